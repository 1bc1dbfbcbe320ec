// The sampling tail on the device: repetition / presence / frequency penalties applied in place
// to the sampled logits rows, the K best candidates of each row, and the row's log-sum-exp.
// The CPU reference is host/src/backend/cpu/sample.rs; these kernels reproduce it exactly in f32.
//
// Order. Every element gets the 64-bit key of `order_key`: high half the "descending key"
// (the float's bits mapped so that ascending u32 order is descending logit, NaN taken as -inf),
// low half the token id. Keys are unique, and the K smallest keys are the K candidates, already
// in output order. Ties at equal logits go to the lower id because the id is part of the key.
//
// Algorithm (radix select, then a small sort):
//   1. Radix select over the 64-bit key, 8 bits a pass from the top, histogram in shared memory
//      (warp-aggregated atomics). Each pass keeps the bin holding the K-th smallest key; it stops
//      as soon as that bin is taken whole, so the selection is the predicate
//      `(key >> shift) <= prefix`, which holds for exactly K keys. Without ties at the threshold
//      it stops after the four passes over the logit half; ties go on into the id half.
//   2. Collect the K selected keys (unordered) and sort them with a bitonic network (ascending,
//      min to the lower index at every exchange, so a non-power-of-two count needs no padding).
//
// Split path (K <= 1024): `sample_chunk_topk` gives every row `parts` CTAs, each holding a
// chunk of the row in shared memory: it applies the penalties that fall in its chunk, writes
// the chunk's partial log-sum-exp (max, sum of exp(x - max)) and its own top min(K, chunk) keys
// (padded with all-ones sentinels) to scratch. `sample_merge` then selects and sorts the K best
// of the row's parts * K keys (cached in shared memory when they fit) and combines the partials.
// Row path (larger K): `sample_row_topk`, one 1024-thread CTA per row, selects straight from the
// row in global memory and sorts in shared memory, or in place in the output columns (token ids
// in `cand_tokens`, descending keys parked in `cand_logits`) when K keys do not fit.
// The planner is `sample.rs`; block sizes are fixed (256 / 512 / 1024 threads) and no launch
// asks for more than 46 KiB of dynamic shared memory.
//
// Learned from (no code copied): the radix-select top-k of RAFT/cuVS ("AIR top-k", Zhang et
// al., SC'23: histogram passes over the key digits, keep the bin of the K-th element, early
// stop), and FlashInfer's sampling kernel docs (one CTA group per row, block-wide reductions
// for the log-sum-exp, penalties applied before selection).

#include "common.cuh"

#define SAMPLE_FULL 0xffffffffu
#define SAMPLE_SENTINEL 0xffffffffffffffffull

// The high half of `order_key`: ascending order is descending logit, NaN ranks as -inf.
__device__ __forceinline__ u32 desc_key(float x) {
    u32 b = x != x ? 0xff800000u : __float_as_uint(x);
    u32 ascending = (b >> 31) ? ~b : (b | 0x80000000u);
    return ~ascending;
}

// The inverse of `desc_key` (NaN comes back as -inf).
__device__ __forceinline__ float key_value(u32 dk) {
    u32 ascending = ~dk;
    return __uint_as_float((ascending >> 31) ? (ascending & 0x7fffffffu) : ~ascending);
}

__device__ __forceinline__ bool finite_f32(float x) { return x > -CHIMERA_INF && x < CHIMERA_INF; }

// The selection a radix select ends with: the keys with `(key >> shift) <= prefix`.
struct Selection {
    u64 prefix;
    u32 shift;
};

__device__ __forceinline__ bool selected(u64 key, Selection s) {
    return (key >> s.shift) <= s.prefix;
}

// Shared memory of the block-wide helpers below.
struct SelectSmem {
    u32 hist[256];
    u32 pick[3];  // bin, keys in lower bins, keys in the bin
    u32 count;
    float red[32];
};

// Key sources: `key(j)` for j < count.
struct ChunkKeys {  // a chunk of a row held as descending keys, ids from `base`
    const u32* dk;
    u32 base;
    __device__ __forceinline__ u64 key(u32 j) const { return ((u64)dk[j] << 32) | (base + j); }
};
struct StoredKeys {  // keys as they are (shared or global memory)
    const u64* keys;
    __device__ __forceinline__ u64 key(u32 j) const { return keys[j]; }
};
struct RowKeys {  // a logits row in global memory (read plainly: penalties were just written)
    const float* x;
    __device__ __forceinline__ u64 key(u32 j) const { return ((u64)desc_key(x[j]) << 32) | j; }
};

