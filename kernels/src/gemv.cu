// Small-batch linear layers in bf16: y[n, m] = x[n, k] · w[m, k]ᵀ (+ b[m]) for n ≤ 8 rows, the
// decode-time shape (and a verify step's few tokens) where the whole cost is streaming the
// weight once.
//
// cuBLASLt picks split-K kernels for these shapes: several partial passes plus a reduction
// kernel, and the smaller projections (K/V, 1024 × 4096) reach only 1.2–2.9 TB/s of the H200's
// 4.8. Here a block of 8 warps owns a group of ROWS output features (looping over groups when
// the grid is smaller than their count) and splits k between its warps: lane
// `l` of warp `w` reads the 16-byte chunks at (j·8 + w)·32 + l of each of the ROWS weight rows,
// U chunks per row in flight before the first FMA, multiplies them with the same columns of
// every x row (so x is read once per block) and accumulates in f32. A warp reduction and a
// pass through shared memory finish each dot product. Nothing is reduced across blocks, so a
// launch is one pass over the weight, and short rows still give every SM many loads in flight.
//
// One launch may cover up to three weights that share the input (the q/k/v projections, or
// gate and up): "segments" laid end to end in the block index space, each with its own weight,
// bias and output. Unused segments have m = 0.
//
// Requirements checked by the host: k a multiple of 8 (16-byte rows), every segment's m a
// multiple of ROWS, pointers 16-byte aligned (the arena and the weight allocations are).
#include "common.cuh"
#include "mma.cuh"

#define GEMV_WARPS 8

struct u32x4 {
    u32 a, b, c, d;
};

__device__ __forceinline__ u32x4 ld16(const bf16* p) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d)
                 : "l"(p));
    return v;
}

// Σ of the 8 products of two packed bf16 octets, added to acc.
__device__ __forceinline__ float dot8(const u32x4& w, const u32x4& x, float acc) {
    const u32 ws[4] = {w.a, w.b, w.c, w.d};
    const u32 xs[4] = {x.a, x.b, x.c, x.d};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc = fmaf(__uint_as_float(ws[j] << 16), __uint_as_float(xs[j] << 16), acc);
        acc = fmaf(__uint_as_float(ws[j] & 0xffff0000u), __uint_as_float(xs[j] & 0xffff0000u), acc);
    }
    return acc;
}

// Epilogues (`mode`): the plain product; the activation of it; or a gated MLP's input, where
// segment 0 is the gate, segment 1 the up projection (equal m, no third segment) and a block's
// rows are two of each, so it writes act(gate) * up (segment 0's output, m features) and the
// product kernel and its pass over two outputs are not needed. Each step rounds to bf16 where
// the unfused kernels store bf16 (the projections' outputs, then the product), so the fused
// results equal theirs bit for bit.
#define GEMV_PLAIN 0u
#define GEMV_ACT 1u
#define GEMV_GATED 2u

// The segment that row `row` of the groups laid end to end falls in: its weight, bias, output
// and width, with `row` made relative to it.
struct GemvSegment {
    const bf16* w;
    const bf16* b;
    bf16* y;
    u32 m;
};

__device__ __forceinline__ GemvSegment segment_of(u32& row, const bf16* w0, const bf16* b0,
                                                  bf16* y0, u32 m0, const bf16* w1,
                                                  const bf16* b1, bf16* y1, u32 m1,
                                                  const bf16* w2, const bf16* b2, bf16* y2,
                                                  u32 m2) {
    if (row < m0) return {w0, b0, y0, m0};
    if (row < m0 + m1) {
        row -= m0;
        return {w1, b1, y1, m1};
    }
    row -= m0 + m1;
    return {w2, b2, y2, m2};
}

