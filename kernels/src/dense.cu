// Dense-path kernels: row gathers (embedding lookup, logit rows), RMS norms (plain, fused
// residual add, gated), rotary embedding (alone, and fused into the paged KV write),
// activations, element-wise updates, paged KV writes, MoE routing and expert scatter, column
// copies, casts and dummy-weight fills.
//
// Every kernel is a template over the storage type T (float in the f32 oracle mode, bf16 in
// the serving mode) with f32 arithmetic, instantiated as `<name>_f32` and `<name>_bf16` at the
// bottom of the file. The f32 instantiations follow the CPU reference's formulas and operation
// order, so the two backends agree to rounding. Element-wise kernels use grid-stride loops;
// row kernels use one block per row.
#include "common.cuh"

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// One row per block: out = w * (x / sqrt(mean(x²) + eps)).
// Row kernels hold their row in registers when it fits (R elements per thread): every load is
// issued before the first store, so a lone row (a decode) costs about one memory round trip
// instead of one per loop trip (the compiler cannot reorder loads past stores that may alias).
// Wider rows take the looping fallback.
template <typename T>
__device__ __forceinline__ float round_to(float v);
template <>
__device__ __forceinline__ float round_to<float>(float v) { return v; }
template <>
__device__ __forceinline__ float round_to<bf16>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

template <typename T, int R>
__device__ void rms_norm_reg(T* out, const T* x, const T* w, u32 cols, float eps, float* scratch) {
    const i64 base = (i64)blockIdx.x * cols;
    float v[R];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        v[k] = c < cols ? load(x, base + c) : 0.0f;
    }
    float wv[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        wv[k] = c < cols ? load(w, c) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < R; ++k) ss += v[k] * v[k];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        if (c < cols) store(out, base + c, wv[k] * (v[k] * inv));
    }
}

// The register path in 16-byte pieces (cols a multiple of VEC<T>, rows 16-byte aligned, at
// most NV pieces a thread): x, the residual, the delta and w all loaded before the first use.
// `residual`/`delta` null: a plain norm of x.
template <typename T, int NV>
__device__ void norm_vec(T* out, T* residual, const T* delta, const T* x, const T* w, u32 cols,
                         float eps, float* scratch) {
    constexpr int V = VEC<T>;
    const i64 base = (i64)blockIdx.x * cols;
    const u32 pieces = cols / V;
    float v[NV][V], wv[NV][V];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const u32 j = threadIdx.x + k * blockDim.x;
        if (j < pieces) {
            load16(residual ? (const T*)residual : x, base + (i64)j * V, v[k]);
            load16(w, (i64)j * V, wv[k]);
            if (residual) {
                float d[V];
                load16(delta, base + (i64)j * V, d);
#pragma unroll
                for (int e = 0; e < V; ++e) v[k][e] = round_to<T>(v[k][e] + d[e]);
            }
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) v[k][e] = 0.0f;
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const u32 j = threadIdx.x + k * blockDim.x;
        if (residual && j < pieces) store16(residual, base + (i64)j * V, v[k]);
#pragma unroll
        for (int e = 0; e < V; ++e) ss += v[k][e] * v[k][e];
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const u32 j = threadIdx.x + k * blockDim.x;
        if (j >= pieces) continue;
        float o[V];
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = wv[k][e] * (v[k][e] * inv);
        store16(out, base + (i64)j * V, o);
    }
}

// Whether a row kernel over `cols` columns may take `norm_vec` with at most 4 pieces a thread.
template <typename T>
__device__ __forceinline__ bool vec_rows_ok(u32 cols, const void* a, const void* b, const void* c,
                                            const void* d) {
    return cols % VEC<T> == 0 && cols / VEC<T> <= 4 * blockDim.x && aligned16(a) && aligned16(b) &&
           aligned16(c) && aligned16(d);
}

