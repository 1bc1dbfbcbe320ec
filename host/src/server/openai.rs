//! Handlers of the OpenAI endpoints: parse, validate, admit, tokenize, route, submit, respond.
//!
//! Owns: the request flow shared by `/v1/completions` and `/v1/chat/completions` and the
//! `/v1/models` listing. Order matters and is: shutting-down check → body parse (400 / 413) →
//! model check (404) → parameter validation (400) → admission (503 + Retry-After, before any
//! CPU work) → tokenization and chat templating on the blocking pool → context-length check
//! (400) → routing → submit (503 when an engine queue is full). A failure after some choices
//! were submitted drops them, and their guards cancel them. It must not decode engine output
//! (that is `pipeline`) or build bodies (that is `respond`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;

use super::AppState;
use super::agent::{self, AgentFields, AgentPlan};
use super::error::AppError;
use super::output::OutputState;
use super::params::{GenParams, validate_common};
use super::pipeline::{ChoiceRun, RequestGuard, RunContext};
use super::prefix_mirror::prompt_block_hashes;
use super::protocol::*;
use super::respond::{Meta, Shape, full_response, stream_response};
use crate::cache::BlockHash;
use crate::engine::api::GenerateRequest;

/// Prompt tokens kept as detokenizer context (for correct leading spaces).
const DETOK_CONTEXT: usize = 4;

