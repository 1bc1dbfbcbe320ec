// The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over the SSM plan's
// entries (the planner: gdn.rs; columns and layouts: ssm.cuh). Per value head h (key head
// kh = h / (v_heads / k_heads)) the state is S [dk, dv]; each token t, with q and k
// L2-normalised (q also scaled by dk^-1/2), decay g = −exp(A_log)·softplus(a + dt_bias) and
// β = sigmoid(b):
//     S ← exp(g)·S;  δ = β(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq.
// Written as one pass over the state: with sk = S_oldᵀk and sq = S_oldᵀq,
//     δ = β(v − e^g sk),  o = e^g sq + δ (k·q),  S ← e^g S_old + k δᵀ.
//
// - gdn_prep: per token, the normalised q and k (f32), k·q per key head, g and β per value
//   head, into scratch (every value head of a key head reads them).
// - gdn_scan: CTA (entry, value head, 4·C columns of v), one warp per C columns; lane l holds
//   rows l, l + 32, … of those columns of S in registers and walks the entry's tokens in
//   order (decodes: their one token), the 2·C column sums of a token reduced across the
//   warp; at each chunk end that carries snapshots (and after a decode's token) the state
//   goes to the snapshot slots, and at the end to the live slot. A padding entry (live
//   slot ≥ slots) writes zero outputs and touches no state. The columns of S are independent
//   of one another, so the decodes (bound by memory) take C = 8, 32 state values a lane in
//   flight, and the prompts (bound by the per-token chain) C = 2: four times the warps to
//   hide one another's latency, and a quarter of the shuffles a token.
// - gdn_decode: the decodes when the value dim is a multiple of the state's 16-byte vector
//   (every published shape): the same step with the state read and written in whole lines
//   (see the kernel); gdn_scan with C = 8 takes the other shapes.
// - gdn_prompt: the prompts when dk ≤ 128 (every published shape): the same recurrence with
//   the tokens staged through shared memory a block ahead and four row lanes a column (see
//   the kernel); gdn_scan with C = 2 takes larger key dims.
//
// The state pool is f32 or bf16 (rounded once per step and at each snapshot); every sum is
// f32. This is the recurrent form for prompts too: exact against the CPU's chunked form up to
// rounding, bound by the per-token chain of the recurrence (a few shuffles and FMAs a token
// once the operands are staged) rather than by memory for long prompts; the chunked
// tensor-core form would take that chain from per token to per chunk. Decode reads and writes
// the state once.
#include "ssm.cuh"

