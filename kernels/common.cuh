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

// Eight neighbouring stored values in one vector load (the decode kernel's lanes, VEC dims
// each): the structs carry the alignment that lets the compiler issue 16-byte loads (two for
// float) and one 8-byte load for int8 / fp8 bytes. p must be aligned to the vector's size.
#define VEC 8
struct __align__(16) Float8 { float2 v[4]; };
struct __align__(16) Half8 { __half2 v[4]; };
struct __align__(16) Bfloat8 { __nv_bfloat162 v[4]; };
struct __align__(8) Bytes8 { unsigned int w[2]; };    // bytes 0..3 in w[0] (little-endian), 4..7 in w[1]

template <int FMT> __device__ __forceinline__ void widen8(const float* p, float* x) {
    const Float8 r = *reinterpret_cast<const Float8*>(p);
    for (int i = 0; i < 4; ++i) { x[2 * i] = r.v[i].x; x[2 * i + 1] = r.v[i].y; }
}
template <int FMT> __device__ __forceinline__ void widen8(const __half* p, float* x) {
    const Half8 r = *reinterpret_cast<const Half8*>(p);
    for (int i = 0; i < 4; ++i) { const float2 f = __half22float2(r.v[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
}
template <int FMT> __device__ __forceinline__ void widen8(const __nv_bfloat16* p, float* x) {
    const Bfloat8 r = *reinterpret_cast<const Bfloat8*>(p);
    for (int i = 0; i < 4; ++i) { const float2 f = __bfloat1622float2(r.v[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
}
template <int FMT> __device__ __forceinline__ void widen8(const signed char* p, float* x) {
    const Bytes8 r = *reinterpret_cast<const Bytes8*>(p);
    for (int i = 0; i < 8; ++i) x[i] = (float)(signed char)((r.w[i / 4] >> (8 * (i % 4))) & 0xffu);
}
template <int FMT> __device__ __forceinline__ void widen8(const unsigned char* p, float* x) {
    const Bytes8 r = *reinterpret_cast<const Bytes8*>(p);
    for (int i = 0; i < 8; ++i) x[i] = widen<FMT>((unsigned char)((r.w[i / 4] >> (8 * (i % 4))) & 0xffu));
}
// The first n (< 8, or a row not a multiple of 8 long) of them one by one; the rest are 0.
template <int FMT, typename C> __device__ __forceinline__ void widen_n(const C* p, float* x, int n) {
    for (int i = 0; i < VEC; ++i) x[i] = i < n ? widen<FMT>(p[i]) : 0.f;
}

// The same with the cache's format known only at run time (the decode kernel, which would
// otherwise be compiled once per format): `elem` counts stored values from `cache`; a format's
// branch is the same for every thread. n < 8 (or !vector: a row that is no multiple of 8): the
// first n one by one.
template <int FMT, typename C>
__device__ __forceinline__ void load8_as(const void* cache, long long elem, float* x, int n, bool vector) {
    const C* p = reinterpret_cast<const C*>(cache) + elem;
    if (vector && n == VEC) widen8<FMT>(p, x); else widen_n<FMT>(p, x, n);
}
template <typename T>
__device__ __forceinline__ void load8(const void* cache, long long elem, int fmt, float* x, int n, bool vector) {
    switch (fmt) {
        case KV_INT8: load8_as<KV_INT8, signed char>(cache, elem, x, n, vector); break;
        case KV_FP8_E4M3: load8_as<KV_FP8_E4M3, unsigned char>(cache, elem, x, n, vector); break;
        case KV_FP8_E5M2: load8_as<KV_FP8_E5M2, unsigned char>(cache, elem, x, n, vector); break;
        default: load8_as<KV_FLOAT, T>(cache, elem, x, n, vector);
    }
}
// The scale of one stored token (int8: its own, at index `token` of the block's scales;
// fp8: the layer's, scales[0]; a float cache: none): the format at run time, or (token_scale)
// known when compiled.
__device__ __forceinline__ float scale_of(int fmt, const float* scales, long long token) {
    return fmt == KV_INT8 ? scales[token] : (fmt == KV_FLOAT ? 1.f : scales[0]);
}
template <int FMT> __device__ __forceinline__ float token_scale(const float* scales, long long token) {
    return scale_of(FMT, scales, token);
}

// A float as an fp8 byte: round to nearest even, saturating at the largest finite value.
__device__ __forceinline__ unsigned char narrow_fp8(float x, int fmt) {
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fp8_kind(fmt));
}

// ------------------------------------------------------------------ paged attention
// Shared by the decode kernels (paged_attention.cu) and the prefill kernel (paged_prefill.cu).
#define NUM_WARPS 4     // warps of an attention thread block (kernels/cuda.py NUM_WARPS)
#define GROUP_MAX 8     // query heads of one GQA group a decode thread block serves (kernels/cuda.py)

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
