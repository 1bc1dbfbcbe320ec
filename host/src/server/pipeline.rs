//! One choice's life after admission: processed output in, text chunks out.
//!
//! Owns: [`ChoiceRun`] (the [`OutputSlot`] the replica's output pass fills for one engine
//! request, its finish and timing metrics) and [`RequestGuard`] (cancels the engine request
//! when the run is dropped before the engine finished it: a client that disconnects drops the
//! response future or body stream, which drops the run, which cancels within one engine step).
//! Invariants: every submitted engine request ends in exactly one of finish, cancel-on-drop,
//! or cancel-on-stop; detokenization runs in the output pass (`server::output`), never on the
//! event loop; the admission permit is released when the run ends. It must not format HTTP
//! bodies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, watch};

use super::agent::CallDelta;
use super::error::AppError;
use super::metrics::{Finished, Metrics};
use super::output::{OutputSlot, Processed};
use crate::engine::api::{EngineHandle, FinishReason, Usage};

/// Cancels the engine request on drop unless the engine already finished it.
pub struct RequestGuard {
    handle: EngineHandle,
    id: u64,
    armed: bool,
    metrics: Arc<Metrics>,
    _permit: OwnedSemaphorePermit,
}

impl RequestGuard {
    pub fn new(
        handle: EngineHandle,
        id: u64,
        metrics: Arc<Metrics>,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        metrics.in_flight_add(1);
        Self {
            handle,
            id,
            armed: true,
            metrics,
            _permit: permit,
        }
    }

    /// The engine finished (or failed) the request: nothing to cancel.
    fn disarm(&mut self) {
        self.armed = false;
    }

    /// The server itself ends the request (stop string, shutdown).
    fn cancel_now(&mut self) {
        if self.armed {
            self.handle.cancel(self.id);
            self.armed = false;
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!(
                engine_id = self.id,
                "request cancelled: the client went away"
            );
            self.handle.cancel(self.id);
            self.metrics.client_disconnect();
            self.metrics.finished(Finished::Abort);
        }
        self.metrics.in_flight_add(-1);
    }
}

/// Logprob of one output token, already turned into text.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    /// Rank in the whole distribution, where the engine computed it (prompt logprobs).
    pub rank: Option<u32>,
    /// (id, text, logprob), best first.
    pub top: Vec<(u32, String, f32)>,
}

/// How a choice ended.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishInfo {
    /// OpenAI finish_reason: "stop", "length" or "abort".
    pub reason: &'static str,
    /// The stop string or stop token id that ended it, if any.
    pub stop_reason: Option<Value>,
    pub usage: Usage,
}

/// A piece of one choice's output.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceChunk {
    pub index: u32,
    pub prompt_idx: usize,
    pub text: String,
    pub logprobs: Vec<TokenInfo>,
    /// The prompt tokens' logprobs (first `None`), in the chunk where they arrive (`echo` with
    /// `logprobs`).
    pub prompt_logprobs: Option<Vec<Option<TokenInfo>>>,
    /// The token ids this chunk adds (every generated id up to where the text stops,
    /// a stop token included).
    pub token_ids: Vec<u32>,
    pub finish: Option<FinishInfo>,
    /// Reasoning text split out of the response (chat, with a reasoning parser).
    pub reasoning: String,
    /// Tool-call pieces (chat, with a tool-call parser).
    pub calls: Vec<CallDelta>,
}

/// What every choice of one HTTP request shares.
#[derive(Clone)]
pub struct RunContext {
    /// Turns true when the server cancels everything in flight (shutdown).
    pub abort: watch::Receiver<bool>,
    pub metrics: Arc<Metrics>,
    /// When the HTTP request arrived (time to first token, end-to-end latency).
    pub start: Instant,
    /// `Retry-After` for an engine failure worth retrying (a full queue).
    pub retry_after_secs: u32,
    /// The response's id (`cmpl-…`), for the log.
    pub request_id: Arc<str>,
}

