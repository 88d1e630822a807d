// Paged attention of one query a sequence: decoding (spec: kernels/reference.py paged_attention).
// Many queries a sequence (prompts, chunks, prefix hits) go to paged_prefill.cu.
//
// Caches, per layer: (num_blocks, num_kv_heads, block_size, head_dim); block_tables (S, max_blocks).
//   paged_decode_*   one query per sequence. grid = (num_heads, num_seqs, num_partitions),
//                    block = NUM_WARPS * 32 threads. Warps take the KV blocks of the partition
//                    in turn (warp w: blocks w, w + NUM_WARPS, ...) and keep an online softmax;
//                    the warps then merge through shared memory. With one partition the result
//                    is final; with several (split-K, for long contexts) each writes a partial
//                    result that paged_decode_reduce merges.
//   paged_decode_reduce_*  grid = (num_heads, num_seqs), block = 128.
//   paged_select_blocks_*  block-sparse decode (Quest): grid = (num_heads, num_seqs), block = 128.
//                    Scores every block of a one-query sequence's context by the most its keys
//                    could score, sum_d max(q_d * min_d, q_d * max_d) (warp per block), then marks
//                    the first, the last and the keep - 2 best of the others in `chosen`
//                    (S, heads, max_blocks): a block's rank is the number of blocks that beat it
//                    (a higher bound, or an equal one earlier), one thread per block: O(n^2)
//                    comparisons per head, over bounds held in shared memory up to 4096 blocks
//                    (64K tokens at block size 16; beyond, in the global scratch).
//                    The decode and prefill kernels then skip the blocks not marked.
// A sliding window (window > 0): the query at position p = seq_len - 1 reads p - window + 1 .. p.
// The partitions then cover the span from the block holding the window's first position on, so
// blocks wholly before the window are never looked up (their table entries may be -1: freed),
// and kernels/cuda.py launches only the partitions that span needs. (Block-sparse decode with a
// window is refused there.)
// Compressed caches (kv_format int8 / fp8, common.cuh): the kernel reads one byte per value and
// widens it in registers; int8's per-token scales multiply each score and each value's weight,
// fp8's layer scale the same.
// Requirements: head_dim even and <= MAX_HEAD_DIM; block_size a power of two; the partition
// size a multiple of block_size.
#include "common.cuh"

#define SELECT_SHARED_BLOCKS 4096                  // block bounds ranked in shared memory (16 KiB)

// ------------------------------------------------------------------------------ decode

