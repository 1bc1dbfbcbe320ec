//! Output formatting: choice chunks → OpenAI JSON bodies and SSE streams.
//!
//! Owns: the mapping from pipeline [`ChoiceChunk`]s to completion / chat response bodies, the
//! SSE framing (`data: {json}\n\n`, a final usage chunk when `include_usage`, `data: [DONE]`),
//! the running usage on every chunk when `continuous_usage_stats`, and usage accounting across
//! prompts and choices. Invariants: a streamed response carries the
//! same text, tokens and finish reasons as the non-streamed one for the same request; an error
//! after the stream started is sent as one `data: {"error": ...}` event before `[DONE]`. It must
//! not talk to engines: dropping the stream (client gone) drops the runs, which cancel.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::pin::Pin;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures_util::{Stream, StreamExt};
use serde::Serialize;
use serde_json::{Map, Value};

use super::error::AppError;
use super::pipeline::{ChoiceChunk, ChoiceRun, TokenInfo};
use super::protocol::*;
use crate::engine::api::{MissReason, Usage};

/// Which OpenAI endpoint shape to produce.
#[derive(Debug, Clone)]
pub enum Shape {
    Completion {
        /// Per prompt: text to echo before the output (when `echo`).
        echo: Vec<Option<String>>,
        /// Per prompt: the prompt tokens' strings, for echo + logprobs.
        echo_tokens: Vec<Vec<String>>,
    },
    Chat,
}

/// Identity and bookkeeping shared by every chunk of one response.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub logprobs: bool,
    pub include_usage: bool,
    /// Every chunk carries the running usage (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    /// Per prompt: its token count (usage counts each prompt once, whatever `n`).
    pub prompt_tokens: Vec<u32>,
    /// Per prompt: its token ids, when `return_token_ids` asked for them.
    pub prompt_ids: Option<Vec<Vec<u32>>>,
    /// vLLM's `prompt_logprobs` was asked for (not streamed).
    pub prompt_logprobs: bool,
}

impl Meta {
    fn prompt_ids(&self, prompt_idx: usize) -> Option<Vec<u32>> {
        self.prompt_ids
            .as_ref()
            .map(|p| p.get(prompt_idx).cloned().unwrap_or_default())
    }

    /// A response body or stream chunk of `object`'s kind (its prompt ids and logprobs are
    /// set by the callers that have them).
    fn envelope<C, U: UsageField>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: U,
    ) -> Envelope<C, U> {
        Envelope {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            prompt_token_ids: None,
            prompt_logprobs: None,
        }
    }

    /// A `text_completion` body: a whole response, or one chunk of a stream.
    fn completion_json(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Option<UsageBody>>,
    ) -> Vec<u8> {
        to_json(&self.envelope("text_completion", choices, usage))
    }

    /// A `chat.completion.chunk` body.
    fn chat_chunk_json(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Option<UsageBody>>,
        prompt_token_ids: Option<Vec<u32>>,
    ) -> Vec<u8> {
        to_json(&ChatChunk {
            prompt_token_ids,
            ..self.envelope("chat.completion.chunk", choices, usage)
        })
    }
}

/// What one finished choice adds to usage.
#[derive(Debug, Clone, Copy)]
struct Done {
    prompt_idx: usize,
    usage: Usage,
}

impl Done {
    fn of(c: &ChoiceChunk) -> Option<Self> {
        c.finish.as_ref().map(|f| Done {
            prompt_idx: c.prompt_idx,
            usage: f.usage,
        })
    }
}

