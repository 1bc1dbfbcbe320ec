//! The one configuration file: TOML → serde structs (unknown keys are errors) → validation →
//! an immutable [`Config`]. Each section's struct lives with the part that reads it; this
//! module only assembles them, applies the few CLI overrides, and validates across sections.
//!
//! ```toml
//! [server]          # host, port, admin_token, queue and body limits
//! [model]           # path = "builtin:tiny-hybrid" or a Hugging Face folder
//! [engine]          # backend, replicas, max_batched_tokens, max_running, ...
//! [cache]           # memory_budget, block_size, prefix_caching, ssm_share
//! [policy.router]   # plugin = "builtin:prefix-aware" | "native:NAME" | "path.wasm"; config = {...}
//! [policy.evictor]
//! [policy.sampler]
//! [plugins]         # deadline_ms, memory_bytes, max_instances
//! ```

use std::path::Path;

use serde::Deserialize;

use crate::cache::config::CacheConfig;
use crate::engine::EngineConfig;
use crate::engine::speculative::SpeculativeConfig;
use crate::model::builtin;
use crate::plugins::{PluginsConfig, PolicyConfig};
use crate::server::ServerConfig;

/// A tuning knob from the environment variable `name`, for comparing paths on a GPU (settings
/// belong in the TOML; the knobs are listed in `docs/gpu.md`): `None` when unset or empty; a
/// value that does not parse is named in a warning and ignored. Callers read a knob once (a
/// `OnceLock`), so the warning comes once.
pub fn env_knob<T: std::str::FromStr>(name: &str) -> Option<T> {
    let raw = std::env::var(name).ok()?;
    let v = raw.trim();
    if v.is_empty() {
        return None;
    }
    match v.parse() {
        Ok(x) => Some(x),
        Err(_) => {
            tracing::warn!(knob = name, value = %raw, "ignored: not a valid value for this knob");
            None
        }
    }
}

/// The configuration shipped as the laptop default (`configs/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../configs/default.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
    #[error("{file}: {key}: {message}")]
    Invalid {
        file: String,
        key: String,
        message: String,
    },
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `builtin:tiny-hybrid`, a Hugging Face model folder, a `.gguf` file, or a hub model id
    /// (`org/name`, downloaded into the Hugging Face cache; `org/name:Q4_K_M` picks one file
    /// of a repo of GGUF files). An existing local path wins over a hub id of the same
    /// spelling.
    pub path: String,
    /// The hub revision (branch, tag or commit hash) of a hub model id.
    pub revision: String,
    /// Weights and activations: "auto" (bfloat16 on a GPU, float32 on the CPU), "bfloat16"
    /// (GPU serving) or "float32" (the CPU, and the GPU's oracle mode).
    pub dtype: String,
    /// "auto" (the checkpoint) or "dummy" (seeded random weights of the right shapes: a
    /// full-size `config.json` runs without its weights).
    pub load_format: String,
    /// "none", or "fp8": quantize a bf16 checkpoint's big projections to FP8 e4m3 at load, one
    /// scale per output row (an FP8 checkpoint loads as FP8 without it; see `model::quant`).
    pub quantization: String,
    /// The longest context (prompt + output tokens) a request may have, as vLLM's
    /// `--max-model-len`. `None`: the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: builtin::NAME.into(),
            revision: "main".into(),
            dtype: "auto".into(),
            load_format: "auto".into(),
            quantization: "none".into(),
            max_model_len: None,
        }
    }
}

/// Everything a `chimera serve` process reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub model: ModelConfig,
    pub engine: EngineConfig,
    pub cache: CacheConfig,
    pub policy: PolicyConfig,
    pub plugins: PluginsConfig,
    pub speculative: SpeculativeConfig,
    /// `[kv_events]`: the cache's block events for cluster routers (vLLM's ZMQ format).
    pub kv_events: crate::cluster::KvEventsConfig,
}

/// Command-line flags that override config keys.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub model: Option<String>,
    pub revision: Option<String>,
    pub served_model_name: Option<Vec<String>>,
    pub api_key: Option<String>,
    pub tool_call_parser: Option<String>,
    pub reasoning_parser: Option<String>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub replicas: Option<usize>,
    pub backend: Option<String>,
    pub devices: Option<Vec<usize>>,
    pub dtype: Option<String>,
    pub load_format: Option<String>,
    pub quantization: Option<String>,
    pub max_model_len: Option<usize>,
    pub gpu_memory_utilization: Option<f64>,
    pub kv_cache_dtype: Option<String>,
    pub speculative_method: Option<String>,
    pub num_speculative_tokens: Option<usize>,
    pub draft_model: Option<String>,
}

