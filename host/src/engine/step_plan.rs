//! The one place the engine turns a step's schedule into the backend's [`StepPlan`]: each
//! scheduled chunk's tokens, its block table and live SSM slot, its snapshot targets, the SSM
//! restores and zeros of newly admitted requests, and the per-row sampling inputs. The plan is
//! the engine's persistent batch: its buffers are cleared and refilled every step, never
//! reallocated once warm. The plan's own invariants are tested in `backend::step`; this
//! builder's mapping from scheduler and cache state is tested below.
//!
//! A step scheduled while the one before it computes decodes tokens that step is still
//! sampling: each such token is a placeholder in the plan, listed in [`Built::placeholders`]
//! and filled in by [`fill_placeholders`] once the tokens are sampled, before the launch. The
//! mask of a constrained row whose previous token is such a placeholder is left for later
//! ([`Built::late_masks`]) where the executor takes masks after the forward pass: it is
//! computed by [`fill_late_masks`] while that pass runs, on the constraint lanes' threads with
//! the step's other masks. A constrained row with no token in flight (its prompt's end) goes
//! the same way there, so that no mask is computed one at a time on the engine thread.

use super::request::{Phase, Request};
use super::sampling::{RowInfo, SamplingStage};
use super::scheduler::{ScheduledSeq, Scheduler, SchedulerOutput};
use crate::backend::{PlanError, SlotOp, StepPlan};
use crate::cache::{CacheManager, SsmInit};
use crate::policy::{Constrainer, MaskJob};

/// A plan's token that the step before it is still sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placeholder {
    /// Index into the plan's `tokens`.
    pub at: usize,
    /// The request's scheduler slot.
    pub slot: u32,
}

/// A constrained row's mask that waits for the token before it ([`fill_late_masks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LateMask {
    /// Where the row's mask starts in the plan's `sampling.masks`.
    pub at: usize,
    /// The request's scheduler slot.
    pub slot: u32,
}

/// What [`build`] made of the step.
#[derive(Debug, Default)]
pub struct Built {
    /// Prompt tokens the step computes (for the engine's counters).
    pub prompt_tokens: u64,
    /// Tokens to fill in before the launch.
    pub placeholders: Vec<Placeholder>,
    /// A sampled row's penalty history or constraint lacks a token still being sampled: the
    /// plan must be built again once it is known.
    pub history_incomplete: bool,
    /// Constrained requests whose constraint failed while the plan was built (request id and
    /// why); their rows carry no mask, and the engine fails them.
    pub constraint_failures: Vec<(u64, String)>,
    /// Masks of constrained rows, computed in one batch ([`fill_late_masks`]) once every
    /// token they follow is known: after the launched step is applied where the plan allows
    /// late masks (each row allows every token until then), else by [`build`] itself.
    pub late_masks: Vec<LateMask>,
}

impl Built {
    /// Empty, its buffers kept.
    fn clear(&mut self) {
        self.prompt_tokens = 0;
        self.placeholders.clear();
        self.history_incomplete = false;
        self.constraint_failures.clear();
        self.late_masks.clear();
    }
}