template <typename T>
__device__ void rms_norm(T* out, const T* x, const T* w, u32 cols, float eps) {
    __shared__ float scratch[32];
    if (vec_rows_ok<T>(cols, out, x, w, out)) {
        if (cols / VEC<T> <= blockDim.x)
            return norm_vec<T, 1>(out, nullptr, nullptr, x, w, cols, eps, scratch);
        if (cols / VEC<T> <= 2 * blockDim.x)
            return norm_vec<T, 2>(out, nullptr, nullptr, x, w, cols, eps, scratch);
        return norm_vec<T, 4>(out, nullptr, nullptr, x, w, cols, eps, scratch);
    }
    if (cols <= 8 * blockDim.x) return rms_norm_reg<T, 8>(out, x, w, cols, eps, scratch);
    if (cols <= 32 * blockDim.x) return rms_norm_reg<T, 32>(out, x, w, cols, eps, scratch);
    i64 base = (i64)blockIdx.x * cols;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = load(x, base + c);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x)
        store(out, base + c, load(w, c) * (load(x, base + c) * inv));
}

template <typename T, int R>
__device__ void add_rms_norm_reg(T* out, T* residual, const T* delta, const T* w, u32 cols,
                                 float eps, float* scratch) {
    const i64 base = (i64)blockIdx.x * cols;
    float v[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        v[k] = c < cols ? load(residual, base + c) + load(delta, base + c) : 0.0f;
    }
    float wv[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        wv[k] = c < cols ? load(w, c) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        v[k] = round_to<T>(v[k]);
        if (c < cols) store(residual, base + c, v[k]);
        ss += v[k] * v[k];
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        if (c < cols) store(out, base + c, wv[k] * (v[k] * inv));
    }
}

// residual += delta (rounded to T), then out = rms_norm(residual): the sublayer's residual
// add fused into the next norm. The norm reads the rounded sum, as the unfused pair would.
template <typename T>
__device__ void add_rms_norm(T* out, T* residual, const T* delta, const T* w, u32 cols, float eps) {
    __shared__ float scratch[32];
    if (vec_rows_ok<T>(cols, out, residual, delta, w)) {
        if (cols / VEC<T> <= blockDim.x)
            return norm_vec<T, 1>(out, residual, delta, residual, w, cols, eps, scratch);
        if (cols / VEC<T> <= 2 * blockDim.x)
            return norm_vec<T, 2>(out, residual, delta, residual, w, cols, eps, scratch);
        return norm_vec<T, 4>(out, residual, delta, residual, w, cols, eps, scratch);
    }
    if (cols <= 8 * blockDim.x)
        return add_rms_norm_reg<T, 8>(out, residual, delta, w, cols, eps, scratch);
    if (cols <= 32 * blockDim.x)
        return add_rms_norm_reg<T, 32>(out, residual, delta, w, cols, eps, scratch);
    i64 base = (i64)blockIdx.x * cols;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        store(residual, base + c, load(residual, base + c) + load(delta, base + c));
        float v = load(residual, base + c);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x)
        store(out, base + c, load(w, c) * (load(residual, base + c) * inv));
}

// Block (row, g), over the `group`-wide slice g of row `row`. x and gate rows are `x_ld` and
// `gate_ld` elements apart (so either may be a column range of a wider matrix); out is
// contiguous, `cols` wide. By `mode`:
//   0 (gate, then norm): out = norm(x · silu(gate)) · w
//   1 (norm, then gate): out = norm(x) · w · silu(gate)
//   2 (gate only):       out = x · silu(gate)   (w and eps unused)
__device__ __forceinline__ float gate_norm_out(u32 mode, float x, float g, float w, float inv) {
    if (mode == 0) return w * (x * g * inv);
    if (mode == 1) return w * (x * inv) * g;
    return x * g;
}

