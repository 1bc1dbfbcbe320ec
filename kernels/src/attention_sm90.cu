// Causal prefill attention for head_dim 128, bf16, on Hopper: warpgroup MMA (`wgmma`, sm_90a
// only; lib.rs compiles this source only for that target). FlashAttention-3's forward pass
// (Shah et al. 2024, arXiv 2407.08608) without TMA: the KV cache is paged, so K/V rows are
// gathered through the block table with 16-byte cp.async as in attention.cu, but into the
// canonical 128-byte-swizzle layout that wgmma's shared-memory descriptors read.
//
// Work decomposition: attention.cu's header (work items, GQA head packing: one kv head per
// CTA, its group's query heads packed into the rows, so each K/V tile serves all of them).
// A CTA has two warpgroups of 64 packed rows each (128 rows, attention.rs: WGMMA_D128).
//
// Per KV tile of 128 keys, in each warpgroup:
//   S = Q·Kᵀ       8 × wgmma m64n128k16, Q and K from shared memory (K-major descriptors);
//   online softmax on the accumulator layout (the mma.m16n8 C layout per warp: a row is held
//                  by the 4 threads of a quad), causal mask only on tiles that reach past the
//                  CTA's first row's limit;
//   O += P·V       8 × wgmma m64n128k16 with P from registers (the accumulator of S re-packed
//                  as bf16 A fragments, the mma.m16n8k16 A layout per warp) and V from shared
//                  memory: V is [keys × d] row-major, i.e. B "MN-major", read with the
//                  descriptor's transpose bit.
//
// Shared memory (1024-byte aligned; 230448 bytes with the alignment slack): Q [128 × 128],
// then STAGES = 3 stages of K [128 × 128] + V [128 × 128], then the stages' mbarriers. Every
// [rows × 128] tile is two column halves of [rows × 64] (128 bytes a row); in a half, row r
// sits at r·128 and its 16-byte chunk c at (c ^ (r mod 8))·16: the 128-byte swizzle atom of
// 8 rows × 128 bytes that wgmma reads (the XOR acts on address bits 4–6 with bits 7–9, so
// every half starts on a 1024-byte boundary). Descriptors: K-major (Q, K) with the stride
// between 8-row groups 1024 and the k-step's 32-byte column offset added to the start
// address; MN-major (V) with the leading offset = distance between the two 64-column halves
// (128 · 128 bytes) and the stride = 1024 between 8-key groups.
//
// Pipeline (no warp specialisation; all 256 threads gather). Each stage has a "full"
// mbarrier, completed when the 256 threads' copies of the tile have landed
// (cp.async.mbarrier.arrive.noinc), and an "empty" one that every thread arrives on when its
// warpgroup is done with the stage; a thread waits on "empty" only before refilling a stage.
// Two schedules (attention.rs: PrefillKernel):
// - attn_prefill_wgmma_d128_bf16: per tile S, softmax, P·V, each MMA waited for; tile j + 2
//   is gathered while tile j is computed. The warpgroups are not tied to each other tile by
//   tile (at most one apart), so one's softmax may overlap the other's MMAs.
// - attn_prefill_wgmma_pp_d128_bf16 (ping-pong, FlashAttention-3's inter-warpgroup schedule):
//   S(j) and P·V(j − 1) are issued as one batch, and two named barriers make the warpgroups
//   take turns issuing, so one's softmax runs while the other's batch is on the tensor cores.
//   A stage holds the group (K(j), V(j − 1)) that batch j reads, and group j + 1 is gathered
//   after batch j is issued, into the stage both warpgroups released at batch j − 2. The
//   running max moves only when a row's new max exceeds it by MAX_SLACK (O's rescale is then
//   skipped on most tiles). On the H200 at T = 8192 the re-pairing alone took 439 → 505
//   TFLOP/s; with the lazy max, a leaner gather and descriptors in uniform registers, 514.
// A warp-specialised variant (the ping-pong consumers fed by a third, producer warpgroup
// that gathered K and V into separately released rings, setmaxnreg 64 / 216) was measured on
// the H200 at 256 TFLOP/s against ping-pong's 438 (T = 8192): the producer's four warps
// stalled on their loads; it was removed.
// (FA3's intra-warpgroup overlap, the softmax of tile j while P·V(j − 1) runs in the same
// warpgroup, was tried: ptxas 13.0 hoists the wgmma wait above the exponentials, or
// serialises every wgmma when the two P buffers it needs are written in branches.)
//
// Learned from: the FlashAttention-3 paper; the PTX ISA manual (wgmma register fragments,
// shared-memory matrix layouts and descriptor format, mbarrier, cp.async). No code was copied.
#include "attention.cuh"

