//! The output pass of one replica: engine events in, text out, once per engine step for all
//! of the step's requests (as vLLM's output processor).
//!
//! Owns: [`OutputPass`] (a thread per replica that reads the replica's shared event stream,
//! one [`EventBatch`] per engine step, and runs each request's [`OutputState`] — incremental
//! detokenizer, stop matcher, logprob texts — over that request's events of the step) and
//! [`OutputSlot`] (where one request's processed output waits for its HTTP response task).
//!
//! Invariants: a request is registered before it is submitted to the engine (the
//! registration is on the pass's queue before any event of the request can be); each request
//! is processed once per batch, its events in order; a slot holds at most one [`Processed`]:
//! output that arrives while the previous one is unread is merged into it, so a slow client
//! costs memory for its own text only and never holds up the pass; a request leaves the pass
//! with its `Finished` or `Failed` event. It must not format HTTP bodies.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::Notify;

use super::agent::CallDelta;
use super::detok::{IncrementalDetokenizer, StopMatcher};
use super::error::AppError;
use super::pipeline::TokenInfo;
use super::text::{TextCodec, TextError};
use crate::engine::api::{
    EngineEvent, EventBatch, EventSender, FailureKind, FinishReason, SharedEvents, TokenLogprob,
    Usage,
};
use crate::policy::{OutputParser, ParseRequest};
use chimera_policy_core::Parsed;
use chimera_policy_core::columns::parsed_kind;

/// One request's text state: everything that turns its events into text.
pub struct OutputState {
    codec: Arc<TextCodec>,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    stop_ids: HashSet<u32>,
    generated: u32,
    stop_token: Option<u32>,
    /// Stop tokens and strings end the output only from this many generated tokens on.
    min_tokens: u32,
    /// A stop string ended the text: later events only bring the engine's end.
    stopped: bool,
    /// What the response is parsed for (tool calls, reasoning), and its parser once opened.
    parse: Option<ParseRequest>,
    parser: Option<u32>,
    /// Prefix of this response's tool-call ids.
    call_ids: String,
}

/// What one pass made of a request's events (several merged, when its reader was slow).
#[derive(Debug, Default)]
pub struct Processed {
    pub text: String,
    pub logprobs: Vec<TokenInfo>,
    pub prompt_logprobs: Option<Vec<Option<TokenInfo>>>,
    pub token_ids: Vec<u32>,
    /// Generated tokens these events brought.
    pub tokens: usize,
    /// Generated tokens so far, and the stop token that ended the text, if any.
    pub generated: u32,
    pub stop_token: Option<u32>,
    pub stop_string: Option<String>,
    pub finished: Option<(FinishReason, Usage)>,
    pub failed: Option<(FailureKind, String)>,
    /// The text could not be made (a token the tokenizer cannot decode).
    pub error: Option<String>,
    /// Reasoning text the parser split out of the response.
    pub reasoning: String,
    /// Tool-call pieces the parser found, in order.
    pub calls: Vec<CallDelta>,
    /// Malformed tool calls the parser returned as text.
    pub parse_failures: u32,
}

impl Processed {
    /// Appends `later` (output of later events of the same request).
    fn merge(&mut self, later: Processed) {
        self.text.push_str(&later.text);
        self.logprobs.extend(later.logprobs);
        if later.prompt_logprobs.is_some() {
            self.prompt_logprobs = later.prompt_logprobs;
        }
        self.token_ids.extend(later.token_ids);
        self.tokens += later.tokens;
        self.generated = later.generated;
        self.stop_token = later.stop_token.or(self.stop_token);
        self.stop_string = self.stop_string.take().or(later.stop_string);
        self.finished = self.finished.take().or(later.finished);
        self.failed = self.failed.take().or(later.failed);
        self.error = self.error.take().or(later.error);
        self.reasoning.push_str(&later.reasoning);
        self.calls.extend(later.calls);
        self.parse_failures += later.parse_failures;
    }