template <typename T>
__device__ void gated_rms_norm(T* out, const T* x, const T* gate, const T* w, u32 cols, u32 group,
                               float eps, u32 x_ld, u32 gate_ld, u32 mode) {
    __shared__ float scratch[32];
    const i64 col0 = (i64)blockIdx.y * group;
    const T* xr = x + (i64)blockIdx.x * x_ld + col0;
    const T* gr = gate + (i64)blockIdx.x * gate_ld + col0;
    T* outr = out + (i64)blockIdx.x * cols + col0;
    const T* wr = w + col0;
    const bool norm = mode != 2;
    constexpr int V = VEC<T>;
    if (group % V == 0 && group / V <= blockDim.x && aligned16(outr) && aligned16(xr) &&
        aligned16(gr) && (!norm || aligned16(wr))) {
        // One 16-byte piece a thread, every load before the first use.
        const u32 j = threadIdx.x;
        const bool in = j < group / V;
        float v[V], g[V], wv[V];
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = g[e] = wv[e] = 0.0f;
        if (in) {
            load16(xr, (i64)j * V, v);
            load16(gr, (i64)j * V, g);
            if (norm) load16(wr, (i64)j * V, wv);
#pragma unroll
            for (int e = 0; e < V; ++e) g[e] = silu(g[e]);
        }
        float inv = 1.0f;
        if (norm) {
            float ss = 0.0f;
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const float y = mode == 0 ? v[e] * g[e] : v[e];
                ss += y * y;
            }
            ss = block_sum(ss, scratch);
            inv = 1.0f / sqrtf(ss / (float)group + eps);
        }
        if (in) {
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = gate_norm_out(mode, v[e], g[e], wv[e], inv);
            store16(outr, (i64)j * V, v);
        }
        return;
    }
    float inv = 1.0f;
    if (norm) {
        float ss = 0.0f;
        for (u32 c = threadIdx.x; c < group; c += blockDim.x) {
            float y = load(xr, c);
            if (mode == 0) y *= silu(load(gr, c));
            ss += y * y;
        }
        ss = block_sum(ss, scratch);
        inv = 1.0f / sqrtf(ss / (float)group + eps);
    }
    for (u32 c = threadIdx.x; c < group; c += blockDim.x) {
        const float wc = norm ? load(wr, c) : 0.0f;
        store(outr, c, gate_norm_out(mode, load(xr, c), silu(load(gr, c)), wc, inv));
    }
}

// Rotates the leading 2·half dims of every head of row t (non-interleaved halves, Hugging
// Face's rotate_half) by positions[t] · inv_freq[i]. One block per row.
template <typename T>
__device__ void rope(T* x, u32 n, u32 heads, u32 head_dim, u32 half, const u32* positions,
                     const float* inv_freq, float scaling, u32 row_stride) {
    u32 t = blockIdx.x;
    if (t >= n) return;
    float p = (float)positions[t];
    i64 row = (i64)t * row_stride;
    const u32 pairs = heads * half;
    // Up to 8 pairs per thread: all loads first (see the row kernels above).
    constexpr int R = 8;
    u32 j0 = threadIdx.x;
    for (; j0 < pairs; j0 += R * blockDim.x) {
        float x1[R], x2[R];
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const u32 j = j0 + k * blockDim.x;
            const i64 b = row + (i64)(j / half) * head_dim + j % half;
            x1[k] = j < pairs ? load(x, b) : 0.0f;
            x2[k] = j < pairs ? load(x, b + half) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const u32 j = j0 + k * blockDim.x;
            if (j >= pairs) continue;
            const u32 i = j % half;
            float s, c;
            sincosf(inv_freq[i] * p, &s, &c);
            s *= scaling;
            c *= scaling;
            const i64 b = row + (i64)(j / half) * head_dim + i;
            store(x, b, x1[k] * c - x2[k] * s);
            store(x, b + half, x2[k] * c + x1[k] * s);
        }
    }
}

// Element-wise kernels take 16-byte pieces when the length and the addresses allow.
template <typename T>
__device__ void activate(T* x, u64 n, u32 act) {
    constexpr int V = VEC<T>;
    if (n % V == 0 && aligned16(x)) {
        GRID_STRIDE(p, n / V) {
            float v[V];
            load16(x, (i64)p * V, v);
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = apply_act(v[e], act);
            store16(x, (i64)p * V, v);
        }
        return;
    }
    GRID_STRIDE(i, n) store(x, i, apply_act(load(x, i), act));
}

template <typename T>
__device__ void act_mul(T* out, const T* gate, const T* up, u64 n, u32 act) {
    constexpr int V = VEC<T>;
    if (n % V == 0 && aligned16(out) && aligned16(gate) && aligned16(up)) {
        GRID_STRIDE(p, n / V) {
            float g[V], u[V];
            load16(gate, (i64)p * V, g);
            load16(up, (i64)p * V, u);
#pragma unroll
            for (int e = 0; e < V; ++e) g[e] = apply_act(g[e], act) * u[e];
            store16(out, (i64)p * V, g);
        }
        return;
    }
    GRID_STRIDE(i, n) store(out, i, apply_act(load(gate, i), act) * load(up, i));
}

