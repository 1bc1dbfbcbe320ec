//! The `[engine]` configuration section (batching limits) and the engine's whole config.
//!
//! Serde structs with `deny_unknown_fields`; `validate` turns a bad value into an error naming
//! the key. The global config embeds [`EngineConfig`] under `[engine]` and
//! [`crate::cache::CacheConfig`] under `[cache]`.

use serde::Deserialize;

use super::speculative::SpeculativeConfig;
use crate::cache::CacheConfig;

/// `[engine]` section: batching limits of one replica.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Where the model runs: "cpu" (the f32 reference backend), "cuda" (NVIDIA GPUs), or
    /// "auto" (CUDA when a usable GPU is present, else the CPU).
    pub backend: String,
    /// CUDA devices to serve on; replicas are spread over them round-robin (at least one
    /// replica per device).
    pub devices: Vec<usize>,
    /// Engine replicas (data parallel, one engine thread each) behind the router.
    pub replicas: usize,
    /// Tokens computed per step over all requests (prefill chunks + decodes).
    pub max_batched_tokens: usize,
    /// Requests holding cache state at once (running + paused).
    pub max_running: usize,
    /// Requests waiting for admission; more are refused with "queue_full".
    pub max_waiting: usize,
    /// Split long prompts into chunks mixed with decodes. When off, a prompt runs in one step
    /// and prompts longer than `max_batched_tokens` are refused.
    pub chunked_prefill: bool,
    /// Candidates per request handed to the sampler (the full vocabulary if smaller).
    pub sampler_candidates: usize,
    /// Replay decode steps (up to 256 sequences) from CUDA graphs captured at start; ignored
    /// on the CPU. Output is the same either way.
    pub cuda_graphs: bool,
    /// Schedule and build each step while the one before it computes, so the device waits
    /// only for the sampler between two steps: the next step's decodes take the tokens being
    /// sampled as placeholders, filled in before its launch (a request that stops runs one
    /// wasted row). Requests that arrive while a step computes join the step scheduled
    /// ahead, while the device has time left on the current one. Output is the same either
    /// way.
    pub schedule_ahead: bool,
    /// Order of admission: "fcfs" (arrival) or "priority" (a request's `priority`, lower
    /// first, then arrival; a preempted request is the worst-priority paused one), as vLLM's
    /// `--scheduling-policy`.
    pub scheduling_policy: String,
}

/// The values of `configs/default.toml` (a test checks they agree).
impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            backend: "auto".into(),
            devices: vec![0],
            replicas: 1,
            max_batched_tokens: 1024,
            max_running: 64,
            max_waiting: 4096,
            chunked_prefill: true,
            sampler_candidates: 64,
            cuda_graphs: true,
            schedule_ahead: true,
            scheduling_policy: "fcfs".into(),
        }
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ConfigError {
    #[error("engine.{key} = {value}: {why}")]
    Invalid {
        key: &'static str,
        value: String,
        why: &'static str,
    },
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheConfigError),
    #[error("{0}")]
    Speculative(String),
}

impl EngineConfig {
    /// Whether requests are admitted by priority (`scheduling_policy = "priority"`).
    pub fn by_priority(&self) -> bool {
        self.scheduling_policy == "priority"
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, value: usize, why| {
            Err(ConfigError::Invalid {
                key,
                value: value.to_string(),
                why,
            })
        };
        if !matches!(self.backend.as_str(), "cpu" | "cuda" | "auto") {
            return Err(ConfigError::Invalid {
                key: "backend",
                value: self.backend.clone(),
                why: "must be \"cpu\", \"cuda\" or \"auto\"",
            });
        }
        if !matches!(self.scheduling_policy.as_str(), "fcfs" | "priority") {
            return Err(ConfigError::Invalid {
                key: "scheduling_policy",
                value: self.scheduling_policy.clone(),
                why: "must be \"fcfs\" or \"priority\"",
            });
        }
        if self.devices.is_empty() || self.devices.len() > 64 {
            return bad(
                "devices",
                self.devices.len(),
                "must list between 1 and 64 devices",
            );
        }
        let mut seen = self.devices.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != self.devices.len() {
            return Err(ConfigError::Invalid {
                key: "devices",
                value: format!("{:?}", self.devices),
                why: "lists a device twice",
            });
        }
        if self.replicas == 0 || self.replicas > 64 {
            return bad("replicas", self.replicas, "must be between 1 and 64");
        }
        if self.max_batched_tokens < 2 {
            return bad(
                "max_batched_tokens",
                self.max_batched_tokens,
                "must be at least 2",
            );
        }
        if self.max_running == 0 || self.max_running > 1 << 20 {
            return bad(
                "max_running",
                self.max_running,
                "must be between 1 and 1048576",
            );
        }
        if self.max_running > self.max_batched_tokens {
            return bad(
                "max_running",
                self.max_running,
                "must not exceed engine.max_batched_tokens (each running request decodes one token per step)",
            );
        }
        if self.max_waiting == 0 {
            return bad("max_waiting", self.max_waiting, "must be at least 1");
        }
        if self.sampler_candidates == 0 {
            return bad(
                "sampler_candidates",
                self.sampler_candidates,
                "must be at least 1",
            );
        }
        Ok(())
    }
}

/// Everything one engine replica needs from the configuration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSetup {
    pub engine: EngineConfig,
    pub cache: CacheConfig,
    /// Mixed into every prefix hash (model id and revision): replicas of different models
    /// never share cache entries.
    pub hash_salt: String,
    /// `[speculative]`: speculative decoding.
    pub speculative: SpeculativeConfig,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_unknown_keys() {
        let c: EngineConfig = toml::from_str("max_batched_tokens = 512\nmax_running = 8").unwrap();
        assert_eq!(c.max_batched_tokens, 512);
        assert_eq!(c.max_running, 8);
        assert!(c.chunked_prefill);
        assert_eq!(c.sampler_candidates, 64);
        let e = toml::from_str::<EngineConfig>("max_runing = 8").unwrap_err();
        assert!(e.to_string().contains("max_runing"), "{e}");
    }

    #[test]
    fn validation_names_the_key() {
        let c = EngineConfig {
            max_running: 4096,
            max_batched_tokens: 512,
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.starts_with("engine.max_running = 4096"), "{e}");
        assert!(EngineConfig::default().validate().is_ok());
    }
}
