//! One streaming request to an OpenAI-compatible server, timed chunk by chunk.
//!
//! Owns the HTTP side of the benchmark: the pooled HTTP/1.1 client (plain `http://` only),
//! the JSON body of a `/v1/completions` or `/v1/chat/completions` request with
//! `stream: true` and `stream_options.include_usage: true`, and the reading of the SSE reply
//! into an [`Exchange`]: arrival times of text-carrying chunks, the generated text, and the
//! `usage` block (`prompt_tokens`, `completion_tokens`,
//! `prompt_tokens_details.cached_tokens`).
//!
//! Invariants: every request yields an `Exchange`; a failure is an `Exchange` whose `error` is
//! set with a stable kind (`connect`, `http_<status>`, `timeout`, `stream`, `bad_event`,
//! `server_error`, `incomplete`, `no_output`, `request`), never a panic or a dropped result.
//! Times come from `tokio::time::Instant`, so tests with a paused clock are exact. Must not
//! aggregate statistics or decide when to send.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::BenchError;
use super::sse::SseDecoder;
use super::stats::Failure;
use super::workload::Session;

/// Which OpenAI API the requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Endpoint {
    /// `/v1/completions` with a `prompt`.
    Completions,
    /// `/v1/chat/completions` with `messages`.
    Chat,
}

impl Endpoint {
    pub fn default_path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// How a completions prompt is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// A string.
    Text,
    /// A list of token ids (exact lengths regardless of how the server tokenizes text).
    TokenIds,
}

/// Request fields shared by every request of a run.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt_format: PromptFormat,
    pub temperature: f32,
    pub ignore_eos: bool,
    /// Merged last into every body (overrides the fields above).
    pub extra_body: Map<String, Value>,
}

/// The JSON body for turn `turn` of `session`, given the answers to the earlier turns.
pub fn build_body(
    opts: &RequestOptions,
    session: &Session,
    turn: usize,
    answers: &[String],
) -> Value {
    let mut body = Map::new();
    body.insert("model".into(), Value::String(opts.model.clone()));
    let cur = &session.turns[turn.min(session.turns.len().saturating_sub(1))];
    match opts.endpoint {
        Endpoint::Completions => {
            let prompt = match opts.prompt_format {
                PromptFormat::TokenIds => {
                    let mut ids: Vec<u32> = Vec::new();
                    if let Some(s) = &session.system {
                        ids.extend_from_slice(&s.ids);
                    }
                    ids.extend_from_slice(&cur.user.ids);
                    json!(ids)
                }
                PromptFormat::Text => {
                    let mut text = String::new();
                    if let Some(s) = &session.system {
                        text.push_str(&s.text);
                    }
                    for (t, a) in session.turns.iter().zip(answers).take(turn) {
                        text.push_str(&t.user.text);
                        text.push_str(a);
                    }
                    text.push_str(&cur.user.text);
                    Value::String(text)
                }
            };
            body.insert("prompt".into(), prompt);
        }
        Endpoint::Chat => {
            let mut msgs = Vec::new();
            if let Some(s) = &session.system {
                msgs.push(json!({"role": "system", "content": s.text}));
            }
            for (t, a) in session.turns.iter().zip(answers).take(turn) {
                msgs.push(json!({"role": "user", "content": t.user.text}));
                msgs.push(json!({"role": "assistant", "content": a}));
            }
            msgs.push(json!({"role": "user", "content": cur.user.text}));
            body.insert("messages".into(), Value::Array(msgs));
        }
    }
    body.insert("max_tokens".into(), json!(cur.output_len));
    body.insert("temperature".into(), json!(opts.temperature));
    body.insert("stream".into(), Value::Bool(true));
    body.insert("stream_options".into(), json!({"include_usage": true}));
    if opts.ignore_eos {
        body.insert("ignore_eos".into(), Value::Bool(true));
    }
    for (k, v) in &opts.extra_body {
        body.insert(k.clone(), v.clone());
    }
    Value::Object(body)
}

/// What one streamed request observed. Times are seconds from the send.
#[derive(Debug, Clone, Default)]
pub struct Exchange {
    pub ttft: Option<f64>,
    pub itl: Vec<f64>,
    pub e2e: f64,
    pub chunks: usize,
    pub text: String,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub error: Option<Failure>,
}

fn fail(kind: impl Into<String>, message: impl Into<String>) -> Failure {
    Failure {
        kind: kind.into(),
        message: message.into(),
    }
}

/// A pooled HTTP/1.1 client bound to one server.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    api_key: Option<String>,
}