namespace attn {
namespace sm90 {

constexpr int D = 128;
constexpr int WG_ROWS = 64;                        // rows of one warpgroup (wgmma m64)
constexpr int WGS = 2;
constexpr int BM = WGS * WG_ROWS;                  // packed rows per CTA
constexpr int BN = 128;                            // keys per KV tile
constexpr int STAGES = 3;
constexpr float MAX_SLACK = 8.0f;                  // see softmax
constexpr int NTH = 128 * WGS;
constexpr int Q_BYTES = BM * D * 2;
constexpr int TILE_BYTES = BN * D * 2;             // one K or V tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int ALIGN = 1024;                        // the 128-byte swizzle pattern's period
constexpr int SMEM = ALIGN + Q_BYTES + STAGES * STAGE_BYTES + 2 * STAGES * 8;  // attention.rs
constexpr int CPR = D / 8;                         // 16-byte chunks per row
constexpr int RPP = NTH / CPR;                     // rows one pass of the CTA's copies covers
constexpr int KV_PASSES = BN / RPP;
static_assert(NTH % CPR == 0 && BN % RPP == 0 && BM % RPP == 0, "tile shape");
// The block-table lookup (rows_of) spreads a warp's 2 rows × KV_PASSES passes over its lanes.
static_assert(CPR == 16 && 2 * KV_PASSES <= 32, "lookup lanes");
// Schedules (see the header).
constexpr int PLAIN = 0, PINGPONG = 1;

// Byte offset of 16-byte chunk c (0..15) of row r in a [rows × 128] bf16 tile stored as two
// 128-byte-swizzled column halves (see the header).
__device__ __forceinline__ u32 sw128(int rows, int r, int c) {
    return (u32)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A wgmma shared-memory matrix descriptor with 128-byte swizzling: start address, leading and
// stride byte offsets (each >> 4), swizzle mode 1 in bits 62–63, base offset 0.
__device__ __forceinline__ u64 desc128(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}
// The descriptor of the matrix `off` bytes (a multiple of 16) after `desc`'s: the start
// address is the low 14 bits (address >> 4), and shared addresses stay below 256 KiB, so the
// offset adds to them without reaching the leading-offset field. One add per wgmma instead
// of building each descriptor.
__device__ __forceinline__ u64 desc_at(u64 desc, u32 off) {
    const u32 lo = (u32)desc + (off >> 4), hi = (u32)(desc >> 32);
    return ((u64)hi << 32) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers after a wait: later reads cannot move above it.
__device__ __forceinline__ void fence_regs(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Named barriers 1 and 2 (0 is __syncthreads), 256 threads: 128 wait, 128 arrive.
__device__ __forceinline__ void named_bar_sync(int id) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}
// Orders this thread's generic-proxy view of shared memory (the cp.async writes it has
// observed) before its async-proxy reads (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// 16 bytes global → shared, bypassing L1.
__device__ __forceinline__ void cp_async_16_full(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// mbarriers: mbar_init, mbar_arrive, cp_async_arrive, mbar_wait (mma.cuh).

// d (+)= A·B, m64n128k16, bf16 → f32: A and B from shared memory (descriptors), both K-major.
// scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 desc_a, u64 desc_b, u32 scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// d += A·B, m64n128k16: A from registers (the mma.m16n8k16 A layout per warp), B from shared
// memory, MN-major (imm-trans-b = 1).
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1u));
}

extern __shared__ __align__(1024) u16 sm90_dyn_smem[];

// A compile-time flag for generic lambdas that also take a run-time bool.
template <bool B>
struct Const {
    __device__ constexpr operator bool() const { return B; }
};

// SCHED: PLAIN or PINGPONG (the two warpgroups take turns on the tensor cores).
template <int SCHED>
__device__ __forceinline__ void prefill_d128(const Args<bf16>& a) {
    // A launch that disagrees with attention.rs fails loudly rather than computing garbage.
    if (blockDim.x != NTH || dynamic_smem_size() < (u32)SMEM) __trap();
    Tile t;
    if (!tile_of(a, BM, t)) return;
    const int tid = threadIdx.x, lane = tid & 31;
    // warpgroup (rows 64·wg ..), warp in it; the shuffle tells the compiler wg is the same
    // across the warp, so the descriptors built from it can live in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = (tid >> 5) & 3;
    const int g = lane >> 2, tq = lane & 3;
    const int my_chunk = tid % CPR, my_row = tid / CPR;
    const u32 s_q = ((u32)__cvta_generic_to_shared(sm90_dyn_smem) + (ALIGN - 1)) & ~(u32)(ALIGN - 1);
    const u32 s_kv = s_q + Q_BYTES;  // stage i: K at s_kv + i·STAGE_BYTES, V after it
    const u32 full = s_kv + STAGES * STAGE_BYTES;  // STAGES barriers: the tile has landed
    const u32 empty = full + STAGES * 8;           // STAGES barriers: both warpgroups are done
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full + 8 * i, NTH);
            mbar_init(empty + 8 * i, NTH);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Q rows (zeros past the CTA's rows). Their copies precede tile 0's arrival on its full
    // barrier, so waiting for tile 0 waits for Q too.
    auto load_q = [&]() {
#pragma unroll
        for (int k = 0; k < BM / RPP; ++k) {
            const int r = my_row + k * RPP;
            const bf16* src = a.q;
            u32 bytes = 0;
            if (r < t.nrows) {
                src = a.q + qo_offset(a, t, r) + my_chunk * 8;
                bytes = 16;
            }
            cp_async_16(s_q + sw128(BM, r, my_chunk), src, bytes);
        }
    };

    const int ntiles = t.hi > t.kv_first ? (int)((t.hi - t.kv_first + BN - 1) / BN) : 0;
    // Block-table lookups, one per thread per tile, a tile ahead of its gather: a warp's
    // threads copy rows 2·warp + h + RPP·k (h = lane / 16, k < KV_PASSES), lane
    // l < 2·KV_PASSES looks up row 2·warp + l / KV_PASSES + RPP·(l mod KV_PASSES) (higher lanes
    // repeat lower ones), and the gather takes each pass's row from its lane with a shuffle.
    // The loaded block id is first used by that gather, so the load's latency is hidden.
    const int lane_in = lane % (2 * KV_PASSES);
    const u32 lk_row = (u32)(2 * (tid >> 5) + lane_in / KV_PASSES + RPP * (lane_in % KV_PASSES));
    // Positions past the CTA's range are looked up as its first position instead: their
    // keys are masked (P = 0 exactly, and V rows of real cache data are finite), so every
    // copy reads 16 valid bytes and the gather needs no per-row branch or zero fill.
    u32 lk_blk = 0, lk_off = 0;  // block id and offset in it
    auto rows_of = [&](int j) {
        const u32 p = t.kv_first + (u32)j * BN + lk_row;
        const u32 pc = p < t.hi ? p : t.kv_first;
        const u32 blk_idx = pc / a.block_size;
        lk_blk = t.bt[blk_idx];
        lk_off = pc - blk_idx * a.block_size;
    };
    auto looked_up = [&]() { return lk_blk * a.block_size + lk_off; };
    // This thread's chunk of cache row 0 of its kv head in K and V, and the bytes between
    // cache rows; its chunk's offset in a tile (pass k adds k · RPP rows: RPP is a multiple
    // of 8, so the swizzle is the same in every pass).
    const char* k_base = (const char*)(a.k_cache + t.kvh * D + my_chunk * 8);
    const char* v_base = (const char*)(a.v_cache + t.kvh * D + my_chunk * 8);
    const u32 row_bytes = a.kv_heads * D * 2;
    const u32 my_off = sw128(BN, my_row, my_chunk);
    static_assert(RPP % 8 == 0, "one swizzle phase per pass");
    // The KV_PASSES rows of `rows` (a lookup) this thread copies, from `base` into `dst`.
    auto copy_rows = [&](u32 dst, const char* base, u32 rows) {
#pragma unroll
        for (int k = 0; k < KV_PASSES; ++k) {
            const u32 row = __shfl_sync(0xffffffffu, rows, (lane >> 4) * KV_PASSES + k);
            cp_async_16_full(dst + my_off + k * RPP * 128, base + (u64)row * row_bytes);
        }
    };
    // Tile j (the rows rows_of(j) looked up) into stage j mod STAGES, then the arrival on its
    // full barrier.
    auto gather = [&](int j) {
        const int st = j % STAGES;
        const u32 sk = s_kv + st * STAGE_BYTES;
        const u32 rows = looked_up();
        copy_rows(sk, k_base, rows);
        copy_rows(sk + TILE_BYTES, v_base, rows);
        cp_async_arrive(full + 8 * st);
    };
    // Ping-pong's stages pair K and V differently (see that schedule below): group g is
    // K(g) (g < ntiles) and V(g − 1) (g ≥ 1) in stage g mod STAGES, exactly what a
    // warpgroup's batch g reads. V(g − 1)'s rows are those K(g − 1) was gathered from:
    // v_rows keeps that lookup.
    u32 v_rows = 0;
    auto gather_group = [&](int g) {
        const int st = g % STAGES;
        const u32 sk = s_kv + st * STAGE_BYTES;
        const u32 k_rows = looked_up();
        if (g < ntiles) copy_rows(sk, k_base, k_rows);
        if (g > 0) copy_rows(sk + TILE_BYTES, v_base, v_rows);
        cp_async_arrive(full + 8 * st);
        v_rows = k_rows;
        if (g + 1 < ntiles) rows_of(g + 1);
    };
    // Tiles gathered ahead of the one computed (see the schedules below).
    constexpr int LEAD = SCHED == PLAIN ? STAGES - 1 : 1;
    load_q();
    if (ntiles > 0) rows_of(0);
    if (SCHED == PLAIN) {
#pragma unroll
        for (int j = 0; j < LEAD; ++j) {
            if (j < ntiles) {
                gather(j);
                if (j + 1 < ntiles) rows_of(j + 1);
            }
        }
    } else if (ntiles > 0) {
        gather_group(0);
    }

    const int wrow = wg * WG_ROWS;  // the warpgroup's first row
    const bool wg_active = wrow < t.nrows;
    // The warpgroup's KV end (its last row's limit): tiles past it are the other one's.
    const u32 wg_hi = wg_active ? row_limit(t, min(wrow + WG_ROWS, t.nrows) - 1) : 0;
    u32 lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wrow + warp * 16 + g + 8 * h;
        lim[h] = r < t.nrows ? row_limit(t, r) : t.hi;
    }
    const float sl2 = a.scale * LOG2E;  // exponentials in base 2
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float m[2] = {-CHIMERA_INF, -CHIMERA_INF}, l[2] = {0.0f, 0.0f};
    float s[64];
    u32 pa[8][4];  // P as A fragments: k-step kk holds keys 16·kk .. 16·kk + 15

