// SSD step 4, the chunk scan, for prompt chunks (the algorithm and the tiling: ssd.cuh; the
// planner: ssd.rs), from the entering states of ssd_state.cu: the SIMT ssd_scan_simt, or the
// tensor-core ssd_scan_group_mma (chunks of at most 128 tokens) and ssd_scan_mma.
#include "ssd.cuh"

namespace ssm {

constexpr float LOG2E = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------
// SSD step 4 (SIMT): y for rows [l0, l0 + 32) and columns [p0, p0 + 64) of chunk ck, head h.
template <typename T>
__device__ void scan_simt(const T* x, const T* b, const T* c, const T* d, const float* dtv,
                          const float* acum, const float* states, T* out, const u32* ck_tok,
                          const u32* ck_len, u32 heads, u32 P, u32 groups, u32 N, u32 x_ld,
                          u32 bc_ld, u32 out_ld, u32 l_tiles, u32 p_tiles) {
    __shared__ float Cs[TK][TM + 1];   // C[l0 + m][k0 + k] as [k][m]
    __shared__ float Bs[TK][TN + 1];   // h_c[p0 + n][k0 + k], then B[s0 + n][k0 + k], as [k][n]
    __shared__ float Gs[TK][TM + 1];   // decayed scores as [s][m]
    __shared__ float Xs[TK][TN + 1];   // x[s0 + k][p0 + n]
    __shared__ float al[TM], as_[TK], ds[TK];
    u32 r = blockIdx.x;
    const u32 h = r % heads;
    r /= heads;
    const u32 pt = r % p_tiles;
    r /= p_tiles;
    const u32 lt = r % l_tiles;
    const u32 ck = r / l_tiles;
    const u32 tok = ck_tok[ck], len = ck_len[ck];
    const u32 l0 = lt * TM, p0 = pt * TN;
    if (l0 >= len) return;
    const u32 g = h / (heads / groups);
    const int tid = threadIdx.x, ty = tid >> 5, tx = tid & 31;
    const i64 crow = (i64)g * N;
    if (tid < TM) al[tid] = l0 + tid < len ? acum[(u64)(tok + l0 + tid) * heads + h] : 0.0f;

    // State term: Y = C·h_cᵀ, then rows scaled by exp(A_l).
    const float* hc = states + ((u64)ck * heads + h) * P * N;
    float acc[4][2] = {};
    for (u32 k0 = 0; k0 < N; k0 += TK) {
        for (int i = tid; i < TK * TM; i += ST_THREADS) {
            const int m = i / TK, k = i % TK;
            const u32 l = l0 + m, col = k0 + k;
            Cs[k][m] = (l < len && col < N) ? load(c, (i64)(tok + l) * bc_ld + crow + col) : 0.0f;
        }
        for (int i = tid; i < TK * TN; i += ST_THREADS) {
            const int n = i / TK, k = i % TK;
            const u32 p = p0 + n, col = k0 + k;
            Bs[k][n] = (p < P && col < N) ? hc[(u64)p * N + col] : 0.0f;
        }
        __syncthreads();
        simt_fma(acc, Cs, Bs, ty, tx);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float e = expf(al[ty + 8 * i]);
        acc[i][0] *= e;
        acc[i][1] *= e;
    }

    // Intra-chunk term over s tiles up to the diagonal.
    for (u32 s0 = 0; s0 <= l0 + TM - 1 && s0 < len; s0 += TK) {
        if (tid < TK) {
            const u32 s = s0 + tid;
            as_[tid] = s < len ? acum[(u64)(tok + s) * heads + h] : 0.0f;
            ds[tid] = s < len ? dtv[(u64)(tok + s) * heads + h] : 0.0f;
        }
        // G[m][s] = C_l·B_s: thread owns m = ty + 8i, s = tx.
        float gacc[4] = {0.f, 0.f, 0.f, 0.f};
        for (u32 k0 = 0; k0 < N; k0 += TK) {
            for (int i = tid; i < TK * TM; i += ST_THREADS) {
                const int m = i / TK, k = i % TK;
                const u32 l = l0 + m, col = k0 + k;
                Cs[k][m] = (l < len && col < N) ? load(c, (i64)(tok + l) * bc_ld + crow + col) : 0.0f;
            }
            for (int i = tid; i < TK * TK; i += ST_THREADS) {
                const int n = i / TK, k = i % TK;
                const u32 s = s0 + n, col = k0 + k;
                Bs[k][n] = (s < len && col < N) ? load(b, (i64)(tok + s) * bc_ld + crow + col) : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int k = 0; k < TK; ++k) {
                const float bv = Bs[k][tx];
#pragma unroll
                for (int i = 0; i < 4; ++i) gacc[i] += Cs[k][ty + 8 * i] * bv;
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = ty + 8 * i;
            const u32 l = l0 + m, s = s0 + tx;
            Gs[tx][m] = (s <= l && s < len && l < len) ? gacc[i] * (expf(al[m] - as_[tx]) * ds[tx]) : 0.0f;
        }
        for (int i = tid; i < TK * TN; i += ST_THREADS) {
            const int k = i / TN, n = i % TN;
            const u32 s = s0 + k, p = p0 + n;
            Xs[k][n] = (s < len && p < P) ? load(x, (i64)(tok + s) * x_ld + (i64)h * P + p) : 0.0f;
        }
        __syncthreads();
        simt_fma(acc, Gs, Xs, ty, tx);
        __syncthreads();
    }

    const float dh = load(d, h);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 l = l0 + ty + 8 * i, p = p0 + tx + 32 * j;
            if (l < len && p < P) {
                const i64 xi = (i64)(tok + l) * x_ld + (i64)h * P + p;
                store(out, (i64)(tok + l) * out_ld + (i64)h * P + p, acc[i][j] + dh * load(x, xi));
            }
        }
}

// ---------------------------------------------------------------------------------------
// SSD step 4 (tensor cores), any chunk size (the planner takes scan_group_mma below for
// chunks of at most 128 tokens): rows [l0, l0 + 128) of chunk ck, head h; warp w owns rows
// l0 + 16w + [0, 16). One CTA covers a whole 128-token chunk, so h_c and the chunk's B and x
// rows are read once per (chunk, head), not once per 64-row block. Shared (dynamic): the C
// rows, h_c (bf16, from chunk_pass_mma), the B and x rows of the current s tile, and the
// decays. Everything a tile needs is requested up front by cp.async and waited for once.
template <int P, int N>
struct ScanLayout {  // offsets in bf16 elements; ssd.rs: scan_smem_bytes
    static constexpr int LDN = Pad<N>::LD, LDP = Pad<P>::LD;
    static constexpr int CS = 0;                     // C rows [SCAN_ROWS][LDN]
    static constexpr int HB = CS + SCAN_ROWS * LDN;  // h_c [P][LDN]
    static constexpr int BS = HB + P * LDN;          // B rows of the s tile [SCAN_ROWS][LDN]
    static constexpr int XS = BS + SCAN_ROWS * LDN;  // x rows of the s tile [SCAN_ROWS][LDP]
    static constexpr int END = XS + SCAN_ROWS * LDP;
    static constexpr int BYTES = END * 2 + 3 * SCAN_ROWS * 4;  // + al (f32), (as, ds) pairs
};

template <int P, int N>
__device__ void scan_mma(const bf16* x, const bf16* b, const bf16* c, const bf16* d,
                         const float* dtv, const float* acum, const bf16* hc, bf16* out,
                         const u32* ck_tok, const u32* ck_len, u32 heads, u32 groups, u32 x_ld,
                         u32 bc_ld, u32 out_ld, u32 l_blocks) {
    using Ly = ScanLayout<P, N>;
    constexpr int LDN = Ly::LDN, LDP = Ly::LDP;
    bf16* smem = reinterpret_cast<bf16*>(ssm_dyn_smem);
    bf16 *cs = smem + Ly::CS, *hb = smem + Ly::HB, *bs = smem + Ly::BS, *xs = smem + Ly::XS;
    // Cumulative dA in log2 units (exp(a) = exp2(a·log2 e)): the rows' A_l, then (A_s, dt_s)
    // pairs of the s tile, read as one 8-byte load per column.
    float* al = reinterpret_cast<float*>(smem + Ly::END);
    float2* ad = reinterpret_cast<float2*>(al + SCAN_ROWS);
    u32 r = blockIdx.x;
    const u32 h = r % heads;
    r /= heads;
    const u32 lb = r % l_blocks, ck = r / l_blocks;
    const u32 tok = ck_tok[ck], len = ck_len[ck];
    const u32 l0 = lb * SCAN_ROWS;
    if (l0 >= len) return;
    const int lvalid = (int)min((u32)SCAN_ROWS, len - l0);
    const u32 g = h / (heads / groups);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mat = lane >> 3, mr = lane & 7, gq = lane >> 2, tq = lane & 3;

    // The s tile sb: B and x rows by cp.async (committed by the caller), their decays.
    auto stage_s = [&](u32 sb) {
        const u32 s0 = sb * SCAN_ROWS;
        const int svalid = (int)min((u32)SCAN_ROWS, len - s0);
        stage_async<N>(bs, b + (i64)(tok + s0) * bc_ld + (i64)g * N, bc_ld, SCAN_ROWS, svalid);
        stage_async<P>(xs, x + (i64)(tok + s0) * x_ld + (i64)h * P, x_ld, SCAN_ROWS, svalid);
        if (threadIdx.x < SCAN_ROWS) {
            const int s = threadIdx.x;
            const u64 o = (u64)(tok + s0 + s) * heads + h;
            ad[s] = s < svalid ? make_float2(acum[o] * LOG2E, dtv[o]) : make_float2(0.0f, 0.0f);
        }
    };
    stage_async<N>(cs, c + (i64)(tok + l0) * bc_ld + (i64)g * N, bc_ld, SCAN_ROWS, lvalid);
    stage_s(0);
    stage_async<N>(hb, hc + ((u64)ck * heads + h) * P * N, N, P, P);  // h_c (bf16 [P][N])
    cp_async_commit_group();
    if (threadIdx.x < SCAN_ROWS)
        al[threadIdx.x] =
            (int)threadIdx.x < lvalid ? acum[(u64)(tok + l0 + threadIdx.x) * heads + h] * LOG2E : 0.0f;
    cp_async_wait_groups<0>();
    __syncthreads();

    const int row0 = 16 * warp;        // this warp's first row within the block
    const bool active = row0 < lvalid;  // warps past the chunk's end only take part in barriers
    const bf16* a_base = cs + (row0 + mr + ((mat & 1) << 3)) * LDN + ((mat >> 1) << 3);
    float y[P / 8][4] = {};
    const float al0 = al[row0 + gq], al1 = al[row0 + gq + 8];
    if (active) {
        // State term: y = exp(A_l)·C·h_cᵀ (k = state column).
#pragma unroll
        for (int kk = 0; kk < N / 16; ++kk) {
            u32 a[4];
            ldsm4(a, a_base + 16 * kk);
#pragma unroll
            for (int j = 0; j < P / 8; j += 2) {
                u32 bb[4];
                ldsm4(bb, hb + (8 * j + mr + ((mat >> 1) << 3)) * LDN + 16 * kk + ((mat & 1) << 3));
                mma(y[j], a, bb[0], bb[1]);
                mma(y[j + 1], a, bb[2], bb[3]);
            }
        }
        const float e0 = exp2f(al0), e1 = exp2f(al1);
#pragma unroll
        for (int j = 0; j < P / 8; ++j) {
            y[j][0] *= e0;
            y[j][1] *= e0;
            y[j][2] *= e1;
            y[j][3] *= e1;
        }
    }
    const int lr0 = (int)l0 + row0 + gq;  // chunk-relative rows of c[0..1] and c[2..3]
    const int lr1 = lr0 + 8;

    for (u32 sb = 0; sb <= lb; ++sb) {
        if (sb > 0) {
            __syncthreads();  // everyone is done with the previous tile
            stage_s(sb);
            cp_async_commit_group();
            cp_async_wait_groups<0>();
            __syncthreads();
        }
        if (!active) continue;
        const u32 s0 = sb * SCAN_ROWS;
        const int svalid = (int)min((u32)SCAN_ROWS, len - s0);
        // On the diagonal tile, warp w needs s < 16w + 16 only.
        const int smax = sb == lb ? row0 + 16 : SCAN_ROWS;
        for (int c0 = 0; c0 < smax; c0 += SCAN_COLS) {
            const int jmax = min(SCAN_COLS / 8, (smax - c0) / 8);  // 8-wide s tiles here (even)
            float sc[SCAN_COLS / 8][4] = {};
#pragma unroll
            for (int kk = 0; kk < N / 16; ++kk) {
                u32 a[4];
                ldsm4(a, a_base + 16 * kk);
#pragma unroll
                for (int j = 0; j < SCAN_COLS / 8; j += 2) {
                    if (j >= jmax) break;
                    u32 bb[4];
                    ldsm4(bb, bs + (c0 + 8 * j + mr + ((mat >> 1) << 3)) * LDN + 16 * kk + ((mat & 1) << 3));
                    mma(sc[j], a, bb[0], bb[1]);
                    mma(sc[j + 1], a, bb[2], bb[3]);
                }
            }
            // Decay exp(A_l − A_s)·dt_s and causal mask: sc[j][0..1] at (lr0, s), (lr0, s + 1);
            // [2..3] at lr1. A_l − A_s ≤ 0 wherever a score is kept. Columns wholly below
            // this warp's first row, valid, with both rows valid, need no mask.
            const bool full = (int)s0 + c0 + SCAN_COLS - 1 <= (int)l0 + row0 &&
                              c0 + SCAN_COLS <= svalid && lr1 < (int)len;
#pragma unroll
            for (int j = 0; j < SCAN_COLS / 8; ++j) {
                const int sl = c0 + 8 * j + 2 * tq;
                const float2 d0 = ad[sl], d1 = ad[sl + 1];
                if (full) {
                    sc[j][0] *= exp2f(al0 - d0.x) * d0.y;
                    sc[j][1] *= exp2f(al0 - d1.x) * d1.y;
                    sc[j][2] *= exp2f(al1 - d0.x) * d0.y;
                    sc[j][3] *= exp2f(al1 - d1.x) * d1.y;
                    continue;
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int s = (int)s0 + sl + (q & 1);
                    const int l = q < 2 ? lr0 : lr1;
                    const float2 dq = (q & 1) ? d1 : d0;
                    const bool ok = s <= l && sl + (q & 1) < svalid && l < (int)len;
                    sc[j][q] = ok ? sc[j][q] * (exp2f((q < 2 ? al0 : al1) - dq.x) * dq.y) : 0.0f;
                }
            }
            // y += scores · x (k = s).
#pragma unroll
            for (int kk = 0; kk < SCAN_COLS / 16; ++kk) {
                if (2 * kk >= jmax) break;
                const u32 pa[4] = {pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]),
                                   pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                                   pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                   pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
                for (int j = 0; j < P / 8; j += 2) {
                    u32 bb[4];
                    ldsm4_t(bb, xs + (c0 + 16 * kk + mr + ((mat & 1) << 3)) * LDP + 8 * j + ((mat >> 1) << 3));
                    mma(y[j], pa, bb[0], bb[1]);
                    mma(y[j + 1], pa, bb[2], bb[3]);
                }
            }
        }
    }
    if (!active) return;