impl Config {
    /// Parses and validates `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            file: file.into(),
            message: e.to_string(),
        })?;
        config.validate(file)?;
        Ok(config)
    }

    /// Reads `path`, or the built-in default when `None`.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        match path {
            None => Self::parse(DEFAULT_TOML, "configs/default.toml"),
            Some(p) => {
                let file = p.display().to_string();
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError::Parse {
                    file: file.clone(),
                    message: e.to_string(),
                })?;
                Self::parse(&text, &file)
            }
        }
    }

    /// Applies CLI flags, then validates again.
    pub fn with_overrides(mut self, o: Overrides) -> Result<Self, ConfigError> {
        if let Some(m) = o.model {
            self.model.path = m;
        }
        if let Some(r) = o.revision {
            self.model.revision = r;
        }
        if let Some(names) = o.served_model_name {
            self.server.served_model_name = Some(crate::server::config::ServedNames::Many(names));
        }
        if let Some(p) = o.tool_call_parser {
            self.server.tool_call_parser = Some(p);
        }
        if let Some(p) = o.reasoning_parser {
            self.server.reasoning_parser = Some(p);
        }
        if let Some(k) = o.api_key {
            self.server.api_key = Some(k);
        }
        if let Some(h) = o.host {
            self.server.host = h;
        }
        if let Some(p) = o.port {
            self.server.port = p;
        }
        if let Some(r) = o.replicas {
            self.engine.replicas = r;
        }
        if let Some(b) = o.backend {
            self.engine.backend = b;
        }
        if let Some(d) = o.devices {
            self.engine.devices = d;
        }
        if let Some(d) = o.dtype {
            self.model.dtype = d;
        }
        if let Some(f) = o.load_format {
            self.model.load_format = f;
        }
        if let Some(q) = o.quantization {
            self.model.quantization = q;
        }
        if let Some(n) = o.max_model_len {
            self.model.max_model_len = Some(n);
        }
        if let Some(u) = o.gpu_memory_utilization {
            self.cache.gpu_memory_utilization = u;
        }
        if let Some(d) = o.kv_cache_dtype {
            self.cache.kv_dtype = d.parse().map_err(|message| ConfigError::Invalid {
                file: "command line".into(),
                key: "--kv-cache-dtype".into(),
                message,
            })?;
        }
        if let Some(m) = o.speculative_method {
            self.speculative.method = m;
        }
        if let Some(k) = o.num_speculative_tokens {
            self.speculative.num_tokens = k;
        }
        if let Some(m) = o.draft_model {
            self.speculative.draft_model = m;
        }
        self.validate("command line")?;
        Ok(self)
    }

    fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let invalid = |key: String, message: String| ConfigError::Invalid {
            file: file.into(),
            key,
            message,
        };
        self.server
            .validate()
            .map_err(|e| invalid(format!("server.{}", e.key), e.message))?;
        self.engine
            .validate()
            .map_err(|e| invalid("engine".into(), e.to_string()))?;
        self.speculative.validate().map_err(|message| {
            let key = message
                .split(' ')
                .next()
                .unwrap_or("speculative")
                .to_string();
            invalid(key, message)
        })?;
        self.policy
            .validate("policy")
            .map_err(|e| invalid(e.path.clone(), e.message.clone()))?;
        self.plugins
            .validate("plugins")
            .map_err(|e| invalid(e.path.clone(), e.message.clone()))?;
        self.kv_events
            .validate()
            .map_err(|(key, message)| invalid(format!("kv_events.{key}"), message))?;
        if self.model.path.trim().is_empty() {
            return Err(invalid("model.path".into(), "must name a model".into()));
        }
        if self.model.revision.trim().is_empty() {
            return Err(invalid(
                "model.revision".into(),
                "must name a branch, tag or commit (default \"main\")".into(),
            ));
        }
        if !matches!(self.model.dtype.as_str(), "auto" | "bfloat16" | "float32") {
            return Err(invalid(
                "model.dtype".into(),
                format!(
                    "{:?}: must be \"auto\", \"bfloat16\" or \"float32\"",
                    self.model.dtype
                ),
            ));
        }
        if self.model.dtype == "bfloat16" && self.engine.backend == "cpu" {
            return Err(invalid(
                "model.dtype".into(),
                "\"bfloat16\" needs engine.backend = \"cuda\" (the CPU backend computes in float32)"
                    .into(),
            ));
        }
        if let Some(f) = self.cache.memory_fraction
            && !(f > 0.0 && f <= 1.0)
        {
            return Err(invalid(
                "cache.memory_fraction".into(),
                format!("{f}: must be in (0, 1]"),
            ));
        }
        let u = self.cache.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            return Err(invalid(
                "cache.gpu_memory_utilization".into(),
                format!("{u}: must be in (0, 1]"),
            ));
        }
        if self.model.max_model_len == Some(0) {
            return Err(invalid(
                "model.max_model_len".into(),
                "must be at least 1 (leave it unset for the model's own limit)".into(),
            ));
        }
        if !self
            .cache
            .ssm_snapshot_interval
            .is_multiple_of(self.cache.block_size.max(1))
        {
            return Err(invalid(
                "cache.ssm_snapshot_interval".into(),
                format!(
                    "{}: must be a multiple of cache.block_size ({}), or 0 to turn it off",
                    self.cache.ssm_snapshot_interval, self.cache.block_size
                ),
            ));
        }
        if !crate::model::quant::ONLINE_SCHEMES.contains(&self.model.quantization.as_str()) {
            return Err(invalid(
                "model.quantization".into(),
                format!(
                    "{:?}: must be \"none\" or \"fp8\" (FP8 e4m3 weights, one scale per \
                     output row; AWQ, GPTQ, NVFP4 and other schemes are not supported)",
                    self.model.quantization
                ),
            ));
        }
        if !matches!(self.model.load_format.as_str(), "auto" | "dummy") {
            return Err(invalid(
                "model.load_format".into(),
                format!(
                    "{:?}: must be \"auto\" or \"dummy\"",
                    self.model.load_format
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_file_parses() {
        let c = Config::load(None).unwrap();
        assert_eq!(c.model.path, builtin::NAME);
        assert_eq!(c.server.host, "127.0.0.1");
    }

    #[test]
    fn a_partial_config_inherits_the_default_file() {
        let file = Config::load(None).unwrap();
        // The code's defaults are the file's values: an empty file, empty sections, or one
        // key changed leave everything else as configs/default.toml says.
        assert_eq!(Config::parse("", "empty.toml").unwrap(), file);
        assert_eq!(Config::default(), file);
        let sections = "[server]\n[model]\n[engine]\n[cache]\n[plugins]\n";
        assert_eq!(Config::parse(sections, "x.toml").unwrap(), file);
        let c = Config::parse("[engine]\nreplicas = 2\n", "x.toml").unwrap();
        assert_eq!(c.engine.replicas, 2);
        let mut expected = file.clone();
        expected.engine.replicas = 2;
        assert_eq!(c, expected);
        // Values the file sets where the code once differed.
        assert_eq!(c.cache.memory_budget, None);
        assert_eq!(c.engine.backend, "auto");
        assert_eq!(
            (c.engine.max_running, c.engine.max_batched_tokens),
            (64, 1024)
        );
        assert_eq!(c.server.max_queued_requests, 1024);
        assert_eq!(
            c.policy.router.config.get("alpha"),
            Some(&toml::Value::Float(0.5))
        );
    }

    /// The fields a section accepts, read from serde's "unknown field" error (which lists them
    /// all), so the check follows the structs without a list to keep in step.
    fn fields_of(section: &str) -> Vec<String> {
        let probe = if section.is_empty() {
            "[zz_probe]\n".to_string()
        } else {
            format!("[{section}]\nzz_probe = 1\n")
        };
        let e = Config::parse(&probe, "probe.toml").unwrap_err().to_string();
        let expected = e
            .split("expected one of ")
            .nth(1)
            .or_else(|| e.split("expected ").nth(1))
            .unwrap_or_else(|| panic!("no field list in {e}"));
        expected
            .split(',')
            .map(|f| f.trim().trim_matches('`').to_string())
            .filter(|f| !f.is_empty())
            .map(|f| f.lines().next().unwrap_or("").trim_matches('`').to_string())
            .collect()
    }

    #[test]
    fn the_default_file_documents_every_key() {
        // Keys written in the file, set or commented out (`# key = ...`), per section.
        let mut documented: std::collections::BTreeSet<(String, String)> = Default::default();
        let mut section = String::new();
        for line in DEFAULT_TOML.lines() {
            let line = line.trim();
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_string();
                continue;
            }
            let body = line.strip_prefix('#').map_or(line, str::trim);
            if let Some((key, _)) = body.split_once(" = ")
                && !key.contains(' ')
            {
                documented.insert((section.clone(), key.to_string()));
            }
        }
        let top = fields_of("");
        assert_eq!(
            top,
            [
                "server",
                "model",
                "engine",
                "cache",
                "policy",
                "plugins",
                "speculative",
                "kv_events"
            ]
        );
        let mut sections: Vec<String> = top.into_iter().filter(|s| s != "policy").collect();
        sections.extend(["policy.router", "policy.evictor", "policy.sampler"].map(String::from));
        let mut missing = Vec::new();
        for section in &sections {
            let fields = fields_of(section);
            assert!(fields.len() >= 3, "{section}: {fields:?}");
            for f in fields {
                if !documented.contains(&(section.clone(), f.clone())) {
                    missing.push(format!("{section}.{f}"));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "configs/default.toml does not document {missing:?}"
        );
        // And what it documents in comments parses: uncommented, the file is still valid.
        let uncommented: String = DEFAULT_TOML
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest) if rest.contains(" = ") && !rest.contains(". ") => rest,
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n");
        Config::parse(&uncommented, "uncommented default.toml").unwrap();
    }

    #[test]
    fn the_readme_configuration_example_is_a_valid_config() {
        let readme = include_str!("../../README.md");
        let at = readme
            .find("Configuration is one TOML file")
            .expect("the README's configuration paragraph");
        let block = readme[at..]
            .split("```toml\n")
            .nth(1)
            .and_then(|b| b.split("```").next())
            .expect("a toml block after it");
        let c = Config::parse(block, "README.md").unwrap();
        assert_eq!(c.policy.router.plugin, "builtin:prefix-aware");
        assert_eq!(c.cache.gpu_memory_utilization, 0.9);
    }

    #[test]
    fn unknown_keys_are_errors_that_name_them() {
        let e = Config::parse("[engine]\nmax_batched_tokns = 5\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("max_batched_tokns"), "{e}");
        let e = Config::parse("[sever]\nport = 1\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("sever"), "{e}");
        let e =
            Config::parse("[policy.router]\nplugin = \"builtin:nope\"\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("policy.router"), "{e}");
    }

    #[test]
    fn backend_and_model_keys_are_validated() {
        let e = Config::parse("[engine]\nbackend = \"tpu\"\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("engine.backend = tpu"), "{e}");
        let e = Config::parse(
            "[model]\ndtype = \"bfloat16\"\n[engine]\nbackend = \"cpu\"\n",
            "x.toml",
        )
        .unwrap_err();
        assert!(e.to_string().contains("model.dtype"), "{e}");
        let e = Config::parse("[cache]\ngpu_memory_utilization = 1.5\n", "x.toml").unwrap_err();
        assert!(
            e.to_string().contains("cache.gpu_memory_utilization: 1.5"),
            "{e}"
        );
        let e = Config::parse("[model]\nmax_model_len = 0\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("model.max_model_len"), "{e}");
        let e = Config::parse("[model]\nload_format = \"gguf\"\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("model.load_format"), "{e}");
        let e = Config::parse("[engine]\ndevices = [0, 0]\n", "x.toml").unwrap_err();
        assert!(e.to_string().contains("devices"), "{e}");
        let c = Config::parse(
            "[engine]\nbackend = \"cuda\"\ndevices = [0, 1]\n[model]\ndtype = \"bfloat16\"\nload_format = \"dummy\"\n[cache]\nmemory_fraction = 0.8\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(c.engine.devices, vec![0, 1]);
        assert_eq!(c.cache.memory_fraction, Some(0.8));
    }

    #[test]
    fn overrides_apply_and_are_validated() {
        let c = Config::default()
            .with_overrides(Overrides {
                port: Some(9001),
                replicas: Some(2),
                ..Default::default()
            })
            .unwrap();
        assert_eq!((c.server.port, c.engine.replicas), (9001, 2));
        let e = Config::default().with_overrides(Overrides {
            replicas: Some(0),
            ..Default::default()
        });
        assert!(e.is_err());
        let c = Config::default()
            .with_overrides(Overrides {
                kv_cache_dtype: Some("fp8".into()),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(c.cache.kv_dtype, crate::cache::KvCacheDtype::Fp8E4M3);
        let e = Config::default()
            .with_overrides(Overrides {
                kv_cache_dtype: Some("fp8_e5m2".into()),
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("command line: --kv-cache-dtype: cache.kv_dtype = \"fp8_e5m2\""),
            "{e}"
        );
    }
}