template <typename T, typename C, int FMT>
__device__ void paged_decode(T* __restrict__ out, float* __restrict__ part_out,
                             float* __restrict__ part_max, float* __restrict__ part_sum,
                             const T* __restrict__ q, const C* __restrict__ k_cache,
                             const C* __restrict__ v_cache, const float* __restrict__ k_scale,
                             const float* __restrict__ v_scale, const unsigned char* __restrict__ chosen,
                             const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                             int max_blocks, int num_kv_heads, int head_dim, int block_size,
                             int partition_size, int sparse, int window, float scale, float* s_max, float* s_sum,
                             float (*s_acc)[MAX_HEAD_DIM]) {
    const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
    const int num_heads = gridDim.x, num_parts = gridDim.z;
    const int kv_head = head / (num_heads / num_kv_heads);   // GQA: heads share a KV head
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int seq_len = seq_lens[seq];
    const int lo = window_start(seq_len - 1, window);        // the first position the query reads
    const int start = lo - lo % block_size + part * partition_size;   // partitions from lo's block on
    const int end = min(seq_len, start + partition_size);

    // This lane's dims of the (scaled) query and of the running output.
    float qv[2 * MAX_PAIRS], acc[2 * MAX_PAIRS];
    const T* q_row = q + ((long long)seq * num_heads + head) * head_dim;
    for (int i = 0; i < MAX_PAIRS; ++i) {
        const int d = 64 * i + 2 * lane;
        float2 x = d < head_dim ? load2(q_row + d) : make_float2(0.f, 0.f);
        qv[2 * i] = x.x * scale;
        qv[2 * i + 1] = x.y * scale;
        acc[2 * i] = acc[2 * i + 1] = 0.f;
    }
    float m = -INFINITY, l = 0.f;  // online softmax: running max and running sum of exp
    const int* table = block_tables + (long long)seq * max_blocks;
    const unsigned char* keep = chosen + ((long long)seq * num_heads + head) * max_blocks;
    for (int b = start / block_size + warp; b * block_size < end; b += NUM_WARPS) {
        if (sparse && !keep[b]) continue;    // block-sparse: a block this head does not read
        const long long first_token = ((long long)table[b] * num_kv_heads + kv_head) * block_size;
        const int first = b * block_size;
        const int last = min(end, first + block_size);
        for (int pos = max(first, lo); pos < last; ++pos) {     // a window's first block: from lo
            const long long token = first_token + (pos - first);   // (block, kv head, offset)
            const C* k_row = k_cache + token * head_dim;
            float s = 0.f;
            for (int i = 0; i < MAX_PAIRS; ++i) {
                const int d = 64 * i + 2 * lane;
                if (d < head_dim) {
                    float2 kk = widen2<FMT>(k_row + d);
                    s += qv[2 * i] * kk.x + qv[2 * i + 1] * kk.y;
                }
            }
            s = warp_sum(s) * token_scale<FMT>(k_scale, token);  // every lane now holds q . k
            const float m_new = fmaxf(m, s);
            const float correction = __expf(m - m_new), p = __expf(s - m_new);
            l = l * correction + p;
            const float pv = p * token_scale<FMT>(v_scale, token);
            const C* v_row = v_cache + token * head_dim;
            for (int i = 0; i < MAX_PAIRS; ++i) {
                const int d = 64 * i + 2 * lane;
                if (d < head_dim) {
                    float2 vv = widen2<FMT>(v_row + d);
                    acc[2 * i] = acc[2 * i] * correction + pv * vv.x;
                    acc[2 * i + 1] = acc[2 * i + 1] * correction + pv * vv.y;
                }
            }
            m = m_new;
        }
    }

    // Merge the warps through shared memory (s_max, s_sum: (NUM_WARPS,), s_acc: (NUM_WARPS,
    // MAX_HEAD_DIM)): out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M).
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
    }
    for (int i = 0; i < MAX_PAIRS; ++i) {
        const int d = 64 * i + 2 * lane;
        if (d < head_dim) {
            s_acc[warp][d] = acc[2 * i];
            s_acc[warp][d + 1] = acc[2 * i + 1];
        }
    }
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < NUM_WARPS; ++w) big = fmaxf(big, s_max[w]);
    float total = 0.f;
    float weight[NUM_WARPS];
    for (int w = 0; w < NUM_WARPS; ++w) {
        weight[w] = s_max[w] == -INFINITY ? 0.f : __expf(s_max[w] - big);
        total += s_sum[w] * weight[w];
    }
    const long long row = (long long)seq * num_heads + head;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < NUM_WARPS; ++w) o += s_acc[w][d] * weight[w];
        o = total > 0.f ? o / total : 0.f;   // an empty partition (past the end) contributes 0
        if (num_parts == 1) {
            store(out + row * head_dim + d, o);
        } else {
            part_out[(row * num_parts + part) * head_dim + d] = o;
        }
    }
    if (num_parts > 1 && threadIdx.x == 0) {
        part_max[row * num_parts + part] = big;
        part_sum[row * num_parts + part] = total;
    }
}

template <typename T>
__device__ void paged_decode_reduce(T* __restrict__ out, const float* __restrict__ part_out,
                                    const float* __restrict__ part_max,
                                    const float* __restrict__ part_sum, int num_parts, int head_dim) {
    const long long row = (long long)blockIdx.y * gridDim.x + blockIdx.x;  // (seq, head)
    float big = -INFINITY;
    for (int p = 0; p < num_parts; ++p) big = fmaxf(big, part_max[row * num_parts + p]);
    float total = 0.f;
    for (int p = 0; p < num_parts; ++p) {
        const float mp = part_max[row * num_parts + p];
        total += mp == -INFINITY ? 0.f : part_sum[row * num_parts + p] * __expf(mp - big);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        for (int p = 0; p < num_parts; ++p) {
            const float mp = part_max[row * num_parts + p];
            if (mp != -INFINITY)
                o += part_out[(row * num_parts + p) * head_dim + d] * part_sum[row * num_parts + p] *
                     __expf(mp - big);
        }
        store(out + row * head_dim + d, o / total);
    }
}

// ------------------------------------------------------------------------------ block-sparse selection