    // D·x: the last s tile was the diagonal one (s0 = l0), so xs holds this block's x rows.
    const float dh = bf16_to_f32(d[h]);
#pragma unroll
    for (int j = 0; j < P / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int l = half ? lr1 : lr0;
            if (l >= (int)len) continue;
            const int p = 8 * j + 2 * tq;
            const bf16* xr = xs + (l - (int)l0) * LDP + p;
            const i64 oi = (i64)(tok + l) * out_ld + (i64)h * P + p;
            store(out, oi, y[j][2 * half] + dh * bf16_to_f32(xr[0]));
            store(out, oi + 1, y[j][2 * half + 1] + dh * bf16_to_f32(xr[1]));
        }
    }
}

// ---------------------------------------------------------------------------------------
// SSD step 4 for chunks of at most 128 tokens (tensor cores), once per (chunk, group) for the
// scores: CTA (chunk, group, block of `head_block` heads of the group). The scores C·Bᵀ
// depend only on the group, so the CTA computes them once (the 36 lower-triangle 16×16
// tiles, f32, kept in shared memory in accumulator-fragment order: a lane reads back exactly
// the values it needs as an mma A operand). Then its two warpgroups walk the heads
// independently (warpgroup k takes heads k, k + 2, ...), so one's exponentials and barriers
// overlap the other's products. Head i's x, h_c (bf16, from the fused chunk-pass kernel), A_s
// and dt_s land in stage i mod GS_STAGES by cp.async, completing on that stage's mbarrier;
// the warpgroup done with head i refills its stage with head i + GS_STAGES (for the other
// warpgroup). Per head, warp w of a warpgroup owns the row blocks w and 7 − w (16 rows each:
// equal causal work) and all P output columns, and builds its decayed, masked scores
// CB∘exp(A_l − A_s)·dt_s as bf16 A fragments in registers (the FA2 accumulator-to-operand
// trick). Off the diagonal, exp(A_l − A_s) = exp(A_l − A_r)·exp(A_r − A_s) with A_r the
// column block's last A (both factors ≤ 1): the column factors exp(A_r − A_s)·dt_s are
// computed once per head in shared memory, two exponentials per lane and tile remain.
// y = exp(A_l)·C·h_cᵀ + Σ_{s ≤ l} (CB∘decay∘dt)·x + D·x.
constexpr int GS_STAGES = 3;  // head stages (shared by the two warpgroups)
constexpr int GS_TILES = (SCAN_ROWS / 16) * (SCAN_ROWS / 16 + 1) / 2;

