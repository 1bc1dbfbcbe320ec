//! `chimera plugin check FILE.wasm [--config TOML]`: load a plugin the way the server would and
//! report.
//!
//! Loads with default limits, lists what the plugin exports and imports, calls `init` with the
//! given config (empty by default), then makes one dry call of each entry point with a small
//! canned input and shows the answers and how long they took. A plugin that cannot be loaded
//! is an error; a plugin that loads but rejects the config or fails the dry call (a trap, a
//! timeout, an answer out of range) is reported (the report says what failed).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chimera_policy_core::{Config, ConfigValue};

use super::abi::{self, ACCEPTED, AbiRange, AbiVersion};
use super::config::{Grants, PluginsConfig};
use super::instance::Instance;
use super::runtime::{LoadedPlugin, PluginRuntime};
use super::{PluginError, PluginKind};
use crate::policy::{CacheEvents, EventKind, ReplicaColumns, RouteRequest, SamplerBatch};

/// What `check_plugin` found.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub path: PathBuf,
    pub size: usize,
    pub componentized: bool,
    pub kind: PluginKind,
    pub abi: AbiVersion,
    pub accepted: AbiRange,
    pub export: String,
    pub functions: Vec<&'static str>,
    /// Host functions it calls, with the grant each needs, e.g. `("now-ns", "clock")`.
    pub host_functions: Vec<(String, &'static str)>,
    /// The config `init` was given (flattened keys), empty by default.
    pub config: Config,
    /// `init` with that config: `Err(message)` if the plugin rejected it (or trapped).
    pub init: Result<(), String>,
    /// The dry call's input and answer, or why it failed.
    pub dry_call: Result<String, String>,
    pub dry_call_time: Option<Duration>,
}

impl CheckReport {
    /// Whether the plugin is usable as is (it accepted the config and answered).
    pub fn ok(&self) -> bool {
        self.init.is_ok() && self.dry_call.is_ok()
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "plugin:    {}", self.path.display())?;
        let form = if self.componentized {
            "core module (componentized at load)"
        } else {
            "component"
        };
        writeln!(f, "format:    {form}, {} bytes", self.size)?;
        writeln!(f, "kind:      {} (interface {})", self.kind, self.export)?;
        writeln!(
            f,
            "abi:       {} (this host accepts {})",
            self.abi, self.accepted
        )?;
        writeln!(f, "exports:   {}", self.functions.join(", "))?;
        if self.host_functions.is_empty() {
            writeln!(f, "imports:   none")?;
        } else {
            let list: Vec<String> = self
                .host_functions
                .iter()
                .map(|(func, grant)| format!("host.{func} (needs grants = [\"{grant}\"])"))
                .collect();
            writeln!(f, "imports:   {}", list.join(", "))?;
        }
        let config = if self.config.entries.is_empty() {
            "an empty config".to_string()
        } else {
            let keys: Vec<String> = self
                .config
                .entries
                .iter()
                .map(|(k, v)| match v {
                    ConfigValue::Boolean(b) => format!("{k} = {b}"),
                    ConfigValue::Integer(i) => format!("{k} = {i}"),
                    ConfigValue::Float(x) => format!("{k} = {x:?}"),
                    ConfigValue::Text(t) => format!("{k} = {t:?}"),
                })
                .collect();
            format!("config {{ {} }}", keys.join(", "))
        };
        match &self.init {
            Ok(()) => writeln!(f, "init:      ok with {config}")?,
            Err(m) => writeln!(f, "init:      rejected {config}: {m}")?,
        }
        match (&self.dry_call, self.dry_call_time) {
            (Ok(a), Some(t)) => writeln!(
                f,
                "dry call:  {a} ({:.1} µs incl. instantiation)",
                t.as_secs_f64() * 1e6
            )?,
            (Ok(a), None) => writeln!(f, "dry call:  {a}")?,
            (Err(e), _) => writeln!(f, "dry call:  FAILED: {e}")?,
        }
        write!(
            f,
            "verdict:   {}",
            if self.ok() {
                "ok"
            } else if self.config.entries.is_empty() {
                "not usable with an empty config"
            } else {
                "not usable with this config"
            }
        )
    }
}

