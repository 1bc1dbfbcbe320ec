// Shared by the attention sources (attention.cu, and attention_sm90.cu, built for sm_90a only):
// the kernels' common parameters, the work-item decoding (see attention.cu's header for the
// work list and GQA packing), and small PTX helpers (cp.async and ldmatrix: mma.cuh).
#pragma once
#include "mma.cuh"

namespace attn {

constexpr u32 NO_PART = 0xffffffffu;  // attention.rs: NO_PART
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;

// KV: the cache's element type: T, or u8 for an FP8 e4m3 cache whose element is code ·
// k_scale (K) or code · v_scale (V). The tensor-core kernels turn codes into bf16 exactly and
// fold the scales into the softmax scale and the output; the SIMT kernel multiplies.
template <typename T, typename KV = T>
struct Args {
    const T* q;                // [tokens, heads * D]
    const KV* k_cache;         // [blocks, block_size, kv_heads, D]
    const KV* v_cache;
    T* out;                    // [tokens, heads * D]
    const u32* cu_seqlens;     // [S + 1]
    const u32* ctx_lens;       // [S]
    const u32* bt_offsets;     // [S]
    const u32* block_tables;
    const u32* w_seq;          // work columns (attention.rs: WorkCol)
    const u32* w_q_first;
    const u32* w_q_count;
    const u32* w_kv_first;
    const u32* w_kv_end;
    const u32* w_part;
    float* part_o;             // [partial rows, heads, D]
    float* part_ml;            // [partial rows, heads, 2]: (m, l)
    u32 item_base;
    u32 heads, kv_heads, head_dim, block_size;
    float scale;
    float k_scale, v_scale;    // FP8 caches; 1 otherwise
};

// What one CTA works on: its item, kv head and rows [r0, r0 + nrows) of the item's
// q_count × G packed rows.
struct Tile {
    u32 kvh, group;
    u32 q_first, kv_first, kv_end, part;
    u32 ctx, tok0;             // chunk's cached length; global index of the item's token 0
    const u32* bt;             // the chunk's block table
    u32 r0;
    int nrows;
    u32 hi;                    // end of the CTA's KV range (limit of its last row)
    u32 lo_full;               // positions below this are visible to every row of the CTA
};

// Returns false when this CTA has no rows (a row tile past the item's rows).
template <typename T, typename KV>
__device__ __forceinline__ bool tile_of(const Args<T, KV>& a, int rows_per_cta, Tile& t) {
    const u32 item = a.item_base + blockIdx.y;
    t.kvh = blockIdx.x % a.kv_heads;
    const u32 rt = blockIdx.x / a.kv_heads;
    t.group = a.heads / a.kv_heads;
    const u32 rows = a.w_q_count[item] * t.group;
    t.r0 = rt * (u32)rows_per_cta;
    if (t.r0 >= rows) return false;
    t.nrows = (int)min((u32)rows_per_cta, rows - t.r0);
    const u32 s = a.w_seq[item];
    t.q_first = a.w_q_first[item];
    t.kv_first = a.w_kv_first[item];
    t.kv_end = a.w_kv_end[item];
    t.part = a.w_part[item];
    t.ctx = a.ctx_lens[s];
    t.tok0 = a.cu_seqlens[s] + t.q_first;
    t.bt = a.block_tables + a.bt_offsets[s];
    t.hi = min(t.kv_end, t.ctx + t.q_first + (t.r0 + (u32)t.nrows - 1) / t.group + 1);
    t.lo_full = min(t.kv_end, t.ctx + t.q_first + t.r0 / t.group + 1);
    return true;
}

// Exclusive KV limit of CTA-local row r (valid rows only).
__device__ __forceinline__ u32 row_limit(const Tile& t, int r) {
    return min(t.kv_end, t.ctx + t.q_first + (t.r0 + (u32)r) / t.group + 1);
}

// Element offset of row r's (token, head) vector in q / out.
template <typename T, typename KV>
__device__ __forceinline__ i64 qo_offset(const Args<T, KV>& a, const Tile& t, int r) {
    const u32 rr = t.r0 + (u32)r;
    const u32 h = t.kvh * t.group + rr % t.group;
    return (i64)(t.tok0 + rr / t.group) * a.heads * a.head_dim + (i64)h * a.head_dim;
}

// Index of row r's (partial row, head) pair in part_o (× D) and part_ml (× 2).
template <typename T, typename KV>
__device__ __forceinline__ i64 part_index(const Args<T, KV>& a, const Tile& t, int r) {
    const u32 rr = t.r0 + (u32)r;
    const u32 h = t.kvh * t.group + rr % t.group;
    return (i64)(t.part + rr / t.group) * a.heads + h;
}

// Cache row (block * block_size + offset) of position p.
__device__ __forceinline__ u32 cache_row(const u32* bt, u32 p, u32 block_size) {
    return bt[p / block_size] * block_size + p % block_size;
}

__device__ __forceinline__ i64 kv_offset(u32 row, u32 kv_heads, u32 kvh, u32 head_dim) {
    return ((i64)row * kv_heads + kvh) * head_dim;
}


// Stores CTA row r of a tensor-core kernel from this thread's quad share: the pairs of
// columns 8i + 2·tq, 8i + 2·tq + 1 for i < NI (pair(i) gives them unnormalised), the row's sum l
// (over the quad) and max m (log2 units of the scaled scores): O / l as bf16 into `out`, or,
// for a split-KV piece, the f32 partial with m in natural-log units and l. O is in units of
// the cached V values: the V scale of an FP8 cache is applied here.
template <int D, int NI, typename KV, typename Pair>
__device__ __forceinline__ void store_row(const Args<bf16, KV>& a, const Tile& t, int r, int tq, float l,
                                          float m, Pair pair) {
    if (t.part == NO_PART) {
        bf16* dst = a.out + qo_offset(a, t, r) + 2 * tq;
        const float inv = l > 0.0f ? a.v_scale / l : 0.0f;
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            const float2 v = pair(i);
            *(u32*)(dst + i * 8) = pack_bf16x2(v.x * inv, v.y * inv);
        }
    } else {
        const i64 pi = part_index(a, t, r);
        float* dst = a.part_o + pi * D + 2 * tq;
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            const float2 v = pair(i);
            *(float2*)(dst + i * 8) = make_float2(v.x * a.v_scale, v.y * a.v_scale);
        }
        if (tq == 0) {
            a.part_ml[pi * 2] = m == -CHIMERA_INF ? m : m * LN2;  // natural-log units
            a.part_ml[pi * 2 + 1] = l;
        }
    }
}

