// Mamba2 state-space kernels for chimera, one file per stage (as mamba_ssm splits them):
// slot_ops.cu (the SSM slot restores/zeros), conv.cu (the depthwise causal conv1d),
// state_update.cu (the recurrent step for single tokens), and the chunked SSD for prompt
// chunks: ssd_state.cu (dt, chunk states, state passing) and ssd_scan.cu (the chunk scan),
// with what those two share in ssd.cuh. This header holds what every stage reads. The host
// planners (`ssm/*.rs`, one beside each stage) own the work decomposition; these kernels
// execute it. Activations and weights are T (float: the f32 oracle mode; bf16: serving);
// the state pools and every in-kernel sum are f32.
//
// Work columns (plan.rs: WorkCol). Sequence entries e (decodes, i.e. one-token chunks, first:
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
// Learned from: the SSD paper and its `ssd_minimal`; mamba_ssm's ssd_* Triton kernels and
// selective_state_update; Dao-AILab causal-conv1d; vLLM's mamba varlen kernels (cu_seqlens,
// state indices, intermediate states). The PTX ISA manual for mma/ldmatrix fragment
// layouts. No code was copied.
#pragma once
#include "../common.cuh"
#include "../mma.cuh"

namespace ssm {

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

}  // namespace ssm
