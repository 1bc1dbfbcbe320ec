//! The step's sampling tail as plain columns: what a backend needs to turn its logits rows
//! into top-K candidate columns ([`SampleRows`]), and what it hands back ([`SampleOut`]).
//!
//! Per row the tail applies repetition / presence / frequency penalties from the row's token
//! history, then adds each entry's bias (a request's `logit_bias`; negative infinity for a
//! token `min_tokens` masks out), takes the K best (penalised logit, token) pairs (best first, ties to the lower token
//! id, NaN ranked as negative infinity) and, where asked, the log-sum-exp of the penalised row.
//! Temperature is not applied: candidates are logits after penalties, before temperature, as
//! the sampler policy expects them.
//!
//! Backends know no requests: the history arrives as a CSR of *distinct* tokens per row with
//! their count in the row's output (0 for tokens seen only in the prompt), built once on the
//! host by [`SampleRows::push_row`]. Distinct entries mean a device kernel can give every entry
//! its own thread without write races.

/// `hist_counts` of an entry that is only biased: its token is in neither the prompt nor the
/// output, so no penalty touches it.
pub const BIAS_ONLY: u32 = u32::MAX;

/// One row's penalty parameters (as in the request's sampling parameters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Divides positive / multiplies negative logits of every history token; 1 disables and so
    /// does any value ≤ 0.
    pub repetition: f32,
    /// Subtracted once from the logit of every token present in the output.
    pub presence: f32,
    /// Subtracted per occurrence from the logit of every token in the output.
    pub frequency: f32,
}

impl Penalties {
    /// Whether the repetition penalty changes anything.
    pub fn repetition_on(&self) -> bool {
        self.repetition != 1.0 && self.repetition > 0.0
    }
    /// Whether presence or frequency penalties change anything.
    pub fn counts_on(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0
    }
}

/// The sampling inputs of one step, one entry per logits row in every per-row column.
///
/// Invariants (kept by [`SampleRows::push_row`], checked by the kernels): every per-row column
/// has the same length, `hist_offsets` has one more entry, starts at 0, never decreases and ends
/// at `hist_tokens.len() == hist_counts.len() == hist_bias.len()`; the tokens of one row are
/// distinct.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleRows {
    /// Candidates wanted per row; the kernel produces `k.min(vocab).max(1)`.
    pub k: usize,
    pub repetition: Vec<f32>,
    pub presence: Vec<f32>,
    pub frequency: Vec<f32>,
    /// Whether the row needs its log-sum-exp (the request asked for logprobs).
    pub want_lse: Vec<bool>,
    /// Row `i`'s history is `hist_tokens[hist_offsets[i]..hist_offsets[i + 1]]`.
    pub hist_offsets: Vec<u32>,
    pub hist_tokens: Vec<u32>,
    /// Occurrences of the token in the row's output (0: only in the prompt; [`BIAS_ONLY`]: in
    /// neither, the entry is there for its bias).
    pub hist_counts: Vec<u32>,
    /// Added to the token's logit after the penalties (0 for most entries).
    pub hist_bias: Vec<f32>,
    /// Allowed-token masks of constrained rows: row `i`'s mask, when `mask_of[i] !=`
    /// [`NO_MASK`], is `masks[mask_of[i] * w..][..w]` with `w = vocab.div_ceil(32)` words (bit
    /// `t % 32` of word `t / 32` allows token `t`). A masked-out token's logit becomes negative
    /// infinity before the penalties. Rows of requests without a constraint have none, and a
    /// step without one carries no words at all.
    pub mask_of: Vec<u32>,
    pub masks: Vec<u32>,
}

/// `mask_of` of a row without a mask.
pub const NO_MASK: u32 = u32::MAX;

impl SampleRows {
    /// Empties every column (keeping capacity) for a step that wants `k` candidates per row.
    pub fn clear(&mut self, k: usize) {
        self.k = k;
        self.repetition.clear();
        self.presence.clear();
        self.frequency.clear();
        self.want_lse.clear();
        self.hist_offsets.clear();
        self.hist_offsets.push(0);
        self.hist_tokens.clear();
        self.hist_counts.clear();
        self.hist_bias.clear();
        self.mask_of.clear();
        self.masks.clear();
    }

