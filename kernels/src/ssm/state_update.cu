// The selective scan's recurrent step for one-token entries (decodes), after mamba_ssm's
// selective_state_update (the planner: state_update.rs; columns and layouts: ssm.cuh). For
// head h of group g: dt = clamp(softplus(dt_raw + dt_bias)), a = −exp(A_log);
// - ssm_decode: one token: S ← exp(dt·a)·S + dt·x⊗B, y = S·C + D·x (f32), live and snapshots.
// - ssm_recurrent: the same step token by token over short prompts (verify steps), snapshots at
//   chunk ends.
#include "ssm.cuh"

namespace ssm {

// Decode: the recurrent step for one-token entries. The step reads and writes the whole
// P×N state once and is bound by memory; what limits it is how many bytes are in flight, and
// every CTA first waits for a short chain of dependent loads (its entry's slot, then the
// state). So the CTAs are small and many (as mamba_ssm's selective_state_update does):
// CTA (entry, head, slice of `slice_rows` rows of p), 128 threads, a thread holding
// DEC_VECS raw 16-byte state vectors in flight, so that several CTAs stay resident and their
// prologues overlap the others' streaming. When a state row splits into lane slices of
// DEC_COLS 16-byte vectors that divide the warp (`decode_rows_vec`), each lane owns one slice
// of a row; otherwise a warp walks the slice's rows with its lanes over n, two rows in flight
// (`decode_rows`). Measured at batch 256 (NemotronH-8B layer, H200): f32 state 0.62 →
// 0.58 ms, bf16 state 0.54 → 0.31 ms against the one-CTA-per-head kernel this replaced.

constexpr int DEC_THREADS = 128;  // state_update.rs: DEC_THREADS
constexpr int DEC_WARPS = DEC_THREADS / 32;
constexpr int DEC_VECS = 8;  // state_update.rs: DEC_VECS (16-byte state vectors a thread holds at once)

// What one (entry, head) step needs besides the operands: the decay exp(dt·a), dt, D, the
// head's offset inside a layer state, the layer state size and the pool geometry (snapshots).
struct RowStep {
    float decay, dtv, dh;
    u64 head_off, per_layer;
    u32 layer, layers, slots;
};

// Any N: a warp walks rows p ∈ [p0, p1) with its lanes over n, two rows in flight.
template <typename T, typename S>
__device__ void decode_rows(const T* x, const T* b, const T* c, T* out, S* st, S* pool,
                            const u32* snap_slot, u32 k0, u32 nk, u32 p0, u32 p1, u32 N, i64 xrow,
                            i64 brow, i64 yrow, const RowStep& r) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // bf16 state: one row at a time (the register budget of the bf16 kernels' occupancy).
    constexpr u32 ROWS = sizeof(S) == 4 ? 2 : 1;
    for (u32 p = p0 + warp; p < p1; p += ROWS * DEC_WARPS) {
        const u32 p2 = p + DEC_WARPS;
        const bool two = ROWS == 2 && p2 < p1;
        const float x1 = load(x, xrow + p), x2 = two ? load(x, xrow + p2) : 0.0f;
        const float dx1 = r.dtv * x1, dx2 = r.dtv * x2;
        float acc1 = 0.0f, acc2 = 0.0f;
        for (u32 n0 = 0; n0 < N; n0 += 128) {
            float s1[4], s2[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 n = n0 + lane + 32 * j;
                s1[j] = n < N ? load(st, p * N + n) : 0.0f;
                s2[j] = (two && n < N) ? load(st, p2 * N + n) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 n = n0 + lane + 32 * j;
                if (n >= N) continue;
                const float bn = load(b, brow + n), cn = load(c, brow + n);
                s1[j] = s1[j] * r.decay + dx1 * bn;
                acc1 += s1[j] * cn;
                store(st, p * N + n, s1[j]);
                if (two) {
                    s2[j] = s2[j] * r.decay + dx2 * bn;
                    acc2 += s2[j] * cn;
                    store(st, p2 * N + n, s2[j]);
                }
                for (u32 k = k0; k < k0 + nk; ++k) {
                    S* dst = layer_state(pool, snap_slot[k], r.slots, r.layer, r.layers, r.per_layer);
                    if (!dst) continue;
                    dst += r.head_off;
                    store(dst, p * N + n, s1[j]);
                    if (two) store(dst, p2 * N + n, s2[j]);
                }
            }
        }
        acc1 = warp_sum(acc1);
        acc2 = warp_sum(acc2);
        if (lane == 0) {
            store(out, yrow + p, acc1 + r.dh * x1);
            if (two) store(out, yrow + p2, acc2 + r.dh * x2);
        }
    }
}