// Key buffers for collecting and sorting: `get(i)`, `set(i, key)`.
struct KeyBuf {
    u64* keys;
    __device__ __forceinline__ u64 get(u32 i) const { return keys[i]; }
    __device__ __forceinline__ void set(u32 i, u64 k) const { keys[i] = k; }
};
struct SplitBuf {  // the output columns: ids in `tok`, descending keys parked in `val`
    u32* tok;
    float* val;
    __device__ __forceinline__ u64 get(u32 i) const {
        return ((u64)__float_as_uint(val[i]) << 32) | tok[i];
    }
    __device__ __forceinline__ void set(u32 i, u64 k) const {
        tok[i] = (u32)k;
        val[i] = __uint_as_float((u32)(k >> 32));
    }
};

// Finds the selection of the `need` smallest of `count` unique keys (1 <= need <= count; extra
// all-ones sentinels may repeat, as long as `need` real keys exist). Every thread gets it.
template <class Src>
__device__ Selection radix_select(const Src& src, u32 count, u32 need, SelectSmem& sm) {
    const u32 lane = threadIdx.x & 31;
    u64 prefix = 0;
    for (int d = 56; d >= 0; d -= 8) {
        for (u32 b = threadIdx.x; b < 256; b += blockDim.x) sm.hist[b] = 0;
        __syncthreads();
        // Uniform trip count: whole warps take part in the match and the vote.
        for (u32 base = 0; base < count; base += blockDim.x) {
            u32 j = base + threadIdx.x;
            bool live = false;
            u32 bin = 0;
            if (j < count) {
                u64 key = src.key(j);
                live = d == 56 || (key >> (d + 8)) == prefix;
                bin = (u32)(key >> d) & 255u;
            }
            if (__any_sync(SAMPLE_FULL, live)) {
                u32 peers = __match_any_sync(SAMPLE_FULL, live ? bin : 0xffffffffu);
                if (live && lane == (u32)(__ffs(peers) - 1))
                    atomicAdd(&sm.hist[bin], __popc(peers));
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // The bin where the running count reaches `need`: lane l scans bins 8l..8l+7.
            u32 h[8], total = 0;
#pragma unroll
            for (int q = 0; q < 8; q++) {
                h[q] = sm.hist[lane * 8 + q];
                total += h[q];
            }
            u32 incl = total;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u32 t = __shfl_up_sync(SAMPLE_FULL, incl, o);
                if (lane >= (u32)o) incl += t;
            }
            u32 c = incl - total;
            if (c < need && need <= incl) {
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    if (c + h[q] >= need) {
                        sm.pick[0] = lane * 8 + q;
                        sm.pick[1] = c;
                        sm.pick[2] = h[q];
                        break;
                    }
                    c += h[q];
                }
            }
        }
        __syncthreads();
        u32 bin = sm.pick[0], below = sm.pick[1], in_bin = sm.pick[2];
        need -= below;
        prefix = (prefix << 8) | bin;
        // The bin is taken whole: everything at or below the prefix is exactly the selection.
        if (in_bin == need) return Selection{prefix, (u32)d};
    }
    return Selection{prefix, 0};  // not reached for unique keys: the last bin holds one key
}

// Writes the selected keys of `src` to `out` at slots 0.. (in no particular order; never past
// `cap`, which only a broken contract would reach) and returns after a barrier.
template <class Src, class Buf>
__device__ void collect(const Src& src, u32 count, Selection sel, const Buf& out, u32 cap,
                        SelectSmem& sm) {
    const u32 lane = threadIdx.x & 31;
    if (threadIdx.x == 0) sm.count = 0;
    __syncthreads();
    for (u32 base = 0; base < count; base += blockDim.x) {
        u32 j = base + threadIdx.x;
        bool take = false;
        u64 key = 0;
        if (j < count) {
            key = src.key(j);
            take = selected(key, sel);
        }
        u32 ballot = __ballot_sync(SAMPLE_FULL, take);
        if (ballot) {
            u32 leader = __ffs(ballot) - 1, slot = 0;
            if (lane == leader) slot = atomicAdd(&sm.count, __popc(ballot));
            slot = __shfl_sync(SAMPLE_FULL, slot, leader);
            slot += __popc(ballot & ((1u << lane) - 1));
            if (take && slot < cap) out.set(slot, key);
        }
    }
    __syncthreads();
}

