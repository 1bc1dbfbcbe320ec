//! [`ChimeraEngine`]: Dynamo's `LLMEngine` over chimera's engine replicas.
//!
//! `start` builds the serving stack exactly as `chimera serve` does (model, caches, plugins,
//! engine threads) and the in-process replica router; each request Dynamo hands over (token
//! ids, sampling and stop conditions) is hashed into blocks, placed on a replica by the router
//! plugin, submitted, and streamed back as token chunks with one terminal chunk. A stop from
//! Dynamo (client gone, stop string matched in the frontend) cancels the request in its engine;
//! a dropped stream does too.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use dynamo_backend_common::engine::GenerateContext;
use dynamo_backend_common::{
    AsyncEngineContext, ComponentSnapshot, DynamoError, EngineConfig, ErrorType, HEALTH_CHECK_KEY,
    KvEventSource, LLMEngine, LLMEngineOutput, LLMEngineOutputExt, LlmRegistration,
    MetricsBindings, MetricsCtx, PreprocessedRequest, PromptTokensDetails, SnapshotPublisher,
    TopLogprob, usage,
};
use futures::stream::BoxStream;

use chimera::cache::BlockHash;
use chimera::config::Config;
use chimera::engine::api::{
    EngineEvent, EngineHandle, FailureKind, FinishReason, GenerateRequest, Grammar, SamplingParams,
    SubmitError, TokenLogprob,
};
use chimera::server::metrics::{CacheInfo, MetricNames, Metrics, with_vllm_names};
use chimera::server::prefix_mirror::prompt_block_hashes;
use chimera::server::router::RouterHandle;

use crate::kv::{AnnounceRule, KvState};

/// What `start` built.
struct Running {
    router: RouterHandle,
    metrics: Arc<Metrics>,
    kv: Arc<KvState>,
    salt: String,
    block_size: u32,
    max_model_len: u32,
    vocab: u32,
    num_blocks: u32,
    prefix_caching: bool,
}

pub struct ChimeraEngine {
    config: Config,
    served: String,
    rule: AnnounceRule,
    running: OnceLock<Running>,
    next_id: AtomicU64,
    stopped: AtomicBool,
}

fn error(kind: ErrorType, message: impl Into<String>) -> DynamoError {
    DynamoError::builder()
        .error_type(kind)
        .message(message.into())
        .build()
}

impl ChimeraEngine {
    pub fn new(config: Config, served: String, rule: AnnounceRule) -> Self {
        Self {
            config,
            served,
            rule,
            running: OnceLock::new(),
            next_id: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
        }
    }

    fn running(&self) -> Result<&Running, DynamoError> {
        if self.stopped.load(Ordering::Relaxed) {
            return Err(error(ErrorType::Unavailable, "the worker is shutting down"));
        }
        self.running
            .get()
            .ok_or_else(|| error(ErrorType::Unavailable, "the engines are not started"))
    }
}