template <int N, int ROWS, int U>
__device__ void gemv(const bf16* __restrict__ x, u32 n, u32 k, const bf16* w0, const bf16* b0,
                     bf16* y0, u32 m0, const bf16* w1, const bf16* b1, bf16* y1, u32 m1,
                     const bf16* w2, const bf16* b2, bf16* y2, u32 m2, u32 mode, u32 act) {
    static_assert(ROWS % 2 == 0, "gated groups take ROWS / 2 rows of gate and of up");
    // Two buffers: a group's sums are read from one while the next group's go to the other.
    __shared__ float part[2][GEMV_WARPS][N * ROWS];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const bool gated = mode == GEMV_GATED;
    const u32 groups = gated ? m0 / (ROWS / 2) : (m0 + m1 + m2) / ROWS;
    const u32 stride = GEMV_WARPS * 32 * 8;
    const u32 first = (warp * 32 + lane) * 8;
    u32x4 wv[U][ROWS];
    // Every weight load of a trip is issued before any arithmetic.
    auto load_trip = [&](const bf16* const* wr, u32 base) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 c = base + u * stride;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                if (c < k) wv[u][r] = ld16(wr[r] + c);
        }
    };
    // The row groups of all segments, laid end to end, are shared out round-robin: with a
    // grid of one block per group each block takes one; a smaller grid keeps its blocks
    // resident (no block launched per group).
    for (u32 g = blockIdx.x, it = 0; g < groups; g += gridDim.x, ++it) {
        u32 row = g * ROWS;
        const bf16* w;
        const bf16* b;
        bf16* y;
        u32 m;
        const bf16* wr[ROWS];
        if (gated) {
            row = g * (ROWS / 2);
            w = w0, b = b0, y = y0, m = m0;
#pragma unroll
            for (int r = 0; r < ROWS / 2; ++r) {
                wr[r] = w0 + (u64)(row + r) * k;
                wr[ROWS / 2 + r] = w1 + (u64)(row + r) * k;
            }
        } else {
            const GemvSegment seg = segment_of(row, w0, b0, y0, m0, w1, b1, y1, m1, w2, b2, y2, m2);
            w = seg.w, b = seg.b, y = seg.y, m = seg.m;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) wr[r] = w + (u64)(row + r) * k;
        }
        float acc[N][ROWS];
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.0f;
        load_trip(wr, first);
        // The weights never depend on the previous kernel: the first trip's loads go out
        // before waiting for it (programmatic dependent launch, see CHIMERA_PDL_ENTRY), so a
        // launch overlaps its ramp-up with the tail of the kernel before. x is read only after
        // the wait.
        if (it == 0) CHIMERA_PDL_WAIT();
        for (u32 base = first; base < k; base += stride * U) {
            if (base != first) load_trip(wr, base);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 c = base + u * stride;
                if (c >= k) break;
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    if (i >= (int)n) break;
                    const u32x4 xv = ld16(x + (u64)i * k + c);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[i][r] = dot8(wv[u][r], xv, acc[i][r]);
                }
            }
        }
        float(*sums)[N * ROWS] = part[it & 1];
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float s = warp_sum(acc[i][r]);
                if (lane == 0) sums[warp][i * ROWS + r] = s;
            }
        __syncthreads();
        const u32 t = threadIdx.x;
        auto sum_of = [&](u32 i, u32 r) {
            float s = 0.0f;
#pragma unroll
            for (int v = 0; v < GEMV_WARPS; ++v) s += sums[v][i * ROWS + r];
            return s;
        };
        auto rounded = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
        if (gated) {
            if (t < n * (ROWS / 2)) {
                const u32 i = t / (ROWS / 2), r = t % (ROWS / 2);
                const float gs = sum_of(i, r) + (b0 ? bf16_to_f32(b0[row + r]) : 0.0f);
                const float us = sum_of(i, ROWS / 2 + r) + (b1 ? bf16_to_f32(b1[row + r]) : 0.0f);
                y[(u64)i * m + row + r] = f32_to_bf16(apply_act(rounded(gs), act) * rounded(us));
            }
        } else if (t < n * ROWS) {
            const u32 i = t / ROWS, r = t % ROWS;
            float s = sum_of(i, r) + (b ? bf16_to_f32(b[row + r]) : 0.0f);
            if (mode == GEMV_ACT) s = apply_act(rounded(s), act);
            y[(u64)i * m + row + r] = f32_to_bf16(s);
        }
    }
}

