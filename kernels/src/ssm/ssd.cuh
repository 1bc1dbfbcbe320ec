// The chunked selective scan for prompt chunks, and the tiles its kernels share: steps 1–3
// in ssd_state.cu, step 4 in ssd_scan.cu (the planner of both: ssd.rs; columns and layouts:
// ssm.cuh).
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
#pragma once
#include "ssm.cuh"

// Dynamic shared memory of the kernels that use it (ssd_scan_mma).
extern __shared__ __align__(16) u16 ssm_dyn_smem[];

namespace ssm {

// ---------------------------------------------------------------------------------------
// SIMT tiles (f32 operands in shared memory): 256 threads as 8 (m) × 32 (n); a thread owns
// rows m = ty + 8i (i < 4) and columns n = tx + 32j (j < 2) of a 32 × 64 tile.

constexpr int ST_THREADS = 256;  // ssd.rs: SIMT_THREADS
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


constexpr int SCAN_THREADS = 256;  // ssd.rs: SCAN_THREADS (8 warps)
constexpr int SCAN_ROWS = 128;     // ssd.rs: SCAN_ROWS (rows of l per CTA, tokens per s tile)
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

}  // namespace ssm
