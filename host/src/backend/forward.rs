//! [`forward!`]: writes trait methods of [`super::Backend`], [`super::LayerOps`] and
//! [`super::StepBackend`] whose body is one call with the method's own arguments, from a list
//! of method names. It owns the one copy of the traits' signatures that those bodies need
//! (the traits in `backend/mod.rs` keep the docs; the compiler holds the two to each other in
//! every impl that uses this).
//!
//! Its forms, each written inside an `impl` block of one of the traits:
//! - `forward! { self.inner => name, upload, … }`: the methods named, each calling the same
//!   method of the receiver (`fn upload(&self, host) { self.inner.upload(host) }`).
//! - `forward! { self => upload -> upload_host, … }`: a method forwarded to another method of
//!   the receiver (`self.upload_host(host)`); `m` alone forwards to the same name.
//! - `forward! { self.inner, first self.kernel() => linear, … }`: runs the expression before
//!   each call (a count).
//! - `forward! { composed(self) => add_rms_norm, … }`: `composed::add_rms_norm(self, …)`, a
//!   function of a module taking the backend first.
//!
//! It writes no method that does anything but forward: a method with its own logic is written
//! out beside the macro in the impl.

/// See the module docs.
macro_rules! forward {
    ($s:ident $(. $field:ident)* $(, first $pre:expr)? => $($list:tt)*) => {
        forward!(@each [method [$s $(. $field)*] [$($pre)?]] $($list)*);
    };
    ($module:ident ($s:ident) => $($list:tt)*) => {
        forward!(@each [function [$s $module] []] $($list)*);
    };
    (@each $how:tt $($m:ident $(-> $t:ident)?),* $(,)?) => {
        $( forward!(@one $how $m $($t)?); )*
    };
    (@one $how:tt $m:ident) => {
        forward!(@sig $m [$m $how]);
    };
    (@one $how:tt $m:ident $t:ident) => {
        forward!(@sig $m [$t $how]);
    };

    // The body: `recv.t(args…)`, or `module::t(self, args…)`.
    (@emit [$t:ident [method [$s:ident $($recv:tt)*] [$($pre:expr)?]]]
        $m:ident [$($g:tt)*] ($($a:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        fn $m $($g)* (&$s, $($a: $ty),*) $(-> $ret)? {
            $($pre;)?
            $s $($recv)* . $t($($a),*)
        }
    };
    (@emit [$t:ident [function [$s:ident $module:ident] []]]
        $m:ident [$($g:tt)*] ($($a:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        fn $m $($g)* (&$s, $($a: $ty),*) $(-> $ret)? {
            $module::$t($s, $($a),*)
        }
    };

    // The signatures, in the traits' order: `name [generics] (arguments) -> return`.
    // Backend
    (@sig name $h:tt) => {
        forward!(@emit $h name [] () -> &'static str);
    };
    (@sig act_dtype $h:tt) => {
        forward!(@emit $h act_dtype [] () -> $crate::backend::DType);
    };
    (@sig is_lost $h:tt) => {
        forward!(@emit $h is_lost [] () -> bool);
    };
    (@sig bf16_ssm_state $h:tt) => {
        forward!(@emit $h bf16_ssm_state [] () -> bool);
    };
    (@sig upload $h:tt) => {
        forward!(@emit $h upload [] (
            host: $crate::backend::HostTensor<'_>
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig upload_fp8 $h:tt) => {
        forward!(@emit $h upload_fp8 [] (
            w: $crate::backend::fp8::Fp8Weight<'_>
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig quantize_fp8 $h:tt) => {
        forward!(@emit $h quantize_fp8 [] (w: &Self::Tensor) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig download $h:tt) => {
        forward!(@emit $h download [] (t: &Self::Tensor) -> $crate::backend::Result<Vec<f32>>);
    };
    (@sig shape $h:tt) => {
        forward!(@emit $h shape [<'a>] (t: &'a Self::Tensor) -> &'a [usize]);
    };
    (@sig dtype $h:tt) => {
        forward!(@emit $h dtype [] (t: &Self::Tensor) -> $crate::backend::DType);
    };
    (@sig zeros $h:tt) => {
        forward!(@emit $h zeros [] (
            shape: &[usize], dtype: $crate::backend::DType
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig copy_into $h:tt) => {
        forward!(@emit $h copy_into [] (
            src: &Self::Tensor, dst: &mut Self::Tensor
        ) -> $crate::backend::Result<()>);
    };
    (@sig fill_dummy $h:tt) => {
        forward!(@emit $h fill_dummy [] (
            t: &mut Self::Tensor, seed: u64, std: f32, mean: f32
        ) -> $crate::backend::Result<()>);
    };

    // LayerOps
    (@sig set_ssm_chunk_size $h:tt) => {
        forward!(@emit $h set_ssm_chunk_size [] (chunk: usize));
    };
    (@sig zeros_like $h:tt) => {
        forward!(@emit $h zeros_like [] (
            x: &Self::Tensor
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig embedding $h:tt) => {
        forward!(@emit $h embedding [] (
            table: &Self::Tensor, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig linear $h:tt) => {
        forward!(@emit $h linear [] (
            x: &Self::Tensor, w: &Self::Tensor, bias: Option<&Self::Tensor>
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig linear_shared $h:tt) => {
        forward!(@emit $h linear_shared [] (
            x: &Self::Tensor, weights: &[(&Self::Tensor, Option<&Self::Tensor>)]
        ) -> $crate::backend::Result<Vec<Self::Tensor>>);
    };
    (@sig gated_linear $h:tt) => {
        forward!(@emit $h gated_linear [] (
            x: &Self::Tensor, gate: (&Self::Tensor, Option<&Self::Tensor>),
            up: (&Self::Tensor, Option<&Self::Tensor>), act: $crate::backend::Activation
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig linear_activated $h:tt) => {
        forward!(@emit $h linear_activated [] (
            x: &Self::Tensor, w: &Self::Tensor, bias: Option<&Self::Tensor>,
            act: $crate::backend::Activation
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig add_assign $h:tt) => {
        forward!(@emit $h add_assign [] (
            x: &mut Self::Tensor, y: &Self::Tensor
        ) -> $crate::backend::Result<()>);
    };
    (@sig scale_assign $h:tt) => {
        forward!(@emit $h scale_assign [] (
            x: &mut Self::Tensor, s: f32
        ) -> $crate::backend::Result<()>);
    };
    (@sig rms_norm $h:tt) => {
        forward!(@emit $h rms_norm [] (
            x: &Self::Tensor, w: &Self::Tensor, eps: f32
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig add_rms_norm $h:tt) => {
        forward!(@emit $h add_rms_norm [] (
            residual: &mut Self::Tensor, delta: &Self::Tensor, w: &Self::Tensor, eps: f32
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig gated_rms_norm $h:tt) => {
        forward!(@emit $h gated_rms_norm [] (
            x: &Self::Tensor, gate: &Self::Tensor, w: &Self::Tensor, group: usize, eps: f32
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig activate $h:tt) => {
        forward!(@emit $h activate [] (
            x: &mut Self::Tensor, act: $crate::backend::Activation
        ) -> $crate::backend::Result<()>);
    };
    (@sig gated_activation $h:tt) => {
        forward!(@emit $h gated_activation [] (
            gate: &Self::Tensor, up: &Self::Tensor, act: $crate::backend::Activation
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig split_cols $h:tt) => {
        forward!(@emit $h split_cols [<const N: usize>] (
            x: &Self::Tensor, widths: [usize; N]
        ) -> $crate::backend::Result<[Self::Tensor; N]>);
    };
    (@sig gather_logit_rows $h:tt) => {
        forward!(@emit $h gather_logit_rows [] (
            x: &Self::Tensor, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig apply_rope $h:tt) => {
        forward!(@emit $h apply_rope [] (
            x: &mut Self::Tensor, heads: usize, head_dim: usize, rope: &$crate::backend::Rope,
            step: &Self::Step
        ) -> $crate::backend::Result<()>);
    };
    (@sig paged_attention $h:tt) => {
        forward!(@emit $h paged_attention [] (
            q: &Self::Tensor, k: &Self::Tensor, v: &Self::Tensor,
            cache: &mut $crate::backend::KvLayer<Self::Tensor>, shape: $crate::backend::AttnShape,
            step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig rope_paged_attention $h:tt) => {
        forward!(@emit $h rope_paged_attention [] (
            q: Self::Tensor, k: Self::Tensor, v: &Self::Tensor,
            cache: &mut $crate::backend::KvLayer<Self::Tensor>, shape: $crate::backend::AttnShape,
            rope: &$crate::backend::Rope, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig ssm_slot_ops $h:tt) => {
        forward!(@emit $h ssm_slot_ops [] (
            pools: &mut $crate::backend::SsmPools<Self::Tensor>, step: &Self::Step
        ) -> $crate::backend::Result<()>);
    };
    (@sig causal_conv1d $h:tt) => {
        forward!(@emit $h causal_conv1d [] (
            x: &Self::Tensor, weight: &Self::Tensor, bias: Option<&Self::Tensor>,
            pools: &mut $crate::backend::SsmPools<Self::Tensor>, layer: usize, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig ssm_scan $h:tt) => {
        forward!(@emit $h ssm_scan [] (
            x: &$crate::backend::SsmOperands<'_, Self::Tensor>, shape: $crate::backend::SsmShape,
            pools: &mut $crate::backend::SsmPools<Self::Tensor>, layer: usize, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig mamba2_mix $h:tt) => {
        forward!(@emit $h mamba2_mix [] (
            zxbcdt: &Self::Tensor, m: &$crate::backend::Mamba2Mix<'_, Self::Tensor>,
            pools: &mut $crate::backend::SsmPools<Self::Tensor>, layer: usize, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig head_rms_norm $h:tt) => {
        forward!(@emit $h head_rms_norm [] (
            x: &Self::Tensor, w: &Self::Tensor, head_dim: usize, eps: f32
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig sigmoid_gate $h:tt) => {
        forward!(@emit $h sigmoid_gate [] (
            x: &mut Self::Tensor, gate: &Self::Tensor
        ) -> $crate::backend::Result<()>);
    };
    (@sig gated_delta_rule $h:tt) => {
        forward!(@emit $h gated_delta_rule [] (
            x: &$crate::backend::GdnOperands<'_, Self::Tensor>, shape: $crate::backend::GdnShape,
            pools: &mut $crate::backend::SsmPools<Self::Tensor>, layer: usize, step: &Self::Step
        ) -> $crate::backend::Result<Self::Tensor>);
    };
    (@sig moe $h:tt) => {
        forward!(@emit $h moe [] (
            x: &Self::Tensor, router_logits: &Self::Tensor,
            routing: &$crate::backend::MoeRouting<Self::Tensor>,
            experts: &$crate::backend::StackedExperts<Self::Tensor>, out: &mut Self::Tensor
        ) -> $crate::backend::Result<()>);
    };

    // StepBackend
    (@sig new_step $h:tt) => {
        forward!(@emit $h new_step [] (max_tokens: usize) -> $crate::backend::Result<Self::Step>);
    };
    (@sig upload_step $h:tt) => {
        forward!(@emit $h upload_step [] (
            plan: &$crate::backend::StepPlan, step: &mut Self::Step
        ) -> $crate::backend::Result<()>);
    };
    (@sig arena_stats $h:tt) => {
        forward!(@emit $h arena_stats [] () -> $crate::backend::ArenaStats);
    };
    (@sig applies_token_masks $h:tt) => {
        forward!(@emit $h applies_token_masks [] () -> bool);
    };
    (@sig packs_ahead $h:tt) => {
        forward!(@emit $h packs_ahead [] () -> bool);
    };
    (@sig pack_step $h:tt) => {
        forward!(@emit $h pack_step [] (
            plan: &$crate::backend::StepPlan, step: &mut Self::Step,
            bucket: Option<$crate::backend::GraphBucket>, max_blocks: usize
        ) -> $crate::backend::Result<bool>);
    };
    (@sig repack_tokens $h:tt) => {
        forward!(@emit $h repack_tokens [] (
            plan: &$crate::backend::StepPlan, step: &mut Self::Step
        ) -> $crate::backend::Result<()>);
    };
    (@sig send_masks $h:tt) => {
        forward!(@emit $h send_masks [] (
            plan: &$crate::backend::StepPlan, step: &mut Self::Step
        ) -> $crate::backend::Result<()>);
    };
    (@sig hold_tail $h:tt) => {
        forward!(@emit $h hold_tail [] () -> $crate::backend::Result<()>);
    };
    (@sig send_step $h:tt) => {
        forward!(@emit $h send_step [] (step: &mut Self::Step) -> $crate::backend::Result<()>);
    };
    (@sig graph_buckets $h:tt) => {
        forward!(@emit $h graph_buckets [] (
            max_batch: usize, max_tokens: usize
        ) -> Vec<$crate::backend::GraphBucket>);
    };
    (@sig upload_graph_step $h:tt) => {
        forward!(@emit $h upload_graph_step [] (
            plan: &$crate::backend::StepPlan, step: &mut Self::Step,
            bucket: $crate::backend::GraphBucket, max_blocks: usize
        ) -> $crate::backend::Result<bool>);
    };
    (@sig capture_graph $h:tt) => {
        forward!(@emit $h capture_graph [] (
            run: &mut dyn FnMut() -> $crate::backend::Result<()>
        ) -> $crate::backend::Result<usize>);
    };
    (@sig replay_graph $h:tt) => {
        forward!(@emit $h replay_graph [] (id: usize) -> $crate::backend::Result<()>);
    };
    (@sig step_clock_start $h:tt) => {
        forward!(@emit $h step_clock_start [] () -> $crate::backend::Result<()>);
    };
    (@sig step_clock_end $h:tt) => {
        forward!(@emit $h step_clock_end []
            () -> $crate::backend::Result<Option<$crate::backend::DeviceStepTime>>);
    };
    (@sig sample $h:tt) => {
        forward!(@emit $h sample [] (
            logits: &mut Self::Tensor, step: &Self::Step, out: &mut $crate::backend::SampleOut
        ) -> $crate::backend::Result<()>);
    };
    (@sig sample_start $h:tt) => {
        forward!(@emit $h sample_start [] (
            logits: &mut Self::Tensor, step: &Self::Step, out: &mut $crate::backend::SampleOut
        ) -> $crate::backend::Result<()>);
    };
    (@sig sample_finish $h:tt) => {
        forward!(@emit $h sample_finish [] (
            out: &mut $crate::backend::SampleOut
        ) -> $crate::backend::Result<()>);
    };
    (@sig sample_ready $h:tt) => {
        forward!(@emit $h sample_ready [] () -> bool);
    };
}

pub(crate) use forward;

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use crate::backend::cpu::{CpuBackend, CpuTensor};
    use crate::backend::{Backend, DType, HostTensor};

    /// A wrapper written with the macro alone: each call counted, then forwarded.
    struct Probe {
        inner: CpuBackend,
        calls: AtomicU32,
    }

    impl Backend for Probe {
        type Tensor = CpuTensor;

        forward! { self.inner, first self.calls.fetch_add(1, Ordering::Relaxed) =>
            name, act_dtype, is_lost, bf16_ssm_state, upload, upload_fp8, quantize_fp8,
            download, shape, dtype, zeros, copy_into, fill_dummy,
        }
    }

    #[test]
    fn a_listed_method_calls_its_target_with_its_arguments() {
        let probe = Probe {
            inner: CpuBackend::default(),
            calls: AtomicU32::new(0),
        };
        let cpu = &probe.inner;
        assert_eq!(probe.name(), "cpu");
        let values = [1.0, -2.0, 3.5, 0.25];
        let t = probe
            .upload(HostTensor::f32(&values, &[2, 2]))
            .expect("upload");
        assert_eq!(probe.shape(&t), &[2, 2]);
        assert_eq!(probe.download(&t).expect("download"), values);

        // Arguments in order: a swapped seed, std or mean would fill other values.
        let mut via_probe = probe.zeros(&[3, 5], DType::F32).expect("zeros");
        let mut direct = cpu.zeros(&[3, 5], DType::F32).expect("zeros");
        probe
            .fill_dummy(&mut via_probe, 7, 0.5, 0.125)
            .expect("fill");
        cpu.fill_dummy(&mut direct, 7, 0.5, 0.125).expect("fill");
        let (a, b) = (probe.download(&via_probe), cpu.download(&direct));
        assert_eq!(a.expect("download"), b.expect("download"));
        let mut copy = probe.zeros(&[3, 5], DType::F32).expect("zeros");
        probe.copy_into(&via_probe, &mut copy).expect("copy");
        assert_eq!(copy.shape, via_probe.shape);
        assert_eq!(probe.download(&copy), cpu.download(&direct));
        assert_eq!(probe.calls.load(Ordering::Relaxed), 10);
    }
}