#define GEMV_ENTRY(NAME, N, ROWS, U, MIN_BLOCKS)                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                    \
        NAME(const bf16* x, u32 n, u32 k, const bf16* w0, const bf16* b0, bf16* y0, u32 m0,      \
             const bf16* w1, const bf16* b1, bf16* y1, u32 m1, const bf16* w2, const bf16* b2,   \
             bf16* y2, u32 m2, u32 mode, u32 act) {                                              \
        CHIMERA_PDL_LAUNCH_DEPENDENTS();                                                         \
        gemv<N, ROWS, U>(x, n, k, w0, b0, y0, m0, w1, b1, y1, m1, w2, b2, y2, m2, mode, act);    \
    }

// Measured on the H200 (tests/gpu/run.sh bench): at 1 and 2 rows this beats cuBLASLt on every
// decode shape of Llama-3-8B and NemotronH-8B; at 4 rows it lost on most of them (the FMAs per
// weight byte grow with n), so wider batches stay on cuBLASLt. One row: two features a block,
// one 16-byte load a row a trip, 32 registers so 8 blocks (2048 threads) share an SM — against
// four features, four loads a row and 100 registers (2 blocks an SM) before, o_proj 3.33 →
// 3.78 TB/s and down_proj 3.95 → 4.35 in the same runs; grids capped to resident blocks
// looping over more groups (CHIMERA_GEMV_BLOCKS_PER_SM) measured no better.
GEMV_ENTRY(gemv_bf16_n1, 1, 2, 1, 8)
GEMV_ENTRY(gemv_bf16_n2, 2, 4, 2, 2)

