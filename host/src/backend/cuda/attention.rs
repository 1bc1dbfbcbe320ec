//! Paged attention on the CUDA backend: RoPE (alone, or fused into the KV write), the write of
//! this step's K and V into their paged rows, and the launches the attention planner of
//! `chimera_kernels::attention` picks for the step (decode, split-KV or prefill tiles), their
//! symbolic arguments mapped to device addresses here. Rotary tables are uploaded once per
//! set of frequencies and kept.

use chimera_kernels::attention::{AttnArg, AttnDims};

use super::device::Arg;
use super::memory::{DevAlloc, htod, sync};
use super::{CudaBackend, CudaStep, CudaTensor, scratch_arg};
use crate::backend::{AttnShape, BackendError, DType, KvLayer, Result, Rope};

impl CudaBackend {
    pub(super) fn rope_in_place(
        &self,
        x: &mut CudaTensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &CudaStep,
    ) -> Result<()> {
        self.step_ready(step)?;
        let (n, cols) = x.rows_cols();
        if cols != heads * head_dim || n != step.dims.tokens || rope.rotary_dim > head_dim {
            return Err(BackendError::Invalid(format!(
                "rope: x {:?}, {heads} heads × {head_dim}, {} positions",
                x.shape, step.dims.tokens
            )));
        }
        let table = self.rope_table(rope)?;
        self.launch(
            "rope",
            x.dtype,
            n as u32,
            &[
                Arg::Ptr(x.ptr),
                Arg::U32(n as u32),
                Arg::U32(heads as u32),
                Arg::U32(head_dim as u32),
                Arg::U32((rope.rotary_dim / 2) as u32),
                Arg::Ptr(step.col(step.cols.positions)),
                Arg::Ptr(table),
                Arg::F32(rope.attention_scaling),
                Arg::U32(cols as u32),
            ],
        )
    }

