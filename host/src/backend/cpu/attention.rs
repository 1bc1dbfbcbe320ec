//! Paged causal attention on the CPU: writes the step's K/V into cache blocks, then attends;
//! and RoPE at the step's positions.
//!
//! The cache layout is `[num_blocks, block_size, kv_heads, head_dim]`; a sequence's token at
//! position `p` lives in block `block_table[p / block_size]`, row `p % block_size`.

use rayon::prelude::*;

use super::matmul::dot;
use super::{CpuBackend, CpuStep, CpuTensor, min_rows};
use crate::backend::{AttnShape, BackendError, KvLayer, Result, Rope, StepPlan, fp8};

pub(super) fn paged_attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    cache: &mut KvLayer<CpuTensor>,
    shape: AttnShape,
    plan: &StepPlan,
    out: &mut CpuTensor,
) -> Result<()> {
    let AttnShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    let block_size = plan.block_size.max(1);
    let kv_width = kv_heads * head_dim;
    let qcols = q.rows_cols().1;
    check_inputs(q, k, v, shape, plan, out)?;
    let rows = cache.k.data.len() / kv_width.max(1);

    // 1. Scatter this step's keys and values into their paged rows.
    write_kv(k, v, cache, plan, kv_width)?;
    let slot_index = |seq: usize, pos: usize| -> Result<usize> {
        let table = plan.block_table(seq);
        let block = *table.get(pos / block_size).ok_or_else(|| {
            BackendError::Invalid(format!(
                "block table of {} blocks does not cover position {pos}",
                table.len()
            ))
        })? as usize;
        let row = block * block_size + pos % block_size;
        if row >= rows {
            return Err(BackendError::Invalid(format!("KV row {row} out of {rows}")));
        }
        Ok(row)
    };

    // 2. Attend: each query token independently, over positions 0..=its own position.
    let group = heads / kv_heads;
    let (kc, vc) = (&cache.k.data, &cache.v.data);
    out.data
        .par_chunks_mut(qcols)
        .enumerate()
        .try_for_each(|(t, orow)| -> Result<()> {
            let si = plan.token_seq[t] as usize;
            let pos = plan.positions[t] as usize;
            let slots: Vec<usize> = (0..=pos)
                .map(|p| slot_index(si, p))
                .collect::<Result<_>>()?;
            let mut scores = vec![0.0f32; slots.len()];
            for h in 0..heads {
                let kvh = h / group;
                let qh = &q.data[t * qcols + h * head_dim..t * qcols + (h + 1) * head_dim];
                let mut max = f32::NEG_INFINITY;
                for (s, &slot) in scores.iter_mut().zip(&slots) {
                    let kb = slot * kv_width + kvh * head_dim;
                    *s = dot(qh, &kc[kb..kb + head_dim]) * scale;
                    max = max.max(*s);
                }
                let mut denom = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    denom += *s;
                }
                let oh = &mut orow[h * head_dim..(h + 1) * head_dim];
                for (s, &slot) in scores.iter().zip(&slots) {
                    let w = s / denom;
                    let vb = slot * kv_width + kvh * head_dim;
                    for (o, val) in oh.iter_mut().zip(&vc[vb..vb + head_dim]) {
                        *o += w * val;
                    }
                }
            }
            Ok(())
        })?;
    Ok(())
}

/// Checks the attention inputs against the shape, the output and the step.
fn check_inputs(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    shape: AttnShape,
    plan: &StepPlan,
    out: &CpuTensor,
) -> Result<()> {
    let AttnShape {
        heads,
        kv_heads,
        head_dim,
        ..
    } = shape;
    let kv_width = kv_heads * head_dim;
    let (n, qcols) = q.rows_cols();
    if qcols != heads * head_dim
        || k.rows_cols() != (n, kv_width)
        || v.rows_cols() != (n, kv_width)
        || out.data.len() != n * qcols
        || plan.slot_mapping.len() != n
    {
        return Err(BackendError::Invalid(format!(
            "attention inputs q {:?} k {:?} v {:?} do not match {heads}q/{kv_heads}kv × {head_dim} over {} tokens",
            q.shape,
            k.shape,
            v.shape,
            plan.slot_mapping.len()
        )));
    }
    if heads % kv_heads != 0 {
        return Err(BackendError::Invalid(format!(
            "{heads} query heads are not a multiple of {kv_heads} kv heads"
        )));
    }
    Ok(())
}

/// Writes the step's keys and values (`kv_width` wide) into their paged rows (the step's slot
/// mapping). An FP8 cache stores each value rounded through e4m3 at its scale (what a GPU's
/// FP8 cache reads back).
fn write_kv(
    k: &CpuTensor,
    v: &CpuTensor,
    cache: &mut KvLayer<CpuTensor>,
    plan: &StepPlan,
    kv_width: usize,
) -> Result<()> {
    let rows = cache.k.data.len() / kv_width.max(1);
    for (t, &slot) in plan.slot_mapping.iter().enumerate() {
        let slot = slot as usize;
        if slot >= rows {
            return Err(BackendError::Invalid(format!(
                "KV row {slot} out of {rows} (block table too short or block id out of range)"
            )));
        }
        let (dst, src) = (
            slot * kv_width..(slot + 1) * kv_width,
            t * kv_width..(t + 1) * kv_width,
        );
        cache.k.data[dst.clone()].copy_from_slice(&k.data[src.clone()]);
        cache.v.data[dst.clone()].copy_from_slice(&v.data[src]);
        if let Some(s) = cache.fp8 {
            fp8_round(&mut cache.k.data[dst.clone()], s.k);
            fp8_round(&mut cache.v.data[dst], s.v);
        }
    }
    Ok(())
}

/// Each value replaced by the e4m3 code of `value / scale`, times `scale` (saturating at
/// ±448 · scale).
fn fp8_round(values: &mut [f32], scale: f32) {
    for x in values {
        *x = fp8::e4m3_to_f32(fp8::f32_to_e4m3(*x / scale)) * scale;
    }
}

impl CpuBackend {
    pub(super) fn rope_in_place(
        &self,
        x: &mut CpuTensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &CpuStep,
    ) -> Result<()> {
        let positions = &step.plan.positions;
        let (n, cols) = x.rows_cols();
        if cols != heads * head_dim || n != positions.len() || rope.rotary_dim > head_dim {
            return Err(BackendError::Invalid(format!(
                "rope: x {:?}, {heads} heads × {head_dim}, {} positions",
                x.shape,
                positions.len()
            )));
        }
        let half = rope.rotary_dim / 2;
        x.data
            .par_chunks_mut(cols.max(1))
            .zip(positions.par_iter())
            .with_min_len(min_rows(cols))
            .for_each(|(row, &pos)| {
                let p = pos as f32;
                for i in 0..half {
                    let angle = rope.inv_freq[i] * p;
                    let (s, c) = angle.sin_cos();
                    let (s, c) = (s * rope.attention_scaling, c * rope.attention_scaling);
                    for h in 0..heads {
                        let base = h * head_dim;
                        let x1 = row[base + i];
                        let x2 = row[base + i + half];
                        row[base + i] = x1 * c - x2 * s;
                        row[base + i + half] = x2 * c + x1 * s;
                    }
                }
            });
        Ok(())
    }

    pub(super) fn write_kv_and_attend(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut KvLayer<CpuTensor>,
        shape: AttnShape,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        let mut out = self.tmp_zeroed(&q.shape);
        paged_attention(q, k, v, cache, shape, &step.plan, &mut out)?;
        Ok(out)
    }
}
