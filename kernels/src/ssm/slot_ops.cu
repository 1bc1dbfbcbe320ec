// SSM slot restores and zeros (the planner: slot_ops.rs; columns and layouts: ssm.cuh).
#include "ssm.cuh"

namespace ssm {

constexpr u32 NONE = 0xffffffffu;  // plan.rs: ZERO_OP (op_from of a zero op)

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
}  // namespace ssm

// ---------------------------------------------------------------------------------------
// Entry points (slot_ops.rs: ENTRIES).

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
