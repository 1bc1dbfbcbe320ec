// Mamba2 state-space kernels for chimera: the depthwise causal conv1d, the selective scan
// (chunked SSD for prompt chunks, the recurrent step for single tokens) and the SSM slot
// restores/zeros. The host planner (`ssm.rs`) owns the work decomposition; these kernels
// execute it. Activations and weights are T (float: the f32 oracle mode; bf16: serving);
// the state pools and every in-kernel sum are f32.
//
// Work columns (ssm.rs: WorkCol). Sequence entries e (decodes, i.e. one-token chunks, first:
// e < dec_count): first token row, length, live slot, first chunk and chunk count (prompt
// chunks only), snapshot range (its one token, decodes only). SSD chunks c: first token row,
// length (≤ the plan's chunk size), sequence entry, and the snapshot range at the chunk's
// end. The planner cuts a prompt at every snapshot offset and then every chunk_size tokens
// (as the CPU reference does), so a snapshot is always a chunk-end state. `snap_slot` holds
// the destination slots. A slot ≥ `slots` (padding) is never read or written.
//
// State layouts: conv pool [slots, layers, channels, k − 1], ssm pool [slots, layers, heads,
// head_dim, state]; layer l of slot s starts at (s·layers + l)·per_layer.
//
// Causal conv1d (after Dao-AILab causal-conv1d and vLLM's varlen Triton conv):
// out_t = silu(bias + Σ_j w_j·in(t − (k−1) + j)), where in(q < 0) reads the live conv state.
// - ssm_conv_chunks: one thread per channel walks CONV_ROWS rows of one chunk with a
//   right-aligned register window; the block holding a chunk's end writes the snapshot states
//   (the k − 1 inputs before the chunk end). It only reads the live state.
// - ssm_conv_update: one thread per (sequence, channel): the new live state (the last k − 1
//   inputs of the sequence), and for decodes the output and snapshots. Launched after
//   conv_chunks, so prompt chunks have read the old state before it is replaced.
//
// Selective scan (Dao & Gu 2024, "Transformers are SSMs", arXiv 2405.21060, the SSD
// algorithm; pipeline after mamba_ssm's Triton kernels: chunk cumsum → chunk states → state
// passing → chunk scan). For head h of group g, token s of a chunk: dt_s = clamp(softplus(
// dt_raw + dt_bias)), a = −exp(A_log), A_s = Σ_{r≤s} dt_r·a (cumulative within the chunk).
// - ssd_dt: dt_s and A_s per (token, head) into f32 scratch (the CPU's serial sum order).
// - ssd_states: each chunk's local end state S_c[p][n] = Σ_s exp(A_end − A_s)·dt_s·x_s[p]·B_s[n]
//   (a P×N GEMM over the chunk's tokens), into scratch `states`.
// - ssd_pass: per (sequence, head, element tile) h = live state; per chunk: states[c] ← h
//   (the state entering c), h = exp(A_end)·h + S_c, snapshot slots of c ← h; live ← h.
// - ssd_scan: y_l = exp(A_l)·C_l·h_c + Σ_{s≤l} (C_l·B_s)·exp(A_l − A_s)·dt_s·x_s + D·x_l.
// - ssm_decode: one token: S ← exp(dt·a)·S + dt·x⊗B, y = S·C + D·x (f32), live and snapshots.
//
// Tiling. SIMT kernels (f32; bf16 fallback for other shapes): 256 threads, 32×64 output
// tiles, each thread a 4×2 micro-tile, operands staged as f32 in shared memory over 32-wide
// k tiles. Tensor-core kernels (bf16, head_dim 64, state 64 or 128): mma.sync m16n8k16
// bf16 → f32 with ldmatrix (.trans where the operand's k runs across rows);
// - ssd_chunk_pass_mma (steps 2 and 3 in one kernel): CTA (sequence, head, half of the state
//   columns) walks the sequence's chunks in order with the running state in registers
//   (accumulator fragments); per chunk it writes only the entering state, as bf16, for the
//   scan (the separate f32 chunk states were written, read, rewritten and read again:
//   ~1 GB at T = 8192), and the snapshots and the live state in the pool's type.
// - ssd_scan_group_mma (chunks ≤ 128 tokens): CTA (chunk, group, block of heads): the scores
//   C·Bᵀ once per group (f32 in shared memory), then per head the state term C·h_cᵀ and the
//   decayed, masked scores re-packed as bf16 A fragments (the FA2 accumulator-to-operand
//   trick) for P·X, each warp owning two row blocks of equal causal work.
// - ssd_scan_mma (any chunk size): 8 warps × 16 rows of l (a 128-row block of a chunk, one
//   CTA per (chunk, head) at chunk sizes ≤ 128); the state term first, then per 128-token
//   tile of s ≤ l, 32 columns at a time: scores C·Bᵀ (f32), decay and causal mask in
//   registers, re-packed as above. Rows past the diagonal are skipped per warp.
// This is the rounding mamba_ssm's Triton kernels also make (states and decayed scores in
// the input dtype before the second product).
//
// Learned from: the SSD paper and its `ssd_minimal`; mamba_ssm's ssd_* Triton kernels and
// selective_state_update; Dao-AILab causal-conv1d; vLLM's mamba varlen kernels (cu_seqlens,
// state indices, intermediate states). The PTX ISA manual for mma/ldmatrix fragment
// layouts. No code was copied.
#include "common.cuh"
#include "mma.cuh"