// 16 raw bytes of state as f32 values (4 floats or 8 bf16) and back.
__device__ __forceinline__ void unpack16(const uint4& r, float* v, const float*) {
    v[0] = __uint_as_float(r.x);
    v[1] = __uint_as_float(r.y);
    v[2] = __uint_as_float(r.z);
    v[3] = __uint_as_float(r.w);
}
__device__ __forceinline__ void unpack16(const uint4& r, float* v, const bf16*) {
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}
__device__ __forceinline__ uint4 pack16(const float* v, const float*) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                      __float_as_uint(v[3]));
}
__device__ __forceinline__ uint4 pack16(const float* v, const bf16*) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

// Vectors of a state row one lane holds: the y sum of a row takes log2(L) shuffles over
// the row's L = N / (VEC·DEC_COLS) lanes, so fewer, wider lane slices of a row are cheaper
// (f32 state: 4; bf16 state keeps one, which leaves it enough registers for 5 CTAs an SM).
template <typename S>
constexpr int DEC_COLS = VEC<S> == 4 ? 4 : 1;

// N a multiple of VEC·DEC_COLS with L = N / (VEC·DEC_COLS) dividing 32: lane l of a warp owns
// DEC_COLS 16-byte vectors (n = (l mod L)·VEC + j·L·VEC) of row l / L of each pass over rows
// [p0, p1). A thread requests its DEC_VECS vectors of a group first and keeps them raw (4
// registers each, whatever the state type), then converts, updates, stores, and reduces y
// over the row's L lanes.
template <typename T, typename S>
__device__ void decode_rows_vec(const T* x, const T* b, const T* c, T* out, S* st, S* pool,
                                const u32* snap_slot, u32 k0, u32 nk, u32 p0, u32 p1, u32 N,
                                i64 xrow, i64 brow, i64 yrow, const RowStep& r) {
    // bf16 state: half the vectors at once (two passes per planned slice), which keeps this
    // path inside the register budget of the fast path's occupancy.
    constexpr int V = VEC<S>, CV = DEC_COLS<S>, RK = DEC_VECS / CV / (sizeof(S) == 2 ? 2 : 1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 L = N / (V * CV);
    const u32 per_pass = 32 / L;  // rows a warp covers per pass
    const u32 n0 = (lane % L) * V, nstep = L * V;
    const u32 row_in = lane / L;
    const u32 stride = DEC_WARPS * per_pass;  // rows between a thread's consecutive rows
    // The loop bound is uniform over the warp (the shuffles below need every lane); rows
    // past p1 are carried as zeros and never stored.
#pragma unroll 1
    for (u32 first = p0 + warp * per_pass; first < p1; first += RK * stride) {
        const u32 base = first + row_in;
        uint4 raw[RK][CV];
        float xv[RK];
#pragma unroll
        for (int k = 0; k < RK; ++k) {
            const u32 p = base + k * stride;
            xv[k] = 0.0f;
#pragma unroll
            for (int j = 0; j < CV; ++j) raw[k][j] = make_uint4(0u, 0u, 0u, 0u);
            if (p < p1) {
#pragma unroll
                for (int j = 0; j < CV; ++j)
                    raw[k][j] = *reinterpret_cast<const uint4*>(st + (u64)p * N + n0 + j * nstep);
                xv[k] = load(x, xrow + p);
            }
        }
        float bv[CV][V], cv[CV][V];  // after the state loads: those go out first
        // B and C in 16-byte pieces where a lane's V values are whole pieces (bf16 inputs
        // with bf16 state; f32 with f32) and the rows allow it.
        constexpr bool WHOLE = V % VEC<T> == 0;
        if (WHOLE && aligned16(b + brow + n0) && aligned16(c + brow + n0)) {
#pragma unroll
            for (int j = 0; j < CV; ++j)
#pragma unroll
                for (int v = 0; v < V; v += VEC<T>) {
                    load16(b, brow + n0 + j * nstep + v, bv[j] + v);
                    load16(c, brow + n0 + j * nstep + v, cv[j] + v);
                }
        } else {
#pragma unroll
            for (int j = 0; j < CV; ++j)
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    bv[j][v] = load(b, brow + n0 + j * nstep + v);
                    cv[j][v] = load(c, brow + n0 + j * nstep + v);
                }
        }
        float acc[RK];
#pragma unroll
        for (int k = 0; k < RK; ++k) {
            const u32 p = base + k * stride;
            const float dx = r.dtv * xv[k];
            acc[k] = 0.0f;
#pragma unroll
            for (int j = 0; j < CV; ++j) {
                float sv[V];
                unpack16(raw[k][j], sv, st);
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    sv[v] = sv[v] * r.decay + dx * bv[j][v];
                    acc[k] += sv[v] * cv[j][v];
                }
                if (p < p1) *reinterpret_cast<uint4*>(st + (u64)p * N + n0 + j * nstep) = pack16(sv, st);
            }
        }
        // Snapshots (rare) copy the new state back from the live slot: this thread's own
        // stores, so they are visible to it; no register stays live for them meanwhile.
        for (u32 q = k0; q < k0 + nk; ++q) {
            S* dst = layer_state(pool, snap_slot[q], r.slots, r.layer, r.layers, r.per_layer);
            if (!dst) continue;
            dst += r.head_off;
            for (int k = 0; k < RK; ++k)
                for (int j = 0; j < CV; ++j) {
                    const u64 i = (u64)(base + k * stride) * N + n0 + j * nstep;
                    if (base + k * stride < p1)
                        *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(st + i);
                }
        }
#pragma unroll
        for (int k = 0; k < RK; ++k) {
            for (u32 o = L / 2; o > 0; o >>= 1) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
            const u32 p = base + k * stride;
            if (lane % L == 0 && p < p1) store(out, yrow + p, acc[k] + r.dh * xv[k]);
        }
    }
}