namespace ssm {

constexpr int GDN_THREADS = 128;  // gdn.rs: GDN_THREADS

template <typename T>
__device__ void gdn_prep(const T* q, const T* k, const T* a, const T* b, const T* a_log,
                         const T* dt_bias, float* qn, float* kn, float* qk, float* g,
                         float* beta, u32 k_heads, u32 dk, u32 v_heads, u32 q_ld, u32 ab_ld) {
    const u32 t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float scale = rsqrtf((float)dk);
    const u32 kcols = k_heads * dk;
    for (u32 kh = warp; kh < k_heads; kh += GDN_THREADS / 32) {
        const T* qr = q + (i64)t * q_ld + kh * dk;
        const T* kr = k + (i64)t * q_ld + kh * dk;
        float sq = 0.0f, sk = 0.0f, d = 0.0f;
        for (u32 i = lane; i < dk; i += 32) {
            const float x = load(qr, i), y = load(kr, i);
            sq += x * x;
            sk += y * y;
            d += x * y;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        d = warp_sum(d);
        const float iq = 1.0f / sqrtf(sq + 1e-6f) * scale, ik = 1.0f / sqrtf(sk + 1e-6f);
        for (u32 i = lane; i < dk; i += 32) {
            qn[(i64)t * kcols + kh * dk + i] = load(qr, i) * iq;
            kn[(i64)t * kcols + kh * dk + i] = load(kr, i) * ik;
        }
        if (lane == 0) qk[(i64)t * k_heads + kh] = d * iq * ik;
    }
    for (u32 h = threadIdx.x; h < v_heads; h += GDN_THREADS) {
        const float x = load(a, (i64)t * ab_ld + h) + load(dt_bias, h);
        const float sp = x > 20.0f ? x : log1pf(expf(x));
        g[(i64)t * v_heads + h] = -expf(load(a_log, h)) * sp;
        beta[(i64)t * v_heads + h] = 1.0f / (1.0f + expf(-load(b, (i64)t * ab_ld + h)));
    }
}

// One token's operands as one lane reads them (R rows, C columns a warp).
template <int R, int C>
struct GdnTok {
    float k[R], q[R], v[C];
    float g, beta, qk;
};

template <typename T, int R, int C>
__device__ __forceinline__ void gdn_load_tok(GdnTok<R, C>& o, const float* qn, const float* kn,
                                             const float* qk, const float* g, const float* beta,
                                             const T* v, u32 t, u32 h, u32 kh, u32 c0, int lane,
                                             u32 dk, u32 dv, u32 k_heads, u32 v_heads, u32 v_ld) {
    const i64 kb = (i64)t * k_heads * dk + (i64)kh * dk;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 i = lane + 32 * r;
        o.k[r] = i < dk ? kn[kb + i] : 0.0f;
        o.q[r] = i < dk ? qn[kb + i] : 0.0f;
    }
    const i64 vb = (i64)t * v_ld + (i64)h * dv;
#pragma unroll
    for (int j = 0; j < C; ++j) o.v[j] = c0 + j < dv ? load(v, vb + c0 + j) : 0.0f;
    o.g = g[(i64)t * v_heads + h];
    o.beta = beta[(i64)t * v_heads + h];
    o.qk = qk[(i64)t * k_heads + kh];
}

// Rows lane + 32r, columns c0 .. c0 + C of a head's state at `st` ([dk, dv]).
template <typename S, int R, int C>
__device__ __forceinline__ void gdn_state_io(S* st, float (&s)[R][C], int lane, u32 c0, u32 dk,
                                             u32 dv, bool write) {
    const bool vec = C % VEC<S> == 0 && dv % C == 0 && c0 + C <= dv && aligned16(st);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 i = lane + 32 * r;
        if (i >= dk) {
            if (!write) {
#pragma unroll
                for (int j = 0; j < C; ++j) s[r][j] = 0.0f;
            }
            continue;
        }
        const i64 base = (i64)i * dv + c0;
        if (vec) {
#pragma unroll
            for (int j = 0; j < C; j += VEC<S>) {
                if (write) store16(st, base + j, &s[r][j]);
                else load16(st, base + j, &s[r][j]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < C; ++j) {
                if (c0 + j >= dv) {
                    if (!write) s[r][j] = 0.0f;
                } else if (write) {
                    store(st, base + j, s[r][j]);
                } else {
                    s[r][j] = load(st, base + j);
                }
            }
        }
    }
}

template <typename S, int R, int C>
__device__ __forceinline__ void gdn_snapshots(S* pool, const u32* snap_slot, u32 first, u32 n,
                                              float (&s)[R][C], int lane, u32 c0, u32 dk,
                                              u32 dv, u32 layer, u32 layers, u32 slots, u64 per,
                                              u64 head_off) {
    for (u32 m = first; m < first + n; ++m) {
        S* dst = layer_state(pool, snap_slot[m], slots, layer, layers, per);
        if (dst) gdn_state_io<S, R, C>(dst + head_off, s, lane, c0, dk, dv, true);
    }
}

template <typename T, typename S, int R, int C>
__device__ void gdn_scan(const float* qn, const float* kn, const float* qk, const float* g,
                         const float* beta, const T* v, T* out, S* pool, const u32* seq_tok,
                         const u32* seq_len, const u32* seq_slot, const u32* seq_chunk,
                         const u32* seq_chunks, const u32* seq_snap, const u32* seq_snaps,
                         const u32* ck_tok, const u32* ck_len, const u32* ck_snap,
                         const u32* ck_snaps, const u32* snap_slot, u32 e0, u32 decodes, u32 k_heads,
                         u32 v_heads, u32 dk, u32 dv, u32 v_ld, u32 out_ld, u32 layer, u32 layers,
                         u32 slots) {
    const u32 col_blocks = (dv + 4 * C - 1) / (4 * C);
    const u32 cb = blockIdx.x % col_blocks;
    const u32 h = (blockIdx.x / col_blocks) % v_heads;
    const u32 e = e0 + blockIdx.x / (col_blocks * v_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 c0 = cb * 4 * C + warp * C;
    if (c0 >= dv) return;
    const u32 kh = h / (v_heads / k_heads);
    const u32 tok0 = seq_tok[e], len = seq_len[e];
    const u64 per = (u64)v_heads * dk * dv, head_off = (u64)h * dk * dv;
    S* live = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (!live) {
        for (u32 t = tok0; t < tok0 + len; ++t)
            if (lane < C && c0 + lane < dv) store(out, (i64)t * out_ld + h * dv + c0 + lane, 0.0f);
        return;
    }
    float s[R][C];
    gdn_state_io<S, R, C>(live + head_off, s, lane, c0, dk, dv, false);
    // The chunk whose end comes next (prompts), and where it ends.
    u32 ck = e < decodes ? 0 : seq_chunk[e];
    const u32 ck_end = e < decodes ? 0 : ck + seq_chunks[e];
    u32 next_end = ck < ck_end ? ck_tok[ck] + ck_len[ck] : 0;
    GdnTok<R, C> cur, nxt{};
    gdn_load_tok<T, R, C>(cur, qn, kn, qk, g, beta, v, tok0, h, kh, c0, lane, dk, dv, k_heads,
                       v_heads, v_ld);
    for (u32 t = tok0; t < tok0 + len; ++t) {
        if (t + 1 < tok0 + len)
            gdn_load_tok<T, R, C>(nxt, qn, kn, qk, g, beta, v, t + 1, h, kh, c0, lane, dk, dv,
                               k_heads, v_heads, v_ld);
        float sk[C], sq[C];
#pragma unroll
        for (int j = 0; j < C; ++j) {
            float a = 0.0f, b = 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                a += s[r][j] * cur.k[r];
                b += s[r][j] * cur.q[r];
            }
            sk[j] = a;
            sq[j] = b;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int j = 0; j < C; ++j) {
                sk[j] += __shfl_xor_sync(0xffffffffu, sk[j], off);
                sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], off);
            }
        }
        const float decay = expf(cur.g);
        float mine = 0.0f;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            const float delta = cur.beta * (cur.v[j] - decay * sk[j]);
            const float o = decay * sq[j] + delta * cur.qk;
            if (lane == j) mine = o;
