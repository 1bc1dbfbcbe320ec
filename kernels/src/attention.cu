// Paged attention for chimera's mixed batches (decodes, fresh prefills, chunks over a cached
// prefix), causal, GQA/MQA/MHA, over a block-table KV cache. The host planner
// (`attention.rs`) owns the work decomposition; these kernels execute it.
//
// Algorithm. FlashAttention-2 online softmax (Dao 2023, arXiv 2307.08691): a CTA keeps a
// running row max m, a running sum l and an unnormalised f32 accumulator O for its query
// rows, and streams the KV range tile by tile: S = Q·Kᵀ·scale, m' = max(m, rowmax S),
// P = exp(S − m'), O = O·exp(m − m') + P·V, l = l·exp(m − m') + rowsum P; at the end O / l.
// A row whose keys in a tile are all masked keeps m = −inf; exponentials are then taken
// against 0 instead of −inf, so no (−inf) − (−inf) NaN can appear.
//
// Work items (the planner's columns, see attention.rs): chunk s, a tile of at most 128
// query tokens [q_first, q_first + q_count), a KV range [kv_first, kv_end) and a
// partial-row base `part`. Query token i of chunk s sits at position ctx_lens[s] + i and
// sees positions < min(kv_end, ctx_lens[s] + i + 1).
//
// GQA head packing (as FlashInfer does for decode): a CTA serves one kv head and packs the
// query heads of its group into its rows, row r = (token r / G, head kv_head·G + r % G),
// so K/V are read once per kv head. grid.x = kv_heads × row tiles, grid.y = items.
//
// Split-KV (flash-decoding): when the planner splits a tile's KV range, each piece writes
// its unnormalised O, its m (natural-log units, scaled scores) and its l as f32 partials;
// `attn_combine` merges the pieces: O = Σ e^(m_j−M) O_j / Σ e^(m_j−M) l_j.
//
// Kernels:
// - attn_simt_{f32,bf16}: SIMT, any head_dim ≤ 256, f32 accumulation, `expf` (the f32
//   oracle path; bf16 fallback for head dims without a tensor-core kernel). 16 rows per CTA,
//   4 rows per warp; K/V tiles gathered into shared memory as f32.
// - attn_decode_d{64,128}_bf16: tensor cores (mma.sync m16n8k16 bf16 → f32) for at most 16
//   packed rows (a decode's G query heads): the 4 warps share the rows and each takes 16 keys
//   of every 64-key tile (one warp alone would leave the tensor pipes of 3 SM quarters idle);
//   their (m, l, O) merge through shared memory at the end. K+V tiles in a 2-stage ring.
// - attn_mma_d{64,128,256}_bf16: 4 warps × 16 rows, Q fragments in registers, KV tiles of 64
//   keys (16 for d = 256); small chunks, and every tile for d = 64 and 256.
// - attn_prefill_d128_bf16: 8 warps × 32 rows (two m16 tiles share each K/V fragment), Q
//   re-read from shared memory; prefill tiles of d = 128. On Hopper the planner runs
//   attention_sm90.cu's warpgroup-MMA kernels instead (attention.rs: PrefillKernel).
// Tensor-core loop: KV tiles are gathered row by row through the block table (one thread
// per key reads the table into a double-buffered row list) with 16-byte cp.async,
// zero-filled past the range, into XOR-swizzled shared memory read by ldmatrix. With one
// stage, K and V have one buffer each and overlap as in FA2: V(j) loads during S = QKᵀ,
// K(j+1) during O += PV. The causal mask is applied only on tiles reaching past the CTA's
// first row's limit.
// - attn_combine_{f32,bf16}: merges split-KV partials into `out`.
//
// Learned from: the FlashAttention-2 paper; the flash-decoding write-up; vLLM's paged
// attention and `triton_unified_attention` docs (one kernel for a mixed batch driven by a
// query-tile work list); FlashInfer's docs (plan/run split, GQA head packing). The PTX ISA
// manual for mma.sync / ldmatrix / cp.async fragment layouts. No code was copied.
#include "attention.cuh"