    pub(super) fn write_kv_and_attend(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &mut KvLayer<CudaTensor>,
        shape: AttnShape,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.check_attention(q, k, v, cache, shape, step)?;
        let n = step.dims.tokens;
        let kv_width = shape.kv_heads * shape.head_dim;
        let mut args = kv_write_args(cache, (k.ptr, v.ptr), step, n);
        args.extend([Arg::U32(kv_width as u32), Arg::U64(cache_rows(cache))]);
        let name = kv_write_entry(["kv_write", "kv_write_fp8"], cache, &mut args);
        self.launch(name, q.dtype, n as u32, &args)?;
        self.attend(q, cache, shape, step)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_write_kv_and_attend(
        &self,
        q: CudaTensor,
        k: CudaTensor,
        v: &CudaTensor,
        cache: &mut KvLayer<CudaTensor>,
        shape: AttnShape,
        rope: &Rope,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.check_attention(&q, &k, v, cache, shape, step)?;
        if rope.rotary_dim > shape.head_dim {
            return Err(BackendError::Invalid(format!(
                "rope: rotary dim {} > head dim {}",
                rope.rotary_dim, shape.head_dim
            )));
        }
        let n = step.dims.tokens;
        let table = self.rope_table(rope)?;
        let mut args = kv_write_args(cache, (k.ptr, v.ptr), step, n);
        args.extend([
            Arg::U32(shape.kv_heads as u32),
            Arg::U32(shape.head_dim as u32),
            Arg::U32((rope.rotary_dim / 2) as u32),
            Arg::Ptr(step.col(step.cols.positions)),
            Arg::Ptr(table),
            Arg::F32(rope.attention_scaling),
            Arg::U64(cache_rows(cache)),
            Arg::Ptr(q.ptr),
            Arg::U32(shape.heads as u32),
        ]);
        let name = kv_write_entry(["rope_kv_write", "rope_kv_write_fp8"], cache, &mut args);
        self.launch(name, q.dtype, n as u32, &args)?;
        self.attend(&q, cache, shape, step)
    }

    fn rope_table(&self, rope: &Rope) -> Result<u64> {
        // Looked up by the frequencies' bits without building a key: this runs per layer.
        let bits = f32_bits(&rope.inv_freq);
        let mut ropes = self.inner.ropes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = ropes.get(bits) {
            return Ok(b.ptr);
        }
        let key = bits.to_vec();
        let buf = DevAlloc::new(self.dev(), 4 * key.len(), &self.inner.stats)?;
        let bytes = crate::backend::f32_bytes(&rope.inv_freq);
        // SAFETY: the buffer holds exactly these bytes; the source is synchronised below.
        unsafe { htod(self.dev(), self.stream(), buf.ptr, bytes)? };
        sync(self.dev(), self.stream())?;
        let ptr = buf.ptr;
        ropes.insert(key, buf);
        Ok(ptr)
    }

    fn check_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &KvLayer<CudaTensor>,
        shape: AttnShape,
        step: &CudaStep,
    ) -> Result<()> {
        self.step_ready(step)?;
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
            ..
        } = shape;
        let n = step.dims.tokens;
        let kv_width = kv_heads * head_dim;
        if q.rows_cols() != (n, heads * head_dim)
            || k.rows_cols() != (n, kv_width)
            || v.rows_cols() != (n, kv_width)
            || heads % kv_heads.max(1) != 0
            || cache.k.shape.len() != 4
            || cache.k.shape[2] * cache.k.shape[3] != kv_width
            || cache.v.shape != cache.k.shape
        {
            return Err(BackendError::Invalid(format!(
                "attention inputs q {:?} k {:?} v {:?} cache {:?} do not match {heads}q/{kv_heads}kv × {head_dim} over {n} tokens",
                q.shape, k.shape, v.shape, cache.k.shape
            )));
        }
        for t in [q, k, v] {
            self.check_dtype("attention", t)?;
        }
        for t in [&cache.k, &cache.v] {
            match cache.fp8 {
                None => self.check_dtype("attention cache", t)?,
                Some(_) if t.dtype == DType::F8E4M3 => {}
                Some(_) => {
                    return Err(BackendError::Invalid(format!(
                        "attention: an FP8 cache holds {:?} tensors",
                        t.dtype
                    )));
                }
            }
        }
        Ok(())
    }

    /// Attention of every query over its sequence's cached keys (this step's already written).
    fn attend(
        &self,
        q: &CudaTensor,
        cache: &KvLayer<CudaTensor>,
        shape: AttnShape,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
            scale,
        } = shape;
        let out = self.tmp(&q.shape, q.dtype)?;
        let dims = AttnDims {
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            block_size: step.dims.block_size as u32,
            num_seqs: step.dims.seqs as u32,
            kv_fp8: cache.fp8.is_some(),
        };
        let scales = cache.fp8.unwrap_or_default();
        let bf16 = q.dtype == DType::BF16;
        let attn_err =
            |e: chimera_kernels::attention::AttnError| BackendError::Invalid(e.to_string());
        let launches =
            chimera_kernels::attention::launches(&step.attn, dims, bf16, self.prefill_kernel())
                .map_err(attn_err)?;
        let scratch: Vec<CudaTensor> = chimera_kernels::attention::scratch_bytes(&step.attn, dims)
            .into_iter()
            .map(|b| self.tmp(&[b.div_ceil(4).max(1)], DType::F32))
            .collect::<Result<_>>()?;
        self.run_launches(launches, |a| {
            Ok(match *a {
                AttnArg::Q => Arg::Ptr(q.ptr),
                AttnArg::KCache => Arg::Ptr(cache.k.ptr),
                AttnArg::VCache => Arg::Ptr(cache.v.ptr),
                AttnArg::Out => Arg::Ptr(out.ptr),
                AttnArg::CuSeqlens => Arg::Ptr(step.col(step.cols.cu_seqlens)),
                AttnArg::CtxLens => Arg::Ptr(step.col(step.cols.ctx_lens)),
                AttnArg::BtOffsets => Arg::Ptr(step.col(step.cols.bt_offsets)),
                AttnArg::BlockTables => Arg::Ptr(step.col(step.cols.block_tables)),
                AttnArg::Work(c) => Arg::Ptr(step.attn_col(c)),
                AttnArg::Scratch(i) => scratch_arg(&scratch, i, "attention")?,
                AttnArg::U32(v) => Arg::U32(v),
                AttnArg::F32Scale => Arg::F32(scale),
                AttnArg::KScale => Arg::F32(scales.k),
                AttnArg::VScale => Arg::F32(scales.v),
            })
        })?;
        Ok(out)
    }
}

/// The write kernel for `cache`: `[plain, fp8]`'s first, or its FP8 twin with the cache's K
/// and V scales appended to `args`.
fn kv_write_entry(
    [plain, fp8]: [&'static str; 2],
    cache: &KvLayer<CudaTensor>,
    args: &mut Vec<Arg>,
) -> &'static str {
    match cache.fp8 {
        Some(s) => {
            args.extend([Arg::F32(s.k), Arg::F32(s.v)]);
            fp8
        }
        None => plain,
    }
}

fn cache_rows(cache: &KvLayer<CudaTensor>) -> u64 {
    (cache.k.shape[0] * cache.k.shape[1]) as u64
}

/// An f32 slice's bit patterns as u32 (same size and alignment; no copy).
fn f32_bits(v: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is a valid u32.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u32>(), v.len()) }
}

/// The leading arguments of the paged KV writes: the cache's K and V, the new rows of `k` and
/// `v` (device pointers), the step's slot mapping and its token count `n`.
fn kv_write_args(
    cache: &KvLayer<CudaTensor>,
    (k, v): (u64, u64),
    step: &CudaStep,
    n: usize,
) -> Vec<Arg> {
    vec![
        Arg::Ptr(cache.k.ptr),
        Arg::Ptr(cache.v.ptr),
        Arg::Ptr(k),
        Arg::Ptr(v),
        Arg::Ptr(step.col(step.cols.slot_mapping)),
        Arg::U32(n as u32),
    ]
}
