//! Multi-turn reuse through the HTTP API, against the real engine over the mock executor (a
//! hybrid spec: the mock's logits depend on its SSM state, so a wrong restore shows): token ids
//! in and out (`return_token_ids`), the render endpoints, client checkpoints, and the cache's
//! per-request miss reasons in responses and in `/metrics`.

#![allow(clippy::unwrap_used)]

use crate::server_support;

use chimera::engine::api::{EngineEvent, GenerateRequest, SamplingParams};
use serde_json::{Value, json};
use server_support::*;

const BS: usize = 4;

fn hybrid() -> Options {
    let mut o = Options::default();
    o.mock.ssm_layers = 2;
    o.block_size = BS;
    o
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// What a cold engine of this setup generates for `prompt` (greedy, `n` tokens).
fn cold(o: &Options, prompt: &[u32], n: u32) -> Vec<u32> {
    let events = o.run_direct(GenerateRequest {
        id: 1,
        prompt: prompt.to_vec(),
        params: SamplingParams::default(),
        max_tokens: n,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        prompt_logprobs: None,
        block_hashes: None,
        checkpoints: Vec::new(),
        priority: 0,
        constraint: None,
        speculative: true,
    });
    events
        .into_iter()
        .filter_map(|e| match e {
            EngineEvent::Tokens { tokens, .. } => Some(tokens),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Three turns in token space: each prompt is the previous prompt, the reply's `token_ids`
/// and a new message. From turn 2 on the cache serves up to at most one block before where
/// the previous turn ended, the miss reason names the uncomputed new message, and every reply
/// equals a cold run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_continues_in_token_space_and_is_served_from_cache() {
    let opts = hybrid();
    let s = TestServer::start(hybrid()).await;
    let c = codec();
    let mut prompt = c.encode("the cat sat on the mat and looked", true).unwrap();
    let mut ended_at = 0;
    let mut misses = 0.0;
    for turn in 0..3 {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12,
            "temperature": 0, "return_token_ids": true});
        let r = post(s.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let choice = &v["choices"][0];
        assert_eq!(ids(&choice["prompt_token_ids"]), prompt, "turn {turn}");
        let reply = ids(&choice["token_ids"]);
        assert_eq!(reply.len() as u64, v["usage"]["completion_tokens"]);
        assert_eq!(reply, cold(&opts, &prompt, 12), "turn {turn}: reply");
        let details = &v["usage"]["prompt_tokens_details"];
        let cached = details["cached_tokens"].as_u64().unwrap() as usize;
        assert_eq!(
            details["cacheable_tokens"].as_u64().unwrap() as usize,
            (prompt.len() - 2) / BS * BS
        );
        if turn == 0 {
            assert_eq!(cached, 0);
        } else {
            assert!(
                cached + BS >= ended_at && cached < ended_at,
                "turn {turn}: cached {cached}, previous turn ended at {ended_at}"
            );
        }
        let cacheable = details["cacheable_tokens"].as_u64().unwrap() as usize;
        if turn == 0 {
            // A cold prompt: a miss, and it says why.
            assert!(cached < cacheable);
            assert_eq!(details["cache_miss_reason"], "no_kv_match", "turn {turn}");
            misses += 1.0;
        } else {
            // Short of the cacheable prefix only where the new message starts: reuse was
            // maximal, so no miss reason (it would be noise on every follow-up).
            assert!(
                cached < cacheable,
                "turn {turn}: the new message is never cached"
            );
            assert!(
                details.get("cache_miss_reason").is_none(),
                "turn {turn}: {details}"
            );
        }
        prompt.extend(&reply);
        ended_at = prompt.len();
        prompt.extend(c.encode(" and then the dog", false).unwrap());
    }
    assert_eq!(s.engine_sum(|e| e.ssm_restores), 2);
    assert!(s.engine_sum(|e| e.ssm_rolling_kept) >= 2);
    let m = s.metrics().await;
    assert!(
        parse_metric(
            &m,
            "chimera:ssm_snapshot_copies_total{model_name=\"tiny-mock\",engine=\"0\",kind=\"rolling\""
        ) > 0.0,
        "{m}"
    );
    assert_eq!(
        parse_metric(
            &m,
            "chimera:prefix_cache_misses_total{model_name=\"tiny-mock\",engine=\"0\",reason=\"no_kv_match\""
        ),
        misses
    );
    assert_eq!(misses, 1.0);
    // Without `return_token_ids` none of the id fields appear.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "a cat", "max_tokens": 2}),
    )
    .await
    .json();
    assert!(r["choices"][0].get("token_ids").is_none(), "{r}");
    assert!(r["choices"][0].get("prompt_token_ids").is_none(), "{r}");
}

/// Chat with `return_token_ids`: the rendered prompt's ids at the top, each choice's ids; a
/// stream carries the prompt ids once and ids per chunk that add up to the full response's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_returns_token_ids_whole_and_streamed() {
    let s = TestServer::start(hybrid()).await;
    let c = codec();
    let messages = json!([{"role": "user", "content": "tell me about the cat"}]);
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 10,
        "temperature": 0, "return_token_ids": true});
    let v = post(s.addr, "/v1/chat/completions", &body).await.json();
    let rendered = c.render_chat(&messages, true).unwrap();
    let want_prompt = c.encode(&rendered, false).unwrap();
    assert_eq!(ids(&v["prompt_token_ids"]), want_prompt);
    let reply = ids(&v["choices"][0]["token_ids"]);
    assert_eq!(reply.len() as u64, v["usage"]["completion_tokens"]);
    assert_eq!(reply, cold(&hybrid(), &want_prompt, 10));
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let ev = post(s.addr, "/v1/chat/completions", &stream_body)
        .await
        .sse();
    assert_eq!(ids(&ev[0]["prompt_token_ids"]), want_prompt);
    let mut streamed = Vec::new();
    for (i, e) in ev.iter().enumerate() {
        if i > 0 {
            assert!(e.get("prompt_token_ids").is_none(), "chunk {i}: {e}");
        }
        if let Some(t) = e["choices"][0].get("token_ids") {
            streamed.extend(ids(t));
        }
    }
    assert_eq!(streamed, reply);
    // Streamed completions: the prompt's ids in the first chunk only.
    let ev = post(
        s.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0,
            "return_token_ids": true, "stream": true}),
    )
    .await
    .sse();
    assert_eq!(
        ids(&ev[0]["choices"][0]["prompt_token_ids"]),
        vec![5, 6, 7, 8, 9]
    );
    let with_prompt = ev
        .iter()
        .filter(|e| e["choices"][0].get("prompt_token_ids").is_some())
        .count();
    assert_eq!(with_prompt, 1);
    let streamed: usize = ev
        .iter()
        .filter_map(|e| e["choices"][0].get("token_ids"))
        .map(|t| ids(t).len())
        .sum();
    assert_eq!(streamed, 6);
}

