//! One choice's life after admission: engine events in, text chunks out.
//!
//! Owns: [`ChoiceRun`] (the event receiver of one engine request, its detokenizer and stop
//! matcher, and timing metrics) and [`RequestGuard`] (cancels the engine request when the run is
//! dropped before the engine finished it: a client that disconnects drops the response future
//! or body stream, which drops the run, which cancels within one engine step). Invariants: every
//! submitted engine request ends in exactly one of finish, cancel-on-drop, or cancel-on-stop;
//! detokenization runs on the blocking pool, never on the event loop; the admission permit is
//! released when the run ends. It must not format HTTP bodies.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, mpsc, watch};

use super::detok::{IncrementalDetokenizer, StopMatcher};
use super::error::AppError;
use super::metrics::{Finished, Metrics};
use super::text::{TextCodec, TextError};
use crate::engine::api::{
    EngineEvent, EngineHandle, FailureKind, FinishReason, TokenLogprob, Usage,
};

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
}

/// Everything the blocking pool needs to turn events into text (moved there and back).
pub struct OutputState {
    codec: Arc<TextCodec>,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    stop_ids: HashSet<u32>,
    generated: u32,
    stop_token: Option<u32>,
    /// Stop tokens and strings end the output only from this many generated tokens on.
    min_tokens: u32,
}

/// Result of processing a batch of events.
#[derive(Debug, Default)]
struct Processed {
    text: String,
    logprobs: Vec<TokenInfo>,
    prompt_logprobs: Option<Vec<Option<TokenInfo>>>,
    token_ids: Vec<u32>,
    stop_string: Option<String>,
    finished: Option<(FinishReason, Usage)>,
    failed: Option<(FailureKind, String)>,
}

impl OutputState {
    pub fn new(
        codec: Arc<TextCodec>,
        prompt_tail: &[u32],
        stops: Vec<String>,
        stop_ids: HashSet<u32>,
        skip_special: bool,
    ) -> Self {
        Self {
            detok: IncrementalDetokenizer::new(&codec, prompt_tail, skip_special),
            codec,
            stop: StopMatcher::new(stops),
            stop_ids,
            generated: 0,
            stop_token: None,
            min_tokens: 0,
        }
    }

    /// vLLM's `min_tokens` (stops are not matched before) and `include_stop_str_in_output`
    /// (a matched stop string stays in the text).
    pub fn with_stop_rules(mut self, min_tokens: u32, include_stop: bool) -> Self {
        self.min_tokens = min_tokens;
        self.stop = std::mem::take(&mut self.stop).including_stop(include_stop);
        self
    }

    fn token_info(&self, lp: &TokenLogprob) -> Result<TokenInfo, TextError> {
        let text = |t: u32| self.codec.decode(&[t], false);
        let top = lp
            .top
            .iter()
            .map(|(t, l)| Ok((*t, text(*t)?, *l)))
            .collect::<Result<_, TextError>>()?;
        Ok(TokenInfo {
            id: lp.token,
            token: text(lp.token)?,
            logprob: lp.logprob,
            rank: lp.rank,
            top,
        })
    }