template <typename T>
__device__ void paged_select_blocks(unsigned char* __restrict__ chosen, float* __restrict__ bound,
                                    const T* __restrict__ q, const float* __restrict__ key_min,
                                    const float* __restrict__ key_max, const int* __restrict__ block_tables,
                                    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
                                    int max_blocks, int num_kv_heads, int head_dim, int block_size, int keep,
                                    float scale) {
    const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
    if (query_start_loc[seq + 1] - query_start_loc[seq] != 1) return;   // not decoding: dense
    const int kv_head = head / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int n = (seq_lens[seq] + block_size - 1) / block_size;         // the context's blocks
    const T* q_row = q + ((long long)query_start_loc[seq] * num_heads + head) * head_dim;
    const int* table = block_tables + (long long)seq * max_blocks;
    const long long row = (long long)seq * num_heads + head;
    // the bounds, in shared memory when they fit (every thread reads all of them below)
    __shared__ float s_score[SELECT_SHARED_BLOCKS];
    float* score = n <= SELECT_SHARED_BLOCKS ? s_score : bound + row * max_blocks;
    unsigned char* mark = chosen + row * max_blocks;
    for (int j = warp; j < n; j += num_warps) {                          // a warp per block
        const float* lo = key_min + ((long long)table[j] * num_kv_heads + kv_head) * head_dim;
        const float* hi = key_max + ((long long)table[j] * num_kv_heads + kv_head) * head_dim;
        float s = 0.f;
        for (int d = lane; d < head_dim; d += WARP_SIZE) {
            const float x = to_float(q_row[d]) * scale;
            s += fmaxf(x * lo[d], x * hi[d]);
        }
        s = warp_sum(s);
        if (lane == 0) score[j] = s;
    }
    __syncthreads();   // every bound written (global memory: visible to the block after the barrier)
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        bool take = j == 0 || j == n - 1 || keep >= n;
        if (!take) {
            int rank = 0;                                                // middle blocks that beat j
            for (int i = 1; i < n - 1; ++i) rank += score[i] > score[j] || (score[i] == score[j] && i < j);
            take = rank < keep - 2;
        }
        mark[j] = take;
    }
}

// ------------------------------------------------------------------------------ entry points
// One per activation type (float, half, bfloat16); the cache's format is an argument
// (kv_format, DISPATCH_FORMAT in common.cuh). Shared memory is declared here, once, and handed
// to whichever body runs (declared inside the template, each of the four instantiations would
// reserve its own).

#define DECODE_SHARED                                                                         \
    __shared__ float s_max[NUM_WARPS], s_sum[NUM_WARPS];                                      \
    __shared__ float s_acc[NUM_WARPS][MAX_HEAD_DIM];

#define DECODE(T, C, FMT)                                                                     \
    paged_decode<T, C, FMT>(out, part_out, part_max, part_sum, q, (const C*)k_cache,          \
                            (const C*)v_cache, k_scale, v_scale, chosen, block_tables, seq_lens, \
                            max_blocks, num_kv_heads, head_dim, block_size, partition_size, sparse, window, \
                            scale, s_max, s_sum, s_acc)

extern "C" __global__ void paged_decode_f32(float* __restrict__ out, float* __restrict__ part_out,
                                            float* __restrict__ part_max, float* __restrict__ part_sum,
                                            const float* __restrict__ q, const void* __restrict__ k_cache,
                                            const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                            const float* __restrict__ v_scale,
                                            const unsigned char* __restrict__ chosen,
                                            const int* __restrict__ block_tables,
                                            const int* __restrict__ seq_lens, int max_blocks,
                                            int num_kv_heads, int head_dim, int block_size,
                                            int partition_size, int kv_format, int sparse, int window, float scale) {
    DECODE_SHARED
    DISPATCH_FORMAT(float, DECODE)
}

extern "C" __global__ void paged_decode_f16(__half* __restrict__ out, float* __restrict__ part_out,
                                            float* __restrict__ part_max, float* __restrict__ part_sum,
                                            const __half* __restrict__ q, const void* __restrict__ k_cache,
                                            const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                            const float* __restrict__ v_scale,
                                            const unsigned char* __restrict__ chosen,
                                            const int* __restrict__ block_tables,
                                            const int* __restrict__ seq_lens, int max_blocks,
                                            int num_kv_heads, int head_dim, int block_size,
                                            int partition_size, int kv_format, int sparse, int window, float scale) {
    DECODE_SHARED
    DISPATCH_FORMAT(__half, DECODE)
}

