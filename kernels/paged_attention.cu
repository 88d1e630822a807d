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
// A thread block serves one KV head of one sequence (one partition of it) and the query heads of
// that KV head's GQA group, up to GROUP of them (a larger group takes several thread blocks, each
// reading the KV head again): every K and V row is read from memory once for them all.
// Inside a warp a token takes LANES lanes, LANES = head_dim / VEC rounded up to a power of two,
// each lane VEC = 8 consecutive dims loaded as one vector (16 bytes of half or bfloat16, two of
// 16 for float, 8 bytes of int8 or fp8): at head_dim 64 a warp reads 4 tokens at once, at 128
// two, at 256 one, and no lane is masked off (a head_dim that is not a power of two times 8 leaves
// the lanes past it idle; one that is not a multiple of 8 is read element by element). Each query
// head's score is summed over the token's LANES lanes; each group of LANES lanes keeps its own
// online softmax over its tokens, merged through shuffles at the end, then across warps through
// shared memory.

template <typename T, int GROUP>
__device__ void paged_decode(T* __restrict__ out, float* __restrict__ part_out,
                             float* __restrict__ part_max, float* __restrict__ part_sum,
                             const T* __restrict__ q, const void* __restrict__ k_cache,
                             const void* __restrict__ v_cache, int fmt, const float* __restrict__ k_scale,
                             const float* __restrict__ v_scale, const unsigned char* __restrict__ chosen,
                             const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                             int max_blocks, int num_heads, int num_kv_heads, int head_dim, int block_size,
                             int partition_size, int sparse, int window, int q_stride, float scale, float* s_max,
                             float* s_sum, float* s_acc) {
    const int group = num_heads / num_kv_heads;                        // query heads per KV head
    const int chunks = (group + GROUP - 1) / GROUP;                    // thread blocks per KV head
    const int kv_head = blockIdx.x / chunks;
    const int head0 = kv_head * group + (blockIdx.x % chunks) * GROUP;  // this block's first query head
    const int heads = min(GROUP, (kv_head + 1) * group - head0);       // ... and how many it serves
    const int seq = blockIdx.y, part = blockIdx.z, num_parts = gridDim.z;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    int lanes = 1;                                                     // a token's lanes
    while (lanes * VEC < head_dim) lanes <<= 1;
    const int sub = lane / lanes, tokens_at_once = WARP_SIZE / lanes;
    const int d0 = (lane % lanes) * VEC;                               // this lane's first dim
    const int n = max(0, min(VEC, head_dim - d0));                     // ... and how many it has
    const bool vector = head_dim % VEC == 0;                           // whole, aligned vectors
    const int seq_len = seq_lens[seq];
    const int lo = window_start(seq_len - 1, window);        // the first position the query reads
    const int start = lo - lo % block_size + part * partition_size;   // partitions from lo's block on
    const int end = min(seq_len, start + partition_size);

    // This lane's dims of each query head (scaled) and of its running output.
    float qv[GROUP][VEC], acc[GROUP][VEC], m[GROUP], l[GROUP];
    for (int g = 0; g < GROUP; ++g) {
        float x[VEC];
        const long long q_row = (long long)seq * q_stride + (head0 + min(g, heads - 1)) * head_dim + d0;
        load8_as<KV_FLOAT, T>(q, q_row, x, n, vector && q_stride % VEC == 0);
        for (int i = 0; i < VEC; ++i) {
            qv[g][i] = x[i] * scale;
            acc[g][i] = 0.f;
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    const int* table = block_tables + (long long)seq * max_blocks;
    for (int b = start / block_size + warp; b * block_size < end; b += NUM_WARPS) {
        unsigned reads = (1u << GROUP) - 1;             // the heads that read this block
        if (sparse) {                                   // block-sparse: those that chose it
            reads = 0;
            for (int g = 0; g < heads; ++g)
                reads |= (unsigned)(chosen[((long long)seq * num_heads + head0 + g) * max_blocks + b] != 0) << g;
            if (!reads) continue;                       // the same for every lane of the warp
        }
        const long long first_token = ((long long)table[b] * num_kv_heads + kv_head) * block_size;
        const int first = b * block_size;
        const int last = min(end, first + block_size);
        for (int p0 = max(first, lo); p0 < last; p0 += tokens_at_once) {   // a window's first block: from lo
            const int pos = p0 + sub;
            const bool valid = pos < last;
            const long long token = first_token + (pos - first);   // (block, kv head, offset)
            float kx[VEC];
            load8<T>(k_cache, token * head_dim + d0, fmt, kx, valid ? n : 0, vector);
            float s[GROUP];
            for (int g = 0; g < GROUP; ++g) {
                s[g] = 0.f;
                for (int i = 0; i < VEC; ++i) s[g] += qv[g][i] * kx[i];
            }
            for (int mask = lanes / 2; mask > 0; mask >>= 1)      // the token's lanes: q . k
                for (int g = 0; g < GROUP; ++g) s[g] += __shfl_xor_sync(FULL_MASK, s[g], mask);
            if (!valid) continue;                                 // no shuffle below
            const float ks = scale_of(fmt, k_scale, token), vs = scale_of(fmt, v_scale, token);
            float vx[VEC];
            load8<T>(v_cache, token * head_dim + d0, fmt, vx, n, vector);
            for (int g = 0; g < GROUP; ++g) {
                if (g >= heads || !((reads >> g) & 1u)) continue;
                const float score = s[g] * ks;
                const float m_new = fmaxf(m[g], score);
                const float correction = __expf(m[g] - m_new), p = __expf(score - m_new);
                l[g] = l[g] * correction + p;
                const float pv = p * vs;
                for (int i = 0; i < VEC; ++i) acc[g][i] = acc[g][i] * correction + pv * vx[i];
                m[g] = m_new;
            }
        }
    }

    // The warp's token groups hold the same dims of different tokens: merge them (shuffles).
    for (int offset = lanes; offset < WARP_SIZE; offset <<= 1) {
        for (int g = 0; g < GROUP; ++g) {
            const float m_other = __shfl_xor_sync(FULL_MASK, m[g], offset);
            const float l_other = __shfl_xor_sync(FULL_MASK, l[g], offset);
            const float big = fmaxf(m[g], m_other);
            const float mine = m[g] == -INFINITY ? 0.f : __expf(m[g] - big);
            const float theirs = m_other == -INFINITY ? 0.f : __expf(m_other - big);
            for (int i = 0; i < VEC; ++i) {
                const float a = __shfl_xor_sync(FULL_MASK, acc[g][i], offset);
                acc[g][i] = acc[g][i] * mine + a * theirs;
            }
            l[g] = l[g] * mine + l_other * theirs;
            m[g] = big;
        }
    }
    // Then the warps, through shared memory (s_max, s_sum: (NUM_WARPS, GROUP_MAX); s_acc:
    // (NUM_WARPS, GROUP_MAX, MAX_HEAD_DIM)): out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M).
    if (sub == 0) {
        for (int g = 0; g < heads; ++g) {
            if (lane == 0) {
                s_max[warp * GROUP_MAX + g] = m[g];
                s_sum[warp * GROUP_MAX + g] = l[g];
            }
            for (int i = 0; i < n; ++i) s_acc[(warp * GROUP_MAX + g) * MAX_HEAD_DIM + d0 + i] = acc[g][i];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < heads * head_dim; idx += blockDim.x) {
        const int g = idx / head_dim, d = idx % head_dim;
        float big = -INFINITY;
        for (int w = 0; w < NUM_WARPS; ++w) big = fmaxf(big, s_max[w * GROUP_MAX + g]);
        float total = 0.f, o = 0.f;
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float mw = s_max[w * GROUP_MAX + g];
            const float weight = mw == -INFINITY ? 0.f : __expf(mw - big);
            total += s_sum[w * GROUP_MAX + g] * weight;
            o += s_acc[(w * GROUP_MAX + g) * MAX_HEAD_DIM + d] * weight;
        }
        o = total > 0.f ? o / total : 0.f;   // an empty partition (past the end) contributes 0
        const long long row = (long long)seq * num_heads + head0 + g;
        if (num_parts == 1) {
            store(out + row * head_dim + d, o);
        } else {
            part_out[(row * num_parts + part) * head_dim + d] = o;
            if (d == 0) {
                part_max[row * num_parts + part] = big;
                part_sum[row * num_parts + part] = total;
            }
        }
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
                                    int q_stride, float scale) {
    const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
    if (query_start_loc[seq + 1] - query_start_loc[seq] != 1) return;   // not decoding: dense
    const int kv_head = head / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int n = (seq_lens[seq] + block_size - 1) / block_size;         // the context's blocks
    const T* q_row = q + (long long)query_start_loc[seq] * q_stride + head * head_dim;
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
    __shared__ float s_max[NUM_WARPS * GROUP_MAX], s_sum[NUM_WARPS * GROUP_MAX];              \
    __shared__ float s_acc[NUM_WARPS * GROUP_MAX * MAX_HEAD_DIM];

#define DECODE_BODY(T, G)                                                                     \
    paged_decode<T, G>(out, part_out, part_max, part_sum, q, k_cache, v_cache, kv_format, k_scale, \
                       v_scale, chosen, block_tables, seq_lens, max_blocks, num_heads, num_kv_heads, \
                       head_dim, block_size, partition_size, sparse, window, q_stride, scale, s_max, s_sum, s_acc)

// The group width (query heads a thread block serves) kernels/cuda.py chose: 1 (no GQA), 4, or 8.
// The cache's format is read at run time (load8): one body per width, not one per format too.
#define DECODE(T)                                                                             \
    if (group_width == 1) { DECODE_BODY(T, 1); }                                              \
    else if (group_width == 4) { DECODE_BODY(T, 4); }                                         \
    else { DECODE_BODY(T, GROUP_MAX); }

extern "C" __global__ void paged_decode_f32(float* __restrict__ out, float* __restrict__ part_out,
                                            float* __restrict__ part_max, float* __restrict__ part_sum,
                                            const float* __restrict__ q, const void* __restrict__ k_cache,
                                            const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                            const float* __restrict__ v_scale,
                                            const unsigned char* __restrict__ chosen,
                                            const int* __restrict__ block_tables,
                                            const int* __restrict__ seq_lens, int max_blocks, int num_heads,
                                            int num_kv_heads, int head_dim, int block_size,
                                            int partition_size, int kv_format, int sparse, int window,
                                            int group_width, int q_stride, float scale) {
    DECODE_SHARED
    DECODE(float)
}

extern "C" __global__ void paged_decode_f16(__half* __restrict__ out, float* __restrict__ part_out,
                                            float* __restrict__ part_max, float* __restrict__ part_sum,
                                            const __half* __restrict__ q, const void* __restrict__ k_cache,
                                            const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                            const float* __restrict__ v_scale,
                                            const unsigned char* __restrict__ chosen,
                                            const int* __restrict__ block_tables,
                                            const int* __restrict__ seq_lens, int max_blocks, int num_heads,
                                            int num_kv_heads, int head_dim, int block_size,
                                            int partition_size, int kv_format, int sparse, int window,
                                            int group_width, int q_stride, float scale) {
    DECODE_SHARED
    DECODE(__half)
}

extern "C" __global__ void paged_decode_bf16(__nv_bfloat16* __restrict__ out, float* __restrict__ part_out,
                                             float* __restrict__ part_max, float* __restrict__ part_sum,
                                             const __nv_bfloat16* __restrict__ q, const void* __restrict__ k_cache,
                                             const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                             const float* __restrict__ v_scale,
                                             const unsigned char* __restrict__ chosen,
                                             const int* __restrict__ block_tables,
                                             const int* __restrict__ seq_lens, int max_blocks, int num_heads,
                                             int num_kv_heads, int head_dim, int block_size,
                                             int partition_size, int kv_format, int sparse, int window,
                                             int group_width, int q_stride, float scale) {
    DECODE_SHARED
    DECODE(__nv_bfloat16)
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
                                                   int q_stride, float scale) {
    paged_select_blocks<float>(chosen, bound, q, key_min, key_max, block_tables, seq_lens, query_start_loc,
                               max_blocks, num_kv_heads, head_dim, block_size, keep, q_stride, scale);
}

extern "C" __global__ void paged_select_blocks_f16(unsigned char* __restrict__ chosen, float* __restrict__ bound,
                                                   const __half* __restrict__ q, const float* __restrict__ key_min,
                                                   const float* __restrict__ key_max,
                                                   const int* __restrict__ block_tables,
                                                   const int* __restrict__ seq_lens,
                                                   const int* __restrict__ query_start_loc, int max_blocks,
                                                   int num_kv_heads, int head_dim, int block_size, int keep,
                                                   int q_stride, float scale) {
    paged_select_blocks<__half>(chosen, bound, q, key_min, key_max, block_tables, seq_lens, query_start_loc,
                                max_blocks, num_kv_heads, head_dim, block_size, keep, q_stride, scale);
}

extern "C" __global__ void paged_select_blocks_bf16(unsigned char* __restrict__ chosen, float* __restrict__ bound,
                                                    const __nv_bfloat16* __restrict__ q,
                                                    const float* __restrict__ key_min,
                                                    const float* __restrict__ key_max,
                                                    const int* __restrict__ block_tables,
                                                    const int* __restrict__ seq_lens,
                                                    const int* __restrict__ query_start_loc, int max_blocks,
                                                    int num_kv_heads, int head_dim, int block_size, int keep,
                                                    int q_stride, float scale) {
    paged_select_blocks<__nv_bfloat16>(chosen, bound, q, key_min, key_max, block_tables, seq_lens, query_start_loc,
                                       max_blocks, num_kv_heads, head_dim, block_size, keep, q_stride, scale);
}
