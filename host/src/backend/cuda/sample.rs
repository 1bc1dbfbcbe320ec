//! The sampling tail on the CUDA backend: bf16 logits widened to f32, the launches of
//! `chimera_kernels::sample` (penalties, per-row top-K candidates, log-sum-exp), and the
//! step's one device-to-host copy into pinned memory, enqueued by `enqueue_sample` and waited
//! for by `finish_sample`, so the host can work while the device computes.

use chimera_kernels::sample::SampleArg;
use cudarc::driver::sys;

use super::device::Arg;
use super::memory::{self, Pinned, bad_tensor, dtoh};
use super::{BLOCK, CudaBackend, CudaStep, CudaTensor, grid_for, scratch_arg};
use crate::backend::{BackendError, DType, Result, SampleOut};

/// A read-back in flight: `rows × k` candidates (and `rows` log-sum-exps) land in the pinned
/// read-back buffer once `done` has completed.
pub(super) struct PendingRead {
    rows: usize,
    k: usize,
    done: sys::CUevent,
}

// SAFETY: a plain event handle of the backend's context (owned by its step clock).
unsafe impl Send for PendingRead {}

impl CudaBackend {
    pub(super) fn sample_and_wait(
        &self,
        logits: &mut CudaTensor,
        step: &CudaStep,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.enqueue_sample(logits, step, out)?;
        self.finish_sample(out)
    }

    pub(super) fn enqueue_sample(
        &self,
        logits: &mut CudaTensor,
        step: &CudaStep,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.step_ready(step)?;
        // A read-back started earlier and never finished is waited for (its pinned buffer
        // may be replaced below) and given up.
        if let Some(p) = self.lock_pending().take() {
            memory::wait_event(self.dev(), p.done)?;
        }
        let (rows, vocab) = logits.rows_cols();
        let n = step.dims.sample_rows;
        if rows != step.dims.logit_rows {
            return Err(BackendError::Invalid(format!(
                "{rows} logits rows for {} logit rows in the step",
                step.dims.logit_rows
            )));
        }
        let k = step.dims.k.min(vocab).max(1);
        out.reshape(n, k);
        if n == 0 {
            return Ok(());
        }
        // The tail works on f32 rows; bf16 logits are widened first.
        let widened;
        let lg: &CudaTensor = if logits.dtype == DType::F32 {
            logits
        } else {
            let w = self.tmp(&logits.shape, DType::F32)?;
            self.cast("cast_bf16_to_f32", &w, logits)?;
            widened = w;
            &widened
        };
        // Results land in one buffer: tokens [n·k] u32, logits [n·k] f32, lse [n] f32.
        let words = 2 * n * k + n;
        let res = self.tmp(&[words], DType::F32)?;
        self.launch_sample_tail(lg, step, (n, vocab, k), &res)?;
        // Penalties were applied to the f32 copy; keep the caller's rows in step with them.
        if logits.dtype != DType::F32 {
            self.cast("cast_f32_to_bf16", logits, lg)?;
        }
        self.enqueue_readback(&res, words, n, k)
    }

    /// `dst = src` elementwise through the cast kernel `entry` (the two the same length).
    fn cast(&self, entry: &str, dst: &CudaTensor, src: &CudaTensor) -> Result<()> {
        let len = src.len() as u64;
        self.launch_exact(
            entry,
            (grid_for(len, self.sm_count()), 1, 1),
            (BLOCK, 1, 1),
            0,
            &[Arg::Ptr(dst.ptr), Arg::Ptr(src.ptr), Arg::U64(len)],
        )
    }

