// Paged attention of many queries a sequence: prompts, prompt chunks, prefix-cache hits, and
// mixed batches (spec: kernels/reference.py paged_attention). The decode kernels, one query a
// sequence, are in paged_attention.cu.
//
// Caches, per layer: (num_blocks, num_kv_heads, block_size, head_dim); block_tables (S, max_blocks).
//   paged_prefill_*  a flattened batch of query tokens. grid = (num_tiles, num_heads),
//                    block = NUM_WARPS * 32. A tile is up to QUERY_TILE queries of one sequence
//                    (tiles: (W, 2) int64 (sequence, first query row), kernels/cuda.py); the
//                    thread block loads each KV position the tile reads into shared memory once,
//                    KV_SUBTILE positions at a time, and every warp reuses it for its queries.
// A sliding window (window > 0): the query at position p reads p - window + 1 .. p. The tile
// stages positions from its first query's window start on, so a block wholly before every
// query's window is never looked up (its table entry may be -1: freed); each query skips the
// staged positions before its own window start.
// Block-sparse decode (sparse = 1): a sequence of this batch whose one new token decodes reads
// only the blocks paged_select_blocks marked in `chosen` (S, heads, max_blocks).
// Compressed caches (kv_format int8 / fp8, common.cuh): each byte is widened, and times its
// scale, as it is staged in shared memory.
// Requirements: head_dim even and <= MAX_HEAD_DIM; block_size a power of two.
#include "common.cuh"

#define QUERY_TILE 16                              // queries per thread block (kernels/cuda.py)
#define QUERIES_PER_WARP (QUERY_TILE / NUM_WARPS)
#define KV_SUBTILE 16                              // KV positions staged in shared memory at once

template <typename T, typename C, int FMT>
__device__ void paged_prefill(T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ k_cache,
                              const C* __restrict__ v_cache, const float* __restrict__ k_scale,
                              const float* __restrict__ v_scale, const unsigned char* __restrict__ chosen,
                              const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                              const int* __restrict__ query_start_loc, const long long* __restrict__ tiles,
                              int max_blocks, int num_kv_heads, int head_dim, int block_size, int sparse,
                              int window, int q_stride, float scale, float (*s_k)[MAX_HEAD_DIM],
                              float (*s_v)[MAX_HEAD_DIM]) {
    // tiles on x (up to 2^31 - 1 of them), heads on y
    const int head = blockIdx.y, num_heads = gridDim.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int seq = (int)tiles[2 * blockIdx.x], t0 = (int)tiles[2 * blockIdx.x + 1];
    const int seq_start = query_start_loc[seq], seq_end = query_start_loc[seq + 1];
    const int t1 = min(t0 + QUERY_TILE, seq_end);
    const int first_pos = seq_lens[seq] - (seq_end - seq_start) + (t0 - seq_start);
    const int last_pos = first_pos + (t1 - t0) - 1;

    // Warp w owns queries t0 + w, t0 + w + NUM_WARPS, ... of the tile.
    float qv[QUERIES_PER_WARP][2 * MAX_PAIRS], acc[QUERIES_PER_WARP][2 * MAX_PAIRS];
    float m[QUERIES_PER_WARP], l[QUERIES_PER_WARP];
    for (int j = 0; j < QUERIES_PER_WARP; ++j) {
        const int t = t0 + warp + j * NUM_WARPS;
        for (int i = 0; i < MAX_PAIRS; ++i) {
            const int d = 64 * i + 2 * lane;
            float2 x = (t < t1 && d < head_dim) ? load2(q + (long long)t * q_stride + head * head_dim + d)
                                                : make_float2(0.f, 0.f);
            qv[j][2 * i] = x.x * scale;
            qv[j][2 * i + 1] = x.y * scale;
            acc[j][2 * i] = acc[j][2 * i + 1] = 0.f;
        }
        m[j] = -INFINITY;
        l[j] = 0.f;
    }

    // s_k, s_v (KV_SUBTILE, MAX_HEAD_DIM): the staged keys and values, in shared memory
    const int* table = block_tables + (long long)seq * max_blocks;
    // a sequence whose one new token decodes (in a mixed batch) reads only its chosen blocks
    const bool skip_blocks = sparse && seq_end - seq_start == 1;
    const unsigned char* keep = chosen + ((long long)seq * num_heads + head) * max_blocks;
    for (int sub = window_start(first_pos, window); sub <= last_pos; sub += KV_SUBTILE) {
        // Stage positions sub .. sub + KV_SUBTILE - 1 (through the block table) for all warps.
        const int count = min(KV_SUBTILE, last_pos + 1 - sub);
        for (int i = threadIdx.x; i < count * head_dim; i += blockDim.x) {
            const int pos = sub + i / head_dim, d = i % head_dim;
            if (skip_blocks && !keep[pos / block_size]) continue;   // never read: not staged
            const long long token = ((long long)table[pos / block_size] * num_kv_heads + kv_head) * block_size
                                    + pos % block_size;
            s_k[i / head_dim][d] = widen<FMT>(k_cache[token * head_dim + d]) * token_scale<FMT>(k_scale, token);
            s_v[i / head_dim][d] = widen<FMT>(v_cache[token * head_dim + d]) * token_scale<FMT>(v_scale, token);
        }
        __syncthreads();
        for (int j = 0; j < QUERIES_PER_WARP; ++j) {
            const int t = t0 + warp + j * NUM_WARPS;
            const int qpos = first_pos + (t - t0);
            if (t >= t1) continue;                                       // warp-uniform: whole warp skips
            const int from = max(window_start(qpos, window) - sub, 0);   // its window: later staged rows only
            const int visible = min(count, qpos - sub + 1);              // causal: positions <= qpos
            for (int o = from; o < visible; ++o) {
                if (skip_blocks && !keep[(sub + o) / block_size]) continue;   // warp-uniform
                float s = 0.f;
                for (int i = 0; i < MAX_PAIRS; ++i) {
                    const int d = 64 * i + 2 * lane;
                    if (d < head_dim) {  // one 8-byte read: no bank conflict between lanes l and l + 16
                        const float2 kk = *reinterpret_cast<const float2*>(&s_k[o][d]);
                        s += qv[j][2 * i] * kk.x + qv[j][2 * i + 1] * kk.y;
                    }
                }
                s = warp_sum(s);
                const float m_new = fmaxf(m[j], s);
                const float correction = __expf(m[j] - m_new), p = __expf(s - m_new);
                l[j] = l[j] * correction + p;
                for (int i = 0; i < MAX_PAIRS; ++i) {
                    const int d = 64 * i + 2 * lane;
                    if (d < head_dim) {
                        const float2 vv = *reinterpret_cast<const float2*>(&s_v[o][d]);
                        acc[j][2 * i] = acc[j][2 * i] * correction + p * vv.x;
                        acc[j][2 * i + 1] = acc[j][2 * i + 1] * correction + p * vv.y;
                    }
                }
                m[j] = m_new;
            }
        }
        __syncthreads();  // before the next sub-tile overwrites shared memory
    }
    for (int j = 0; j < QUERIES_PER_WARP; ++j) {
        const int t = t0 + warp + j * NUM_WARPS;
        if (t >= t1) continue;
        T* o_row = out + ((long long)t * num_heads + head) * head_dim;
        for (int i = 0; i < MAX_PAIRS; ++i) {
            const int d = 64 * i + 2 * lane;
            if (d < head_dim) {
                store(o_row + d, acc[j][2 * i] / l[j]);
                store(o_row + d + 1, acc[j][2 * i + 1] / l[j]);
            }
        }
    }
}

