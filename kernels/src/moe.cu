// Grouped mixture-of-experts expert compute, entirely on the device: nothing comes back to
// the host, and every grid size depends only on the token count, top-k, the expert count and
// the layer's widths, so a step's launches can be captured in a CUDA graph.
//
// After `moe_route` (dense.cu) has written each token's expert ids and weights
// (`[tokens, top_k]`; entry j = t * top_k + k):
//
// 1. `moe_sort` (one CTA): counts the entries per expert, prefix-sums the counts into
//    `offsets[experts + 1]`, writes the expert-sorted entry list `sorted` (ascending expert,
//    entries ascending within an expert — so tokens ascending, as the CPU reference groups
//    them) and the tile list: one (expert, first row) per MOE_BM rows of each expert, at most
//    min(n, ceil(n / MOE_BM) + experts) tiles, their number in `n_tiles`. The order is
//    deterministic: each warp counts a contiguous range of entries, the (expert, warp) counts
//    are scanned in that order, and each warp then places its entries in order.
// 2. `moe_up_*` / `moe_up_gated_*`: a grouped GEMM, one CTA per (tile, column tile); CTAs
//    past `n_tiles` exit. Rows are the tile's tokens gathered from x; the output `mid` is in
//    sorted order: act(x · upᵀ), or act(x · gateᵀ) · (x · upᵀ) for gated experts (the gate and
//    up rows of one output column share a CTA, so the product is fused in the epilogue).
// 3. `moe_down_*`: the same grouped GEMM over `mid` and the down weights; each output row is
//    scaled by its routing weight and written to its own entry's row y[j] (no atomics).
// 4. `moe_combine_*` (one CTA per token): out[t] += y[t, k] over the token's picks in
//    ascending expert order — the CPU reference's summation order.
//
// bf16: tensor cores (mma.sync m16n8k16, bf16 → f32), ldmatrix from XOR-swizzled shared tiles
// filled by 16-byte cp.async in a 3-stage pipeline (K step 64); widths must be multiples of 8. f32 (the
// oracle mode): a plain shared-memory tiled SIMT GEMM. moe.rs mirrors the geometry.
//
// An expert id ≥ `experts` (which moe_route never writes) is left out of every step, so it can
// contribute nothing and never index out of bounds.
#include "mma.cuh"

#define MOE_BM 64
#define SORT_WARPS 16
#define MAX_TOP_K 32

// Exclusive prefix sum of one value per thread over the block (at most 1024 threads);
// `total` gets the sum. `scratch` holds 33 words of shared memory.
__device__ u32 block_exclusive_scan(u32 v, u32* scratch, u32& total) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    u32 inc = v;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        u32 y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u32 s = lane < warps ? scratch[lane] : 0u;
        u32 si = s;
#pragma unroll
        for (u32 o = 1; o < 32; o <<= 1) {
            u32 y = __shfl_up_sync(0xffffffffu, si, o);
            if (lane >= o) si += y;
        }
        scratch[lane] = si - s;
        if (lane == 31) scratch[32] = si;
    }
    __syncthreads();
    total = scratch[32];
    return scratch[warp] + inc - v;
}