/// Reads the body within the size limit and the read timeout. A declared `Content-Length` over
/// the limit is refused before reading anything.
async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, AppError> {
    let limit = state.config().max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(AppError::PayloadTooLarge(limit));
    }
    let timeout = Duration::from_secs(u64::from(state.config().body_read_timeout_secs));
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(AppError::InvalidJson(
            "timed out reading the request body".into(),
        )),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            // axum reports the limit as a boxed `LengthLimitError` somewhere in the chain.
            let mut too_large = false;
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = cur {
                too_large |= err.to_string().contains("length limit");
                cur = err.source();
            }
            if too_large {
                Err(AppError::PayloadTooLarge(limit))
            } else {
                Err(AppError::InvalidJson(format!("cannot read the body: {e}")))
            }
        }
    }
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, AppError> {
    serde_json::from_slice(body).map_err(|e| {
        let msg = e.to_string();
        match e.classify() {
            serde_json::error::Category::Data => {
                if msg.contains("PromptInput") {
                    AppError::invalid(
                        "prompt",
                        "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                    )
                } else if msg.contains("MessageContent") {
                    AppError::invalid("messages", "message content must be a string or a list of content parts")
                } else if msg.contains("StopInput") {
                    AppError::invalid("stop", "stop must be a string or a list of strings")
                } else {
                    AppError::InvalidRequest { message: msg, param: None }
                }
            }
            _ => AppError::InvalidJson(msg),
        }
    })
}

/// Logs the fields of a request body this server does not know (they are ignored).
fn warn_unknown(endpoint: &str, unknown: &serde_json::Map<String, Value>) {
    if !unknown.is_empty() {
        let names: Vec<&str> = unknown.keys().map(String::as_str).take(20).collect();
        tracing::warn!(
            endpoint,
            fields = %names.join(", "),
            "the request has fields this server does not know; they are ignored"
        );
    }
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), AppError> {
    let served = &state.inner().served_names;
    match model {
        None => Ok(()),
        Some(m) if served.iter().any(|s| s == m) => Ok(()),
        Some(m) => Err(AppError::ModelNotFound {
            model: m.chars().take(200).collect(),
            served: served.clone(),
        }),
    }
}

fn admit(state: &AppState, choices: usize) -> Result<OwnedSemaphorePermit, AppError> {
    if state.is_shutting_down() {
        return Err(AppError::ShuttingDown);
    }
    let max = state.config().max_choices_per_request as usize;
    if choices > max {
        return Err(AppError::invalid(
            "n",
            format!("n × prompts = {choices} exceeds the limit of {max}"),
        ));
    }
    let n = u32::try_from(choices).map_err(|_| AppError::invalid("n", "too many choices"))?;
    state
        .inner()
        .admission
        .clone()
        .try_acquire_many_owned(n)
        .map_err(|_| AppError::Overloaded {
            retry_after_secs: state.config().retry_after_secs,
        })
}

/// What the user sent as one prompt.
enum PromptSource {
    Text(String),
    Tokens(Vec<u32>),
}

/// One prompt, tokenized.
struct Prepared {
    ids: Vec<u32>,
    /// Computed once: the router probes its mirrors with them and the engine adopts them.
    hashes: Arc<[BlockHash]>,
    echo: Option<String>,
    echo_tokens: Vec<String>,
    /// Prompt offsets to keep SSM snapshots at (`cache_checkpoints`, validated).
    checkpoints: Vec<u32>,
    /// Tokens cut from the front by `truncate_prompt_tokens`.
    dropped: usize,
}

impl Prepared {
    /// Offsets into the prompt as the client sent it, moved onto the truncated prompt (those
    /// that fall in the cut part are dropped).
    fn shift(&self, offsets: &[u32]) -> Vec<u32> {
        offsets
            .iter()
            .filter_map(|&o| (o as usize).checked_sub(self.dropped))
            .filter(|&o| o > 0)
            .map(|o| o as u32)
            .collect()
    }
}

/// Checks client checkpoint offsets against a prompt of `len` tokens.
fn check_checkpoints(offsets: &[u32], len: usize) -> Result<(), AppError> {
    const MAX: usize = 64;
    if offsets.len() > MAX {
        return Err(AppError::invalid(
            "cache_checkpoints",
            format!("at most {MAX} checkpoints per prompt"),
        ));
    }
    match offsets.iter().find(|&&o| o == 0 || o as usize > len) {
        Some(o) => Err(AppError::invalid(
            "cache_checkpoints",
            format!("checkpoint offset {o} is outside the prompt's 1 ..= {len} tokens"),
        )),
        None => Ok(()),
    }
}

async fn prepare(
    state: &AppState,
    sources: Vec<PromptSource>,
    add_special: bool,
    echo: bool,
    logprobs: bool,
    truncate: Option<usize>,
) -> Result<Vec<Prepared>, AppError> {
    let codec = state.inner().codec.clone();
    let salt = state.inner().model.cache_salt.clone();
    let block = state.inner().model.block_size;
    let vocab = state.inner().limits.vocab_size;
    tokio::task::spawn_blocking(move || {
        sources
            .into_iter()
            .map(|src| {
                let (ids, text) = match src {
                    PromptSource::Text(t) => (codec.encode(&t, add_special)?, Some(t)),
                    PromptSource::Tokens(ids) => {
                        if let Some(bad) = ids.iter().find(|t| **t >= vocab) {
                            return Err(AppError::invalid(
                                "prompt",
                                format!("token id {bad} is outside the vocabulary (size {vocab})"),
                            ));
                        }
                        (ids, None)
                    }
                };
                if ids.is_empty() {
                    return Err(AppError::invalid("prompt", "the prompt is empty"));
                }
                // `truncate_prompt_tokens`: keep the last tokens (the echo shows what is kept).
                let mut ids = ids;
                let dropped = truncate.map_or(0, |k| ids.len().saturating_sub(k));
                ids.drain(..dropped);
                let text = text.filter(|_| dropped == 0);
                let echo_text = match (echo, text) {
                    (false, _) => None,
                    (true, Some(t)) => Some(t),
                    (true, None) => Some(codec.decode(&ids, false)?),
                };
                let echo_tokens = if echo && logprobs {
                    ids.iter()
                        .map(|t| codec.decode(&[*t], false))
                        .collect::<Result<_, _>>()?
                } else {
                    Vec::new()
                };
                let hashes = prompt_block_hashes(&salt, &ids, block).into();
                Ok(Prepared {
                    ids,
                    hashes,
                    echo: echo_text,
                    echo_tokens,
                    checkpoints: Vec::new(),
                    dropped,
                })
            })
            .collect()
    })
    .await
    .map_err(|e| AppError::Internal(format!("tokenizer task failed: {e}")))?
}

/// `max_tokens` of a `/v1/completions` request that omits it (OpenAI's and vLLM's default).
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// Resolves `max_tokens` against the context window for one prompt.
fn budget(state: &AppState, prompt_len: usize, params: &GenParams) -> Result<u32, AppError> {
    let max_len = state.inner().model.max_model_len as usize;
    if prompt_len >= max_len {
        return Err(AppError::ContextLength {
            message: format!(
                "this model's maximum context length is {max_len} tokens, but the prompt has {prompt_len} tokens"
            ),
            param: params.prompt_param,
        });
    }
    let room = (max_len - prompt_len) as u32;
    match params.max_tokens {
        None => Ok(params.default_max_tokens.map_or(room, |d| d.min(room))),
        Some(m) if m <= room => Ok(m),
        Some(m) => Err(AppError::ContextLength {
            message: format!(
                "this model's maximum context length is {max_len} tokens; the prompt has {prompt_len} tokens and max_tokens is {m}"
            ),
            param: params.prompt_param,
        }),
    }
}

/// The engine request of choice `k` of prompt `prep`.
fn engine_request(
    id: u64,
    k: u32,
    prep: &Prepared,
    params: &GenParams,
    max_tokens: u32,
) -> GenerateRequest {
    let mut sampling = params.sampling.clone();
    // Distinct but reproducible draws for the n choices of a seeded request.
    sampling.seed = sampling.seed.map(|s| s.wrapping_add(u64::from(k)));
    GenerateRequest {
        id,
        prompt: prep.ids.clone(),
        params: sampling,
        max_tokens,
        stop_token_ids: params.stop_token_ids.clone(),
        ignore_eos: params.ignore_eos,
        // `echo` with `logprobs` scores the prompt too.
        prompt_logprobs: params.prompt_logprobs.or_else(|| {
            if prep.echo.is_some() {
                params.logprobs
            } else {
                None
            }
        }),
        block_hashes: Some(prep.hashes.clone()),
        checkpoints: prep.checkpoints.clone(),
        priority: params.priority,
        constraint: None,
        speculative: params.speculative,
    }
}

/// The last part of a response id (`chatcmpl-<hex>`), to make tool-call ids unique.
fn meta_tag(response_id: &str) -> &str {
    response_id.rsplit('-').next().unwrap_or(response_id)
}

/// Routes and submits every choice; returns the runs and their (index, prompt) pairs.
#[allow(clippy::too_many_arguments)]
async fn submit(
    state: &AppState,
    prepared: &[Prepared],
    params: &GenParams,
    agent: &AgentPlan,
    mut permit: OwnedSemaphorePermit,
    tenant: String,
    start: Instant,
    request_id: &str,
) -> Result<(Vec<ChoiceRun>, Vec<(u32, usize)>), AppError> {
    let budgets = prepared
        .iter()
        .map(|p| budget(state, p.ids.len(), params))
        .collect::<Result<Vec<_>, _>>()?;
    let inner = state.inner();
    let mut stop_ids: HashSet<u32> = params.stop_token_ids.iter().copied().collect();
    if !params.ignore_eos {
        stop_ids.extend(inner.codec.eos_token_ids().iter().copied());
    }
    let ctx = RunContext {
        abort: state.abort_rx(),
        metrics: inner.metrics.clone(),
        start,
        retry_after_secs: inner.config.retry_after_secs,
        request_id: request_id.into(),
    };
    let mut runs = Vec::with_capacity(prepared.len() * params.n as usize);
    let mut indices = Vec::with_capacity(runs.capacity());
    for (p, (prep, max_tokens)) in prepared.iter().zip(budgets).enumerate() {
        let placement = inner
            .router
            .route(prep.hashes.clone(), prep.ids.len() as u32, tenant.clone())
            .await?;
        let handle = inner
            .router
            .replicas()
            .get(placement.replica)
            .cloned()
            .ok_or_else(|| AppError::Internal("router chose a missing replica".into()))?;
        let tail = &prep.ids[prep.ids.len().saturating_sub(DETOK_CONTEXT)..];
        let pass = (inner.outputs.get(placement.replica))
            .ok_or_else(|| AppError::Internal("no output pass for the replica".into()))?;
        for k in 0..params.n {
            let index = p as u32 * params.n + k;
            let id = state.next_id();
            let mut request = engine_request(id, k, prep, params, max_tokens);
            request.constraint = agent.grammar.clone();
            let out = OutputState::new(
                inner.codec.clone(),
                tail,
                params.stop.clone(),
                stop_ids.clone(),
                params.skip_special_tokens,
            )
            .with_stop_rules(
                params.sampling.min_tokens,
                params.include_stop_str_in_output,
            );
            let out = match &agent.parse {
                Some(p) => {
                    out.with_parsing(p.clone(), format!("call_{}_{index}_", meta_tag(request_id)))
                }
                None => out,
            };
            let one = permit
                .split(1)
                .ok_or_else(|| AppError::Internal("admission accounting".into()))?;
            let slot = pass.register(id, out)?;
            if let Err(e) = handle.submit_to(request, pass.events()) {
                pass.forget(id);
                return Err(AppError::from_submit(e, inner.config.retry_after_secs));
            }
            let guard = RequestGuard::new(handle.clone(), id, inner.metrics.clone(), one);
            runs.push(ChoiceRun::new(index, p, slot, guard, ctx.clone()));
            indices.push((index, p));
        }
    }
    Ok((runs, indices))
}

fn meta(state: &AppState, prefix: &str, params: &GenParams, prepared: &[Prepared]) -> Meta {
    Meta {
        id: state.response_id(prefix),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: state.model_id().to_string(),
        logprobs: params.logprobs.is_some(),
        include_usage: params.include_usage,
        continuous_usage: params.continuous_usage,
        prompt_tokens: prepared.iter().map(|p| p.ids.len() as u32).collect(),
        prompt_ids: params
            .return_token_ids
            .then(|| prepared.iter().map(|p| p.ids.clone()).collect()),
        prompt_logprobs: params.prompt_logprobs.is_some(),
    }
}

async fn finish(
    shape: Shape,
    meta: Meta,
    params: &GenParams,
    runs: Vec<ChoiceRun>,
    indices: Vec<(u32, usize)>,
) -> Result<Response, AppError> {
    if params.stream {
        return Ok(stream_response(shape, meta, runs, indices));
    }
    let outputs = futures_util::future::join_all(runs.into_iter().map(ChoiceRun::collect)).await;
    let choices = outputs.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(full_response(&shape, &meta, choices))
}

/// A parsed, validated, templated and tokenized request of either endpoint.
struct Job {
    params: GenParams,
    prepared: Vec<Prepared>,
    permit: OwnedSemaphorePermit,
    tenant: String,
    /// Completions: structured outputs only (no tools, no parsing).
    agent: AgentPlan,
}

impl Job {
    /// Submits every choice and answers in the shape `shape` makes of the prepared prompts,
    /// whole or streamed; response ids start with `id_prefix`.
    async fn serve(
        self,
        state: &AppState,
        id_prefix: &str,
        start: Instant,
        shape: impl FnOnce(Vec<Prepared>) -> Shape,
    ) -> Result<Response, AppError> {
        let Job {
            params,
            prepared,
            permit,
            tenant,
            agent,
        } = self;
        let meta = meta(state, id_prefix, &params, &prepared);
        let (runs, indices) = submit(
            state, &prepared, &params, &agent, permit, tenant, start, &meta.id,
        )
        .await?;
        finish(shape(prepared), meta, &params, runs, indices).await
    }
}

async fn completion_job(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    endpoint: &str,
) -> Result<Job, AppError> {
    if state.is_shutting_down() {
        return Err(AppError::ShuttingDown);
    }
    let body = read_body(state, headers, body).await?;
    let req: CompletionRequest = parse(&body)?;
    warn_unknown(endpoint, &req.unknown);
    check_model(state, req.common.model.as_deref())?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(AppError::Unsupported("suffix".into()));
    }
    let fields = AgentFields {
        tools: None,
        tool_choice: None,
        parallel_tool_calls: None,
        response_format: req.common.response_format.as_ref(),
        structured_outputs: req.common.structured_outputs.as_ref(),
    };
    let mut no_calls = |_: &str, _: &str, _: &str, _: bool| -> Result<String, String> {
        Err("completions take no tools".into())
    };
    let mut agent = agent::plan(&fields, &agent::Formats::default(), &mut no_calls)?;
    agent.parse = None;
    check_grammar(state, &agent).await?;
    let mut params = validate_common(
        &req.common,
        req.common.max_tokens,
        req.logprobs,
        &state.inner().limits,
    )?;
    params.default_max_tokens = Some(COMPLETIONS_DEFAULT_MAX_TOKENS);
    params.prompt_param = "prompt";
    if let Some(b) = req.best_of
        && b != params.n
    {
        return Err(AppError::Unsupported("best_of different from n".into()));
    }
    let sources: Vec<PromptSource> = match req.prompt {
        PromptInput::Text(t) => vec![PromptSource::Text(t)],
        PromptInput::Tokens(ids) => vec![PromptSource::Tokens(ids)],
        PromptInput::TextBatch(v) => v.into_iter().map(PromptSource::Text).collect(),
        PromptInput::TokenBatch(v) => v.into_iter().map(PromptSource::Tokens).collect(),
    };
    if sources.is_empty() {
        return Err(AppError::invalid("prompt", "the prompt list is empty"));
    }
    let permit = admit(state, sources.len() * params.n as usize)?;
    let echo = req.echo.unwrap_or(false);
    let mut prepared = prepare(
        state,
        sources,
        true,
        echo,
        params.logprobs.is_some(),
        params.truncate_prompt_tokens,
    )
    .await?;
    if let Some(offsets) = &req.cache_checkpoints {
        for p in &mut prepared {
            check_checkpoints(offsets, p.ids.len() + p.dropped)?;
            p.checkpoints = p.shift(offsets);
        }
    }
    Ok(Job {
        params,
        prepared,
        permit,
        tenant: req.common.user.clone().unwrap_or_default(),
        agent,
    })
}

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let start = Instant::now();
    let job = completion_job(&state, &headers, body, "/v1/completions").await?;
    let shape = |prepared: Vec<Prepared>| Shape::Completion {
        echo: prepared.iter().map(|p| p.echo.clone()).collect(),
        echo_tokens: prepared.into_iter().map(|p| p.echo_tokens).collect(),
    };
    job.serve(&state, "cmpl", start, shape).await
}