namespace attn {

constexpr int THREADS = 128;           // SIMT and combine CTAs (tensor-core: 32 × NW)
constexpr int WARPS = THREADS / 32;

// ---------------------------------------------------------------------------------------
// SIMT kernel: any head_dim ≤ 256.

constexpr int S_ROWS_PER_WARP = 4;
constexpr int S_ROWS = WARPS * S_ROWS_PER_WARP;  // 16 rows per CTA (attention.rs: SIMT_ROWS)
constexpr int S_MAX_D = 256;
constexpr int S_KV_FLOATS = 6144;                 // K tile [kt][D + 1] + V tile [kt][D]
constexpr int S_MAX_KT = 64;
constexpr int S_DPL = S_MAX_D / 32;               // dims per lane

template <typename T, typename KV>
__device__ __forceinline__ void simt(const Args<T, KV>& a) {
    __shared__ float sq[S_ROWS * S_MAX_D];
    __shared__ float skv[S_KV_FLOATS];
    __shared__ float sp[WARPS][S_ROWS_PER_WARP][S_MAX_KT];

    if (blockDim.x != THREADS) __trap();  // attention.rs launches 128 threads
    Tile t;
    if (!tile_of(a, S_ROWS, t)) return;
    const int D = (int)a.head_dim;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int i = threadIdx.x; i < S_ROWS * D; i += THREADS) {
        const int r = i / D, d = i - r * D;
        sq[i] = r < t.nrows ? load(a.q, qo_offset(a, t, r) + d) : 0.0f;
    }

    const int row0 = warp * S_ROWS_PER_WARP;
    const bool active = row0 < t.nrows;
    u32 lim[S_ROWS_PER_WARP];
#pragma unroll
    for (int j = 0; j < S_ROWS_PER_WARP; ++j)
        lim[j] = row0 + j < t.nrows ? row_limit(t, row0 + j) : 0;

    const int kt = min(S_MAX_KT, S_KV_FLOATS / (2 * D + 1));
    float* sk = skv;
    float* sv = skv + kt * (D + 1);

    float m[S_ROWS_PER_WARP], l[S_ROWS_PER_WARP], acc[S_ROWS_PER_WARP][S_DPL];
#pragma unroll
    for (int j = 0; j < S_ROWS_PER_WARP; ++j) {
        m[j] = -CHIMERA_INF;
        l[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < S_DPL; ++k) acc[j][k] = 0.0f;
    }