// One CTA of SORT_WARPS warps; dynamic shared memory: experts * SORT_WARPS words.
extern "C" __global__ void moe_sort(u32* sorted, u32* offsets, u32* tile_e, u32* tile_m,
                                    u32* n_tiles, const u32* ids, u32 n, u32 experts,
                                    u32 max_tiles) { CHIMERA_PDL_ENTRY();
    extern __shared__ u32 moe_hist[];  // [experts][SORT_WARPS]: counts, then cursors
    __shared__ u32 scratch[33];
    const u32 cells = experts * SORT_WARPS;
    for (u32 i = threadIdx.x; i < cells; i += blockDim.x) moe_hist[i] = 0;
    __syncthreads();
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 per = (n + SORT_WARPS - 1) / SORT_WARPS;
    u32 lo = min(n, warp * per), hi = min(n, lo + per);
    for (u32 j = lo + lane; j < hi; j += 32) {
        u32 e = ids[j];
        if (e < experts) atomicAdd(&moe_hist[e * SORT_WARPS + warp], 1u);
    }
    __syncthreads();
    // Exclusive scan in (expert, warp) order; each thread scans a contiguous run of cells.
    u32 run = (cells + blockDim.x - 1) / blockDim.x;
    u32 c0 = min(cells, threadIdx.x * run), c1 = min(cells, c0 + run);
    u32 sum = 0;
    for (u32 c = c0; c < c1; ++c) sum += moe_hist[c];
    u32 total;
    u32 base = block_exclusive_scan(sum, scratch, total);
    for (u32 c = c0; c < c1; ++c) {
        u32 v = moe_hist[c];
        moe_hist[c] = base;
        base += v;
    }
    __syncthreads();
    // Offsets and the tile list (experts in order, MOE_BM rows a tile).
    u32 erun = (experts + blockDim.x - 1) / blockDim.x;
    u32 e0 = min(experts, threadIdx.x * erun), e1 = min(experts, e0 + erun);
    u32 tiles = 0;
    for (u32 e = e0; e < e1; ++e) {
        u32 s = moe_hist[e * SORT_WARPS];
        u32 end = e + 1 < experts ? moe_hist[(e + 1) * SORT_WARPS] : total;
        tiles += (end - s + MOE_BM - 1) / MOE_BM;
    }
    u32 all_tiles;
    u32 t = block_exclusive_scan(tiles, scratch, all_tiles);
    for (u32 e = e0; e < e1; ++e) {
        u32 s = moe_hist[e * SORT_WARPS];
        u32 end = e + 1 < experts ? moe_hist[(e + 1) * SORT_WARPS] : total;
        offsets[e] = s;
        for (u32 m = 0; m < end - s; m += MOE_BM, ++t) {
            if (t < max_tiles) {
                tile_e[t] = e;
                tile_m[t] = m;
            }
        }
    }
    if (threadIdx.x == 0) {
        offsets[experts] = total;
        n_tiles[0] = min(all_tiles, max_tiles);
    }
    __syncthreads();
    // Each warp places its entries in order: rank among equal experts of the same 32, plus
    // the warp's cursor for that expert.
    for (u32 j0 = lo; j0 < hi; j0 += 32) {
        u32 j = j0 + lane;
        u32 e = j < hi ? ids[j] : 0xffffffffu;
        bool ok = e < experts;
        u32 peers = __match_any_sync(0xffffffffu, e);
        if (ok) {
            u32 rank = __popc(peers & ((1u << lane) - 1u));
            sorted[moe_hist[e * SORT_WARPS + warp] + rank] = j;
        }
        __syncwarp();
        if (ok && lane == (u32)(__ffs(peers) - 1)) moe_hist[e * SORT_WARPS + warp] += __popc(peers);
        __syncwarp();
    }
}

// What a grouped GEMM CTA needs of the sort.
struct Groups {
    const u32* sorted;
    const u32* offsets;
    const u32* tile_e;
    const u32* tile_m;
    const u32* n_tiles;
};

#define MODE_UP 0
#define MODE_UP_GATED 1
#define MODE_DOWN 2

// ---------------------------------------------------------------------------------------
// bf16 tensor-core grouped GEMM: C[rows, N] = A[rows, K] · B[e]ᵀ with B[e] = [N, K].
// CTA tile 64 × 128 (B-tile rows; 64 output columns when gated), K step 64 (128-byte row
// segments from global memory), 4 warps of 32 × 64, 3 cp.async stages in dynamic shared
// memory (G_SMEM bytes; moe.rs raises the kernels' limit).

#define GB_M 64
#define GB_N 128
#define GB_K 64
#define G_STAGES 3
#define G_THREADS 128
#define G_SMEM (G_STAGES * (GB_M + GB_N) * GB_K * 2)

// Byte offset of 16-byte chunk c (0..7) of row r in a [rows][64] bf16 tile. Rows are 128
// bytes; XOR-ing the chunk with the row's low 3 bits spreads any 8 consecutive rows of one
// chunk over all 32 banks (ldmatrix and cp.async conflict-free).
__device__ __forceinline__ u32 tile_off(u32 r, u32 c) { return r * 128u + ((c ^ (r & 7u)) << 4); }

extern __shared__ __align__(128) u16 moe_gemm_smem[];

