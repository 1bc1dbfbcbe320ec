// Shared device helpers for chimera's kernels. NVRTC compiles these sources with no toolkit
// headers, so everything a kernel needs (bf16 conversion, fixed-width integers, reductions)
// is defined here.
#pragma once

typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;

// bf16 is stored as its 16 raw bits; arithmetic happens in f32.
struct bf16 {
    u16 bits;
};

__device__ __forceinline__ float bf16_to_f32(bf16 v) {
    return __uint_as_float(((u32)v.bits) << 16);
}

// Round to nearest even (the hardware conversion; NaN stays NaN).
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    bf16 b;
    b.bits = r;
    return b;
}

// Two f32 packed into one bf16x2 register (lo in the low half), as mma.sync wants them.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Element access for kernels templated on the storage type (float or bf16).
__device__ __forceinline__ float load(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, i64 i, float v) { p[i] = f32_to_bf16(v); }

// Sixteen bytes as f32 values: 4 floats or 8 bf16. The element index `i` must be a multiple
// of VEC<T> and the address 16-byte aligned (check with `aligned16`).
template <typename T>
constexpr int VEC = 16 / sizeof(T);

__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15ull) == 0; }

__device__ __forceinline__ void load16(const float* p, i64 i, float* v) {
    const float4 r = *reinterpret_cast<const float4*>(p + i);
    v[0] = r.x;
    v[1] = r.y;
    v[2] = r.z;
    v[3] = r.w;
}
__device__ __forceinline__ void load16(const bf16* p, i64 i, float* v) {
    const uint4 r = *reinterpret_cast<const uint4*>(p + i);
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}
__device__ __forceinline__ void store16(float* p, i64 i, const float* v) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store16(bf16* p, i64 i, const float* v) {
    *reinterpret_cast<uint4*>(p + i) = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                                                  pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : -__int_as_float(0x7f800000);
    return warp_max(v);
}

// Programmatic dependent launch (sm_90): the host may launch a kernel while the one before it
// in the stream is still running (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`),
// which hides the launch latency between small kernels. Every entry point starts with this:
// it waits until the previous grids have completed and their writes are visible, then lets
// the next kernel's blocks be scheduled as this grid's blocks retire. Without the attribute
// both instructions do nothing. `kernels/tests/nvrtc_abi.rs` checks every entry has it.
// griddepcontrol exists from sm_90 on; older targets (Ampere) launch without the attribute
// and the entry is empty there.
// The two halves are also usable alone (the GEMV issues its first weight loads in between).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CHIMERA_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define CHIMERA_PDL_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define CHIMERA_PDL_WAIT() \
    do {                   \
    } while (0)
#define CHIMERA_PDL_LAUNCH_DEPENDENTS() \
    do {                                \
    } while (0)
#endif
#define CHIMERA_PDL_ENTRY()  \
    do {                     \
        CHIMERA_PDL_WAIT();  \
        CHIMERA_PDL_LAUNCH_DEPENDENTS(); \
    } while (0)

// Activation codes (the host's `Activation` enum); dense.cu and the GEMV's epilogues apply them.
#define ACT_SILU 0u
#define ACT_RELU2 1u
#define ACT_GELU 2u

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float apply_act(float x, u32 act) {
    if (act == ACT_SILU) return silu(x);
    if (act == ACT_RELU2) {
        float r = fmaxf(x, 0.0f);
        return r * r;
    }
    return 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x)));
}

#define CHIMERA_INF __int_as_float(0x7f800000)
#define CHIMERA_NAN __int_as_float(0x7fc00000)

// ---- FP8 e4m3 codes ---------------------------------------------------------------------------
typedef unsigned char u8;

// 2^120, exactly.
#define FP8_UNBIAS 1.329227995784916e+36f

// The four e4m3 codes of `w` (lowest byte first) as f32 × 2^-120: a code's bits, shifted so
// that its 4-bit exponent and 3-bit mantissa sit at the top of an f32's exponent and mantissa
// fields, are an f32 whose value is the code's times 2^-120 (the exponent biases are 7 and
// 127); subnormal codes land on f32 subnormals with the same property, so this is exact for
// every finite code. Multiply by FP8_UNBIAS (or fold it into a scale) for the value.
__device__ __forceinline__ void fp8x4_scaled(u32 w, float* f) {
    f[0] = __uint_as_float(((w & 0x7fu) << 20) | ((w & 0x80u) << 24));
    f[1] = __uint_as_float(((w & 0x7f00u) << 12) | ((w & 0x8000u) << 16));
    f[2] = __uint_as_float(((w & 0x7f0000u) << 4) | ((w & 0x800000u) << 8));
    f[3] = __uint_as_float(((w & 0x7f000000u) >> 4) | (w & 0x80000000u));
}

#define FP8_MAX 448.0f

// Round to nearest even, saturating at ±448 (NaN stays NaN): the hardware conversion from
// sm_89 on, the same rounding in software before (Ampere has no FP8 conversion).
__device__ __forceinline__ u8 f32_to_fp8(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    return (u8)(r & 0xff);
#else
    if (isnan(v)) return 0x7f;
    const u32 sign = (__float_as_uint(v) >> 24) & 0x80u;
    const float a = fabsf(v);
    // Below the smallest normal (2^-6) the grid is uniform with step 2^-9 (a · 512 is exact).
    if (a < 0.015625f) return (u8)(sign | (u32)__float2int_rn(a * 512.0f));
    if (a >= FP8_MAX) return (u8)(sign | 0x7eu);
    int e;
    frexpf(a, &e);
    e -= 1;  // 2^e ≤ a < 2^(e+1)
    int q = __float2int_rn((ldexpf(a, -e) - 1.0f) * 8.0f);
    if (q == 8) {
        q = 0;
        e += 1;
    }
    const u32 code = min((u32)(((e + 7) << 3) | q), 0x7eu);
    return (u8)(sign | code);
#endif
}

__device__ __forceinline__ float fp8_to_f32(u8 code) {
    float f[4];
    fp8x4_scaled(code, f);
    return f[0] * FP8_UNBIAS;
}