// ------------------------------------------------------------------------------ entry points
// One per activation type (float, half, bfloat16). Shared memory is declared here, once, and
// handed to whichever body DISPATCH_FORMAT runs (declared inside the template, each of the
// four instantiations would reserve its own). Read as float2 (8-byte loads): aligned to 16.

#define PREFILL_SHARED                                                                        \
    __shared__ __align__(16) float s_k[KV_SUBTILE][MAX_HEAD_DIM];                             \
    __shared__ __align__(16) float s_v[KV_SUBTILE][MAX_HEAD_DIM];

#define PREFILL(T, C, FMT)                                                                    \
    paged_prefill<T, C, FMT>(out, q, (const C*)k_cache, (const C*)v_cache, k_scale, v_scale, chosen, \
                             block_tables, seq_lens, query_start_loc, tiles, max_blocks, num_kv_heads, \
                             head_dim, block_size, sparse, window, q_stride, scale, s_k, s_v)

extern "C" __global__ void paged_prefill_f32(float* __restrict__ out, const float* __restrict__ q,
                                             const void* __restrict__ k_cache, const void* __restrict__ v_cache,
                                             const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                             const unsigned char* __restrict__ chosen,
                                             const int* __restrict__ block_tables,
                                             const int* __restrict__ seq_lens,
                                             const int* __restrict__ query_start_loc,
                                             const long long* __restrict__ tiles, int max_blocks,
                                             int num_kv_heads, int head_dim, int block_size, int kv_format,
                                             int sparse, int window, int q_stride, float scale) {
    PREFILL_SHARED
    DISPATCH_FORMAT(float, PREFILL)
}

extern "C" __global__ void paged_prefill_f16(__half* __restrict__ out, const __half* __restrict__ q,
                                             const void* __restrict__ k_cache, const void* __restrict__ v_cache,
                                             const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                             const unsigned char* __restrict__ chosen,
                                             const int* __restrict__ block_tables,
                                             const int* __restrict__ seq_lens,
                                             const int* __restrict__ query_start_loc,
                                             const long long* __restrict__ tiles, int max_blocks,
                                             int num_kv_heads, int head_dim, int block_size, int kv_format,
                                             int sparse, int window, int q_stride, float scale) {
    PREFILL_SHARED
    DISPATCH_FORMAT(__half, PREFILL)
}

extern "C" __global__ void paged_prefill_bf16(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
                                              const void* __restrict__ k_cache, const void* __restrict__ v_cache,
                                              const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                              const unsigned char* __restrict__ chosen,
                                              const int* __restrict__ block_tables,
                                              const int* __restrict__ seq_lens,
                                              const int* __restrict__ query_start_loc,
                                              const long long* __restrict__ tiles, int max_blocks,
                                              int num_kv_heads, int head_dim, int block_size, int kv_format,
                                              int sparse, int window, int q_stride, float scale) {
    PREFILL_SHARED
    DISPATCH_FORMAT(__nv_bfloat16, PREFILL)
}
