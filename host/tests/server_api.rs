//! Endpoint and parameter tests over real loopback HTTP against the real engine over the
//! model-free mock executor.

#![allow(clippy::unwrap_used)]

use crate::server_support;

use std::time::Duration;

use chimera::engine::api::{EngineEvent, GenerateRequest, SamplingParams};
use chimera::server::mock_tokenizer;
use serde_json::{Value, json};
use server_support::*;

async fn server() -> TestServer {
    TestServer::start(Options::default()).await
}

fn completion(prompt: Value, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0});
    for (k, v) in extra.as_object().expect("object") {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let s = server().await;
    let r = request(s.addr, "GET", "/v1/models", &[], b"").await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["max_model_len"], 4096);
    let h = request(s.addr, "GET", "/health", &[], b"").await;
    assert_eq!(h.status, 200, "{}", h.text());
    let m = s.metrics().await;
    for name in [
        "chimera:num_requests_running",
        "chimera:num_requests_waiting",
        "chimera:kv_cache_usage_perc",
        "chimera:prefix_cache_queries_total",
        "chimera:prefix_cache_hits_total",
        "chimera:time_to_first_token_seconds_bucket",
        "chimera:inter_token_latency_seconds_bucket",
        "chimera:e2e_request_latency_seconds_bucket",
        "chimera:prompt_tokens_total",
        "chimera:generation_tokens_total",
        "chimera:num_preemptions_total",
        "chimera:cache_config_info",
        "chimera:router_requests_total",
        "chimera:ssm_snapshot_hits_total",
        "chimera:router_decision_latency_seconds_bucket",
        "chimera:router_placement_fallbacks_total",
    ] {
        assert!(m.contains(name), "missing {name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_text_prompt_counts_tokens_and_finishes_by_length() {
    let s = server().await;
    let r = post(
        s.addr,
        "/v1/completions",
        &completion(json!("hello world"), json!({})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty());
    let prompt_len = tokenizer()
        .encode("hello world", true)
        .unwrap()
        .get_ids()
        .len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(v["usage"]["total_tokens"], prompt_len + 24);
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    // The engine saw exactly the tokenized prompt and max_tokens.
    let seen = s.recorders[0].recent_requests();
    let last = seen.last().unwrap();
    assert_eq!(
        last.prompt,
        tokenizer().encode("hello world", true).unwrap().get_ids()
    );
    assert_eq!(last.max_tokens, 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_non_streaming_agree() {
    let s = server().await;
    for prompt in [json!("the cat sat"), json!([5, 6, 7, 8, 9]), json!("😀 é")] {
        let full = post(
            s.addr,
            "/v1/completions",
            &completion(prompt.clone(), json!({"max_tokens": 40})),
        )
        .await;
        let want = texts(&full.json());
        let st = post(
            s.addr,
            "/v1/completions",
            &completion(prompt.clone(), json!({"max_tokens": 40, "stream": true})),
        )
        .await;
        assert_eq!(st.status, 200);
        assert_eq!(st.header("content-type"), Some("text/event-stream"));
        let events = st.sse();
        for e in &events {
            for c in e["choices"].as_array().unwrap() {
                // A chunk never ends inside a character. Only the length limit can cut the
                // last one, and then the whole text ends with the replacement too.
                let text = c["text"].as_str().unwrap();
                if c["finish_reason"] == "length" && want[0].ends_with('\u{fffd}') {
                    let whole = text.trim_end_matches('\u{fffd}');
                    assert!(!whole.contains('\u{fffd}'), "split UTF-8 in {c}");
                } else {
                    assert!(!text.contains('\u{fffd}'), "split UTF-8 in {c}");
                }
            }
            assert!(e.get("usage").is_none(), "usage only with include_usage");
        }
        let got = join_stream(&events);
        assert_eq!(got[0].0, want[0], "prompt {prompt}");
        assert_eq!(got[0].1.as_deref(), Some("length"));
    }
    // The executor's units include characters split over byte tokens; some output must hold
    // them.
    let r = post(
        s.addr,
        "/v1/completions",
        &completion(json!("the cat sat"), json!({"max_tokens": 200})),
    )
    .await;
    let text = &texts(&r.json())[0];
    assert!(
        !text.is_ascii(),
        "no multi-byte characters generated: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_lists_and_n_choices() {
    let s = server().await;
    let body = completion(
        json!(["the cat", "a dog ran"]),
        json!({"n": 2, "max_tokens": 8}),
    );
    let v = post(s.addr, "/v1/completions", &body).await.json();
    let t = texts(&v);
    assert_eq!(t.len(), 4);
    // Greedy: both choices of a prompt agree, the two prompts differ.
    assert_eq!(t[0], t[1]);
    assert_eq!(t[2], t[3]);
    assert_ne!(t[0], t[2]);
    let tok = tokenizer();
    let p: u64 = ["the cat", "a dog ran"]
        .iter()
        .map(|p| tok.encode(*p, true).unwrap().get_ids().len() as u64)
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], p);
    assert_eq!(v["usage"]["completion_tokens"], 32);
    let v = post(
        s.addr,
        "/v1/completions",
        &completion(json!([[1, 2, 3], [4, 5]]), json!({"max_tokens": 3})),
    )
    .await
    .json();
    assert_eq!(texts(&v).len(), 2);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    // Streamed n > 1 interleaves choices but reassembles to the same texts.
    let st = post(
        s.addr,
        "/v1/completions",
        &completion(
            json!(["the cat", "a dog ran"]),
            json!({"n": 2, "max_tokens": 8, "stream": true}),
        ),
    )
    .await;
    let joined: Vec<String> = join_stream(&st.sse()).into_iter().map(|x| x.0).collect();
    assert_eq!(joined, t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_parameters_reach_the_engine_and_seed_is_reproducible() {
    let s = server().await;
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 12, "temperature": 0.7, "top_p": 0.9,
        "top_k": 5, "min_p": 0.1, "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "stop_token_ids": [7], "ignore_eos": true});
    let a = post(s.addr, "/v1/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let req = s.recorders[0].recent_requests().pop().unwrap();
    let p = &req.params;
    assert_eq!(
        (p.temperature, p.top_p, p.top_k, p.min_p),
        (0.7, 0.9, 5, 0.1)
    );
    assert_eq!(p.seed, Some(42));
    assert_eq!(
        (
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty
        ),
        (0.5, -0.5, 1.2)
    );
    assert_eq!(req.stop_token_ids, vec![7]);
    assert!(req.ignore_eos);
    assert_eq!(p.logprobs, None);
    let b = post(s.addr, "/v1/completions", &body).await;
    assert_eq!(texts(&a.json()), texts(&b.json()), "same seed, same text");
    let mut other = body.clone();
    other["seed"] = json!(43);
    let c = post(s.addr, "/v1/completions", &other).await;
    assert_ne!(
        texts(&a.json()),
        texts(&c.json()),
        "different seed, different text"
    );
    // top_k = -1 means disabled, as in vLLM.
    let mut off = body.clone();
    off["top_k"] = json!(-1);
    assert_eq!(post(s.addr, "/v1/completions", &off).await.status, 200);
    assert_eq!(
        s.recorders[0].recent_requests().pop().unwrap().params.top_k,
        0
    );
}

/// Token strings of a greedy completion, via logprobs.
async fn token_strings(s: &TestServer, prompt: &str, max_tokens: u32) -> (String, Vec<String>) {
    let v = post(
        s.addr,
        "/v1/completions",
        &completion(
            json!(prompt),
            json!({"max_tokens": max_tokens, "logprobs": 1}),
        ),
    )
    .await
    .json();
    let toks = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    (texts(&v)[0].clone(), toks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_split_across_tokens() {
    let s = server().await;
    let (text, toks) = token_strings(&s, "the cat sat on", 60).await;
    // Pick two adjacent whole-word tokens and a stop string straddling their boundary.
    let i = toks
        .windows(2)
        .position(|w| w.iter().all(|t| t.len() >= 3 && t.is_ascii()))
        .expect("two adjacent word tokens");
    let (a, b) = (&toks[i], &toks[i + 1]);
    let stop = format!("{}{}", &a[a.len() - 2..], &b[..2]);
    let cut = text.find(&stop).expect("stop string occurs in the text");
    let cancels_before = s.counter(|c| c.get(&c.cancels));
    for stream in [false, true] {
        let body = completion(
            json!("the cat sat on"),
            json!({"max_tokens": 60, "stop": [stop.clone(), "zzzz"], "stream": stream}),
        );
        let r = post(s.addr, "/v1/completions", &body).await;
        let (got, finish) = if stream {
            let ev = r.sse();
            let last = ev
                .iter()
                .rev()
                .find(|e| e["choices"][0]["finish_reason"].is_string())
                .unwrap()
                .clone();
            assert_eq!(last["choices"][0]["stop_reason"], json!(stop));
            join_stream(&ev).remove(0)
        } else {
            let v = r.json();
            assert_eq!(v["choices"][0]["stop_reason"], json!(stop));
            (
                texts(&v)[0].clone(),
                v["choices"][0]["finish_reason"].as_str().map(String::from),
            )
        };
        assert_eq!(got, text[..cut], "stream={stream}");
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    // A stop string ends the engine request through a cancel. The engine may still finish
    // a request by length before its cancel arrives, and the idle gauges read 0 then, so the
    // wait is for the cancels themselves.
    let cancels = || s.counter(|c| c.get(&c.cancels));
    wait_for(
        "the stop strings' cancels",
        Duration::from_secs(10),
        async || cancels() >= cancels_before + 2,
    )
    .await;
    assert!(s.wait_idle(Duration::from_secs(10)).await);
    assert_eq!(cancels(), cancels_before + 2);
    // A stop string that never matches releases everything held back.
    let r = post(
        s.addr,
        "/v1/completions",
        &completion(
            json!("the cat sat on"),
            json!({"max_tokens": 60, "stop": ["the cat sat on the mat and ran"]}),
        ),
    )
    .await;
    assert_eq!(texts(&r.json())[0], text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_the_text() {
    let s = server().await;
    let (text, toks) = token_strings(&s, "a dog", 40).await;
    let word = toks
        .iter()
        .skip(2)
        .find(|t| t.len() >= 3 && t.is_ascii())
        .expect("a word token")
        .clone();
    let id = tokenizer()
        .token_to_id(&word.replace(' ', "Ġ"))
        .expect("word id");
    let r = post(
        s.addr,
        "/v1/completions",
        &completion(
            json!("a dog"),
            json!({"max_tokens": 40, "stop_token_ids": [id]}),
        ),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["choices"][0]["stop_reason"], json!(id));
    let cut = text.find(&word).unwrap();
    assert_eq!(texts(&r)[0], text[..cut]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_logprobs_and_echo() {
    let s = server().await;
    let v = post(
        s.addr,
        "/v1/completions",
        &completion(json!("hello"), json!({"max_tokens": 6, "logprobs": 3})),
    )
    .await
    .json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 6);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 6);
    assert_eq!(lp["text_offset"].as_array().unwrap().len(), 6);
    for top in lp["top_logprobs"].as_array().unwrap() {
        let n = top.as_object().unwrap().len();
        assert!((1..=3).contains(&n), "{top}");
    }
    assert!(lp["token_logprobs"][0].as_f64().unwrap() < 0.0);
    assert_eq!(
        s.recorders[0]
            .recent_requests()
            .pop()
            .unwrap()
            .params
            .logprobs,
        Some(3)
    );
    let echo_prompt = "hello there, general";
    // echo puts the prompt in front; with logprobs the prompt tokens come first, scored by
    // the engine (the first one has nothing before it: null).
    let plain = texts(
        &post(
            s.addr,
            "/v1/completions",
            &completion(json!(echo_prompt), json!({"max_tokens": 6})),
        )
        .await
        .json(),
    )[0]
    .clone();
    let e = post(
        s.addr,
        "/v1/completions",
        &completion(
            json!(echo_prompt),
            json!({"max_tokens": 6, "echo": true, "logprobs": 0}),
        ),
    )
    .await
    .json();
    assert_eq!(texts(&e)[0], format!("{echo_prompt}{plain}"));
    let toks = e["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    let prompt_len = tokenizer()
        .encode(echo_prompt, true)
        .unwrap()
        .get_ids()
        .len();
    assert_eq!(toks.len(), prompt_len + 6);
    assert!(toks[0].is_null());
    assert!(
        prompt_len >= 2,
        "the test needs a prompt of two tokens or more"
    );
    // The prompt logprobs are the engine's, unchanged and in place: the same prompt run
    // directly on an engine of the same setup scores every position the same.
    let ids = tokenizer()
        .encode(echo_prompt, true)
        .unwrap()
        .get_ids()
        .to_vec();
    let direct = Options::default().run_direct(GenerateRequest {
        id: 1,
        prompt: ids,
        params: SamplingParams {
            logprobs: Some(0),
            ..SamplingParams::default()
        },
        max_tokens: 6,
        stop_token_ids: vec![],
        ignore_eos: false,
        prompt_logprobs: Some(0),
        block_hashes: None,
        checkpoints: Vec::new(),
        priority: 0,
        constraint: None,
        speculative: true,
    });
    let want = direct
        .iter()
        .find_map(|e| match e {
            EngineEvent::PromptLogprobs { logprobs } => Some(logprobs.clone()),
            _ => None,
        })
        .expect("the engine sent prompt logprobs");
    assert_eq!(want.len(), prompt_len);
    for (p, t) in toks.iter().enumerate().take(prompt_len).skip(1) {
        let want = want[p].as_ref().expect("a logprob").logprob;
        assert_eq!(t.as_f64().map(|x| x as f32), Some(want), "prompt token {p}");
    }
    assert_eq!(
        s.recorders[0]
            .recent_requests()
            .pop()
            .unwrap()
            .prompt_logprobs,
        Some(0),
        "echo + logprobs: 0 asks the engine for prompt logprobs with 0 alternatives"
    );
    let st = post(
        s.addr,
        "/v1/completions",
        &completion(
            json!(echo_prompt),
            json!({"max_tokens": 6, "echo": true, "stream": true, "logprobs": 0}),
        ),
    )
    .await;
    let ev = st.sse();
    assert_eq!(join_stream(&ev)[0].0, format!("{echo_prompt}{plain}"));
    // The streamed logprobs, joined, equal the non-streamed ones (prompt tokens first).
    let mut streamed = Vec::new();
    for x in &ev {
        if let Some(t) = x["choices"][0]["logprobs"]["tokens"].as_array() {
            streamed.extend(t.iter().cloned());
        }
    }
    assert_eq!(
        &streamed,
        e["choices"][0]["logprobs"]["tokens"].as_array().unwrap()
    );
    let mut streamed_lp = Vec::new();
    for x in &ev {
        if let Some(t) = x["choices"][0]["logprobs"]["token_logprobs"].as_array() {
            streamed_lp.extend(t.iter().take(prompt_len).cloned());
        }
    }
    assert_eq!(&streamed_lp[..prompt_len], &toks[..prompt_len]);
}

fn chat(messages: Value, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": messages, "max_tokens": 20, "temperature": 0});
    for (k, v) in extra.as_object().expect("object") {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_stream_and_usage() {
    let s = server().await;
    let msgs = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat(msgs.clone(), json!({})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // The engine got the chat template's rendering, tokenized without extra special tokens.
    let rendered = "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n";
    let want: Vec<u32> = tokenizer()
        .encode(rendered, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(s.recorders[0].recent_requests().pop().unwrap().prompt, want);
    assert_eq!(v["usage"]["prompt_tokens"], want.len() as u64);

    let st = post(
        s.addr,
        "/v1/chat/completions",
        &chat(
            msgs.clone(),
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    )
    .await;
    let ev = st.sse();
    assert_eq!(ev[0]["object"], "chat.completion.chunk");
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    let last = ev.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], v["usage"][k], "{k}");
    }
    // The second identical prompt reuses the first one's cached blocks.
    assert!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    for e in &ev[..ev.len() - 1] {
        assert!(
            e["usage"].is_null(),
            "usage must be null before the last chunk"
        );
    }
    let joined = join_stream(&ev);
    assert_eq!(
        joined[0].0,
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(joined[0].1.as_deref(), Some("length"));
    // max_completion_tokens wins over max_tokens.
    let v = post(
        s.addr,
        "/v1/chat/completions",
        &chat(msgs, json!({"max_completion_tokens": 3})),
    )
    .await
    .json();
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

/// `stream_options.continuous_usage_stats` (vLLM's): with `include_usage`, every chunk carries
/// the running usage — the prompt's tokens, the completion tokens streamed so far (exactly the
/// ids the chunks have carried) and their total — and the final usage chunk stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_usage_stats_put_running_usage_on_every_chunk() {
    let s = server().await;
    let msgs = json!([{"role": "user", "content": "count to ten"}]);
    let bodies = [
        (
            "/v1/completions",
            completion(json!("one two three"), json!({"max_tokens": 8})),
        ),
        ("/v1/chat/completions", chat(msgs, json!({"max_tokens": 8}))),
    ];
    for (path, body) in bodies {
        let full = post(s.addr, path, &body).await.json();
        let prompt = full["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(full["usage"]["completion_tokens"], 8);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["return_token_ids"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        let ev = post(s.addr, path, &streamed).await.sse();
        assert!(ev.len() > 3, "{path}: {ev:?}");
        let mut ids = 0;
        for e in &ev[..ev.len() - 1] {
            ids += e["choices"][0]["token_ids"].as_array().map_or(0, Vec::len) as u64;
            let u = &e["usage"];
            assert_eq!(u["prompt_tokens"], prompt, "{path}: {e}");
            assert_eq!(u["completion_tokens"], ids, "{path}: {e}");
            assert_eq!(u["total_tokens"], prompt + ids, "{path}: {e}");
        }
        assert_eq!(ids, 8, "{path}");
        let last = ev.last().unwrap();
        assert_eq!(last["choices"].as_array().unwrap().len(), 0);
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(last["usage"][k], full["usage"][k], "{path}: {k}");
        }
        // Without include_usage there is no usage at all (vLLM's rule).
        streamed["stream_options"] = json!({"continuous_usage_stats": true});
        let ev = post(s.addr, path, &streamed).await.sse();
        assert!(
            ev.iter().all(|e| e.get("usage").is_none()),
            "{path}: {ev:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_shape_and_n() {
    let s = server().await;
    let msgs = json!([{"role": "user", "content": "the cat"}]);
    let v = post(s.addr, "/v1/chat/completions", &chat(msgs.clone(), json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 7}))).await.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    for c in v["choices"].as_array().unwrap() {
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 5);
        for t in content {
            assert!(t["token"].is_string() && t["logprob"].is_f64() && t["bytes"].is_array());
            assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2);
        }
    }
    // Seeded n > 1: choices differ from each other but repeat across calls.
    let t = texts(&v);
    assert!(t[0] != t[1] || t[1] != t[2]);
    let again = post(s.addr, "/v1/chat/completions", &chat(msgs.clone(), json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 7}))).await.json();
    assert_eq!(texts(&again), t);
    let no = post(s.addr, "/v1/chat/completions", &chat(msgs, json!({})))
        .await
        .json();
    assert!(no["choices"][0]["logprobs"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_reported_on_a_repeated_prompt() {
    let s = server().await;
    let prompt = "the cat sat on the mat and the dog ran on the mat and the cat sat here";
    let first = post(
        s.addr,
        "/v1/completions",
        &completion(json!(prompt), json!({"max_tokens": 2})),
    )
    .await
    .json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = post(
        s.addr,
        "/v1/completions",
        &completion(json!(prompt), json!({"max_tokens": 2})),
    )
    .await
    .json();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let len = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < len, "cached {cached} of {len}");
    // Whole blocks of 4, leaving at least two tokens to compute.
    assert_eq!(cached, (len - 2) / 4 * 4);
    // The counters are in tokens, as vLLM's: each request queried its whole prompt, and the
    // hits are exactly the tokens the second one was served from the cache.
    assert!(s.wait_idle(Duration::from_secs(10)).await);
    let m = s.metrics().await;
    assert_eq!(
        parse_metric(&m, "chimera:prefix_cache_queries_total"),
        (2 * len) as f64
    );
    assert_eq!(
        parse_metric(&m, "chimera:prefix_cache_hits_total"),
        cached as f64
    );
    assert_eq!(
        parse_metric(&m, "chimera:prompt_tokens_total"),
        (2 * len) as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eos_ends_generation_and_is_not_printed() {
    let mut opts = Options::default();
    opts.mock.eos_one_in = 4;
    let s = TestServer::start(opts).await;
    let mut saw_stop = false;
    for p in ["a", "b", "c", "d", "e"] {
        let v = post(
            s.addr,
            "/v1/completions",
            &completion(json!(p), json!({"max_tokens": 64})),
        )
        .await
        .json();
        let t = &texts(&v)[0];
        assert!(!t.contains(mock_tokenizer::EOS));
        if v["choices"][0]["finish_reason"] == "stop" {
            saw_stop = true;
            assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 64);
        }
        // ignore_eos runs to max_tokens.
        let v = post(
            s.addr,
            "/v1/completions",
            &completion(json!(p), json!({"max_tokens": 64, "ignore_eos": true})),
        )
        .await
        .json();
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
    assert!(saw_stop);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_failure_maps_to_an_error() {
    let mut opts = Options::default();
    opts.mock.fail_on_token = Some(3);
    let s = TestServer::start(opts).await;
    let r = post(
        s.addr,
        "/v1/completions",
        &completion(json!([1, 2, 3]), json!({})),
    )
    .await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["code"], "executor_failed");
    let st = post(
        s.addr,
        "/v1/completions",
        &completion(json!([1, 2, 3]), json!({"stream": true})),
    )
    .await;
    assert_eq!(st.status, 200);
    let ev = st.sse();
    assert_eq!(ev.last().unwrap()["error"]["code"], "executor_failed");
    assert!(
        s.metric_sum("chimera:request_errors_total{kind=\"executor_failed\"")
            .await
            >= 1.0
    );
}

/// Streaming over a reused keep-alive connection: with Nagle's algorithm on the server's
/// socket, each small SSE write waits for the client's delayed ACK (~40 ms on Linux) — the
/// first token arrived ~40 ms late although the engine had it in a few ms. Accepted
/// connections set TCP_NODELAY, so the first event comes within a few ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_first_token_is_not_delayed_on_a_reused_connection() {
    let s = server().await;
    let body = completion(json!("hello"), json!({"stream": true, "max_tokens": 4}));
    let times = stream_ttfts_on_one_connection(s.addr, "/v1/completions", &body, 9).await;
    // The first request runs while the connection is new (TCP's quick-ACK mode hides Nagle).
    let mut reused = times[1..].to_vec();
    reused.sort();
    let median = reused[reused.len() / 2];
    let server_ttft = s
        .metric_sum("chimera:time_to_first_token_seconds_sum")
        .await
        / s.metric_sum("chimera:time_to_first_token_seconds_count")
            .await;
    eprintln!(
        "client TTFT per request: {times:?}; median on the reused connection {median:?}; \
         server's own mean TTFT {:.2} ms",
        server_ttft * 1e3
    );
    assert!(
        median < Duration::from_millis(20),
        "first token {median:?} after the request on a reused connection (all: {times:?})"
    );
}

/// Response ids are unique across restarts (as vLLM's random ids): two servers started alike
/// give different first ids, each `cmpl-` and 32 hex digits; `/version` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_ids_differ_across_restarts_and_version_answers() {
    let mut firsts = Vec::new();
    for _ in 0..2 {
        let s = server().await;
        let body = json!({"prompt": "hi", "max_tokens": 1});
        let a = post(s.addr, "/v1/completions", &body).await.json();
        let b = post(s.addr, "/v1/completions", &body).await.json();
        let (a, b) = (
            a["id"].as_str().unwrap().to_string(),
            b["id"].as_str().unwrap(),
        );
        assert_ne!(a, b);
        let hex = a.strip_prefix("cmpl-").unwrap();
        assert_eq!(hex.len(), 32, "{a}");
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        firsts.push(a);
        let v = request(s.addr, "GET", "/version", &[], b"").await;
        assert_eq!(v.status, 200);
        assert_eq!(v.json()["version"], env!("CARGO_PKG_VERSION"));
    }
    assert_ne!(firsts[0], firsts[1], "the first id repeats across restarts");
}

/// The ids `/v1/models` lists.
async fn model_ids(addr: std::net::SocketAddr) -> Vec<String> {
    let models = request(addr, "GET", "/v1/models", &[], b"").await.json();
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// `/v1/models` lists the served model once (its alias is accepted, not listed as a second
/// model), every alias is accepted, and a 404 for an unknown id lists the served ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_names_and_aliases_are_accepted_and_a_404_lists_them() {
    let s = TestServer::start(Options {
        aliases: vec!["mock-alias".into()],
        ..Options::default()
    })
    .await;
    assert_eq!(model_ids(s.addr).await, [MODEL]);
    for name in [MODEL, "mock-alias"] {
        let body = json!({"model": name, "prompt": "hi", "max_tokens": 2});
        let r = post(s.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        assert_eq!(r.json()["model"], MODEL);
    }
    let body = json!({"model": "nope", "prompt": "hi", "max_tokens": 2});
    let r = post(s.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 404);
    let e = r.json();
    assert_eq!(e["error"]["code"], "model_not_found");
    assert_eq!(
        e["error"]["message"],
        format!("the model `nope` does not exist; this server serves `{MODEL}` and `mock-alias`")
    );

    // `served_model_name` replaces the defaults: only its names are accepted.
    let mut o = Options::default();
    o.server.served_model_name = Some(chimera::server::config::ServedNames::Many(vec![
        "org/model".into(),
        "short".into(),
    ]));
    let s = TestServer::start(o).await;
    assert_eq!(
        model_ids(s.addr).await,
        ["org/model", "short"],
        "names given are all listed"
    );
    for (name, status) in [("org/model", 200), ("short", 200), (MODEL, 404)] {
        let body = json!({"model": name, "prompt": "hi", "max_tokens": 2});
        let r = post(s.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, status, "{name}: {}", r.text());
        if status == 200 {
            assert_eq!(r.json()["model"], "org/model");
        }
    }
}

/// OpenAI and vLLM: `max_tokens` omitted on `/v1/completions` means 16 (capped by the room
/// the context leaves); on chat it means the rest of the context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_without_max_tokens_generate_16() {
    let s = server().await;
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "the cat", "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // A prompt that leaves 5 tokens of room gets 5, not an error.
    let prompt_len = tokenizer().encode("the cat", true).unwrap().get_ids().len() as u32;
    let s = TestServer::start(Options {
        max_model_len: prompt_len + 5,
        ..Options::default()
    })
    .await;
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "the cat"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 5);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(
        r.status, 400,
        "the chat prompt alone overflows this context"
    );
}

/// Unknown fields are ignored but logged (so `"max_token": 5` does not pass silently), and each
/// finished request leaves one debug line with its id, token counts and timings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_fields_are_warned_about_and_each_request_is_logged() {
    captured_logs();
    let s = server().await;
    let body = json!({"model": MODEL, "prompt": "the cat sat", "max_token": 5,
                      "zz_field_of_this_test": true, "max_tokens": 3});
    let r = post(s.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let id = v["id"].as_str().unwrap().to_string();
    let logs = captured_logs();
    let warning = logs
        .lines()
        .find(|l| l.contains("zz_field_of_this_test"))
        .unwrap_or_else(|| panic!("no warning about the unknown fields in:\n{logs}"));
    assert!(warning.contains("WARN"), "{warning}");
    assert!(
        warning.contains("fields=max_token, zz_field_of_this_test"),
        "{warning}"
    );
    assert!(
        warning.contains("endpoint=\"/v1/completions\""),
        "{warning}"
    );
    // The log is the test binary's: servers of other tests number their requests from 1 as
    // well, so this request's line is the one with its id and every expected field.
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let fields = [
        format!("request_id={id} "),
        "DEBUG".to_string(),
        "request finished".to_string(),
        format!("prompt_tokens={prompt_tokens} "),
        "output_tokens=3 ".to_string(),
        "cached_tokens=0 ".to_string(),
        "finish=\"length\"".to_string(),
        "ttft_ms=".to_string(),
        "e2e_ms=".to_string(),
    ];
    let ours: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains(&format!("request_id={id} ")))
        .collect();
    assert!(
        ours.iter()
            .any(|l| fields.iter().all(|f| l.contains(f.as_str()))),
        "no line with {fields:?} among the lines for {id}:\n{}",
        ours.join("\n")
    );
}

/// With `server.api_key`, `/v1/*` needs `Authorization: Bearer <key>` (401 with the OpenAI
/// error shape otherwise); `/health` and `/metrics` stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_protects_the_v1_endpoints() {
    let mut o = Options::default();
    o.server.api_key = Some("sk-test-key".into());
    let s = TestServer::start(o).await;
    let body =
        serde_json::to_vec(&json!({"model": MODEL, "prompt": "hi", "max_tokens": 2})).unwrap();
    for auth in [None, Some("Bearer sk-wrong-key"), Some("sk-test-key")] {
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(a) = auth {
            headers.push(("Authorization", a));
        }
        for (method, path) in [("POST", "/v1/completions"), ("GET", "/v1/models")] {
            let r = request(s.addr, method, path, &headers, &body).await;
            assert_eq!(r.status, 401, "{auth:?} {path}: {}", r.text());
            assert_eq!(r.json()["error"]["code"], "unauthorized");
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        }
    }
    let headers = [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer sk-test-key"),
    ];
    let r = request(s.addr, "POST", "/v1/completions", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = request(s.addr, "GET", "/v1/models", &headers, b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    for path in ["/health", "/metrics"] {
        assert_eq!(
            request(s.addr, "GET", path, &[], b"").await.status,
            200,
            "{path}"
        );
    }
    assert_eq!(
        s.metric_sum("chimera:request_errors_total{kind=\"unauthorized\"")
            .await,
        6.0
    );
}

/// `/tokenize` and `/detokenize` (vLLM's shapes): the ids a prompt or a chat would be served
/// with, and text back from ids; bad input is a 400 that names the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize() {
    let s = server().await;
    let c = codec();
    let text = "hello tokenizer world";
    let r = post(
        s.addr,
        "/tokenize",
        &json!({"model": MODEL, "prompt": text}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let want = c.encode(text, true).unwrap();
    let got: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(got, want);
    assert_eq!(v["count"], want.len());
    assert_eq!(v["max_model_len"], 4096);
    // Without special tokens, detokenize gives the text back.
    let r = post(
        s.addr,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    )
    .await;
    let ids = r.json()["tokens"].clone();
    let r = post(
        s.addr,
        "/detokenize",
        &json!({"model": MODEL, "tokens": ids}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["prompt"], text);
    // Chat messages go through the chat template, as /v1/chat/completions renders them.
    let messages = json!([{"role": "user", "content": "hi there"}]);
    let r = post(s.addr, "/tokenize", &json!({"messages": messages})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let rendered = c.render_chat(&messages, true).unwrap();
    let got: Vec<u32> = serde_json::from_value(r.json()["tokens"].clone()).unwrap();
    assert_eq!(got, c.encode(&rendered, false).unwrap());
    // Bad input.
    for (body, field) in [
        (json!({"prompt": "a", "messages": messages}), "prompt"),
        (json!({}), "prompt"),
    ] {
        let r = post(s.addr, "/tokenize", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], field, "{}", r.text());
    }
    let r = post(s.addr, "/detokenize", &json!({"tokens": [1, 99999999]})).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("outside the vocabulary"), "{}", r.text());
    let r = post(
        s.addr,
        "/tokenize",
        &json!({"model": "nope", "prompt": "a"}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
}

/// vLLM's request fields are honoured, not ignored: `min_tokens`, `include_stop_str_in_output`,
/// `prompt_logprobs`, `truncate_prompt_tokens`, `priority` and `logit_bias`, each refused with
/// a 400 naming it when it cannot be served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_request_fields_are_served_or_refused_by_name() {
    let s = server().await;
    let bad = async |body: Value, param: &str| {
        let r = post(s.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.text());
    };
    let base = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    bad(with("logit_bias", json!({"x": 1})), "logit_bias").await;
    bad(with("logit_bias", json!({"5": 101})), "logit_bias").await;
    bad(with("logit_bias", json!({"99999999": 1})), "logit_bias").await;
    bad(with("min_tokens", json!(7)), "min_tokens").await;
    bad(with("priority", json!(3)), "priority").await;
    bad(
        with("truncate_prompt_tokens", json!(0)),
        "truncate_prompt_tokens",
    )
    .await;
    bad(with("prompt_logprobs", json!(99)), "prompt_logprobs").await;
    let mut streamed = with("prompt_logprobs", json!(1));
    streamed["stream"] = json!(true);
    bad(streamed, "prompt_logprobs").await;

    // truncate_prompt_tokens keeps the last tokens of the prompt.
    let ids: Vec<u32> = (40..50).collect();
    let mut t = with("prompt", json!(ids));
    t["truncate_prompt_tokens"] = json!(3);
    t["return_token_ids"] = json!(true);
    let v = post(s.addr, "/v1/completions", &t).await.json();
    assert_eq!(v["usage"]["prompt_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["prompt_token_ids"], json!([47, 48, 49]));

    // prompt_logprobs: one entry per prompt token, the first null, each holding the prompt
    // token with its rank and the asked-for alternatives ranked from 1.
    let mut p = with("prompt", json!(ids));
    p["prompt_logprobs"] = json!(2);
    let v = post(s.addr, "/v1/completions", &p).await.json();
    let plp = v["choices"][0]["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs");
    assert_eq!(plp.len(), ids.len());
    assert!(plp[0].is_null());
    for (i, entry) in plp.iter().enumerate().skip(1) {
        let m = entry.as_object().expect("an object");
        let own = &m[&ids[i].to_string()];
        assert!(own["logprob"].as_f64().unwrap() <= 0.0);
        assert!(own["rank"].as_u64().unwrap() >= 1);
        assert!(own["decoded_token"].is_string());
        let ranks: Vec<u64> = m.values().map(|e| e["rank"].as_u64().unwrap()).collect();
        assert!(ranks.contains(&1) && ranks.contains(&2), "{entry}");
    }

    // include_stop_str_in_output keeps the matched stop string.
    let text = post(s.addr, "/v1/completions", &base).await.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 3, "{text:?}");
    let stop: String = chars[1..3].iter().collect();
    let cut = text.find(&stop).unwrap();
    let mut st = with("stop", json!([stop]));
    let v = post(s.addr, "/v1/completions", &st).await.json();
    assert_eq!(v["choices"][0]["text"], text[..cut], "{v}");
    st["include_stop_str_in_output"] = json!(true);
    let v = post(s.addr, "/v1/completions", &st).await.json();
    assert_eq!(v["choices"][0]["text"], text[..cut + stop.len()], "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // min_tokens: a stop string is not matched before that many tokens are out.
    let mut m = st.clone();
    m["include_stop_str_in_output"] = json!(false);
    m["min_tokens"] = json!(6);
    let v = post(s.addr, "/v1/completions", &m).await.json();
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    assert_eq!(v["choices"][0]["text"], text, "{v}");
}

/// Under `engine.scheduling_policy = "priority"` a request's `priority` is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_is_accepted_under_the_priority_policy() {
    let mut o = Options::default();
    o.engine.scheduling_policy = "priority".into();
    let s = TestServer::start(o).await;
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": -5});
    let r = post(s.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
}