// Dynamic shared memory of the kernels that use it (ssd_scan_mma).
extern __shared__ __align__(16) u16 ssm_dyn_smem[];

namespace ssm {

constexpr u32 NONE = 0xffffffffu;  // ssm.rs: ZERO_OP (op_from of a zero op)
constexpr float LOG2E = 1.4426950408889634f;
constexpr int MAXK = 8;            // ssm.rs: MAX_CONV_KERNEL
constexpr int CONV_THREADS = 128;  // ssm.rs: CONV_THREADS
constexpr int CONV_ROWS = 32;      // ssm.rs: CONV_ROWS

// The CPU's softplus and clamp (NaN stays NaN).
__device__ __forceinline__ float dt_of(float raw, float bias, float lo, float hi) {
    const float x = raw + bias;
    const float v = x > 20.0f ? x : log1pf(expf(x));
    return v < lo ? lo : (v > hi ? hi : v);
}

// Base of one layer's state of `slot` in a slot-major pool; null for a slot out of range.
template <typename S>
__device__ __forceinline__ S* layer_state(S* pool, u32 slot, u32 slots, u32 layer, u32 layers,
                                          u64 per) {
    if (slot >= slots) return nullptr;
    return pool + ((u64)slot * layers + layer) * per;
}

// ---------------------------------------------------------------------------------------
// Slot ops: op i copies slot op_from[i] (or zeroes, op_from = NONE) into op_to[i], both pools,
// all layers. The planner groups ops into waves without read/write conflicts.
// Counts are 4-byte words: a pool stored as bf16 passes half its element count, and the copy
// moves raw bits either way (a zero word is +0 in both types).

template <bool V4>
__device__ void slot_ops(float* conv, float* ssmp, const u32* op_from, const u32* op_to,
                         u32 op_base, u32 slots, u64 conv_per, u64 ssm_per) {
    const u32 op = op_base + blockIdx.y;
    const u32 from = op_from[op], to = op_to[op];
    if (to >= slots || (from != NONE && from >= slots)) return;
    const u64 w = V4 ? 4 : 1;
    const u64 cn = conv_per / w, sn = ssm_per / w;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < cn + sn; i += stride) {
        const bool is_conv = i < cn;
        float* pool = is_conv ? conv : ssmp;
        const u64 per = is_conv ? cn : sn;
        const u64 j = is_conv ? i : i - cn;
        if (V4) {
            float4* p = reinterpret_cast<float4*>(pool);
            p[(u64)to * per + j] = from == NONE ? make_float4(0.f, 0.f, 0.f, 0.f) : p[(u64)from * per + j];
        } else {
            pool[(u64)to * per + j] = from == NONE ? 0.0f : pool[(u64)from * per + j];
        }
    }
}

// ---------------------------------------------------------------------------------------
// Causal conv1d.

// Input of channel c at sequence position q (q < 0: the live conv state).
template <typename T>
__device__ __forceinline__ float conv_in(const T* x, u32 x_ld, u32 stok, int q, u32 c,
                                         const float* st, int hist) {
    if (q >= 0) return load(x, (i64)(stok + (u32)q) * x_ld + c);
    return st ? st[hist + q] : 0.0f;
}