template <int P, int N>
struct GroupScanLayout {  // offsets in bf16 elements; ssd.rs: group_scan_smem_bytes
    static constexpr int LDN = Pad<N>::LD, LDP = Pad<P>::LD;
    static constexpr int CB = 0;  // score tiles (f32, GS_TILES × 256)
    // A head stage: x rows [SCAN_ROWS][LDP], h_c [P][LDN], then f32 A_s and dt_s [SCAN_ROWS].
    // Before the heads, stages 1 and 2 hold the C and the B rows [SCAN_ROWS][LDN].
    static constexpr int XS = 0, HB = SCAN_ROWS * LDP, FS = HB + P * LDN;
    static constexpr int STAGE = FS + 2 * SCAN_ROWS * 2;
    static constexpr int HEAD = CB + GS_TILES * 256 * 2;
    static constexpr int CF = HEAD + GS_STAGES * STAGE;  // per warpgroup: column factors (f32)
    static constexpr int BAR = CF + 2 * SCAN_ROWS * 2;   // GS_STAGES mbarriers
    static constexpr int BYTES = BAR * 2 + GS_STAGES * 8;
    static_assert(SCAN_ROWS * LDN <= STAGE && GS_STAGES >= 3, "C and B rows fit in stages 1, 2");
    static_assert(HEAD % 8 == 0 && STAGE % 8 == 0 && FS % 8 == 0 && BAR % 4 == 0, "alignment");
};