/// One staged case per miss reason the HTTP surface can provoke, each reported exactly, and
/// counted by reason in `/metrics`; `cache_config_info` describes the SSM snapshot pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_miss_says_why() {
    let s = TestServer::start(hybrid()).await;
    let reason = async |body: Value| -> (Value, u64) {
        let r = post(s.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let d = v["usage"]["prompt_tokens_details"].clone();
        (
            d["cache_miss_reason"].clone(),
            d["cached_tokens"].as_u64().unwrap(),
        )
    };
    let long: Vec<u32> = (10..40).collect();
    let req = |prompt: &[u32]| json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    // Five tokens: a skip of one block would leave one token.
    assert_eq!(reason(req(&long[..5])).await.0, "prompt_too_short");
    // A cold prompt: nothing of it was ever cached.
    let cold: Vec<u32> = (100..130).collect();
    assert_eq!(reason(req(&cold)).await.0, "no_kv_match");
    // `long` goes on past the cached block of its five-token prefix with tokens nobody
    // computed: all the cache held was served, which is no miss.
    let (r, cached) = reason(req(&long)).await;
    assert!(r.is_null(), "{r}");
    assert_eq!(cached as usize, BS, "the prefix's block");
    // The same prompt again: served in full, no reason.
    let (r, cached) = reason(req(&long)).await;
    assert!(r.is_null(), "{r}");
    assert_eq!(cached as usize, (long.len() - 2) / BS * BS);
    // Prompt logprobs recompute everything.
    let mut lp = req(&long);
    lp["echo"] = json!(true);
    lp["logprobs"] = json!(1);
    assert_eq!(reason(lp).await.0, "prompt_logprobs");
    // Shares 3 blocks with `long`, whose snapshots are at 4, 24 and 28 only.
    let diverge = [&long[..13], &[50, 51, 52, 53, 54, 55][..]].concat();
    assert_eq!(reason(req(&diverge)).await.0, "no_ssm_snapshot");
    let m = s.metrics().await;
    let count = |r: &str| {
        parse_metric(
            &m,
            &format!(
                "chimera:prefix_cache_misses_total{{model_name=\"tiny-mock\",engine=\"0\",reason=\"{r}\""
            ),
        )
    };
    for (r, n) in [
        ("prompt_too_short", 1.0),
        ("no_kv_match", 1.0),
        ("prompt_logprobs", 1.0),
        ("no_ssm_snapshot", 1.0),
        ("evicted", 0.0),
        ("caching_disabled", 0.0),
        ("snapshot_budget_full", 0.0),
    ] {
        assert_eq!(count(r), n, "{r}");
    }
    let info = m
        .lines()
        .find(|l| l.starts_with("chimera:cache_config_info{"))
        .unwrap();
    assert!(info.contains("ssm_snapshot_slots=\"64\""), "{info}");
    assert!(info.contains("min_cacheable_prefix_tokens=\"4\""), "{info}");
    let bytes = s.engines[0].stats().ssm_slot_bytes;
    assert!(bytes > 0);
    assert!(
        info.contains(&format!("ssm_state_bytes_per_slot=\"{bytes}\"")),
        "{info}"
    );
}

