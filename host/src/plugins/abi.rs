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
use wasmtime::component::{ComponentType, Lift, Lower};

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

/// The ABI versions this host can drive: every 0.1.x (0.1.0 is the first release) and 0.2.x
/// (0.1.1 plus the `constraining` and `parsing` interfaces).
pub const ACCEPTED: AbiRange = AbiRange {
    min: AbiVersion::new(0, 1, 0),
    below: AbiVersion::new(0, 3, 0),
};

/// The first version that defines `kind`'s interface.
pub fn introduced(kind: PluginKind) -> AbiVersion {
    match kind {
        PluginKind::Router | PluginKind::Evictor | PluginKind::Sampler => AbiVersion::new(0, 1, 0),
        PluginKind::Constraint | PluginKind::Parser => AbiVersion::new(0, 2, 0),
    }
}

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

/// Function names of each interface, in the order the host looks them up (the same in every
/// version that defines it).
pub fn functions(kind: PluginKind) -> &'static [&'static str] {
    match kind {
        PluginKind::Router => &["init", "route"],
        PluginKind::Evictor => &["init", "on-events", "choose-victims"],
        PluginKind::Sampler => &["init", "sample"],
        PluginKind::Constraint => &["init", "open", "next", "rollback", "close"],
        PluginKind::Parser => &["init", "formats", "open", "feed", "finish", "call-grammar"],
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

/// A model's vocabulary as the `constraining` interface takes it (0.2.0 `vocabulary`): token
/// `i`'s bytes are `bytes[ends[i - 1]..ends[i]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vocabulary {
    pub bytes: Vec<u8>,
    pub ends: Vec<u32>,
    pub special: Vec<u8>,
    pub eos: u32,
}

impl Vocabulary {
    /// Builds the columns from each token's bytes and whether it is special.
    pub fn from_tokens<'a>(tokens: impl IntoIterator<Item = (&'a [u8], bool)>, eos: u32) -> Self {
        let mut v = Self {
            eos,
            ..Self::default()
        };
        for (bytes, special) in tokens {
            v.bytes.extend_from_slice(bytes);
            v.ends.push(v.bytes.len() as u32);
            v.special.push(special as u8);
        }
        v
    }

    /// A small stand-in used to check a constraint plugin before a model is loaded: the 256
    /// single bytes, then `<|end|>` (special, the EOS).
    pub fn sample() -> Self {
        let bytes: Vec<[u8; 1]> = (0..=255u8).map(|b| [b]).collect();
        let tokens = bytes
            .iter()
            .map(|b| (&b[..], false))
            .chain(std::iter::once((&b"<|end|>"[..], true)));
        Self::from_tokens(tokens, 256)
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Mask words per position: `ceil(len / 32)`.
    pub fn mask_words(&self) -> usize {
        self.len().div_ceil(32)
    }

    pub fn view(&self) -> chimera_policy_core::VocabularyView<'_> {
        chimera_policy_core::VocabularyView {
            bytes: &self.bytes,
            ends: &self.ends,
            special: &self.special,
            eos: self.eos,
        }
    }

    pub(crate) fn arg(&self) -> WitVocabulary<'_> {
        WitVocabulary {
            bytes: &self.bytes,
            ends: &self.ends,
            special: &self.special,
            eos: self.eos,
        }
    }
}

#[derive(ComponentType, Lower, Debug, Clone, Copy)]
#[component(record)]
pub struct WitVocabulary<'a> {
    #[component(name = "bytes")]
    pub bytes: &'a [u8],
    #[component(name = "ends")]
    pub ends: &'a [u32],
    #[component(name = "special")]
    pub special: &'a [u8],
    #[component(name = "eos")]
    pub eos: u32,
}

#[derive(ComponentType, Lower, Debug, Clone, Copy)]
#[component(record)]
pub struct WitParseRequest<'a> {
    #[component(name = "tool-format")]
    pub tool_format: &'a str,
    #[component(name = "reasoning-format")]
    pub reasoning_format: &'a str,
    #[component(name = "reasoning-open")]
    pub reasoning_open: bool,
    #[component(name = "tools")]
    pub tools: &'a str,
}

#[derive(ComponentType, Lift, Debug, Clone, Default)]
#[component(record)]
pub struct WitParsed {
    #[component(name = "kinds")]
    pub kinds: Vec<u8>,
    #[component(name = "calls")]
    pub calls: Vec<u32>,
    #[component(name = "texts")]
    pub texts: Vec<String>,
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
        assert!(ACCEPTED.contains(AbiVersion::new(0, 2, 0)));
        assert!(!ACCEPTED.contains(AbiVersion::new(0, 3, 0)));
        assert!(!ACCEPTED.contains(AbiVersion::new(0, 0, 9)));
        assert_eq!(AbiVersion::parse("1.2"), None);
        assert_eq!(AbiVersion::parse("1.2.3.4"), None);
        assert_eq!(ACCEPTED.to_string(), ">=0.1.0, <0.3.0");
        assert_eq!(
            parse_export("chimera:plugin/constraining@0.2.0"),
            Some((Some(PluginKind::Constraint), Some(AbiVersion::new(0, 2, 0))))
        );
        assert_eq!(introduced(PluginKind::Parser), AbiVersion::new(0, 2, 0));
    }
}