extern "C" __global__ void paged_decode_bf16(__nv_bfloat16* __restrict__ out, float* __restrict__ part_out,
                                             float* __restrict__ part_max, float* __restrict__ part_sum,
                                             const __nv_bfloat16* __restrict__ q, const void* __restrict__ k_cache,
                                             const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                             const float* __restrict__ v_scale,
                                             const unsigned char* __restrict__ chosen,
                                             const int* __restrict__ block_tables,
                                             const int* __restrict__ seq_lens, int max_blocks,
                                             int num_kv_heads, int head_dim, int block_size,
                                             int partition_size, int kv_format, int sparse, int window, float scale) {
    DECODE_SHARED
    DISPATCH_FORMAT(__nv_bfloat16, DECODE)
}

extern "C" __global__ void paged_decode_reduce_f32(float* __restrict__ out, const float* __restrict__ part_out,
                                                   const float* __restrict__ part_max,
                                                   const float* __restrict__ part_sum, int num_parts,
                                                   int head_dim) {
    paged_decode_reduce<float>(out, part_out, part_max, part_sum, num_parts, head_dim);
}

extern "C" __global__ void paged_decode_reduce_f16(__half* __restrict__ out, const float* __restrict__ part_out,
                                                   const float* __restrict__ part_max,
                                                   const float* __restrict__ part_sum, int num_parts,
                                                   int head_dim) {
    paged_decode_reduce<__half>(out, part_out, part_max, part_sum, num_parts, head_dim);
}

extern "C" __global__ void paged_decode_reduce_bf16(__nv_bfloat16* __restrict__ out, const float* __restrict__ part_out,
                                                    const float* __restrict__ part_max,
                                                    const float* __restrict__ part_sum, int num_parts,
                                                    int head_dim) {
    paged_decode_reduce<__nv_bfloat16>(out, part_out, part_max, part_sum, num_parts, head_dim);
}

extern "C" __global__ void paged_select_blocks_f32(unsigned char* __restrict__ chosen, float* __restrict__ bound,
                                                   const float* __restrict__ q, const float* __restrict__ key_min,
                                                   const float* __restrict__ key_max,
                                                   const int* __restrict__ block_tables,
                                                   const int* __restrict__ seq_lens,
                                                   const int* __restrict__ query_start_loc, int max_blocks,
                                                   int num_kv_heads, int head_dim, int block_size, int keep,
                                                   float scale) {
    paged_select_blocks<float>(chosen, bound, q, key_min, key_max, block_tables, seq_lens, query_start_loc,
                               max_blocks, num_kv_heads, head_dim, block_size, keep, scale);
}

extern "C" __global__ void paged_select_blocks_f16(unsigned char* __restrict__ chosen, float* __restrict__ bound,
                                                   const __half* __restrict__ q, const float* __restrict__ key_min,
                                                   const float* __restrict__ key_max,
                                                   const int* __restrict__ block_tables,
                                                   const int* __restrict__ seq_lens,
                                                   const int* __restrict__ query_start_loc, int max_blocks,
                                                   int num_kv_heads, int head_dim, int block_size, int keep,
                                                   float scale) {
    paged_select_blocks<__half>(chosen, bound, q, key_min, key_max, block_tables, seq_lens, query_start_loc,
                                max_blocks, num_kv_heads, head_dim, block_size, keep, scale);
}

extern "C" __global__ void paged_select_blocks_bf16(unsigned char* __restrict__ chosen, float* __restrict__ bound,
                                                    const __nv_bfloat16* __restrict__ q,
                                                    const float* __restrict__ key_min,
                                                    const float* __restrict__ key_max,
                                                    const int* __restrict__ block_tables,
                                                    const int* __restrict__ seq_lens,
                                                    const int* __restrict__ query_start_loc, int max_blocks,
                                                    int num_kv_heads, int head_dim, int block_size, int keep,
                                                    float scale) {
    paged_select_blocks<__nv_bfloat16>(chosen, bound, q, key_min, key_max, block_tables, seq_lens, query_start_loc,
                                       max_blocks, num_kv_heads, head_dim, block_size, keep, scale);
}
