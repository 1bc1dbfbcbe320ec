// FP8 (e4m3) weights: per-row quantization (online quantization of weights, and of activations
// per token before an FP8 GEMM), dequantization, and the small-batch GEMV that streams the
// codes once.
//
// A weight is `codes` (one byte an element, row-major [rows, cols]) and f32 `scales`: one per
// row when `b0 == 0`, else one per b0 × b1 block, [ceil(rows / b0), ceil(cols / b1)] of them.
//
// Decoding without a conversion instruction: an e4m3 code's bits, shifted so that its 4-bit
// exponent and 3-bit mantissa sit at the top of an f32's exponent and mantissa fields, are an
// f32 whose value is the code's times 2^-120 (the exponent biases are 7 and 127). Subnormal
// codes land on f32 subnormals with the same property, so the decode is exact for every
// finite code; the 2^120 is folded into the scale.
#include "common.cuh"

#define FP8_WARPS 8

// One block a row: scales[row] = max|src| / 448 (1 for an all-zero row), codes = src / scale.
template <typename T>
__device__ void quantize_rows(const T* __restrict__ src, u8* __restrict__ codes,
                              float* __restrict__ scales, u32 cols) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * cols;
    float amax = 0.0f;
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) amax = fmaxf(amax, fabsf(load(src, base + j)));
    amax = block_max(amax, scratch);
    const float s = (amax > 0.0f && amax <= 3.4028234663852886e38f) ? amax / FP8_MAX : 1.0f;
    if (threadIdx.x == 0) scales[blockIdx.x] = s;
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) codes[base + j] = f32_to_fp8(load(src, base + j) / s);
}

#define FP8_QUANTIZE(NAME, T)                                                                     \
    extern "C" __global__ void NAME(const T* src, u8* codes, float* scales, u32 cols) {           \
        CHIMERA_PDL_ENTRY();                                                                      \
        quantize_rows<T>(src, codes, scales, cols);                                               \
    }
FP8_QUANTIZE(fp8_quantize_rows_f32, float)
FP8_QUANTIZE(fp8_quantize_rows_bf16, bf16)

// dst[r, c] = decode(codes[r, c]) · scale(r, c), grid-stride over all elements.
template <typename T>
__device__ void dequantize(const u8* __restrict__ codes, const float* __restrict__ scales,
                           T* __restrict__ dst, u32 rows, u32 cols, u32 b0, u32 b1) {
    const u64 n = (u64)rows * cols;
    const u32 bc = b0 ? (cols + b1 - 1) / b1 : 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(i / cols), c = (u32)(i % cols);
        const float s = b0 ? scales[(r / b0) * bc + c / b1] : scales[r];
        store(dst, i, fp8_to_f32(codes[i]) * s);
    }
}

#define FP8_DEQUANTIZE(NAME, T)                                                                   \
    extern "C" __global__ void NAME(const u8* codes, const float* scales, T* dst, u32 rows,       \
                                    u32 cols, u32 b0, u32 b1) {                                   \
        CHIMERA_PDL_ENTRY();                                                                      \
        dequantize<T>(codes, scales, dst, rows, cols, b0, b1);                                    \
    }
FP8_DEQUANTIZE(fp8_dequantize_f32, float)
FP8_DEQUANTIZE(fp8_dequantize_bf16, bf16)

// Sixteen activations as f32 (16-byte aligned: k is a multiple of 16).
__device__ __forceinline__ void load_x16(const float* p, float* v) {
#pragma unroll
    for (int j = 0; j < 4; ++j) load16(p, 4 * j, v + 4 * j);
}
__device__ __forceinline__ void load_x16(const bf16* p, float* v) {
    load16(p, 0, v);
    load16(p, 8, v + 8);
}