// x[r, c] *= sigmoid(gate[r, c]) (gate_cols == cols) or sigmoid(gate[r, 0]) (gate_cols == 1).
template <typename T>
__device__ void sigmoid_gate(T* x, const T* gate, u64 n, u32 cols, u32 gate_cols) {
    GRID_STRIDE(i, n) {
        const u64 r = i / cols, c = i % cols;
        const float g = load(gate, (i64)(r * gate_cols + (gate_cols == 1 ? 0 : c)));
        store(x, i, load(x, i) * (1.0f / (1.0f + expf(-g))));
    }
}

template <typename T>
__device__ void add_assign(T* x, const T* y, u64 n) {
    GRID_STRIDE(i, n) store(x, i, load(x, i) + load(y, i));
}

template <typename T>
__device__ void scale_assign(T* x, u64 n, float s) {
    GRID_STRIDE(i, n) store(x, i, load(x, i) * s);
}

// out[r, :] = x[rows[r], :]; a row index outside x gives a NaN row (visible, never silent).
template <typename T>
__device__ void gather_rows(T* out, const T* x, const u32* rows, u32 n_out, u32 cols, u32 n_in) {
    u32 r = blockIdx.x;
    if (r >= n_out) return;
    u32 src = rows[r];
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = src < n_in ? load(x, (i64)src * cols + c) : CHIMERA_NAN;
        store(out, (i64)r * cols + c, v);
    }
}

// A cache element: as computed (C = T), or the FP8 e4m3 code of v / scale (C = u8, an FP8 KV
// cache; `cache.kv_dtype = "fp8_e4m3"`, rounded as the CPU's oracle rounds).
__device__ __forceinline__ void store_kv(float* p, i64 i, float v, float) { p[i] = v; }
__device__ __forceinline__ void store_kv(bf16* p, i64 i, float v, float) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ void store_kv(u8* p, i64 i, float v, float scale) { p[i] = f32_to_fp8(v / scale); }

// Writes token t's K and V rows into cache row slot_mapping[t] (a slot ≥ cache_rows, e.g. the
// padding slot 0xffffffff, is skipped). One block per token. The scales matter only for an
// FP8 cache.
template <typename T, typename C>
__device__ void kv_write(C* k_cache, C* v_cache, const T* k, const T* v, const u32* slot_mapping,
                         u32 n, u32 kv_width, u64 cache_rows, float k_scale, float v_scale) {
    u32 t = blockIdx.x;
    if (t >= n) return;
    u64 slot = slot_mapping[t];
    if (slot >= cache_rows) return;
    for (u32 c = threadIdx.x; c < kv_width; c += blockDim.x) {
        store_kv(k_cache, slot * kv_width + c, load(k, (i64)t * kv_width + c), k_scale);
        store_kv(v_cache, slot * kv_width + c, load(v, (i64)t * kv_width + c), v_scale);
    }
}

// Rotates token t's keys (as `rope`) on their way into the cache and writes its values: the
// RoPE of K fused with the paged KV write. One block per token; a slot ≥ cache_rows (padding)
// is skipped. `k` itself is left as it was. The entry point also rotates the token's queries
// in place (`rope`), so that Q's and K's rotations and the KV write are one launch.
template <typename T, typename C>
__device__ void rope_kv_write(C* k_cache, C* v_cache, const T* k, const T* v,
                              const u32* slot_mapping, u32 n, u32 kv_heads, u32 head_dim,
                              u32 half, const u32* positions, const float* inv_freq,
                              float scaling, u64 cache_rows, float k_scale, float v_scale) {
    u32 t = blockIdx.x;
    if (t >= n) return;
    u64 slot = slot_mapping[t];
    if (slot >= cache_rows) return;
    u32 width = kv_heads * head_dim;
    float p = (float)positions[t];
    const T* src = k + (i64)t * width;
    C* dst = k_cache + slot * width;
    // Up to 8 elements per thread: all loads first (see the row kernels above).
    constexpr int R = 8;
    for (u32 j0 = threadIdx.x; j0 < width; j0 += R * blockDim.x) {
        float own[R], other[R];
        float vv[R];
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const u32 j = j0 + k * blockDim.x;
            const u32 d = j % head_dim;
            const i64 base = (i64)(j - d);
            const bool in = j < width;
            own[k] = in ? load(src, base + d) : 0.0f;
            const i64 pair = d < half ? base + d + half : base + d - half;
            other[k] = in && d < 2 * half ? load(src, pair) : 0.0f;
            if (in) vv[k] = load(v, (i64)t * width + j);
        }
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const u32 j = j0 + k * blockDim.x;
            if (j >= width) continue;
            const u32 d = j % head_dim;
            float out = own[k];
            if (d < 2 * half) {
                float s, c;
                sincosf(inv_freq[d < half ? d : d - half] * p, &s, &c);
                out = d < half ? own[k] * (c * scaling) - other[k] * (s * scaling)
                               : own[k] * (c * scaling) + other[k] * (s * scaling);
            }
            store_kv(dst, j, out, k_scale);
            store_kv(v_cache, slot * width + j, vv[k], v_scale);
        }
    }
}