    /// Whether the request's output ends here.
    fn is_last(&self) -> bool {
        self.finished.is_some() || self.failed.is_some() || self.error.is_some()
    }
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
            stopped: false,
            parse: None,
            parser: None,
            call_ids: String::new(),
        }
    }

    /// Parses the response for tool calls and reasoning (with the output pass's parser);
    /// `call_ids` prefixes its tool calls' ids.
    pub fn with_parsing(mut self, request: ParseRequest, call_ids: String) -> Self {
        self.parse = Some(request);
        self.call_ids = call_ids;
        self
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

    /// Turns a request's events (in order) into text, logprobs and its end; with a parse
    /// request and the pass's `parser`, the text is split into content, reasoning and tool
    /// calls.
    pub fn process(
        &mut self,
        events: impl IntoIterator<Item = EngineEvent>,
        parser: Option<&mut (dyn OutputParser + '_)>,
    ) -> Processed {
        let mut out = Processed::default();
        if let Err(e) = self.process_into(events, &mut out) {
            out.error = Some(e.to_string());
        }
        out.generated = self.generated;
        out.stop_token = self.stop_token;
        if let (true, Some(parser)) = (self.parse.is_some(), parser) {
            self.parse_text(parser, &mut out);
        }
        out
    }

    /// Runs `out.text` through the response's parser (opened at its first text).
    fn parse_text(&mut self, parser: &mut dyn OutputParser, out: &mut Processed) {
        let ends = out.is_last() || out.stop_string.is_some();
        if out.text.is_empty() && !ends {
            return;
        }
        let id = match (self.parser, &self.parse) {
            (Some(id), _) => id,
            (None, None) => return,
            (None, Some(request)) => match parser.open(request) {
                Ok(id) => {
                    self.parser = Some(id);
                    id
                }
                Err(why) => {
                    // The text stays as it is.
                    tracing::warn!(error = %why, "the response's parser could not be opened");
                    out.parse_failures += 1;
                    self.parse = None;
                    return;
                }
            },
        };
        let text = std::mem::take(&mut out.text);
        let mut parsed = parser.feed(id, &text);
        if ends {
            parsed.extend(parser.finish(id));
            self.parser = None;
            self.parse = None;
        }
        self.take_parsed(parsed, out);
    }

    fn take_parsed(&self, parsed: Parsed, out: &mut Processed) {
        for ((kind, call), text) in parsed.kinds.into_iter().zip(parsed.calls).zip(parsed.texts) {
            match kind {
                parsed_kind::CONTENT => out.text.push_str(&text),
                parsed_kind::REASONING => out.reasoning.push_str(&text),
                parsed_kind::CALL_BEGIN => out.calls.push(CallDelta {
                    index: call,
                    id: Some(format!("{}{call}", self.call_ids)),
                    name: Some(text),
                    arguments: String::new(),
                }),
                parsed_kind::CALL_ARGUMENTS => match out.calls.last_mut() {
                    Some(last) if last.index == call => last.arguments.push_str(&text),
                    _ => out.calls.push(CallDelta {
                        index: call,
                        id: None,
                        name: None,
                        arguments: text,
                    }),
                },
                _ => {
                    tracing::warn!(reason = %text, "a tool call could not be parsed; it is returned as text");
                    out.parse_failures += 1;
                }
            }
        }
    }

    fn process_into(
        &mut self,
        events: impl IntoIterator<Item = EngineEvent>,
        out: &mut Processed,
    ) -> Result<(), TextError> {
        for ev in events {
            match ev {
                EngineEvent::Finished { reason, usage } => {
                    if !self.stopped {
                        self.flush_text(out)?;
                    }
                    out.finished = Some((reason, usage));
                    return Ok(());
                }
                EngineEvent::Failed { kind, message } => {
                    out.failed = Some((kind, message));
                    return Ok(());
                }
                // After a stop string only the engine's end matters.
                _ if self.stopped => {}
                EngineEvent::PromptLogprobs { logprobs } => {
                    out.prompt_logprobs = Some(
                        logprobs
                            .iter()
                            .map(|lp| lp.as_ref().map(|lp| self.token_info(lp)).transpose())
                            .collect::<Result<_, _>>()?,
                    );
                }
                EngineEvent::Tokens { tokens, logprobs } => {
                    self.push_tokens(&tokens, logprobs.as_deref(), out)?;
                }
            }
        }
        Ok(())
    }

    fn push_tokens(
        &mut self,
        tokens: &[u32],
        logprobs: Option<&[TokenLogprob]>,
        out: &mut Processed,
    ) -> Result<(), TextError> {
        for (j, t) in tokens.iter().enumerate() {
            self.generated += 1;
            out.tokens += 1;
            out.token_ids.push(*t);
            if let Some(lp) = logprobs.and_then(|l| l.get(j)) {
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
                self.stopped = true;
                return Ok(());
            }
        }
        Ok(())
    }

    /// The engine finished: the text held back (an unfinished character, a possible stop
    /// string's start) goes out.
    fn flush_text(&mut self, out: &mut Processed) -> Result<(), TextError> {
        let tail = self.detok.flush(&self.codec)?;
        let released = self.stop.push(&tail);
        out.text.push_str(&released.text);
        if released.stopped.is_some() {
            out.stop_string = released.stopped;
        } else {
            out.text.push_str(&self.stop.finish());
        }
        Ok(())
    }
}

/// Where one request's processed output waits for its reader: at most one [`Processed`],
/// later output merged into it.
#[derive(Default)]
pub struct OutputSlot {
    pending: Mutex<Option<Processed>>,
    ready: Notify,
}

impl OutputSlot {
    fn put(&self, p: Processed) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        match pending.as_mut() {
            Some(earlier) => earlier.merge(p),
            None => *pending = Some(p),
        }
        drop(pending);
        self.ready.notify_one();
    }

    /// The output that arrived since the last call, waiting for some if there is none.
    pub async fn take(&self) -> Processed {
        loop {
            let taken = self
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(p) = taken {
                return p;
            }
            // A `put` between the check and here left a permit: this returns at once.
            self.ready.notified().await;
        }
    }
}