__device__ __forceinline__ uint4 ld16_nc(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Σ of 16 decoded codes (× 2^-120) times 16 activations.
__device__ __forceinline__ float dot16(const uint4& w, const float* x) {
    const u32 ws[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float f[4];
        fp8x4_scaled(ws[j], f);
#pragma unroll
        for (int t = 0; t < 4; ++t) acc = fmaf(f[t], x[4 * j + t], acc);
    }
    return acc;
}

// The R weight rows a GEMV block or warp reads, from output feature feat0 on: each row's codes,
// its scales and its row within its own matrix (gated: the first R / 2 rows are the gate's,
// the rest the up projection's rows of the same features).
template <int R>
struct GemvRows {
    const u8* w[R];
    const float* s[R];
    u32 row[R];

    __device__ __forceinline__ GemvRows(const u8* w1, const float* s1, const u8* w2, const float* s2,
                                        u32 feat0, u32 k) {
        const bool gated = w2 != nullptr;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const bool second = gated && r >= R / 2;
            row[r] = feat0 + (second ? r - R / 2 : r);
            w[r] = (second ? w2 : w1) + (u64)row[r] * k;
            s[r] = second ? s2 : s1;
        }
    }
};

// acc[i][r] += (chunk c of row r, 16 codes) · x[i, c .. c + 16] for the n ≤ N input rows, with
// the chunk's block scale (b0 > 0; bc blocks a row) or none (row scales come at the end).
template <typename T, int N, int R>
__device__ __forceinline__ void gemv_chunk(float (&acc)[N][R], const uint4 (&wv)[R], const GemvRows<R>& rows,
                                           const T* x, u32 n, u32 k, u32 c, u32 b0, u32 b1, u32 bc) {
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = b0 ? rows.s[r][(rows.row[r] / b0) * bc + c / b1] : 1.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (i >= (int)n) break;
        float xv[16];
        load_x16(x + (u64)i * k + c, xv);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[i][r] = fmaf(s[r], dot16(wv[r], xv), acc[i][r]);
    }
}

// y[n, m] = x[n, k] · (codes · scales)[m, k]ᵀ (+ bias[m]) for n ≤ N rows. A block of FP8_WARPS
// warps owns ROWS output features; lane l of warp w reads the 16-byte chunks at
// (j · FP8_WARPS + w) · 32 + l of each row, U chunks per row in flight, and multiplies them
// with the same 16 activations of every x row. With block scales each 16-byte chunk lies in
// one block (b1 a multiple of 16), so its partial sum takes that block's scale; with row
// scales the scale is applied once at the end. Requirements checked by the host: k a multiple
// of 16, m a multiple of ROWS (of ROWS / 2 when gated).
//
// Gated (w2 non-null: w the gate, w2 the up projection, same shape and scale layout): a
// block's rows are ROWS / 2 of each and it writes act(gate) · up, each rounded to the output
// type first as the separate projections and product kernel would, so the fused result
// equals theirs.
template <typename T, int N, int ROWS, int U>
__device__ void fp8_gemv(const T* __restrict__ x, u32 n, u32 k, const u8* __restrict__ w,
                         const float* __restrict__ scales, u32 b0, u32 b1,
                         const T* __restrict__ bias, T* __restrict__ y, u32 m,
                         const u8* __restrict__ w2, const float* __restrict__ scales2,
                         const T* __restrict__ bias2, u32 act) {
    __shared__ float part[FP8_WARPS][N * ROWS];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const bool gated = w2 != nullptr;
    const u32 per_block = gated ? ROWS / 2 : ROWS;
    const u32 feat0 = blockIdx.x * per_block;
    const u32 stride = FP8_WARPS * 32 * 16;
    const u32 first = (warp * 32 + lane) * 16;
    const u32 bc = b0 ? (k + b1 - 1) / b1 : 0;
    const GemvRows<ROWS> rows(w, scales, w2, scales2, feat0, k);
    float acc[N][ROWS];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.0f;
    CHIMERA_PDL_WAIT();
    for (u32 base = first; base < k; base += stride * U) {
        uint4 wv[U][ROWS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 c = base + u * stride;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                if (c < k) wv[u][r] = ld16_nc(rows.w[r] + c);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 c = base + u * stride;
            if (c >= k) break;
            gemv_chunk<T, N, ROWS>(acc, wv[u], rows, x, n, k, c, b0, b1, bc);
        }
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[i][r]);
            if (lane == 0) part[warp][i * ROWS + r] = v;
        }
    __syncthreads();
    CHIMERA_PDL_LAUNCH_DEPENDENTS();
    const u32 t = threadIdx.x;
    // The epilogue indexes rows by a thread's r: copies, so that `rows` itself (indexed only
    // by unrolled constants above) stays in registers.
    const float* sr[ROWS];
    u32 rr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        sr[r] = rows.s[r];
        rr[r] = rows.row[r];
    }
    // Row r's finished dot product for input row i, bias included.
    auto result = [&](u32 i, u32 r) {
        float v = 0.0f;
#pragma unroll
        for (int q = 0; q < FP8_WARPS; ++q) v += part[q][i * ROWS + r];
        v *= FP8_UNBIAS;
        if (!b0) v *= sr[r][rr[r]];
        const T* b = gated && r >= ROWS / 2 ? bias2 : bias;
        if (b) v += load(b, rr[r]);
        return v;
    };
    if (t < n * per_block) {
        const u32 i = t / per_block, r = t % per_block;
        float v = result(i, r);
        if (gated) {
            const float up = result(i, r + ROWS / 2);
            T g, u;
            store(&g, 0, v);
            store(&u, 0, up);
            v = apply_act(load(&g, 0), act) * load(&u, 0);
        }
        store(y, (u64)i * m + feat0 + r, v);
    }
}