// MoE routing, one thread per token, exactly as the CPU reference (`backend/cpu/moe.rs`):
// sigmoid scores; choice = score + correction bias; group score = the sum of the group's two
// best choices (best first); the `topk_group` best groups (ties to the lower group); the
// `top_k` best choices among their experts (ties to the lower id); weights are the scores
// (not the choices), optionally normalised by their sum + 1e-20, times `scaling`.
// Scratch: `experts` floats of choices per token in `choice` ([tokens, experts]).
template <typename T>
__device__ void moe_route(u32* ids, float* weights, float* choice, const T* logits,
                          const T* bias, u32 tokens, u32 experts, u32 n_group, u32 topk_group,
                          u32 top_k, u32 norm, float scaling) {
    u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const T* row = logits + (i64)t * experts;
    float* ch = choice + (i64)t * experts;
    for (u32 e = 0; e < experts; ++e) {
        float s = 1.0f / (1.0f + expf(-load(row, e)));
        ch[e] = s + load(bias, e);
    }
    u32 per = experts / n_group;
    // Allowed groups as a bit mask (at most 64 groups).
    u64 allowed = 0;
    for (u32 pick = 0; pick < topk_group; ++pick) {
        int best_g = -1;
        float best_s = 0.0f;
        for (u32 g = 0; g < n_group; ++g) {
            if (allowed >> g & 1ull) continue;
            float b0 = -CHIMERA_INF, b1 = -CHIMERA_INF;
            u32 m = 0;
            for (u32 e = g * per; e < (g + 1) * per; ++e) {
                float v = ch[e];
                if (m == 0) { b0 = v; m = 1; }
                else if (v > b0) { b1 = b0; b0 = v; m = 2; }
                else if (m == 1 || v > b1) { b1 = v; m = 2; }
            }
            float gs = m == 2 ? b0 + b1 : b0;
            if (best_g < 0 || gs > best_s) { best_g = (int)g; best_s = gs; }
        }
        allowed |= 1ull << best_g;
    }
    // Top-k experts of the allowed groups by choice (ties to the lower id): selection.
    float sum = 0.0f;
    u32* out_ids = ids + (i64)t * top_k;
    float* out_w = weights + (i64)t * top_k;
    for (u32 j = 0; j < top_k; ++j) {
        int best = -1;
        float best_v = 0.0f;
        for (u32 e = 0; e < experts; ++e) {
            if (!(allowed >> (e / per) & 1ull)) continue;
            bool taken = false;
            for (u32 q = 0; q < j; ++q) taken |= out_ids[q] == e;
            if (taken) continue;
            float v = ch[e];
            if (best < 0 || v > best_v) { best = (int)e; best_v = v; }
        }
        out_ids[j] = (u32)best;
        float w = 1.0f / (1.0f + expf(-load(row, (u32)best)));
        out_w[j] = w;
        sum += w;
    }
    if (norm) {
        sum += 1e-20f;
        for (u32 j = 0; j < top_k; ++j) out_w[j] = out_w[j] / sum;
    }
    for (u32 j = 0; j < top_k; ++j) out_w[j] *= scaling;
}