    /// Becomes a copy of `src`, reusing this value's buffers (no allocation once warm).
    pub fn copy_from(&mut self, src: &SampleRows) {
        self.k = src.k;
        self.repetition.clone_from(&src.repetition);
        self.presence.clone_from(&src.presence);
        self.frequency.clone_from(&src.frequency);
        self.want_lse.clone_from(&src.want_lse);
        self.hist_offsets.clone_from(&src.hist_offsets);
        self.hist_tokens.clone_from(&src.hist_tokens);
        self.hist_counts.clone_from(&src.hist_counts);
        self.hist_bias.clone_from(&src.hist_bias);
        self.mask_of.clone_from(&src.mask_of);
        self.masks.clone_from(&src.masks);
    }

    /// Gives the last row pushed a mask of `words` words, all tokens masked out, for the
    /// caller to fill.
    pub fn mask_last_row(&mut self, words: usize) -> &mut [u32] {
        let start = self.masks.len();
        if let Some(m) = self.mask_of.last_mut() {
            *m = (start / words.max(1)) as u32;
        }
        self.masks.resize(start + words, 0);
        &mut self.masks[start..]
    }

    /// Row `i`'s mask words, if it has a mask (`words` per mask).
    pub fn mask(&self, i: usize, words: usize) -> Option<&[u32]> {
        let m = *self.mask_of.get(i)?;
        if m == NO_MASK {
            return None;
        }
        self.masks.get(m as usize * words..(m as usize + 1) * words)
    }

    /// Whether any row has a mask.
    pub fn has_masks(&self) -> bool {
        !self.masks.is_empty()
    }

    pub fn len(&self) -> usize {
        self.repetition.len()
    }

    pub fn is_empty(&self) -> bool {
        self.repetition.is_empty()
    }

    /// Row `i`'s `(tokens, output counts)`.
    pub fn history(&self, i: usize) -> (&[u32], &[u32]) {
        let (a, b) = self.entries(i);
        (&self.hist_tokens[a..b], &self.hist_counts[a..b])
    }

    /// Row `i`'s entry biases (aligned with [`Self::history`]).
    pub fn bias(&self, i: usize) -> &[f32] {
        let (a, b) = self.entries(i);
        &self.hist_bias[a..b]
    }

    fn entries(&self, i: usize) -> (usize, usize) {
        (
            self.hist_offsets[i] as usize,
            self.hist_offsets[i + 1] as usize,
        )
    }

    /// Adds biases to the last row pushed: `bias` (token, value) pairs, and negative infinity
    /// for every `banned` token. A token already in the row's history keeps its entry (its
    /// penalties apply first); others get a [`BIAS_ONLY`] entry. Allocates (rare rows only:
    /// requests with `logit_bias` or `min_tokens`).
    pub fn bias_last_row(&mut self, bias: &[(u32, f32)], banned: &[u32]) {
        let Some(i) = self.len().checked_sub(1) else {
            return;
        };
        let (a, _) = self.entries(i);
        let mut row: Vec<(u32, u32, f32)> = (a..self.hist_tokens.len())
            .map(|j| (self.hist_tokens[j], self.hist_counts[j], self.hist_bias[j]))
            .collect();
        row.sort_unstable_by_key(|e| e.0);
        let extra = bias
            .iter()
            .copied()
            .chain(banned.iter().map(|&t| (t, f32::NEG_INFINITY)));
        for (t, v) in extra {
            match row.binary_search_by_key(&t, |e| e.0) {
                Ok(j) if v == f32::NEG_INFINITY => row[j].2 = v,
                Ok(j) => row[j].2 += v,
                Err(j) => row.insert(j, (t, BIAS_ONLY, v)),
            }
        }
        self.hist_tokens.truncate(a);
        self.hist_counts.truncate(a);
        self.hist_bias.truncate(a);
        for (t, c, v) in row {
            self.hist_tokens.push(t);
            self.hist_counts.push(c);
            self.hist_bias.push(v);
        }
        self.hist_offsets[i + 1] = self.hist_tokens.len() as u32;
    }