#pragma unroll
            for (int r = 0; r < R; ++r) s[r][j] = decay * s[r][j] + cur.k[r] * delta;
        }
        if (lane < C && c0 + lane < dv) store(out, (i64)t * out_ld + h * dv + c0 + lane, mine);
        if (e < decodes) {
            gdn_snapshots<S, R, C>(pool, snap_slot, seq_snap[e], seq_snaps[e], s, lane, c0, dk, dv,
                                layer, layers, slots, per, head_off);
        } else if (t + 1 == next_end) {
            gdn_snapshots<S, R, C>(pool, snap_slot, ck_snap[ck], ck_snaps[ck], s, lane, c0, dk, dv,
                                layer, layers, slots, per, head_off);
            ++ck;
            next_end = ck < ck_end ? ck_tok[ck] + ck_len[ck] : 0;
        }
        cur = nxt;
    }
    gdn_state_io<S, R, C>(live + head_off, s, lane, c0, dk, dv, true);
}

// Prompts with their tokens staged through shared memory: CTA (prompt entry, value head,
// 4·8·C columns of v), 4 warps; lane (rl = lane / 8, cl = lane mod 8) of warp w holds columns
// c0 + cl·C + j (c0 = the warp's first, j < C) of rows 16m + 4·rl + u (m < R/4, u < 4) of S,
// so a token's column sums reduce over the four row lanes in two shuffles (gdn_scan: five),
// and a lane reads its rows of k and q as R/4 16-byte vectors whose four row lanes hit
// distinct banks. The entry's tokens go through shared memory in blocks of GDN_TB: the normed
// k and q by cp.async, v, e^g, β and k·q through registers, the next block in flight while
// this one runs, so no global load sits on the per-token chain (gdn_scan waits for the next
// token's operands from L2 at every token). dk ≤ 4R (rows past dk are zeros).
constexpr int GDN_TB = 16;

template <int R, int COLS>
struct GdnStage {
    float kq[2][GDN_TB][2][4 * R];  // normed k, then q (zeros past dk)
    float v[2][GDN_TB][COLS];
    float sc[2][GDN_TB][3];  // e^g, β, k·q
};