    for (u32 p0 = t.kv_first; p0 < t.hi; p0 += kt) {
        const int n = (int)min((u32)kt, t.hi - p0);
        __syncthreads();  // the previous tile is consumed (and sq is written, first time)
        for (int i = threadIdx.x; i < n * D; i += THREADS) {
            const int key = i / D, d = i - key * D;
            const u32 row = cache_row(t.bt, p0 + key, a.block_size);
            const i64 off = kv_offset(row, a.kv_heads, t.kvh, D) + d;
            sk[key * (D + 1) + d] = load_kv(a.k_cache, off, a.k_scale);
            sv[key * D + d] = load_kv(a.v_cache, off, a.v_scale);
        }
        __syncthreads();
        if (!active) continue;

        // Scores: lane handles keys lane and lane + 32 for the warp's 4 rows.
        float sc[S_ROWS_PER_WARP][2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int key = lane + 32 * c;
            float dot[S_ROWS_PER_WARP];
#pragma unroll
            for (int j = 0; j < S_ROWS_PER_WARP; ++j) dot[j] = 0.0f;
            if (key < n) {
                const float* kr = sk + key * (D + 1);
                const float* qr = sq + row0 * D;
                for (int d = 0; d < D; ++d) {
                    const float kd = kr[d];
#pragma unroll
                    for (int j = 0; j < S_ROWS_PER_WARP; ++j) dot[j] = fmaf(qr[j * D + d], kd, dot[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < S_ROWS_PER_WARP; ++j)
                sc[j][c] = key < n && p0 + key < lim[j] ? dot[j] * a.scale : -CHIMERA_INF;
        }

#pragma unroll
        for (int j = 0; j < S_ROWS_PER_WARP; ++j) {
            const float mx = warp_max(fmaxf(sc[j][0], sc[j][1]));
            const float m_new = fmaxf(m[j], mx);
            const float base = m_new == -CHIMERA_INF ? 0.0f : m_new;
            const float alpha = expf(m[j] - base);
            const float e0 = expf(sc[j][0] - base);
            const float e1 = expf(sc[j][1] - base);
            l[j] = l[j] * alpha + warp_sum(e0 + e1);
            m[j] = m_new;
#pragma unroll
            for (int k = 0; k < S_DPL; ++k) acc[j][k] *= alpha;
            sp[warp][j][lane] = e0;
            sp[warp][j][lane + 32] = e1;
        }
        __syncwarp();
        for (int key = 0; key < n; ++key) {
            const float* vr = sv + key * D;
#pragma unroll
            for (int k = 0; k < S_DPL; ++k) {
                const int d = lane + 32 * k;
                if (d < D) {
                    const float vd = vr[d];
#pragma unroll
                    for (int j = 0; j < S_ROWS_PER_WARP; ++j)
                        acc[j][k] = fmaf(sp[warp][j][key], vd, acc[j][k]);
                }
            }
        }
        __syncwarp();
    }

    if (!active) return;
#pragma unroll
    for (int j = 0; j < S_ROWS_PER_WARP; ++j) {
        const int r = row0 + j;
        if (r >= t.nrows) continue;
        if (t.part == NO_PART) {
            const i64 o = qo_offset(a, t, r);
            const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
#pragma unroll
            for (int k = 0; k < S_DPL; ++k) {
                const int d = lane + 32 * k;
                if (d < D) store(a.out, o + d, acc[j][k] * inv);
            }
        } else {
            const i64 pi = part_index(a, t, r);
#pragma unroll
            for (int k = 0; k < S_DPL; ++k) {
                const int d = lane + 32 * k;
                if (d < D) a.part_o[pi * D + d] = acc[j][k];
            }
            if (lane == 0) {
                a.part_ml[pi * 2] = m[j];
                a.part_ml[pi * 2 + 1] = l[j];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tensor-core kernel (bf16, head_dim D ∈ {64, 128, 256}); cp.async, ldmatrix and mma.sync
// from mma.cuh.

// ldmatrix_x4 transposed (V tiles as the B operand of P·V).
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Shared-memory byte offset of 16-byte chunk c of row r in a [rows][D] bf16 tile whose
// chunks are XOR-swizzled by the row's low 3 bits (ldmatrix and cp.async conflict-free).
template <int D>
__device__ __forceinline__ u32 swz(int r, int c) {
    return (u32)(r * D * 2 + ((c ^ (r & 7)) << 4));
}

extern __shared__ __align__(128) u16 attn_dyn_smem[];

// Eight e4m3 codes (lowest byte first) as eight bf16 values, exactly (every e4m3 value is a
// bf16 value), packed in pairs as mma.sync wants them.
__device__ __forceinline__ u32 fp8x2_to_bf16x2(u32 w) {
    const float lo = __uint_as_float(((w & 0x7fu) << 20) | ((w & 0x80u) << 24)) * FP8_UNBIAS;
    const float hi = __uint_as_float(((w & 0x7f00u) << 12) | ((w & 0x8000u) << 16)) * FP8_UNBIAS;
    return pack_bf16x2(lo, hi);
}
__device__ __forceinline__ uint4 fp8x8_to_bf16x8(uint2 c) {
    return make_uint4(fp8x2_to_bf16x2(c.x), fp8x2_to_bf16x2(c.x >> 16), fp8x2_to_bf16x2(c.y),
                      fp8x2_to_bf16x2(c.y >> 16));
}


// Shared memory of the tensor-core kernel: the KV tiles (STAGES slots of a K tile and a V
// tile), then Q when it stays in shared memory (else Q is staged over the KV tiles), then
// two tables of a KV tile's cache rows. attention.rs: `mma` mirrors this.
template <int D, int BN, int MT, bool Q_SMEM, int NW, int STAGES, bool WS>
struct MmaShape {
    static constexpr int BM = WS ? 16 : 16 * MT * NW;  // rows per CTA: NW warps × MT × 16
    static constexpr int TILE_BYTES = BN * D * 2;
    static constexpr int KV_BYTES = 2 * STAGES * TILE_BYTES;
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int TILES_BYTES = Q_SMEM ? KV_BYTES + Q_BYTES : (KV_BYTES > Q_BYTES ? KV_BYTES : Q_BYTES);
    static constexpr int SMEM = TILES_BYTES + 2 * BN * 4;
};

// Warp-split epilogue: each warp holds (m, l, O) of the CTA's 16 rows over its share of the
// keys; they are merged through shared memory (the KV tiles are done with) and stored.
template <int D, int NW, int NTH, typename KV>
__device__ __forceinline__ void merge_warps(const Args<bf16, KV>& a, const Tile& t, float (&o)[D / 8][4],
                                            float (&m)[2], float (&l)[2]) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    float* so = (float*)attn_dyn_smem;  // [NW][16][D]
    float* sml = so + NW * 16 * D;      // [NW][16]: (m, l)
    cp_async_wait_groups<0>();
    __syncthreads();  // every warp is done with the KV tiles
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lh = l[h];
        lh += __shfl_xor_sync(0xffffffffu, lh, 1);
        lh += __shfl_xor_sync(0xffffffffu, lh, 2);
        const int r = warp * 16 + g + 8 * h;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            so[r * D + i * 8 + 2 * tq] = o[i][2 * h];
            so[r * D + i * 8 + 2 * tq + 1] = o[i][2 * h + 1];
        }
        if (tq == 0) {
            sml[r * 2] = m[h];
            sml[r * 2 + 1] = lh;
        }
    }
    __syncthreads();
    for (int idx = tid; idx < t.nrows * D; idx += NTH) {
        const int r = idx / D, c = idx - r * D;
        float mx = -CHIMERA_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sml[(w * 16 + r) * 2]);
        const float base = mx == -CHIMERA_INF ? 0.0f : mx;
        float acc = 0.0f, sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = ex2(sml[(w * 16 + r) * 2] - base);  // 0 for a warp that saw no key
            acc += f * so[(w * 16 + r) * D + c];
            sum += f * sml[(w * 16 + r) * 2 + 1];
        }
        if (t.part == NO_PART) {
            store(a.out, qo_offset(a, t, r) + c, sum > 0.0f ? acc * a.v_scale / sum : 0.0f);
        } else {
            const i64 pi = part_index(a, t, r);
            a.part_o[pi * D + c] = acc * a.v_scale;
            if (c == 0) {
                a.part_ml[pi * 2] = mx == -CHIMERA_INF ? mx : mx * LN2;  // natural-log units
                a.part_ml[pi * 2 + 1] = sum;
            }
        }
    }
}

// The tensor-core kernel. D: head dim; BN: keys per KV tile; MT: m16 tiles per warp; Q_SMEM:
// Q re-read from shared memory (else held as A fragments in registers, MT = 1); NW: warps;
// STAGES = 1: one K and one V buffer overlapping as in FA2 (V(j) loads during QKᵀ, K(j+1)
// during PV, two barriers a tile); STAGES ≥ 2: a ring of K+V tiles, STAGES − 1 in flight,
// one barrier a tile. WS (warp split, for decodes): the warps share one m16 tile of rows and
// each takes 16 keys of every KV tile; their (m, l, O) are merged through shared memory.
template <int D, int BN, int MT, bool Q_SMEM, int NW, int STAGES, bool WS = false, typename KV = bf16>
__device__ __forceinline__ void mma(const Args<bf16, KV>& a) {
    using Sh = MmaShape<D, BN, MT, Q_SMEM, NW, STAGES, WS>;
    constexpr int BM = Sh::BM;
    constexpr int NTH = 32 * NW;
    constexpr int CPR = D / 8;             // 16-byte chunks per row
    constexpr int RPP = NTH / CPR;         // rows a pass of cp.async covers
    constexpr int KV_PASSES = BN / RPP;
    constexpr int Q_PASSES = BM / RPP;
    constexpr int KSTEPS = D / 16;
    constexpr int NT = BN / 8;             // S n-tiles
    constexpr int DT = D / 8;              // O n-tiles
    constexpr int QA = Q_SMEM ? 1 : KSTEPS;
    static_assert(NTH % CPR == 0 && BN % RPP == 0 && BM % RPP == 0 && BN % 16 == 0, "tile shape");
    static_assert(Q_SMEM || MT == 1, "Q fragments in registers only for one m-tile");
    static_assert(BN <= NTH && STAGES >= 1, "one thread per key of a tile");
    static_assert(!WS || (MT == 1 && !Q_SMEM && BN == 16 * NW), "warp split: 16 keys a warp");
    static_assert(!WS || NW * 16 * (D + 2) * 4 <= Sh::SMEM, "warp split merge area");
    constexpr int NTW = WS ? 2 : NT;       // S n-tiles of a warp
    constexpr int KKW = WS ? 1 : BN / 16;  // PV k-steps of a warp

    // A launch that disagrees with attention.rs fails loudly rather than computing garbage.
    if (blockDim.x != NTH || dynamic_smem_size() < (u32)Sh::SMEM) __trap();
    Tile t;
    if (!tile_of(a, BM, t)) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int my_chunk = tid % CPR, my_row = tid / CPR;
    const u32 s_kv = smem_addr(attn_dyn_smem);  // slot i: K at s_kv + 2i·TILE, V after it
    const u32 s_q = Q_SMEM ? s_kv + Sh::KV_BYTES : s_kv;
    // Cache row of each key of a KV tile (NO_PART past the range: zeros), double-buffered.
    u32* rows = (u32*)((char*)attn_dyn_smem + Sh::TILES_BYTES);
    const int wrow = WS ? 0 : warp * 16 * MT;  // the warp's first row
    const int key0 = WS ? warp * 16 : 0;       // the warp's first key of a tile

#pragma unroll
    for (int k = 0; k < Q_PASSES; ++k) {
        const int r = my_row + k * RPP;
        const bf16* src = a.q;
        u32 bytes = 0;
        if (r < t.nrows) {
            src = a.q + qo_offset(a, t, r) + my_chunk * 8;
            bytes = 16;
        }
        cp_async_16(s_q + swz<D>(r, my_chunk), src, bytes);
    }
    cp_async_commit_group();

    // One thread per key looks a tile's cache rows up (once, not once per 16-byte chunk).
    auto rows_of = [&](int tile, u32* dst) {
        if (tid < BN) {
            const u32 p = t.kv_first + (u32)tile * BN + (u32)tid;
            dst[tid] = p < t.hi ? cache_row(t.bt, p, a.block_size) : NO_PART;
        }
    };
    // A K or V tile is gathered through a row table in two halves: `issue` starts the loads
    // (no commit), `land` finishes them. bf16: issue is the tile's 16-byte cp.async copies and
    // land does nothing. FP8: issue loads the 8-byte chunks of codes into `raw` (registers),
    // and land widens them to bf16 exactly (an e4m3 value is a bf16 value; the scales are
    // applied to the scores and the output) and stores them in the same tile layout. The
    // loops issue a tile before the maths of the tile they compute and land it after, so the
    // codes' latency hides behind that maths as cp.async's does; land's stores are visible
    // after the barrier that also publishes a cp.async tile.
    using Raw = uint2[KV_PASSES];
    auto issue = [&](u32 dst, const KV* cache, const u32* tile_rows, Raw& raw) {
#pragma unroll
        for (int k = 0; k < KV_PASSES; ++k) {
            const int r = my_row + k * RPP;
            const u32 row = tile_rows[r];
            if constexpr (sizeof(KV) == 1) {
                raw[k] = row != NO_PART
                             ? *(const uint2*)(cache + kv_offset(row, a.kv_heads, t.kvh, D) + my_chunk * 8)
                             : make_uint2(0u, 0u);
            } else {
                const bf16* src = cache;
                u32 bytes = 0;
                if (row != NO_PART) {
                    src = cache + kv_offset(row, a.kv_heads, t.kvh, D) + my_chunk * 8;
                    bytes = 16;
                }
                cp_async_16(dst + swz<D>(r, my_chunk), src, bytes);
            }
        }
    };
    auto land = [&](u32 dst, const Raw& raw) {
        if constexpr (sizeof(KV) == 1) {
#pragma unroll
            for (int k = 0; k < KV_PASSES; ++k) {
                const uint4 w = fp8x8_to_bf16x8(raw[k]);
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + swz<D>(my_row + k * RPP, my_chunk)),
                             "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                             : "memory");
            }
        }
    };
    Raw raw_k, raw_v;  // FP8 only (unused registers are dropped for bf16)

    // A-fragment address parts: row within a 16-row tile and chunk parity of this lane.
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_hi = lane >> 4;
    u32 qa[QA][4];
    rows_of(0, rows);
    if (!Q_SMEM) {
        cp_async_wait_groups<0>();
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < QA; ++ks) ldmatrix_x4(qa[ks], s_q + swz<D>(wrow + a_row, 2 * ks + a_hi));
    }
    __syncthreads();  // the first row table is written; Q staging (if any) is consumed

