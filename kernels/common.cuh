// Shared helpers of the CUDA kernels: warp reductions, float <-> storage type, paired loads.
//
// Included by every kernels/*.cu file. Under NVRTC (a real GPU build) it pulls in CUDA's
// half-precision header; under the CPU test harness (kernels/cuda_harness.py compiles the
// same sources as C++ with kernels/cuda_cpu_shim.h) the shim provides these names instead.
#pragma once

#ifndef MINIPAGED_CPU_HARNESS
#include <cuda_fp16.h>
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