template <typename T, typename S, int R, int C>
__device__ void gdn_prompt(const float* qn, const float* kn, const float* qk, const float* g,
                           const float* beta, const T* v, T* out, S* pool, const u32* seq_tok,
                           const u32* seq_len, const u32* seq_slot, const u32* seq_chunk,
                           const u32* seq_chunks, const u32* ck_tok, const u32* ck_len,
                           const u32* ck_snap, const u32* ck_snaps, const u32* snap_slot, u32 e0,
                           u32 k_heads, u32 v_heads, u32 dk, u32 dv, u32 v_ld, u32 out_ld,
                           u32 layer, u32 layers, u32 slots) {
    constexpr int COLS = GDN_THREADS / 32 * 8 * C, DKP = 4 * R;
    __shared__ __align__(16) GdnStage<R, COLS> sm;
    const u32 col_blocks = (dv + COLS - 1) / COLS;
    const u32 cb = blockIdx.x % col_blocks;
    const u32 h = (blockIdx.x / col_blocks) % v_heads;
    const u32 e = e0 + blockIdx.x / (col_blocks * v_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rl = lane >> 3, cl = lane & 7;
    const u32 cta_c0 = cb * COLS;
    const int lc0 = warp * 8 * C + cl * C;  // this lane's first column in the CTA's
    const u32 kh = h / (v_heads / k_heads);
    const u32 tok0 = seq_tok[e], len = seq_len[e];
    const u64 per = (u64)v_heads * dk * dv, head_off = (u64)h * dk * dv;
    S* live = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (!live) {
        for (u32 t = tok0; t < tok0 + len; ++t)
            for (u32 c = tid; c < COLS; c += GDN_THREADS)
                if (cta_c0 + c < dv) store(out, (i64)t * out_ld + h * dv + cta_c0 + c, 0.0f);
        return;
    }
    // Rows past dk stay zero in both buffers (the copies below write rows < dk only).
    for (int i = tid; i < 2 * GDN_TB * 2 * DKP; i += GDN_THREADS) (&sm.kq[0][0][0][0])[i] = 0.0f;
    __syncthreads();

    const u32 kcols = k_heads * dk;
    const bool vec4 = dk % 4 == 0;
    // Stage block b's k and q (cp.async) into buffer b & 1.
    auto stage_kq = [&](u32 b) {
        const int buf = b & 1;
        const u32 t0 = b * GDN_TB;
        const u32 n = min((u32)GDN_TB, len - t0);
        if (vec4) {
            const u32 per_row = dk / 4;
            for (u32 x = tid; x < n * 2 * per_row; x += GDN_THREADS) {
                const u32 tt = x / (2 * per_row), rest = x % (2 * per_row);
                const u32 which = rest / per_row, i = 4 * (rest % per_row);
                const float* src = (which ? qn : kn) + (i64)(tok0 + t0 + tt) * kcols + kh * dk + i;
                cp_async_16(smem_addr(&sm.kq[buf][tt][which][i]), src, 16);
            }
        } else {
            for (u32 x = tid; x < n * 2 * dk; x += GDN_THREADS) {
                const u32 tt = x / (2 * dk), rest = x % (2 * dk);
                const u32 which = rest / dk, i = rest % dk;
                const float* src = (which ? qn : kn) + (i64)(tok0 + t0 + tt) * kcols + kh * dk + i;
                cp_async_4(smem_addr(&sm.kq[buf][tt][which][i]), src, 4);
            }
        }
        cp_async_commit_group();
    };
    // Block b's v columns and scalars into registers (VR values a thread), then into
    // shared memory once the block before has been read.
    constexpr int VR = (GDN_TB * COLS + GDN_THREADS - 1) / GDN_THREADS;
    float vreg[VR], sreg = 0.0f;
    auto load_regs = [&](u32 b) {
        const u32 t0 = b * GDN_TB;
#pragma unroll
        for (int k = 0; k < VR; ++k) {
            const int x = tid + k * GDN_THREADS;
            const u32 tt = x / COLS, c = x % COLS;
            const bool in = x < GDN_TB * COLS && t0 + tt < len && cta_c0 + c < dv;
            vreg[k] = in ? load(v, (i64)(tok0 + t0 + tt) * v_ld + h * dv + cta_c0 + c) : 0.0f;
        }
        if (tid < 3 * GDN_TB) {
            const u32 tt = tid / 3, which = tid % 3;
            const u32 t = tok0 + t0 + tt;
            if (t0 + tt < len) {
                sreg = which == 0   ? expf(g[(i64)t * v_heads + h])
                       : which == 1 ? beta[(i64)t * v_heads + h]
                                    : qk[(i64)t * k_heads + kh];
            }
        }
    };
    auto store_regs = [&](u32 b) {
        const int buf = b & 1;
#pragma unroll
        for (int k = 0; k < VR; ++k) {
            const int x = tid + k * GDN_THREADS;
            if (x < GDN_TB * COLS) sm.v[buf][x / COLS][x % COLS] = vreg[k];
        }
        if (tid < 3 * GDN_TB) sm.sc[buf][tid / 3][tid % 3] = sreg;
    };

    float s[R][C];
#pragma unroll
    for (int m = 0; m < R / 4; ++m) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const u32 i = 16 * m + 4 * rl + u;
#pragma unroll
            for (int j = 0; j < C; ++j) {
                const u32 c = cta_c0 + lc0 + j;
                s[4 * m + u][j] =
                    i < dk && c < dv ? load(live + head_off, (i64)i * dv + c) : 0.0f;
            }
        }
    }
    // Writes this lane's part of the state to `dst` (a head's [dk, dv]). The row stride goes
    // through an empty asm so the R·C offsets are computed at each write, not hoisted out of
    // the token loop into registers the state needs.
    auto write_state = [&](S* dst) {
        u32 stride = dv;
        asm volatile("" : "+r"(stride));
        dst += (i64)(4 * rl) * stride + cta_c0 + lc0;
#pragma unroll
        for (int m = 0; m < R / 4; ++m) {
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const u32 i = 16 * m + 4 * rl + u;
#pragma unroll
                for (int j = 0; j < C; ++j) {
                    if (i < dk && cta_c0 + lc0 + j < dv)
                        store(dst, (i64)(16 * m + u) * stride + j, s[4 * m + u][j]);
                }
            }
        }
    };

    u32 ck = seq_chunk[e];
    const u32 ck_end = ck + seq_chunks[e];
    u32 next_end = ck < ck_end ? ck_tok[ck] + ck_len[ck] : 0;
    const u32 blocks = (len + GDN_TB - 1) / GDN_TB;
    stage_kq(0);
    load_regs(0);
    store_regs(0);