// The state streams through the decode step once (each vector read, then written back by the
// same thread): the loads skip L1. Inline PTX also keeps each row's store where it is written,
// so the compiler neither sinks the stores (holding every new row at once) nor delays loads.
__device__ __forceinline__ uint4 ld_state(const void* p) {
    uint4 r;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ void st_state(void* p, const uint4& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// bf16 state, N = 128, a full 64-row slice (the shape the host plans for NemotronH-class
// layers): lane l of warp w owns the 16-byte vector l mod 16 of rows w·2 + l/16 + 8k, k < 8,
// so every state access is the slice base plus a constant, and all eight loads go out before
// the first use. y is reduced over a row's 16 lanes by halving exchange: each round sends
// half of the remaining row sums (4 + 2 + 1 + 1 shuffles for the thread's 8 rows, not 4 × 8),
// adding the same pairs in the same order as a butterfly per row, so y is unchanged. The
// head's scalars (dt, decay, D) are loaded and computed after the state loads are out.
// 80 registers: 6 CTAs an SM (the general path holds 96: 5).
constexpr u32 DEC_FAST_N = 128, DEC_FAST_ROWS = 64, DEC_FAST_STEP = 2 * DEC_WARPS;

// The element offset of this thread's first vector in a fast-path slice (the others follow
// at DEC_FAST_STEP rows).
__device__ __forceinline__ u32 fast_own() {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return (warp * 2 + (lane >> 4)) * DEC_FAST_N + (lane & 15) * 8;
}

// The eight x values of a thread's rows (at `step` elements from `p`): bf16 inputs are kept
// as raw pairs (4 registers; the fast path's budget), f32 as they are.
template <typename T>
struct XRows;
template <>
struct XRows<float> {
    float v[8];
    __device__ __forceinline__ void load(const float* p, u32 step) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = p[k * step];
    }
    __device__ __forceinline__ float get(int k) const { return v[k]; }
};
template <>
struct XRows<bf16> {
    u32 w[4];
    __device__ __forceinline__ void load(const bf16* p, u32 step) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            w[j] = (u32)p[2 * j * step].bits | ((u32)p[(2 * j + 1) * step].bits << 16);
    }
    __device__ __forceinline__ float get(int k) const {
        return __uint_as_float(k % 2 ? w[k / 2] & 0xffff0000u : w[k / 2] << 16);
    }
};

