//! Mixture of experts on the CUDA backend: routing on the device (`moe_route`, dense.cu) and
//! the grouped expert compute of `chimera_kernels::moe` — the sort into expert order, one
//! grouped GEMM for up (fused with the gate and the activation), one for down with the routing
//! weights, and an ordered combine into `out`. Nothing comes back to the host and every launch
//! geometry follows from the layer's dims, so a MoE layer can be captured in a CUDA graph.
//!
//! [`CudaBackend::moe_route`] (routing read back to the host) and
//! [`CudaBackend::moe_per_expert`] (the former per-expert path: a read-back, then a gather,
//! two cuBLASLt GEMMs and a scatter-add per expert) remain for the GPU checks and the bench's
//! comparison only; the model never calls them.

use chimera_kernels::moe::{self as kmoe, MoeArg, MoeDims};

use super::device::Arg;
use super::memory::{dtoh, htod, sync};
use super::{CudaBackend, CudaTensor, act_code, u32_bytes};
use crate::backend::cpu::moe::group_by_expert;
use crate::backend::{
    BackendError, DType, LayerOps, MoeRouting, MoeScoring, Result, StackedExperts,
};

impl CudaBackend {
    pub(super) fn moe_on_device(
        &self,
        x: &CudaTensor,
        router_logits: &CudaTensor,
        routing: &MoeRouting<CudaTensor>,
        experts: &StackedExperts<CudaTensor>,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let dims = self.moe_dims(x, router_logits, routing, experts, out)?;
        if dims.tokens == 0 {
            return Ok(());
        }
        let routed = self.route_on_device(router_logits, routing)?;
        self.moe_grouped(x, &routed, experts, dims, out)
    }

    /// Checks the layer's tensors against each other and returns its dims.
    pub(super) fn moe_dims(
        &self,
        x: &CudaTensor,
        router_logits: &CudaTensor,
        routing: &MoeRouting<CudaTensor>,
        experts: &StackedExperts<CudaTensor>,
        out: &CudaTensor,
    ) -> Result<MoeDims> {
        let (tokens, hidden) = x.rows_cols();
        let up = &experts.up.shape;
        let shapes_ok = up.len() == 3
            && out.shape == x.shape
            && experts.down.shape == [up[0], hidden, up[1]]
            && up[2] == hidden
            && router_logits.rows_cols() == (tokens, up[0])
            && experts.gate.as_ref().is_none_or(|g| &g.shape == up);
        // Experts are all of the activation dtype, or all FP8 with row scales (then the
        // widths are multiples of 16: the kernels stage 16-code chunks).
        let weights = || {
            [&experts.up, &experts.down]
                .into_iter()
                .chain(experts.gate.as_ref())
        };
        let fp8 = experts.up.fp8.is_some();
        let dtypes_ok = out.dtype == x.dtype
            && if fp8 {
                weights().all(|t| t.fp8.as_ref().is_some_and(|m| m.block.is_none()))
                    && hidden.is_multiple_of(16)
                    && up[1].is_multiple_of(16)
            } else {
                weights().all(|t| t.dtype == x.dtype)
            };
        if !shapes_ok || !dtypes_ok {
            return Err(BackendError::Invalid(format!(
                "moe: x {:?} {:?}, router logits {:?}, up {up:?} {:?}, down {:?} {:?}, gate {:?}, \
                 out {:?} {:?}",
                x.dtype,
                x.shape,
                router_logits.shape,
                experts.up.dtype,
                experts.down.shape,
                experts.down.dtype,
                experts.gate.as_ref().map(|g| (g.dtype, &g.shape)),
                out.dtype,
                out.shape
            )));
        }
        let dims = MoeDims {
            tokens,
            hidden,
            inter: up[1],
            experts: up[0],
            top_k: routing.top_k,
            gated: experts.gate.is_some(),
            act: act_code(experts.act),
        };
        dims.check(x.dtype == DType::BF16)
            .map_err(|e| BackendError::Invalid(format!("moe: {e}")))?;
        Ok(dims)
    }

    /// Routes every token on the device (the CPU's rule, bit for bit in f32 mode): a u32
    /// tensor of `2 × tokens × top_k` words, the expert ids (`[tokens, top_k]`, best first)
    /// then the weights' f32 bits.
    pub(super) fn route_on_device(
        &self,
        router_logits: &CudaTensor,
        routing: &MoeRouting<CudaTensor>,
    ) -> Result<CudaTensor> {
        let (tokens, n_experts) = router_logits.rows_cols();
        let r = routing;
        if r.scoring == MoeScoring::Softmax {
            return self.route_softmax_on_device(router_logits, routing);
        }
        let groups_ok = r.n_group > 0
            && r.n_group <= 64
            && n_experts.is_multiple_of(r.n_group)
            && r.topk_group <= r.n_group
            && r.top_k > 0
            && r.top_k <= r.topk_group * (n_experts / r.n_group)
            && r.correction_bias.len() == n_experts;
        if !groups_ok {
            return Err(BackendError::Invalid(format!(
                "moe_route: top-{} of {n_experts} experts in {} groups (at most 64), {} allowed",
                r.top_k, r.n_group, r.topk_group
            )));
        }
        let choice = self.tmp(&[tokens.max(1), n_experts], DType::F32)?;
        self.launch_route(
            "moe_route",
            router_logits,
            r,
            &[Arg::Ptr(choice.ptr)],
            &[
                Arg::Ptr(r.correction_bias.ptr),
                Arg::U32(tokens as u32),
                Arg::U32(n_experts as u32),
                Arg::U32(r.n_group as u32),
                Arg::U32(r.topk_group as u32),
            ],
        )
    }