/// The engine request for Dynamo's preprocessed one.
fn engine_request(
    id: u64,
    r: &PreprocessedRequest,
    max_model_len: u32,
    vocab: u32,
) -> Result<GenerateRequest, DynamoError> {
    let invalid = |m: String| error(ErrorType::InvalidRequest, m);
    let prompt: Vec<u32> = r.token_ids.as_ref().clone();
    if prompt.is_empty() {
        return Err(invalid("the prompt has no tokens".into()));
    }
    if let Some(t) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(invalid(format!(
            "prompt token {t} is outside the vocabulary ({vocab} tokens)"
        )));
    }
    let room = max_model_len.saturating_sub(prompt.len() as u32);
    if room == 0 {
        return Err(invalid(format!(
            "the prompt has {} tokens; the model's context is {max_model_len}",
            prompt.len()
        )));
    }
    let stop = &r.stop_conditions;
    let max_tokens = match stop.max_tokens {
        Some(0) => return Err(invalid("max_tokens must be at least 1".into())),
        Some(n) if n > room => {
            return Err(invalid(format!(
                "max_tokens {n} with a {}-token prompt exceeds the model's context of \
                 {max_model_len}",
                prompt.len()
            )));
        }
        Some(n) => n,
        None => room,
    };
    let ignore_eos = stop.ignore_eos.unwrap_or(false);
    let mut stop_token_ids: Vec<u32> = [
        &stop.stop_token_ids,
        &stop.stop_token_ids_hidden,
        &stop.stop_token_ids_visible,
    ]
    .into_iter()
    .flatten()
    .flatten()
    .copied()
    .collect();
    if !ignore_eos {
        stop_token_ids.extend(r.eos_token_ids.iter().copied());
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let s = &r.sampling_options;
    let params = SamplingParams {
        // OpenAI's default temperature is 1.
        temperature: s.temperature.unwrap_or(1.0),
        top_p: s.top_p.unwrap_or(1.0),
        top_k: s.top_k.filter(|&k| k > 0).map_or(0, |k| k as u32),
        min_p: s.min_p.unwrap_or(0.0),
        seed: s.seed.map(|v| v as u64),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        logprobs: r.output_options.logprobs,
        min_tokens: stop.min_tokens.unwrap_or(0),
        logit_bias: Vec::new(),
    };
    if s.n.is_some_and(|n| n > 1) {
        return Err(invalid(
            "n > 1 reaches a worker only as separate requests".into(),
        ));
    }
    let constraint = match &s.guided_decoding {
        None => None,
        Some(g) => {
            let mut found = Vec::new();
            if let Some(json) = &g.json {
                found.push(Grammar {
                    kind: "json-schema".into(),
                    text: match json {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    },
                });
            }
            if let Some(regex) = &g.regex {
                found.push(Grammar {
                    kind: "regex".into(),
                    text: regex.clone(),
                });
            }
            if let Some(choice) = &g.choice {
                if choice.is_empty() {
                    return Err(invalid("guided choice needs at least one string".into()));
                }
                found.push(Grammar {
                    kind: "choice".into(),
                    text: serde_json::Value::from(choice.clone()).to_string(),
                });
            }
            if let Some(grammar) = &g.grammar {
                found.push(Grammar {
                    kind: "lark".into(),
                    text: grammar.clone(),
                });
            }
            if found.len() > 1 {
                return Err(invalid(
                    "guided decoding takes one of json, regex, choice or grammar".into(),
                ));
            }
            found.pop()
        }
    };
    Ok(GenerateRequest {
        id,
        prompt,
        params,
        max_tokens,
        stop_token_ids,
        ignore_eos,
        prompt_logprobs: None,
        block_hashes: None,
        checkpoints: Vec::new(),
        priority: 0,
        constraint,
        speculative: true,
    })
}

/// Cancels the request in its engine if the stream goes away before it finished.
struct CancelOnDrop {
    handle: EngineHandle,
    id: u64,
    done: bool,
}

impl CancelOnDrop {
    /// The request ended in the engine: nothing to cancel.
    fn finished(&mut self) {
        self.done = true;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.done {
            self.handle.cancel(self.id);
        }
    }
}

fn failure(kind: FailureKind, message: String) -> DynamoError {
    let class = match kind {
        FailureKind::InvalidRequest | FailureKind::PromptTooLong => ErrorType::InvalidRequest,
        FailureKind::QueueFull => ErrorType::CapacityExhausted,
        FailureKind::Executor | FailureKind::Cache | FailureKind::Constraint => ErrorType::Internal,
    };
    error(class, format!("{kind}: {message}"))
}

fn logprobs_of(lp: Vec<TokenLogprob>) -> (Vec<f64>, Vec<Vec<TopLogprob>>) {
    let values = lp.iter().map(|l| f64::from(l.logprob)).collect();
    let top = lp
        .into_iter()
        .map(|l| {
            l.top
                .into_iter()
                .enumerate()
                .map(|(rank, (token_id, logprob))| TopLogprob {
                    rank: rank as u32 + 1,
                    token_id,
                    token: None,
                    logprob: f64::from(logprob),
                    bytes: None,
                })
                .collect()
        })
        .collect();
    (values, top)
}