// The same product with one warp per group of R output features (R / 2 gate and R / 2 up
// rows when gated) instead of a block: each lane streams the 16-byte chunks lane · 16 +
// j · 512 of the warp's rows, U chunks a row in flight and the next U loaded while the
// current are multiplied, and the warp's sums reduce by shuffles alone (no shared memory, no
// barrier). A block's warps are independent, so a grid of m / (FP8_WARPS · R) blocks has no
// partial last wave of whole-block work: the per-block kernel above, with few chunks a row
// (k = 4096: one a thread), spends its time in a second wave of short blocks. The weights
// of the first chunks are read before waiting on the previous kernel (they are written only
// at load, which synchronises); x after it.
template <typename T, int N, int R, int U>
__device__ void fp8_gemv_warp(const T* __restrict__ x, u32 n, u32 k, const u8* __restrict__ w,
                              const float* __restrict__ scales, u32 b0, u32 b1,
                              const T* __restrict__ bias, T* __restrict__ y, u32 m,
                              const u8* __restrict__ w2, const float* __restrict__ scales2,
                              const T* __restrict__ bias2, u32 act) {
    const u32 lane = threadIdx.x & 31;
    const bool gated = w2 != nullptr;
    const u32 per_warp = gated ? R / 2 : R;
    const u32 feat0 = (blockIdx.x * FP8_WARPS + (threadIdx.x >> 5)) * per_warp;
    if (feat0 >= m) return;  // warp-uniform; the host launches whole groups
    const u32 bc = b0 ? (k + b1 - 1) / b1 : 0;
    const GemvRows<R> rows(w, scales, w2, scales2, feat0, k);
    constexpr u32 STRIDE = 32 * 16;
    const u32 iters = (k + STRIDE * U - 1) / (STRIDE * U);
    auto fetch = [&](u32 it, uint4 (&wv)[U][R]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 c = (it * U + u) * STRIDE + lane * 16;
#pragma unroll
            for (int r = 0; r < R; ++r) wv[u][r] = c < k ? ld16_nc(rows.w[r] + c) : make_uint4(0, 0, 0, 0);
        }
    };
    float acc[N][R];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;
    uint4 cur[U][R], next[U][R];
    fetch(0, cur);
    CHIMERA_PDL_WAIT();
    for (u32 it = 0; it < iters; ++it) {
        if (it + 1 < iters) fetch(it + 1, next);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 c = (it * U + u) * STRIDE + lane * 16;
            if (c >= k) break;
            gemv_chunk<T, N, R>(acc, cur[u], rows, x, n, k, c, b0, b1, bc);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) cur[u][r] = next[u][r];
    }
    CHIMERA_PDL_LAUNCH_DEPENDENTS();
    float v[N][R];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            v[i][r] = warp_sum(acc[i][r]) * FP8_UNBIAS;
            if (!b0) v[i][r] *= rows.s[r][rows.row[r]];
            const T* b = gated && r >= R / 2 ? bias2 : bias;
            if (b) v[i][r] += load(b, rows.row[r]);
        }
    if (lane != 0) return;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (i >= (int)n) break;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= (int)per_warp) break;
            float out = v[i][r];
            if (gated) {
                T g, u;
                store(&g, 0, out);
                store(&u, 0, v[i][r + R / 2]);
                out = apply_act(load(&g, 0), act) * load(&u, 0);
            }
            store(y, (u64)i * m + feat0 + r, out);
        }
    }
}