    // S = Q·Kᵀ (issued, not waited for): k-step ks reads columns 16·ks.. of Q and K (half
    // ks / 4, 32-byte offset ks mod 4 in the swizzled row).
    const u64 q_desc = desc128(s_q + wrow * 128, 16, 1024);  // this warpgroup's Q rows
    auto issue_s = [&](u32 sk) {
        const u64 k_desc = desc128(sk, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const u32 col = (u32)(ks & 3) * 32;
            const u64 da = desc_at(q_desc, (ks >> 2) * (BM * 128) + col);
            const u64 db = desc_at(k_desc, (ks >> 2) * (BN * 128) + col);
            wgmma_ss(s, da, db, ks > 0 ? 1u : 0u);
        }
        wgmma_commit();
    };
    // O += P·V (issued, not waited for): k-step kk reads keys 16·kk .. of V (two 8-key groups
    // of 1024 bytes).
    auto issue_pv = [&](u32 sv) {
        const u64 v_desc = desc128(sv, BN * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs_tb(o, pa[kk], desc_at(v_desc, kk * 2048));
        wgmma_commit();
    };
    // Masks tile p0's scores when `masked` (a bool, or a Const when known at compile time;
    // accumulator element s[4i + e]: row warp·16 + g + 8·(e / 2) of
    // the warpgroup, key p0 + 8i + 2·tq + (e mod 2)), updates m and l, turns s into
    // P = 2^(s·scale·log2 e − m); alpha[h] is what O's row h must be scaled by.
    auto softmax = [&](u32 p0, float (&alpha)[2], auto masked) {
        // Row maxima and sums over 4 partials each (i mod 4), so the dependent chains are a
        // quarter as long.
        float mx4[4][2];
#pragma unroll
        for (int c = 0; c < 4; ++c) mx4[c][0] = mx4[c][1] = -CHIMERA_INF;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (masked) {
                    const u32 key = p0 + (u32)(8 * i + 2 * tq + (e & 1));
                    if (key >= lim[e >> 1]) s[4 * i + e] = -CHIMERA_INF;
                }
                mx4[i & 3][e >> 1] = fmaxf(mx4[i & 3][e >> 1], s[4 * i + e]);
            }
        }
        float mx[2], base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(fmaxf(mx4[0][h], mx4[1][h]), fmaxf(mx4[2][h], mx4[3][h]));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            // The running max (log2 units of the scaled scores) moves only when the tile's
            // exceeds it by more than MAX_SLACK: P stays ≤ 2^MAX_SLACK (exact enough in bf16
            // and f32), and O needs no rescale on most tiles (alpha = 1).
            const float mt = mx[h] * sl2;
            const bool move = mt > m[h] + MAX_SLACK;
            const float mn = move ? mt : m[h];
            base[h] = mn == -CHIMERA_INF ? 0.0f : mn;
            alpha[h] = move ? ex2(m[h] - mn) : 1.0f;
            m[h] = mn;
            l[h] *= alpha[h];
        }
        float sum4[4][2] = {};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = ex2(fmaf(s[4 * i + e], sl2, -base[e >> 1]));
                s[4 * i + e] = p;
                sum4[i & 3][e >> 1] += p;
            }
        }
        // Per-thread partial sums; the quad sums at the end.
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] += (sum4[0][h] + sum4[1][h]) + (sum4[2][h] + sum4[3][h]);
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[4 * i + e] *= alpha[e >> 1];
        }
    };
    auto pack = [&]() {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            pa[kk][0] = pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    // The stage tile j + LEAD goes to last held tile j + LEAD − STAGES: wait until both
    // warpgroups have released it, then gather.
    // (Split in two: the wait, and the copies, which the ping-pong schedule issues while
    // its own MMAs run.)
    auto refill_wait = [&](int j) {
        const int ahead = j + LEAD, prev = ahead - STAGES;
        if (ahead < ntiles && prev >= 0)
            mbar_wait(empty + 8 * (prev % STAGES), (u32)(prev / STAGES) & 1u);
    };
    auto refill_copy = [&](int j) {
        const int ahead = j + LEAD;
        if (ahead >= ntiles) return;
        gather(ahead);
        if (ahead + 1 < ntiles) rows_of(ahead + 1);
    };
    auto refill = [&](int j) {
        refill_wait(j);
        refill_copy(j);
    };

    if (SCHED == PLAIN) {
        // Per tile: S = Q·Kᵀ, wait, softmax, O += P·V, wait, release the stage. Tile j + 2 is
        // gathered while tile j is computed.
        for (int j = 0; j < ntiles; ++j) {
            const int st = j % STAGES;
            refill_wait(j);
            const u32 p0 = t.kv_first + (u32)j * BN;
            if (wg_active && p0 < wg_hi) {
                mbar_wait(full + 8 * st, (u32)(j / STAGES) & 1u);
                fence_proxy_async();
                const u32 sk = s_kv + st * STAGE_BYTES;
                wgmma_fence();
                issue_s(sk);
                refill_copy(j);  // tile j + 2, while S = Q·Kᵀ runs
                wgmma_wait<0>();
                fence_regs(s);
                float alpha[2];
                softmax(p0, alpha, p0 + BN > t.lo_full);
                rescale(alpha);
                pack();
                wgmma_fence();
                issue_pv(sk + TILE_BYTES);
                wgmma_wait<0>();
                fence_regs(o);
            } else {
                refill_copy(j);
            }
            mbar_arrive(empty + 8 * st);
        }
    } else {
        // Ping-pong (FlashAttention-3's inter-warpgroup schedule): a warpgroup's batch j is
        // S = Q·K(j)ᵀ and O += P(j − 1)·V(j − 1), issued together; it waits for them and then
        // runs tile j's softmax; two named barriers hand the tensor cores from one warpgroup
        // to the other, so one's softmax runs while the other's batch is on the tensor cores.
        // O is rescaled by tile j − 1's factor just before the batch.
        //
        // Stages hold groups (K(g), V(g − 1)), read by batch g alone and released once both
        // warpgroups' batch g is done. Group j + 1 is gathered before batch j, into the stage
        // of group j − 2: both warpgroups finished batch j − 2 before the other warpgroup's
        // batch j − 1 began, so the refill never waits for the batch just ahead of this one
        // on the tensor cores (pairing K(j) with V(j) made it wait for exactly that one).
        //
        // Turns: warpgroup w waits on barrier 1 + w before issuing, then arrives on the
        // other's. Both take a turn for every group 0..ntiles, computing or not; warpgroup 1
        // starts by arriving on barrier 1 and warpgroup 0 ends by waiting on it, so every
        // arrival is matched by a wait.
        const int mine = 1 + wg, other = 2 - wg;  // named barrier ids
        auto take_turn = [&]() { named_bar_sync(mine); };
        auto pass_turn = [&]() { named_bar_arrive(other); };
        // Group j + 1 into its stage once both warpgroups have released group j − 2.
        auto refill_group = [&](int j) {
            const int g = j + 1, prev = g - STAGES;
            if (g > ntiles) return;
            if (prev >= 0) mbar_wait(empty + 8 * (prev % STAGES), (u32)(prev / STAGES) & 1u);
            gather_group(g);
        };
        if (wg == 1 && ntiles > 0) named_bar_arrive(1);
        // Tiles [0, jn) are this warpgroup's; tiles [jm, ..) are masked.
        const int jn = wg_active && wg_hi > t.kv_first
                           ? min(ntiles, (int)((wg_hi - t.kv_first + BN - 1) / BN))
                           : 0;
        const int jm = t.lo_full > t.kv_first ? (int)((t.lo_full - t.kv_first) / BN) : 0;
        float alpha[2] = {1.0f, 1.0f};  // the last softmax's factor, not yet applied to O
        auto stage_addr = [&](int j) { return s_kv + (j % STAGES) * STAGE_BYTES; };
        auto step = [&](int j, auto masked) {  // 1 ≤ j < jn
            // O's rescale comes before the waits' loops: registers a wgmma reads must not be
            // written between a branch and the wgmma (ptxas serialises every wgmma then).
            // Skipped when no row of the warp moved its max (the usual case).
            if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale(alpha);
            const int st = j % STAGES;
            mbar_wait(full + 8 * st, (u32)(j / STAGES) & 1u);
            fence_proxy_async();
            take_turn();
            wgmma_fence();
            issue_s(stage_addr(j));
            issue_pv(stage_addr(j) + TILE_BYTES);
            pass_turn();
            refill_group(j);  // while the batch runs
            wgmma_wait<0>();
            fence_regs(s);
            fence_regs(o);
            mbar_arrive(empty + 8 * st);
            softmax(t.kv_first + (u32)j * BN, alpha, masked);
            pack();
        };
        int j = 0;
        if (ntiles > 0 && jn > 0) {
            mbar_wait(full, 0);
            fence_proxy_async();
            take_turn();
            wgmma_fence();
            issue_s(s_kv);
            pass_turn();
            refill_group(0);  // while the batch runs
            wgmma_wait<0>();
            fence_regs(s);
            mbar_arrive(empty);
            if (jm > 0)
                softmax(t.kv_first, alpha, Const<false>());
            else
                softmax(t.kv_first, alpha, Const<true>());
            pack();
            for (j = 1; j < min(jm, jn); ++j) step(j, Const<false>());
            for (j = max(jm, 1); j < jn; ++j) step(j, Const<true>());
            // Batch jn: the last P·V alone.
            // Skipped when no row of the warp moved its max (the usual case).
            if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale(alpha);
            const int st = jn % STAGES;
            mbar_wait(full + 8 * st, (u32)(jn / STAGES) & 1u);
            fence_proxy_async();
            take_turn();
            wgmma_fence();
            issue_pv(stage_addr(jn) + TILE_BYTES);
            pass_turn();
            refill_group(jn);  // while the batch runs
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(empty + 8 * st);
            j = jn + 1;
        }
        if (ntiles > 0) {
            for (; j <= ntiles; ++j) {
                refill_group(j);
                take_turn();
                pass_turn();
                mbar_arrive(empty + 8 * (j % STAGES));
            }
        }
        if (wg == 0 && ntiles > 0) take_turn();  // warpgroup 1's last arrival
    }
    // Nothing this thread copied is still landing when it exits (the copies were never
    // committed as groups: wait_all commits and waits).
    asm volatile("cp.async.wait_all;\n" ::: "memory");

    if (!wg_active) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lh = l[h];
        lh += __shfl_xor_sync(0xffffffffu, lh, 1);
        lh += __shfl_xor_sync(0xffffffffu, lh, 2);
        const int r = wrow + warp * 16 + g + 8 * h;
        if (r >= t.nrows) continue;
        store_row<D, 16>(a, t, r, tq, lh, m[h],
                         [&](int i) { return make_float2(o[4 * i + 2 * h], o[4 * i + 2 * h + 1]); });
    }
}

}  // namespace sm90
}  // namespace attn

// attention.rs: SM90_ENTRIES. 230448 bytes of dynamic shared memory (the limit must be raised).
extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill_wgmma_d128_bf16(ATTN_PARAMS(bf16, bf16)) {
    CHIMERA_PDL_ENTRY();
    attn::sm90::prefill_d128<attn::sm90::PLAIN>(ATTN_ARGS(bf16, bf16));
}
// The same with the two warpgroups taking turns on the tensor cores (ping-pong).
extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill_wgmma_pp_d128_bf16(ATTN_PARAMS(bf16, bf16)) {
    CHIMERA_PDL_ENTRY();
    attn::sm90::prefill_d128<attn::sm90::PINGPONG>(ATTN_ARGS(bf16, bf16));
}