#[async_trait]
impl LLMEngine for ChimeraEngine {
    async fn start(&self, worker_id: u64) -> Result<EngineConfig, DynamoError> {
        tracing::info!(worker_id, model = %self.config.model.path, "starting chimera engines");
        let config = self.config.clone();
        let stack = tokio::task::spawn_blocking(move || chimera::app::build(&config))
            .await
            .map_err(|e| error(ErrorType::Internal, format!("engine start panicked: {e}")))?
            .map_err(|e| error(ErrorType::InvalidRequest, format!("{e:#}")))?;
        let parts = stack.parts;
        let model = parts.model.clone();
        let replicas = parts.replicas.len();
        let hybrid = parts.is_hybrid();
        let kv = Arc::new(KvState::new(replicas, hybrid, self.rule, model.block_size));
        // Each replica's cache events feed both the in-process router's mirror and the
        // announcer for Dynamo's router.
        let sink = kv.clone();
        let teed = chimera::cluster::tee(
            parts.replicas,
            Arc::new(move |replica, events| sink.apply(replica, events)),
        );
        let metrics = Arc::new(Metrics::new(replicas));
        let router = RouterHandle::spawn(
            teed,
            parts.policy,
            metrics.clone(),
            model.block_size,
            parts.config.router_mirror_max_blocks as usize,
        );
        let stats = router.stats();
        let total_blocks: u64 = stats.iter().map(|s| u64::from(s.total_blocks)).sum();
        let running = Running {
            router,
            metrics,
            kv,
            salt: model.cache_salt.clone(),
            block_size: model.block_size,
            max_model_len: model.max_model_len,
            vocab: parts.codec.vocab_size(),
            num_blocks: model.num_blocks,
            prefix_caching: model.prefix_caching,
        };
        let _ = self.running.set(running);
        tracing::info!(
            replicas,
            hybrid,
            block_size = model.block_size,
            total_blocks,
            announce = ?self.rule,
            "chimera engines started"
        );
        Ok(EngineConfig {
            model: self.served.clone(),
            served_model_name: Some(self.served.clone()),
            llm: Some(LlmRegistration {
                context_length: Some(model.max_model_len),
                kv_cache_block_size: Some(model.block_size),
                total_kv_blocks: Some(total_blocks),
                max_num_seqs: Some((self.config.engine.max_running * replicas) as u64),
                max_num_batched_tokens: Some(self.config.engine.max_batched_tokens as u64),
                ..LlmRegistration::default()
            }),
            ..EngineConfig::default()
        })
    }