/// One rendered request in vLLM's token-in shape (`GenerateRequest`): the ids the request
/// would be served with and its resolved sampling parameters; nothing is generated.
fn rendered(state: &AppState, prep: &Prepared, params: &GenParams) -> Result<Value, AppError> {
    let max_tokens = budget(state, prep.ids.len(), params)?;
    let s = &params.sampling;
    Ok(json!({
        "request_id": state.response_id("render"),
        "model": state.model_id(),
        "token_ids": prep.ids,
        "features": Value::Null,
        "stream": params.stream,
        "sampling_params": {
            "n": params.n,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "seed": s.seed,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "stop": params.stop,
            "stop_token_ids": params.stop_token_ids,
            "ignore_eos": params.ignore_eos,
            "skip_special_tokens": params.skip_special_tokens,
            "logprobs": s.logprobs,
            "min_tokens": s.min_tokens,
            "logit_bias": s.logit_bias.iter().map(|(t, b)| (t.to_string(), Value::from(*b))).collect::<serde_json::Map<_, _>>(),
            "include_stop_str_in_output": params.include_stop_str_in_output,
            "prompt_logprobs": params.prompt_logprobs,
            "truncate_prompt_tokens": params.truncate_prompt_tokens,
            "priority": params.priority,
            "speculative": params.speculative,
        },
        "cache_checkpoints": prep.checkpoints,
    }))
}

