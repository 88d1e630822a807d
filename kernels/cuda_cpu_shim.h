// The CUDA built-ins our kernels use, for running the same .cu sources on a CPU.
//
// kernels/cuda_harness.py compiles a kernel file as C++ with this header forced in front
// (g++ -include cuda_cpu_shim.h -DMINIPAGED_CPU_HARNESS). A launch runs the thread blocks
// of the grid one after another; the threads of a block run at the same time, one OS
// thread per CUDA thread, so that:
//   threadIdx / blockIdx          thread-local variables set by the launcher
//   blockDim / gridDim            the launch's dimensions (one launch at a time)
//   __syncthreads()               a barrier over the block's threads
//   __shared__                    `static`: one copy, seen by all threads of the block
//   __align__(n)                  GCC's aligned attribute (allowed where CUDA puts it)
//   __shfl_xor_sync(mask, v, m)   an exchange through a per-warp buffer between two barriers
//                                 (all 32 lanes of a warp must call it together: full masks)
//   __half / __half2              _Float16 (IEEE binary16, round to nearest like __float2half)
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

// Run one launch: every block of the grid in turn, all threads of a block at once.
inline void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
    gridDim = grid;
    blockDim = block;
    const unsigned threads = block.x * block.y * block.z;
    Block b;
    b.bar = std::make_unique<std::barrier<>>(threads);
    for (unsigned w = 0; w < (threads + kWarp - 1) / kWarp; ++w) b.warps.push_back(std::make_unique<Warp>());
    g_block = &b;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (unsigned t = 0; t < threads; ++t)
                    pool.emplace_back([&, t] {
                        blockIdx = dim3{bx, by, bz};
                        threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                        body();
                    });
                for (auto& th : pool) th.join();
            }
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