    async fn generate(
        &self,
        request: PreprocessedRequest,
        ctx: GenerateContext,
    ) -> Result<BoxStream<'static, Result<LLMEngineOutput, DynamoError>>, DynamoError> {
        let run = self.running()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut req = engine_request(id, &request, run.max_model_len, run.vocab)?;
        let prompt_len = req.prompt.len() as u32;
        let hashes: Arc<[BlockHash]> =
            prompt_block_hashes(&run.salt, &req.prompt, run.block_size).into();
        let short: Vec<u64> = hashes.iter().map(|h| h.short()).collect();
        let announced = run.kv.announced_prefix(&short) as u32;
        let placement = run
            .router
            .route(hashes.clone(), prompt_len, String::new())
            .await
            .map_err(|e| error(ErrorType::Unavailable, format!("routing: {e}")))?;
        req.block_hashes = Some(hashes);
        let handle = run.router.replicas()[placement.replica].clone();
        let mut rx = handle.submit(req).map_err(|e| match e {
            SubmitError::QueueFull => error(ErrorType::CapacityExhausted, e.to_string()),
            SubmitError::ShuttingDown => error(ErrorType::Unavailable, e.to_string()),
        })?;
        // Health canaries are not traffic: the routing counters leave them out.
        let canary = request
            .extra_args
            .as_ref()
            .is_some_and(|a| a.get(HEALTH_CHECK_KEY).is_some());
        let kv = run.kv.clone();
        let mut guard = CancelOnDrop {
            handle,
            id,
            done: false,
        };
        let stream = async_stream::stream! {
            let mut cancelled = false;
            loop {
                tokio::select! {
                    event = rx.recv() => match event {
                        Some(EngineEvent::Tokens { tokens, logprobs }) => {
                            let mut out = LLMEngineOutput {
                                token_ids: tokens,
                                ..LLMEngineOutput::default()
                            };
                            if let Some(lp) = logprobs {
                                let (values, top) = logprobs_of(lp);
                                out.log_probs = Some(values);
                                out.top_logprobs = Some(top);
                            }
                            yield Ok(out);
                        }
                        Some(EngineEvent::PromptLogprobs { .. }) => {}
                        Some(EngineEvent::Finished { reason, usage: u }) => {
                            guard.finished();
                            if !canary {
                                tracing::debug!(
                                    prompt = prompt_len,
                                    announced_blocks = announced,
                                    reused = u.cached_tokens,
                                    cacheable = u.cacheable_tokens,
                                    miss = u.cache_miss.map(|m| m.as_str()),
                                    "request finished"
                                );
                                kv.record(prompt_len, announced, u.cached_tokens, u.cacheable_tokens, u.cache_miss);
                            }
                            let mut done_usage = usage(u.prompt_tokens, u.completion_tokens);
                            done_usage.prompt_tokens_details = Some(PromptTokensDetails {
                                cached_tokens: Some(u.cached_tokens),
                                ..PromptTokensDetails::default()
                            });
                            let terminal = match reason {
                                FinishReason::Stop => LLMEngineOutput::stop(),
                                FinishReason::Length => LLMEngineOutput::length(),
                                FinishReason::Cancelled => LLMEngineOutput::cancelled(),
                            };
                            yield Ok(terminal.with_usage(done_usage));
                            break;
                        }
                        Some(EngineEvent::Failed { kind, message }) => {
                            guard.finished();
                            yield Err(failure(kind, message));
                            break;
                        }
                        None => {
                            guard.finished();
                            yield Err(error(
                                ErrorType::Unavailable,
                                "the engine replica stopped before the request finished",
                            ));
                            break;
                        }
                    },
                    _ = ctx.stopped(), if !cancelled => {
                        // The engine answers with a `Finished { Cancelled }`.
                        cancelled = true;
                        guard.handle.cancel(guard.id);
                    }
                }
            }
        };
        Ok(Box::pin(stream))
    }

    async fn abort(&self, _ctx: Arc<dyn AsyncEngineContext>) {
        // Cancellation is handled in the stream (`ctx.stopped()`), which owns the request id.
    }

    async fn cleanup(&self) -> Result<(), DynamoError> {
        if self.stopped.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        if let Some(run) = self.running.get() {
            for h in run.router.replicas() {
                let _ = h.control(chimera::engine::api::Command::Shutdown);
            }
        }
        Ok(())
    }

    async fn kv_event_sources(&self) -> Result<Vec<KvEventSource>, DynamoError> {
        let run = self.running()?;
        if !run.prefix_caching {
            return Ok(Vec::new());
        }
        let kv = run.kv.clone();
        Ok(vec![KvEventSource::Push {
            on_ready: Box::new(move |publisher| {
                kv.set_publisher(publisher);
                Ok(())
            }),
            dp_rank: 0,
        }])
    }

    async fn setup_metrics(&self, ctx: MetricsCtx<'_>) -> Result<MetricsBindings, DynamoError> {
        let run = self.running()?;
        // chimera's families (under vLLM's names with `server.metrics_names = "vllm"`) and the
        // worker's routing counters, on the worker's `/metrics`.
        let metrics = run.metrics.clone();
        let router = run.router.clone();
        let kv = run.kv.clone();
        let served = self.served.clone();
        let vllm_names = self.config.server.metrics_names == MetricNames::Vllm;
        let cache = CacheInfo {
            block_size: run.block_size,
            num_gpu_blocks: run.num_blocks,
            prefix_caching: run.prefix_caching,
        };
        ctx.metrics.add_expfmt_callback(Arc::new(move || {
            let mut text = metrics.render(&served, &router.stats(), &cache);
            if vllm_names {
                text = with_vllm_names(&text);
            }
            text.push_str(&kv.render());
            Ok(text)
        }));
        let router = run.router.clone();
        let hit_queries = run.prefix_caching;
        Ok(MetricsBindings {
            dp_ranks: vec![0],
            on_publisher_ready: Some(Box::new(move |publisher: Arc<SnapshotPublisher>| {
                tokio::spawn(publish_load(router, publisher, hit_queries));
                Ok(())
            })),
        })
    }

    async fn health_check_payload(&self) -> Result<Option<serde_json::Value>, DynamoError> {
        // One greedy token of a one-token prompt: the engines answer only if they step.
        Ok(Some(serde_json::json!({
            "token_ids": [1],
            "stop_conditions": {"max_tokens": 1, "ignore_eos": true},
            "sampling_options": {"temperature": 0.0},
            "output_options": {},
            "eos_token_ids": [],
            "annotations": [],
            "extra_args": {HEALTH_CHECK_KEY: true},
        })))
    }
}