impl HttpClient {
    /// `url` is the server root, e.g. `http://127.0.0.1:8000`.
    pub fn new(url: &str, api_key: Option<String>) -> Result<Self, BenchError> {
        let uri: Uri = url
            .parse()
            .map_err(|e| BenchError::InvalidArg(format!("--url `{url}`: {e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(BenchError::InvalidArg(format!(
                    "--url `{url}`: scheme `{other}` is not supported; use http://"
                )));
            }
            None => {
                return Err(BenchError::InvalidArg(format!(
                    "--url `{url}`: give a full URL such as http://127.0.0.1:8000"
                )));
            }
        }
        let Some(authority) = uri.authority() else {
            return Err(BenchError::InvalidArg(format!("--url `{url}`: no host")));
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(usize::MAX)
            .build(connector);
        let prefix = uri.path().trim_end_matches('/');
        Ok(Self {
            client,
            base: format!("http://{authority}{prefix}"),
            api_key,
        })
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>, Failure> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path))
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "text/event-stream, application/json");
        if let Some(k) = &self.api_key {
            b = b.header(AUTHORIZATION, format!("Bearer {k}"));
        }
        b.body(Full::new(body))
            .map_err(|e| fail("request", e.to_string()))
    }

    /// GET `path` and return the reply's text (used for `/metrics`).
    pub async fn get_text(&self, path: &str, timeout: Duration) -> Result<String, Failure> {
        let req = self.request("GET", path, Bytes::new())?;
        let fut = async {
            let resp = self.client.request(req).await.map_err(client_failure)?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| fail("stream", e.to_string()))?
                .to_bytes();
            if !status.is_success() {
                return Err(fail(
                    format!("http_{}", status.as_u16()),
                    String::from_utf8_lossy(&bytes).into_owned(),
                ));
            }
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        tokio::time::timeout(timeout, fut)
            .await
            .unwrap_or_else(|_| Err(fail("timeout", format!("no reply in {timeout:?}"))))
    }

    /// GET `path` and parse the JSON reply (used for `/v1/models`).
    pub async fn get_json(&self, path: &str, timeout: Duration) -> Result<Value, Failure> {
        let text = self.get_text(path, timeout).await?;
        serde_json::from_str(&text).map_err(|e| fail("bad_event", e.to_string()))
    }

    /// POSTs `body` to `path` and reads the streamed reply, giving up after `timeout`.
    pub async fn stream(&self, path: &str, body: &Value, timeout: Duration) -> Exchange {
        let start = Instant::now();
        let mut ex = Exchange::default();
        let bytes = Bytes::from(body.to_string());
        let result =
            tokio::time::timeout(timeout, self.stream_inner(path, bytes, start, &mut ex)).await;
        ex.e2e = start.elapsed().as_secs_f64();
        let outcome = match result {
            Ok(r) => r,
            Err(_) => Err(fail("timeout", format!("request exceeded {timeout:?}"))),
        };
        if let Err(f) = outcome {
            ex.error = Some(f);
        }
        ex
    }

    async fn stream_inner(
        &self,
        path: &str,
        body: Bytes,
        start: Instant,
        ex: &mut Exchange,
    ) -> Result<(), Failure> {
        let req = self.request("POST", path, body)?;
        let resp = self.client.request(req).await.map_err(client_failure)?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let text = match body.collect().await {
                Ok(c) => String::from_utf8_lossy(&c.to_bytes())
                    .chars()
                    .take(500)
                    .collect(),
                Err(e) => e.to_string(),
            };
            return Err(fail(format!("http_{}", status.as_u16()), text));
        }
        let mut dec = SseDecoder::new();
        let mut st = StreamState::default();
        let mut last: Option<f64> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| fail("stream", e.to_string()))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let now = start.elapsed().as_secs_f64();
            let mut text_seen = false;
            for ev in dec.push(&data) {
                text_seen |= st.event(&ev, ex)?;
            }
            if text_seen {
                match last {
                    None => ex.ttft = Some(now),
                    Some(prev) => ex.itl.push(now - prev),
                }
                last = Some(now);
            }
            if st.done {
                break;
            }
        }
        if let Some(ev) = dec.finish() {
            st.event(&ev, ex)?;
        }
        if !st.done && !st.finished {
            return Err(fail(
                "incomplete",
                "stream ended without [DONE] or a finish_reason",
            ));
        }
        if ex.chunks == 0 {
            return Err(fail("no_output", "the stream carried no generated text"));
        }
        Ok(())
    }
}

fn client_failure(e: hyper_util::client::legacy::Error) -> Failure {
    if e.is_connect() {
        fail("connect", format!("{e:?}"))
    } else {
        fail("request", format!("{e:?}"))
    }
}

/// Parsing state of one reply stream.
#[derive(Default)]
struct StreamState {
    done: bool,
    finished: bool,
}