    /// Appends one row: its penalties, whether it wants its log-sum-exp, and its history as
    /// distinct tokens with output counts. Only what an active penalty reads is stored: output
    /// tokens when any penalty is on, prompt-only tokens when the repetition penalty is on.
    /// Allocates nothing once the columns have grown to a step's size.
    pub fn push_row(&mut self, pen: Penalties, want_lse: bool, prompt: &[u32], output: &[u32]) {
        self.push_row_after(pen, want_lse, prompt, output, &[]);
    }

    /// [`Self::push_row`] for a row whose history continues with `drafts` after `output` (a
    /// verify row: the drafts before its position count as output).
    pub fn push_row_after(
        &mut self,
        pen: Penalties,
        want_lse: bool,
        prompt: &[u32],
        output: &[u32],
        drafts: &[u32],
    ) {
        if self.hist_offsets.is_empty() {
            self.hist_offsets.push(0);
        }
        self.repetition.push(pen.repetition);
        self.presence.push(pen.presence);
        self.frequency.push(pen.frequency);
        self.want_lse.push(want_lse);
        self.mask_of.push(NO_MASK);
        let (rep, counts) = (pen.repetition_on(), pen.counts_on());
        if rep || counts {
            let start = self.hist_tokens.len();
            // Output tokens, sorted, compressed in place into (token, count) runs.
            self.hist_tokens.extend_from_slice(output);
            self.hist_tokens.extend_from_slice(drafts);
            self.hist_tokens[start..].sort_unstable();
            let end = self.hist_tokens.len();
            let (mut r, mut w) = (start, start);
            while r < end {
                let t = self.hist_tokens[r];
                let mut n = r + 1;
                while n < end && self.hist_tokens[n] == t {
                    n += 1;
                }
                self.hist_tokens[w] = t;
                self.hist_counts.push((n - r) as u32);
                w += 1;
                r = n;
            }
            self.hist_tokens.truncate(w);
            if rep {
                // Prompt tokens not in the output, sorted and deduplicated in place.
                for &t in prompt {
                    if self.hist_tokens[start..w].binary_search(&t).is_err() {
                        self.hist_tokens.push(t);
                    }
                }
                self.hist_tokens[w..].sort_unstable();
                let end = self.hist_tokens.len();
                let mut kept = w;
                for r in w..end {
                    let t = self.hist_tokens[r];
                    if kept == w || self.hist_tokens[kept - 1] != t {
                        self.hist_tokens[kept] = t;
                        kept += 1;
                    }
                }
                self.hist_tokens.truncate(kept);
                self.hist_counts.resize(kept, 0);
            }
        }
        self.hist_bias.resize(self.hist_tokens.len(), 0.0);
        self.hist_offsets.push(self.hist_tokens.len() as u32);
    }
}

/// The tail's result: the only per-step data that must come back to the host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleOut {
    /// Candidates per row (`SampleRows::k` capped at the vocabulary, at least 1).
    pub k: usize,
    /// `rows × k` token ids, best first (ties to the lower id). `cand_tokens[i * k]` is the
    /// row's argmax.
    pub cand_tokens: Vec<u32>,
    /// `rows × k` penalised logits of those tokens, as they are in the row (NaN included; the
    /// host maps NaN to negative infinity where the sampler policy sees it).
    pub cand_logits: Vec<f32>,
    /// Per row: log-sum-exp of the whole penalised row where `want_lse`, else 0.
    pub lse: Vec<f32>,
}

impl SampleOut {
    pub fn rows(&self) -> usize {
        self.lse.len()
    }

    /// Sizes every column for `rows` rows of `k` candidates without clearing what is there
    /// (so a kernel test can poison the buffers and see every element written).
    pub fn reshape(&mut self, rows: usize, k: usize) {
        self.k = k;
        self.cand_tokens.resize(rows * k, 0);
        self.cand_logits.resize(rows * k, 0.0);
        self.lse.resize(rows, 0.0);
    }
}