template <typename T>
__device__ void conv_chunks(const T* x, const T* weight, const T* bias, T* out, float* pool,
                            const u32* seq_tok, const u32* seq_slot, const u32* ck_tok,
                            const u32* ck_len, const u32* ck_seq, const u32* ck_snap,
                            const u32* ck_snaps, const u32* snap_slot, u32 channels, u32 kernel,
                            u32 x_ld, u32 out_ld, u32 layer, u32 layers, u32 slots,
                            u32 ch_blocks, u32 row_blocks) {
    const u32 cb = blockIdx.x % ch_blocks;
    const u32 rest = blockIdx.x / ch_blocks;
    const u32 rb = rest % row_blocks, ck = rest / row_blocks;
    const u32 c = cb * CONV_THREADS + threadIdx.x;
    const u32 len = ck_len[ck];
    const u32 r0 = rb * CONV_ROWS;
    if (c >= channels || r0 >= len) return;
    const u32 r1 = min(len, r0 + CONV_ROWS);
    const u32 e = ck_seq[ck];
    const u32 stok = seq_tok[e];
    const int hist = (int)kernel - 1;
    const u64 per = (u64)channels * hist;
    const float* st = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (st) st += (u64)c * hist;
    // Right-aligned: win[MAXK−1] is the newest input, wr[MAXK−k + j] = w_j.
    float wr[MAXK], win[MAXK];
#pragma unroll
    for (int j = 0; j < MAXK; ++j) {
        const int src = j - (MAXK - (int)kernel);
        wr[j] = src >= 0 ? load(weight, (i64)c * kernel + src) : 0.0f;
        win[j] = 0.0f;
    }
    const float b = bias ? load(bias, c) : 0.0f;
    const u32 t0 = ck_tok[ck] + r0;
    const int q0 = (int)(t0 - stok);
#pragma unroll
    for (int j = 0; j < MAXK; ++j) {
        const int m = MAXK - j;  // win[j] holds in(q0 − m)
        if (m <= hist) win[j] = conv_in(x, x_ld, stok, q0 - m, c, st, hist);
    }
    for (u32 r = 0; r < r1 - r0; ++r) {
#pragma unroll
        for (int j = 0; j < MAXK - 1; ++j) win[j] = win[j + 1];
        win[MAXK - 1] = load(x, (i64)(t0 + r) * x_ld + c);
        float acc = 0.0f;  // the CPU's order: Σ_j w_j·in_j from j = 0
#pragma unroll
        for (int j = 0; j < MAXK; ++j)
            if (j >= MAXK - (int)kernel) acc += wr[j] * win[j];
        store(out, (i64)(t0 + r) * out_ld + c, silu(acc + b));
    }
    if (r1 != len) return;
    const u32 k0 = ck_snap[ck], nk = ck_snaps[ck];
    for (u32 k = k0; k < k0 + nk; ++k) {
        float* dst = layer_state(pool, snap_slot[k], slots, layer, layers, per);
        if (!dst) continue;
        dst += (u64)c * hist;
#pragma unroll
        for (int j = 0; j < MAXK; ++j)
            if (j >= MAXK - hist) dst[j - (MAXK - hist)] = win[j];
    }
}

// Channels a conv_update thread takes: four when the conv is 4 wide (3 history columns, so
// four channels' states are 12 consecutive floats, three 16-byte loads) and they divide the
// channels; else one. ssm.rs: conv_update_channels.
__device__ __forceinline__ u32 conv_update_cpt(u32 kernel, u32 channels) {
    return kernel == 4 && channels % 4 == 0 ? 4 : 1;
}

// One channel: the new live state (the last k − 1 inputs), the decode's output, snapshots.
// `old(j)` reads the old state's column j; every read happens before the first write.
template <typename T, typename Old>
__device__ __forceinline__ void conv_update_channel(const T* x, const T* weight, const T* bias,
                                                    T* out, u32 c, u32 stok, u32 len, bool dec,
                                                    u32 kernel, u32 x_ld, u32 out_ld, Old old,
                                                    float* nw) {
    const int hist = (int)kernel - 1;
#pragma unroll
    for (int j = 0; j < MAXK - 1; ++j) {
        const int q = (int)len - hist + j;
        nw[j] = j >= hist ? 0.0f : (q >= 0 ? load(x, (i64)(stok + (u32)q) * x_ld + c) : old(hist + q));
    }
    if (dec) {
        const float x0 = load(x, (i64)stok * x_ld + c);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < MAXK; ++j)
            if (j < (int)kernel) acc += load(weight, (i64)c * kernel + j) * (j < hist ? old(j) : x0);
        const float b = bias ? load(bias, c) : 0.0f;
        store(out, (i64)stok * out_ld + c, silu(acc + b));
    }
}