/// Loads `path` as a plugin, initializes it with `config` and reports its kind, ABI version,
/// exports and a dry call.
pub fn check_plugin(path: impl AsRef<Path>, config: &Config) -> Result<CheckReport, PluginError> {
    let path = path.as_ref();
    let wasm = std::fs::read(path).map_err(|e| PluginError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let runtime = PluginRuntime::new(&PluginsConfig::default())?;
    let name = path.display().to_string();
    // Everything the host can grant, so the report can say what the plugin needs.
    let plugin = Arc::new(runtime.compile(&name, &wasm, config, Grants::ALL)?);
    let mut report = CheckReport {
        path: path.to_path_buf(),
        size: plugin.size,
        componentized: plugin.componentized,
        kind: plugin.kind,
        abi: plugin.abi,
        accepted: ACCEPTED,
        export: plugin.export.clone(),
        functions: abi::functions(plugin.kind).to_vec(),
        host_functions: plugin
            .host_functions
            .iter()
            .map(|f| (f.clone(), Grants::needed_for(f).unwrap_or("?")))
            .collect(),
        config: config.clone(),
        init: Ok(()),
        dry_call: Err("not run".into()),
        dry_call_time: None,
    };
    let start = Instant::now();
    let mut instance = match Instance::new(plugin.clone()) {
        Ok(i) => i,
        Err(e) => {
            report.init = Err(e.to_string());
            report.dry_call = Err("skipped: init failed".into());
            return Ok(report);
        }
    };
    report.dry_call = dry_call(&plugin, &mut instance);
    report.dry_call_time = Some(start.elapsed());
    Ok(report)
}

fn dry_call(plugin: &LoadedPlugin, instance: &mut Instance) -> Result<String, String> {
    match plugin.kind {
        PluginKind::Router => {
            let request = RouteRequest {
                prompt_tokens: 64,
                prompt_blocks: 4,
                tenant: "check".into(),
            };
            let cols = ReplicaColumns {
                waiting: vec![2, 0, 1],
                running: vec![4, 1, 3],
                free_blocks: vec![10, 90, 40],
                total_blocks: vec![100; 3],
                kv_usage: vec![0.9, 0.1, 0.6],
                prefix_hit_blocks: vec![4, 0, 2],
                ssm_hit_blocks: vec![0; 3],
            };
            let (req, r) = super::adapters::route_args(&request, &cols);
            match instance.route(req, r).map_err(|e| e.to_string())? {
                Some(i) if (i as usize) < cols.len() => {
                    Ok(format!("route over 3 replicas -> replica {i}"))
                }
                Some(i) => Err(format!("route over 3 replicas -> {i}, out of range")),
                None => Ok("route over 3 replicas -> use default".into()),
            }
        }
        PluginKind::Evictor => {
            let mut ev = CacheEvents::default();
            ev.push(EventKind::Stored, 0, u32::MAX, 1);
            ev.push(EventKind::Stored, 1, 0, 1);
            ev.push(EventKind::Stored, 2, u32::MAX, 2);
            for b in [1, 0, 2] {
                ev.push(EventKind::Released, b, 0, 3);
            }
            instance
                .on_events(super::adapters::events_arg(&ev))
                .map_err(|e| e.to_string())?;
            let victims = instance.choose_victims(2, 4).map_err(|e| e.to_string())?;
            Ok(format!(
                "3 cached blocks (0 <- 1, 2), choose 2 -> {victims:?}"
            ))
        }
        PluginKind::Sampler => {
            let batch = SamplerBatch {
                k: 3,
                temperature: vec![0.0, 0.8],
                top_k: vec![0, 0],
                top_p: vec![1.0, 0.9],
                min_p: vec![0.0, 0.05],
                seed: vec![1, 2],
                counter: vec![0, 0],
                cand_tokens: vec![10, 11, 12, 20, 21, 22],
                cand_logits: vec![3.0, 2.0, 1.0, 0.5, 0.4, 0.1],
            };
            let tokens = instance
                .sample(super::adapters::batch_arg(&batch))
                .map_err(|e| e.to_string())?;
            Ok(format!("2 requests × 3 candidates -> {tokens:?}"))
        }
        PluginKind::Constraint => {
            let vocabulary = plugin.vocabulary.len();
            let matcher = instance
                .open("regex", "(ab)+")
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("open(regex \"(ab)+\") refused: {e}"))?;
            let mask = instance
                .next(matcher, &[])
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("next refused: {e}"))?;
            let allowed: u32 = mask.iter().map(|w| w.count_ones()).sum();
            instance.close(matcher).map_err(|e| e.to_string())?;
            Ok(format!(
                "regex (ab)+ over a {vocabulary}-token vocabulary -> {} mask words, {allowed} tokens allowed first",
                mask.len()
            ))
        }
        PluginKind::Parser => {
            let (tools, reasoning) = instance.formats().map_err(|e| e.to_string())?;
            let mut said = format!(
                "tool formats [{}], reasoning formats [{}]",
                tools.join(", "),
                reasoning.join(", ")
            );
            if let Some(format) = tools.first() {
                let request = super::abi::WitParseRequest {
                    tool_format: format,
                    reasoning_format: "",
                    reasoning_open: false,
                    tools: "",
                };
                let parser = instance
                    .open_parser(request)
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("open({format}) refused: {e}"))?;
                let mut pieces = instance.feed(parser, "hello").map_err(|e| e.to_string())?;
                let rest = instance.finish(parser).map_err(|e| e.to_string())?;
                pieces.kinds.extend(rest.kinds);
                said.push_str(&format!(
                    "; `hello` in {format} -> {} piece(s)",
                    pieces.kinds.len()
                ));
            }
            Ok(said)
        }
    }
}
