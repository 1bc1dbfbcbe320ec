//! Paged causal attention on the CPU: writes the step's K/V into cache blocks, then attends.
//!
//! The cache layout is `[num_blocks, block_size, kv_heads, head_dim]`; a sequence's token at
//! position `p` lives in block `block_table[p / block_size]`, row `p % block_size`.

use rayon::prelude::*;

use super::CpuTensor;
use crate::backend::{AttnShape, BackendError, KvLayer, Result};
use crate::model::SeqChunk;

fn slot_index(seq: &SeqChunk, pos: usize, block_size: usize, num_blocks: usize) -> Result<usize> {
    let block = *seq.block_table.get(pos / block_size).ok_or_else(|| {
        BackendError::Invalid(format!(
            "block table of {} blocks does not cover position {pos}",
            seq.block_table.len()
        ))
    })? as usize;
    if block >= num_blocks {
        return Err(BackendError::Invalid(format!(
            "block id {block} out of {num_blocks}"
        )));
    }
    Ok(block * block_size + pos % block_size)
}

pub(super) fn paged_attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    cache: &mut KvLayer<CpuTensor>,
    block_size: usize,
    shape: AttnShape,
    seqs: &[SeqChunk],
) -> Result<CpuTensor> {
    let AttnShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    let kv_width = kv_heads * head_dim;
    let (n, qcols) = q.rows_cols();
    if qcols != heads * head_dim || k.rows_cols() != (n, kv_width) || v.rows_cols() != (n, kv_width)
    {
        return Err(BackendError::Invalid(format!(
            "attention inputs q {:?} k {:?} v {:?} do not match {heads}q/{kv_heads}kv × {head_dim}",
            q.shape, k.shape, v.shape
        )));
    }
    if heads % kv_heads != 0 {
        return Err(BackendError::Invalid(format!(
            "{heads} query heads are not a multiple of {kv_heads} kv heads"
        )));
    }
    let num_blocks = cache.k.shape.first().copied().unwrap_or(0);

    // 1. Scatter this step's keys and values into their paged slots.
    let mut token_seq = vec![0usize; n];
    for (si, seq) in seqs.iter().enumerate() {
        if seq.offset + seq.len > n {
            return Err(BackendError::Invalid(
                "sequence chunk exceeds the batch".into(),
            ));
        }
        for i in 0..seq.len {
            let t = seq.offset + i;
            token_seq[t] = si;
            let slot = slot_index(seq, seq.context_len + i, block_size, num_blocks)?;
            cache.k.data[slot * kv_width..(slot + 1) * kv_width]
                .copy_from_slice(&k.data[t * kv_width..(t + 1) * kv_width]);
            cache.v.data[slot * kv_width..(slot + 1) * kv_width]
                .copy_from_slice(&v.data[t * kv_width..(t + 1) * kv_width]);
        }
    }

    // 2. Attend: each query token independently, over positions 0..=its own position.
    let group = heads / kv_heads;
    let (kc, vc) = (&cache.k.data, &cache.v.data);
    let mut out = vec![0.0f32; n * qcols];
    out.par_chunks_mut(qcols)
        .enumerate()
        .try_for_each(|(t, orow)| -> Result<()> {
            let seq = &seqs[token_seq[t]];
            let pos = seq.context_len + (t - seq.offset);
            let slots: Vec<usize> = (0..=pos)
                .map(|p| slot_index(seq, p, block_size, num_blocks))
                .collect::<Result<_>>()?;
            let mut scores = vec![0.0f32; slots.len()];
            for h in 0..heads {
                let kvh = h / group;
                let qh = &q.data[t * qcols + h * head_dim..t * qcols + (h + 1) * head_dim];
                let mut max = f32::NEG_INFINITY;
                for (s, &slot) in scores.iter_mut().zip(&slots) {
                    let kb = slot * kv_width + kvh * head_dim;
                    let dot: f32 = qh
                        .iter()
                        .zip(&kc[kb..kb + head_dim])
                        .map(|(a, b)| a * b)
                        .sum();
                    *s = dot * scale;
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
    CpuTensor::new(out, &[n, qcols])
}