// Sorts buf[0..n) ascending (unique keys). Bitonic network in its one-direction form: the first
// exchange of each merge pairs i with its mirror, every exchange puts the minimum at the lower
// index, so positions >= n behave as +inf padding and are skipped. Ends with a barrier.
template <class Buf>
__device__ void bitonic_sort(const Buf& buf, u32 n) {
    u32 p = 1;
    while (p < n) p <<= 1;
    for (u32 size = 2; size <= p; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 t = threadIdx.x; t < p / 2; t += blockDim.x) {
                u32 i = ((t & ~(stride - 1)) << 1) | (t & (stride - 1));
                u32 l = stride == size >> 1 ? i ^ (size - 1) : i + stride;
                if (l < n) {
                    u64 a = buf.get(i), b = buf.get(l);
                    if (b < a) {
                        buf.set(i, b);
                        buf.set(l, a);
                    }
                }
            }
            __syncthreads();
        }
    }
}

// The CPU's `apply_penalties` on the row's history tokens in [lo, hi) (hi <= vocab), with its
// exact f32 operations (no contraction into FMA): repetition, then frequency and presence, then
// the entry's bias. An entry whose count is BIAS_ONLY is in neither prompt nor output and gets
// only its bias. History tokens are distinct, so one thread per entry writes without races.
#define BIAS_ONLY 0xffffffffu
__device__ void apply_penalties(float* x, u32 lo, u32 hi, u32 i, const float* repetition,
                                const float* presence, const float* frequency,
                                const u32* hist_offsets, const u32* hist_tokens,
                                const u32* hist_counts, const float* hist_bias) {
    float rep = repetition[i], pres = presence[i], freq = frequency[i];
    bool rep_on = rep != 1.0f && rep > 0.0f;
    bool counts_on = pres != 0.0f || freq != 0.0f;
    u32 end = hist_offsets[i + 1];
    for (u32 j = hist_offsets[i] + threadIdx.x; j < end; j += blockDim.x) {
        u32 t = hist_tokens[j];
        if (t < lo || t >= hi) continue;
        float v = x[t];
        u32 c = hist_counts[j];
        bool seen = c != BIAS_ONLY;
        if (rep_on && seen) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
        if (counts_on && seen && c > 0)
            v = __fsub_rn(v, __fadd_rn(__fmul_rn(freq, __uint2float_rn(c)), pres));
        float b = hist_bias[j];
        if (b != 0.0f) v = __fadd_rn(v, b);
        x[t] = v;
    }
}

// The CPU's `log_sum_exp` semantics from the max over the non-NaN values, whether a NaN was
// seen, and (for a finite max) the sum of exp(x - max).
__device__ __forceinline__ float lse_from(float mx, bool nan, float sum) {
    if (!finite_f32(mx)) return mx;
    return nan ? CHIMERA_NAN : mx + logf(sum);
}

// Writes sorted keys as candidates: ids, and each id's penalised logit as it is in the row.
__device__ void write_candidates(const u64* sorted, u32 k, const float* x, u32* tokens,
                                 float* logits_out) {
    for (u32 j = threadIdx.x; j < k; j += blockDim.x) {
        u32 t = (u32)sorted[j];
        tokens[j] = t;
        logits_out[j] = x[t];
    }
}

#define CHUNK_THREADS 256
#define CHUNK_UNROLL 8