enum Registration {
    Open {
        id: u64,
        state: Box<OutputState>,
        slot: Arc<OutputSlot>,
    },
    /// The request never reached the engine.
    Forget { id: u64 },
}

/// The output pass of one replica (see the module doc).
pub struct OutputPass {
    events: SharedEvents,
    registrations: Sender<Registration>,
    thread: Option<JoinHandle<()>>,
}

impl OutputPass {
    /// Starts the pass of replica `replica` on a thread of its own, with the parser plugin
    /// instance its responses are parsed with (`None`: text is never parsed).
    pub fn spawn(replica: usize, parser: Option<Box<dyn OutputParser>>) -> std::io::Result<Self> {
        let (events, batches) = SharedEvents::channel();
        let (registrations, registered) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("chimera-output-{replica}"))
            .spawn(move || run(batches, registered, parser))?;
        Ok(Self {
            events,
            registrations,
            thread: Some(thread),
        })
    }

    /// Where the engine sends the events of requests registered here.
    pub fn events(&self) -> EventSender {
        EventSender::Shared(self.events.clone())
    }

    /// Registers request `id` with its text state, before it is submitted; its output
    /// arrives in the returned slot.
    pub fn register(&self, id: u64, state: OutputState) -> Result<Arc<OutputSlot>, AppError> {
        let slot = Arc::new(OutputSlot::default());
        let reg = Registration::Open {
            id,
            state: Box::new(state),
            slot: slot.clone(),
        };
        self.registrations
            .send(reg)
            .map_err(|_| AppError::Internal("the output pass has stopped".into()))?;
        Ok(slot)
    }

    /// Drops a registered request that was never submitted.
    pub fn forget(&self, id: u64) {
        let _ = self.registrations.send(Registration::Forget { id });
    }
}

impl Drop for OutputPass {
    fn drop(&mut self) {
        // The thread ends once every sender of the event stream is gone (the engine's too),
        // which may be after the server: it is not waited for.
        drop(self.thread.take());
    }
}

