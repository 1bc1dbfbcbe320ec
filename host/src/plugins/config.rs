//! The TOML sections that choose and limit policy plugins: `[policy.*]` and `[plugins]`.
//!
//! Owns the serde structs (unknown keys are errors), their validation, and the flattening of a
//! plugin's free-form `config` table into the typed key/values the ABI passes to `init`.
//! Every error names the key path it is about. Must not load or compile anything.

use std::fmt;
use std::path::PathBuf;

use chimera_policy_core::{Config, ConfigValue};
use serde::Deserialize;

use super::PluginKind;

/// `[policy]`: one plugin per policy kind.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    #[serde(default = "PolicySpec::default_router")]
    pub router: PolicySpec,
    #[serde(default = "PolicySpec::default_evictor")]
    pub evictor: PolicySpec,
    #[serde(default = "PolicySpec::default_sampler")]
    pub sampler: PolicySpec,
    /// Grammars, JSON schemas and forced tool calls (ABI 0.2.0).
    #[serde(default = "PolicySpec::default_constraint")]
    pub constraint: PolicySpec,
    /// Tool calls and reasoning in responses' text (ABI 0.2.0).
    #[serde(default = "PolicySpec::default_parser")]
    pub parser: PolicySpec,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            router: PolicySpec::default_router(),
            evictor: PolicySpec::default_evictor(),
            sampler: PolicySpec::default_sampler(),
            constraint: PolicySpec::default_constraint(),
            parser: PolicySpec::default_parser(),
        }
    }
}

/// `[policy.<kind>]`: which plugin, and its own `config` table.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// `"builtin:NAME"` (embedded Wasm build), `"native:NAME"` (the native twin, no Wasm), or a
    /// path to a `.wasm` file.
    pub plugin: String,
    #[serde(default)]
    pub config: toml::Table,
    /// Host functions the plugin may call: `"clock"`, `"log"` (ABI 0.1.1). None by default.
    #[serde(default)]
    pub grants: Vec<String>,
}

impl PolicySpec {
    fn builtin(name: &str) -> Self {
        Self {
            plugin: format!("builtin:{name}"),
            config: toml::Table::new(),
            grants: Vec::new(),
        }
    }
    /// `configs/default.toml`'s router: prefix-aware with `alpha = 0.5` (a `[policy.router]`
    /// section that is written replaces all of it: its `config` starts empty).
    fn default_router() -> Self {
        let mut spec = Self::builtin("prefix-aware");
        spec.config.insert("alpha".into(), toml::Value::Float(0.5));
        spec
    }
    fn default_evictor() -> Self {
        Self::builtin("lru")
    }
    fn default_sampler() -> Self {
        Self::builtin("default")
    }
    fn default_constraint() -> Self {
        Self::builtin("llguidance")
    }
    fn default_parser() -> Self {
        Self::builtin("tool-parsers")
    }
}

/// `[plugins]`: limits applied to every plugin call.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsConfig {
    /// Wall-clock budget of one call, in milliseconds (1 ms epoch ticks).
    pub deadline_ms: u64,
    /// Most linear memory one plugin instance may grow to.
    pub memory_bytes: u64,
    /// Plugin instances that may exist at once (pooling allocator slots): per replica a router,
    /// evictor, sampler, `constraint_threads` constraints and a parser, plus the constraint instances that check
    /// grammars; twice over while a reload is under way.
    pub max_instances: u32,
    /// The constraint plugin's budget for one call: compiling one grammar (a request's
    /// grammar that takes longer is refused with a 400) or one response's mask.
    pub constraint_deadline_ms: u64,
    /// The constraint plugin's memory (it holds the vocabulary's token trie and every
    /// response's matcher).
    pub constraint_memory_bytes: u64,
    /// Constraint instances (and threads) per replica computing one step's masks at once; a
    /// response's matcher lives in one of them.
    pub constraint_threads: u32,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        Self {
            deadline_ms: 20,
            memory_bytes: 64 << 20,
            max_instances: 128,
            constraint_deadline_ms: 1000,
            constraint_memory_bytes: 1 << 30,
            constraint_threads: 4,
        }
    }
}

impl PluginsConfig {
    /// The limits a plugin of `kind` runs under.
    pub fn for_kind(&self, kind: PluginKind) -> PluginsConfig {
        let mut limits = self.clone();
        if kind == PluginKind::Constraint {
            limits.deadline_ms = self.constraint_deadline_ms;
            limits.memory_bytes = self.constraint_memory_bytes;
        }
        limits
    }

