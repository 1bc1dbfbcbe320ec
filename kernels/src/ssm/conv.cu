// Causal conv1d (after Dao-AILab causal-conv1d and vLLM's varlen Triton conv; the planner:
// conv.rs; columns and layouts: ssm.cuh):
// out_t = silu(bias + Σ_j w_j·in(t − (k−1) + j)), where in(q < 0) reads the live conv state.
// - ssm_conv_chunks: one thread per channel walks CONV_ROWS rows of one chunk with a
//   right-aligned register window; the block holding a chunk's end writes the snapshot states
//   (the k − 1 inputs before the chunk end). It only reads the live state.
// - ssm_conv_update: one thread per (sequence, channel): the new live state (the last k − 1
//   inputs of the sequence), and for decodes the output and snapshots. Launched after
//   conv_chunks, so prompt chunks have read the old state before it is replaced.
// - ssm_conv_recurrent: when every prompt of the step is short (verify steps), one thread per
//   (prompt, channel) walks the prompt token by token in place of both for the prompts.
#include "ssm.cuh"

namespace ssm {

constexpr int MAXK = 8;            // conv.rs: MAX_CONV_KERNEL
constexpr int CONV_THREADS = 128;  // conv.rs: CONV_THREADS
constexpr int CONV_ROWS = 32;      // conv.rs: CONV_ROWS

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

// Short prompts (a verify step's, when every prompt of the step is short; conv.rs
// launches_conv): one thread per (prompt entry, channel) walks the entry's tokens with the
// right-aligned window of conv_chunks, starting from the live state, writing each output, the
// snapshot states at the chunk ends that carry them, and the new live state: one launch in place
// of conv_chunks and the prompts' share of conv_update (which then takes the decodes only).
template <typename T>
__device__ void conv_recurrent(const T* x, const T* weight, const T* bias, T* out, float* pool,
                               const u32* seq_slot, const u32* seq_chunk, const u32* seq_chunks,
                               const u32* ck_tok, const u32* ck_len, const u32* ck_snap,
                               const u32* ck_snaps, const u32* snap_slot, u32 seq_base,
                               u32 channels, u32 kernel, u32 x_ld, u32 out_ld, u32 layer,
                               u32 layers, u32 slots, u32 ch_blocks) {
    const u32 e = seq_base + blockIdx.x / ch_blocks;
    const u32 c = (blockIdx.x % ch_blocks) * CONV_THREADS + threadIdx.x;
    if (c >= channels) return;
    const u32 c0 = seq_chunk[e], c1 = c0 + seq_chunks[e];
    const int hist = (int)kernel - 1;
    const u64 per = (u64)channels * hist;
    float* st = layer_state(pool, seq_slot[e], slots, layer, layers, per);
    if (!st) {  // a padding entry: zero outputs, no state
        CHIMERA_PDL_WAIT();
        for (u32 k = c0; k < c1; ++k)
            for (u32 t = ck_tok[k]; t < ck_tok[k] + ck_len[k]; ++t) store(out, (i64)t * out_ld + c, 0.0f);
        return;
    }
    st += (u64)c * hist;
    // Right-aligned: win[MAXK−1] is the newest input, wr[MAXK−k + j] = w_j.
    float wr[MAXK], win[MAXK];
#pragma unroll
    for (int j = 0; j < MAXK; ++j) {
        const int src = j - (MAXK - (int)kernel);
        wr[j] = src >= 0 ? load(weight, (i64)c * kernel + src) : 0.0f;
        win[j] = j >= MAXK - hist ? st[j - (MAXK - hist)] : 0.0f;
    }
    const float b = bias ? load(bias, c) : 0.0f;
    // The entry's chunks are consecutive token rows; each input is requested a token ahead,
    // so its load overlaps the step before instead of waiting behind its store.
    if (c1 == c0) return;  // (a real entry has at least one chunk)
    const u32 tb = ck_tok[c0], te = ck_tok[c1 - 1] + ck_len[c1 - 1];
    // Everything above (the plan, the weights, the live state: none written by the kernels
    // just before this one) was read before waiting for them; the inputs and every store
    // come after (see the entry point).
    CHIMERA_PDL_WAIT();
    float next = load(x, (i64)tb * x_ld + c);
    u32 k = c0, kend = tb + ck_len[c0];
    for (u32 t = tb; t < te; ++t) {
#pragma unroll
        for (int j = 0; j < MAXK - 1; ++j) win[j] = win[j + 1];
        win[MAXK - 1] = next;
        if (t + 1 < te) next = load(x, (i64)(t + 1) * x_ld + c);
        float acc = 0.0f;  // the CPU's order: Σ_j w_j·in_j from j = 0
#pragma unroll
        for (int j = 0; j < MAXK; ++j)
            if (j >= MAXK - (int)kernel) acc += wr[j] * win[j];
        store(out, (i64)t * out_ld + c, silu(acc + b));
        // A chunk end (a verify step's plan ends one at every draft position; chunks are at
        // least a token long): its snapshots.
        if (t + 1 == kend) {
            for (u32 q = ck_snap[k]; q < ck_snap[k] + ck_snaps[k]; ++q) {
                float* dst = layer_state(pool, snap_slot[q], slots, layer, layers, per);
                if (!dst) continue;
                dst += (u64)c * hist;
#pragma unroll
                for (int j = 0; j < MAXK; ++j)
                    if (j >= MAXK - hist) dst[j - (MAXK - hist)] = win[j];
            }
            if (++k < c1) kend = ck_tok[k] + ck_len[k];
        }
    }
#pragma unroll
    for (int j = 0; j < MAXK; ++j)
        if (j >= MAXK - hist) st[j - (MAXK - hist)] = win[j];
}

// Channels a conv_update thread takes: four when the conv is 4 wide (3 history columns, so
// four channels' states are 12 consecutive floats, three 16-byte loads) and they divide the
// channels; else one. conv.rs: conv_update_channels.
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
}  // namespace ssm

// ---------------------------------------------------------------------------------------
// Entry points (conv.rs: ENTRIES).

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

#define CONV_RECURRENT_PARAMS(T)                                                             \
    const T *x, const T *weight, const T *bias, T *out, float *pool, const u32 *seq_slot,      \
        const u32 *seq_chunk, const u32 *seq_chunks, const u32 *ck_tok, const u32 *ck_len,   \
        const u32 *ck_snap, const u32 *ck_snaps, const u32 *snap_slot, u32 seq_base,         \
        u32 channels, u32 kernel, u32 x_ld, u32 out_ld, u32 layer, u32 layers, u32 slots,    \
        u32 ch_blocks
// The recurrent conv reads the plan, its weights and the live state before waiting for the
// kernels before it (programmatic dependent launch, common.cuh): none of them writes those
// (the step's slot restores ran before its first layer, which waited for them), and every
// store comes after the wait. It lets the next kernel start at once, as the GEMV does.
#define CONV_RECURRENT_ARGS                                                                  \
    x, weight, bias, out, pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap,     \
        ck_snaps, snap_slot, seq_base, channels, kernel, x_ld, out_ld, layer, layers, slots,  \
        ch_blocks

extern "C" __global__ void __launch_bounds__(128) ssm_conv_recurrent_f32(CONV_RECURRENT_PARAMS(float)) { CHIMERA_PDL_LAUNCH_DEPENDENTS();
    ssm::conv_recurrent(CONV_RECURRENT_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) ssm_conv_recurrent_bf16(CONV_RECURRENT_PARAMS(bf16)) { CHIMERA_PDL_LAUNCH_DEPENDENTS();
    ssm::conv_recurrent(CONV_RECURRENT_ARGS);
}