// FP8 experts (BT = u8: e4m3 codes, `bs` / `gs` one f32 scale per expert row of B / gate):
// each K step's code tile is staged by cp.async (64-byte rows, plain), converted after the
// stage's wait into one bf16 tile (the codes' exact values; swizzled as the bf16 path's), and
// the scales are applied per output column in the epilogue. K must be a multiple of 16.
template <int MODE, typename BT>
__device__ __forceinline__ void grouped_mma(bf16* c, const bf16* a, const BT* b, const BT* gate,
                                            const float* bs, const float* gs, const float* w,
                                            Groups g, u32 K, u32 N, u32 top_k, u32 act) {
    constexpr bool FP8 = sizeof(BT) == 1;
    u32 tile = blockIdx.x;
    if (tile >= g.n_tiles[0]) return;
    const u32 e = g.tile_e[tile];
    const u32 row0 = g.offsets[e] + g.tile_m[tile], row_end = g.offsets[e + 1];
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 n0 = blockIdx.y * (MODE == MODE_UP_GATED ? GB_N / 2 : GB_N);
    // Each thread copies chunk `lc` of rows lr + 16 i (A: 4 rows, B: 8 rows) every K step.
    const u32 lc = tid & 7, lr = tid >> 3;
    const bf16* a_src[4];
    bool a_ok[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 p = row0 + lr + 16 * i;
        a_ok[i] = p < row_end;
        u32 src_row = 0;
        if (a_ok[i]) src_row = MODE == MODE_DOWN ? p : g.sorted[p] / top_k;
        a_src[i] = a + (i64)src_row * K;
    }
    const BT* b_src[8];
    bool b_ok[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 r = lr + 16 * i, col;
        const BT* base = b;
        if (MODE == MODE_UP_GATED) {
            // Warp column wn holds the gate rows of its 32 output columns, then their up rows.
            u32 q = r & 63;
            col = n0 + (r >> 6) * 32 + (q & 31);
            if (q < 32) base = gate;
        } else {
            col = n0 + r;
        }
        b_ok[i] = col < N;
        b_src[i] = base + ((i64)e * N + (b_ok[i] ? col : 0)) * K;
    }
    const u32 sa0 = smem_addr(moe_gemm_smem), sb0 = sa0 + G_STAGES * GB_M * GB_K * 2;
    const u32 sa_bytes = GB_M * GB_K * 2, sb_bytes = GB_N * GB_K * sizeof(BT);
    // FP8: byte offsets (from moe_gemm_smem) of the code stages and of the converted tile.
    const u32 sb_off = G_STAGES * sa_bytes, sbt_off = sb_off + G_STAGES * sb_bytes;
    const u32 ktiles = (K + GB_K - 1) / GB_K;
    // FP8: thread (lr, lc) stages 16-code chunk lc & 3 of rows lr + 16 (h + 2 j), h = lc >> 2.
    const u32 c4 = lc & 3, h4 = lc >> 2;
    auto load = [&](u32 kt, u32 s) {
        u32 k = kt * GB_K + lc * 8;
        bool kin = k < K;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            bool ok = a_ok[i] && kin;
            cp_async_16(sa0 + s * sa_bytes + tile_off(lr + 16 * i, lc), ok ? a_src[i] + k : a, ok ? 16 : 0);
        }
        if constexpr (FP8) {
            const u32 kc = kt * GB_K + c4 * 16;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 i = h4 + 2 * j;
                bool ok = b_ok[i] && kc < K;
                cp_async_16(sb0 + s * sb_bytes + (lr + 16 * i) * GB_K + c4 * 16,
                            ok ? (const void*)(b_src[i] + kc) : (const void*)b, ok ? 16 : 0);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                bool ok = b_ok[i] && kin;
                cp_async_16(sb0 + s * sb_bytes + tile_off(lr + 16 * i, lc), ok ? (const void*)(b_src[i] + k) : (const void*)b, ok ? 16 : 0);
            }
        }
    };
    // FP8: the staged codes of stage s as bf16 values in the tile after the stages.
    auto convert = [&](u32 s) {
        const char* smem = reinterpret_cast<const char*>(moe_gemm_smem);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 r = lr + 16 * (h4 + 2 * j);
            const uint4 q = *reinterpret_cast<const uint4*>(smem + sb_off + s * sb_bytes + r * GB_K + c4 * 16);
            const u32 words[4] = {q.x, q.y, q.z, q.w};
            u32 out[8];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                float f[4];
                fp8x4_scaled(words[t], f);
                out[2 * t] = pack_bf16x2(f[0] * FP8_UNBIAS, f[1] * FP8_UNBIAS);
                out[2 * t + 1] = pack_bf16x2(f[2] * FP8_UNBIAS, f[3] * FP8_UNBIAS);
            }
            char* tile = reinterpret_cast<char*>(moe_gemm_smem) + sbt_off;
            *reinterpret_cast<uint4*>(tile + tile_off(r, 2 * c4)) = make_uint4(out[0], out[1], out[2], out[3]);
            *reinterpret_cast<uint4*>(tile + tile_off(r, 2 * c4 + 1)) = make_uint4(out[4], out[5], out[6], out[7]);
        }
    };
    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.0f;