/// `POST /v1/completions/render` (vLLM's shape): a completions request → one token-in
/// request per prompt, as a list.
pub async fn render_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let job = completion_job(&state, &headers, body, "/v1/completions/render").await?;
    let out = (job.prepared.iter())
        .map(|p| rendered(&state, p, &job.params))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(axum::Json(Value::Array(out)).into_response())
}

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

fn messages_json(messages: &[ChatMessage]) -> Result<Value, AppError> {
    if messages.is_empty() {
        return Err(AppError::invalid("messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(AppError::invalid(
                "messages",
                format!(
                    "unknown role `{}`",
                    m.role.chars().take(50).collect::<String>()
                ),
            ));
        }
        let content = match &m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        ("text", None) => {
                            return Err(AppError::invalid(
                                "messages",
                                "a text content part needs `text`",
                            ));
                        }
                        (other, _) => {
                            return Err(AppError::Unsupported(format!(
                                "content part type `{}`",
                                other.chars().take(50).collect::<String>()
                            )));
                        }
                    }
                }
                s
            }
        };
        let mut v = json!({"role": m.role, "content": content});
        if let Some(name) = &m.name {
            v["name"] = Value::String(name.clone());
        }
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
            v["tool_calls"] = template_tool_calls(calls)?;
        }
        if let Some(id) = &m.tool_call_id {
            v["tool_call_id"] = Value::String(id.clone());
        }
        out.push(v);
    }
    Ok(Value::Array(out))
}

