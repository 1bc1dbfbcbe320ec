// SSD steps 1–3 for prompt chunks (the algorithm and the tiling: ssd.cuh; the planner:
// ssd.rs): dt and the cumulative dA (ssd_dt), then the chunk states and the state passing,
// by the SIMT ssd_states_simt and ssd_pass, or in one tensor-core walk (ssd_chunk_pass_mma).
#include "ssd.cuh"

namespace ssm {

// SSD step 1: dt and the within-chunk cumulative dA, per (token, head), into scratch; and
// the same chunk-major ([chunk][head][rec_rows]) for the tensor-core kernels, which stage a
// (chunk, head)'s values in 16-byte pieces (per token, at a stride of `heads` words, they
// were one cache line a value, through an L1 that the shared memory leaves small).

constexpr int DT_THREADS = 256;  // ssd.rs: DT_THREADS
constexpr int DT_HEADS = 32;     // ssd.rs: DT_HEADS
constexpr int DT_ROWS = 64;

template <typename T>
__device__ void ssd_dt(const T* dt, const T* dt_bias, const T* a_log, float* dtv, float* acum,
                       float* ck_a, float* ck_dt, const u32* ck_tok, const u32* ck_len, u32 heads,
                       u32 dt_ld, u32 head_blocks, u32 rec_rows, float dt_min, float dt_max) {
    __shared__ float v[DT_ROWS][DT_HEADS + 1];
    __shared__ float av[DT_ROWS][DT_HEADS + 1];
    const u32 ck = blockIdx.x / head_blocks;
    const u32 h0 = (blockIdx.x % head_blocks) * DT_HEADS;
    const u32 tok = ck_tok[ck], len = ck_len[ck];
    const u32 hm = threadIdx.x < DT_HEADS ? h0 + threadIdx.x : heads;
    const float a = hm < heads ? -expf(load(a_log, hm)) : 0.0f;
    float run = 0.0f;
    for (u32 base = 0; base < len; base += DT_ROWS) {
        const u32 rows = min((u32)DT_ROWS, len - base);
        for (u32 i = threadIdx.x; i < DT_ROWS * DT_HEADS; i += DT_THREADS) {
            const u32 r = i / DT_HEADS, hh = i % DT_HEADS, h = h0 + hh;
            if (r < rows && h < heads)
                v[r][hh] = dt_of(load(dt, (i64)(tok + base + r) * dt_ld + h), load(dt_bias, h),
                                 dt_min, dt_max);
        }
        __syncthreads();
        if (hm < heads) {
            for (u32 r = 0; r < rows; ++r) {
                const float d = v[r][threadIdx.x];
                run += __fmul_rn(d, a);  // the CPU's order and rounding: run += dt·a
                const u64 o = (u64)(tok + base + r) * heads + hm;
                dtv[o] = d;
                acum[o] = run;
                av[r][threadIdx.x] = run;
            }
        }
        __syncthreads();
        // The same values chunk-major, [chunk][head][rec_rows], row by row of each head.
        for (u32 i = threadIdx.x; i < DT_ROWS * DT_HEADS; i += DT_THREADS) {
            const u32 hh = i / DT_ROWS, r = i % DT_ROWS, h = h0 + hh;
            if (r < rows && h < heads) {
                const u64 o = ((u64)ck * heads + h) * rec_rows + base + r;
                ck_a[o] = av[r][hh];
                ck_dt[o] = v[r][hh];
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// SSD step 2 (SIMT): S_c[p][n] = Σ_s x_s[p]·(w_s·B_s[n]), w_s = exp(A_end − A_s)·dt_s.
// CTA (head, p tile, n tile, chunk); m = p, n = state column, k = token.
template <typename T>
__device__ void states_simt(const T* x, const T* b, const float* dtv, const float* acum,
                            float* states, const u32* ck_tok, const u32* ck_len, u32 heads,
                            u32 P, u32 groups, u32 N, u32 x_ld, u32 bc_ld, u32 p_tiles,
                            u32 n_tiles) {
    __shared__ float As[TK][TM + 1];
    __shared__ float Bs[TK][TN + 1];
    __shared__ float ws[TK];
    u32 r = blockIdx.x;
    const u32 h = r % heads;
    r /= heads;
    const u32 nt = r % n_tiles;
    r /= n_tiles;
    const u32 pt = r % p_tiles;
    const u32 ck = r / p_tiles;
    const u32 tok = ck_tok[ck], len = ck_len[ck];
    // A padding chunk (len 0; plan.rs: SsmPlan::pad_to) sits on the step's last row, so the
    // read of a_end below stays in the step, and writes a zero state into its own scratch.
    // (An early return here costs ssd_states_simt_f32 a 16-byte spill.)
    const u32 g = h / (heads / groups);
    const u32 p0 = pt * TM, n0 = nt * TN;
    const int tid = threadIdx.x, ty = tid >> 5, tx = tid & 31;
    const float a_end = acum[(u64)(tok + len - 1) * heads + h];
    float acc[4][2] = {};
    for (u32 s0 = 0; s0 < len; s0 += TK) {
        if (tid < TK) {
            const u32 s = s0 + tid;
            ws[tid] = s < len ? expf(a_end - acum[(u64)(tok + s) * heads + h]) * dtv[(u64)(tok + s) * heads + h]
                              : 0.0f;
        }
        __syncthreads();
        for (int i = tid; i < TK * TM; i += ST_THREADS) {
            const int k = i / TM, m = i % TM;
            const u32 s = s0 + k, p = p0 + m;
            As[k][m] = (s < len && p < P) ? load(x, (i64)(tok + s) * x_ld + (i64)h * P + p) : 0.0f;
        }
        for (int i = tid; i < TK * TN; i += ST_THREADS) {
            const int k = i / TN, n = i % TN;
            const u32 s = s0 + k, col = n0 + n;
            Bs[k][n] = (s < len && col < N) ? ws[k] * load(b, (i64)(tok + s) * bc_ld + (i64)g * N + col) : 0.0f;
        }
        __syncthreads();
        simt_fma(acc, As, Bs, ty, tx);
        __syncthreads();
    }
    float* out = states + ((u64)ck * heads + h) * P * N;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 p = p0 + ty + 8 * i, n = n0 + tx + 32 * j;
            if (p < P && n < N) out[(u64)p * N + n] = acc[i][j];
        }
}

// ---------------------------------------------------------------------------------------
// SSD step 3: state passing (f32). CTA (head, element tile, prompt entry); each thread
// carries PASS_PER elements of the head's P×N state, strided by the CTA size. The chain over
// chunks is latency-bound: enough loads must be in flight. 4 elements per thread ran at
// 0.5 TB/s on an H200 (47 registers: 5 CTAs per SM, two waves at T = 8192); 8 per thread at
// ≤ 64 registers keeps 4 CTAs per SM and one wave (not yet measured).

constexpr int PASS_THREADS = 256;  // ssd.rs: PASS_THREADS
constexpr int PASS_PER = 8;        // ssd.rs: PASS_PER

template <typename S>
__device__ void ssd_pass(float* states, const float* acum, S* pool, const u32* seq_slot,
                         const u32* seq_chunk, const u32* seq_chunks, const u32* ck_tok,
                         const u32* ck_len, const u32* ck_snap, const u32* ck_snaps,
                         const u32* snap_slot, u32 seq_base, u32 heads, u32 pn, u32 layer,
                         u32 layers, u32 slots, u32 tiles) {
    u32 r = blockIdx.x;
    const u32 h = r % heads;
    r /= heads;
    const u32 tile = r % tiles;
    const u32 e = seq_base + r / tiles;
    const u64 per = (u64)heads * pn;
    S* live = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (live) live += (u64)h * pn;
    const u32 i0 = tile * PASS_THREADS * PASS_PER + threadIdx.x;
    float hv[PASS_PER];
#pragma unroll
    for (int v = 0; v < PASS_PER; ++v) {
        const u32 i = i0 + v * PASS_THREADS;
        hv[v] = (live && i < pn) ? load(live, i) : 0.0f;
    }
    const u32 c0 = seq_chunk[e], nc = seq_chunks[e];
    // Software-pipelined over chunks: the next chunk's local state and decay are loaded
    // before this chunk's entering state is stored. (Without it, every trip waits a full
    // memory round trip: the loads cannot move above stores to the same buffer.)
    float s[PASS_PER];
    float decay = 0.0f;
    auto fetch = [&](u32 ck, float (&dst)[PASS_PER], float& dec) {
        const float* sp = states + ((u64)ck * heads + h) * pn;
        dec = expf(acum[(u64)(ck_tok[ck] + ck_len[ck] - 1) * heads + h]);
#pragma unroll
        for (int v = 0; v < PASS_PER; ++v) {
            const u32 i = i0 + v * PASS_THREADS;
            dst[v] = i < pn ? sp[i] : 0.0f;
        }
    };
    if (nc > 0) fetch(c0, s, decay);
    for (u32 ck = c0; ck < c0 + nc; ++ck) {
        float* sp = states + ((u64)ck * heads + h) * pn;
        float next[PASS_PER];
        float next_decay = 0.0f;
        if (ck + 1 < c0 + nc) fetch(ck + 1, next, next_decay);
#pragma unroll
        for (int v = 0; v < PASS_PER; ++v) {
            const u32 i = i0 + v * PASS_THREADS;
            if (i < pn) sp[i] = hv[v];
            hv[v] = decay * hv[v] + s[v];
        }
        const u32 k0 = ck_snap[ck], nk = ck_snaps[ck];
        for (u32 k = k0; k < k0 + nk; ++k) {
            S* dst = layer_state(pool, snap_slot[k], slots, layer, layers, per);
            if (!dst) continue;
            dst += (u64)h * pn;
#pragma unroll
            for (int v = 0; v < PASS_PER; ++v) {
                const u32 i = i0 + v * PASS_THREADS;
                if (i < pn) store(dst, i, hv[v]);
            }
        }
#pragma unroll
        for (int v = 0; v < PASS_PER; ++v) s[v] = next[v];
        decay = next_decay;
    }
    if (!live) return;
#pragma unroll
    for (int v = 0; v < PASS_PER; ++v) {
        const u32 i = i0 + v * PASS_THREADS;
        if (i < pn) store(live, i, hv[v]);
    }
}

// ---------------------------------------------------------------------------------------
// SSD steps 2 and 3 fused (tensor cores): chunk states and state passing in one walk over a
// sequence's chunks, so the state never leaves the chip between chunks. CTA (prompt entry,
// head, half of the state columns); 8 warps, warp w owning the p rows [16·(w mod 4), +16)
// and half of the CTA's columns, whose running state h (f32, from the live slot) and chunk
// end state S_c its threads hold as accumulator fragments. Per chunk: the state entering it
// goes to `hc` as bf16 (all the chunk scan reads), S_c = Xᵀ·(w∘B) is accumulated over the
// chunk's 128-token tiles, then h ← exp(A_end)·h + S_c and the chunk's snapshot slots take h
// (f32 or the pool's type); at the end the live slot does. The tiles of the sequence's
// chunks flow through a CP_STAGES-deep cp.async ring (x, the CTA's B columns, A_s, dt_s and
// the chunk's A_end, the last three from ssd_dt's chunk-major copies), so the loads of the
// next tiles overlap this one's products. The token weights w_s = exp(A_end − A_s)·dt_s
// scale the x fragments in registers (rounded to bf16 there, as the separate kernel rounded
// w∘B).
constexpr int CP_STAGES = 3;  // tiles in the ring
constexpr int CP_SPLIT = 2;   // ssd.rs: CHUNK_PASS_SPLIT (CTAs per (entry, head))

template <int P, int N>
struct ChunkPassLayout {  // ssd.rs: chunk_pass_smem_bytes
    static constexpr int NC = N / CP_SPLIT;  // state columns of a CTA
    static constexpr int LDP = Pad<P>::LD, LDB = Pad<NC>::LD;
    // bf16 offsets within a stage: x rows [SCAN_ROWS][LDP], B rows [SCAN_ROWS][LDB].
    static constexpr int XS = 0, BS = SCAN_ROWS * LDP, STAGE = BS + SCAN_ROWS * LDB;
    // f32 offsets after the bf16 stages: per stage A_s [SCAN_ROWS], dt_s [SCAN_ROWS], A_end
    // (padded to 4); then the weights of the tile being multiplied [SCAN_ROWS].
    static constexpr int F0 = CP_STAGES * STAGE / 2, FST = 2 * SCAN_ROWS + 4;
    static constexpr int WS = F0 + CP_STAGES * FST;
    // Then per stage its tile's record (u32 [8]): valid rows (0: no tile, the walk is over),
    // flags (1: the chunk's first tile, 2: its last), chunk, first snapshot, snapshots.
    static constexpr int META = WS + SCAN_ROWS;
    static constexpr int BYTES = (META + CP_STAGES * 8) * 4;
    static_assert(STAGE % 8 == 0 && F0 % 4 == 0 && FST % 4 == 0, "16-byte stage alignment");
};

// A bf16x2 register with both halves multiplied by (w.x, w.y), rounded back to bf16.
__device__ __forceinline__ u32 scale_bf16x2(u32 v, float2 w) {
    return pack_bf16x2(__uint_as_float(v << 16) * w.x, __uint_as_float(v & 0xffff0000u) * w.y);
}

template <int P, int N, typename S>
__device__ void chunk_pass_mma(const bf16* x, const bf16* b, const float* ck_dt, const float* ck_a,
                               bf16* hc, S* pool, const u32* seq_slot, const u32* seq_chunk,
                               const u32* seq_chunks, const u32* ck_tok, const u32* ck_len,
                               const u32* ck_snap, const u32* ck_snaps, const u32* snap_slot,
                               u32 seq_base, u32 heads, u32 groups, u32 x_ld, u32 bc_ld,
                               u32 layer, u32 layers, u32 slots, u32 rec_rows) {
    using Ly = ChunkPassLayout<P, N>;
    constexpr int NC = Ly::NC, NW = NC / 2, LDP = Ly::LDP, LDB = Ly::LDB, NT = NW / 8;
    static_assert(P == 64 && SCAN_THREADS == 256 && NW % 16 == 0, "4 × 16 p rows, 2 column halves");
    bf16* smem = reinterpret_cast<bf16*>(ssm_dyn_smem);
    float* fsm = reinterpret_cast<float*>(ssm_dyn_smem);
    u32 r = blockIdx.x;
    const u32 split = r % CP_SPLIT;
    r /= CP_SPLIT;
    const u32 h = r % heads, e = seq_base + r / heads;
    const u32 g = h / (heads / groups);
    const u32 n0 = split * NC;
    const u64 pn = (u64)P * N, per = pn * heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mat = lane >> 3, mr = lane & 7, gq = lane >> 2, tq = lane & 3;
    const int pw = warp & 3, nw = warp >> 2;
    // This thread's state elements: rows prow and prow + 8, columns ncol + 8j (+1).
    const int prow = 16 * pw + gq;
    const int ncol = (int)n0 + nw * NW + 2 * tq;

    S* live = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (live) live += (u64)h * pn;
    float hs[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const i64 i = (i64)(prow + 8 * (q >> 1)) * N + ncol + 8 * j + (q & 1);
            hs[j][q] = live ? load(live, i) : 0.0f;
        }

    const u32 c0 = seq_chunk[e], c_end = c0 + seq_chunks[e];
    u32* meta = reinterpret_cast<u32*>(fsm + Ly::META);
    // The next tile to request: chunk ick, rows from is0. The chunk's columns are loaded into
    // registers when the walk reaches it, one request before they are used, so no request
    // waits on a table read (the small L1 left beside the shared memory does not keep them).
    u32 ick = c0, is0 = 0;
    u32 i_tok = 0, i_len = 0, i_snap = 0, i_snaps = 0;
    auto chunk_cols = [&]() {
        if (ick < c_end) {
            i_tok = ck_tok[ick];
            i_len = ck_len[ick];
            i_snap = ck_snap[ick];
            i_snaps = ck_snaps[ick];
        }
    };
    chunk_cols();
    // The weight inputs of the tile issued last (threads < SCAN_ROWS; w_valid 0: no tile).
    int w_valid = 0;
    float w_a = 0.0f, w_dt = 0.0f, w_end = 0.0f;
    auto issue = [&](int stage) {
        w_valid = 0;
        u32* m = meta + stage * 8;
        if (ick < c_end) {
            const u32 tok = i_tok, len = i_len;
            const int valid = (int)min((u32)SCAN_ROWS, len - is0);
            bf16* st = smem + stage * Ly::STAGE;
            stage_rows<P, SCAN_ROWS, SCAN_THREADS>(st + Ly::XS, x + (i64)(tok + is0) * x_ld + (i64)h * P,
                                                   x_ld, valid, threadIdx.x);
            stage_rows<NC, SCAN_ROWS, SCAN_THREADS>(st + Ly::BS, b + (i64)(tok + is0) * bc_ld + (i64)g * N + n0,
                                                    bc_ld, valid, threadIdx.x);
            // A_s and dt_s of this thread's row (threads < SCAN_ROWS) from the chunk-major
            // copies, and the chunk's A_end, into registers: the weight is computed after the
            // current tile's products (finish_weights), its loads' latency hidden by them.
            if (threadIdx.x < SCAN_ROWS) {
                const u64 rec = ((u64)ick * heads + h) * rec_rows;
                const int s = threadIdx.x;
                w_valid = valid;
                w_a = s < valid ? ck_a[rec + is0 + s] : 0.0f;
                w_dt = s < valid ? ck_dt[rec + is0 + s] : 0.0f;
                w_end = ck_a[rec + len - 1];
            }
            const bool last = is0 + SCAN_ROWS >= len;
            if (threadIdx.x == 0) {
                m[0] = (u32)valid;
                m[1] = (is0 == 0 ? 1u : 0u) | (last ? 2u : 0u);
                m[2] = ick;
                m[3] = i_snap;
                m[4] = i_snaps;
            }
            is0 += SCAN_ROWS;
            if (last) {
                ++ick;
                is0 = 0;
                chunk_cols();
            }
        } else if (threadIdx.x == 0) {
            m[0] = 0;
        }
        cp_async_commit_group();  // possibly empty: one group per tile slot keeps the count
    };
    // The issued tile's weights w_s = exp(A_end − A_s)·dt_s (zero past its rows) and A_end into
    // its stage's f32 slot; read after the next barrier.
    auto finish_weights = [&](int stage) {
        if (threadIdx.x < SCAN_ROWS && w_valid > 0) {
            float* f = fsm + Ly::F0 + stage * Ly::FST;
            const int s = threadIdx.x;
            f[s] = s < w_valid ? expf(w_end - w_a) * w_dt : 0.0f;
            if (s == 0) f[2 * SCAN_ROWS] = w_end;
        }
    };
#pragma unroll
    for (int st = 0; st < CP_STAGES - 1; ++st) {
        issue(st);
        finish_weights(st);
    }

    float acc[NT][4] = {};
    for (int it = 0;; ++it) {
        const int stage = it % CP_STAGES;
        cp_async_wait_groups<CP_STAGES - 2>();  // this tile's group is complete
        __syncthreads();  // ... for every thread; and every thread is done with the last tile
        issue((it + CP_STAGES - 1) % CP_STAGES);
        const u32* m = meta + stage * 8;
        const int valid = (int)m[0];
        if (valid == 0) break;  // (the same record for every thread)
        const u32 flags = m[1], cck = m[2];
        const float* f = fsm + Ly::F0 + stage * Ly::FST;
        const float* ws = f;  // this tile's weights (written before the barrier above)
        if (flags & 1u) {
            // The state entering chunk cck, for the chunk scan.
            bf16* dst = hc + ((u64)cck * heads + h) * pn;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = ncol + 8 * j;
                *reinterpret_cast<u32*>(dst + (u64)prow * N + n) = pack_bf16x2(hs[j][0], hs[j][1]);
                *reinterpret_cast<u32*>(dst + (u64)(prow + 8) * N + n) = pack_bf16x2(hs[j][2], hs[j][3]);
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
            }
        }
        const bf16* xs = smem + stage * Ly::STAGE + Ly::XS;
        const bf16* bs = smem + stage * Ly::STAGE + Ly::BS;
#pragma unroll
        for (int kk = 0; kk < SCAN_ROWS / 16; ++kk) {
            // (Rows past the tile's valid ones are zero, with zero weights.)
            // A (m = p, k = s) from xs[s][p], transposed; its k pairs (2tq, 2tq + 1) and
            // (2tq + 8, 2tq + 9) scaled by their tokens' weights.
            u32 a[4];
            ldsm4_t(a, xs + (16 * kk + mr + ((mat >> 1) << 3)) * LDP + 16 * pw + ((mat & 1) << 3));
            const float2 w0 = *reinterpret_cast<const float2*>(ws + 16 * kk + 2 * tq);
            const float2 w1 = *reinterpret_cast<const float2*>(ws + 16 * kk + 2 * tq + 8);
            a[0] = scale_bf16x2(a[0], w0);
            a[1] = scale_bf16x2(a[1], w0);
            a[2] = scale_bf16x2(a[2], w1);
            a[3] = scale_bf16x2(a[3], w1);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                // B (k = s, n) from bs[s][n], transposed: (b0, b1) of n tiles j and j + 1.
                u32 bb[4];
                ldsm4_t(bb, bs + (16 * kk + mr + ((mat & 1) << 3)) * LDB + nw * NW + 8 * j + ((mat >> 1) << 3));
                mma(acc[j], a, bb[0], bb[1]);
                mma(acc[j + 1], a, bb[2], bb[3]);
            }
        }
        finish_weights((it + CP_STAGES - 1) % CP_STAGES);
        if (!(flags & 2u)) continue;  // more tiles of this chunk
        const float decay = expf(f[2 * SCAN_ROWS]);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) hs[j][q] = decay * hs[j][q] + acc[j][q];
        const u32 k0 = m[3], nk = m[4];
        for (u32 k = k0; k < k0 + nk; ++k) {
            S* dst = layer_state(pool, snap_slot[k], slots, layer, layers, per);
            if (!dst) continue;
            dst += (u64)h * pn;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    store(dst, (i64)(prow + 8 * (q >> 1)) * N + ncol + 8 * j + (q & 1), hs[j][q]);
        }
    }
    if (!live) return;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q)
            store(live, (i64)(prow + 8 * (q >> 1)) * N + ncol + 8 * j + (q & 1), hs[j][q]);
}
}  // namespace ssm

