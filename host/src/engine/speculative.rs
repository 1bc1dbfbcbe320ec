//! Speculative decoding: a decoding request's next tokens are guessed (drafted) and checked by
//! the target model in one step, so one weight pass can yield several tokens.
//!
//! A *verify chunk* is the request's last known token followed by its `k` drafts (a decode of
//! `1 + k` positions); every position is a sampled row. Row `j` is sampled exactly as the
//! `j`-th next token would be without speculation: its penalty history is the output plus the
//! drafts before it, and its sampler counter is `output.len() + j`. The drafts are accepted
//! while they equal what their rows sampled ([`accepted`]); the row after the last accepted
//! draft supplies the next token. For the drafts proposed here (one token per position, no
//! distribution) this is the rejection rule of speculative sampling with a point-mass draft:
//! a draft `d` survives with probability `p(d)`, and a rejected row's token is distributed as
//! `p` without `d`, renormalised. Since every row samples with the randomness of the position
//! it stands for, a seeded request's output is *the same tokens* with speculation on or off,
//! at any temperature, and the sampler plugin sees the same per-token semantics.
//!
//! The state after the last accepted token is exact: attention rows past it are simply never
//! read again (their blocks released, see [`crate::cache::CacheManager::shrink`]), and on
//! hybrids the verify scan writes the recurrent state after each of the first `k` positions
//! into the request's draft slots (the in-scan snapshot mechanism; verify steps scan their
//! short prompts token by token, `ssm_recurrent` on CUDA). When a draft was rejected, the draft
//! slot after the last accepted token becomes the live slot and the old live slot a draft slot
//! ([`crate::cache::CacheManager::adopt_draft`]): no state is copied, and the next step, a
//! plain decode, can replay the decode graph. Block hashes and snapshots only ever cover
//! accepted tokens.

use serde::Deserialize;

/// `[speculative]` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    /// "off"; "ngram": prompt lookup (drafts copied from where the context's last tokens
    /// occurred before; no extra weights); "draft_model": a smaller model with the same
    /// tokenizer (`draft_model`) decodes the drafts greedily; or "mtp": the checkpoint's
    /// multi-token-prediction head (Qwen3.5, Qwen3-Next `mtp.*`) drafts them from the
    /// target's hidden states (steps then run eagerly, none scheduled ahead).
    pub method: String,
    /// Drafts per verify step (`k`).
    pub num_tokens: usize,
    /// Speculate only while at most this many requests run: a larger batch is bound by
    /// compute, where rejected drafts cost throughput (and the step ahead, which speculation
    /// gives up, hides more host time).
    pub max_batch: usize,
    /// N-gram sizes tried, longest first, when looking up the context's suffix.
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// The draft model of "draft_model": a folder, a `.gguf` file or a hub id, as
    /// `model.path`. Its vocabulary must be the served model's.
    pub draft_model: String,
    /// The draft model's cache (its KV blocks and recurrent-state slots, prefix caching on),
    /// per replica.
    pub draft_memory_budget: String,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            method: "off".into(),
            num_tokens: 3,
            max_batch: 16,
            prompt_lookup_min: 2,
            prompt_lookup_max: 4,
            draft_model: String::new(),
            draft_memory_budget: "512MiB".into(),
        }
    }
}

/// Most drafts per verify step.
pub const MAX_DRAFTS: usize = 16;

/// Most decodes a request runs without drafts after verify steps that accepted none.
pub const MAX_BACKOFF: u32 = 32;

/// Decodes to run without drafts after `misses` verify steps in a row accepted none: 0 after
/// the first miss, then 1, 2, 4, … up to [`MAX_BACKOFF`].
pub fn backoff(misses: u32) -> u32 {
    match misses {
        0 | 1 => 0,
        m => (1u32 << (m - 2).min(5)).min(MAX_BACKOFF),
    }
}

impl SpeculativeConfig {
    pub fn enabled(&self) -> bool {
        self.method != "off"
    }