template <typename T>
__device__ void conv_update(const T* x, const T* weight, const T* bias, T* out, float* pool,
                            const u32* seq_tok, const u32* seq_len, const u32* seq_slot,
                            const u32* seq_snap, const u32* seq_snaps, const u32* snap_slot,
                            u32 dec_count, u32 channels, u32 kernel, u32 x_ld, u32 out_ld,
                            u32 layer, u32 layers, u32 slots, u32 ch_blocks) {
    const u32 cpt = conv_update_cpt(kernel, channels);
    const u32 e = blockIdx.x / ch_blocks;
    const u32 c0 = ((blockIdx.x % ch_blocks) * CONV_THREADS + threadIdx.x) * cpt;
    if (c0 >= channels) return;
    const u32 stok = seq_tok[e], len = seq_len[e];
    const bool dec = e < dec_count;
    const u32 hist = kernel - 1;
    const u64 per = (u64)channels * hist;
    float* st = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (!st) {
        if (dec)
            for (u32 c = c0; c < c0 + cpt; ++c) store(out, (i64)stok * out_ld + c, 0.0f);
        return;
    }
    st += (u64)c0 * hist;
    const u32 k0 = dec ? seq_snap[e] : 0, nk = dec ? seq_snaps[e] : 0;
    if (cpt == 4 && aligned16(st)) {
        // Four channels × 3 columns: 12 floats in three 16-byte pieces, read, then written.
        float s[12], n[12];
#pragma unroll
        for (int v = 0; v < 3; ++v) load16(st, 4 * v, s + 4 * v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float nw[MAXK - 1];
            conv_update_channel(x, weight, bias, out, c0 + i, stok, len, dec, kernel, x_ld,
                                out_ld, [&](int j) { return s[3 * i + j]; }, nw);
#pragma unroll
            for (int j = 0; j < 3; ++j) n[3 * i + j] = nw[j];
        }
#pragma unroll
        for (int v = 0; v < 3; ++v) store16(st, 4 * v, n + 4 * v);
        for (u32 k = k0; k < k0 + nk; ++k) {
            float* dst = layer_state(pool, snap_slot[k], slots, layer, layers, per);
            if (!dst) continue;
            dst += (u64)c0 * hist;
#pragma unroll
            for (int v = 0; v < 3; ++v) store16(dst, 4 * v, n + 4 * v);
        }
        return;
    }
    for (u32 i = 0; i < cpt; ++i) {
        float* sc = st + i * hist;
        float nw[MAXK - 1];
        conv_update_channel(x, weight, bias, out, c0 + i, stok, len, dec, kernel, x_ld, out_ld,
                            [&](int j) { return sc[j]; }, nw);
#pragma unroll
        for (int j = 0; j < MAXK - 1; ++j)
            if (j < (int)hist) sc[j] = nw[j];
        for (u32 k = k0; k < k0 + nk; ++k) {
            float* dst = layer_state(pool, snap_slot[k], slots, layer, layers, per);
            if (!dst) continue;
            dst += (u64)(c0 + i) * hist;
#pragma unroll
            for (int j = 0; j < MAXK - 1; ++j)
                if (j < (int)hist) dst[j] = nw[j];
        }
    }
}

// ---------------------------------------------------------------------------------------
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

constexpr int DEC_THREADS = 128;  // ssm.rs: DEC_THREADS
constexpr int DEC_WARPS = DEC_THREADS / 32;
constexpr int DEC_VECS = 8;  // ssm.rs: DEC_VECS (16-byte state vectors a thread holds at once)

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

// ---------------------------------------------------------------------------------------
// SSD step 1: dt and the within-chunk cumulative dA, per (token, head), into scratch; and
// the same chunk-major ([chunk][head][rec_rows]) for the tensor-core kernels, which stage a
// (chunk, head)'s values in 16-byte pieces (per token, at a stride of `heads` words, they
// were one cache line a value, through an L1 that the shared memory leaves small).

constexpr int DT_THREADS = 256;  // ssm.rs: DT_THREADS
constexpr int DT_HEADS = 32;     // ssm.rs: DT_HEADS
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
// SIMT tiles (f32 operands in shared memory): 256 threads as 8 (m) × 32 (n); a thread owns
// rows m = ty + 8i (i < 4) and columns n = tx + 32j (j < 2) of a 32 × 64 tile.