#pragma unroll 1
    for (u32 b = 0; b < blocks; ++b) {
        const int buf = b & 1;
        if (b + 1 < blocks) {
            stage_kq(b + 1);
            load_regs(b + 1);
            cp_async_wait_groups<1>();
        } else {
            cp_async_wait_groups<0>();
        }
        __syncthreads();
        const u32 n = min((u32)GDN_TB, len - b * GDN_TB);
#pragma unroll 1
        for (u32 tt = 0; tt < n; ++tt) {
            const u32 t = tok0 + b * GDN_TB + tt;
            float kr[R], qr[R];
#pragma unroll
            for (int m = 0; m < R / 4; ++m) {
                const float4 a = *reinterpret_cast<const float4*>(&sm.kq[buf][tt][0][16 * m + 4 * rl]);
                const float4 c = *reinterpret_cast<const float4*>(&sm.kq[buf][tt][1][16 * m + 4 * rl]);
                kr[4 * m] = a.x, kr[4 * m + 1] = a.y, kr[4 * m + 2] = a.z, kr[4 * m + 3] = a.w;
                qr[4 * m] = c.x, qr[4 * m + 1] = c.y, qr[4 * m + 2] = c.z, qr[4 * m + 3] = c.w;
            }
            // Column sums with four partial sums each (a shorter dependent chain).
            float sk[C], sq[C];
#pragma unroll
            for (int j = 0; j < C; ++j) {
                float a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, q4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    a[r & 3] += s[r][j] * kr[r];
                    q4[r & 3] += s[r][j] * qr[r];
                }
                sk[j] = (a[0] + a[1]) + (a[2] + a[3]);
                sq[j] = (q4[0] + q4[1]) + (q4[2] + q4[3]);
            }
#pragma unroll
            for (int j = 0; j < C; ++j) {
                sk[j] += __shfl_xor_sync(0xffffffffu, sk[j], 8);
                sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], 8);
                sk[j] += __shfl_xor_sync(0xffffffffu, sk[j], 16);
                sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], 16);
            }
            const float decay = sm.sc[buf][tt][0], bt = sm.sc[buf][tt][1], kq = sm.sc[buf][tt][2];