// Waits for the cp.async group of row k (of 8, committed in order).
__device__ __forceinline__ void wait_rows(int k) {
    switch (k) {
    case 0: cp_async_wait_groups<7>(); break;
    case 1: cp_async_wait_groups<6>(); break;
    case 2: cp_async_wait_groups<5>(); break;
    case 3: cp_async_wait_groups<4>(); break;
    case 4: cp_async_wait_groups<3>(); break;
    case 5: cp_async_wait_groups<2>(); break;
    case 6: cp_async_wait_groups<1>(); break;
    default: cp_async_wait_groups<0>(); break;
    }
}

template <typename T, typename Snap>
__device__ __forceinline__ void decode_fast_bf16(const T* x, const T* b, const T* c, const T* dt,
                                                 const T* a_log, const T* d, const T* dt_bias,
                                                 T* out, bf16* st, u32 h, i64 dt_at, i64 xrow,
                                                 i64 brow, i64 yrow, float dt_min, float dt_max,
                                                 u32 snaps, const Snap& snap) {
    constexpr u32 N = DEC_FAST_N, RS = DEC_FAST_STEP;
    const u32 lane = threadIdx.x & 31;
    const u32 row0 = (threadIdx.x >> 5) * 2 + (lane >> 4);
    const u32 n0 = (lane & 15) * 8;
    uint4* sv4 = reinterpret_cast<uint4*>(st + fast_own());
    // The state goes global → shared by cp.async, one group per row: nothing of it is held in
    // registers while in flight (64 registers: 8 CTAs an SM, 16 KB of shared memory each).
    // Each thread reads back only its own copies, so no barrier is needed.
    __shared__ uint4 stage[8][DEC_THREADS];
    const u32 at = smem_addr(&stage[0][threadIdx.x]);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        cp_async_16(at + k * DEC_THREADS * 16, sv4 + k * RS * N / 8, 16);
        cp_async_commit_group();
    }
    XRows<T> xv;
    xv.load(x + xrow + row0, RS);
    float bv[8], cv[8];  // B and C rows 16-byte aligned (checked by the caller)