constexpr int ST_THREADS = 256;  // ssm.rs: SIMT_THREADS
constexpr int TM = 32, TN = 64, TK = 32;

// acc += Σ_k A[k][m]·B[k][n] over one k tile.
__device__ __forceinline__ void simt_fma(float (&acc)[4][2], const float (*As)[TM + 1],
                                         const float (*Bs)[TN + 1], int ty, int tx) {
#pragma unroll 8
    for (int k = 0; k < TK; ++k) {
        float a[4], b[2];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[k][ty + 8 * i];
#pragma unroll
        for (int j = 0; j < 2; ++j) b[j] = Bs[k][tx + 32 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) acc[i][j] += a[i] * b[j];
    }
}

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
    // A padding chunk (len 0; ssm.rs: SsmPlan::pad_to) sits on the step's last row, so the
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
// SSD step 3: state passing (f32). CTA (head, element tile, prompt entry); each thread
// carries PASS_PER elements of the head's P×N state, strided by the CTA size. The chain over
// chunks is latency-bound: enough loads must be in flight. 4 elements per thread ran at
// 0.5 TB/s on an H200 (47 registers: 5 CTAs per SM, two waves at T = 8192); 8 per thread at
// ≤ 64 registers keeps 4 CTAs per SM and one wave (not yet measured).

constexpr int PASS_THREADS = 256;  // ssm.rs: PASS_THREADS
constexpr int PASS_PER = 8;        // ssm.rs: PASS_PER

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
// Tensor-core kernels (bf16).

// ldmatrix x4 (and .trans) from a shared-memory pointer; mma.cuh's m16n8k16 bf16 mma.
__device__ __forceinline__ void ldsm4(u32 (&r)[4], const void* p) { ldmatrix_x4(r, smem_addr(p)); }
__device__ __forceinline__ void ldsm4_t(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    mma_bf16_16816(c, a, b0, b1);
}

// Rows of `rows` bf16 tiles are padded by 8 elements (16 bytes): ldmatrix rows of a
// 8-row group then fall in distinct banks.
template <int W>
struct Pad {
    static constexpr int LD = W + 8;
};


constexpr int SCAN_THREADS = 256;  // ssm.rs: SCAN_THREADS (8 warps)
constexpr int SCAN_ROWS = 128;     // ssm.rs: SCAN_ROWS (rows of l per CTA, tokens per s tile)
constexpr int SCAN_COLS = 32;      // s columns of the scores a warp holds at once

// `rows` × W bf16 from global rows into a padded tile with cp.async; rows ≥ valid are zero.
template <int W>
__device__ __forceinline__ void stage_async(bf16* dst, const bf16* src, i64 ld, int rows, int valid) {
    constexpr int CH = W / 8;
    for (int i = threadIdx.x; i < rows * CH; i += SCAN_THREADS) {
        const int r = i / CH, cc = i % CH;
        const bool ok = r < valid;
        cp_async_16(smem_addr(dst + r * Pad<W>::LD + cc * 8), ok ? src + (i64)r * ld + cc * 8 : src,
                    ok ? 16u : 0u);
    }
}

// ROWS × W bf16 from global rows into a padded tile with cp.async, by THREADS threads (t:
// this thread's index among them); rows ≥ valid are zero. The shape is known at compile time,
// so each thread's pieces are a fixed unrolled list (one address step per piece).
template <int W, int ROWS, int THREADS>
__device__ __forceinline__ void stage_rows(bf16* dst, const bf16* src, i64 ld, int valid, int t) {
    constexpr int CH = W / 8;
    static_assert((ROWS * CH) % THREADS == 0 && THREADS % CH == 0, "whole passes");
    constexpr int STEP = THREADS / CH;  // rows per pass
    const int r0 = t / CH, cc = t % CH;
    const bf16* s = src + (i64)r0 * ld + cc * 8;
    const u32 d = smem_addr(dst + r0 * Pad<W>::LD + cc * 8);
#pragma unroll
    for (int u = 0; u < ROWS * CH / THREADS; ++u) {
        const bool ok = r0 + STEP * u < valid;
        cp_async_16(d + 2 * STEP * u * Pad<W>::LD, ok ? s + (i64)STEP * u * ld : src, ok ? 16u : 0u);
    }
}

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
constexpr int CP_SPLIT = 2;   // ssm.rs: CHUNK_PASS_SPLIT (CTAs per (entry, head))