#pragma unroll
            for (int j = 0; j < C; ++j) {
                const float delta = bt * (sm.v[buf][tt][lc0 + j] - decay * sk[j]);
                const u32 c = cta_c0 + lc0 + j;
                if (rl == 0 && c < dv) store(out, (i64)t * out_ld + h * dv + c, decay * sq[j] + delta * kq);
#pragma unroll
                for (int r = 0; r < R; ++r) s[r][j] = decay * s[r][j] + kr[r] * delta;
            }
            if (t + 1 == next_end) {
                for (u32 m = ck_snap[ck]; m < ck_snap[ck] + ck_snaps[ck]; ++m) {
                    S* dst = layer_state(pool, snap_slot[m], slots, layer, layers, per);
                    if (dst) write_state(dst + head_off);
                }
                ++ck;
                next_end = ck < ck_end ? ck_tok[ck] + ck_len[ck] : 0;
            }
        }
        __syncthreads();
        if (b + 1 < blocks) store_regs(b + 1);
    }
    write_state(live + head_off);
}

// Decode, the state read and written in whole 128-byte lines: CTA (decode entry, value head,
// COLS = 8·VEC<S> columns: 32 for an f32 state, 64 for bf16), W warps; lane l of warp w holds
// one 16-byte vector (VEC<S> columns: (l mod 8)·VEC<S>) of rows 4w + l/8 + 4W·r, r < R
// (dk ≤ 4W·R), so a warp's load covers four rows' 128 contiguous bytes and a thread keeps R
// vectors in flight. The column sums go over the four row groups of a warp by shuffles and
// over the warps through shared memory. A bf16 state takes W = 8: its 8 columns a lane double
// the sums a thread makes per byte, and twice the threads halve them (f32: W = 4). Needs dv a
// multiple of VEC<S> (the planner's check).
template <typename T, typename S, int R, int W>
__device__ void gdn_decode(const float* qn, const float* kn, const float* qk, const float* g,
                           const float* beta, const T* v, T* out, S* pool, const u32* seq_tok,
                           const u32* seq_slot, const u32* seq_snap, const u32* seq_snaps,
                           const u32* snap_slot, u32 k_heads, u32 v_heads, u32 dk, u32 dv,
                           u32 v_ld, u32 out_ld, u32 layer, u32 layers, u32 slots) {
    constexpr int V = VEC<S>;
    constexpr int COLS = 8 * V;
    __shared__ float part[W][2][COLS];
    const u32 col_blocks = (dv + COLS - 1) / COLS;
    const u32 cb = blockIdx.x % col_blocks;
    const u32 h = (blockIdx.x / col_blocks) % v_heads;
    const u32 e = blockIdx.x / (col_blocks * v_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cq = lane & 7, rsub = lane >> 3;
    const u32 c0 = cb * COLS + cq * V;
    const bool cols_in = c0 < dv;
    const u32 kh = h / (v_heads / k_heads);
    const u32 t = seq_tok[e];
    const u64 per = (u64)v_heads * dk * dv, head_off = (u64)h * dk * dv;
    S* live = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (!live) {
        if (warp == 0 && rsub == 0 && cols_in) {
#pragma unroll
            for (int j = 0; j < V; ++j)
                if (c0 + j < dv) store(out, (i64)t * out_ld + h * dv + c0 + j, 0.0f);
        }
        return;
    }
    S* st = live + head_off;
    // Every load first: the state vectors, then this token's operands.
    float s[R][V];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 i = 4 * warp + rsub + 4 * W * r;
        if (i < dk && cols_in) {
            load16(st, (i64)i * dv + c0, s[r]);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) s[r][j] = 0.0f;
        }
    }
    const i64 kb = (i64)t * k_heads * dk + (i64)kh * dk;
    float kr[R], qr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 i = 4 * warp + rsub + 4 * W * r;
        kr[r] = i < dk ? kn[kb + i] : 0.0f;
        qr[r] = i < dk ? qn[kb + i] : 0.0f;
    }
    const float decay = expf(g[(i64)t * v_heads + h]);
    const float bt = beta[(i64)t * v_heads + h], kq = qk[(i64)t * k_heads + kh];
    float sk[V], sq[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            a += s[r][j] * kr[r];
            b += s[r][j] * qr[r];
        }
        a += __shfl_xor_sync(0xffffffffu, a, 8);
        b += __shfl_xor_sync(0xffffffffu, b, 8);
        a += __shfl_xor_sync(0xffffffffu, a, 16);
        b += __shfl_xor_sync(0xffffffffu, b, 16);
        sk[j] = a;
        sq[j] = b;
    }
    if (rsub == 0) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            part[warp][0][cq * V + j] = sk[j];
            part[warp][1][cq * V + j] = sq[j];
        }
    }
    __syncthreads();
    float delta[V], o[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int c = cq * V + j;
        float k_sum = 0.0f, q_sum = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            k_sum += part[w][0][c];
            q_sum += part[w][1][c];
        }
        const float vj = c0 + j < dv ? load(v, (i64)t * v_ld + h * dv + c0 + j) : 0.0f;
        delta[j] = bt * (vj - decay * k_sum);
        o[j] = decay * q_sum + delta[j] * kq;
    }
    if (warp == 0 && rsub == 0 && cols_in) {
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (c0 + j < dv) store(out, (i64)t * out_ld + h * dv + c0 + j, o[j]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < V; ++j) s[r][j] = decay * s[r][j] + kr[r] * delta[j];
    }
    if (!cols_in) return;
    const u32 n_snap = seq_snaps[e], first = seq_snap[e];
    for (u32 m = 0; m <= n_snap; ++m) {
        // The snapshot slots, then the live slot.
        S* dst = m < n_snap ? layer_state(pool, snap_slot[first + m], slots, layer, layers, per)
                            : live;
        if (!dst) continue;
        dst += head_off;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u32 i = 4 * warp + rsub + 4 * W * r;
            if (i < dk) store16(dst, (i64)i * dv + c0, s[r]);
        }
    }
}

}  // namespace ssm