// ---------------------------------------------------------------------------------------
// Entry points (ssd.rs: STATE_ENTRIES).

#define DT_PARAMS(T)                                                                          \
    const T *dt, const T *dt_bias, const T *a_log, float *dtv, float *acum, float *ck_a,        \
        float *ck_dt, const u32 *ck_tok, const u32 *ck_len, u32 heads, u32 dt_ld,              \
        u32 head_blocks, u32 rec_rows, float dt_min, float dt_max
#define DT_ARGS                                                                               \
    dt, dt_bias, a_log, dtv, acum, ck_a, ck_dt, ck_tok, ck_len, heads, dt_ld, head_blocks,     \
        rec_rows, dt_min, dt_max

extern "C" __global__ void __launch_bounds__(256) ssd_dt_f32(DT_PARAMS(float)) { CHIMERA_PDL_ENTRY(); ssm::ssd_dt(DT_ARGS); }
extern "C" __global__ void __launch_bounds__(256) ssd_dt_bf16(DT_PARAMS(bf16)) { CHIMERA_PDL_ENTRY(); ssm::ssd_dt(DT_ARGS); }

#define STATES_PARAMS(T)                                                                      \
    const T *x, const T *b, const float *dtv, const float *acum, float *states,                \
        const u32 *ck_tok, const u32 *ck_len, u32 heads, u32 head_dim, u32 groups, u32 state,  \
        u32 x_ld, u32 bc_ld, u32 p_tiles, u32 n_tiles