    /// A bad value, named by its key.
    pub fn validate(&self) -> Result<(), String> {
        if !matches!(
            self.method.as_str(),
            "off" | "ngram" | "draft_model" | "mtp"
        ) {
            return Err(format!(
                "speculative.method = {:?}: must be \"off\", \"ngram\", \"draft_model\" or \"mtp\"",
                self.method
            ));
        }
        if self.method == "draft_model" && self.draft_model.trim().is_empty() {
            return Err(
                "speculative.draft_model = \"\": method \"draft_model\" needs the draft model's path"
                    .into(),
            );
        }
        if let Err(e) = crate::cache::ByteSize::parse(&self.draft_memory_budget) {
            return Err(format!(
                "speculative.draft_memory_budget = {:?}: {e}",
                self.draft_memory_budget
            ));
        }
        if !(1..=MAX_DRAFTS).contains(&self.num_tokens) {
            return Err(format!(
                "speculative.num_tokens = {}: must be between 1 and {MAX_DRAFTS}",
                self.num_tokens
            ));
        }
        if self.max_batch == 0 {
            return Err("speculative.max_batch = 0: must be at least 1".into());
        }
        if self.prompt_lookup_min == 0 || self.prompt_lookup_min > self.prompt_lookup_max {
            return Err(format!(
                "speculative.prompt_lookup_min = {} / prompt_lookup_max = {}: need 1 ≤ min ≤ max",
                self.prompt_lookup_min, self.prompt_lookup_max
            ));
        }
        Ok(())
    }

    /// The drafter this configuration names (`None` when off; for "draft_model", whose
    /// drafter the caller builds with the loaded draft model: [`DraftModelDrafter`]; and for
    /// "mtp", whose drafter the engine builds over its MTP pass).
    pub fn drafter(&self) -> Option<Box<dyn Drafter>> {
        match self.method.as_str() {
            "ngram" => Some(Box::new(NgramDrafter {
                min: self.prompt_lookup_min,
                max: self.prompt_lookup_max,
            })),
            _ => None,
        }
    }

    /// Recurrent-state slots a hybrid needs for the drafts of the requests that may speculate
    /// at once (`max_running` at most).
    pub fn draft_slots(&self, max_running: usize) -> usize {
        if self.enabled() {
            self.max_batch.min(max_running) * self.num_tokens
        } else {
            0
        }
    }
}

/// One request's ask of a drafter: up to `k` tokens after `tokens` (its prompt and output).
#[derive(Debug, Clone, Copy)]
pub struct DraftAsk<'a> {
    pub id: u64,
    pub tokens: &'a [u32],
    pub k: usize,
}

/// Proposes decoding requests' next tokens.
pub trait Drafter: Send {
    /// Appends up to `k` guesses of what follows `tokens` (the request's prompt and output)
    /// to `out`; fewer, or none, when it has no guess. `id` is the request's.
    fn propose(&mut self, id: u64, tokens: &[u32], k: usize, out: &mut Vec<u32>);

    /// [`Self::propose`] for every ask of a step, `out[i]` (empty on entry) for `asks[i]`. A
    /// drafter that runs a model drafts them as one batch.
    fn propose_many(&mut self, asks: &[DraftAsk<'_>], out: &mut [Vec<u32>]) {
        for (a, o) in asks.iter().zip(out) {
            self.propose(a.id, a.tokens, a.k, o);
        }
    }
}

/// Prompt lookup: finds the latest earlier occurrence of the context's last `n` tokens
/// (`n` from `max` down to `min`) and proposes the tokens that followed it.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    pub min: usize,
    pub max: usize,
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, _id: u64, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let len = tokens.len();
        for n in (self.min..=self.max.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // Latest match first; the match must end before the suffix itself.
            let found = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix);
            if let Some(i) = found {
                let from = i + n;
                out.extend_from_slice(&tokens[from..(from + k).min(len)]);
                return;
            }
        }
    }
}

/// A benchmark's drafter: proposes each request's known continuation (`answers`: request id
/// → the whole expected sequence, prompt and output, e.g. from a run without speculation) with
/// each draft right with probability `accept` (a fixed hash of the request, position and
/// draft index decides; a wrong draft is another token). It measures what verifying costs at a
/// chosen acceptance rate without trained draft weights; it is not a serving drafter.
#[derive(Debug, Clone, Default)]
pub struct ReplayDrafter {
    pub answers: std::collections::HashMap<u64, Vec<u32>>,
    pub accept: f64,
}

impl Drafter for ReplayDrafter {
    fn propose(&mut self, id: u64, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let Some(answer) = self.answers.get(&id) else {
            return;
        };
        for (j, &t) in answer.iter().skip(tokens.len()).take(k).enumerate() {
            let h =
                crate::engine::request::derive_seed(id ^ ((tokens.len() as u64) << 20) ^ j as u64);
            let right = ((h >> 11) as f64 / (1u64 << 53) as f64) < self.accept;
            out.push(if right {
                t
            } else {
                t.checked_sub(1).unwrap_or(1)
            });
        }
    }
}

