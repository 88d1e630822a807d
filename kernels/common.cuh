// Shared helpers of the CUDA kernels: warp reductions, float <-> storage type, paired loads,
// and the compressed KV formats (int8 and fp8 bytes widened to floats in registers).
//
// Included by every kernels/*.cu file. Under NVRTC (a real GPU build) it pulls in CUDA's
// half-precision, bfloat16 and fp8 headers; under the CPU test harness (kernels/cuda_harness.py
// compiles the same sources as C++ with kernels/cuda_cpu_shim.h) the shim provides these
// names instead.
//
// Three activation types, one kernel body each (the _f32, _f16 and _bf16 entry points):
// float; __half (IEEE binary16: 11 significant bits, largest 65504); __nv_bfloat16 (8
// significant bits and float's exponent range, largest ~3.4e38: a bf16 checkpoint's
// activations can pass 65504, so they are computed in bf16 rather than squeezed into half).
// Whatever the storage type, the arithmetic is float32; a value is rounded to its storage
// type once, when stored.
#pragma once

#ifndef MINIPAGED_CPU_HARNESS
#include <cuda_bf16.h>
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
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16(x); }  // to nearest even

// Two neighbouring elements in one load (8 bytes for float, 4 for half and bfloat16): the
// vectorised access that lets a warp read a 64-element row in a single 256- or 128-byte transaction.
__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load2(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
}
__device__ __forceinline__ float2 load2(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// ------------------------------------------------------------------ compressed KV blocks
// The storage formats, numbered as kernels/kv_quant.py numbers them. A kernel takes the
// format as an argument and switches once, at its top, to a body compiled for that format.
#define KV_FLOAT 0      // the cache holds the activations' type (float, half or bfloat16)
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
template <int FMT> __device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <int FMT> __device__ __forceinline__ float widen(signed char x) { return (float)x; }
template <int FMT> __device__ __forceinline__ float widen(unsigned char x) {
    return __half2float(__ushort_as_half(__nv_cvt_fp8_to_halfraw(x, fp8_kind(FMT)).x));
}

// Two neighbouring stored values as floats (before their scale).
template <int FMT> __device__ __forceinline__ float2 widen2(const float* p) { return load2(p); }
template <int FMT> __device__ __forceinline__ float2 widen2(const __half* p) { return load2(p); }
template <int FMT> __device__ __forceinline__ float2 widen2(const __nv_bfloat16* p) { return load2(p); }
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

// ------------------------------------------------------------------ paged attention
// Shared by the decode kernels (paged_attention.cu) and the prefill kernel (paged_prefill.cu).
#define NUM_WARPS 4     // warps of an attention thread block (kernels/cuda.py NUM_WARPS)

// The first position a query at position `pos` reads: a sliding window of `window` positions
// (pos - window + 1 .. pos, transformers' mask), or the sequence's first (window 0: full).
// The blocks wholly before it are never read: the block manager may have freed them (-1).
__device__ __forceinline__ int window_start(int pos, int window) {
    return window > 0 ? max(pos - window + 1, 0) : 0;
}

// An attention entry point takes the cache's format as an argument (kv_format) and switches
// on it once: each case is the kernel body compiled for that storage type C.
#define DISPATCH_FORMAT(T, CALL)                                                              \
    switch (kv_format) {                                                                      \
        case KV_INT8: CALL(T, signed char, KV_INT8); break;                                   \
        case KV_FP8_E4M3: CALL(T, unsigned char, KV_FP8_E4M3); break;                         \
        case KV_FP8_E5M2: CALL(T, unsigned char, KV_FP8_E5M2); break;                         \
        default: CALL(T, T, KV_FLOAT);                                                        \
    }
