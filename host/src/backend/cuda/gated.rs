//! The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) on the CUDA backend:
//! `gdn_prep` (normalised q/k, decays and βs of the step's tokens) then the recurrence per
//! entry, value head and block of state columns (`gdn_decode` for the decodes, `gdn_prompt`
//! for the prompts, their tokens staged through shared memory; `gdn_scan` for the shapes
//! those do not take; snapshots at the plan's chunk ends) from `chimera_kernels::ssm`, over
//! the same step plan, work columns and state pools as the Mamba2 scan.

use chimera_kernels::ssm;

use super::ssm::SsmTensors;
use super::{CudaBackend, CudaStep, CudaTensor};
use crate::backend::{BackendError, DType, GdnOperands, GdnShape, Result, SsmPools};

impl CudaBackend {
    /// [`crate::backend::LayerOps::gated_delta_rule`]: returns `o [n, v_heads·v_dim]`.
    pub(super) fn delta_rule_layer(
        &self,
        x: &GdnOperands<'_, CudaTensor>,
        shape: GdnShape,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.step_ready(step)?;
        self.check_pools(pools, step, true)?;
        let n = step.dims.tokens;
        let dtype = x.q.dtype;
        let ok = x.q.rows_cols() == (n, shape.key_dim())
            && x.k.rows_cols() == (n, shape.key_dim())
            && x.v.rows_cols() == (n, shape.value_dim())
            && x.a.rows_cols() == (n, shape.v_heads)
            && x.b.rows_cols() == (n, shape.v_heads)
            && x.a_log.len() == shape.v_heads
            && x.dt_bias.len() == shape.v_heads
            && [x.k, x.v, x.a, x.b, x.a_log, x.dt_bias]
                .iter()
                .all(|t| t.dtype == dtype)
            && layer < pools.layers
            && pools.ssm.bytes() / pools.slots.max(1) / pools.layers.max(1)
                == shape.state_elems() * pools.ssm.dtype.size();
        if !ok {
            return Err(BackendError::Invalid(format!(
                "gated_delta_rule: q {:?} k {:?} v {:?} a {:?} b {:?} ({dtype:?}), state pool {:?} \
                 for {shape:?}, layer {layer} of {}, {n} tokens in the step",
                x.q.shape,
                x.k.shape,
                x.v.shape,
                x.a.shape,
                x.b.shape,
                pools.ssm.shape,
                pools.layers
            )));
        }
        let out = self.tmp(&[n, shape.value_dim()], dtype)?;
        let dims = ssm::GdnDims {
            layer: layer as u32,
            layers: pools.layers as u32,
            slots: pools.slots as u32,
            state_bf16: pools.ssm.dtype == DType::BF16,
            staged_prompts: staged_prompts(),
            ..ssm::GdnDims::packed(
                shape.k_heads as u32,
                shape.v_heads as u32,
                shape.k_dim as u32,
                shape.v_dim as u32,
            )
        };
        let launches = ssm::launches_gdn(&step.ssm, dims, dtype == DType::BF16)
            .map_err(|e| BackendError::Invalid(format!("gated_delta_rule: {e}")))?;
        let scratch: Vec<CudaTensor> = ssm::gdn_scratch_lens(&dims, n)
            .into_iter()
            .map(|len| self.tmp(&[len.max(1)], DType::F32))
            .collect::<Result<_>>()?;
        let t = SsmTensors {
            x: x.q.ptr,
            b: x.k.ptr,
            c: x.v.ptr,
            dt: x.a.ptr,
            d: x.b.ptr,
            a_log: x.a_log.ptr,
            dt_bias: x.dt_bias.ptr,
            out: out.ptr,
            ..SsmTensors::default()
        };
        self.run_ssm(launches, step, pools, &t, &scratch)?;
        Ok(out)
    }
}

/// Whether prompts take `gdn_prompt` (the default, `CHIMERA_GDN_PROMPTS` unset or `prompt`)
/// or the first kernel, `gdn_scan` (`CHIMERA_GDN_PROMPTS=scan`), for comparing the two on a
/// GPU. Read once; another value is named in a warning and the default kept.
fn staged_prompts() -> bool {
    static STAGED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STAGED.get_or_init(|| match std::env::var("CHIMERA_GDN_PROMPTS") {
        Err(_) => true,
        Ok(v) if v == "prompt" => true,
        Ok(v) if v == "scan" => false,
        Ok(v) => {
            tracing::warn!(value = %v, "CHIMERA_GDN_PROMPTS is `prompt` or `scan`; using `prompt`");
            true
        }
    })
}