    u32 lim[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wrow + mt * 16 + g + 8 * h;
            lim[mt][h] = r < t.nrows ? row_limit(t, r) : t.hi;
        }
    const bool active = wrow < t.nrows;
    const float sl2 = a.scale * a.k_scale * LOG2E;  // exponentials in base 2; K's FP8 scale

    float o[MT][DT][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
        m[mt][0] = m[mt][1] = -CHIMERA_INF;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    u32 pa[MT][KKW][4];  // P as A fragments

    // S = Q·Kᵀ for tile j (keys from p0), masked, online softmax, P → pa; rescales o and l.
    auto scores = [&](u32 s_k, u32 p0) {
        float sc[MT][NTW][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NTW; ++i) sc[mt][i][0] = sc[mt][i][1] = sc[mt][i][2] = sc[mt][i][3] = 0.0f;
        const int b_row = (lane & 7) + ((lane >> 4) << 3), b_hi = (lane >> 3) & 1;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            u32 qf[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (Q_SMEM) {
                    ldmatrix_x4(qf[mt], s_q + swz<D>(wrow + mt * 16 + a_row, 2 * ks + a_hi));
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) qf[mt][e] = qa[Q_SMEM ? 0 : ks][e];
                }
            }
#pragma unroll
            for (int np = 0; np < NTW / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, s_k + swz<D>(key0 + np * 16 + b_row, 2 * ks + b_hi));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16_16816(sc[mt][2 * np], qf[mt], b[0], b[1]);
                    mma_bf16_16816(sc[mt][2 * np + 1], qf[mt], b[2], b[3]);
                }
            }
        }
        const bool masked = p0 + BN > t.lo_full;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx[2] = {-CHIMERA_INF, -CHIMERA_INF};