/// Drafts from a smaller model with the same tokenizer: an engine of its own over the draft
/// model (greedy, prefix caching on, a step's asks as one batch) continues each request's
/// tokens by `k`. Consecutive proposals for a request share all but their last tokens, so the draft
/// engine's prefix cache serves them and each proposal computes only the tokens accepted since
/// the last one, the partial last block and the `k` drafts. A proposal the draft engine cannot
/// make (its cache too small for the context) proposes nothing.
pub struct DraftModelDrafter<E: super::StepExecutor> {
    engine: super::Engine<E>,
    next_id: u64,
    warned: bool,
}

impl<E: super::StepExecutor> DraftModelDrafter<E> {
    /// Over a draft engine (see [`draft_setup`]).
    pub fn new(engine: super::Engine<E>) -> Self {
        Self {
            engine,
            next_id: 0,
            warned: false,
        }
    }

    pub fn engine(&self) -> &super::Engine<E> {
        &self.engine
    }
}

/// The draft engine's setup: the requests of one step's asks at once (`max_batch`), chunked
/// prefill, prefix caching, a cache of `budget` bytes in blocks of `block_size`.
pub fn draft_setup(
    budget: crate::cache::ByteSize,
    block_size: usize,
    max_batch: usize,
) -> super::EngineSetup {
    super::EngineSetup {
        engine: super::EngineConfig {
            max_running: max_batch.max(1),
            max_waiting: max_batch.max(1) * 4,
            max_batched_tokens: 2048,
            schedule_ahead: false,
            cuda_graphs: false,
            ..Default::default()
        },
        cache: crate::cache::CacheConfig {
            memory_budget: Some(budget),
            block_size,
            prefix_caching: true,
            ..Default::default()
        },
        hash_salt: "draft-model".into(),
        speculative: SpeculativeConfig::default(),
    }
}

impl<E: super::StepExecutor> Drafter for DraftModelDrafter<E> {
    fn propose(&mut self, id: u64, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let ask = [DraftAsk { id, tokens, k }];
        let mut one = [std::mem::take(out)];
        self.propose_many(&ask, &mut one);
        *out = std::mem::take(&mut one[0]);
    }

    fn propose_many(&mut self, asks: &[DraftAsk<'_>], out: &mut [Vec<u32>]) {
        use super::api::{EngineEvent, GenerateRequest};
        let mut streams = Vec::with_capacity(asks.len());
        for ask in asks {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            self.next_id += 1;
            self.engine.add(
                GenerateRequest {
                    speculative: false,
                    ..GenerateRequest::greedy(self.next_id, ask.tokens.to_vec(), ask.k as u32)
                },
                tx,
            );
            streams.push((rx, false));
        }
        let mut open = asks.len();
        while open > 0 {
            let ran = self.engine.step();
            for ((rx, done), o) in streams.iter_mut().zip(out.iter_mut()) {
                while let Ok(ev) = rx.try_recv() {
                    match ev {
                        EngineEvent::Tokens { tokens, .. } => o.extend(tokens),
                        EngineEvent::Finished { .. } => {
                            *done = true;
                            open -= 1;
                        }
                        EngineEvent::Failed { message, .. } => {
                            if !std::mem::replace(&mut self.warned, true) {
                                tracing::warn!(error = %message, "the draft model could not draft (said once)");
                            }
                            o.clear();
                            *done = true;
                            open -= 1;
                        }
                        EngineEvent::PromptLogprobs { .. } => {}
                    }
                }
            }
            if !ran {
                break;
            }
        }
        // A step scheduled ahead may still hold a request: let it go.
        while !self.engine.is_idle() && self.engine.step() {}
    }
}

/// How many of `drafts` are accepted given `sampled`, the tokens the verify rows sampled
/// (row `j` at the position of draft `j`): the leading drafts equal to their row's token.
pub fn accepted(sampled: &[u32], drafts: &[u32]) -> usize {
    sampled
        .iter()
        .zip(drafts)
        .take_while(|(s, d)| s == d)
        .count()
}

/// Counters of speculative decoding, vLLM's `spec_decode_*` figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecCounters {
    /// Verify chunks that carried at least one draft.
    pub drafts: u64,
    /// Draft tokens proposed (verified).
    pub draft_tokens: u64,
    /// Draft tokens accepted.
    pub accepted_tokens: u64,
    /// Accepted drafts by position in their chunk (index 0: the first draft).
    pub accepted_per_pos: Vec<u64>,
}