// Split path, stage 1. Grid (n * parts): block b is part b % parts of sampled row b / parts,
// the ids [part * chunk, min(part * chunk + chunk, vocab)). Dynamic shared memory: chunk * 4.
// Writes part_keys[b * k ..][k] (its min(k, len) best keys, then sentinels) and
// part_stats[b * 2 ..][2] (max over non-NaN values, sum of exp(x - max) or NaN if a NaN was
// seen; only where the row wants its log-sum-exp).
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) sample_chunk_topk(
    float* logits, const u32* sample_rows, const float* repetition, const float* presence,
    const float* frequency, const u32* want_lse, const u32* hist_offsets, const u32* hist_tokens,
    const u32* hist_counts, const float* hist_bias, u32 vocab, u32 chunk, u32 parts, u32 k,
    u64* part_keys,
    float* part_stats) { CHIMERA_PDL_ENTRY();
    extern __shared__ u32 chunk_dk[];
    __shared__ SelectSmem sm;
    const u32 i = blockIdx.x / parts, part = blockIdx.x % parts;
    const u32 lo = part * chunk, len = min(chunk, vocab - lo);
    float* x = logits + (u64)sample_rows[i] * vocab;

    apply_penalties(x, lo, lo + len, i, repetition, presence, frequency, hist_offsets,
                    hist_tokens, hist_counts, hist_bias);
    __syncthreads();  // the penalised values are read below by other threads

    float mx = -CHIMERA_INF;
    int nan = 0;
    for (u32 base = 0; base < len; base += CHUNK_UNROLL * CHUNK_THREADS) {
        float v[CHUNK_UNROLL];
#pragma unroll
        for (int u = 0; u < CHUNK_UNROLL; u++) {
            u32 j = base + u * CHUNK_THREADS + threadIdx.x;
            v[u] = j < len ? x[lo + j] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < CHUNK_UNROLL; u++) {
            u32 j = base + u * CHUNK_THREADS + threadIdx.x;
            if (j < len) {
                chunk_dk[j] = desc_key(v[u]);
                if (v[u] != v[u])
                    nan = 1;
                else
                    mx = fmaxf(mx, v[u]);
            }
        }
    }
    __syncthreads();

    if (want_lse[i]) {
        mx = block_max(mx, sm.red);
        nan = __syncthreads_or(nan);
        float sum = 0.0f;
        if (finite_f32(mx) && !nan) {
            for (u32 j = threadIdx.x; j < len; j += CHUNK_THREADS)
                sum += expf(key_value(chunk_dk[j]) - mx);
            sum = block_sum(sum, sm.red);
        }
        if (threadIdx.x == 0) {
            part_stats[2 * (u64)blockIdx.x] = mx;
            part_stats[2 * (u64)blockIdx.x + 1] = nan ? CHIMERA_NAN : sum;
        }
    }

    const u32 need = min(k, len);
    ChunkKeys src{chunk_dk, lo};
    Selection sel = radix_select(src, len, need, sm);
    u64* out = part_keys + (u64)blockIdx.x * k;
    collect(src, len, sel, KeyBuf{out}, need, sm);
    for (u32 j = need + threadIdx.x; j < k; j += CHUNK_THREADS) out[j] = SAMPLE_SENTINEL;
}

#define MERGE_THREADS 512

template <class Src>
__device__ void merge_select(const Src& src, u32 count, u32 k, u64* sorted, SelectSmem& sm) {
    Selection sel = radix_select(src, count, k, sm);
    collect(src, count, sel, KeyBuf{sorted}, k, sm);
}

// Split path, stage 2. Grid (n), one block a sampled row. Dynamic shared memory: k * 8, plus
// parts * k * 8 when `cache` (the row's part keys are copied to shared memory first).
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) sample_merge(
    const float* logits, const u32* sample_rows, const u32* want_lse, u32 vocab, u32 parts,
    u32 k, u32 cache, const u64* part_keys, const float* part_stats, u32* cand_tokens,
    float* cand_logits, float* lse) { CHIMERA_PDL_ENTRY();
    extern __shared__ u64 merge_keys[];
    __shared__ SelectSmem sm;
    const u32 i = blockIdx.x, count = parts * k;
    const u64* keys = part_keys + (u64)i * count;
    u64* sorted = merge_keys;

    if (cache) {
        u64* cached = merge_keys + k;
        for (u32 j = threadIdx.x; j < count; j += MERGE_THREADS) cached[j] = keys[j];
        __syncthreads();
        merge_select(StoredKeys{cached}, count, k, sorted, sm);
    } else {
        merge_select(StoredKeys{keys}, count, k, sorted, sm);
    }
    bitonic_sort(KeyBuf{sorted}, k);
    const float* x = logits + (u64)sample_rows[i] * vocab;
    write_candidates(sorted, k, x, cand_tokens + (u64)i * k, cand_logits + (u64)i * k);

    if (threadIdx.x < 32) {
        float value = 0.0f;
        if (want_lse[i]) {
            const float* st = part_stats + 2 * (u64)i * parts;
            float mx = -CHIMERA_INF;
            for (u32 s = threadIdx.x; s < parts; s += 32) mx = fmaxf(mx, st[2 * s]);
            mx = warp_max(mx);
            value = mx;
            if (finite_f32(mx)) {
                // Parts whose max is -inf hold 0 (or NaN) and scale by exp(-inf) = 0.
                float sum = 0.0f;
                for (u32 s = threadIdx.x; s < parts; s += 32)
                    sum += st[2 * s + 1] * expf(st[2 * s] - mx);
                value = mx + logf(warp_sum(sum));
            }
        }
        if (threadIdx.x == 0) lse[i] = value;
    }
}