#pragma unroll
            for (int i = 0; i < NTW; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (masked) {
                        const u32 key = p0 + (u32)(key0 + i * 8 + 2 * tq + (e & 1));
                        if (key >= lim[mt][e >> 1]) sc[mt][i][e] = -CHIMERA_INF;
                    }
                    mx[e >> 1] = fmaxf(mx[e >> 1], sc[mt][i][e]);
                }
            }
            float base[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                const float mn = fmaxf(m[mt][h], mx[h] * sl2);  // scores scaled to log2 units
                base[h] = mn == -CHIMERA_INF ? 0.0f : mn;
                const float alpha = ex2(m[mt][h] - base[h]);
                m[mt][h] = mn;
                l[mt][h] *= alpha;
#pragma unroll
                for (int i = 0; i < DT; ++i) {
                    o[mt][i][2 * h] *= alpha;
                    o[mt][i][2 * h + 1] *= alpha;
                }
            }
#pragma unroll
            for (int i = 0; i < NTW; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = ex2(fmaf(sc[mt][i][e], sl2, -base[e >> 1]));
                    sc[mt][i][e] = p;
                    l[mt][e >> 1] += p;  // per-thread partial sums; the quad sums at the end
                }
            }
#pragma unroll
            for (int kk = 0; kk < KKW; ++kk) {
                pa[mt][kk][0] = pack_bf16x2(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
                pa[mt][kk][1] = pack_bf16x2(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
                pa[mt][kk][2] = pack_bf16x2(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = pack_bf16x2(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
            }
        }
    };
    // O += P·V for one tile.
    auto accumulate = [&](u32 s_v) {
        const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_hi = lane >> 4;
#pragma unroll
        for (int kk = 0; kk < KKW; ++kk) {
#pragma unroll
            for (int dn = 0; dn < D / 16; ++dn) {
                u32 b[4];
                ldsm_x4_t(b, s_v + swz<D>(key0 + kk * 16 + v_row, 2 * dn + v_hi));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16_16816(o[mt][2 * dn], pa[mt][kk], b[0], b[1]);
                    mma_bf16_16816(o[mt][2 * dn + 1], pa[mt][kk], b[2], b[3]);
                }
            }
        }
    };

    const int ntiles = t.hi > t.kv_first ? (int)((t.hi - t.kv_first + BN - 1) / BN) : 0;
    if (STAGES == 1) {
        const u32 s_k = s_kv, s_v = s_kv + Sh::TILE_BYTES;
        if (ntiles > 0) {
            issue(s_k, a.k_cache, rows, raw_k);
            land(s_k, raw_k);
            cp_async_commit_group();
        }
        for (int j = 0; j < ntiles; ++j) {
            const u32 p0 = t.kv_first + (u32)j * BN;
            u32* cur = rows + (j & 1) * BN;
            u32* next = rows + ((j + 1) & 1) * BN;
            cp_async_wait_groups<0>();  // K(j) (and Q, the first time)
            __syncthreads();      // ... visible to all; every warp is done with V(j-1)
            issue(s_v, a.v_cache, cur, raw_v);
            cp_async_commit_group();
            // The next tile's block-table reads overlap this tile's maths; its readers come
            // after the barrier below, and this buffer's last readers were before the last.
            if (j + 1 < ntiles) rows_of(j + 1, next);
            if (active) scores(s_k, p0);
            land(s_v, raw_v);
            cp_async_wait_groups<0>();  // V(j)
            __syncthreads();      // ... visible to all; every warp is done with K(j)
            if (j + 1 < ntiles) {
                issue(s_k, a.k_cache, next, raw_k);
                cp_async_commit_group();
            }
            if (active) accumulate(s_v);
            if (j + 1 < ntiles) land(s_k, raw_k);
        }
    } else {
        // Prologue: tiles 0 .. STAGES-2 in flight, the table of tile STAGES-1 written.
        for (int i = 0; i < STAGES - 1; ++i) {
            if (i < ntiles) {
                const u32* tr = rows + (i & 1) * BN;
                const u32 slot = s_kv + 2 * i * Sh::TILE_BYTES;
                issue(slot, a.k_cache, tr, raw_k);
                issue(slot + Sh::TILE_BYTES, a.v_cache, tr, raw_v);
                land(slot, raw_k);
                land(slot + Sh::TILE_BYTES, raw_v);
            }
            cp_async_commit_group();
            __syncthreads();  // every thread has read table i & 1
            if (i + 1 < ntiles) rows_of(i + 1, rows + ((i + 1) & 1) * BN);
            __syncthreads();
        }
        for (int j = 0; j < ntiles; ++j) {
            const u32 p0 = t.kv_first + (u32)j * BN;
            // Groups committed so far: one per tile < j + STAGES - 1 (and Q's, first).
            asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
            __syncthreads();  // tile j visible to all; every warp is done with tile j-1
            const int ahead = j + STAGES - 1;
            const u32 ahead_slot = s_kv + 2 * (ahead % STAGES) * Sh::TILE_BYTES;
            if (ahead < ntiles) {
                const u32* tr = rows + (ahead & 1) * BN;
                issue(ahead_slot, a.k_cache, tr, raw_k);
                issue(ahead_slot + Sh::TILE_BYTES, a.v_cache, tr, raw_v);
            }
            cp_async_commit_group();  // possibly empty: keeps one group per tile
            // Table of tile ahead + 1: read after the next barrier; its buffer's last
            // reader was the issue of tile ahead - 1, before this barrier.
            if (ahead + 1 < ntiles) rows_of(ahead + 1, rows + ((ahead + 1) & 1) * BN);
            if (active) {
                const u32 slot = s_kv + 2 * (j % STAGES) * Sh::TILE_BYTES;
                scores(slot, p0);
                accumulate(slot + Sh::TILE_BYTES);
            }
            // Tile ahead's slot held tile j - 1, which every warp finished before the barrier
            // above; it is read after the next one.
            if (ahead < ntiles) {
                land(ahead_slot, raw_k);
                land(ahead_slot + Sh::TILE_BYTES, raw_v);
            }
        }
    }

    if (WS) {
        merge_warps<D, NW, NTH>(a, t, o[0], m[0], l[0]);
        return;
    }
    if (!active) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float lh = l[mt][h];
            lh += __shfl_xor_sync(0xffffffffu, lh, 1);
            lh += __shfl_xor_sync(0xffffffffu, lh, 2);
            const int r = wrow + mt * 16 + g + 8 * h;
            if (r >= t.nrows) continue;
            store_row<D, DT>(a, t, r, tq, lh, m[mt][h],
                             [&](int i) { return make_float2(o[mt][i][2 * h], o[mt][i][2 * h + 1]); });
        }
    }
}