    /// The most memory any plugin may grow to.
    pub fn largest_memory(&self) -> u64 {
        self.memory_bytes.max(self.constraint_memory_bytes)
    }
}

/// Where a plugin comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginSource {
    Builtin(String),
    Native(String),
    File(PathBuf),
}

impl fmt::Display for PluginSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginSource::Builtin(n) => write!(f, "builtin:{n}"),
            PluginSource::Native(n) => write!(f, "native:{n}"),
            PluginSource::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A configuration error with the key path it is about.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl ConfigError {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Built-in plugin names per kind (each has an embedded Wasm build and a native twin).
pub fn builtin_names(kind: PluginKind) -> &'static [&'static str] {
    match kind {
        PluginKind::Router => &["least-loaded", "prefix-aware"],
        PluginKind::Evictor => &["lru"],
        PluginKind::Sampler => &["default"],
        PluginKind::Constraint => &["llguidance"],
        PluginKind::Parser => &["tool-parsers"],
    }
}

/// Host functions granted to one plugin (`grants = [...]` in its `[policy.*]` section).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Grants {
    /// `host.now-ns`: a monotonic clock.
    pub clock: bool,
    /// `host.log`: lines in the server's log.
    pub log: bool,
}

impl Grants {
    pub const NONE: Grants = Grants {
        clock: false,
        log: false,
    };
    pub const ALL: Grants = Grants {
        clock: true,
        log: true,
    };

    /// Parses grant names; `path` is the key path of the list.
    pub fn parse(names: &[String], path: &str) -> Result<Self, ConfigError> {
        let mut g = Self::NONE;
        for (i, name) in names.iter().enumerate() {
            match name.as_str() {
                "clock" => g.clock = true,
                "log" => g.log = true,
                other => {
                    return Err(ConfigError::new(
                        format!("{path}.{i}"),
                        format!(
                            "unknown grant `{other}`: the host offers \"clock\" and \"log\" (filesystem and network access are never granted)"
                        ),
                    ));
                }
            }
        }
        Ok(g)
    }

    /// The grant that allows calling host function `function` (a WIT name), if any.
    pub fn needed_for(function: &str) -> Option<&'static str> {
        match function {
            "now-ns" => Some("clock"),
            "log" => Some("log"),
            _ => None,
        }
    }

    pub fn allows(&self, grant: &str) -> bool {
        match grant {
            "clock" => self.clock,
            "log" => self.log,
            _ => false,
        }
    }
}

impl PolicySpec {
    /// The parsed `grants`; `path` is this section's key path, e.g. `policy.router`.
    pub fn grants(&self, path: &str) -> Result<Grants, ConfigError> {
        Grants::parse(&self.grants, &format!("{path}.grants"))
    }

    /// Parses `plugin`; `path` is this section's key path, e.g. `policy.router`.
    pub fn source(&self, kind: PluginKind, path: &str) -> Result<PluginSource, ConfigError> {
        let key = format!("{path}.plugin");
        let known = builtin_names(kind);
        let named = |prefix: &str, name: &str| {
            if known.contains(&name) {
                Ok(name.to_string())
            } else {
                Err(ConfigError::new(
                    &key,
                    format!(
                        "unknown {prefix} {kind} `{name}` (known: {})",
                        known.join(", ")
                    ),
                ))
            }
        };
        if let Some(name) = self.plugin.strip_prefix("builtin:") {
            return named("built-in", name).map(PluginSource::Builtin);
        }
        if let Some(name) = self.plugin.strip_prefix("native:") {
            return named("native", name).map(PluginSource::Native);
        }
        if self.plugin.ends_with(".wasm") {
            return Ok(PluginSource::File(PathBuf::from(&self.plugin)));
        }
        Err(ConfigError::new(
            key,
            format!(
                "`{}` is neither `builtin:NAME`, `native:NAME` nor a path ending in `.wasm`",
                self.plugin
            ),
        ))
    }

    /// The `config` table as the ABI's flat key/values.
    pub fn flat_config(&self, path: &str) -> Result<Config, ConfigError> {
        let mut entries = Vec::new();
        flatten(&self.config, "", &format!("{path}.config"), &mut entries)?;
        Ok(Config::new(entries))
    }
}