/// Fills `plan` for `out`, the step the scheduler planned last. `late_masks`: a constrained
/// row whose previous token is being sampled gets its mask later ([`Built::late_masks`])
/// instead of making the plan wait for that token ([`Built::history_incomplete`]).
#[allow(clippy::too_many_arguments)]
pub fn build(
    plan: &mut StepPlan,
    block_size: usize,
    out: &SchedulerOutput,
    sched: &Scheduler,
    cache: &CacheManager,
    sampling: &SamplingStage,
    constraints: Option<(&mut (dyn Constrainer + '_), usize)>,
    late_masks: bool,
    built: &mut Built,
) -> Result<(), PlanError> {
    plan.clear(block_size);
    plan.sampling.clear(sampling.k());
    built.clear();
    // The constraint, and its mask words per row.
    let (constraints, words) = match constraints {
        Some((c, words)) => (Some(c), words),
        None => (None, 0),
    };
    for s in &out.seqs {
        let r = sched
            .request(s.slot)
            .ok_or_else(|| PlanError(format!("scheduled slot {} holds no request", s.slot)))?;
        if s.drafts > 0 {
            push_verify(plan, s, r, cache)?;
        } else {
            let words = constraints.is_some().then_some(words);
            push_chunk(plan, built, (s, r), cache, words, late_masks)?;
        }
        for snap in &s.snapshots {
            plan.snapshot(snap.after, snap.slot);
        }
    }
    // Launched whole: the masks of rows with nothing in flight are due now, computed at once
    // (on the constraint lanes' threads).
    if !late_masks
        && !built.late_masks.is_empty()
        && let Some(c) = constraints
    {
        fill_late_masks(plan, built, sched, c, words);
        built.late_masks.clear();
    }
    push_slot_ops(plan, out);
    plan.finish()?;
    Ok(())
}

/// The chunk of a scheduled sequence without drafts: its tokens (a placeholder for the one
/// being sampled) and its sampled row. `words`: the constraint mask's words per
/// row when the step has a constraint.
fn push_chunk(
    plan: &mut StepPlan,
    built: &mut Built,
    (s, r): (&ScheduledSeq, &Request),
    cache: &CacheManager,
    words: Option<usize>,
    late_masks: bool,
) -> Result<(), PlanError> {
    let known = r.tokens.len().clamp(s.start, s.start + s.len);
    let missing = s.start + s.len - known;
    if missing > 1 || missing == 1 && s.len != 1 {
        return Err(PlanError(format!(
            "slot {}: a chunk of {} tokens from {} past the {} known",
            s.slot,
            s.len,
            s.start,
            r.tokens.len()
        )));
    }
    let at = plan.tokens.len();
    let tokens: &[u32] = if missing == 1 {
        built.placeholders.push(Placeholder { at, slot: s.slot });
        &[0]
    } else {
        &r.tokens[s.start..s.start + s.len]
    };
    let chunk = plan.push(
        tokens,
        s.start,
        cache.block_table(s.slot),
        cache.live_slot(s.slot),
        s.want_logits,
    );
    chunk.all_logits = s.all_logits;
    if s.want_logits {
        push_sampled_row(
            plan,
            built,
            r,
            s.slot,
            words.is_some(),
            words.unwrap_or(0),
            late_masks,
        );
    }
    if s.start < r.prompt_len {
        built.prompt_tokens += (s.start + s.len).min(r.prompt_len) as u64 - s.start as u64;
    }
    Ok(())
}

/// The SSM slot operations of the step: each scheduled chunk's state init (zero, or restore
/// from a snapshot). (A speculative rollback copies nothing: the draft slot holding the state
/// after the last accepted token becomes the live slot, `CacheManager::adopt_draft`.)
fn push_slot_ops(plan: &mut StepPlan, out: &SchedulerOutput) {
    for init in &out.ssm_init {
        match *init {
            SsmInit::None => {}
            SsmInit::Zero { live } => plan.slot_ops.push(SlotOp::Zero { slot: live }),
            SsmInit::Restore { from, live } => plan.slot_ops.push(SlotOp::Copy { from, to: live }),
        }
    }
}

/// The sampled row of request `r`'s chunk (in `slot`): its sampling parameters and history, and
/// its constraint's mask, listed in [`Built::late_masks`] to be computed with the step's others
/// (at the end of [`build`], or while the forward pass runs when the token before is still
/// being sampled and `late_masks` allows), or else the whole plan marked to be built again.
fn push_sampled_row(
    plan: &mut StepPlan,
    built: &mut Built,
    r: &Request,
    slot: u32,
    has_constrainer: bool,
    words: usize,
    late_masks: bool,
) {
    let p = &r.params;
    let penalised = p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0
        || p.presence_penalty != 0.0
        || p.frequency_penalty != 0.0;
    built.history_incomplete |= penalised && r.in_flight > 0;
    let row = RowInfo {
        params: &r.params,
        prompt: &r.tokens[..r.orig_prompt_len],
        output: r.output(),
        drafts: &[],
        seed: r.seed,
        banned: r.banned_now(),
    };
    SamplingStage::push_sample_row(&mut plan.sampling, &row);
    if r.constraint.is_some() {
        // The mask needs every token before this position: one still being sampled
        // is waited for, by the mask (computed while the forward pass runs) or else
        // by the whole plan (built again once it is known). Every mask is listed and
        // computed with the step's others in one batch (the lanes' threads at once): at
        // the end of `build`, or while the forward pass runs where masks can come late.
        let batched = r.in_flight == 0 || r.in_flight == 1 && late_masks;
        if batched && has_constrainer {
            let at = plan.sampling.masks.len();
            plan.sampling.mask_last_row(words).fill(u32::MAX);
            built.late_masks.push(LateMask { at, slot });
        } else if r.in_flight > 0 {
            built.history_incomplete = true;
        }
    }
}

/// Adds verify chunk `s` of request `r`: its last known token and its drafts, every position a
/// sampled row whose history holds the drafts before it (see [`super::speculative`]).
#[cold]
#[inline(never)]
fn push_verify(
    plan: &mut StepPlan,
    s: &ScheduledSeq,
    r: &Request,
    cache: &CacheManager,
) -> Result<(), PlanError> {
    if r.in_flight > 0
        || r.tokens.len() != s.start + 1
        || r.drafts.len() != s.drafts
        || s.len != 1 + s.drafts
    {
        return Err(PlanError(format!(
            "slot {}: a verify chunk of {} tokens from {} with {} drafts does not follow the {} known",
            s.slot,
            s.len,
            s.start,
            r.drafts.len(),
            r.tokens.len()
        )));
    }
    plan.push(
        &r.tokens[s.start..],
        s.start,
        cache.block_table(s.slot),
        cache.live_slot(s.slot),
        true,
    )
    .sample_all = true;
    plan.extend_last(&r.drafts);
    for j in 0..=s.drafts {
        let row = RowInfo {
            params: &r.params,
            prompt: &r.tokens[..r.orig_prompt_len],
            output: r.output(),
            drafts: &r.drafts[..j],
            seed: r.seed,
            banned: r.banned_at(j),
        };
        SamplingStage::push_sample_row(&mut plan.sampling, &row);
    }
    Ok(())
}

/// Computes the masks [`build`] left for later ([`Built::late_masks`]), the launched step's
/// tokens now applied to its requests: each constrained request's matcher takes the tokens it
/// has not seen and writes its row's mask. A request that finished meanwhile keeps its row
/// unmasked (the row is never used); one whose constraint fails keeps it unmasked and is
/// listed in `built.constraint_failures`.
pub fn fill_late_masks(
    plan: &mut StepPlan,
    built: &mut Built,
    sched: &Scheduler,
    c: &mut (dyn Constrainer + '_),
    words: usize,
) {
    // The rows' masks as disjoint slices of the plan's mask words (`at` rises with the rows).
    let mut rest: &mut [u32] = &mut plan.sampling.masks;
    let mut base = 0;
    let mut jobs = Vec::with_capacity(built.late_masks.len());
    let mut owners = Vec::with_capacity(built.late_masks.len());
    for m in &built.late_masks {
        let Some(r) = sched.request(m.slot) else {
            continue;
        };
        let Some(active) = r.constraint.as_ref().filter(|_| r.phase != Phase::Finished) else {
            continue;
        };
        if m.at < base || m.at + words > base + rest.len() {
            // A plan that lost the row's mask: never quietly unmasked.
            built.constraint_failures.push((
                r.id,
                format!(
                    "no mask at word {} of the step's {}",
                    m.at,
                    base + rest.len()
                ),
            ));
            continue;
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(m.at - base);
        let (mask, tail) = tail.split_at_mut(words);
        (rest, base) = (tail, m.at + words);
        let output = r.output();
        let fed = active.fed.get().min(output.len());
        jobs.push(MaskJob {
            matcher: active.matcher,
            tokens: &output[fed..],
            mask,
            result: Ok(()),
        });
        owners.push((r.id, active, output.len()));
    }
    c.next_batch(&mut jobs);
    for (job, (id, active, fed)) in jobs.into_iter().zip(owners) {
        match job.result {
            Ok(()) => active.fed.set(fed),
            Err(why) => {
                job.mask.fill(u32::MAX);
                built.constraint_failures.push((id, why));
            }
        }
    }
}

/// Writes the tokens the launched step `launched` sampled (`sampled[i]` for its i-th sampled
/// row) into the placeholders of `plan`, built for the step after it. `row_of` is scratch.
pub fn fill_placeholders(
    plan: &mut StepPlan,
    placeholders: &[Placeholder],
    launched: &SchedulerOutput,
    sampled: &[u32],
    row_of: &mut Vec<u32>,
) -> Result<(), PlanError> {
    row_of.clear();
    let mut row = 0;
    for s in &launched.seqs {
        // A verify chunk's request is never decoded ahead: its last row is as good as any.
        row += s.rows();
        if s.rows() == 0 {
            continue;
        }
        let i = s.slot as usize;
        if row_of.len() <= i {
            row_of.resize(i + 1, u32::MAX);
        }
        row_of[i] = (row - 1) as u32;
    }
    for p in placeholders {
        let token = row_of
            .get(p.slot as usize)
            .and_then(|&row| sampled.get(row as usize))
            .ok_or_else(|| PlanError(format!("slot {}: no token sampled for it", p.slot)))?;
        plan.tokens[p.at] = *token;
    }
    Ok(())
}

/// What the sampling stage needs about each sampled row of the launched step `launched`, in
/// row order.
pub fn sampled_rows<'a>(sched: &'a Scheduler, launched: &'a SchedulerOutput) -> SampledRows<'a> {
    SampledRows {
        sched,
        seqs: launched.seqs.iter(),
        verify: None,
    }
}

/// The iterator of [`sampled_rows`]: one row per chunk with logits, `1 + drafts` for a verify
/// chunk (a plain loop, not a `flat_map`: it is walked twice per step on the critical path).
#[derive(Clone)]
pub struct SampledRows<'a> {
    sched: &'a Scheduler,
    seqs: std::slice::Iter<'a, ScheduledSeq>,
    /// The verify chunk being walked: its request, the next row, its drafts.
    verify: Option<(&'a Request, usize, usize)>,
}

impl<'a> Iterator for SampledRows<'a> {
    type Item = RowInfo<'a>;

    fn next(&mut self) -> Option<RowInfo<'a>> {
        let row = |r: &'a Request, j: usize| RowInfo {
            params: &r.params,
            prompt: &r.tokens[..r.orig_prompt_len],
            output: r.output(),
            drafts: &r.drafts[..j.min(r.drafts.len())],
            seed: r.seed,
            // Bans are in the candidates' logits already (negative infinity).
            banned: &[],
        };
        loop {
            if let Some((r, j, n)) = self.verify {
                self.verify = (j < n).then_some((r, j + 1, n));
                return Some(row(r, j));
            }
            let s = self.seqs.next()?;
            if !s.want_logits {
                continue;
            }
            let Some(r) = self.sched.request(s.slot) else {
                continue;
            };
            if s.drafts > 0 {
                self.verify = Some((r, 1, s.drafts));
            }
            return Some(row(r, 0));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::cache::{CacheLayout, HashSeed};
    use crate::engine::api::{GenerateRequest, SamplingParams};
    use crate::engine::config::EngineConfig;
    use crate::engine::request::Request;

    const BS: usize = 4;

    fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>) {
        let (tx, _rx) = unbounded_channel();
        let req = GenerateRequest {
            params: SamplingParams {
                repetition_penalty: 1.3,
                ..SamplingParams::default()
            },
            ..GenerateRequest::for_test(id, prompt, 4)
        };
        s.add(|slot| Request::new(req, slot, tx.into()));
    }

    /// A hybrid cache, two requests over a shared 8-token prefix, 12 tokens a step: the plan
    /// carries each chunk's tokens, positions and table, zeroes or restores new live slots,
    /// snapshots at block boundaries only, and one sampling row per final chunk.
    #[test]
    fn plan_follows_the_schedule_and_the_cache() {
        let cfg = EngineConfig {
            max_batched_tokens: 12,
            max_running: 4,
            ..Default::default()
        };
        let layout = CacheLayout {
            block_size: BS,
            num_blocks: 32,
            live_slots: 4,
            durable_slots: 8,
            kv_bytes: 0,
            ssm_bytes: 0,
        };
        let mut sched = Scheduler::new(cfg.clone(), BS, HashSeed::new("t"));
        let mut cache = CacheManager::new(&layout, true, true, None);
        let sampling = SamplingStage::new(cfg.sampler_candidates);
        add(&mut sched, 1, (1..=10).collect());
        add(&mut sched, 2, (1..=8).chain(50..53).collect());
        let mut plan = StepPlan::default();
        let (mut seen_zero, mut seen_copy) = (0, 0);
        let mut snapshot_slots = Vec::new();
        let mut sampled = 0;
        let mut out = SchedulerOutput::default();
        for _ in 0..4 {
            sched.schedule(&mut cache, &mut out);
            if out.is_empty() {
                break;
            }
            let mut built = Built::default();
            build(
                &mut plan, BS, &out, &sched, &cache, &sampling, None, false, &mut built,
            )
            .unwrap();
            assert!(built.placeholders.is_empty());
            assert_eq!(plan.seqs.len(), out.seqs.len());
            for (i, (c, s)) in plan.seqs.iter().zip(&out.seqs).enumerate() {
                let r = sched.request(s.slot).unwrap();
                let toks = &plan.tokens[c.offset..c.offset + c.len];
                assert_eq!(toks, &r.tokens[s.start..s.start + s.len]);
                assert_eq!(plan.positions[c.offset] as usize, s.start);
                assert_eq!(plan.block_table(i), cache.block_table(s.slot));
                assert_eq!(c.ssm_slot, cache.live_slot(s.slot));
                for t in plan.snapshots_of(i) {
                    assert_eq!((s.start + t.after as usize) % BS, 0, "block boundary");
                    assert_ne!(t.slot, c.ssm_slot, "snapshots go to durable slots");
                }
            }
            for op in &plan.slot_ops {
                match *op {
                    SlotOp::Zero { .. } => seen_zero += 1,
                    // A restore reads a snapshot an earlier step of this test asked for.
                    SlotOp::Copy { from, .. } => {
                        assert!(snapshot_slots.contains(&from), "restore from {from}");
                        seen_copy += 1;
                    }
                }
            }
            snapshot_slots.extend(plan.snapshots.iter().map(|t| t.slot));
            assert_eq!(plan.sampling.len(), plan.sample_rows.len());
            // The repetition penalty is on, so every sampled row carries its history.
            for i in 0..plan.sampling.len() {
                assert!(!plan.sampling.history(i).0.is_empty());
            }
            sampled += plan.sample_rows.len();
            let tokens = vec![7; plan.sample_rows.len()];
            let mut fin = Vec::new();
            sched.launched(&out);
            sched.update_from_output(&mut cache, &out, &tokens, &[], &mut fin, &mut Vec::new());
            cache.commit_step();
            sched.release(&out, &mut cache);
        }
        // The first request starts from zero; the second shares its 8-token prefix and
        // restores the snapshot taken at that boundary.
        assert_eq!((seen_zero, seen_copy), (1, 1));
        assert!(sampled >= 2);
    }
}