/// One engine request being turned into output chunks.
pub struct ChoiceRun {
    index: u32,
    prompt_idx: usize,
    guard: RequestGuard,
    slot: Arc<OutputSlot>,
    abort: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    start: Instant,
    retry_after_secs: u32,
    request_id: Arc<str>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Generated tokens so far (for the log of a run that ends without usage).
    generated: u32,
    /// Generated ids not yet sent (their text is still held back).
    held_ids: Vec<u32>,
    /// The parser found a tool call in this choice: a natural end is `tool_calls`.
    made_calls: bool,
    done: bool,
}

async fn aborted(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl ChoiceRun {
    pub fn new(
        index: u32,
        prompt_idx: usize,
        slot: Arc<OutputSlot>,
        guard: RequestGuard,
        ctx: RunContext,
    ) -> Self {
        Self {
            index,
            prompt_idx,
            slot,
            guard,
            abort: ctx.abort,
            metrics: ctx.metrics,
            start: ctx.start,
            retry_after_secs: ctx.retry_after_secs,
            request_id: ctx.request_id,
            first_token: None,
            last_token: None,
            generated: 0,
            held_ids: Vec::new(),
            made_calls: false,
            done: false,
        }
    }

    fn chunk(
        &self,
        text: String,
        logprobs: Vec<TokenInfo>,
        finish: Option<FinishInfo>,
    ) -> ChoiceChunk {
        ChoiceChunk {
            index: self.index,
            prompt_idx: self.prompt_idx,
            text,
            logprobs,
            prompt_logprobs: None,
            token_ids: Vec::new(),
            finish,
            reasoning: String::new(),
            calls: Vec::new(),
        }
    }

    /// Time to first token and inter-token latency, for `n` tokens that arrived now.
    fn observe_tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => {
                self.first_token = Some(now);
                self.metrics.ttft.observe((now - self.start).as_secs_f64());
            }
            Some(last) => {
                let gap = (now - last).as_secs_f64() / n as f64;
                for _ in 0..n {
                    self.metrics.itl.observe(gap);
                }
            }
        }
        self.last_token = Some(now);
    }

    fn end(&mut self, how: Finished, usage: Option<&Usage>) {
        self.done = true;
        self.metrics.finished(how);
        let e2e = self.start.elapsed();
        self.metrics.e2e.observe(e2e.as_secs_f64());
        if tracing::enabled!(tracing::Level::DEBUG) {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(
                request_id = %self.request_id,
                choice = self.index,
                engine_id = self.guard.id,
                finish = how.as_str(),
                prompt_tokens = usage.map(|u| u.prompt_tokens),
                output_tokens = usage.map_or(self.generated, |u| u.completion_tokens),
                cached_tokens = usage.map(|u| u.cached_tokens),
                ttft_ms = self.first_token.map(|t| ms(t - self.start)),
                e2e_ms = ms(e2e),
                "request finished"
            );
        }
    }

    /// Waits for the engine's own end of a request the server cancelled, for its usage.
    async fn drain_usage(&mut self) -> Option<Usage> {
        let wait = async {
            loop {
                let p = self.slot.take().await;
                if let Some((_, usage)) = p.finished {
                    return Some(usage);
                }
                if p.failed.is_some() || p.error.is_some() {
                    return None;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(2), wait)
            .await
            .ok()
            .flatten()
    }

    /// The server cancels everything in flight (shutdown): the choice ends as aborted.
    async fn abort_chunk(&mut self) -> ChoiceChunk {
        self.guard.cancel_now();
        let usage = self.drain_usage().await.unwrap_or_default();
        self.end(Finished::Abort, Some(&usage));
        let finish = FinishInfo {
            reason: "abort",
            stop_reason: None,
            usage,
        };
        self.chunk(String::new(), Vec::new(), Some(finish))
    }

    /// The next chunk of output; `None` once the choice is over.
    pub async fn next(&mut self) -> Option<Result<ChoiceChunk, AppError>> {
        loop {
            if self.done {
                return None;
            }
            let out = tokio::select! {
                out = self.slot.take() => out,
                _ = aborted(&mut self.abort) => return Some(Ok(self.abort_chunk().await)),
            };
            self.observe_tokens(out.tokens);
            self.generated = out.generated;
            if let Some(chunk) = self.take(out).await.transpose() {
                return Some(chunk);
            }
        }
    }

    /// What one processed output makes: an error, a chunk, or nothing yet (ids whose text is
    /// held back ride with the next chunk).
    async fn take(&mut self, mut out: Processed) -> Result<Option<ChoiceChunk>, AppError> {
        if let Some(e) = out.error.take() {
            self.end(Finished::Abort, None);
            self.guard.cancel_now();
            return Err(AppError::Internal(e));
        }
        if let Some((kind, message)) = out.failed.take() {
            self.guard.disarm();
            self.end(Finished::Abort, None);
            return Err(AppError::Engine {
                kind,
                message,
                retry_after_secs: self.retry_after_secs,
            });
        }
        self.made_calls |= !out.calls.is_empty();
        if out.parse_failures > 0 {
            self.metrics.parse_failures(out.parse_failures);
        }
        let mut finish = self.finish_of(&mut out).await;
        if let Some(f) = finish.as_mut()
            && self.made_calls
            && f.reason == "stop"
        {
            f.reason = "tool_calls";
        }
        if out.text.is_empty()
            && out.reasoning.is_empty()
            && out.calls.is_empty()
            && out.logprobs.is_empty()
            && out.prompt_logprobs.is_none()
            && finish.is_none()
        {
            self.held_ids.extend(out.token_ids);
            return Ok(None);
        }
        let mut chunk = self.chunk(out.text, out.logprobs, finish);
        chunk.reasoning = out.reasoning;
        chunk.calls = out.calls;
        chunk.prompt_logprobs = out.prompt_logprobs;
        chunk.token_ids = std::mem::take(&mut self.held_ids);
        chunk.token_ids.extend(out.token_ids);
        Ok(Some(chunk))
    }

    /// How the choice ends with this output, if it does: a stop string (the server cancels
    /// the engine request and reports the engine's usage up to the stop), or the engine's
    /// own end.
    async fn finish_of(&mut self, out: &mut Processed) -> Option<FinishInfo> {
        if let Some(stop) = out.stop_string.take() {
            self.guard.cancel_now();
            let usage = match out.finished.take() {
                Some((_, usage)) => Some(usage),
                None => self.drain_usage().await,
            };
            let mut usage = usage.unwrap_or_default();
            usage.completion_tokens = out.generated;
            self.end(Finished::Stop, Some(&usage));
            return Some(FinishInfo {
                reason: "stop",
                stop_reason: Some(Value::String(stop)),
                usage,
            });
        }
        let (reason, usage) = out.finished.take()?;
        self.guard.disarm();
        let (name, how) = match reason {
            FinishReason::Stop => ("stop", Finished::Stop),
            FinishReason::Length => ("length", Finished::Length),
            FinishReason::Cancelled => ("abort", Finished::Abort),
        };
        self.end(how, Some(&usage));
        Some(FinishInfo {
            reason: name,
            stop_reason: out.stop_token.map(Value::from),
            usage,
        })
    }

    /// Runs to the end and returns the whole output as one chunk.
    pub async fn collect(mut self) -> Result<ChoiceChunk, AppError> {
        let mut all = self.chunk(String::new(), Vec::new(), None);
        while let Some(c) = self.next().await {
            let c = c?;
            all.text.push_str(&c.text);
            all.reasoning.push_str(&c.reasoning);
            for d in c.calls {
                match all.calls.iter_mut().find(|a| a.index == d.index) {
                    Some(a) => a.arguments.push_str(&d.arguments),
                    None => all.calls.push(d),
                }
            }
            all.logprobs.extend(c.logprobs);
            all.token_ids.extend(c.token_ids);
            if c.prompt_logprobs.is_some() {
                all.prompt_logprobs = c.prompt_logprobs;
            }
            if c.finish.is_some() {
                all.finish = c.finish;
            }
        }
        Ok(all)
    }

    /// The run as a stream of chunks.
    pub fn into_stream(
        self,
    ) -> impl futures_util::Stream<Item = Result<ChoiceChunk, AppError>> + Send {
        futures_util::stream::unfold(
            self,
            |mut run| async move { run.next().await.map(|c| (c, run)) },
        )
    }
}
