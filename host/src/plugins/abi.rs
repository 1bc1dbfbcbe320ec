//! The plugin ABI as the host sees it: versions, kinds, export names, and the records that
//! cross the boundary.
//!
//! A plugin exports exactly one interface of the WIT package `chimera:plugin`, named
//! `chimera:plugin/<interface>@<version>`; the interface gives the kind and the version is
//! checked against [`ACCEPTED`] at load. The host-side records here are typechecked by
//! wasmtime against the plugin's own types when a function is looked up, and borrow the
//! host's columns so nothing is copied before the canonical ABI lowers them. Must not know
//! about fallbacks or metrics.

use std::fmt;

use chimera_policy_core::{Config, ConfigValue};
use wasmtime::component::{ComponentType, Lower};

use super::PluginKind;

pub const PACKAGE: &str = "chimera:plugin";

/// A semantic version `major.minor.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AbiVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl AbiVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// Parses `1.2.3` (pre-release and build suffixes are not accepted).
    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.split('.').map(|p| p.parse::<u32>().ok());
        let v = Self::new(it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    }
}

impl fmt::Display for AbiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// A half-open range of ABI versions: `min <= v < below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbiRange {
    pub min: AbiVersion,
    pub below: AbiVersion,
}

impl AbiRange {
    pub fn contains(&self, v: AbiVersion) -> bool {
        self.min <= v && v < self.below
    }
}

impl fmt::Display for AbiRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, ">={}, <{}", self.min, self.below)
    }
}

/// The ABI versions this host can drive: every 0.1.x (0.1.0 is the first release).
pub const ACCEPTED: AbiRange = AbiRange {
    min: AbiVersion::new(0, 1, 0),
    below: AbiVersion::new(0, 2, 0),
};

/// The version of a host-interface import `chimera:plugin/host@<version>`, if it is one.
pub fn parse_host_import(name: &str) -> Option<AbiVersion> {
    let version = name.strip_prefix(PACKAGE)?.strip_prefix("/host@")?;
    AbiVersion::parse(version)
}

/// Parses an export name `chimera:plugin/<interface>@<version>` into kind and version.
/// Returns `None` for names outside the package; `Some((None, v))` for an unknown interface.
pub fn parse_export(name: &str) -> Option<(Option<PluginKind>, Option<AbiVersion>)> {
    let rest = name.strip_prefix(PACKAGE)?.strip_prefix('/')?;
    let (iface, version) = match rest.split_once('@') {
        Some((i, v)) => (i, AbiVersion::parse(v)),
        None => (rest, None),
    };
    let kind = PluginKind::ALL.into_iter().find(|k| k.interface() == iface);
    Some((kind, version))
}

/// Function names of each interface in 0.1.x, in the order the host looks them up.
pub fn functions(kind: PluginKind) -> &'static [&'static str] {
    match kind {
        PluginKind::Router => &["init", "route"],
        PluginKind::Evictor => &["init", "on-events", "choose-victims"],
        PluginKind::Sampler => &["init", "sample"],
    }
}

// ---------------------------------------------------------------------------------------------
// Records crossing the boundary (0.1.x). Field and case names are the WIT names.
// ---------------------------------------------------------------------------------------------

#[derive(ComponentType, Lower, Debug, Clone)]
#[component(variant)]
pub enum WitConfigValue {
    #[component(name = "boolean")]
    Boolean(bool),
    #[component(name = "integer")]
    Integer(i64),
    #[component(name = "float")]
    Float(f64),
    #[component(name = "text")]
    Text(String),
}

#[derive(ComponentType, Lower, Debug, Clone)]
#[component(record)]
pub struct WitConfigEntry {
    #[component(name = "key")]
    pub key: String,
    #[component(name = "value")]
    pub value: WitConfigValue,
}

/// The flat config as the `list<config-entry>` that `init` takes.
pub fn config_entries(config: &Config) -> Vec<WitConfigEntry> {
    config
        .entries
        .iter()
        .map(|(k, v)| WitConfigEntry {
            key: k.clone(),
            value: match v {
                ConfigValue::Boolean(b) => WitConfigValue::Boolean(*b),
                ConfigValue::Integer(i) => WitConfigValue::Integer(*i),
                ConfigValue::Float(f) => WitConfigValue::Float(*f),
                ConfigValue::Text(s) => WitConfigValue::Text(s.clone()),
            },
        })
        .collect()
}

#[derive(ComponentType, Lower, Debug, Clone, Copy)]
#[component(record)]
pub struct WitRouteRequest<'a> {
    #[component(name = "prompt-tokens")]
    pub prompt_tokens: u32,
    #[component(name = "prompt-blocks")]
    pub prompt_blocks: u32,
    #[component(name = "tenant")]
    pub tenant: &'a str,
}

#[derive(ComponentType, Lower, Debug, Clone, Copy)]
#[component(record)]
pub struct WitReplicaColumns<'a> {
    #[component(name = "waiting")]
    pub waiting: &'a [u32],
    #[component(name = "running")]
    pub running: &'a [u32],
    #[component(name = "free-blocks")]
    pub free_blocks: &'a [u32],
    #[component(name = "total-blocks")]
    pub total_blocks: &'a [u32],
    #[component(name = "kv-usage")]
    pub kv_usage: &'a [f32],
    #[component(name = "prefix-hit-blocks")]
    pub prefix_hit_blocks: &'a [u32],
    #[component(name = "ssm-hit-blocks")]
    pub ssm_hit_blocks: &'a [u32],
}

#[derive(ComponentType, Lower, Debug, Clone, Copy)]
#[component(record)]
pub struct WitCacheEvents<'a> {
    #[component(name = "kinds")]
    pub kinds: &'a [u8],
    #[component(name = "blocks")]
    pub blocks: &'a [u32],
    #[component(name = "parents")]
    pub parents: &'a [u32],
    #[component(name = "steps")]
    pub steps: &'a [u64],
}

#[derive(ComponentType, Lower, Debug, Clone, Copy)]
#[component(record)]
pub struct WitSamplerBatch<'a> {
    #[component(name = "k")]
    pub k: u32,
    #[component(name = "temperature")]
    pub temperature: &'a [f32],
    #[component(name = "top-k")]
    pub top_k: &'a [u32],
    #[component(name = "top-p")]
    pub top_p: &'a [f32],
    #[component(name = "min-p")]
    pub min_p: &'a [f32],
    #[component(name = "seed")]
    pub seed: &'a [u64],
    #[component(name = "counter")]
    pub counter: &'a [u64],
    #[component(name = "cand-tokens")]
    pub cand_tokens: &'a [u32],
    #[component(name = "cand-logits")]
    pub cand_logits: &'a [f32],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_names_and_ranges() {
        assert_eq!(
            parse_export("chimera:plugin/routing@0.1.3"),
            Some((Some(PluginKind::Router), Some(AbiVersion::new(0, 1, 3))))
        );
        assert_eq!(
            parse_export("chimera:plugin/mystery@0.1.0").map(|p| p.0),
            Some(None)
        );
        assert_eq!(parse_export("wasi:cli/run@0.2.0"), None);
        assert!(ACCEPTED.contains(AbiVersion::new(0, 1, 7)));
        assert!(!ACCEPTED.contains(AbiVersion::new(0, 2, 0)));
        assert!(!ACCEPTED.contains(AbiVersion::new(0, 0, 9)));
        assert_eq!(AbiVersion::parse("1.2"), None);
        assert_eq!(AbiVersion::parse("1.2.3.4"), None);
        assert_eq!(ACCEPTED.to_string(), ">=0.1.0, <0.2.0");
    }
}