// A cached element as f32: as stored, or an FP8 code times its scale (the CPU oracle's value).
__device__ __forceinline__ float load_kv(const float* p, i64 i, float) { return p[i]; }
__device__ __forceinline__ float load_kv(const bf16* p, i64 i, float) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float load_kv(const u8* p, i64 i, float scale) { return fp8_to_f32(p[i]) * scale; }

// 2^x (the hardware approximation; 2^-inf = 0). bf16 path only.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 dynamic_smem_size() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

}  // namespace attn

// Every main kernel takes these parameters (attention.rs: MAIN); KV is the cache's element
// type (T, or u8 codes of an FP8 cache).
#define ATTN_PARAMS(T, KV)                                                                    \
    const T *q, const KV *k_cache, const KV *v_cache, T *out, const u32 *cu_seqlens,          \
        const u32 *ctx_lens, const u32 *bt_offsets, const u32 *block_tables, const u32 *w_seq, \
        const u32 *w_q_first, const u32 *w_q_count, const u32 *w_kv_first,                    \
        const u32 *w_kv_end, const u32 *w_part, float *part_o, float *part_ml, u32 item_base, \
        u32 heads, u32 kv_heads, u32 head_dim, u32 block_size, float scale, float k_scale,    \
        float v_scale
#define ATTN_ARGS(T, KV)                                                                     \
    attn::Args<T, KV> {                                                                      \
        q, k_cache, v_cache, out, cu_seqlens, ctx_lens, bt_offsets, block_tables, w_seq,     \
            w_q_first, w_q_count, w_kv_first, w_kv_end, w_part, part_o, part_ml, item_base, \
            heads, kv_heads, head_dim, block_size, scale, k_scale, v_scale                   \
    }