impl StreamState {
    /// Handles one event; returns whether it carried generated text.
    fn event(&mut self, data: &str, ex: &mut Exchange) -> Result<bool, Failure> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(false);
        }
        if data.is_empty() {
            return Ok(false);
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| fail("bad_event", format!("{e}: {}", truncate(data))))?;
        if let Some(err) = v.get("error") {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| err.to_string(), str::to_string);
            return Err(fail("server_error", msg));
        }
        let mut text_seen = false;
        if let Some(choices) = v.get("choices").and_then(Value::as_array) {
            for c in choices {
                let piece = c
                    .get("text")
                    .and_then(Value::as_str)
                    .or_else(|| c.pointer("/delta/content").and_then(Value::as_str))
                    .or_else(|| {
                        c.pointer("/delta/reasoning_content")
                            .and_then(Value::as_str)
                    });
                if let Some(p) = piece.filter(|p| !p.is_empty()) {
                    ex.text.push_str(p);
                    text_seen = true;
                }
                if c.get("finish_reason").is_some_and(|f| !f.is_null()) {
                    self.finished = true;
                }
            }
        }
        if text_seen {
            ex.chunks += 1;
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            ex.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64);
            ex.completion_tokens = u.get("completion_tokens").and_then(Value::as_u64);
            ex.cached_tokens = u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64);
        }
        Ok(text_seen)
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(200).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::tokens::Prompt;
    use crate::workload::Turn;

    fn p(text: &str, ids: &[u32]) -> Prompt {
        Prompt {
            text: text.into(),
            ids: ids.to_vec(),
        }
    }

    fn opts(endpoint: Endpoint, format: PromptFormat) -> RequestOptions {
        RequestOptions {
            endpoint,
            model: "m".into(),
            prompt_format: format,
            temperature: 0.0,
            ignore_eos: true,
            extra_body: serde_json::from_str(r#"{"top_k": 5}"#).unwrap(),
        }
    }

    fn session() -> Session {
        Session {
            id: 0,
            group: None,
            system: Some(p(" sys", &[1])),
            turns: vec![
                Turn {
                    user: p(" q1", &[2]),
                    output_len: 3,
                },
                Turn {
                    user: p(" q2", &[4]),
                    output_len: 5,
                },
            ],
        }
    }

    #[test]
    fn bodies_extend_the_conversation() {
        let s = session();
        let answers = vec![" a1".to_string()];
        let b = build_body(
            &opts(Endpoint::Completions, PromptFormat::Text),
            &s,
            1,
            &answers,
        );
        assert_eq!(b["prompt"], " sys q1 a1 q2");
        assert_eq!(b["max_tokens"], 5);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["top_k"], 5);
        let b = build_body(
            &opts(Endpoint::Completions, PromptFormat::TokenIds),
            &s,
            0,
            &[],
        );
        assert_eq!(b["prompt"], json!([1, 2]));
        let b = build_body(&opts(Endpoint::Chat, PromptFormat::Text), &s, 1, &answers);
        let roles: Vec<&str> = b["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(b["messages"][2]["content"], " a1");
    }

    #[test]
    fn stream_events_fill_the_exchange() {
        let mut st = StreamState::default();
        let mut ex = Exchange::default();
        assert!(
            st.event(
                r#"{"choices":[{"text":"hi","finish_reason":null}]}"#,
                &mut ex
            )
            .unwrap()
        );
        assert!(
            !st.event(r#"{"choices":[{"delta":{"content":""}}]}"#, &mut ex)
                .unwrap()
        );
        assert!(
            st.event(
                r#"{"choices":[{"delta":{"content":" there"},"finish_reason":"length"}]}"#,
                &mut ex
            )
            .unwrap()
        );
        assert!(!st.event(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}"#, &mut ex).unwrap());
        st.event("[DONE]", &mut ex).unwrap();
        assert!(st.done && st.finished);
        assert_eq!(ex.text, "hi there");
        assert_eq!(ex.chunks, 2);
        assert_eq!(
            (ex.prompt_tokens, ex.completion_tokens, ex.cached_tokens),
            (Some(7), Some(2), Some(4))
        );
        let e = st
            .event(r#"{"error":{"message":"overloaded"}}"#, &mut ex)
            .unwrap_err();
        assert_eq!(
            (e.kind.as_str(), e.message.as_str()),
            ("server_error", "overloaded")
        );
        assert_eq!(
            st.event("{not json", &mut ex).unwrap_err().kind,
            "bad_event"
        );
    }

    #[test]
    fn urls_are_checked() {
        assert!(HttpClient::new("http://127.0.0.1:8000", None).is_ok());
        assert!(HttpClient::new("https://example.invalid", None).is_err());
        assert!(HttpClient::new("127.0.0.1:8000", None).is_err());
    }
}
