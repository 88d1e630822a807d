// The CUDA built-ins our kernels use, for running the same .cu sources on a CPU.
//
// kernels/cuda_harness.py compiles a kernel file as C++ with this header forced in front
// (g++ -include cuda_cpu_shim.h -DMINIPAGED_CPU_HARNESS). A launch runs the thread blocks
// of the grid one after another; the threads of a block run at the same time, one OS
// thread per CUDA thread (started once a launch), so that:
//   threadIdx / blockIdx          thread-local variables set by the launcher
//   blockDim / gridDim            the launch's dimensions (one launch at a time)
//   __syncthreads()               a barrier over the block's threads
//   __shared__                    `static`: one copy, seen by all threads of the block
//   __align__(n)                  GCC's aligned attribute (allowed where CUDA puts it)
//   __shfl_xor_sync(mask, v, m)   an exchange through a per-warp buffer between two barriers
//                                 (all 32 lanes of a warp must call it together: full masks)
//   __half / __half2              _Float16 (IEEE binary16, round to nearest like __float2half)
//   __nv_bfloat16 / __nv_bfloat162  a float's upper 16 bits in a struct; __float2bfloat16 rounds
//                                 to nearest even, written out on the bits (cuda_bf16.h's rule)
//   cuda_fp8.h's fp8 bytes        __nv_cvt_float_to_fp8 (round to nearest even, saturating) and
//                                 __nv_cvt_fp8_to_halfraw, written out with frexp / ldexp
// What is not here, a kernel may not use (docs/kernels.md lists it): atomics, dynamic shared
// memory, cooperative groups, textures, warp votes, partial-warp masks.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

typedef _Float16 __half;
struct __half2 {
    __half x, y;
};
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half(float f) { return (__half)f; }
inline float2 __half22float2(__half2 h) { return float2{(float)h.x, (float)h.y}; }

inline __half __ushort_as_half(unsigned short bits) {
    __half h;
    std::memcpy(&h, &bits, sizeof h);
    return h;
}

// ---- cuda_bf16.h: bfloat16 is a float with the low 16 bits of its significand cut off (1 sign,
// 8 exponent, 7 stored significand bits). Only conversions: the kernels compute in float.
struct __nv_bfloat16 {
    unsigned short bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t word = (uint32_t)h.bits << 16;   // the cut-off bits are zeros
    float f;
    std::memcpy(&f, &word, sizeof f);
    return f;
}
// The bfloat16 nearest f, ties to even: add just under half of the dropped part's range
// (0x7FFF), plus one more when the kept part is odd, and let the carry round up. A NaN stays
// a (quiet) NaN; a value past bfloat16's largest rounds to infinity, as on the GPU.
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t word;
    std::memcpy(&word, &f, sizeof word);
    if (std::isnan(f)) return __nv_bfloat16{(unsigned short)((word >> 16) | 0x0040)};
    word += 0x7FFFu + ((word >> 16) & 1u);
    return __nv_bfloat16{(unsigned short)(word >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return float2{__bfloat162float(h.x), __bfloat162float(h.y)};
}

// ---- cuda_fp8.h: the two fp8 formats as bytes, and the two conversions the kernels use
typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
struct __half_raw {
    unsigned short x;
};

namespace cuda_cpu {
struct Fp8Format {
    int mantissa_bits, min_exponent;  // a normal value is 1.m * 2^e with e >= min_exponent
    float largest;                    // the largest finite value
};
inline Fp8Format fp8_format(__nv_fp8_interpretation_t kind) {
    return kind == __NV_E5M2 ? Fp8Format{2, -14, 57344.f} : Fp8Format{3, -6, 448.f};
}
}  // namespace cuda_cpu

// The fp8 byte nearest x (ties to even). Written as arithmetic on the value: the grid of
// representable values around |x| has spacing 2^(e - mantissa bits), where e is |x|'s
// exponent (never below the smallest normal's: subnormals share its spacing).
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                __nv_fp8_interpretation_t kind) {
    const cuda_cpu::Fp8Format f = cuda_cpu::fp8_format(kind);
    const unsigned char sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return sign | 0x7F;                     // NaN in both formats
    float a = std::fabs(x);
    if (saturate == __NV_SATFINITE) a = std::fmin(a, f.largest);
    int e;
    std::frexp(a, &e);                                         // a = m * 2^e, m in [0.5, 1)
    e = std::max(e - 1, f.min_exponent);                       // a = 1.m * 2^e (or subnormal)
    const float spacing = std::ldexp(1.f, e - f.mantissa_bits);
    float rounded = std::nearbyint(a / spacing) * spacing;     // the default mode: to nearest even
    if (saturate == __NV_SATFINITE) rounded = std::fmin(rounded, f.largest);
    if (rounded < std::ldexp(1.f, f.min_exponent))             // a subnormal (or zero): exponent 0
        return sign | (unsigned char)(rounded / std::ldexp(1.f, f.min_exponent - f.mantissa_bits));
    std::frexp(rounded, &e);                                   // rounding may have reached 2^(e+1)
    e -= 1;
    const int mantissa = (int)((std::ldexp(rounded, -e) - 1.f) * (1 << f.mantissa_bits));
    const int biased = e - f.min_exponent + 1;
    return sign | (unsigned char)((biased << f.mantissa_bits) | mantissa);
}