#pragma unroll
    for (u32 s = 0; s < G_STAGES - 1; ++s) {
        if (s < ktiles) load(s, s);
        cp_async_commit_group();
    }
    const u32 wm = warp & 1, wn = warp >> 1;
    for (u32 kt = 0; kt < ktiles; ++kt) {
        cp_async_wait_groups<G_STAGES - 2>();
        __syncthreads();
        u32 next = kt + G_STAGES - 1;
        if (next < ktiles) load(next, next % G_STAGES);
        cp_async_commit_group();
        u32 s = kt % G_STAGES;
        if constexpr (FP8) {
            convert(s);
            __syncthreads();
        }
        u32 as = sa0 + s * sa_bytes, bt;
        if constexpr (FP8) bt = sa0 + sbt_off;
        else bt = sb0 + s * sb_bytes;
#pragma unroll
        for (u32 kk = 0; kk < GB_K / 16; ++kk) {
            u32 af[2][4];
#pragma unroll
            for (u32 mt = 0; mt < 2; ++mt)
                ldmatrix_x4(af[mt], as + tile_off(wm * 32 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
            for (u32 np = 0; np < 4; ++np) {
                u32 bf[4];
                ldmatrix_x4(bf, bt + tile_off(wn * 64 + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                              kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
                for (u32 mt = 0; mt < 2; ++mt) {
                    mma_bf16_16816(acc[mt][2 * np], af[mt], bf[0], bf[1]);
                    mma_bf16_16816(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait_groups<0>();
    // Epilogue: thread (gr, tg) of a fragment holds rows gr, gr + 8 and columns 2 tg, 2 tg + 1.
    const u32 gr = lane >> 2, tg = lane & 3;
#pragma unroll
    for (u32 mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            u32 p = row0 + wm * 32 + mt * 16 + gr + 8 * h;
            if (p >= row_end) continue;
            if (MODE == MODE_UP_GATED) {
                bf16* dst = c + (i64)p * N;
#pragma unroll
                for (u32 nt = 0; nt < 4; ++nt) {
                    u32 col = n0 + wn * 32 + nt * 8 + 2 * tg;
                    if (col >= N) continue;
                    float g0 = acc[mt][nt][2 * h], g1 = acc[mt][nt][2 * h + 1];
                    float u0 = acc[mt][nt + 4][2 * h], u1 = acc[mt][nt + 4][2 * h + 1];
                    if constexpr (FP8) {
                        const i64 sc = (i64)e * N + col;
                        g0 *= gs[sc];
                        g1 *= gs[sc + 1];
                        u0 *= bs[sc];
                        u1 *= bs[sc + 1];
                    }
                    float v0 = apply_act(g0, act) * u0;
                    float v1 = apply_act(g1, act) * u1;
                    *(u32*)(dst + col) = pack_bf16x2(v0, v1);
                }
            } else {
                u32 j = MODE == MODE_DOWN ? g.sorted[p] : p;
                float scale = MODE == MODE_DOWN ? w[j] : 1.0f;
                bf16* dst = c + (i64)j * N;
#pragma unroll
                for (u32 nt = 0; nt < 8; ++nt) {
                    u32 col = n0 + wn * 64 + nt * 8 + 2 * tg;
                    if (col >= N) continue;
                    float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
                    if constexpr (FP8) {
                        const i64 sc = (i64)e * N + col;
                        v0 *= bs[sc];
                        v1 *= bs[sc + 1];
                    }
                    if (MODE == MODE_DOWN) {
                        v0 *= scale;
                        v1 *= scale;
                    } else {
                        v0 = apply_act(v0, act);
                        v1 = apply_act(v1, act);
                    }
                    *(u32*)(dst + col) = pack_bf16x2(v0, v1);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// f32 SIMT grouped GEMM (the oracle mode): CTA tile 64 × 64, K step 16, 256 threads of 4 × 4
// outputs (rows ty + 16 i, columns tx + 16 j). Gated experts keep a second accumulator.

#define FS_M 64
#define FS_N 64
#define FS_K 16
#define FS_THREADS 256

// An element of B as f32: itself, or an FP8 code times its row's scale (exactly the CPU's
// dequantized value).
__device__ __forceinline__ float b_value(const float* p, i64 k, float) { return p[k]; }
__device__ __forceinline__ float b_value(const u8* p, i64 k, float scale) {
    return fp8_to_f32(p[k]) * scale;
}

template <int MODE, typename BT>
__device__ __forceinline__ void grouped_simt(float* c, const float* a, const BT* b,
                                             const BT* gate, const float* bs, const float* gs,
                                             const float* w, Groups g, u32 K, u32 N, u32 top_k,
                                             u32 act) {
    constexpr bool FP8 = sizeof(BT) == 1;
    u32 tile = blockIdx.x;
    if (tile >= g.n_tiles[0]) return;
    __shared__ float sa[FS_K][FS_M + 1];
    __shared__ float sb[FS_K][FS_N + 1];
    __shared__ float sg[MODE == MODE_UP_GATED ? FS_K : 1][FS_N + 1];
    const u32 e = g.tile_e[tile];
    const u32 row0 = g.offsets[e] + g.tile_m[tile], row_end = g.offsets[e + 1];
    const u32 tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const u32 n0 = blockIdx.y * FS_N;
    const float* a_src[4];
    const BT* b_src[4];
    const BT* g_src[4];
    float b_scale[4], g_scale[4];
    bool a_ok[4], b_ok[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 p = row0 + ty + 16 * i;
        a_ok[i] = p < row_end;
        u32 src_row = 0;
        if (a_ok[i]) src_row = MODE == MODE_DOWN ? p : g.sorted[p] / top_k;
        a_src[i] = a + (i64)src_row * K;
        u32 col = n0 + ty + 16 * i;
        b_ok[i] = col < N;
        i64 brow = ((i64)e * N + (b_ok[i] ? col : 0)) * K;
        b_src[i] = b + brow;
        g_src[i] = MODE == MODE_UP_GATED ? gate + brow : b;
        const i64 sc = (i64)e * N + (b_ok[i] ? col : 0);
        b_scale[i] = FP8 ? bs[sc] : 1.0f;
        g_scale[i] = FP8 && MODE == MODE_UP_GATED ? gs[sc] : 1.0f;
    }
    float acc[4][4], accg[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = accg[i][j] = 0.0f;
    for (u32 k0 = 0; k0 < K; k0 += FS_K) {
        u32 k = k0 + tx;
        bool kin = k < K;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sa[tx][ty + 16 * i] = a_ok[i] && kin ? a_src[i][k] : 0.0f;
            sb[tx][ty + 16 * i] = b_ok[i] && kin ? b_value(b_src[i], k, b_scale[i]) : 0.0f;
            if (MODE == MODE_UP_GATED)
                sg[tx][ty + 16 * i] = b_ok[i] && kin ? b_value(g_src[i], k, g_scale[i]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < FS_K; ++kk) {
            float av[4], bv[4], gv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                av[i] = sa[kk][ty + 16 * i];
                bv[i] = sb[kk][tx + 16 * i];
                gv[i] = MODE == MODE_UP_GATED ? sg[kk][tx + 16 * i] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
                    if (MODE == MODE_UP_GATED) accg[i][j] = fmaf(av[i], gv[j], accg[i][j]);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 p = row0 + ty + 16 * i;
        if (p >= row_end) continue;
        u32 j_row = MODE == MODE_DOWN ? g.sorted[p] : p;
        float scale = MODE == MODE_DOWN ? w[j_row] : 1.0f;
        float* dst = c + (i64)j_row * N;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 col = n0 + tx + 16 * j;
            if (col >= N) continue;
            float v = acc[i][j];
            if (MODE == MODE_DOWN) v *= scale;
            else if (MODE == MODE_UP_GATED) v = apply_act(accg[i][j], act) * v;
            else v = apply_act(v, act);
            dst[col] = v;
        }
    }
}

// out[t, :] += Σ y[t * top_k + k, :] over the token's picks in ascending expert order.
template <typename T>
__device__ __forceinline__ void moe_combine(T* out, const T* y, const u32* ids, u32 top_k,
                                            u32 hidden, u32 experts) {
    __shared__ u32 order[MAX_TOP_K];
    __shared__ u32 count;
    const i64 t = blockIdx.x;
    const u32* mine = ids + t * top_k;
    if (threadIdx.x == 0) {
        u32 m = 0;
        for (u32 k = 0; k < top_k && k < MAX_TOP_K; ++k) {
            u32 e = mine[k];
            if (e >= experts) continue;
            u32 i = m++;
            for (; i > 0 && mine[order[i - 1]] > e; --i) order[i] = order[i - 1];
            order[i] = k;
        }
        count = m;
    }
    __syncthreads();
    for (u32 col = threadIdx.x; col < hidden; col += blockDim.x) {
        float acc = load(out, t * hidden + col);
        for (u32 i = 0; i < count; ++i) acc += load(y, (t * top_k + order[i]) * hidden + col);
        store(out, t * hidden + col, acc);
    }
}

#define GEMM_PARAMS(T)                                                                             \
    T *c, const T *a, const T *b, const T *gate, const float *w, const u32 *sorted,                \
        const u32 *offsets, const u32 *tile_e, const u32 *tile_m, const u32 *n_tiles, u32 K, u32 N, \
        u32 top_k, u32 act
#define GROUPS Groups{sorted, offsets, tile_e, tile_m, n_tiles}

#define FP8_GEMM_PARAMS(T)                                                                         \
    T *c, const T *a, const u8 *b, const u8 *gate, const float *bs, const float *gs,               \
        const float *w, const u32 *sorted, const u32 *offsets, const u32 *tile_e,                  \
        const u32 *tile_m, const u32 *n_tiles, u32 K, u32 N, u32 top_k, u32 act

extern "C" __global__ void __launch_bounds__(G_THREADS, 3) moe_up_bf16(GEMM_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    grouped_mma<MODE_UP, bf16>(c, a, b, gate, nullptr, nullptr, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(G_THREADS, 3) moe_up_gated_bf16(GEMM_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    grouped_mma<MODE_UP_GATED, bf16>(c, a, b, gate, nullptr, nullptr, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(G_THREADS, 3) moe_down_bf16(GEMM_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    grouped_mma<MODE_DOWN, bf16>(c, a, b, gate, nullptr, nullptr, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS) moe_up_f32(GEMM_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    grouped_simt<MODE_UP, float>(c, a, b, gate, nullptr, nullptr, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS) moe_up_gated_f32(GEMM_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    grouped_simt<MODE_UP_GATED, float>(c, a, b, gate, nullptr, nullptr, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS) moe_down_f32(GEMM_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    grouped_simt<MODE_DOWN, float>(c, a, b, gate, nullptr, nullptr, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(G_THREADS, 2) moe_up_fp8_bf16(FP8_GEMM_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    grouped_mma<MODE_UP, u8>(c, a, b, gate, bs, gs, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(G_THREADS, 2) moe_up_gated_fp8_bf16(FP8_GEMM_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    grouped_mma<MODE_UP_GATED, u8>(c, a, b, gate, bs, gs, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(G_THREADS, 2) moe_down_fp8_bf16(FP8_GEMM_PARAMS(bf16)) { CHIMERA_PDL_ENTRY();
    grouped_mma<MODE_DOWN, u8>(c, a, b, gate, bs, gs, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS) moe_up_fp8_f32(FP8_GEMM_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    grouped_simt<MODE_UP, u8>(c, a, b, gate, bs, gs, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS) moe_up_gated_fp8_f32(FP8_GEMM_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    grouped_simt<MODE_UP_GATED, u8>(c, a, b, gate, bs, gs, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS) moe_down_fp8_f32(FP8_GEMM_PARAMS(float)) { CHIMERA_PDL_ENTRY();
    grouped_simt<MODE_DOWN, u8>(c, a, b, gate, bs, gs, w, GROUPS, K, N, top_k, act);
}
extern "C" __global__ void moe_combine_f32(float* out, const float* y, const u32* ids, u32 top_k,
                                           u32 hidden, u32 experts) { CHIMERA_PDL_ENTRY();
    moe_combine(out, y, ids, top_k, hidden, experts);
}
extern "C" __global__ void moe_combine_bf16(bf16* out, const bf16* y, const u32* ids, u32 top_k,
                                            u32 hidden, u32 experts) { CHIMERA_PDL_ENTRY();
    moe_combine(out, y, ids, top_k, hidden, experts);
}