#pragma unroll
    for (int v = 0; v < 8; v += VEC<T>) {
        load16(b, brow + n0 + v, bv + v);
        load16(c, brow + n0 + v, cv + v);
    }
    // The head's scalars only now: their loads and the softplus stay off the state loads' path.
    const float dtv = dt_of(load(dt, dt_at), load(dt_bias, h), dt_min, dt_max);
    const float decay = expf(dtv * -expf(load(a_log, h)));
    const float dh = load(d, h);
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float dx = dtv * xv.get(k);
        float sv[8];
        wait_rows(k);
        unpack16(stage[k][threadIdx.x], sv, st);
        acc[k] = 0.0f;
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            sv[v] = sv[v] * decay + dx * bv[v];
            acc[k] += sv[v] * cv[v];
        }
        const uint4 nv = pack16(sv, st);
        st_state(sv4 + k * RS * N / 8, nv);
        // Snapshots (rare) from the registers. The branch also ends the row's block, so the
        // compiler schedules row by row: it neither sinks the stores nor interleaves rows,
        // which would hold more registers than the eight raw vectors do.
        if (snaps) snap(fast_own() + k * RS * N, nv);
    }
    const bool h3 = lane & 8, h2 = lane & 4, h1 = lane & 2;
    float a4[4], x4[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float send = h3 ? acc[j] : acc[j + 4], keep = h3 ? acc[j + 4] : acc[j];
        a4[j] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
        x4[j] = h3 ? xv.get(j + 4) : xv.get(j);
    }
    float a2[2], x2[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float send = h2 ? a4[j] : a4[j + 2], keep = h2 ? a4[j + 2] : a4[j];
        a2[j] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
        x2[j] = h2 ? x4[j + 2] : x4[j];
    }
    const float send = h1 ? a2[0] : a2[1], keep = h1 ? a2[1] : a2[0];
    float a1 = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    a1 += __shfl_xor_sync(0xffffffffu, a1, 1);
    const float x1 = h1 ? x2[1] : x2[0];
    // This lane pair holds row k = 4·h3 + 2·h2 + h1 of the thread's rows.
    const u32 k = (lane >> 1) & 7;
    if ((lane & 1) == 0) store(out, yrow + row0 + k * RS, a1 + dh * x1);
}

template <typename T, typename S>
__device__ void decode(const T* x, const T* b, const T* c, const T* dt, const T* a_log,
                       const T* d, const T* dt_bias, T* out, S* pool, const u32* seq_tok,
                       const u32* seq_slot, const u32* seq_snap, const u32* seq_snaps,
                       const u32* snap_slot, u32 heads, u32 P, u32 groups, u32 N, u32 x_ld,
                       u32 bc_ld, u32 dt_ld, u32 out_ld, u32 layer, u32 layers, u32 slots,
                       u32 slice_rows, float dt_min, float dt_max) {
    const u32 slices = (P + slice_rows - 1) / slice_rows;
    u32 r = blockIdx.x;
    const u32 slice = r % slices;
    r /= slices;
    const u32 h = r % heads, e = r / heads;
    const u32 p0 = slice * slice_rows, p1 = min(P, p0 + slice_rows);
    const u32 tok = seq_tok[e];
    const u64 pn = (u64)P * N;
    S* st = layer_state(pool, seq_slot[e], slots, layer, layers, pn * heads);
    const i64 yrow = (i64)tok * out_ld + (i64)h * P;
    if (!st) {
        for (u32 p = p0 + threadIdx.x; p < p1; p += DEC_THREADS) store(out, yrow + p, 0.0f);
        return;
    }
    st += h * pn;
    const u32 g = h / (heads / groups);
    const i64 brow = (i64)tok * bc_ld + (i64)g * N;
    const i64 xrow = (i64)tok * x_ld + (i64)h * P;
    if constexpr (sizeof(S) == 2) {
        if (N == DEC_FAST_N && p1 - p0 == DEC_FAST_ROWS && aligned16(pool) &&
            aligned16(b + brow) && aligned16(c + brow)) {
            const u64 off = (u64)p0 * N;
            const u32 snaps = seq_snaps[e];
            auto snap = [&](u32 at, const uint4& v) {
                const u32 q0 = seq_snap[e];
#pragma unroll 1
                for (u32 q = q0; q < q0 + snaps; ++q) {
                    bf16* dst = layer_state(pool, snap_slot[q], slots, layer, layers, pn * heads);
                    if (dst) st_state(dst + h * pn + off + at, v);
                }
            };
            decode_fast_bf16(x, b, c, dt, a_log, d, dt_bias, out + p0, st + off, h,
                             (i64)tok * dt_ld + h, xrow + p0, brow, yrow, dt_min, dt_max, snaps,
                             snap);
            return;
        }
    }
    const float dtv = dt_of(load(dt, (i64)tok * dt_ld + h), load(dt_bias, h), dt_min, dt_max);
    const float a = -expf(load(a_log, h));
    const float decay = expf(dtv * a);
    const float dh = load(d, h);
    const u32 k0 = seq_snap[e], nk = seq_snaps[e];
    const RowStep step{decay, dtv, dh, h * pn, pn * heads, layer, layers, slots};
    constexpr u32 W = VEC<S> * DEC_COLS<S>;  // state values a lane holds of a row
    if (N >= W && N % W == 0 && 32 % (N / W) == 0 && aligned16(pool))
        decode_rows_vec(x, b, c, out, st, pool, snap_slot, k0, nk, p0, p1, N, xrow, brow, yrow, step);
    else
        decode_rows(x, b, c, out, st, pool, snap_slot, k0, nk, p0, p1, N, xrow, brow, yrow, step);
}