#define FP8_GEMV_WARP(NAME, T, N, R, U)                                                           \
    extern "C" __global__ void __launch_bounds__(FP8_WARPS * 32)                                  \
        NAME(const T* x, u32 n, u32 k, const u8* w, const float* scales, u32 b0, u32 b1,          \
             const T* bias, T* y, u32 m, const u8* w2, const float* scales2, const T* bias2,      \
             u32 act) {                                                                           \
        fp8_gemv_warp<T, N, R, U>(x, n, k, w, scales, b0, b1, bias, y, m, w2, scales2, bias2,     \
                                  act);                                                           \
    }

#define FP8_GEMV(NAME, T, N, ROWS, U)                                                             \
    extern "C" __global__ void __launch_bounds__(FP8_WARPS * 32)                                  \
        NAME(const T* x, u32 n, u32 k, const u8* w, const float* scales, u32 b0, u32 b1,          \
             const T* bias, T* y, u32 m, const u8* w2, const float* scales2, const T* bias2,      \
             u32 act) {                                                                           \
        fp8_gemv<T, N, ROWS, U>(x, n, k, w, scales, b0, b1, bias, y, m, w2, scales2, bias2, act); \
    }
FP8_GEMV(fp8_gemv_f32_n1, float, 1, 4, 2)
FP8_GEMV(fp8_gemv_f32_n2, float, 2, 4, 2)
FP8_GEMV(fp8_gemv_bf16_n1, bf16, 1, 4, 2)
FP8_GEMV(fp8_gemv_bf16_n2, bf16, 2, 4, 2)
// Other shapes of the one-row bf16 GEMV (ROWS features a block, U chunks a row in flight),
// timed against the default by `bench-fp8` (CudaBackend::set_fp8_gemv_variant).
FP8_GEMV(fp8_gemv_bf16_n1_r8u1, bf16, 1, 8, 1)
FP8_GEMV(fp8_gemv_bf16_n1_r8u2, bf16, 1, 8, 2)
FP8_GEMV(fp8_gemv_bf16_n1_r16u1, bf16, 1, 16, 1)
FP8_GEMV(fp8_gemv_bf16_n1_r2u4, bf16, 1, 2, 4)
// A warp a group of features (fp8_gemv_warp): R features a warp, U chunks a row in flight.
FP8_GEMV_WARP(fp8_gemv_bf16_n1_w2u4, bf16, 1, 2, 4)
FP8_GEMV_WARP(fp8_gemv_bf16_n1_w4u2, bf16, 1, 4, 2)
FP8_GEMV_WARP(fp8_gemv_bf16_n1_w2u2, bf16, 1, 2, 2)