// The 128 threads of warpgroup `wg` (named barrier 1 + wg).
__device__ __forceinline__ void gs_wg_sync(int wg) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

template <int P, int N>
__device__ void scan_group_mma(const bf16* x, const bf16* b, const bf16* c, const bf16* d,
                               const float* ck_dt, const float* ck_a, const bf16* hc, bf16* out,
                               const u32* ck_tok, const u32* ck_len, u32 heads, u32 groups,
                               u32 x_ld, u32 bc_ld, u32 out_ld, u32 head_block, u32 head_blocks,
                               u32 rec_rows) {
    static_assert(P == 64 && SCAN_THREADS == 256 && SCAN_ROWS == 128, "2 × 4 warps, 8 row blocks");
    using Ly = GroupScanLayout<P, N>;
    constexpr int LDN = Ly::LDN, LDP = Ly::LDP, KN = N / 16;
    bf16* smem = reinterpret_cast<bf16*>(ssm_dyn_smem);
    float4* cb4 = reinterpret_cast<float4*>(smem + Ly::CB);
    u32 r = blockIdx.x;
    const u32 hblk = r % head_blocks;
    r /= head_blocks;
    const u32 g = r % groups, ck = r / groups;
    const u32 hpg = heads / groups;
    const u32 h0 = g * hpg + hblk * head_block;
    const u32 nh = min(head_block, hpg - min(hpg, hblk * head_block));
    const u32 tok = ck_tok[ck], len = ck_len[ck];
    if (nh == 0 || len == 0) return;  // len 0: a padding chunk (plan.rs: SsmPlan::pad_to)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wt = tid & 127;
    const int mat = lane >> 3, mr = lane & 7, gq = lane >> 2, tq = lane & 3;
    const u64 pn = (u64)P * N;
    const u32 bar0 = smem_addr(smem + Ly::BAR);
    auto stage_of = [&](u32 i) { return smem + Ly::HEAD + (int)(i % GS_STAGES) * Ly::STAGE; };

    // Head h0 + i into its stage, by the 128 threads of the calling warpgroup.
    auto issue = [&](u32 i) {
        bf16* st = stage_of(i);
        const u32 h = h0 + i;
        stage_rows<P, SCAN_ROWS, 128>(st + Ly::XS, x + (i64)tok * x_ld + (i64)h * P, x_ld, (int)len, wt);
        stage_rows<N, P, 128>(st + Ly::HB, hc + ((u64)ck * heads + h) * pn, N, P, wt);
        // A_s and dt_s from ssd_dt's chunk-major copies, rows past the chunk's end zero.
        float* f = reinterpret_cast<float*>(st + Ly::FS);
        if (wt < 2 * SCAN_ROWS / 4) {
            const int q = wt % (SCAN_ROWS / 4), half = wt / (SCAN_ROWS / 4);
            const int bytes = max(0, min(16, 4 * ((int)len - 4 * q)));
            const float* src = (half ? ck_dt : ck_a) + ((u64)ck * heads + h) * rec_rows + 4 * q;
            cp_async_16(smem_addr(f + half * SCAN_ROWS + 4 * q), bytes > 0 ? src : ck_a, (u32)bytes);
        }
        cp_async_arrive(bar0 + 8 * (i % GS_STAGES));
    };

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < GS_STAGES; ++s) mbar_init(bar0 + 8 * s, 128);
#if __CUDA_ARCH__ >= 900
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    }
    __syncthreads();
    if (wg == 0) issue(0);
    const bf16 *cs = stage_of(1), *bs = stage_of(2);
    stage_rows<N, SCAN_ROWS, SCAN_THREADS>(stage_of(1), c + (i64)tok * bc_ld + (i64)g * N, bc_ld, (int)len, tid);
    stage_rows<N, SCAN_ROWS, SCAN_THREADS>(stage_of(2), b + (i64)tok * bc_ld + (i64)g * N, bc_ld, (int)len, tid);
    cp_async_commit_group();
    cp_async_wait_groups<0>();
    __syncthreads();

    // Scores: tile t = lb(lb + 1)/2 + sb (sb ≤ lb) holds C rows [16lb, +16) · B rows
    // [16sb, +16)ᵀ as two n8 accumulator fragments, lane-major (float4 index (2t + jj)·32 + lane).
    for (int t = warp; t < GS_TILES; t += SCAN_THREADS / 32) {
        int lb = 0;
        while ((lb + 1) * (lb + 2) / 2 <= t) ++lb;
        const int sb = t - lb * (lb + 1) / 2;
        float sc[2][4] = {};
        if (16 * sb < (int)len && 16 * lb < (int)len) {
#pragma unroll
            for (int kk = 0; kk < KN; ++kk) {
                u32 a[4], bb[4];
                ldsm4(a, cs + (16 * lb + mr + ((mat & 1) << 3)) * LDN + 16 * kk + ((mat >> 1) << 3));
                ldsm4(bb, bs + (16 * sb + mr + ((mat >> 1) << 3)) * LDN + 16 * kk + ((mat & 1) << 3));
                mma(sc[0], a, bb[0], bb[1]);
                mma(sc[1], a, bb[2], bb[3]);
            }
        }
        cb4[(2 * t) * 32 + lane] = make_float4(sc[0][0], sc[0][1], sc[0][2], sc[0][3]);
        cb4[(2 * t + 1) * 32 + lane] = make_float4(sc[1][0], sc[1][1], sc[1][2], sc[1][3]);
    }
    const int rp = warp & 3;
    // The C fragments (A operands, k = state column) of this warp's row blocks rp and 7 − rp,
    // the same for every head: loaded once.
    u32 ca[2][KN][4];