// ---------------------------------------------------------------------------------------
// Split-KV combine: one CTA per (head, combined token). The pieces' maxima and sums are read
// in parallel (one thread per piece) and their weights e^(m_j−M) kept in shared memory, so the
// output loop's loads are independent of each other.
constexpr int COMBINE_SMEM = 256;  // pieces whose weights fit in shared memory

template <typename T>
__device__ __forceinline__ void combine(T* out, const float* part_o, const float* part_ml,
                                        const u32* c_token, const u32* c_part,
                                        const u32* c_stride, const u32* c_splits, u32 item_base,
                                        u32 heads, u32 head_dim) {
    __shared__ float red[32];
    __shared__ float wgt[COMBINE_SMEM];
    const u32 c = item_base + blockIdx.y, h = blockIdx.x;
    const u32 first = c_part[c], stride = c_stride[c], n = c_splits[c];
    auto ml = [&](u32 j) { return ((i64)(first + j * stride) * heads + h) * 2; };
    float mloc = -CHIMERA_INF;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) mloc = fmaxf(mloc, part_ml[ml(j)]);
    const float mmax = block_max(mloc, red);
    __syncthreads();
    float dloc = 0.0f;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const float m = part_ml[ml(j)];
        const float wj = m != -CHIMERA_INF ? expf(m - mmax) : 0.0f;
        if (j < COMBINE_SMEM) wgt[j] = wj;
        dloc += wj * part_ml[ml(j) + 1];
    }
    const float denom = block_sum(dloc, red);
    __syncthreads();
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    const i64 o = (i64)c_token[c] * heads * head_dim + (i64)h * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 8
        for (u32 j = 0; j < n; ++j) {
            float wj;
            if (j < COMBINE_SMEM) {
                wj = wgt[j];
            } else {
                const float m = part_ml[ml(j)];
                wj = m != -CHIMERA_INF ? expf(m - mmax) : 0.0f;
            }
            const i64 pi = (i64)(first + j * stride) * heads + h;
            if (wj != 0.0f) acc += wj * part_o[pi * head_dim + d];
        }
        store(out, o + d, acc * inv);
    }
}

}  // namespace attn