// An fp8 byte as a half's bits (exactly: every fp8 value is a half).
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t byte, __nv_fp8_interpretation_t kind) {
    const cuda_cpu::Fp8Format f = cuda_cpu::fp8_format(kind);
    const int exponent_bits = 7 - f.mantissa_bits;
    const int biased = (byte >> f.mantissa_bits) & ((1 << exponent_bits) - 1);
    const int mantissa = byte & ((1 << f.mantissa_bits) - 1);
    float value;
    const bool e4m3_nan = kind == __NV_E4M3 && (byte & 0x7F) == 0x7F;
    if (e4m3_nan || (kind == __NV_E5M2 && biased == 31))
        value = (kind == __NV_E5M2 && mantissa == 0) ? INFINITY : NAN;
    else if (biased == 0)
        value = std::ldexp((float)mantissa, f.min_exponent - f.mantissa_bits);
    else
        value = std::ldexp(1.f + (float)mantissa / (1 << f.mantissa_bits), biased - 1 + f.min_exponent);
    const __half h = (__half)((byte & 0x80) ? -value : value);
    __half_raw raw;
    std::memcpy(&raw.x, &h, sizeof raw.x);
    return raw;
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::fmaxf;
using std::fminf;
using std::max;
using std::min;
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace cuda_cpu {

constexpr int kWarp = 32;

struct Warp {
    std::barrier<> bar{kWarp};
    uint64_t slots[kWarp];
};

struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline Block* g_block = nullptr;

inline int linear_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

// Run one launch: every block of the grid in turn, all threads of a block at once. The block's
// OS threads are started once per launch and walk the grid together, each block ending at a
// barrier of its own (so no thread starts the next block while another still reads shared
// memory), rather than started afresh for every block: a launch of many blocks costs the
// threads' start-up once.
inline void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
    gridDim = grid;
    blockDim = block;
    const unsigned threads = block.x * block.y * block.z;
    Block b;
    b.bar = std::make_unique<std::barrier<>>(threads);
    std::barrier<> block_done(threads);
    for (unsigned w = 0; w < (threads + kWarp - 1) / kWarp; ++w) b.warps.push_back(std::make_unique<Warp>());
    g_block = &b;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned bz = 0; bz < grid.z; ++bz)
                for (unsigned by = 0; by < grid.y; ++by)
                    for (unsigned bx = 0; bx < grid.x; ++bx) {
                        blockIdx = dim3{bx, by, bz};
                        body();                       // may return early: it still meets the others here
                        block_done.arrive_and_wait();
                    }
        });
    for (auto& th : pool) th.join();
    g_block = nullptr;
}

}  // namespace cuda_cpu

inline void __syncthreads() { cuda_cpu::g_block->bar->arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask: always full*/, T value, int lane_mask) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a type wider than 8 bytes");
    const int t = cuda_cpu::linear_thread();
    cuda_cpu::Warp& w = *cuda_cpu::g_block->warps[t / cuda_cpu::kWarp];
    const int lane = t % cuda_cpu::kWarp;
    std::memcpy(&w.slots[lane], &value, sizeof(T));
    w.bar.arrive_and_wait();  // everyone has written
    T out;
    std::memcpy(&out, &w.slots[lane ^ lane_mask], sizeof(T));
    w.bar.arrive_and_wait();  // everyone has read; the slots may be reused
    return out;
}