#pragma unroll
    for (int bi = 0; bi < 2; ++bi)
#pragma unroll
        for (int kk = 0; kk < KN; ++kk)
            ldsm4(ca[bi][kk], cs + (16 * (bi ? 7 - rp : rp) + mr + ((mat & 1) << 3)) * LDN + 16 * kk +
                                   ((mat >> 1) << 3));
    __syncthreads();  // the scores are in; the C and B stages are free
    if (wg == 1 && nh > 1) issue(1);
    if (wg == 0 && nh > 2) issue(2);

    float* cfw = reinterpret_cast<float*>(smem + Ly::CF) + wg * SCAN_ROWS;
    for (u32 i = (u32)wg; i < nh; i += 2) {
        const u32 h = h0 + i;
        const float dh = bf16_to_f32(d[h]);
        mbar_wait(bar0 + 8 * (i % GS_STAGES), (i / GS_STAGES) & 1u);
        const bf16* st = stage_of(i);
        const bf16 *xs = st + Ly::XS, *hb = st + Ly::HB;
        const float* fa = reinterpret_cast<const float*>(st + Ly::FS);  // A_s (natural units)
        const float* fd = fa + SCAN_ROWS;                                // dt_s
        {
            // Column factors exp(A_r − A_s)·dt_s, A_r the last valid A of s's 16-column block
            // (rows past the chunk's end have A = dt = 0: factor 0).
            const int s = wt, ref = min(s | 15, (int)len - 1);
            cfw[s] = exp2f((fa[ref] - fa[s]) * LOG2E) * fd[s];
        }
        // State term of both row blocks: C_l·h_cᵀ, each h_c fragment used twice.
        float y[2][P / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < KN; ++kk)
#pragma unroll
            for (int j = 0; j < P / 8; j += 2) {
                u32 bb[4];
                ldsm4(bb, hb + (8 * j + mr + ((mat >> 1) << 3)) * LDN + 16 * kk + ((mat & 1) << 3));
#pragma unroll
                for (int bi = 0; bi < 2; ++bi) {
                    mma(y[bi][j], ca[bi][kk], bb[0], bb[1]);
                    mma(y[bi][j + 1], ca[bi][kk], bb[2], bb[3]);
                }
            }
        gs_wg_sync(wg);  // the column factors
#pragma unroll
        for (int bi = 0; bi < 2; ++bi) {
            const int lb = bi ? 7 - rp : rp;
            const int r0 = 16 * lb;
            if (r0 >= (int)len) continue;  // the whole block is past the chunk's end
            const int l0 = r0 + gq, l1 = l0 + 8;  // rows of y[bi][.][0..1] and [2..3]
            const float a0 = fa[l0], a1 = fa[l1];
            const float al0 = a0 * LOG2E, al1 = a1 * LOG2E;
            const float e0 = exp2f(al0), e1 = exp2f(al1);  // exp(A_l)
#pragma unroll
            for (int j = 0; j < P / 8; ++j) {
                y[bi][j][0] *= e0;
                y[bi][j][1] *= e0;
                y[bi][j][2] *= e1;
                y[bi][j][3] *= e1;
            }
            const int tb = lb * (lb + 1) / 2;  // the block's first score tile
            // Column blocks left of the diagonal: no mask (rows and columns past the chunk's
            // end have zero scores and factors).
            for (int sb = 0; sb < lb; ++sb) {
                const float4 v0 = cb4[(2 * (tb + sb)) * 32 + lane], v1 = cb4[(2 * (tb + sb) + 1) * 32 + lane];
                const float ar = fa[16 * sb + 15];
                // Rows past the chunk's end (A = 0) clamp to 1 (their scores are zero).
                const float r0f = exp2f(fminf((a0 - ar) * LOG2E, 0.0f));
                const float r1f = exp2f(fminf((a1 - ar) * LOG2E, 0.0f));
                const float2 c0 = *reinterpret_cast<const float2*>(cfw + 16 * sb + 2 * tq);
                const float2 c1 = *reinterpret_cast<const float2*>(cfw + 16 * sb + 8 + 2 * tq);
                const u32 pa[4] = {pack_bf16x2(v0.x * r0f * c0.x, v0.y * r0f * c0.y),
                                   pack_bf16x2(v0.z * r1f * c0.x, v0.w * r1f * c0.y),
                                   pack_bf16x2(v1.x * r0f * c1.x, v1.y * r0f * c1.y),
                                   pack_bf16x2(v1.z * r1f * c1.x, v1.w * r1f * c1.y)};
#pragma unroll
                for (int j = 0; j < P / 8; j += 2) {
                    u32 bb[4];
                    ldsm4_t(bb, xs + (16 * sb + mr + ((mat & 1) << 3)) * LDP + 8 * j + ((mat >> 1) << 3));
                    mma(y[bi][j], pa, bb[0], bb[1]);
                    mma(y[bi][j + 1], pa, bb[2], bb[3]);
                }
            }
            {
                // The diagonal tile: exp(A_l − A_s)·dt_s directly, masked to s ≤ l.
                const float4 v0 = cb4[(2 * (tb + lb)) * 32 + lane], v1 = cb4[(2 * (tb + lb) + 1) * 32 + lane];
                float sc[2][4] = {{v0.x, v0.y, v0.z, v0.w}, {v1.x, v1.y, v1.z, v1.w}};
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    const int s = r0 + 8 * jj + 2 * tq;  // columns of sc[jj][0|2], [1|3]: s, s + 1
                    const float as0 = fa[s] * LOG2E, as1 = fa[s + 1] * LOG2E;
                    const float d0 = fd[s], d1 = fd[s + 1];
                    sc[jj][0] = s <= l0 ? sc[jj][0] * (exp2f(al0 - as0) * d0) : 0.0f;
                    sc[jj][1] = s + 1 <= l0 ? sc[jj][1] * (exp2f(al0 - as1) * d1) : 0.0f;
                    sc[jj][2] = s <= l1 ? sc[jj][2] * (exp2f(al1 - as0) * d0) : 0.0f;
                    sc[jj][3] = s + 1 <= l1 ? sc[jj][3] * (exp2f(al1 - as1) * d1) : 0.0f;
                }
                const u32 pa[4] = {pack_bf16x2(sc[0][0], sc[0][1]), pack_bf16x2(sc[0][2], sc[0][3]),
                                   pack_bf16x2(sc[1][0], sc[1][1]), pack_bf16x2(sc[1][2], sc[1][3])};
#pragma unroll
                for (int j = 0; j < P / 8; j += 2) {
                    u32 bb[4];
                    ldsm4_t(bb, xs + (r0 + mr + ((mat & 1) << 3)) * LDP + 8 * j + ((mat >> 1) << 3));
                    mma(y[bi][j], pa, bb[0], bb[1]);
                    mma(y[bi][j + 1], pa, bb[2], bb[3]);
                }
            }
            // D·x and the stores: (row, column pair) per fragment half.
#pragma unroll
            for (int j = 0; j < P / 8; ++j) {
                const int p = 8 * j + 2 * tq;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int l = half ? l1 : l0;
                    if (l >= (int)len) continue;
                    const u32 xv = *reinterpret_cast<const u32*>(xs + l * LDP + p);
                    const float o0 = y[bi][j][2 * half] + dh * __uint_as_float(xv << 16);
                    const float o1 = y[bi][j][2 * half + 1] + dh * __uint_as_float(xv & 0xffff0000u);
                    *reinterpret_cast<u32*>(out + (i64)(tok + l) * out_ld + (i64)h * P + p) =
                        pack_bf16x2(o0, o1);
                }
            }
        }
        gs_wg_sync(wg);  // every warp of the warpgroup is done with head i's stage
        if (i + GS_STAGES < nh) issue(i + GS_STAGES);
    }
}
}  // namespace ssm