// Softmax routing (Granite 4.0, Qwen MoE), one thread a token, as the CPU's
// moe_route_softmax: the top_k largest logits (ties to the lower id), best first; weights
// softmax(logits) at the picked experts (the sum over every expert in id order), renormalised
// over the picked ones when `norm`, times `scaling`.
template <typename T>
__device__ void moe_route_softmax(u32* ids, float* weights, const T* logits, u32 tokens,
                                  u32 experts, u32 top_k, u32 norm, float scaling) {
    u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const T* row = logits + (i64)t * experts;
    u32* out_ids = ids + (i64)t * top_k;
    float* out_w = weights + (i64)t * top_k;
    for (u32 j = 0; j < top_k; ++j) {
        int best = -1;
        float best_v = 0.0f;
        for (u32 e = 0; e < experts; ++e) {
            bool taken = false;
            for (u32 q = 0; q < j; ++q) taken |= out_ids[q] == e;
            if (taken) continue;
            const float v = load(row, e);
            if (best < 0 || v > best_v) { best = (int)e; best_v = v; }
        }
        out_ids[j] = (u32)best;
    }
    const float mx = load(row, out_ids[0]);
    float z = 0.0f;
    for (u32 e = 0; e < experts; ++e) z += expf(load(row, e) - mx);
    float sum = 0.0f;
    for (u32 j = 0; j < top_k; ++j) {
        out_w[j] = expf(load(row, out_ids[j]) - mx) / z;
        sum += out_w[j];
    }
    if (norm) {
        sum += 1e-20f;
        for (u32 j = 0; j < top_k; ++j) out_w[j] = out_w[j] / sum;
    }
    for (u32 j = 0; j < top_k; ++j) out_w[j] *= scaling;
}

// out[rows[i], :] += w[i] * y[i, :] for the `n` rows of one expert (distinct tokens: no race).
template <typename T>
__device__ void moe_scatter_add(T* out, const T* y, const u32* rows, const float* w, u32 n,
                                u32 cols) {
    u32 i = blockIdx.x;
    if (i >= n) return;
    i64 dst = (i64)rows[i] * cols, src = (i64)i * cols;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x)
        store(out, dst + c, load(out, dst + c) + w[i] * load(y, src + c));
}

// x[r, c] += b[c].
template <typename T>
__device__ void add_bias(T* x, const T* b, u32 rows, u32 cols) {
    GRID_STRIDE(i, (u64)rows * cols) store(x, i, load(x, i) + load(b, i % cols));
}

// out[r, :] = x[r, col_start .. col_start + out_cols] (x has in_cols columns).
// In 16-byte pieces when the widths, the start and the addresses allow; 32-bit index
// arithmetic (a 64-bit division per element costs more than the copy).
template <typename T>
__device__ void copy_cols(T* out, const T* x, u32 rows, u32 out_cols, u32 in_cols, u32 col_start) {
    constexpr int V = VEC<T>;
    const u64 n = (u64)rows * out_cols;
    if (out_cols % V == 0 && in_cols % V == 0 && col_start % V == 0 && aligned16(out) &&
        aligned16(x) && n / V < 0xffffffffull) {
        const u32 pieces = out_cols / V, in_pieces = in_cols / V, start = col_start / V;
        const uint4* src = reinterpret_cast<const uint4*>(x);
        uint4* dst = reinterpret_cast<uint4*>(out);
        for (u32 p = blockIdx.x * blockDim.x + threadIdx.x; p < (u32)(n / V);
             p += gridDim.x * blockDim.x) {
            const u32 r = p / pieces, c = p - r * pieces;
            dst[p] = src[(u64)r * in_pieces + start + c];
        }
        return;
    }
    if (n < 0xffffffffull) {
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < (u32)n; i += gridDim.x * blockDim.x) {
            const u32 r = i / out_cols, c = i - r * out_cols;
            out[i] = x[(u64)r * in_cols + col_start + c];
        }
        return;
    }
    GRID_STRIDE(i, n) {
        u64 r = i / out_cols, c = i % out_cols;
        out[i] = x[r * in_cols + col_start + c];
    }
}

// A counter-based hash (splitmix64): element i of tensor `seed` gets a uniform value in
// [-a, a) with a = std·√3, so the values have standard deviation `std`.
__device__ __forceinline__ float hash_uniform(u64 seed, u64 i, float std) {
    u64 z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    return (2.0f * u - 1.0f) * std * 1.7320508f;
}

template <typename T>
__device__ void fill_random(T* out, u64 n, u64 seed, float std) {
    GRID_STRIDE(i, n) store(out, i, hash_uniform(seed, i, std));
}