template <int P, int N>
struct ChunkPassLayout {  // ssm.rs: chunk_pass_smem_bytes
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

// SSD step 4 (tensor cores), any chunk size (the planner takes scan_group_mma below for
// chunks of at most 128 tokens): rows [l0, l0 + 128) of chunk ck, head h; warp w owns rows
// l0 + 16w + [0, 16). One CTA covers a whole 128-token chunk, so h_c and the chunk's B and x
// rows are read once per (chunk, head), not once per 64-row block. Shared (dynamic): the C
// rows, h_c (bf16, from chunk_pass_mma), the B and x rows of the current s tile, and the
// decays. Everything a tile needs is requested up front by cp.async and waited for once.
template <int P, int N>
struct ScanLayout {  // offsets in bf16 elements; ssm.rs: scan_smem_bytes
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
struct GroupScanLayout {  // offsets in bf16 elements; ssm.rs: group_scan_smem_bytes
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
    if (nh == 0 || len == 0) return;  // len 0: a padding chunk (ssm.rs: SsmPlan::pad_to)
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
// Entry points (ssm.rs: ENTRIES).

extern "C" __global__ void __launch_bounds__(256)
    ssm_slot_ops(float* conv, float* ssmp, const u32* op_from, const u32* op_to, u32 op_base,
                 u32 slots, u64 conv_per, u64 ssm_per) { CHIMERA_PDL_ENTRY();
    ssm::slot_ops<false>(conv, ssmp, op_from, op_to, op_base, slots, conv_per, ssm_per);
}
extern "C" __global__ void __launch_bounds__(256)
    ssm_slot_ops_v4(float* conv, float* ssmp, const u32* op_from, const u32* op_to, u32 op_base,
                    u32 slots, u64 conv_per, u64 ssm_per) { CHIMERA_PDL_ENTRY();
    ssm::slot_ops<true>(conv, ssmp, op_from, op_to, op_base, slots, conv_per, ssm_per);
}

#define CONV_CHUNKS_PARAMS(T)                                                                \
    const T *x, const T *weight, const T *bias, T *out, float *pool, const u32 *seq_tok,       \
        const u32 *seq_slot, const u32 *ck_tok, const u32 *ck_len, const u32 *ck_seq,        \
        const u32 *ck_snap, const u32 *ck_snaps, const u32 *snap_slot, u32 channels,         \
        u32 kernel, u32 x_ld, u32 out_ld, u32 layer, u32 layers, u32 slots, u32 ch_blocks,   \
        u32 row_blocks
#define CONV_CHUNKS_ARGS                                                                     \
    x, weight, bias, out, pool, seq_tok, seq_slot, ck_tok, ck_len, ck_seq, ck_snap, ck_snaps, \
        snap_slot, channels, kernel, x_ld, out_ld, layer, layers, slots, ch_blocks, row_blocks

extern "C" __global__ void __launch_bounds__(128) ssm_conv_chunks_f32(CONV_CHUNKS_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::conv_chunks(CONV_CHUNKS_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) ssm_conv_chunks_bf16(CONV_CHUNKS_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::conv_chunks(CONV_CHUNKS_ARGS);
}

#define CONV_UPDATE_PARAMS(T)                                                                \
    const T *x, const T *weight, const T *bias, T *out, float *pool, const u32 *seq_tok,       \
        const u32 *seq_len, const u32 *seq_slot, const u32 *seq_snap, const u32 *seq_snaps,  \
        const u32 *snap_slot, u32 dec_count, u32 channels, u32 kernel, u32 x_ld, u32 out_ld,  \
        u32 layer, u32 layers, u32 slots, u32 ch_blocks
#define CONV_UPDATE_ARGS                                                                      \
    x, weight, bias, out, pool, seq_tok, seq_len, seq_slot, seq_snap, seq_snaps, snap_slot,    \
        dec_count, channels, kernel, x_ld, out_ld, layer, layers, slots, ch_blocks

extern "C" __global__ void __launch_bounds__(128) ssm_conv_update_f32(CONV_UPDATE_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    ssm::conv_update(CONV_UPDATE_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) ssm_conv_update_bf16(CONV_UPDATE_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    ssm::conv_update(CONV_UPDATE_ARGS);
}

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