    fn process(&mut self, events: Vec<EngineEvent>) -> Result<Processed, TextError> {
        let mut out = Processed::default();
        for ev in events {
            match ev {
                EngineEvent::PromptLogprobs { logprobs } => {
                    out.prompt_logprobs = Some(
                        logprobs
                            .iter()
                            .map(|lp| lp.as_ref().map(|lp| self.token_info(lp)).transpose())
                            .collect::<Result<_, _>>()?,
                    );
                }
                EngineEvent::Tokens { tokens, logprobs } => {
                    for (j, t) in tokens.iter().enumerate() {
                        self.generated += 1;
                        out.token_ids.push(*t);
                        if let Some(lp) = logprobs.as_ref().and_then(|l| l.get(j)) {
                            out.logprobs.push(self.token_info(lp)?);
                        }
                        let armed = self.generated >= self.min_tokens;
                        if armed && self.stop_ids.contains(t) {
                            // A stop token ends the text; the engine's Finished follows.
                            self.stop_token = Some(*t);
                            continue;
                        }
                        let delta = self.detok.push(&self.codec, *t)?;
                        if !armed {
                            out.text.push_str(&self.stop.push_unmatched(&delta));
                            continue;
                        }
                        let released = self.stop.push(&delta);
                        out.text.push_str(&released.text);
                        if released.stopped.is_some() {
                            out.stop_string = released.stopped;
                            return Ok(out);
                        }
                    }
                }
                EngineEvent::Finished { reason, usage } => {
                    let tail = self.detok.flush(&self.codec)?;
                    let released = self.stop.push(&tail);
                    out.text.push_str(&released.text);
                    if released.stopped.is_some() {
                        out.stop_string = released.stopped;
                    } else {
                        out.text.push_str(&self.stop.finish());
                    }
                    out.finished = Some((reason, usage));
                    return Ok(out);
                }
                EngineEvent::Failed { kind, message } => {
                    out.failed = Some((kind, message));
                    return Ok(out);
                }
            }
        }
        Ok(out)
    }
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
    // Declared before `rx` so that on drop the cancel is sent before the receiver closes.
    guard: RequestGuard,
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    state: Option<OutputState>,
    abort: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    start: Instant,
    retry_after_secs: u32,
    request_id: Arc<str>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Generated ids not yet sent (their text is still held back).
    held_ids: Vec<u32>,
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
        rx: mpsc::UnboundedReceiver<EngineEvent>,
        guard: RequestGuard,
        state: OutputState,
        ctx: RunContext,
    ) -> Self {
        Self {
            index,
            prompt_idx,
            rx,
            guard,
            state: Some(state),
            abort: ctx.abort,
            metrics: ctx.metrics,
            start: ctx.start,
            retry_after_secs: ctx.retry_after_secs,
            request_id: ctx.request_id,
            first_token: None,
            last_token: None,
            held_ids: Vec::new(),
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
        }
    }

    fn observe_tokens(&mut self, events: &[EngineEvent]) {
        let n: usize = events
            .iter()
            .map(|e| {
                if let EngineEvent::Tokens { tokens, .. } = e {
                    tokens.len()
                } else {
                    0
                }
            })
            .sum();
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
            let generated = self.state.as_ref().map_or(0, |s| s.generated);
            tracing::debug!(
                request_id = %self.request_id,
                choice = self.index,
                engine_id = self.guard.id,
                finish = how.as_str(),
                prompt_tokens = usage.map(|u| u.prompt_tokens),
                output_tokens = usage.map_or(generated, |u| u.completion_tokens),
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
            while let Some(ev) = self.rx.recv().await {
                if let EngineEvent::Finished { usage, .. } = ev {
                    return Some(usage);
                }
                if let EngineEvent::Failed { .. } = ev {
                    return None;
                }
            }
            None
        };
        tokio::time::timeout(Duration::from_secs(2), wait)
            .await
            .ok()
            .flatten()
    }

    /// The next chunk of output; `None` once the choice is over.
    pub async fn next(&mut self) -> Option<Result<ChoiceChunk, AppError>> {
        loop {
            if self.done {
                return None;
            }
            let first = tokio::select! {
                ev = self.rx.recv() => ev,
                _ = aborted(&mut self.abort) => {
                    self.guard.cancel_now();
                    let usage = self.drain_usage().await.unwrap_or_default();
                    self.end(Finished::Abort, Some(&usage));
                    let finish = FinishInfo { reason: "abort", stop_reason: None, usage };
                    return Some(Ok(self.chunk(String::new(), Vec::new(), Some(finish))));
                }
            };
            let Some(first) = first else {
                self.guard.disarm();
                self.end(Finished::Abort, None);
                return Some(Err(AppError::Internal(
                    "the engine dropped a request without finishing it".into(),
                )));
            };
            let mut events = vec![first];
            while !matches!(
                events.last(),
                Some(EngineEvent::Finished { .. } | EngineEvent::Failed { .. })
            ) {
                match self.rx.try_recv() {
                    Ok(ev) => events.push(ev),
                    Err(_) => break,
                }
            }
            self.observe_tokens(&events);
            let Some(mut state) = self.state.take() else {
                self.done = true;
                return Some(Err(AppError::Internal("output state lost".into())));
            };
            let joined = tokio::task::spawn_blocking(move || {
                let r = state.process(events);
                (state, r)
            })
            .await;
            let (state, result) = match joined {
                Ok(v) => v,
                Err(e) => {
                    self.done = true;
                    return Some(Err(AppError::Internal(format!(
                        "detokenizer task failed: {e}"
                    ))));
                }
            };
            let generated = state.generated;
            let stop_token = state.stop_token;
            self.state = Some(state);
            let out = match result {
                Ok(out) => out,
                Err(e) => {
                    self.end(Finished::Abort, None);
                    self.guard.cancel_now();
                    return Some(Err(AppError::Internal(e.to_string())));
                }
            };
            if let Some((kind, message)) = out.failed {
                self.guard.disarm();
                self.end(Finished::Abort, None);
                return Some(Err(AppError::Engine {
                    kind,
                    message,
                    retry_after_secs: self.retry_after_secs,
                }));
            }
            let finish = if let Some(stop) = out.stop_string {
                self.guard.cancel_now();
                let mut usage = self.drain_usage().await.unwrap_or_default();
                usage.completion_tokens = generated;
                self.end(Finished::Stop, Some(&usage));
                Some(FinishInfo {
                    reason: "stop",
                    stop_reason: Some(Value::String(stop)),
                    usage,
                })
            } else if let Some((reason, usage)) = out.finished {
                self.guard.disarm();
                let (name, how) = match reason {
                    FinishReason::Stop => ("stop", Finished::Stop),
                    FinishReason::Length => ("length", Finished::Length),
                    FinishReason::Cancelled => ("abort", Finished::Abort),
                };
                self.end(how, Some(&usage));
                let stop_reason = stop_token.map(Value::from);
                Some(FinishInfo {
                    reason: name,
                    stop_reason,
                    usage,
                })
            } else {
                None
            };
            if out.text.is_empty()
                && out.logprobs.is_empty()
                && out.prompt_logprobs.is_none()
                && finish.is_none()
            {
                // Ids whose text is not out yet ride with the next chunk.
                self.held_ids.extend(out.token_ids);
                continue;
            }
            let mut chunk = self.chunk(out.text, out.logprobs, finish);
            chunk.prompt_logprobs = out.prompt_logprobs;
            chunk.token_ids = std::mem::take(&mut self.held_ids);
            chunk.token_ids.extend(out.token_ids);
            return Some(Ok(chunk));
        }
    }

    /// Runs to the end and returns the whole output as one chunk.
    pub async fn collect(mut self) -> Result<ChoiceChunk, AppError> {
        let mut all = self.chunk(String::new(), Vec::new(), None);
        while let Some(c) = self.next().await {
            let c = c?;
            all.text.push_str(&c.text);
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