// Short prompts (a verify step's k + 1 tokens, when every prompt of the step is short): the
// recurrent step token by token, as the CPU reference scans one-token segments, instead of the
// chunked SSD's four kernels. The state stays in registers in f32 through the entry and is
// rounded to the pool's type only where it is stored, as the SSD stores it: at each chunk end
// that carries snapshots (a verify step's plan ends a chunk at every draft position) and in the
// live slot at the end. CTA (prompt entry, head, slice of REC_ROWS rows of p); warp w owns
// rows p0 + w·REC_WARP_ROWS + i, lane l the columns n = l + 32·j (N ≤ 32·REC_COLS).
constexpr int REC_WARP_ROWS = 4;
constexpr int REC_COLS = 8;  // state_update.rs: REC_MAX_STATE = 32 · REC_COLS
constexpr u32 REC_ROWS = REC_WARP_ROWS * DEC_WARPS;  // state_update.rs: REC_ROWS

template <typename S>
__device__ __forceinline__ void rec_store(S* dst, u32 pw, u32 P, u32 N, u32 lane,
                                          const float (&s)[REC_WARP_ROWS][REC_COLS]) {
#pragma unroll
    for (int i = 0; i < REC_WARP_ROWS; ++i) {
        if (pw + i >= P) break;
#pragma unroll
        for (int j = 0; j < REC_COLS; ++j) {
            const u32 n = lane + 32 * j;
            if (n < N) store(dst, (u64)(pw + i) * N + n, s[i][j]);
        }
    }
}

// One token's operands of a warp's rows: raw dt, its lanes' B and C columns, its rows' x.
struct RecIn {
    float dt;
    float b[REC_COLS], c[REC_COLS], x[REC_WARP_ROWS];
};