impl SpecCounters {
    /// Counts one verify chunk of `proposed` drafts of which `accepted` were accepted.
    pub fn count(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.drafts += 1;
        self.draft_tokens += proposed as u64;
        self.accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < proposed {
            self.accepted_per_pos.resize(proposed, 0);
        }
        for c in &mut self.accepted_per_pos[..accepted] {
            *c += 1;
        }
    }

    /// Tokens per verify chunk: the accepted drafts plus the one token every chunk yields.
    pub fn mean_acceptance_length(&self) -> f64 {
        if self.drafts == 0 {
            return 0.0;
        }
        1.0 + self.accepted_tokens as f64 / self.drafts as f64
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn propose(d: &mut NgramDrafter, tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        d.propose(0, tokens, k, &mut out);
        out
    }

    #[test]
    fn ngram_proposes_what_followed_the_latest_match() {
        let mut d = NgramDrafter { min: 1, max: 3 };
        // "1 2 3" occurs at 0 and 5; the latest earlier one (at 5) is followed by 9 9.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3];
        assert_eq!(propose(&mut d, &t, 2), vec![9, 9]);
        // Fewer tokens follow than asked: what there is.
        assert_eq!(propose(&mut d, &[5, 6, 5, 6], 4), vec![5, 6]);
        // No match of any size: nothing.
        assert!(propose(&mut d, &[1, 2, 3, 4], 3).is_empty());
        // Only a shorter n-gram matches.
        assert_eq!(propose(&mut d, &[8, 4, 2, 7, 3, 4], 2), vec![2, 7]);
        // Too short to look anything up.
        assert!(propose(&mut d, &[1], 3).is_empty());
        let mut two = NgramDrafter { min: 2, max: 2 };
        assert!(propose(&mut two, &[8, 4, 2, 7, 3, 4], 2).is_empty());
    }

    #[test]
    fn acceptance_stops_at_the_first_mismatch() {
        assert_eq!(accepted(&[5, 6, 7, 8], &[5, 6, 7]), 3);
        assert_eq!(accepted(&[5, 1, 7, 8], &[5, 6, 7]), 1);
        assert_eq!(accepted(&[4, 6, 7, 8], &[5, 6, 7]), 0);
        assert_eq!(accepted(&[4], &[]), 0);
        let mut c = SpecCounters::default();
        c.count(3, 2);
        c.count(3, 0);
        c.count(0, 0);
        assert_eq!((c.drafts, c.draft_tokens, c.accepted_tokens), (2, 6, 2));
        assert_eq!(c.accepted_per_pos, vec![1, 1, 0]);
        assert_eq!(c.mean_acceptance_length(), 2.0);
        let waits: Vec<u32> = (0..10).map(backoff).collect();
        assert_eq!(waits, vec![0, 0, 1, 2, 4, 8, 16, 32, 32, 32]);
    }

    /// Two positions over a 4-token vocabulary, position 1's distribution depending on
    /// position 0's token. Speculation proposes fixed drafts, the rows are sampled by the
    /// built-in sampler (temperature 1, the seed and counter of the position each row stands
    /// for), the drafts are accepted by `rule`, and a rejected position is sampled afresh in
    /// the context of the token that replaced the draft. Returns the counts of the 16
    /// two-token outputs over `n` seeds, and their expected probabilities.
    fn two_token_outputs(
        rule: impl Fn(&[u32], &[u32], &[[f32; 4]]) -> Vec<u32>,
        drafts: [u32; 2],
        n: u64,
    ) -> (Vec<u64>, Vec<f64>) {
        use crate::policy::native::DefaultSampler;
        use crate::policy::{Decision, Sampler, SamplerBatch};
        let l0 = [1.0f32, 0.2, -0.5, 0.6];
        let l1 = |x0: u32| -> [f32; 4] {
            let mut l = [0.3f32, -0.4, 0.9, 0.0];
            l[x0 as usize] += 1.2;
            l
        };
        let softmax = |l: &[f32; 4]| {
            let m = l.iter().fold(f32::MIN, |a, &b| a.max(b));
            let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            e.into_iter().map(|x| x / z).collect::<Vec<_>>()
        };
        let mut sampler = DefaultSampler::default();
        // The token the sampler draws from `logits` for `seed` at `counter`.
        let mut draw = |logits: &[f32; 4], seed: u64, counter: u64| -> u32 {
            let mut order: Vec<u32> = (0..4).collect();
            order.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            let batch = SamplerBatch {
                k: 4,
                temperature: vec![1.0],
                top_k: vec![0],
                top_p: vec![1.0],
                min_p: vec![0.0],
                seed: vec![seed],
                counter: vec![counter],
                cand_logits: order.iter().map(|&t| logits[t as usize]).collect(),
                cand_tokens: order,
            };
            match sampler.sample(&batch) {
                Decision::Use(v) => v[0],
                Decision::UseDefault => panic!("the default sampler decides"),
            }
        };
        let mut counts = vec![0u64; 16];
        for seed in 0..n {
            // The verify step: row 0 at position 0, row 1 at position 1 after draft 0.
            let rows = [l0, l1(drafts[0])];
            let sampled = [draw(&rows[0], seed, 0), draw(&rows[1], seed, 1)];
            let mut out = rule(&sampled, &drafts[..1], &rows);
            if out.len() < 2 {
                // The next step samples position 1 after the token emitted at position 0.
                out.push(draw(&l1(out[0]), seed, 1));
            }
            counts[(out[0] * 4 + out[1]) as usize] += 1;
        }
        let p0 = softmax(&l0);
        let expected = (0..16)
            .map(|c| p0[c / 4] * softmax(&l1(c as u32 / 4))[c % 4])
            .collect();
        (counts, expected)
    }

    /// Pearson's χ² of `counts` against `probs`.
    fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The acceptance rule keeps the target distribution: over 40 000 seeds the two-token
    /// outputs of speculative sampling fit the model's joint distribution (χ² below its 0.999
    /// quantile for 15 degrees of freedom, 37.7), whatever the drafts; the same test rejects
    /// two plausible wrong rules, so it can fail.
    #[test]
    fn acceptance_keeps_the_target_distribution() {
        const CHI2_15_999: f64 = 37.7;
        let n = 40_000;
        // The engine's rule: the accepted drafts, then the row after them.
        let right = |sampled: &[u32], drafts: &[u32], _: &[[f32; 4]]| {
            let a = accepted(sampled, drafts);
            sampled[..=a].to_vec()
        };
        for drafts in [[0, 0], [2, 2], [1, 3]] {
            let (counts, p) = two_token_outputs(right, drafts, n);
            let x2 = chi_square(&counts, &p);
            eprintln!("drafts {drafts:?}: χ² = {x2:.1}");
            assert!(x2 < CHI2_15_999, "drafts {drafts:?}: χ² = {x2:.1}");
        }
        // Wrong: the second row's token kept although the draft it followed was rejected.
        let stale = |sampled: &[u32], _: &[u32], _: &[[f32; 4]]| sampled.to_vec();
        let (counts, p) = two_token_outputs(stale, [2, 2], n);
        let x2 = chi_square(&counts, &p);
        eprintln!("stale: χ² = {x2:.1}");
        assert!(x2 > 10.0 * CHI2_15_999, "a stale row passed: χ² = {x2:.1}");
        // Wrong: a draft the model finds likely enough (p ≥ 0.2) accepted without its row.
        let lenient = |sampled: &[u32], drafts: &[u32], rows: &[[f32; 4]]| {
            let l = &rows[0];
            let z: f32 = l.iter().map(|x| x.exp()).sum();
            if l[drafts[0] as usize].exp() / z >= 0.2 {
                vec![drafts[0], sampled[1]]
            } else {
                vec![sampled[0]]
            }
        };
        let (counts, p) = two_token_outputs(lenient, [0, 0], n);
        let x2 = chi_square(&counts, &p);
        eprintln!("lenient: χ² = {x2:.1}");
        assert!(
            x2 > 10.0 * CHI2_15_999,
            "a lenient rule passed: χ² = {x2:.1}"
        );
    }

    #[test]
    fn config_is_checked() {
        assert!(SpeculativeConfig::default().validate().is_ok());
        let bad = SpeculativeConfig {
            method: "eagle".into(),
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("speculative.method"));
        let bad = SpeculativeConfig {
            num_tokens: 0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("num_tokens"));
        let on = SpeculativeConfig {
            method: "ngram".into(),
            num_tokens: 4,
            max_batch: 8,
            ..Default::default()
        };
        assert_eq!(on.draft_slots(64), 32);
        assert_eq!(on.draft_slots(2), 8);
        assert_eq!(SpeculativeConfig::default().draft_slots(64), 0);
    }
}