/// Sums usage: prompts once each, completions over all choices, cached and cacheable tokens
/// per prompt (its best choice); the miss reason of the first prompt that missed.
fn usage(meta: &Meta, finished: &[Done]) -> UsageBody {
    let prompt_tokens: u32 = meta.prompt_tokens.iter().sum();
    let mut per_prompt: BTreeMap<usize, Usage> = BTreeMap::new();
    let mut completion_tokens = 0;
    for d in finished {
        completion_tokens += d.usage.completion_tokens;
        let e = per_prompt.entry(d.prompt_idx).or_insert(d.usage);
        if d.usage.cached_tokens > e.cached_tokens {
            *e = d.usage;
        }
    }
    UsageBody {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: per_prompt.values().map(|u| u.cached_tokens).sum(),
            cacheable_tokens: per_prompt.values().map(|u| u.cacheable_tokens).sum(),
            cache_miss_reason: per_prompt
                .values()
                .find_map(|u| u.cache_miss)
                .map(MissReason::as_str),
        },
    }
}

fn chat_logprobs(infos: &[TokenInfo]) -> ChatLogprobs {
    ChatLogprobs {
        content: infos
            .iter()
            .map(|t| ChatTokenLogprob {
                token: t.token.clone(),
                logprob: t.logprob,
                bytes: t.token.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(_, s, l)| TopLogprob {
                        token: s.clone(),
                        logprob: *l,
                        bytes: s.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// vLLM's `prompt_logprobs` value: per prompt token `null` (the first) or a map from token id
/// to `{logprob, rank, decoded_token}` holding the prompt token and its top alternatives.
pub fn vllm_prompt_logprobs(infos: &[Option<TokenInfo>]) -> Value {
    let entry = |logprob: f32, rank: Option<u32>, text: &str| serde_json::json!({"logprob": logprob, "rank": rank, "decoded_token": text});
    Value::Array(
        infos
            .iter()
            .map(|info| {
                info.as_ref().map_or(Value::Null, |t| {
                    let mut m = Map::new();
                    for (j, (id, text, l)) in t.top.iter().enumerate() {
                        m.insert(id.to_string(), entry(*l, Some(j as u32 + 1), text));
                    }
                    m.insert(t.id.to_string(), entry(t.logprob, t.rank, &t.token));
                    Value::Object(m)
                })
            })
            .collect(),
    )
}

/// Appends one token to legacy completion logprobs, advancing `offset` (characters); `info`
/// is `None` for a token without a logprob (the first prompt token).
fn push_token(
    lp: &mut CompletionLogprobs,
    token: &str,
    info: Option<&TokenInfo>,
    offset: &mut u32,
) {
    lp.tokens.push(token.to_string());
    lp.token_logprobs.push(info.map(|x| x.logprob));
    lp.top_logprobs.push(info.map(|x| {
        let mut top = Map::new();
        for (_, s, l) in &x.top {
            top.entry(s.clone()).or_insert(Value::from(*l));
        }
        top
    }));
    lp.text_offset.push(*offset);
    *offset += token.chars().count() as u32;
}

/// Prompt tokens in legacy logprobs, with their logprobs when the engine computed them (the
/// first token has none).
fn push_prompt_tokens(
    lp: &mut CompletionLogprobs,
    tokens: &[String],
    infos: Option<&[Option<TokenInfo>]>,
    offset: &mut u32,
) {
    for (i, t) in tokens.iter().enumerate() {
        let info = infos.and_then(|v| v.get(i)).and_then(Option::as_ref);
        push_token(lp, t, info, offset);
    }
}

/// Legacy completion logprobs of one chunk: the echoed prompt's tokens first (`echoed`, with
/// their logprobs where the engine sent them), then the generated ones. `offset` (characters)
/// carries on across a choice's chunks.
fn completion_logprobs(
    echoed: Option<&[String]>,
    c: &ChoiceChunk,
    offset: &mut u32,
) -> CompletionLogprobs {
    let mut lp = CompletionLogprobs::default();
    if let Some(toks) = echoed {
        push_prompt_tokens(&mut lp, toks, c.prompt_logprobs.as_deref(), offset);
    }
    for t in &c.logprobs {
        push_token(&mut lp, &t.token, Some(t), offset);
    }
    lp
}

/// The whole non-streamed body.
pub fn full_response(shape: &Shape, meta: &Meta, mut choices: Vec<ChoiceChunk>) -> Response {
    choices.sort_by_key(|c| c.index);
    let finished: Vec<Done> = choices.iter().filter_map(Done::of).collect();
    let usage = usage(meta, &finished);
    let body = match shape {
        Shape::Completion { echo, echo_tokens } => {
            let choices = choices
                .into_iter()
                .map(|c| full_completion_choice(meta, echo, echo_tokens, c))
                .collect();
            meta.completion_json(choices, Some(Some(usage)))
        }
        Shape::Chat => full_chat(meta, choices, usage),
    };
    json_response(StatusCode::OK, body)
}

/// One choice of a non-streamed completion; with `echo`, its prompt leads the text and the
/// logprobs.
fn full_completion_choice(
    meta: &Meta,
    echo: &[Option<String>],
    echo_tokens: &[Vec<String>],
    c: ChoiceChunk,
) -> CompletionChoice {
    let prefix = echo.get(c.prompt_idx).cloned().flatten();
    let logprobs = meta.logprobs.then(|| {
        let echoed = prefix
            .is_some()
            .then(|| echo_tokens.get(c.prompt_idx))
            .flatten();
        completion_logprobs(echoed.map(Vec::as_slice), &c, &mut 0)
    });
    let prompt_logprobs = meta
        .prompt_logprobs
        .then(|| c.prompt_logprobs.as_deref().map(vllm_prompt_logprobs))
        .flatten();
    CompletionChoice {
        index: c.index,
        text: format!("{}{}", prefix.unwrap_or_default(), c.text),
        logprobs,
        prompt_logprobs,
        finish_reason: c.finish.as_ref().map(|f| f.reason),
        stop_reason: c.finish.and_then(|f| f.stop_reason),
        prompt_token_ids: meta.prompt_ids(c.prompt_idx),
        token_ids: meta.prompt_ids.is_some().then_some(c.token_ids),
    }
}

/// The non-streamed chat body; the prompt's logprobs (one prompt) come from any choice that
/// carries them.
fn full_chat(meta: &Meta, choices: Vec<ChoiceChunk>, usage: UsageBody) -> Vec<u8> {
    let prompt_logprobs = meta
        .prompt_logprobs
        .then(|| {
            choices
                .iter()
                .find_map(|c| c.prompt_logprobs.as_deref())
                .map(vllm_prompt_logprobs)
        })
        .flatten();
    let choices = choices
        .into_iter()
        .map(|c| ChatChoice {
            index: c.index,
            message: ChatMessageOut {
                role: "assistant",
                content: (!c.text.is_empty() || c.calls.is_empty()).then_some(c.text),
                reasoning_content: (!c.reasoning.is_empty()).then_some(c.reasoning),
                tool_calls: c
                    .calls
                    .into_iter()
                    .map(|d| ToolCallOut {
                        index: None,
                        id: d.id,
                        kind: Some("function"),
                        function: FunctionCallOut {
                            name: d.name,
                            arguments: d.arguments,
                        },
                    })
                    .collect(),
            },
            logprobs: meta.logprobs.then(|| chat_logprobs(&c.logprobs)),
            finish_reason: c.finish.as_ref().map(|f| f.reason),
            stop_reason: c.finish.and_then(|f| f.stop_reason),
            token_ids: meta.prompt_ids.is_some().then_some(c.token_ids),
        })
        .collect();
    to_json(&ChatResponse {
        prompt_token_ids: meta.prompt_ids(0),
        prompt_logprobs,
        ..meta.envelope("chat.completion", choices, usage)
    })
}

fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_else(|e| {
        AppError::Internal(e.to_string())
            .to_json()
            .to_string()
            .into_bytes()
    })
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn sse_frame(json: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(json.len() + 8);
    v.extend_from_slice(b"data: ");
    v.extend_from_slice(json);
    v.extend_from_slice(b"\n\n");
    Bytes::from(v)
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<ChoiceChunk, AppError>> + Send>>;

struct SseState {
    shape: Shape,
    meta: Meta,
    merged: futures_util::stream::SelectAll<ChunkStream>,
    pending: VecDeque<Bytes>,
    finished: Vec<Done>,
    /// Choices whose first chunk went out (they carried the prompt's ids, if asked for).
    started: HashSet<u32>,
    offsets: HashMap<u32, u32>,
    /// Choices whose echoed prompt waits for their first chunk (index → prompt).
    echo_pending: HashMap<u32, usize>,
    /// Per choice: completion tokens streamed so far (the engine's count once finished).
    generated: HashMap<u32, u32>,
    over: bool,
}

impl SseState {
    /// The `usage` field of a content chunk: absent without `include_usage`, `null` until the
    /// final usage chunk, or the running counts with `continuous_usage_stats`.
    fn chunk_usage(&self) -> Option<Option<UsageBody>> {
        if !self.meta.continuous_usage {
            return self.meta.include_usage.then_some(None);
        }
        let mut u = usage(&self.meta, &self.finished);
        u.completion_tokens = self.generated.values().sum();
        u.total_tokens = u.prompt_tokens + u.completion_tokens;
        Some(Some(u))
    }

    fn chunk_frame(&mut self, c: ChoiceChunk) -> Bytes {
        let done = Done::of(&c);
        let count = self.generated.entry(c.index).or_insert(0);
        *count = match &done {
            Some(d) => d.usage.completion_tokens,
            None => *count + c.token_ids.len() as u32,
        };
        if let Some(d) = done {
            self.finished.push(d);
        }
        let usage_field = self.chunk_usage();
        let first = self.started.insert(c.index);
        let ids = self.meta.prompt_ids.is_some().then(|| c.token_ids.clone());
        let body = match &self.shape {
            Shape::Completion { echo, echo_tokens } => {
                // A deferred echo (with logprobs) leads the first chunk of its choice.
                let echoed = self.echo_pending.remove(&c.index).map(|p| {
                    (
                        echo.get(p).cloned().flatten().unwrap_or_default(),
                        echo_tokens.get(p).map(Vec::as_slice).unwrap_or_default(),
                    )
                });
                let logprobs = self.meta.logprobs.then(|| {
                    let offset = self.offsets.entry(c.index).or_insert(0);
                    completion_logprobs(echoed.as_ref().map(|(_, toks)| *toks), &c, offset)
                });
                let text = match echoed {
                    Some((prefix, _)) => prefix + &c.text,
                    None => c.text,
                };
                let prompt_token_ids = first.then(|| self.meta.prompt_ids(c.prompt_idx)).flatten();
                let choice = CompletionChoice {
                    index: c.index,
                    text,
                    logprobs,
                    prompt_logprobs: None,
                    finish_reason: c.finish.as_ref().map(|f| f.reason),
                    stop_reason: c.finish.and_then(|f| f.stop_reason),
                    prompt_token_ids,
                    token_ids: ids,
                };
                self.meta.completion_json(vec![choice], usage_field)
            }
            Shape::Chat => {
                let choice = ChatChunkChoice {
                    index: c.index,
                    delta: ChatDelta {
                        role: None,
                        content: (!c.text.is_empty()
                            || c.finish.is_none() && c.reasoning.is_empty() && c.calls.is_empty())
                        .then_some(c.text),
                        reasoning_content: (!c.reasoning.is_empty()).then_some(c.reasoning),
                        tool_calls: c
                            .calls
                            .into_iter()
                            .map(|d| ToolCallOut {
                                index: Some(d.index),
                                kind: d.id.is_some().then_some("function"),
                                id: d.id,
                                function: FunctionCallOut {
                                    name: d.name,
                                    arguments: d.arguments,
                                },
                            })
                            .collect(),
                    },
                    logprobs: self.meta.logprobs.then(|| chat_logprobs(&c.logprobs)),
                    finish_reason: c.finish.as_ref().map(|f| f.reason),
                    stop_reason: c.finish.and_then(|f| f.stop_reason),
                    token_ids: ids,
                };
                // The opening (role) chunk carried the prompt's ids.
                self.meta.chat_chunk_json(vec![choice], usage_field, None)
            }
        };
        sse_frame(&body)
    }

    fn usage_frame(&self) -> Bytes {
        let usage = usage(&self.meta, &self.finished);
        let body = match &self.shape {
            Shape::Completion { .. } => self.meta.completion_json(Vec::new(), Some(Some(usage))),
            Shape::Chat => self
                .meta
                .chat_chunk_json(Vec::new(), Some(Some(usage)), None),
        };
        sse_frame(&body)
    }

    /// Opening frames: the assistant role (chat) or the echoed prompt (completions).
    fn opening(&mut self, indices: &[(u32, usize)]) {
        let usage_field = self.chunk_usage();
        for &(index, prompt_idx) in indices {
            let body = match &self.shape {
                Shape::Chat => {
                    let choice = ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                            ..ChatDelta::default()
                        },
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                        token_ids: self.meta.prompt_ids.is_some().then(Vec::new),
                    };
                    let ids = self.meta.prompt_ids(prompt_idx);
                    self.meta.chat_chunk_json(vec![choice], usage_field, ids)
                }
                Shape::Completion { echo, .. } => {
                    let Some(text) = echo.get(prompt_idx).cloned().flatten() else {
                        continue;
                    };
                    if self.meta.logprobs {
                        // The prompt's logprobs come from the engine with the first output:
                        // the echo leads that chunk instead.
                        self.echo_pending.insert(index, prompt_idx);
                        continue;
                    }
                    let choice = CompletionChoice {
                        index,
                        text,
                        logprobs: None,
                        prompt_logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                        prompt_token_ids: self.meta.prompt_ids(prompt_idx),
                        token_ids: self.meta.prompt_ids.is_some().then(Vec::new),
                    };
                    self.meta.completion_json(vec![choice], usage_field)
                }
            };
            self.pending.push_back(sse_frame(&body));
            self.started.insert(index);
        }
    }
}

/// The streamed response. Dropping its body (client gone) drops every run, which cancels.
pub fn stream_response(
    shape: Shape,
    meta: Meta,
    runs: Vec<ChoiceRun>,
    indices: Vec<(u32, usize)>,
) -> Response {
    let streams: Vec<ChunkStream> = runs
        .into_iter()
        .map(|r| Box::pin(r.into_stream()) as ChunkStream)
        .collect();
    let mut state = SseState {
        shape,
        meta,
        merged: futures_util::stream::select_all(streams),
        pending: VecDeque::new(),
        finished: Vec::new(),
        started: HashSet::new(),
        offsets: HashMap::new(),
        echo_pending: HashMap::new(),
        generated: HashMap::new(),
        over: false,
    };
    state.opening(&indices);
    let body = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(frame) = s.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(frame), s));
            }
            if s.over {
                return None;
            }
            match s.merged.next().await {
                Some(Ok(chunk)) => {
                    let frame = s.chunk_frame(chunk);
                    s.pending.push_back(frame);
                }
                Some(Err(e)) => {
                    e.log(Some(&s.meta.id));
                    s.pending
                        .push_back(sse_frame(e.to_json().to_string().as_bytes()));
                    s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.merged = futures_util::stream::select_all(Vec::new());
                    s.over = true;
                }
                None => {
                    if s.meta.include_usage {
                        let frame = s.usage_frame();
                        s.pending.push_back(frame);
                    }
                    s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.over = true;
                }
            }
        }
    });
    let mut r = Response::new(Body::from_stream(body));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