template <typename T, typename S>
__device__ void recurrent(const T* x, const T* b, const T* c, const T* dt, const T* a_log,
                          const T* d, const T* dt_bias, T* out, S* pool, const u32* seq_slot,
                          const u32* seq_chunk, const u32* seq_chunks, const u32* ck_tok,
                          const u32* ck_len, const u32* ck_snap, const u32* ck_snaps,
                          const u32* snap_slot, u32 seq_base, u32 heads, u32 P, u32 groups,
                          u32 N, u32 x_ld, u32 bc_ld, u32 dt_ld, u32 out_ld, u32 layer,
                          u32 layers, u32 slots, float dt_min, float dt_max) {
    const u32 slices = (P + REC_ROWS - 1) / REC_ROWS;
    u32 r = blockIdx.x;
    const u32 slice = r % slices;
    r /= slices;
    const u32 h = r % heads, e = seq_base + r / heads;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 pw = slice * REC_ROWS + warp * REC_WARP_ROWS;  // the warp's first row
    const u64 pn = (u64)P * N, per_layer = pn * heads;
    const u32 c0 = seq_chunk[e], c1 = c0 + seq_chunks[e];
    S* live = layer_state(pool, seq_slot[e], slots, layer, layers, per_layer);
    if (!live) {  // a padding entry: zero outputs, no state
        for (u32 k = c0; k < c1; ++k)
            for (u32 t = ck_tok[k]; t < ck_tok[k] + ck_len[k]; ++t)
                for (u32 i = lane; i < REC_WARP_ROWS; i += 32)
                    if (pw + i < P) store(out, (i64)t * out_ld + (i64)h * P + pw + i, 0.0f);
        return;
    }
    live += h * pn;
    float s[REC_WARP_ROWS][REC_COLS];
#pragma unroll
    for (int i = 0; i < REC_WARP_ROWS; ++i)
#pragma unroll
        for (int j = 0; j < REC_COLS; ++j) {
            const u32 n = lane + 32 * j;
            s[i][j] = pw + i < P && n < N ? load(live, (u64)(pw + i) * N + n) : 0.0f;
        }
    const u32 g = h / (heads / groups);
    const float a = -expf(load(a_log, h)), dh = load(d, h), bias = load(dt_bias, h);
    // The entry's chunks are consecutive token rows. Each token's operands are requested a
    // token ahead, so their loads overlap the step before instead of waiting behind its
    // stores (which the compiler may not move loads across).
    if (c1 == c0) return;  // (a real entry has at least one chunk)
    const u32 tb = ck_tok[c0], te = ck_tok[c1 - 1] + ck_len[c1 - 1];
    auto fetch = [&](u32 t, RecIn& in) {
        in.dt = load(dt, (i64)t * dt_ld + h);
        const i64 brow = (i64)t * bc_ld + (i64)g * N, xrow = (i64)t * x_ld + (i64)h * P;
#pragma unroll
        for (int j = 0; j < REC_COLS; ++j) {
            const u32 n = lane + 32 * j;
            in.b[j] = n < N ? load(b, brow + n) : 0.0f;
            in.c[j] = n < N ? load(c, brow + n) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < REC_WARP_ROWS; ++i) in.x[i] = pw + i < P ? load(x, xrow + pw + i) : 0.0f;
    };
    RecIn cur, next;
    fetch(tb, cur);
    u32 k = c0, kend = tb + ck_len[c0];
    for (u32 t = tb; t < te; ++t) {
        if (t + 1 < te) fetch(t + 1, next);
        const float dtv = dt_of(cur.dt, bias, dt_min, dt_max);
        const float decay = expf(dtv * a);
#pragma unroll
        for (int i = 0; i < REC_WARP_ROWS; ++i) {
            const float dx = dtv * cur.x[i];
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < REC_COLS; ++j) {
                s[i][j] = s[i][j] * decay + dx * cur.b[j];
                acc += s[i][j] * cur.c[j];
            }
            acc = warp_sum(acc);
            if (lane == 0 && pw + i < P)
                store(out, (i64)t * out_ld + (i64)h * P + pw + i, acc + dh * cur.x[i]);
        }
        // A chunk end (a verify step's plan ends one at every draft position; chunks are at
        // least a token long): its snapshots.
        if (t + 1 == kend) {
            for (u32 q = ck_snap[k]; q < ck_snap[k] + ck_snaps[k]; ++q) {
                S* dst = layer_state(pool, snap_slot[q], slots, layer, layers, per_layer);
                if (dst) rec_store(dst + h * pn, pw, P, N, lane, s);
            }
            if (++k < c1) kend = ck_tok[k] + ck_len[k];
        }
        cur = next;
    }
    rec_store(live, pw, P, N, lane, s);
}
}  // namespace ssm