/// An assistant message's `tool_calls` as chat templates read them: OpenAI sends each call's
/// `arguments` as a JSON string; templates iterate them as a mapping (Qwen, Hermes, Llama 3
/// templates `| tojson` or `| items` them), so a string that parses as a JSON object becomes
/// that object, as vLLM renders it; any other string stays as sent.
fn template_tool_calls(calls: &Value) -> Result<Value, AppError> {
    let bad = |why: &str| AppError::invalid("messages", format!("tool_calls: {why}"));
    let list = calls.as_array().ok_or_else(|| bad("must be a list"))?;
    let mut out = Vec::with_capacity(list.len());
    for call in list {
        let mut call = call.clone();
        let function = call
            .get_mut("function")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| bad("each call needs a `function` object"))?;
        if !function.get("name").is_some_and(Value::is_string) {
            return Err(bad("each call's function needs a `name` string"));
        }
        if let Some(Value::String(args)) = function.get("arguments")
            && let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(args)
        {
            function.insert("arguments".into(), parsed);
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

/// The template variables of a chat request besides its messages: the tool definitions (when
/// the plan puts them there) and `chat_template_kwargs`.
fn template_extras(req: &ChatRequest, plan: &AgentPlan) -> super::text::TemplateExtras {
    super::text::TemplateExtras {
        tools: req.tools.clone().filter(|_| plan.tools_in_template),
        kwargs: req.chat_template_kwargs.clone().unwrap_or_default(),
    }
}

/// Compiles the plan's grammar once off the async threads (see `agent::check`).
async fn check_grammar(state: &AppState, plan: &AgentPlan) -> Result<(), AppError> {
    let Some(grammar) = &plan.grammar else {
        return Ok(());
    };
    let Some(check) = &state.inner().grammar_check else {
        return Err(AppError::Unsupported(
            "constrained responses (response_format, structured_outputs, forced tool calls) on \
             this server: it has no constraint vocabulary for its model (the startup log says why)"
                .into(),
        ));
    };
    let (grammar, check) = (grammar.clone(), check.clone());
    let words = state.inner().constraint_words;
    tokio::task::spawn_blocking(move || agent::check(&check, &grammar, words))
        .await
        .map_err(|e| AppError::Internal(format!("grammar check failed: {e}")))?
}

/// What the request's agent fields ask of the engine and the output pass.
fn agent_plan(state: &AppState, req: &ChatRequest) -> Result<AgentPlan, AppError> {
    let inner = state.inner();
    let fields = AgentFields {
        tools: req.tools.as_ref(),
        tool_choice: req.tool_choice.as_ref(),
        parallel_tool_calls: req.parallel_tool_calls,
        response_format: req.common.response_format.as_ref(),
        structured_outputs: req.common.structured_outputs.as_ref(),
    };
    let Some(parser) = &inner.request_parser else {
        let mut none = |_: &str, _: &str, _: &str, _: bool| -> Result<String, String> {
            Err("this server has no parser plugin".into())
        };
        return agent::plan(&fields, &agent::Formats::default(), &mut none);
    };
    let mut parser = parser.lock().unwrap_or_else(|p| p.into_inner());
    let mut grammar = |format: &str, tools: &str, choice: &str, parallel: bool| {
        parser.call_grammar(format, tools, choice, parallel)
    };
    agent::plan(&fields, &inner.formats, &mut grammar)
}

async fn chat_job(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    endpoint: &str,
) -> Result<Job, AppError> {
    if state.is_shutting_down() {
        return Err(AppError::ShuttingDown);
    }
    let body = read_body(state, headers, body).await?;
    let req: ChatRequest = parse(&body)?;
    warn_unknown(endpoint, &req.unknown);
    check_model(state, req.common.model.as_deref())?;
    let mut agent = agent_plan(state, &req)?;
    check_grammar(state, &agent).await?;
    let extras = template_extras(&req, &agent);
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), k) => Some(k.unwrap_or(0)),
        (_, Some(k)) if k > 0 => {
            return Err(AppError::invalid(
                "top_logprobs",
                "top_logprobs requires logprobs: true",
            ));
        }
        _ => None,
    };
    let max_tokens = req.max_completion_tokens.or(req.common.max_tokens);
    let params = validate_common(&req.common, max_tokens, logprobs, &state.inner().limits)?;
    let messages = messages_json(&req.messages)?;
    let marks = req.cache_checkpoints.clone().unwrap_or_default();
    check_message_marks(&marks, req.messages.len())?;
    let permit = admit(state, params.n as usize)?;
    let codec = state.inner().codec.clone();
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let (rendered, message_ends) = tokio::task::spawn_blocking(move || {
        let text = codec.render_chat_with(&messages, add_generation_prompt, &extras)?;
        let ends = message_end_offsets(&codec, &messages, &marks, &extras)?;
        Ok::<_, AppError>((text, ends))
    })
    .await
    .map_err(|e| AppError::Internal(format!("template task failed: {e}")))??;
    let open = agent::starts_in_reasoning(&agent, &rendered);
    if let Some(parse) = agent.parse.as_mut() {
        parse.reasoning_open = open;
    }
    // The template already holds BOS and special markers.
    let mut prepared = prepare(
        state,
        vec![PromptSource::Text(rendered)],
        false,
        false,
        false,
        params.truncate_prompt_tokens,
    )
    .await?;
    for p in &mut prepared {
        let ends: Vec<u32> = message_ends
            .iter()
            .map(|&o| o.min((p.ids.len() + p.dropped) as u32))
            .collect();
        p.checkpoints = p.shift(&ends);
    }
    Ok(Job {
        params,
        prepared,
        permit,
        tenant: req.common.user.clone().unwrap_or_default(),
        agent,
    })
}

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let start = Instant::now();
    let job = chat_job(&state, &headers, body, "/v1/chat/completions").await?;
    job.serve(&state, "chatcmpl", start, |_| Shape::Chat).await
}

