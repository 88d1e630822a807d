// Shared helpers of the CUDA kernels: warp reductions, float <-> storage type, paired loads,
// and the compressed KV formats (int8 and fp8 bytes widened to floats in registers).
//
// Included by every kernels/*.cu file. Under NVRTC (a real GPU build) it pulls in CUDA's
// half-precision and fp8 headers; under the CPU test harness (kernels/cuda_harness.py
// compiles the same sources as C++ with kernels/cuda_cpu_shim.h) the shim provides these
// names instead.
#pragma once

#ifndef MINIPAGED_CPU_HARNESS
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

// Largest head_dim the attention kernels accept: each lane keeps head_dim / 32 values.
#define MAX_HEAD_DIM 256
#define MAX_PAIRS (MAX_HEAD_DIM / 64)  // a lane owns dims 2*lane + 64*i and the one after

__device__ __forceinline__ float warp_sum(float x) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask >>= 1) x += __shfl_xor_sync(FULL_MASK, x, mask);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, mask));
    return x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half(x); }

// Two neighbouring elements in one load (8 bytes for float, 4 for half): the vectorised
// access that lets a warp read a 64-element row in a single 256- or 128-byte transaction.
__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load2(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
}

// ------------------------------------------------------------------ compressed KV blocks
// The storage formats, numbered as kernels/kv_quant.py numbers them. A kernel takes the
// format as an argument and switches once, at its top, to a body compiled for that format.
#define KV_FLOAT 0      // the cache holds the activations' type (float or half)
#define KV_INT8 1       // int8 codes, one float scale per (token, KV head) beside the block
#define KV_FP8_E4M3 2   // fp8 e4m3 bytes times the layer's scale
#define KV_FP8_E5M2 3   // fp8 e5m2 bytes times the layer's scale

__device__ __forceinline__ __nv_fp8_interpretation_t fp8_kind(int fmt) {
    return fmt == KV_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3;
}

// A stored K/V value as a float, before its scale: floats pass, int8 codes are cast, fp8
// bytes become halves (one cvt instruction on sm_89 and later) and then floats.
template <int FMT> __device__ __forceinline__ float widen(float x) { return x; }
template <int FMT> __device__ __forceinline__ float widen(__half x) { return __half2float(x); }
template <int FMT> __device__ __forceinline__ float widen(signed char x) { return (float)x; }
template <int FMT> __device__ __forceinline__ float widen(unsigned char x) {
    return __half2float(__ushort_as_half(__nv_cvt_fp8_to_halfraw(x, fp8_kind(FMT)).x));
}

// Two neighbouring stored values as floats (before their scale).
template <int FMT> __device__ __forceinline__ float2 widen2(const float* p) { return load2(p); }
template <int FMT> __device__ __forceinline__ float2 widen2(const __half* p) { return load2(p); }
template <int FMT, typename C> __device__ __forceinline__ float2 widen2(const C* p) {
    return make_float2(widen<FMT>(p[0]), widen<FMT>(p[1]));
}

// The scale of one stored token (int8: its own, at index `token` of the block's scales;
// fp8: the layer's, scales[0]; a float cache: none).
template <int FMT> __device__ __forceinline__ float token_scale(const float* scales, long long token) {
    return FMT == KV_INT8 ? scales[token] : (FMT == KV_FLOAT ? 1.f : scales[0]);
}

// A float as an fp8 byte: round to nearest even, saturating at the largest finite value.
__device__ __forceinline__ unsigned char narrow_fp8(float x, int fmt) {
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fp8_kind(fmt));
}