    /// Launches the tail's kernels over the f32 logits `lg` (`n` sampled rows of `vocab`, `k`
    /// candidates a row), writing the results into `res`.
    fn launch_sample_tail(
        &self,
        lg: &CudaTensor,
        step: &CudaStep,
        (n, vocab, k): (usize, usize, usize),
        res: &CudaTensor,
    ) -> Result<()> {
        let (tok_ptr, cand_ptr, lse_ptr) = (
            res.ptr,
            res.ptr + 4 * (n * k) as u64,
            res.ptr + 8 * (n * k) as u64,
        );
        let scratch: Vec<CudaTensor> = chimera_kernels::sample::scratch_bytes(n, vocab, k)
            .into_iter()
            .map(|b| self.tmp(&[b.div_ceil(4).max(1)], DType::F32))
            .collect::<Result<_>>()?;
        let c = &step.cols;
        let masks = step
            .dims
            .masks
            .then(|| chimera_kernels::sample::mask_launch(n, vocab))
            .flatten();
        let launches = masks
            .into_iter()
            .chain(chimera_kernels::sample::launches(n, vocab, k));
        self.run_launches(launches, |a| {
            Ok(match *a {
                SampleArg::MaskOf => Arg::Ptr(step.col(c.mask_of)),
                SampleArg::Masks => Arg::Ptr(step.col(c.masks)),
                SampleArg::Logits => Arg::Ptr(lg.ptr),
                SampleArg::SampleRows => Arg::Ptr(step.col(c.sample_rows)),
                SampleArg::Repetition => Arg::Ptr(step.col(c.repetition)),
                SampleArg::Presence => Arg::Ptr(step.col(c.presence)),
                SampleArg::Frequency => Arg::Ptr(step.col(c.frequency)),
                SampleArg::WantLse => Arg::Ptr(step.col(c.want_lse)),
                SampleArg::HistOffsets => Arg::Ptr(step.col(c.hist_offsets)),
                SampleArg::HistTokens => Arg::Ptr(step.col(c.hist_tokens)),
                SampleArg::HistCounts => Arg::Ptr(step.col(c.hist_counts)),
                SampleArg::HistBias => Arg::Ptr(step.col(c.hist_bias)),
                SampleArg::CandTokens => Arg::Ptr(tok_ptr),
                SampleArg::CandLogits => Arg::Ptr(cand_ptr),
                SampleArg::Lse => Arg::Ptr(lse_ptr),
                SampleArg::Scratch(i) => scratch_arg(&scratch, i, "sampling")?,
                SampleArg::U32(v) => Arg::U32(v),
            })
        })
    }

    /// Enqueues the step's one device-to-host copy of `res` (`words` words: `n` rows of `k`
    /// candidates) into pinned memory, and marks the step's end on the clock.
    fn enqueue_readback(&self, res: &CudaTensor, words: usize, n: usize, k: usize) -> Result<()> {
        // The step's one device-to-host copy; `sample_finish` waits for it.
        let bytes = 4 * words;
        let mut rb = self
            .inner
            .readback
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if rb.as_ref().is_none_or(|p| p.bytes < bytes) {
            *rb = Some(Pinned::new(self.dev(), bytes.next_power_of_two())?);
        }
        let Some(pinned) = rb.as_mut() else {
            return Err(bad_tensor("readback"));
        };
        let dst = &mut pinned.as_mut_slice()[..bytes];
        // SAFETY: `res` holds `bytes`; the pinned buffer is only replaced by a later
        // `sample_start`, which first waits for this read-back.
        unsafe { dtoh(self.dev(), self.stream(), dst, res.ptr)? };
        let done = self.record_step_end()?;
        *self.lock_pending() = Some(PendingRead { rows: n, k, done });
        Ok(())
    }

    pub(super) fn sample_landed(&self) -> bool {
        self.lock_pending()
            .as_ref()
            .is_none_or(|p| memory::event_done(p.done))
    }

    pub(super) fn finish_sample(&self, out: &mut SampleOut) -> Result<()> {
        let Some(p) = self.lock_pending().take() else {
            return Ok(());
        };
        memory::poll_event(self.dev(), p.done)?;
        let (n, k) = (p.rows, p.k);
        if out.cand_tokens.len() != n * k || out.lse.len() != n {
            return Err(BackendError::Invalid(format!(
                "finishing a read-back of {n} rows of {k} into columns of another shape"
            )));
        }
        let rb = self
            .inner
            .readback
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(pinned) = rb.as_ref() else {
            return Err(bad_tensor("readback"));
        };
        let src = &pinned.as_slice()[..4 * (2 * n * k + n)];
        let (tokens, rest) = src.split_at(4 * n * k);
        let (logits, lse) = rest.split_at(4 * n * k);
        memory::read_words(tokens, &mut out.cand_tokens, |w| w);
        memory::read_words(logits, &mut out.cand_logits, f32::from_bits);
        memory::read_words(lse, &mut out.lse, f32::from_bits);
        Ok(())
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Option<PendingRead>> {
        self.inner
            .pending_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}