/// `POST /v1/chat/completions/render` (vLLM's shape): a chat request → the token-in request
/// it would be served as (chat template applied, nothing generated).
pub async fn render_chat(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let job = chat_job(&state, &headers, body, "/v1/chat/completions/render").await?;
    let prep = job
        .prepared
        .first()
        .ok_or_else(|| AppError::Internal("nothing rendered".into()))?;
    Ok(axum::Json(rendered(&state, prep, &job.params)?).into_response())
}

/// Checks chat `cache_checkpoints` (message indices).
fn check_message_marks(marks: &[u32], messages: usize) -> Result<(), AppError> {
    match marks.iter().find(|&&m| m as usize >= messages) {
        Some(m) => Err(AppError::invalid(
            "cache_checkpoints",
            format!("checkpoint message index {m} is out of range: there are {messages} messages"),
        )),
        None if marks.len() > 64 => Err(AppError::invalid(
            "cache_checkpoints",
            "at most 64 checkpoints per request",
        )),
        None => Ok(()),
    }
}

/// The token offset where each marked message ends in the rendered conversation: the length
/// of the template rendered over the messages up to and including it (no generation prompt).
fn message_end_offsets(
    codec: &super::TextCodec,
    messages: &Value,
    marks: &[u32],
    extras: &super::text::TemplateExtras,
) -> Result<Vec<u32>, AppError> {
    let Some(all) = messages.as_array() else {
        return Ok(Vec::new());
    };
    let mut ends = Vec::with_capacity(marks.len());
    for &m in marks {
        let upto = Value::Array(all[..=m as usize].to_vec());
        let text = codec.render_chat_with(&upto, false, extras)?;
        ends.push(codec.encode(&text, false)?.len() as u32);
    }
    Ok(ends)
}