struct Entry {
    state: Box<OutputState>,
    slot: Arc<OutputSlot>,
    /// This batch's events of the request.
    events: Vec<EngineEvent>,
}

/// The pass's open requests and its registrations. However the thread ends (the engine's
/// stream closed, or a panic), every request still waiting for output gets an error at once
/// instead of waiting for ever.
struct Stopping {
    open: HashMap<u64, Entry>,
    registered: Receiver<Registration>,
}

impl Drop for Stopping {
    fn drop(&mut self) {
        for reg in self.registered.try_iter() {
            if let Registration::Open { id, state, slot } = reg {
                let events = Vec::new();
                self.open.insert(
                    id,
                    Entry {
                        state,
                        slot,
                        events,
                    },
                );
            }
        }
        if self.open.is_empty() {
            return;
        }
        tracing::error!(
            requests = self.open.len(),
            panicking = std::thread::panicking(),
            "the output pass stopped with requests open; they fail"
        );
        for (_, entry) in self.open.drain() {
            entry.slot.put(Processed {
                error: Some("the output pass stopped before the request finished".into()),
                ..Processed::default()
            });
        }
    }
}

/// The pass's thread: one batch (one engine step) at a time, each request of it once.
fn run(
    batches: Receiver<EventBatch>,
    registered: Receiver<Registration>,
    mut parser: Option<Box<dyn OutputParser>>,
) {
    let mut pass = Stopping {
        open: HashMap::new(),
        registered,
    };
    let open = &mut pass.open;
    let registered = &pass.registered;
    let mut touched: Vec<u64> = Vec::new();
    for batch in batches {
        // Registrations precede their requests' events: those of this batch are in.
        for reg in registered.try_iter() {
            match reg {
                Registration::Open { id, state, slot } => {
                    let events = Vec::new();
                    open.insert(
                        id,
                        Entry {
                            state,
                            slot,
                            events,
                        },
                    );
                }
                Registration::Forget { id } => {
                    open.remove(&id);
                }
            }
        }
        for (id, event) in batch {
            let Some(entry) = open.get_mut(&id) else {
                tracing::warn!(
                    engine_id = id,
                    "an event for a request the output pass does not know"
                );
                continue;
            };
            if entry.events.is_empty() {
                touched.push(id);
            }
            entry.events.push(event);
        }
        for id in touched.drain(..) {
            let Some(entry) = open.get_mut(&id) else {
                continue;
            };
            let processed = entry
                .state
                .process(entry.events.drain(..), parser.as_deref_mut());
            let last = processed.is_last();
            entry.slot.put(processed);
            if last {
                open.remove(&id);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tokens(t: &[u32]) -> EngineEvent {
        EngineEvent::Tokens {
            tokens: t.to_vec(),
            logprobs: None,
        }
    }

    /// Output the reader has not taken yet is merged, never queued without bound: text and
    /// ids append in order, the end is kept.
    #[test]
    fn unread_output_is_merged_in_order() {
        let slot = OutputSlot::default();
        let p = |text: &str, ids: &[u32]| Processed {
            text: text.into(),
            token_ids: ids.to_vec(),
            tokens: ids.len(),
            generated: ids.len() as u32,
            ..Processed::default()
        };
        slot.put(p("he", &[1]));
        slot.put(p("llo", &[2, 3]));
        let mut end = p("!", &[4]);
        end.finished = Some((FinishReason::Length, Usage::default()));
        slot.put(end);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let got = rt.block_on(slot.take());
        assert_eq!(got.text, "hello!");
        assert_eq!(got.token_ids, vec![1, 2, 3, 4]);
        assert_eq!(got.tokens, 4);
        assert!(got.is_last());
    }

    /// One pass per batch: each request of the batch gets its events' output in its slot, and
    /// a request that finished leaves the pass.
    #[test]
    fn a_batch_reaches_every_registered_request() {
        let codec = Arc::new(TextCodec::embedded().unwrap());
        let pass = OutputPass::spawn(0, None).unwrap();
        let state = || OutputState::new(codec.clone(), &[], Vec::new(), HashSet::new(), false);
        let a = pass.register(1, state()).unwrap();
        let b = pass.register(2, state()).unwrap();
        let EventSender::Shared(stream) = pass.events() else {
            panic!("a shared stream");
        };
        let end = EngineEvent::Finished {
            reason: FinishReason::Stop,
            usage: Usage::default(),
        };
        assert!(stream.send(vec![
            (1, tokens(&[5, 6])),
            (2, tokens(&[7])),
            (1, end.clone())
        ]));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let (a, b) = rt.block_on(async { (a.take().await, b.take().await) });
        assert_eq!(a.token_ids, vec![5, 6]);
        assert!(matches!(a.finished, Some((FinishReason::Stop, _))));
        assert_eq!(b.token_ids, vec![7]);
        assert!(b.finished.is_none());
        assert_eq!(a.text, codec.decode(&[5, 6], false).unwrap());
    }

    /// A pass that stops with a request still open (its engine stream gone) fails that
    /// request at once rather than leaving its reader waiting.
    #[test]
    fn a_stopped_pass_fails_its_open_requests() {
        let codec = Arc::new(TextCodec::embedded().unwrap());
        let pass = OutputPass::spawn(0, None).unwrap();
        let state = OutputState::new(codec, &[], Vec::new(), HashSet::new(), false);
        let slot = pass.register(7, state).unwrap();
        drop(pass);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let got = rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(10), slot.take()).await
        });
        let got = got.expect("the open request heard of the stop");
        assert!(got.error.is_some_and(|e| e.contains("output pass stopped")));
    }

    /// With a parse request, the response's text is split by the pass's parser (the native
    /// twin of the built-in) into reasoning, content and tool calls, the same whether the
    /// tokens arrive at once or one event at a time; a call's id carries the given prefix.
    #[test]
    fn parsed_output_is_split_into_reasoning_content_and_calls() {
        let codec = Arc::new(TextCodec::embedded().unwrap());
        let text = "<think>sunny?</think>Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let ids = codec.encode(text, false).unwrap();
        let request = ParseRequest {
            tool_format: "hermes".into(),
            reasoning_format: "qwen3".into(),
            reasoning_open: false,
            tools: String::new(),
        };
        let end = EngineEvent::Finished {
            reason: FinishReason::Stop,
            usage: Usage::default(),
        };
        let run = |chunks: Vec<Vec<u32>>| {
            let mut parser = crate::policy::native::parser(&Default::default());
            let mut state = OutputState::new(codec.clone(), &[], Vec::new(), HashSet::new(), false)
                .with_parsing(request.clone(), "call_t_".into());
            let mut all = Processed::default();
            for c in chunks {
                all.merge(state.process([tokens(&c)], Some(parser.as_mut())));
            }
            all.merge(state.process([end.clone()], Some(parser.as_mut())));
            all
        };
        let whole = run(vec![ids.clone()]);
        assert_eq!(whole.reasoning, "sunny?");
        assert_eq!(whole.text, "Let me check.");
        assert_eq!(whole.calls.len(), 1, "{:?}", whole.calls);
        let call = &whole.calls[0];
        assert_eq!(call.id.as_deref(), Some("call_t_0"));
        assert_eq!(call.name.as_deref(), Some("get_weather"));
        assert_eq!(call.arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(whole.parse_failures, 0);
        let one_by_one = run(ids.iter().map(|&t| vec![t]).collect());
        assert_eq!(
            (&one_by_one.reasoning, &one_by_one.text, &one_by_one.calls),
            (&whole.reasoning, &whole.text, &whole.calls)
        );
        // A broken call comes back as text, counted.
        let broken = codec
            .encode("<tool_call>\n{\"name\": oops}\n</tool_call>", false)
            .unwrap();
        let out = run(vec![broken]);
        assert!(out.calls.is_empty() && out.text.contains("oops"), "{out:?}");
        assert_eq!(out.parse_failures, 1);
    }
}