template <typename T>
__device__ void fill(T* out, u64 n, float v) {
    GRID_STRIDE(i, n) store(out, i, v);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

extern "C" __global__ void cast_f32_to_bf16(bf16* out, const float* in, u64 n) { CHIMERA_PDL_ENTRY();
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(in[i]);
}
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16* in, u64 n) { CHIMERA_PDL_ENTRY();
    GRID_STRIDE(i, n) out[i] = bf16_to_f32(in[i]);
}
extern "C" __global__ void cast_f16_to_bf16(bf16* out, const u16* in, u64 n) { CHIMERA_PDL_ENTRY();
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(f16_to_f32(in[i]));
}
extern "C" __global__ void cast_f16_to_f32(float* out, const u16* in, u64 n) { CHIMERA_PDL_ENTRY();
    GRID_STRIDE(i, n) out[i] = f16_to_f32(in[i]);
}

// The `_f32` / `_bf16` entry points.
#define INSTANTIATE(T, S)                                                                           \
    extern "C" __global__ void rms_norm_##S(T* out, const T* x, const T* w, u32 cols, float eps) { CHIMERA_PDL_ENTRY(); \
        rms_norm(out, x, w, cols, eps);                                                             \
    }                                                                                               \
    extern "C" __global__ void add_rms_norm_##S(T* out, T* residual, const T* delta, const T* w,    \
                                                u32 cols, float eps) { CHIMERA_PDL_ENTRY();                              \
        add_rms_norm(out, residual, delta, w, cols, eps);                                           \
    }                                                                                               \
    extern "C" __global__ void gated_rms_norm_##S(T* out, const T* x, const T* gate, const T* w,    \
                                                  u32 cols, u32 group, float eps, u32 x_ld,         \
                                                  u32 gate_ld, u32 mode) { CHIMERA_PDL_ENTRY();     \
        gated_rms_norm(out, x, gate, w, cols, group, eps, x_ld, gate_ld, mode);                     \
    }                                                                                               \
    extern "C" __global__ void rope_##S(T* x, u32 n, u32 heads, u32 head_dim, u32 half,             \
                                        const u32* positions, const float* inv_freq,                \
                                        float scaling, u32 row_stride) { CHIMERA_PDL_ENTRY();                            \
        rope(x, n, heads, head_dim, half, positions, inv_freq, scaling, row_stride);                \
    }                                                                                               \
    extern "C" __global__ void activate_##S(T* x, u64 n, u32 act) { CHIMERA_PDL_ENTRY(); activate(x, n, act); }         \
    extern "C" __global__ void act_mul_##S(T* out, const T* gate, const T* up, u64 n, u32 act) { CHIMERA_PDL_ENTRY();   \
        act_mul(out, gate, up, n, act);                                                             \
    }                                                                                               \
    extern "C" __global__ void sigmoid_gate_##S(T* x, const T* gate, u64 n, u32 cols,             \
                                                u32 gate_cols) { CHIMERA_PDL_ENTRY();               \
        sigmoid_gate(x, gate, n, cols, gate_cols);                                                  \
    }                                                                                               \
    extern "C" __global__ void moe_route_softmax_##S(u32* ids, float* weights, const T* logits,     \
                                                     u32 tokens, u32 experts, u32 top_k, u32 norm,  \
                                                     float scaling) { CHIMERA_PDL_ENTRY();          \
        moe_route_softmax(ids, weights, logits, tokens, experts, top_k, norm, scaling);             \
    }                                                                                               \
    extern "C" __global__ void add_assign_##S(T* x, const T* y, u64 n) { CHIMERA_PDL_ENTRY(); add_assign(x, y, n); }    \
    extern "C" __global__ void scale_assign_##S(T* x, u64 n, float s) { CHIMERA_PDL_ENTRY(); scale_assign(x, n, s); }   \
    extern "C" __global__ void gather_rows_##S(T* out, const T* x, const u32* rows, u32 n_out,      \
                                               u32 cols, u32 n_in) { CHIMERA_PDL_ENTRY();                                \
        gather_rows(out, x, rows, n_out, cols, n_in);                                               \
    }                                                                                               \
    extern "C" __global__ void kv_write_##S(T* k_cache, T* v_cache, const T* k, const T* v,         \
                                            const u32* slot_mapping, u32 n, u32 kv_width,           \
                                            u64 cache_rows) { CHIMERA_PDL_ENTRY();                                       \
        kv_write(k_cache, v_cache, k, v, slot_mapping, n, kv_width, cache_rows, 1.0f, 1.0f);        \
    }                                                                                               \
    extern "C" __global__ void kv_write_fp8_##S(u8* k_cache, u8* v_cache, const T* k, const T* v,   \
                                                const u32* slot_mapping, u32 n, u32 kv_width,       \
                                                u64 cache_rows, float k_scale, float v_scale) {     \
        CHIMERA_PDL_ENTRY();                                                                        \
        kv_write(k_cache, v_cache, k, v, slot_mapping, n, kv_width, cache_rows, k_scale, v_scale);  \
    }                                                                                               \
    extern "C" __global__ void rope_kv_write_##S(                                                  \
        T* k_cache, T* v_cache, const T* k, const T* v, const u32* slot_mapping, u32 n,             \
        u32 kv_heads, u32 head_dim, u32 half, const u32* positions, const float* inv_freq,          \
        float scaling, u64 cache_rows, T* q, u32 heads) { CHIMERA_PDL_ENTRY();                       \
        rope_kv_write(k_cache, v_cache, k, v, slot_mapping, n, kv_heads, head_dim, half, positions, \
                      inv_freq, scaling, cache_rows, 1.0f, 1.0f);                                   \
        rope(q, n, heads, head_dim, half, positions, inv_freq, scaling, heads * head_dim);          \
    }                                                                                               \
    extern "C" __global__ void rope_kv_write_fp8_##S(                                              \
        u8* k_cache, u8* v_cache, const T* k, const T* v, const u32* slot_mapping, u32 n,           \
        u32 kv_heads, u32 head_dim, u32 half, const u32* positions, const float* inv_freq,          \
        float scaling, u64 cache_rows, T* q, u32 heads, float k_scale, float v_scale) {             \
        CHIMERA_PDL_ENTRY();                                                                        \
        rope_kv_write(k_cache, v_cache, k, v, slot_mapping, n, kv_heads, head_dim, half, positions, \
                      inv_freq, scaling, cache_rows, k_scale, v_scale);                             \
        rope(q, n, heads, head_dim, half, positions, inv_freq, scaling, heads * head_dim);          \
    }                                                                                               \
    extern "C" __global__ void moe_route_##S(u32* ids, float* weights, float* choice,               \
                                             const T* logits, const T* bias, u32 tokens,            \
                                             u32 experts, u32 n_group, u32 topk_group, u32 top_k,   \
                                             u32 norm, float scaling) { CHIMERA_PDL_ENTRY();                             \
        moe_route(ids, weights, choice, logits, bias, tokens, experts, n_group, topk_group, top_k,  \
                  norm, scaling);                                                                   \
    }                                                                                               \
    extern "C" __global__ void moe_scatter_add_##S(T* out, const T* y, const u32* rows,             \
                                                   const float* w, u32 n, u32 cols) { CHIMERA_PDL_ENTRY();               \
        moe_scatter_add(out, y, rows, w, n, cols);                                                  \
    }                                                                                               \
    extern "C" __global__ void add_bias_##S(T* x, const T* b, u32 rows, u32 cols) { CHIMERA_PDL_ENTRY();                \
        add_bias(x, b, rows, cols);                                                                 \
    }                                                                                               \
    extern "C" __global__ void copy_cols_##S(T* out, const T* x, u32 rows, u32 out_cols,            \
                                             u32 in_cols, u32 col_start) { CHIMERA_PDL_ENTRY();                          \
        copy_cols(out, x, rows, out_cols, in_cols, col_start);                                      \
    }                                                                                               \
    extern "C" __global__ void fill_random_##S(T* out, u64 n, u64 seed, float std) { CHIMERA_PDL_ENTRY();               \
        fill_random(out, n, seed, std);                                                             \
    }                                                                                               \
    extern "C" __global__ void fill_##S(T* out, u64 n, float v) { CHIMERA_PDL_ENTRY(); fill(out, n, v); }

INSTANTIATE(float, f32)
INSTANTIATE(bf16, bf16)