extern "C" __global__ void __launch_bounds__(256) ssd_states_simt_f32(STATES_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::states_simt(x, b, dtv, acum, states, ck_tok, ck_len, heads, head_dim, groups, state,
                     x_ld, bc_ld, p_tiles, n_tiles);
}
extern "C" __global__ void __launch_bounds__(256) ssd_states_simt_bf16(STATES_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::states_simt(x, b, dtv, acum, states, ck_tok, ck_len, heads, head_dim, groups, state,
                     x_ld, bc_ld, p_tiles, n_tiles);
}

#define PASS_PARAMS(S)                                                                        \
    float *states, const float *acum, S *pool, const u32 *seq_slot, const u32 *seq_chunk,       \
        const u32 *seq_chunks, const u32 *ck_tok, const u32 *ck_len, const u32 *ck_snap,        \
        const u32 *ck_snaps, const u32 *snap_slot, u32 seq_base, u32 heads, u32 pn, u32 layer,  \
        u32 layers, u32 slots, u32 tiles
#define PASS_ARGS                                                                             \
    states, acum, pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap, ck_snaps,    \
        snap_slot, seq_base, heads, pn, layer, layers, slots, tiles

extern "C" __global__ void __launch_bounds__(256, 4) ssd_pass(PASS_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::ssd_pass(PASS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 4) ssd_pass_sbf16(PASS_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::ssd_pass(PASS_ARGS);
}

// Chunk states and state passing in one kernel (bf16, head_dim 64, state 64 | 128): `hc`
// takes each chunk's entering state as bf16 [chunks, heads, P, N] for the chunk scan.
#define CHUNK_PASS_PARAMS(S)                                                                  \
    const bf16 *x, const bf16 *b, const float *ck_dt, const float *ck_a, bf16 *hc, S *pool,     \
        const u32 *seq_slot, const u32 *seq_chunk, const u32 *seq_chunks, const u32 *ck_tok,   \
        const u32 *ck_len, const u32 *ck_snap, const u32 *ck_snaps, const u32 *snap_slot,      \
        u32 seq_base, u32 heads, u32 groups, u32 x_ld, u32 bc_ld, u32 layer, u32 layers,       \
        u32 slots, u32 rec_rows
#define CHUNK_PASS_ARGS                                                                       \
    x, b, ck_dt, ck_a, hc, pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap,      \
        ck_snaps, snap_slot, seq_base, heads, groups, x_ld, bc_ld, layer, layers, slots,       \
        rec_rows

extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_pass_mma_p64n64_bf16(CHUNK_PASS_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::chunk_pass_mma<64, 64>(CHUNK_PASS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_pass_mma_p64n128_bf16(CHUNK_PASS_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::chunk_pass_mma<64, 128>(CHUNK_PASS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_pass_mma_p64n64_bf16_sbf16(CHUNK_PASS_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::chunk_pass_mma<64, 64>(CHUNK_PASS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_pass_mma_p64n128_bf16_sbf16(CHUNK_PASS_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::chunk_pass_mma<64, 128>(CHUNK_PASS_ARGS);
}