// ---------------------------------------------------------------------------------------
// Entry points (state_update.rs: ENTRIES).

#define DECODE_PARAMS(T, S)                                                                   \
    const T *x, const T *b, const T *c, const T *dt, const T *a_log, const T *d,                \
        const T *dt_bias, T *out, S *pool, const u32 *seq_tok, const u32 *seq_slot,        \
        const u32 *seq_snap, const u32 *seq_snaps, const u32 *snap_slot, u32 heads,           \
        u32 head_dim, u32 groups, u32 state, u32 x_ld, u32 bc_ld, u32 dt_ld, u32 out_ld,      \
        u32 layer, u32 layers, u32 slots, u32 slice_rows, float dt_min, float dt_max
#define DECODE_ARGS                                                                           \
    x, b, c, dt, a_log, d, dt_bias, out, pool, seq_tok, seq_slot, seq_snap, seq_snaps,         \
        snap_slot, heads, head_dim, groups, state, x_ld, bc_ld, dt_ld, out_ld, layer, layers,  \
        slots, slice_rows, dt_min, dt_max

extern "C" __global__ void __launch_bounds__(128, 5) ssm_decode_f32(DECODE_PARAMS(float, float)) { CHIMERA_PDL_ENTRY();
    ssm::decode(DECODE_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 5) ssm_decode_bf16(DECODE_PARAMS(bf16, float)) { CHIMERA_PDL_ENTRY();
    ssm::decode(DECODE_ARGS);
}
// bf16 state storage (cache.ssm_state_dtype = "bfloat16"): read and written as bf16, updated in f32.
extern "C" __global__ void __launch_bounds__(128, 8) ssm_decode_f32_sbf16(DECODE_PARAMS(float, bf16)) { CHIMERA_PDL_ENTRY();
    ssm::decode(DECODE_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 8) ssm_decode_bf16_sbf16(DECODE_PARAMS(bf16, bf16)) { CHIMERA_PDL_ENTRY();
    ssm::decode(DECODE_ARGS);
}

#define RECURRENT_PARAMS(T, S)                                                                \
    const T *x, const T *b, const T *c, const T *dt, const T *a_log, const T *d,                \
        const T *dt_bias, T *out, S *pool, const u32 *seq_slot, const u32 *seq_chunk,          \
        const u32 *seq_chunks, const u32 *ck_tok, const u32 *ck_len, const u32 *ck_snap,      \
        const u32 *ck_snaps, const u32 *snap_slot, u32 seq_base, u32 heads, u32 head_dim,     \
        u32 groups, u32 state, u32 x_ld, u32 bc_ld, u32 dt_ld, u32 out_ld, u32 layer,         \
        u32 layers, u32 slots, float dt_min, float dt_max
#define RECURRENT_ARGS                                                                        \
    x, b, c, dt, a_log, d, dt_bias, out, pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, \
        ck_snap, ck_snaps, snap_slot, seq_base, heads, head_dim, groups, state, x_ld, bc_ld,   \
        dt_ld, out_ld, layer, layers, slots, dt_min, dt_max

extern "C" __global__ void __launch_bounds__(128, 4) ssm_recurrent_f32(RECURRENT_PARAMS(float, float)) { CHIMERA_PDL_ENTRY();
    ssm::recurrent(RECURRENT_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 4) ssm_recurrent_bf16(RECURRENT_PARAMS(bf16, float)) { CHIMERA_PDL_ENTRY();
    ssm::recurrent(RECURRENT_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 4) ssm_recurrent_f32_sbf16(RECURRENT_PARAMS(float, bf16)) { CHIMERA_PDL_ENTRY();
    ssm::recurrent(RECURRENT_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 4) ssm_recurrent_bf16_sbf16(RECURRENT_PARAMS(bf16, bf16)) { CHIMERA_PDL_ENTRY();
    ssm::recurrent(RECURRENT_ARGS);
}