/// A plugin's `config` table written as TOML outside a configuration file (`chimera plugin
/// check --config`): either keys (`replica = 2`, as a file holds them) or one inline table
/// (`{ replica = 2 }`). `origin` names where the text came from in errors.
pub fn parse_plugin_config(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let trimmed = text.trim();
    let table = if trimmed.starts_with('{') {
        toml::from_str::<toml::Table>(&format!("config = {trimmed}")).and_then(|mut t| {
            match t.remove("config") {
                Some(toml::Value::Table(inner)) => Ok(inner),
                _ => toml::from_str::<toml::Table>(trimmed),
            }
        })
    } else {
        toml::from_str::<toml::Table>(trimmed)
    }
    .map_err(|e| {
        ConfigError::new(
            origin,
            format!("not a TOML table (`key = value` lines or `{{ key = value }}`): {e}"),
        )
    })?;
    let mut entries = Vec::new();
    flatten(&table, "", origin, &mut entries)?;
    Ok(Config::new(entries))
}

fn flatten(
    table: &toml::Table,
    prefix: &str,
    path: &str,
    out: &mut Vec<(String, ConfigValue)>,
) -> Result<(), ConfigError> {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        flatten_value(v, key, path, out)?;
    }
    Ok(())
}

fn flatten_value(
    v: &toml::Value,
    key: String,
    path: &str,
    out: &mut Vec<(String, ConfigValue)>,
) -> Result<(), ConfigError> {
    let value = match v {
        toml::Value::Boolean(b) => ConfigValue::Boolean(*b),
        toml::Value::Integer(i) => ConfigValue::Integer(*i),
        toml::Value::Float(f) => ConfigValue::Float(*f),
        toml::Value::String(s) => ConfigValue::Text(s.clone()),
        toml::Value::Datetime(_) => {
            return Err(ConfigError::new(
                format!("{path}.{key}"),
                "dates are not supported in plugin config; use a string",
            ));
        }
        toml::Value::Table(t) => return flatten(t, &key, path, out),
        toml::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten_value(item, format!("{key}.{i}"), path, out)?;
            }
            return Ok(());
        }
    };
    out.push((key, value));
    Ok(())
}

impl PolicyConfig {
    /// Checks every `plugin` key; `path` is this section's key path (normally `policy`).
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        for (kind, spec) in self.specs() {
            let here = format!("{path}.{}", kind.section());
            spec.source(kind, &here)?;
            spec.flat_config(&here)?;
            spec.grants(&here)?;
        }
        Ok(())
    }

    pub fn specs(&self) -> [(PluginKind, &PolicySpec); 5] {
        PluginKind::ALL.map(|kind| (kind, self.spec(kind)))
    }

    pub fn spec(&self, kind: PluginKind) -> &PolicySpec {
        match kind {
            PluginKind::Router => &self.router,
            PluginKind::Evictor => &self.evictor,
            PluginKind::Sampler => &self.sampler,
            PluginKind::Constraint => &self.constraint,
            PluginKind::Parser => &self.parser,
        }
    }
}

