// Writing new K/V into their slots: the slot-mapping scatter (spec: kernels/reference.py write_kv),
// quantizing on the way for a compressed cache, and block-sparse attention's page metadata.
//
// Cache layout (kernels/layout.py), per layer: (num_blocks, num_kv_heads, block_size, head_dim),
// of the activations' type, or of bytes for kv_format int8 / fp8 (kernels/kv_quant.py), with
// scales: int8 (num_blocks, num_kv_heads, block_size) floats, one per token and head; fp8 one
// float per layer (scales[0]).
//
// write_kv_*: grid = (num_tokens,), block = (128,). Thread block t writes token t's K and V
//   rows (num_kv_heads x head_dim values each) to slot_mapping[t] = block * block_size + offset.
//   A float cache is a plain copy, thread by thread. An int8 cache needs each head's max |x|
//   first: warp w takes heads w, w + 4, ..., reduces the max across its lanes, and writes the
//   codes and the scale.
// update_key_bounds_*: grid = (num_tokens, ceil(num_kv_heads * head_dim / 128)), block = (128,).
//   The tokens written to one block in one call are a run of consecutive slots (a block belongs
//   to one sequence, whose new tokens are consecutive positions). The run's first token leads
//   it: thread i of its block walks the run (at most block_size tokens) for element i of the
//   key row, widening the block's [min, max] in registers and storing them once; a run that
//   starts at a block's first slot starts them afresh, as in kernels/fast/kv_write.py. Other tokens'
//   thread blocks return at once, so no two threads ever write the same bounds.
#include "common.cuh"

template <typename T, typename C, int FMT>
__device__ void write_kv(const T* __restrict__ k, const T* __restrict__ v, C* __restrict__ k_cache,
                         C* __restrict__ v_cache, float* __restrict__ k_scale, float* __restrict__ v_scale,
                         const long long* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                         int block_size, int k_stride, int v_stride) {
    const int token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // a padding row: nothing to write
    const long long block = slot / block_size;
    const int offset = (int)(slot % block_size);
    const int row = num_kv_heads * head_dim;
    if constexpr (FMT == KV_FLOAT) {
        for (int i = threadIdx.x; i < row; i += blockDim.x) {
            const int head = i / head_dim, d = i % head_dim;
            const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_dim + d;
            k_cache[dst] = (C)k[(long long)token * k_stride + i];
            v_cache[dst] = (C)v[(long long)token * v_stride + i];
        }
    } else {
        const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
        const int num_warps = blockDim.x / WARP_SIZE;
        for (int head = warp; head < num_kv_heads; head += num_warps) {   // warp-uniform
            const long long tok = (block * num_kv_heads + head) * block_size + offset;   // (block, head, offset)
            for (int which = 0; which < 2; ++which) {
                const T* x = (which ? v : k) + (long long)token * (which ? v_stride : k_stride) + head * head_dim;
                C* dst = (which ? v_cache : k_cache) + tok * head_dim;
                float* scales = which ? v_scale : k_scale;
                if constexpr (FMT == KV_INT8) {
                    float top = 0.f;
                    for (int d = lane; d < head_dim; d += WARP_SIZE) top = fmaxf(top, fabsf(to_float(x[d])));
                    const float s = warp_max(top) / 127.f;
                    if (lane == 0) scales[tok] = s;
                    for (int d = lane; d < head_dim; d += WARP_SIZE)   // clamped: a tiny scale could round past 127
                        dst[d] = s > 0.f ? (C)fminf(fmaxf(rintf(to_float(x[d]) / s), -127.f), 127.f) : (C)0;
                } else {
                    const float layer = scales[0];
                    for (int d = lane; d < head_dim; d += WARP_SIZE) dst[d] = (C)narrow_fp8(to_float(x[d]) / layer, FMT);
                }
            }
        }
    }
}

// One entry point per activation type; the cache's format is an argument, dispatched here.
template <typename T>
__device__ void write_kv_any(const T* k, const T* v, void* k_cache, void* v_cache, float* k_scale,
                             float* v_scale, const long long* slot_mapping, int num_kv_heads, int head_dim,
                             int block_size, int kv_format, int k_stride, int v_stride) {
    switch (kv_format) {
        case KV_INT8:
            write_kv<T, signed char, KV_INT8>(k, v, (signed char*)k_cache, (signed char*)v_cache, k_scale,
                                              v_scale, slot_mapping, num_kv_heads, head_dim, block_size, k_stride, v_stride);
            break;
        case KV_FP8_E4M3:
            write_kv<T, unsigned char, KV_FP8_E4M3>(k, v, (unsigned char*)k_cache, (unsigned char*)v_cache,
                                                    k_scale, v_scale, slot_mapping, num_kv_heads, head_dim,
                                                    block_size, k_stride, v_stride);
            break;
        case KV_FP8_E5M2:
            write_kv<T, unsigned char, KV_FP8_E5M2>(k, v, (unsigned char*)k_cache, (unsigned char*)v_cache,
                                                    k_scale, v_scale, slot_mapping, num_kv_heads, head_dim,
                                                    block_size, k_stride, v_stride);
            break;
        default:
            write_kv<T, T, KV_FLOAT>(k, v, (T*)k_cache, (T*)v_cache, k_scale, v_scale, slot_mapping,
                                     num_kv_heads, head_dim, block_size, k_stride, v_stride);
    }
}

