// Writing new K/V into their slots: the slot-mapping scatter (spec: kernels/reference.py write_kv).
//
// Cache layout (kernels/layout.py), per layer: (num_blocks, num_kv_heads, block_size, head_dim).
// Launch: grid = (num_tokens,), block = (128,). Thread block t copies token t's K and V rows
// (num_kv_heads x head_dim values each) to slot_mapping[t] = block * block_size + offset.
#include "common.cuh"

template <typename T>
__device__ void write_kv(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                         T* __restrict__ v_cache, const long long* __restrict__ slot_mapping,
                         int num_kv_heads, int head_dim, int block_size) {
    const int token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // a padding row: nothing to write
    const long long block = slot / block_size;
    const int offset = (int)(slot % block_size);
    const int row = num_kv_heads * head_dim;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        const int head = i / head_dim, d = i % head_dim;
        const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_dim + d;
        k_cache[dst] = k[(long long)token * row + i];
        v_cache[dst] = v[(long long)token * row + i];
    }
}

extern "C" __global__ void write_kv_f32(const float* __restrict__ k, const float* __restrict__ v,
                                        float* __restrict__ k_cache, float* __restrict__ v_cache,
                                        const long long* __restrict__ slot_mapping, int num_kv_heads,
                                        int head_dim, int block_size) {
    write_kv<float>(k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim, block_size);
}

extern "C" __global__ void write_kv_f16(const __half* __restrict__ k, const __half* __restrict__ v,
                                        __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                                        const long long* __restrict__ slot_mapping, int num_kv_heads,
                                        int head_dim, int block_size) {
    write_kv<__half>(k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim, block_size);
}