// Three to eight rows (a verify step's last token and its drafts, a small batch): with FMAs
// the conversions and products per weight byte grow with n until the SMs, not the memory,
// set the pace (the two-row kernel widened to four lost to cuBLASLt). Here the products run on
// the tensor cores, one m16n8k16 bf16 MMA with f32 accumulation per 16 weights of 16 rows: a
// block owns a group of 16 output features (a gated launch: 8 of gate, 8 of up), its 8 warps
// split k, and the n ≤ 8 input rows are the MMA's 8 columns (rows past n are zeros).
//
// The fragments come straight from 16-byte loads. A dot product does not care in which order
// k is walked, as long as the weight and x walk it alike: lane (g, t) = (lane / 4, lane % 4)
// loads the 8 weights at columns c + 8t of rows g and g + 8 and the 8 values of x row g at the
// same columns, and hands the first four of each to one MMA (its k pairs 2t and 2t + 8) and
// the last four to a second. Four lanes read 64 contiguous bytes of a row: whole sectors.
// The epilogues are the one- and two-row kernel's, with the same roundings.
template <int U>
__device__ void gemv_mma(const bf16* __restrict__ x, u32 n, u32 k, const bf16* w0,
                         const bf16* b0, bf16* y0, u32 m0, const bf16* w1, const bf16* b1,
                         bf16* y1, u32 m1, const bf16* w2, const bf16* b2, bf16* y2, u32 m2,
                         u32 mode, u32 act) {
    // Two buffers, as above: [warp][feature * 8 + input row].
    __shared__ float part[2][GEMV_WARPS][16 * 8];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const bool gated = mode == GEMV_GATED;
    const u32 groups = gated ? m0 / 8 : (m0 + m1 + m2) / 16;
    // Columns per trip of the whole block; a warp's trips start at warp * 32 (warp-uniform
    // bounds: every lane must reach each mma.sync), a lane's loads 8t further.
    const u32 stride = GEMV_WARPS * 32;
    const u32 first = warp * 32;
    const bf16* xr = g < n ? x + (u64)g * k : nullptr;
    const u32x4 zero = {0u, 0u, 0u, 0u};
    for (u32 grp = blockIdx.x, it = 0; grp < groups; grp += gridDim.x, ++it) {
        u32 row;
        const bf16* b;
        bf16* y;
        u32 m;
        const bf16* lo;
        const bf16* hi;
        if (gated) {
            row = grp * 8;
            b = b0, y = y0, m = m0;
            lo = w0 + (u64)(row + g) * k;
            hi = w1 + (u64)(row + g) * k;
        } else {
            row = grp * 16;
            const GemvSegment seg = segment_of(row, w0, b0, y0, m0, w1, b1, y1, m1, w2, b2, y2, m2);
            b = seg.b, y = seg.y, m = seg.m;
            lo = seg.w + (u64)(row + g) * k;
            hi = seg.w + (u64)(row + 8 + g) * k;
        }
        u32x4 wl[U], wh[U], xv[U];
        auto load_w = [&](u32 base) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 c = base + u * stride + t * 8;
                wl[u] = c < k ? ld16(lo + c) : zero;
                wh[u] = c < k ? ld16(hi + c) : zero;
            }
        };
        auto load_x = [&](u32 base) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 c = base + u * stride + t * 8;
                xv[u] = xr && c < k ? ld16(xr + c) : zero;
            }
        };
        // Two accumulators halve the chain of dependent MMAs.
        float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        load_w(first);
        // As above: the weights' first loads go out before waiting for the previous kernel.
        if (it == 0) CHIMERA_PDL_WAIT();
        for (u32 base = first; base < k; base += stride * U) {
            if (base != first) load_w(base);
            load_x(base);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 a0[4] = {wl[u].a, wh[u].a, wl[u].b, wh[u].b};
                mma_bf16_16816(acc[0], a0, xv[u].a, xv[u].b);
                const u32 a1[4] = {wl[u].c, wh[u].c, wl[u].d, wh[u].d};
                mma_bf16_16816(acc[1], a1, xv[u].c, xv[u].d);
            }
        }
        // Lane (g, t) holds features g and g + 8 for input rows 2t and 2t + 1.
        float* sums = part[it & 1][warp];
        sums[g * 8 + 2 * t] = acc[0][0] + acc[1][0];
        sums[g * 8 + 2 * t + 1] = acc[0][1] + acc[1][1];
        sums[(g + 8) * 8 + 2 * t] = acc[0][2] + acc[1][2];
        sums[(g + 8) * 8 + 2 * t + 1] = acc[0][3] + acc[1][3];
        __syncthreads();
        const u32 tid = threadIdx.x;
        auto sum_of = [&](u32 i, u32 r) {
            float s = 0.0f;
#pragma unroll
            for (int v = 0; v < GEMV_WARPS; ++v) s += part[it & 1][v][r * 8 + i];
            return s;
        };
        auto rounded = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
        if (gated) {
            if (tid < n * 8) {
                const u32 i = tid / 8, r = tid % 8;
                const float gs = sum_of(i, r) + (b0 ? bf16_to_f32(b0[row + r]) : 0.0f);
                const float us = sum_of(i, 8 + r) + (b1 ? bf16_to_f32(b1[row + r]) : 0.0f);
                y[(u64)i * m + row + r] = f32_to_bf16(apply_act(rounded(gs), act) * rounded(us));
            }
        } else if (tid < n * 16) {
            const u32 i = tid / 16, r = tid % 16;
            float s = sum_of(i, r) + (b ? bf16_to_f32(b[row + r]) : 0.0f);
            if (mode == GEMV_ACT) s = apply_act(rounded(s), act);
            y[(u64)i * m + row + r] = f32_to_bf16(s);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gemv_bf16_mma(const bf16* x, u32 n, u32 k, const bf16* w0, const bf16* b0, bf16* y0, u32 m0,
                  const bf16* w1, const bf16* b1, bf16* y1, u32 m1, const bf16* w2,
                  const bf16* b2, bf16* y2, u32 m2, u32 mode, u32 act) {
    CHIMERA_PDL_LAUNCH_DEPENDENTS();
    if (n > 8) return;  // the host sends 3..8 rows here
    gemv_mma<4>(x, n, k, w0, b0, y0, m0, w1, b1, y1, m1, w2, b2, y2, m2, mode, act);
}