impl PluginsConfig {
    /// Checks the limits; `path` is this section's key path (normally `plugins`).
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if !(1..=60_000).contains(&self.deadline_ms) {
            return Err(ConfigError::new(
                format!("{path}.deadline_ms"),
                format!(
                    "must be in 1..=60000 milliseconds, got {}",
                    self.deadline_ms
                ),
            ));
        }
        if !((1 << 20)..=(4 << 30)).contains(&self.memory_bytes) {
            return Err(ConfigError::new(
                format!("{path}.memory_bytes"),
                format!("must be between 1 MiB and 4 GiB, got {}", self.memory_bytes),
            ));
        }
        if !(1..=10_000).contains(&self.max_instances) {
            return Err(ConfigError::new(
                format!("{path}.max_instances"),
                format!("must be in 1..=10000, got {}", self.max_instances),
            ));
        }
        if !(1..=64).contains(&self.constraint_threads) {
            return Err(ConfigError::new(
                format!("{path}.constraint_threads"),
                format!("must be in 1..=64, got {}", self.constraint_threads),
            ));
        }
        if !(1..=60_000).contains(&self.constraint_deadline_ms) {
            return Err(ConfigError::new(
                format!("{path}.constraint_deadline_ms"),
                format!(
                    "must be in 1..=60000 milliseconds, got {}",
                    self.constraint_deadline_ms
                ),
            ));
        }
        if !((16 << 20)..=(4 << 30)).contains(&self.constraint_memory_bytes) {
            return Err(ConfigError::new(
                format!("{path}.constraint_memory_bytes"),
                format!(
                    "must be between 16 MiB and 4 GiB, got {}",
                    self.constraint_memory_bytes
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Root {
        #[serde(default)]
        policy: PolicyConfig,
        #[serde(default)]
        plugins: PluginsConfig,
    }

    fn parse(text: &str) -> Result<Root, String> {
        toml::from_str::<Root>(text).map_err(|e| e.to_string())
    }

    #[test]
    fn plugin_config_parses_as_keys_or_an_inline_table() {
        let want = Config::new(vec![
            ("alpha".into(), ConfigValue::Float(0.5)),
            ("guard.kv".into(), ConfigValue::Float(0.8)),
            ("name".into(), ConfigValue::Text("x".into())),
        ]);
        let inline = parse_plugin_config(
            r#" { alpha = 0.5, guard = { kv = 0.8 }, name = "x" } "#,
            "--config",
        );
        assert_eq!(inline.unwrap(), want);
        let lines = parse_plugin_config("alpha = 0.5\nname = \"x\"\n[guard]\nkv = 0.8\n", "f.toml");
        assert_eq!(lines.unwrap(), want);
        assert_eq!(
            parse_plugin_config("", "--config").unwrap(),
            Config::default()
        );
        let bad = parse_plugin_config("{ alpha = ", "--config").unwrap_err();
        assert_eq!(bad.path, "--config");
        assert!(bad.message.contains("not a TOML table"), "{bad}");
        let date = parse_plugin_config("when = 2024-01-01", "f.toml").unwrap_err();
        assert_eq!(date.path, "f.toml.when");
    }

    #[test]
    fn defaults_and_full_sections_parse() {
        let root = parse("").unwrap();
        assert_eq!(root.policy, PolicyConfig::default());
        assert_eq!(root.plugins.deadline_ms, 20);
        let root = parse(
            r#"
            [policy.router]
            plugin = "builtin:prefix-aware"
            config = { alpha = 0.5, guard = { kv = 0.8 }, tiers = [1, 2] }
            [policy.sampler]
            plugin = "/opt/my_sampler.wasm"
            [plugins]
            deadline_ms = 5
            memory_bytes = 16777216
            "#,
        )
        .unwrap();
        root.policy.validate("policy").unwrap();
        root.plugins.validate("plugins").unwrap();
        let cfg = root.policy.router.flat_config("policy.router").unwrap();
        assert_eq!(cfg.get("alpha"), Some(&ConfigValue::Float(0.5)));
        assert_eq!(cfg.get("guard.kv"), Some(&ConfigValue::Float(0.8)));
        assert_eq!(cfg.get("tiers.1"), Some(&ConfigValue::Integer(2)));
        assert_eq!(
            root.policy
                .sampler
                .source(PluginKind::Sampler, "policy.sampler"),
            Ok(PluginSource::File("/opt/my_sampler.wasm".into()))
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_path() {
        let err = parse("[policy.router]\nplugin = \"builtin:lru\"\nconfg = {}").unwrap_err();
        assert!(err.contains("confg"), "{err}");
        let err = parse("[plugins]\ndeadline = 5").unwrap_err();
        assert!(err.contains("deadline"), "{err}");

        let root = parse("[policy.router]\nplugin = \"builtin:lru\"").unwrap();
        let err = root.policy.validate("policy").unwrap_err();
        assert_eq!(err.path, "policy.router.plugin");
        assert!(err.message.contains("least-loaded, prefix-aware"), "{err}");

        let root = parse("[policy.evictor]\nplugin = \"lru\"").unwrap();
        assert_eq!(
            root.policy.validate("policy").unwrap_err().path,
            "policy.evictor.plugin"
        );

        let root = parse(
            "[policy.router]\nplugin = \"native:least-loaded\"\nconfig = { when = 1979-05-27 }",
        )
        .unwrap();
        let err = root.policy.validate("policy").unwrap_err();
        assert_eq!(err.path, "policy.router.config.when");

        let root = parse("[plugins]\nmemory_bytes = 10").unwrap();
        assert_eq!(
            root.plugins.validate("plugins").unwrap_err().path,
            "plugins.memory_bytes"
        );
    }
}