/// The render endpoints give the ids a request would be served with (template applied,
/// nothing generated) in vLLM's token-in shape; bad requests are the same 400s as serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_endpoints_give_what_would_be_served() {
    let s = TestServer::start(hybrid()).await;
    let c = codec();
    let r = post(
        s.addr,
        "/v1/completions/render",
        &json!({"model": MODEL, "prompt": ["the cat", "a dog ran"], "temperature": 0.5}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(
        ids(&list[0]["token_ids"]),
        c.encode("the cat", true).unwrap()
    );
    assert_eq!(
        ids(&list[1]["token_ids"]),
        c.encode("a dog ran", true).unwrap()
    );
    assert_eq!(list[0]["sampling_params"]["max_tokens"], 16);
    assert_eq!(list[0]["sampling_params"]["temperature"], 0.5);
    assert_eq!(list[0]["model"], MODEL);
    let messages =
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]);
    let r = post(
        s.addr,
        "/v1/chat/completions/render",
        &json!({"messages": messages, "max_tokens": 7}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let rendered = c.render_chat(&messages, true).unwrap();
    assert_eq!(ids(&v["token_ids"]), c.encode(&rendered, false).unwrap());
    assert_eq!(v["sampling_params"]["max_tokens"], 7);
    // Nothing was generated.
    assert_eq!(s.engine_sum(|e| e.generation_tokens), 0);
    assert_eq!(s.counter(|r| r.get(&r.added)), 0);
    let r = post(
        s.addr,
        "/v1/chat/completions/render",
        &json!({"messages": []}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = post(
        s.addr,
        "/v1/completions/render",
        &json!({"prompt": "a", "top_p": 7}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
}

/// `cache_checkpoints`: offsets outside the prompt (or message indices past the conversation)
/// are a 400 naming the field; valid ones reach the engine (chat: as the token offset where
/// the marked message ends) and are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_are_validated_passed_on_and_counted() {
    let s = TestServer::start(hybrid()).await;
    let c = codec();
    let prompt: Vec<u32> = (10..30).collect();
    for bad in [json!([0]), json!([21]), json!([4, 99])] {
        let r = post(
            s.addr,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2, "cache_checkpoints": bad}),
        )
        .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], "cache_checkpoints");
    }
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "cache_checkpoints": [9, 20]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        s.recorders[0].recent_requests().pop().unwrap().checkpoints,
        vec![9, 20]
    );
    let messages = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "tell me about the cat"}
    ]);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "cache_checkpoints": [2]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "cache_checkpoints");
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "cache_checkpoints": [0]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let first = json!([messages[0].clone()]);
    let end = c
        .encode(&c.render_chat(&first, false).unwrap(), false)
        .unwrap()
        .len() as u32;
    assert_eq!(
        s.recorders[0].recent_requests().pop().unwrap().checkpoints,
        vec![end]
    );
    // Offsets past the first block count (the chat one too: its system message is long
    // enough).
    assert!(end as usize >= BS);
    assert_eq!(s.engine_sum(|e| e.checkpoints_requested), 3);
    let m = s.metrics().await;
    assert_eq!(
        parse_metric(&m, "chimera:cache_checkpoints_requested_total"),
        3.0
    );
}

/// Speculative decoding through the HTTP API (prompt lookup on a hybrid): replies equal a
/// server's without speculation, `/metrics` counts the drafts as vLLM names them, and a
/// request with `"speculative": false` is never verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_replies_equal_plain_ones_and_are_counted() {
    let mut spec = hybrid();
    spec.speculative = chimera::engine::speculative::SpeculativeConfig {
        method: "ngram".into(),
        num_tokens: 3,
        max_batch: 8,
        prompt_lookup_min: 1,
        prompt_lookup_max: 3,
        ..Default::default()
    };
    let on = TestServer::start(spec).await;
    let off = TestServer::start(hybrid()).await;
    let prompt = "the cat sat on the mat and the cat sat on the mat and the cat";
    let body = |speculative: bool| {
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true, "speculative": speculative})
    };
    let plain = post(off.addr, "/v1/completions", &body(true)).await.json();
    let fast = post(on.addr, "/v1/completions", &body(true)).await.json();
    assert_eq!(
        fast["choices"][0]["token_ids"], plain["choices"][0]["token_ids"],
        "{fast}"
    );
    let m = on.metrics().await;
    let drafts = parse_metric(&m, "chimera:spec_decode_num_drafts_total");
    let proposed = parse_metric(&m, "chimera:spec_decode_num_draft_tokens_total");
    let accepted = parse_metric(&m, "chimera:spec_decode_num_accepted_tokens_total");
    assert!(
        drafts > 0.0 && proposed >= drafts && accepted <= proposed,
        "{m}"
    );
    assert!(
        m.contains("chimera:spec_decode_num_accepted_tokens_per_pos_total{") || accepted == 0.0,
        "{m}"
    );
    // Opted out: the same reply, no verify step.
    let out = post(on.addr, "/v1/completions", &body(false)).await.json();
    assert_eq!(
        out["choices"][0]["token_ids"],
        plain["choices"][0]["token_ids"]
    );
    let m = on.metrics().await;
    assert_eq!(
        parse_metric(&m, "chimera:spec_decode_num_drafts_total"),
        drafts
    );
}