pub async fn models(State(state): State<AppState>) -> Response {
    let inner = state.inner();
    let list = ModelList {
        object: "list",
        data: inner
            .served_names
            .iter()
            .take(inner.listed_names)
            .map(|id| ModelCard {
                id: id.clone(),
                object: "model",
                created: inner.created,
                owned_by: "chimera",
                max_model_len: inner.model.max_model_len,
            })
            .collect(),
    };
    axum::Json(list).into_response()
}

/// `POST /tokenize` (vLLM's shape): a `prompt` string, or chat `messages` rendered through the
/// chat template, to the token ids a request would be served with.
#[derive(Debug, serde::Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    /// Default true for a prompt; a rendered chat template already holds its special tokens.
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    unknown: serde_json::Map<String, Value>,
}

pub async fn tokenize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let body = read_body(&state, &headers, body).await?;
    let req: TokenizeRequest = parse(&body)?;
    warn_unknown("/tokenize", &req.unknown);
    check_model(&state, req.model.as_deref())?;
    let codec = state.inner().codec.clone();
    let (text, add_special) = match (req.prompt, req.messages) {
        (Some(p), None) => (p, req.add_special_tokens.unwrap_or(true)),
        (None, Some(m)) => {
            let messages = messages_json(&m)?;
            let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
            let codec = codec.clone();
            let rendered = tokio::task::spawn_blocking(move || {
                codec.render_chat(&messages, add_generation_prompt)
            })
            .await
            .map_err(|e| AppError::Internal(format!("template task failed: {e}")))??;
            (rendered, req.add_special_tokens.unwrap_or(false))
        }
        _ => {
            return Err(AppError::invalid(
                "prompt",
                "give exactly one of `prompt` (a string) and `messages`",
            ));
        }
    };
    let tokens = tokio::task::spawn_blocking(move || codec.encode(&text, add_special))
        .await
        .map_err(|e| AppError::Internal(format!("tokenizer task failed: {e}")))??;
    let body = json!({
        "count": tokens.len(),
        "max_model_len": state.inner().model.max_model_len,
        "tokens": tokens,
        "token_strs": Value::Null,
    });
    Ok(axum::Json(body).into_response())
}

