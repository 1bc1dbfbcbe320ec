//! The built-in plugins, compiled to Wasm by `host/build.rs` and embedded in the binary.
//!
//! Each is the `wasm32-unknown-unknown` core module of a crate in `plugins/`; the loader turns
//! it into a component like any author's module. Every built-in has a native twin in
//! `policy::native` built from the same algorithm source.

use super::PluginKind;

/// One embedded plugin.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    pub name: &'static str,
    pub kind: PluginKind,
    pub wasm: &'static [u8],
}

macro_rules! embed {
    ($file:literal) => {
        include_bytes!(concat!(env!("OUT_DIR"), "/", $file))
    };
}

pub const BUILTINS: [Builtin; 4] = [
    Builtin {
        name: "least-loaded",
        kind: PluginKind::Router,
        wasm: embed!("least_loaded.wasm"),
    },
    Builtin {
        name: "prefix-aware",
        kind: PluginKind::Router,
        wasm: embed!("prefix_aware.wasm"),
    },
    Builtin {
        name: "lru",
        kind: PluginKind::Evictor,
        wasm: embed!("lru.wasm"),
    },
    Builtin {
        name: "default",
        kind: PluginKind::Sampler,
        wasm: embed!("default_sampler.wasm"),
    },
];

pub fn find(kind: PluginKind, name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.kind == kind && b.name == name)
}