extern "C" __global__ void write_kv_f32(const float* __restrict__ k, const float* __restrict__ v,
                                        void* __restrict__ k_cache, void* __restrict__ v_cache,
                                        float* __restrict__ k_scale, float* __restrict__ v_scale,
                                        const long long* __restrict__ slot_mapping, int num_kv_heads,
                                        int head_dim, int block_size, int kv_format, int k_stride, int v_stride) {
    write_kv_any<float>(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_kv_heads, head_dim,
                        block_size, kv_format, k_stride, v_stride);
}

extern "C" __global__ void write_kv_f16(const __half* __restrict__ k, const __half* __restrict__ v,
                                        void* __restrict__ k_cache, void* __restrict__ v_cache,
                                        float* __restrict__ k_scale, float* __restrict__ v_scale,
                                        const long long* __restrict__ slot_mapping, int num_kv_heads,
                                        int head_dim, int block_size, int kv_format, int k_stride, int v_stride) {
    write_kv_any<__half>(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_kv_heads, head_dim,
                         block_size, kv_format, k_stride, v_stride);
}

extern "C" __global__ void write_kv_bf16(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                         void* __restrict__ k_cache, void* __restrict__ v_cache,
                                         float* __restrict__ k_scale, float* __restrict__ v_scale,
                                         const long long* __restrict__ slot_mapping, int num_kv_heads,
                                         int head_dim, int block_size, int kv_format, int k_stride, int v_stride) {
    write_kv_any<__nv_bfloat16>(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_kv_heads, head_dim,
                                block_size, kv_format, k_stride, v_stride);
}

template <typename T>
__device__ void update_key_bounds(const T* __restrict__ k, const long long* __restrict__ slot_mapping,
                                  float* __restrict__ key_min, float* __restrict__ key_max, int num_tokens,
                                  int num_kv_heads, int head_dim, int block_size, int k_stride) {
    const int row = num_kv_heads * head_dim;
    const int t0 = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;   // (head, d) of this thread
    const long long slot = slot_mapping[t0];
    if (i >= row || slot < 0) return;
    const bool leads = slot % block_size == 0 || t0 == 0 || slot_mapping[t0 - 1] != slot - 1;
    if (!leads) return;                                    // inside a run another block walks
    const long long at = (slot / block_size) * row + i;    // key_min[block, head, d]
    float lo = slot % block_size == 0 ? INFINITY : key_min[at];
    float hi = slot % block_size == 0 ? -INFINITY : key_max[at];
    for (int t = t0; t < num_tokens && slot_mapping[t] == slot + (t - t0)
                     && (t == t0 || slot_mapping[t] % block_size != 0); ++t) {
        const float x = to_float(k[(long long)t * k_stride + i]);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    key_min[at] = lo;
    key_max[at] = hi;
}

extern "C" __global__ void update_key_bounds_f32(const float* __restrict__ k, const long long* __restrict__ slot_mapping,
                                                 float* __restrict__ key_min, float* __restrict__ key_max,
                                                 int num_tokens, int num_kv_heads, int head_dim, int block_size, int k_stride) {
    update_key_bounds<float>(k, slot_mapping, key_min, key_max, num_tokens, num_kv_heads, head_dim, block_size, k_stride);
}

extern "C" __global__ void update_key_bounds_f16(const __half* __restrict__ k, const long long* __restrict__ slot_mapping,
                                                 float* __restrict__ key_min, float* __restrict__ key_max,
                                                 int num_tokens, int num_kv_heads, int head_dim, int block_size, int k_stride) {
    update_key_bounds<__half>(k, slot_mapping, key_min, key_max, num_tokens, num_kv_heads, head_dim, block_size, k_stride);
}

extern "C" __global__ void update_key_bounds_bf16(const __nv_bfloat16* __restrict__ k,
                                                  const long long* __restrict__ slot_mapping,
                                                  float* __restrict__ key_min, float* __restrict__ key_max,
                                                  int num_tokens, int num_kv_heads, int head_dim, int block_size, int k_stride) {
    update_key_bounds<__nv_bfloat16>(k, slot_mapping, key_min, key_max, num_tokens, num_kv_heads, head_dim, block_size, k_stride);
}
