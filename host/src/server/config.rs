//! The `[server]` section of the configuration.
//!
//! Owns: the serde shape of `[server]` (every key known; unknown keys are errors that name the
//! key), its defaults and its validation (errors name `server.<key>` and what is allowed).
//! It must not read files or parse other sections.

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("server.{key}: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

/// `[server]`: where to listen and how much work to admit.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to bind (loopback unless the operator opens it).
    pub host: String,
    pub port: u16,
    /// Bearer token for `/admin/*`; admin endpoints are off (404) when unset.
    pub admin_token: Option<String>,
    /// Bearer token every `/v1/*` request must carry (`Authorization: Bearer <key>`, as
    /// vLLM's `--api-key`); `/health` and `/metrics` stay open. Unset: no authentication.
    pub api_key: Option<String>,
    /// Engine requests (choices) the server holds at once; beyond this it answers 503 with
    /// `Retry-After`.
    pub max_queued_requests: u32,
    /// Largest accepted request body; larger bodies get 413.
    pub max_body_bytes: usize,
    /// A request body must arrive within this many seconds.
    pub body_read_timeout_secs: u32,
    /// Largest `n × prompts` in one request.
    pub max_choices_per_request: u32,
    pub max_stop_strings: u32,
    /// Longest stop string, in characters.
    pub max_stop_len: u32,
    /// Largest `logprobs` / `top_logprobs`.
    pub max_logprobs: u32,
    /// Seconds advertised in `Retry-After` when overloaded.
    pub retry_after_secs: u32,
    /// On shutdown, in-flight requests get this long to finish before they are cancelled.
    pub shutdown_grace_secs: u32,
    /// Model ids the API accepts in `model` and lists in `/v1/models`: one name or a list;
    /// the first is the id responses carry. Unset: `model.path` as given, then the model's
    /// short name (`builtin:tiny-hybrid` and `tiny-hybrid`; a folder path and its last part).
    pub served_model_name: Option<ServedNames>,
    /// Upper bound on each replica's prefix-index mirror, in blocks.
    pub router_mirror_max_blocks: u32,
    /// Names of the `/metrics` families vLLM also exports: `chimera` (`chimera:...`) or
    /// `vllm` (`vllm:...`, for scrapers written for vLLM: llm-d's endpoint picker, Ray Serve,
    /// Dynamo's planner); chimera's own families keep `chimera:` either way.
    pub metrics_names: super::metrics::MetricNames,
    /// Seconds between two stats lines in the log (throughput, running and waiting requests,
    /// KV cache usage, prefix-cache hit rate), written while there is work; 0 turns them off.
    pub stats_log_interval_secs: u32,
    /// The tool-call format the parser plugin reads responses in (vLLM's names: `hermes`,
    /// `qwen3_coder`, `llama3_json`, `granite`). Unset: inferred from the chat template;
    /// requests with tools (other than `tool_choice: "none"`) to a model with neither get 400.
    pub tool_call_parser: Option<String>,
    /// The reasoning format split into `reasoning_content` (`qwen3`, `deepseek_r1`). Unset:
    /// `qwen3` when the chat template uses `<think>`, else none.
    pub reasoning_parser: Option<String>,
}

/// The values of `configs/default.toml` (a test checks they agree).
impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            admin_token: None,
            api_key: None,
            max_queued_requests: 1024,
            max_body_bytes: 2 * 1024 * 1024,
            body_read_timeout_secs: 30,
            max_choices_per_request: 64,
            max_stop_strings: 16,
            max_stop_len: 256,
            max_logprobs: 20,
            retry_after_secs: 1,
            shutdown_grace_secs: 30,
            served_model_name: None,
            router_mirror_max_blocks: 1 << 20,
            metrics_names: super::metrics::MetricNames::Chimera,
            stats_log_interval_secs: 10,
            tool_call_parser: None,
            reasoning_parser: None,
        }
    }
}

/// `served_model_name`: one name or a list of names.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ServedNames {
    One(String),
    Many(Vec<String>),
}

impl ServedNames {
    pub fn names(&self) -> Vec<String> {
        match self {
            Self::One(n) => vec![n.clone()],
            Self::Many(v) => v.clone(),
        }
    }
}

impl ServerConfig {
    /// The id responses carry: the first of `served_model_name`, else `model_name` (the
    /// model's own short name).
    pub fn served_name(&self, model_name: &str) -> String {
        self.served_model_name
            .as_ref()
            .and_then(|n| n.names().first().cloned())
            .unwrap_or_else(|| model_name.to_string())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |key, message: &str| {
            Err(ConfigError {
                key,
                message: message.into(),
            })
        };
        if self.host.trim().is_empty() {
            return err("host", "must be an address such as \"127.0.0.1\"");
        }
        if self.admin_token.as_deref().is_some_and(|t| t.len() < 8) {
            return err(
                "admin_token",
                "must be at least 8 characters (or unset to disable admin)",
            );
        }
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return err(
                "api_key",
                "must not be empty (or unset to serve without a key)",
            );
        }
        if let Some(names) = &self.served_model_name {
            let names = names.names();
            if names.is_empty() || names.iter().any(|n| n.trim().is_empty()) {
                return err(
                    "served_model_name",
                    "must be a non-empty name or a non-empty list of non-empty names",
                );
            }
        }
        if self.max_queued_requests == 0 {
            return err("max_queued_requests", "must be at least 1");
        }
        if self.max_body_bytes < 1024 {
            return err("max_body_bytes", "must be at least 1024");
        }
        if self.body_read_timeout_secs == 0 {
            return err("body_read_timeout_secs", "must be at least 1");
        }
        if self.max_choices_per_request == 0 {
            return err("max_choices_per_request", "must be at least 1");
        }
        if self.max_stop_len == 0 {
            return err("max_stop_len", "must be at least 1");
        }
        if self.router_mirror_max_blocks == 0 {
            return err("router_mirror_max_blocks", "must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_defaults_and_rejects_unknown_keys() {
        let c: ServerConfig =
            toml::from_str("port = 9000\nadmin_token = \"secret-token\"").unwrap();
        assert_eq!(c.port, 9000);
        assert_eq!(c.host, "127.0.0.1");
        c.validate().unwrap();
        let e = toml::from_str::<ServerConfig>("prot = 1").unwrap_err();
        assert!(e.to_string().contains("prot"), "{e}");
        let c = ServerConfig {
            max_queued_requests: 0,
            ..Default::default()
        };
        assert_eq!(c.validate().unwrap_err().key, "max_queued_requests");
    }
}