// ---------------------------------------------------------------------------------------
// Entry points (attention.rs: ENTRIES). Every main kernel takes the same parameters.


// Each main kernel twice: over a cache of the activations' dtype, and over an FP8 cache
// (`_kvfp8`, codes with per-layer K and V scales).
#define ATTN_MAIN(NAME, THREADS, T, BODY)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(ATTN_PARAMS(T, T)) {               \
        CHIMERA_PDL_ENTRY();                                                                       \
        BODY(T, ATTN_ARGS(T, T));                                                                  \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_kvfp8(ATTN_PARAMS(T, u8)) {      \
        CHIMERA_PDL_ENTRY();                                                                       \
        BODY(u8, ATTN_ARGS(T, u8));                                                                \
    }

#define SIMT(KV, ARGS) attn::simt(ARGS)
ATTN_MAIN(attn_simt_f32, 128, float, SIMT)
ATTN_MAIN(attn_simt_bf16, 128, bf16, SIMT)
// Decodes (at most 16 packed rows): 4 warps split every 64-key tile, 2-stage K+V ring.
// d = 128 takes 64.5 KiB of dynamic shared memory (the limit must be raised).
#define DECODE_D64(KV, ARGS) attn::mma<64, 64, 1, false, 4, 2, true, KV>(ARGS)
#define DECODE_D128(KV, ARGS) attn::mma<128, 64, 1, false, 4, 2, true, KV>(ARGS)
ATTN_MAIN(attn_decode_d64_bf16, 128, bf16, DECODE_D64)
ATTN_MAIN(attn_decode_d128_bf16, 128, bf16, DECODE_D128)
// Small chunks, and the tiles of head dims without a prefill kernel: 4 warps × 16 rows.
#define MMA_D64(KV, ARGS) attn::mma<64, 64, 1, false, 4, 1, false, KV>(ARGS)
#define MMA_D128(KV, ARGS) attn::mma<128, 64, 1, false, 4, 1, false, KV>(ARGS)
#define MMA_D256(KV, ARGS) attn::mma<256, 16, 1, false, 4, 1, false, KV>(ARGS)
ATTN_MAIN(attn_mma_d64_bf16, 128, bf16, MMA_D64)
ATTN_MAIN(attn_mma_d128_bf16, 128, bf16, MMA_D128)
ATTN_MAIN(attn_mma_d256_bf16, 128, bf16, MMA_D256)
// Prefill tiles, d = 128: 8 warps × 32 rows, Q in shared memory (96.5 KiB: the limit must
// be raised).
#define PREFILL_D128(KV, ARGS) attn::mma<128, 64, 2, true, 8, 1, false, KV>(ARGS)
ATTN_MAIN(attn_prefill_d128_bf16, 256, bf16, PREFILL_D128)

#define COMBINE_PARAMS(T)                                                                  \
    T *out, const float *part_o, const float *part_ml, const u32 *c_token, const u32 *c_part, \
        const u32 *c_stride, const u32 *c_splits, u32 item_base, u32 heads, u32 head_dim

extern "C" __global__ void __launch_bounds__(128) attn_combine_f32(COMBINE_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    attn::combine(out, part_o, part_ml, c_token, c_part, c_stride, c_splits, item_base, heads,
                  head_dim);
}
extern "C" __global__ void __launch_bounds__(128) attn_combine_bf16(COMBINE_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    attn::combine(out, part_o, part_ml, c_token, c_part, c_stride, c_splits, item_base, heads,
                  head_dim);
}
