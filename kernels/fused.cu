// Small fused kernels around the matrix products (specs: kernels/reference.py rms_norm,
// rotary, silu_and_mul). Each reads its input once and writes its output once.
//   rms_norm_*      grid = (num_tokens,), block = (128,): one thread block per row
//   rotary_*        grid = (ceil(num_tokens * heads * head_dim / 2 / 256),), block = (256,): in place,
//                   token t's (heads, head_dim) at x + t * row_stride (q or k as a view of the qkv output)
//   silu_and_mul_*  grid = (ceil(num_tokens * ffn / 256),), block = (256,)
// Arithmetic in float32 whatever the storage type.
#include "common.cuh"

template <typename T>
__device__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                         int hidden, float eps) {
    const long long row = (long long)blockIdx.x * hidden;
    float total = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_float(x[row + i]);
        total += v * v;
    }
    // block-wide sum: each warp reduces, then the first warp reduces the warp sums
    __shared__ float s_part[32];
    total = warp_sum(total);
    if (threadIdx.x % WARP_SIZE == 0) s_part[threadIdx.x / WARP_SIZE] = total;
    __syncthreads();
    const int num_warps = blockDim.x / WARP_SIZE;
    total = threadIdx.x < num_warps ? s_part[threadIdx.x] : 0.f;
    if (threadIdx.x < WARP_SIZE) total = warp_sum(total);
    __shared__ float s_inv_rms;
    if (threadIdx.x == 0) s_inv_rms = rsqrtf(total / hidden + eps);
    __syncthreads();
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        store(out + row + i, to_float(x[row + i]) * s_inv_rms * to_float(weight[i]));
}

template <typename T>
__device__ void rotary(T* __restrict__ x, const long long* __restrict__ positions,
                       const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                       int num_tokens, int heads, int head_dim, int row_stride) {
    const int half = head_dim / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // one (token, head, pair)
    if (idx >= (long long)num_tokens * heads * half) return;
    const int i = (int)(idx % half);
    const long long token = idx / half / heads;
    T* row = x + token * row_stride + ((idx / half) % heads) * head_dim;  // (token, head): rows a stride apart
    const long long pos = positions[token];
    const float c = cos_table[pos * half + i], s = sin_table[pos * half + i];
    const float a = to_float(row[i]), b = to_float(row[i + half]);
    store(row + i, a * c - b * s);
    store(row + i + half, b * c + a * s);
}

template <typename T>
__device__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int num_tokens, int ffn) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_tokens * ffn) return;
    const long long token = idx / ffn;
    const int i = (int)(idx % ffn);
    const float g = to_float(gate_up[token * 2 * ffn + i]);
    store(out + idx, g / (1.f + __expf(-g)) * to_float(gate_up[token * 2 * ffn + ffn + i]));
}

extern "C" __global__ void rms_norm_f32(float* __restrict__ out, const float* __restrict__ x,
                                        const float* __restrict__ weight, int hidden, float eps) {
    rms_norm<float>(out, x, weight, hidden, eps);
}

extern "C" __global__ void rms_norm_f16(__half* __restrict__ out, const __half* __restrict__ x,
                                        const __half* __restrict__ weight, int hidden, float eps) {
    rms_norm<__half>(out, x, weight, hidden, eps);
}

extern "C" __global__ void rms_norm_bf16(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,
                                         const __nv_bfloat16* __restrict__ weight, int hidden, float eps) {
    rms_norm<__nv_bfloat16>(out, x, weight, hidden, eps);
}

extern "C" __global__ void rotary_f32(float* __restrict__ x, const long long* __restrict__ positions,
                                      const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                      int num_tokens, int heads, int head_dim, int row_stride) {
    rotary<float>(x, positions, cos_table, sin_table, num_tokens, heads, head_dim, row_stride);
}

extern "C" __global__ void rotary_f16(__half* __restrict__ x, const long long* __restrict__ positions,
                                      const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                      int num_tokens, int heads, int head_dim, int row_stride) {
    rotary<__half>(x, positions, cos_table, sin_table, num_tokens, heads, head_dim, row_stride);
}

extern "C" __global__ void rotary_bf16(__nv_bfloat16* __restrict__ x, const long long* __restrict__ positions,
                                       const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                       int num_tokens, int heads, int head_dim, int row_stride) {
    rotary<__nv_bfloat16>(x, positions, cos_table, sin_table, num_tokens, heads, head_dim, row_stride);
}

extern "C" __global__ void silu_and_mul_f32(float* __restrict__ out, const float* __restrict__ gate_up,
                                            int num_tokens, int ffn) {
    silu_and_mul<float>(out, gate_up, num_tokens, ffn);
}

extern "C" __global__ void silu_and_mul_f16(__half* __restrict__ out, const __half* __restrict__ gate_up,
                                            int num_tokens, int ffn) {
    silu_and_mul<__half>(out, gate_up, num_tokens, ffn);
}

extern "C" __global__ void silu_and_mul_bf16(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ gate_up,
                                             int num_tokens, int ffn) {
    silu_and_mul<__nv_bfloat16>(out, gate_up, num_tokens, ffn);
}