#define GDN_PREP(S, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(ssm::GDN_THREADS)                              \
        gdn_prep_##S(const T* q, const T* k, const T* a, const T* b, const T* a_log,            \
                     const T* dt_bias, float* qn, float* kn, float* qk, float* g, float* beta,  \
                     u32 k_heads, u32 dk, u32 v_heads, u32 q_ld, u32 ab_ld) {                   \
        CHIMERA_PDL_ENTRY();                                                                    \
        ssm::gdn_prep(q, k, a, b, a_log, dt_bias, qn, kn, qk, g, beta, k_heads, dk, v_heads,   \
                      q_ld, ab_ld);                                                             \
    }

// The parameters of gdn_scan and gdn_prompt (gdn.rs: SCAN).
#define GDN_SCAN_PARAMS(T, S)                                                                   \
    const float* qn, const float* kn, const float* qk, const float* g, const float* beta,       \
        const T* v, T* out, S* pool, const u32* seq_tok, const u32* seq_len,                    \
        const u32* seq_slot, const u32* seq_chunk, const u32* seq_chunks, const u32* seq_snap,  \
        const u32* seq_snaps, const u32* ck_tok, const u32* ck_len, const u32* ck_snap,         \
        const u32* ck_snaps, const u32* snap_slot, u32 e0, u32 decodes, u32 k_heads,            \
        u32 v_heads, u32 dk, u32 dv, u32 v_ld, u32 out_ld, u32 layer, u32 layers, u32 slots

#define GDN_SCAN(NAME, T, S, R, C)                                                              \
    extern "C" __global__ void __launch_bounds__(ssm::GDN_THREADS) NAME(                        \
        GDN_SCAN_PARAMS(T, S)) {                                                                \
        CHIMERA_PDL_ENTRY();                                                                    \
        ssm::gdn_scan<T, S, R, C>(qn, kn, qk, g, beta, v, out, pool, seq_tok, seq_len,         \
                                  seq_slot, seq_chunk, seq_chunks, seq_snap, seq_snaps,        \
                                  ck_tok, ck_len, ck_snap, ck_snaps, snap_slot, e0, decodes,   \
                                  k_heads, v_heads, dk, dv, v_ld, out_ld, layer, layers,       \
                                  slots);                                                      \
    }