    /// Launches the routing kernel `kernel` (a thread a token) into a new buffer of `2 ×
    /// tokens × top_k` words (expert ids, then weights): its arguments are the two halves,
    /// `before` the logits, the logits, `after` them, then top-k, renormalisation and scaling.
    fn launch_route(
        &self,
        kernel: &str,
        router_logits: &CudaTensor,
        r: &MoeRouting<CudaTensor>,
        before: &[Arg],
        after: &[Arg],
    ) -> Result<CudaTensor> {
        let tokens = router_logits.rows_cols().0;
        let n = tokens * r.top_k;
        let res = self.tmp(&[2 * n.max(1)], DType::F32)?;
        let mut args = vec![Arg::Ptr(res.ptr), Arg::Ptr(res.ptr + 4 * n as u64)];
        args.extend_from_slice(before);
        args.push(Arg::Ptr(router_logits.ptr));
        args.extend_from_slice(after);
        args.extend([
            Arg::U32(r.top_k as u32),
            Arg::U32(u32::from(r.norm_topk_prob)),
            Arg::F32(r.scaling),
        ]);
        self.launch_geo(
            kernel,
            router_logits.dtype,
            ((tokens as u32).div_ceil(128).max(1), 1, 1),
            (128, 1, 1),
            0,
            &args,
        )?;
        Ok(res)
    }

    /// Softmax routing on the device (the CPU's `moe_route_softmax`): the same `2 × tokens ×
    /// top_k` words as [`Self::route_on_device`].
    fn route_softmax_on_device(
        &self,
        router_logits: &CudaTensor,
        r: &MoeRouting<CudaTensor>,
    ) -> Result<CudaTensor> {
        let (tokens, n_experts) = router_logits.rows_cols();
        if r.top_k == 0 || r.top_k > n_experts {
            return Err(BackendError::Invalid(format!(
                "moe_route: top-{} of {n_experts} experts",
                r.top_k
            )));
        }
        self.launch_route(
            "moe_route_softmax",
            router_logits,
            r,
            &[],
            &[Arg::U32(tokens as u32), Arg::U32(n_experts as u32)],
        )
    }