// ---------------------------------------------------------------------------------------
// Entry points (ssd.rs: SCAN_ENTRIES).

#define SCAN_PARAMS(T)                                                                        \
    const T *x, const T *b, const T *c, const T *d, const float *dtv, const float *acum,        \
        const float *states, T *out, const u32 *ck_tok, const u32 *ck_len, u32 heads,          \
        u32 head_dim, u32 groups, u32 state, u32 x_ld, u32 bc_ld, u32 out_ld, u32 l_tiles,     \
        u32 p_tiles

extern "C" __global__ void __launch_bounds__(256, 2) ssd_scan_simt_f32(SCAN_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::scan_simt(x, b, c, d, dtv, acum, states, out, ck_tok, ck_len, heads, head_dim, groups,
                   state, x_ld, bc_ld, out_ld, l_tiles, p_tiles);
}
extern "C" __global__ void __launch_bounds__(256, 2) ssd_scan_simt_bf16(SCAN_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::scan_simt(x, b, c, d, dtv, acum, states, out, ck_tok, ck_len, heads, head_dim, groups,
                   state, x_ld, bc_ld, out_ld, l_tiles, p_tiles);
}
// The tensor-core scans read `states` as the bf16 entering states of ssd_chunk_pass_mma.
extern "C" __global__ void __launch_bounds__(256, 2) ssd_scan_mma_p64n64_bf16(SCAN_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::scan_mma<64, 64>(x, b, c, d, dtv, acum, reinterpret_cast<const bf16*>(states), out,
                          ck_tok, ck_len, heads, groups, x_ld, bc_ld, out_ld, l_tiles);
}
extern "C" __global__ void __launch_bounds__(256, 2) ssd_scan_mma_p64n128_bf16(SCAN_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::scan_mma<64, 128>(x, b, c, d, dtv, acum, reinterpret_cast<const bf16*>(states), out,
                           ck_tok, ck_len, heads, groups, x_ld, bc_ld, out_ld, l_tiles);
}

#define GROUP_SCAN_PARAMS                                                                     \
    const bf16 *x, const bf16 *b, const bf16 *c, const bf16 *d, const float *ck_dt,            \
        const float *ck_a, const bf16 *hc, bf16 *out, const u32 *ck_tok, const u32 *ck_len,    \
        u32 heads, u32 groups, u32 x_ld, u32 bc_ld, u32 out_ld, u32 head_block,                \
        u32 head_blocks, u32 rec_rows
#define GROUP_SCAN_ARGS                                                                       \
    x, b, c, d, ck_dt, ck_a, hc, out, ck_tok, ck_len, heads, groups, x_ld, bc_ld, out_ld,      \
        head_block, head_blocks, rec_rows

extern "C" __global__ void __launch_bounds__(256, 1) ssd_scan_group_mma_p64n64_bf16(GROUP_SCAN_PARAMS) { CHIMERA_PDL_ENTRY();
    ssm::scan_group_mma<64, 64>(GROUP_SCAN_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 1) ssd_scan_group_mma_p64n128_bf16(GROUP_SCAN_PARAMS) { CHIMERA_PDL_ENTRY();
    ssm::scan_group_mma<64, 128>(GROUP_SCAN_ARGS);
}