/// `POST /detokenize` (vLLM's shape): token ids back to text.
#[derive(Debug, serde::Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
    #[serde(flatten)]
    unknown: serde_json::Map<String, Value>,
}

pub async fn detokenize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, AppError> {
    let body = read_body(&state, &headers, body).await?;
    let req: DetokenizeRequest = parse(&body)?;
    warn_unknown("/detokenize", &req.unknown);
    check_model(&state, req.model.as_deref())?;
    let vocab = state.inner().limits.vocab_size;
    if let Some(bad) = req.tokens.iter().find(|t| **t >= vocab) {
        return Err(AppError::invalid(
            "tokens",
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    let codec = state.inner().codec.clone();
    let tokens = req.tokens;
    let text = tokio::task::spawn_blocking(move || codec.decode(&tokens, false))
        .await
        .map_err(|e| AppError::Internal(format!("tokenizer task failed: {e}")))??;
    Ok(axum::Json(json!({ "prompt": text })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_arguments_reach_the_template_as_objects_when_they_parse() {
        let calls = json!([
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}}
        ]);
        let out = template_tool_calls(&calls).unwrap();
        assert_eq!(out[0]["function"]["arguments"], json!({"x": 1}));
        // Anything but a JSON object stays the string the client sent.
        assert_eq!(out[1]["function"]["arguments"], json!("not json"));
        assert_eq!(out[2]["function"]["arguments"], json!("[1, 2]"));
        assert_eq!(out[0]["id"], json!("a"));
        for bad in [
            json!({"function": {"name": "f"}}),
            json!([{"id": "a"}]),
            json!([{"function": {"arguments": "{}"}}]),
        ] {
            assert!(template_tool_calls(&bad).is_err(), "{bad}");
        }
    }

    fn chat(extra: Value) -> ChatRequest {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn tools_reach_the_template_as_the_plan_says() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let req = chat(json!({"tools": tools, "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": false}}));
        let with = AgentPlan {
            tools_in_template: true,
            ..AgentPlan::default()
        };
        let e = template_extras(&req, &with);
        assert_eq!(e.tools, Some(tools.clone()));
        assert_eq!(e.kwargs["enable_thinking"], json!(false));
        assert_eq!(template_extras(&req, &AgentPlan::default()).tools, None);
    }
}