    /// [`Self::route_on_device`], then the expert ids and weights (`[tokens, top_k]`) brought
    /// back to the host (a synchronisation: for checks, not the serving path).
    pub fn moe_route(
        &self,
        router_logits: &CudaTensor,
        routing: &MoeRouting<CudaTensor>,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let (tokens, n_experts) = router_logits.rows_cols();
        let n = tokens * routing.top_k;
        let res = self.route_on_device(router_logits, routing)?;
        let mut bytes = vec![0u8; 8 * n];
        // SAFETY: `res` holds 2n words; the copy completes before `sync` returns.
        unsafe { dtoh(self.dev(), self.stream(), &mut bytes, res.ptr)? };
        sync(self.dev(), self.stream())?;
        let word = |i: usize| {
            u32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ])
        };
        let ids: Vec<u32> = (0..n).map(word).collect();
        let weights: Vec<f32> = (n..2 * n).map(|i| f32::from_bits(word(i))).collect();
        if let Some(&bad) = ids.iter().find(|&&e| e as usize >= n_experts) {
            return Err(BackendError::Invalid(format!(
                "moe_route picked expert {bad} of {n_experts} (NaN router logits?)"
            )));
        }
        Ok((ids, weights))
    }

    /// The grouped expert compute over routing already on the device (`routed` from
    /// [`Self::route_on_device`]): sort, up, down, combine (see `chimera_kernels::moe`).
    pub(super) fn moe_grouped(
        &self,
        x: &CudaTensor,
        routed: &CudaTensor,
        experts: &StackedExperts<CudaTensor>,
        d: MoeDims,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let n = d.entries();
        let layout = kmoe::IndexLayout::new(&d);
        let index = self.tmp(&[layout.words], DType::F32)?;
        let cap = self.moe_rows_cap(d.top_k);
        let mid = self.tmp_rows_with_capacity(n, d.inter, cap, x.dtype)?;
        let y = self.tmp_rows_with_capacity(n, d.hidden, cap, x.dtype)?;
        let (ids, weights) = (routed.ptr, routed.ptr + 4 * n as u64);
        let bf16 = x.dtype == DType::BF16;
        let scales = |t: &CudaTensor| t.fp8.as_ref().map_or(0, |m| m.ptr);
        let launches = if experts.up.fp8.is_some() {
            kmoe::fp8_launches(&d, bf16)
        } else {
            kmoe::launches(&d, bf16)
        };
        self.run_launches(launches, |a| {
            Ok(match *a {
                MoeArg::X => Arg::Ptr(x.ptr),
                MoeArg::Out => Arg::Ptr(out.ptr),
                MoeArg::Up => Arg::Ptr(experts.up.ptr),
                MoeArg::Gate => Arg::Ptr(experts.gate.as_ref().map_or(0, |g| g.ptr)),
                MoeArg::Down => Arg::Ptr(experts.down.ptr),
                MoeArg::Ids => Arg::Ptr(ids),
                MoeArg::Weights => Arg::Ptr(weights),
                MoeArg::Index(word) => Arg::Ptr(index.ptr + 4 * word as u64),
                MoeArg::Mid => Arg::Ptr(mid.ptr),
                MoeArg::Y => Arg::Ptr(y.ptr),
                MoeArg::UpScales => Arg::Ptr(scales(&experts.up)),
                MoeArg::GateScales => Arg::Ptr(experts.gate.as_ref().map_or(0, scales)),
                MoeArg::DownScales => Arg::Ptr(scales(&experts.down)),
                MoeArg::Null => Arg::Ptr(0),
                MoeArg::U32(v) => Arg::U32(v),
            })
        })
    }

    /// The former per-expert path, kept only for the bench's comparison: the routing comes
    /// back to the host (a synchronisation), the host groups tokens by expert, and each expert
    /// with tokens is a gather, two cuBLASLt GEMMs and a weighted scatter-add. Plain experts
    /// only.
    pub fn moe_per_expert(
        &self,
        x: &CudaTensor,
        router_logits: &CudaTensor,
        routing: &MoeRouting<CudaTensor>,
        experts: &StackedExperts<CudaTensor>,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let d = self.moe_dims(x, router_logits, routing, experts, out)?;
        if experts.up.fp8.is_some() {
            return Err(BackendError::Invalid(
                "moe_per_expert: FP8 experts (the grouped path runs them)".into(),
            ));
        }
        if d.gated {
            return Err(BackendError::Invalid(
                "moe_per_expert: gated experts (the grouped path runs them)".into(),
            ));
        }
        let (n_experts, inter, hidden, top_k) = (d.experts, d.inter, d.hidden, d.top_k);
        let (ids, weights) = self.moe_route(router_logits, routing)?;
        let (start, rows, row_w) = group_by_expert(&ids, &weights, n_experts, top_k);
        let lists = self.tmp(&[2 * ids.len().max(1)], DType::F32)?;
        let (rows_ptr, w_ptr) = (lists.ptr, lists.ptr + 4 * ids.len() as u64);
        // SAFETY: the buffer holds both lists; pageable sources are staged by the driver
        // before the calls return.
        unsafe {
            htod(self.dev(), self.stream(), rows_ptr, u32_bytes(&rows))?;
            htod(
                self.dev(),
                self.stream(),
                w_ptr,
                crate::backend::f32_bytes(&row_w),
            )?;
        }
        let esize = x.dtype.size() as u64;
        for e in 0..n_experts {
            let (a, b) = (start[e], start[e + 1]);
            let n = b - a;
            if n == 0 {
                continue;
            }
            // `[n, k] → [n, m]` through expert `e`'s slice of the stacked weights `w`.
            let expert = |w: &CudaTensor, input: &CudaTensor, output: &CudaTensor, (k, m)| {
                let we = w.ptr + (e * m * k) as u64 * esize;
                let dims = (n, k, m);
                let stream = self.stream();
                self.inner
                    .gemm
                    .linear(stream, x.dtype, input.ptr, we, None, output.ptr, dims)
            };
            let xs = self.gather_rows(x, rows_ptr + 4 * a as u64, n)?;
            let mut mid = self.tmp(&[n, inter], x.dtype)?;
            expert(&experts.up, &xs, &mid, (hidden, inter))?;
            self.activate(&mut mid, experts.act)?;
            let ys = self.tmp(&[n, hidden], x.dtype)?;
            expert(&experts.down, &mid, &ys, (inter, hidden))?;
            self.launch(
                "moe_scatter_add",
                x.dtype,
                n as u32,
                &[
                    Arg::Ptr(out.ptr),
                    Arg::Ptr(ys.ptr),
                    Arg::Ptr(rows_ptr + 4 * a as u64),
                    Arg::Ptr(w_ptr + 4 * a as u64),
                    Arg::U32(n as u32),
                    Arg::U32(hidden as u32),
                ],
            )?;
        }
        Ok(())
    }
}
