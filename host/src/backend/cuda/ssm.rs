//! The SSM state pools on the CUDA backend: the step's slot restores and zeros (one batched
//! launch set over every layer, planned when the step was uploaded), the pools' checks, and
//! the mapping of the SSM planner's symbolic arguments (`chimera_kernels::ssm`) to device
//! addresses, shared by the slot operations, the conv and the scan ([`super::mamba`]).

use chimera_kernels::ssm;

use super::device::Arg;
use super::{CudaBackend, CudaStep, CudaTensor, scratch_arg};
use crate::backend::{BackendError, DType, Result, SsmPools};

/// Device addresses of one SSM operation's tensors (0 where the operation has none).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct SsmTensors {
    pub(super) x: u64,
    pub(super) b: u64,
    pub(super) c: u64,
    pub(super) dt: u64,
    pub(super) a_log: u64,
    pub(super) d: u64,
    pub(super) dt_bias: u64,
    pub(super) weight: u64,
    pub(super) bias: u64,
    pub(super) out: u64,
}

impl CudaBackend {
    pub(super) fn run_slot_ops(
        &self,
        pools: &mut SsmPools<CudaTensor>,
        step: &CudaStep,
    ) -> Result<()> {
        self.step_ready(step)?;
        if step.ssm.ops() == 0 {
            return Ok(());
        }
        self.check_pools(pools, step, false)?;
        // Raw 4-byte words per slot: the SSM pool may be stored as bf16.
        let per_slot = |t: &CudaTensor| (t.bytes() / 4 / pools.slots.max(1)) as u64;
        let dims = ssm::PoolDims {
            slots: pools.slots as u32,
            conv_per_slot: per_slot(&pools.conv),
            ssm_per_slot: per_slot(&pools.ssm),
        };
        let launches = ssm::launches_slot_ops(&step.ssm, dims);
        self.run_ssm(launches, step, pools, &SsmTensors::default(), &[])
    }

    /// Checks the pools, and (for the conv and the scan) that the step's scan chunks were
    /// planned: slot operations need no chunk size.
    pub(super) fn check_pools(
        &self,
        pools: &SsmPools<CudaTensor>,
        step: &CudaStep,
        scan: bool,
    ) -> Result<()> {
        if scan && step.ssm_chunk == 0 {
            return Err(BackendError::Invalid(
                "SSM operation on a step planned without an SSD chunk size \
                 (LayerOps::set_ssm_chunk_size was not called when the model loaded)"
                    .into(),
            ));
        }
        // The conv state is f32; the recurrent state f32 or (opt-in) bf16, an even number of
        // elements per slot so that the slot ops move whole 4-byte words.
        for (what, t, bf16_ok) in [("conv", &pools.conv, false), ("ssm", &pools.ssm, true)] {
            let dtype_ok = t.dtype == DType::F32 || (bf16_ok && t.dtype == DType::BF16);
            if !dtype_ok
                || t.bytes() % (4 * pools.slots.max(1)) != 0
                || t.shape.first() != Some(&pools.slots)
                || t.shape.get(1) != Some(&pools.layers)
            {
                return Err(BackendError::Invalid(format!(
                    "{what} pool {:?} {:?} is not {} [{} slots, {} layers, …]",
                    t.dtype,
                    t.shape,
                    if bf16_ok { "f32 or bf16" } else { "f32" },
                    pools.slots,
                    pools.layers
                )));
            }
        }
        Ok(())
    }

    /// Launches an SSM planner's kernels, mapping its symbolic arguments.
    pub(super) fn run_ssm(
        &self,
        launches: Vec<chimera_kernels::Launch<ssm::SsmArg>>,
        step: &CudaStep,
        pools: &SsmPools<CudaTensor>,
        t: &SsmTensors,
        scratch: &[CudaTensor],
    ) -> Result<()> {
        use ssm::SsmArg as A;
        self.run_launches(launches, |a| {
            Ok(match *a {
                A::X => Arg::Ptr(t.x),
                A::B => Arg::Ptr(t.b),
                A::C => Arg::Ptr(t.c),
                A::Dt => Arg::Ptr(t.dt),
                A::ALog => Arg::Ptr(t.a_log),
                A::D => Arg::Ptr(t.d),
                A::DtBias => Arg::Ptr(t.dt_bias),
                A::Weight => Arg::Ptr(t.weight),
                A::Bias => Arg::Ptr(t.bias),
                A::Out => Arg::Ptr(t.out),
                A::ConvPool => Arg::Ptr(pools.conv.ptr),
                A::SsmPool => Arg::Ptr(pools.ssm.ptr),
                A::Work(c) => Arg::Ptr(step.ssm_col(c)),
                A::Scratch(i) => scratch_arg(scratch, i, "SSM")?,
                A::U32(v) => Arg::U32(v),
                A::U64(v) => Arg::U64(v),
                A::F32(v) => Arg::F32(v),
            })
        })
    }
}