/// Publishes the worker's KV load (the router's load signal) whenever the engines' stats
/// change, at most every 50 ms.
async fn publish_load(router: RouterHandle, publisher: Arc<SnapshotPublisher>, prefix: bool) {
    let mut last = None;
    loop {
        let stats = router.stats();
        if stats.is_empty() || !router.replicas().iter().any(EngineHandle::is_alive) {
            return;
        }
        let total: u64 = stats.iter().map(|s| u64::from(s.total_blocks)).sum();
        let free: u64 = stats.iter().map(|s| u64::from(s.free_blocks)).sum();
        let queries: u64 = stats.iter().map(|s| s.prefix_cache_queries).sum();
        let hits: u64 = stats.iter().map(|s| s.prefix_cache_hits).sum();
        let used = total.saturating_sub(free);
        let snap = ComponentSnapshot {
            kv_used_blocks: used,
            kv_total_blocks: total,
            gpu_cache_usage: if total == 0 {
                0.0
            } else {
                used as f32 / total as f32
            },
            kv_cache_hit_rate: (prefix && queries > 0).then(|| hits as f32 / queries as f32),
            dp_rank: 0,
        };
        if last != Some(snap) {
            publisher.publish(0, snap);
            last = Some(snap);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: serde_json::Value) -> PreprocessedRequest {
        serde_json::from_value(json).expect("a preprocessed request")
    }

    #[test]
    fn dynamo_requests_become_engine_requests() {
        let r = request(serde_json::json!({
            "model": "m",
            "token_ids": [5, 6, 7],
            "stop_conditions": {"max_tokens": 4, "stop_token_ids_hidden": [9], "min_tokens": 1},
            "sampling_options": {"temperature": 0.5, "top_k": -1, "seed": 3},
            "output_options": {"logprobs": 2},
            "eos_token_ids": [2],
            "annotations": [],
        }));
        let g = engine_request(7, &r, 64, 100).expect("valid");
        assert_eq!(g.prompt, vec![5, 6, 7]);
        assert_eq!(g.max_tokens, 4);
        assert_eq!(g.stop_token_ids, vec![2, 9]);
        assert_eq!(g.params.temperature, 0.5);
        assert_eq!(g.params.top_k, 0);
        assert_eq!(g.params.seed, Some(3));
        assert_eq!(g.params.logprobs, Some(2));
        assert_eq!(g.params.min_tokens, 1);
        // No max_tokens: the rest of the context.
        let r = request(serde_json::json!({
            "model": "m", "token_ids": [5, 6, 7], "stop_conditions": {},
            "sampling_options": {}, "output_options": {}, "eos_token_ids": [], "annotations": [],
        }));
        let g = engine_request(8, &r, 64, 100).expect("valid");
        assert_eq!(g.max_tokens, 61);
        assert_eq!(g.params.temperature, 1.0);
    }

    #[test]
    fn impossible_requests_are_invalid_with_a_reason() {
        for (json, want) in [
            (serde_json::json!([]), "no tokens"),
            (serde_json::json!([500]), "outside the vocabulary"),
            (
                serde_json::json!((0..64).collect::<Vec<u32>>()),
                "context is 64",
            ),
        ] {
            let r = request(serde_json::json!({
                "model": "m", "token_ids": json, "stop_conditions": {},
                "sampling_options": {}, "output_options": {}, "eos_token_ids": [],
                "annotations": [],
            }));
            let e = engine_request(1, &r, 64, 100).expect_err("invalid");
            assert!(e.to_string().contains(want), "{e}");
        }
        let r = request(serde_json::json!({
            "model": "m", "token_ids": [1, 2], "stop_conditions": {"max_tokens": 63},
            "sampling_options": {}, "output_options": {}, "eos_token_ids": [], "annotations": [],
        }));
        let e = engine_request(1, &r, 64, 100).expect_err("too long");
        assert!(e.to_string().contains("exceeds the model's context"), "{e}");
    }
}