#define GDN_DECODE(NAME, T, S, R, W)                                                            \
    extern "C" __global__ void __launch_bounds__(32 * W) NAME(                                  \
        const float* qn, const float* kn, const float* qk, const float* g, const float* beta,   \
        const T* v, T* out, S* pool, const u32* seq_tok, const u32* seq_slot,                   \
        const u32* seq_snap, const u32* seq_snaps, const u32* snap_slot, u32 k_heads,           \
        u32 v_heads, u32 dk, u32 dv, u32 v_ld, u32 out_ld, u32 layer, u32 layers, u32 slots) {  \
        CHIMERA_PDL_ENTRY();                                                                    \
        ssm::gdn_decode<T, S, R, W>(qn, kn, qk, g, beta, v, out, pool, seq_tok, seq_slot,      \
                                    seq_snap, seq_snaps, snap_slot, k_heads, v_heads, dk, dv,  \
                                    v_ld, out_ld, layer, layers, slots);                       \
    }

#define GDN_PROMPT(NAME, T, S, R, C)                                                            \
    extern "C" __global__ void __launch_bounds__(ssm::GDN_THREADS) NAME(                        \
        GDN_SCAN_PARAMS(T, S)) {                                                                \
        CHIMERA_PDL_ENTRY();                                                                    \
        ssm::gdn_prompt<T, S, R, C>(qn, kn, qk, g, beta, v, out, pool, seq_tok, seq_len,       \
                                    seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap,  \
                                    ck_snaps, snap_slot, e0, k_heads, v_heads, dk, dv, v_ld,   \
                                    out_ld, layer, layers, slots);                             \
    }

#define GDN_PROMPTS(R, C)                                                        \
    GDN_PROMPT(gdn_prompt_r##R##_c##C##_f32, float, float, R, C)                 \
    GDN_PROMPT(gdn_prompt_r##R##_c##C##_bf16, bf16, float, R, C)                 \
    GDN_PROMPT(gdn_prompt_r##R##_c##C##_f32_sbf16, float, bf16, R, C)            \
    GDN_PROMPT(gdn_prompt_r##R##_c##C##_bf16_sbf16, bf16, bf16, R, C)

// The warps of a decode CTA by state type (gdn.rs: decode_warps).
#define GDN_DECODES(R)                                                   \
    GDN_DECODE(gdn_decode_r##R##_f32, float, float, R, 4)                \
    GDN_DECODE(gdn_decode_r##R##_bf16, bf16, float, R, 4)                \
    GDN_DECODE(gdn_decode_r##R##_f32_sbf16, float, bf16, R, 8)           \
    GDN_DECODE(gdn_decode_r##R##_bf16_sbf16, bf16, bf16, R, 8)

#define GDN_SCANS(R, C)                                                          \
    GDN_SCAN(gdn_scan_r##R##_c##C##_f32, float, float, R, C)                     \
    GDN_SCAN(gdn_scan_r##R##_c##C##_bf16, bf16, float, R, C)                     \
    GDN_SCAN(gdn_scan_r##R##_c##C##_f32_sbf16, float, bf16, R, C)                \
    GDN_SCAN(gdn_scan_r##R##_c##C##_bf16_sbf16, bf16, bf16, R, C)

GDN_PREP(f32, float)
GDN_PREP(bf16, bf16)
GDN_SCANS(1, 8)
GDN_SCANS(2, 8)
GDN_SCANS(4, 8)
GDN_SCANS(8, 8)
GDN_SCANS(1, 2)
GDN_SCANS(2, 2)
GDN_SCANS(4, 2)
GDN_SCANS(8, 2)
GDN_DECODES(2)
GDN_DECODES(4)
GDN_DECODES(8)
GDN_DECODES(16)
// (gdn.rs: ENTRIES) Two columns a lane up to 16 rows a lane: 32 rows of two spill.
GDN_PROMPTS(4, 1)
GDN_PROMPTS(8, 1)
GDN_PROMPTS(16, 1)
GDN_PROMPTS(32, 1)
GDN_PROMPTS(4, 2)
GDN_PROMPTS(8, 2)
GDN_PROMPTS(16, 2)