#define ROW_THREADS 1024

// Row path. Grid (n), one block a sampled row. Dynamic shared memory: k * 8 when `sort_in_smem`,
// else 0 (the output columns serve as the sort buffer).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) sample_row_topk(
    float* logits, const u32* sample_rows, const float* repetition, const float* presence,
    const float* frequency, const u32* want_lse, const u32* hist_offsets, const u32* hist_tokens,
    const u32* hist_counts, const float* hist_bias, u32 vocab, u32 k, u32 sort_in_smem,
    u32* cand_tokens,
    float* cand_logits, float* lse) { CHIMERA_PDL_ENTRY();
    extern __shared__ u64 row_keys[];
    __shared__ SelectSmem sm;
    const u32 i = blockIdx.x;
    float* x = logits + (u64)sample_rows[i] * vocab;

    apply_penalties(x, 0, vocab, i, repetition, presence, frequency, hist_offsets, hist_tokens,
                    hist_counts, hist_bias);
    __syncthreads();

    if (want_lse[i]) {
        float mx = -CHIMERA_INF;
        int nan = 0;
        for (u32 j = threadIdx.x; j < vocab; j += ROW_THREADS) {
            float v = x[j];
            if (v != v)
                nan = 1;
            else
                mx = fmaxf(mx, v);
        }
        mx = block_max(mx, sm.red);
        nan = __syncthreads_or(nan);
        float sum = 0.0f;
        if (finite_f32(mx) && !nan) {
            for (u32 j = threadIdx.x; j < vocab; j += ROW_THREADS) sum += expf(x[j] - mx);
            sum = block_sum(sum, sm.red);
        }
        if (threadIdx.x == 0) lse[i] = lse_from(mx, nan, sum);
    } else if (threadIdx.x == 0) {
        lse[i] = 0.0f;
    }

    RowKeys src{x};
    Selection sel = radix_select(src, vocab, k, sm);
    u32* tokens = cand_tokens + (u64)i * k;
    float* values = cand_logits + (u64)i * k;
    if (sort_in_smem) {
        collect(src, vocab, sel, KeyBuf{row_keys}, k, sm);
        bitonic_sort(KeyBuf{row_keys}, k);
        write_candidates(row_keys, k, x, tokens, values);
    } else {
        SplitBuf buf{tokens, values};
        collect(src, vocab, sel, buf, k, sm);
        bitonic_sort(buf, k);
        for (u32 j = threadIdx.x; j < k; j += ROW_THREADS) values[j] = x[tokens[j]];
    }
}

// Token masks of constrained rows (grammars), applied before the penalties: for sampled row
// `blockIdx.y` with a mask (`mask_of[row] != SAMPLE_FULL`), every token whose bit is clear in
// its `words`-word mask gets a logit of -inf. One thread per mask word (32 tokens); a word with
// every bit set is skipped. Rows without a mask return at once. The CPU reference is
// `apply_mask` in host/src/backend/cpu/sample.rs.
extern "C" __global__ void __launch_bounds__(256) sample_apply_masks(
    float* __restrict__ logits,
    const u32* __restrict__ sample_rows,
    const u32* __restrict__ mask_of,
    const u32* __restrict__ masks,
    u32 vocab,
    u32 words) { CHIMERA_PDL_ENTRY();
    const u32 i = blockIdx.y;
    const u32 m = mask_of[i];
    const u32 w = blockIdx.x * blockDim.x + threadIdx.x;
    if (m == SAMPLE_FULL || w >= words) return;
    const u32 bits = masks[(u64)m * words + w];
    if (bits == SAMPLE_FULL) return;
    float* x = logits + (u64)sample_rows[i] * vocab;
    const u32 base = w * 32u;
    const u32 end = min(base + 32u, vocab);
    for (u32 t = base; t < end; ++t) {
        if (!((bits >> (t - base)) & 1u)) x[t] = -CHIMERA_INF;
    }
}
