//! The built-in plugins, compiled to Wasm by `host/build.rs` and embedded in the binary.
//!
//! Each is the `wasm32-unknown-unknown` core module of a crate in `plugins/`; the loader turns
//! it into a component like any author's module. Every built-in has a native twin in
//! `policy::native` built from the same algorithm source. On a toolchain without the wasm
//! target the build embeds the committed, checksummed copies in `plugins/prebuilt/` instead
//! ([`FROM_SOURCE`] says which); a test checks that a from-source build reproduces them.

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

pub const BUILTINS: [Builtin; 6] = [
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
    Builtin {
        name: "llguidance",
        kind: PluginKind::Constraint,
        wasm: embed!("llguidance.wasm"),
    },
    Builtin {
        name: "tool-parsers",
        kind: PluginKind::Parser,
        wasm: embed!("tool_parsers.wasm"),
    },
];

pub fn find(kind: PluginKind, name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.kind == kind && b.name == name)
}

/// Whether this build compiled the built-ins from source (otherwise it embedded
/// `plugins/prebuilt/`).
pub const FROM_SOURCE: bool = matches!(env!("CHIMERA_BUILTIN_PLUGINS").as_bytes(), b"source");

/// Whether the toolchain that built this crate has the `wasm32-unknown-unknown` target (tests
/// that compile Wasm plugins of their own need it).
pub const WASM_TARGET_INSTALLED: bool = matches!(env!("CHIMERA_WASM_TARGET").as_bytes(), b"1");

/// The embedded file name of each built-in (as in `plugins/prebuilt/`), in [`BUILTINS`] order.
pub const FILES: [&str; 6] = [
    "least_loaded.wasm",
    "prefix_aware.wasm",
    "lru.wasm",
    "default_sampler.wasm",
    "llguidance.wasm",
    "tool_parsers.wasm",
];

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};
    use std::path::PathBuf;

    fn prebuilt_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/prebuilt")
    }

    fn sha256(bytes: &[u8]) -> String {
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// `SHA256SUMS` as (file, checksum) pairs.
    fn manifest() -> Vec<(String, String)> {
        std::fs::read_to_string(prebuilt_dir().join("SHA256SUMS"))
            .unwrap()
            .lines()
            .map(|l| {
                let (sum, file) = l.split_once("  ").unwrap();
                (file.to_string(), sum.to_string())
            })
            .collect()
    }

    #[test]
    fn the_committed_plugins_match_their_checksums() {
        let m = manifest();
        assert_eq!(
            m.iter().map(|(f, _)| f.as_str()).collect::<Vec<_>>(),
            FILES,
            "SHA256SUMS lists every built-in, in order"
        );
        for (file, sum) in m {
            let bytes = std::fs::read(prebuilt_dir().join(&file)).unwrap();
            assert_eq!(sha256(&bytes), sum, "plugins/prebuilt/{file}");
        }
    }

    /// The committed binaries are what the pinned toolchain builds from this source (the
    /// from-source build is deterministic). `CHIMERA_UPDATE_PREBUILT=1` rewrites them from
    /// this build instead of failing.
    #[test]
    fn committed_plugins_are_reproduced_from_source() {
        if !FROM_SOURCE {
            assert!(
                std::env::var("CHIMERA_REQUIRE_WASM").as_deref() != Ok("1"),
                "CHIMERA_REQUIRE_WASM=1 but this build embedded plugins/prebuilt/ (no wasm target)"
            );
            // Straight to stderr, past the harness's capture, so the skip is seen.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                b"skipped: committed_plugins_are_reproduced_from_source: this build embedded \
                  plugins/prebuilt/ (no wasm32-unknown-unknown target), so there is no \
                  from-source build to compare\n",
            );
            return;
        }
        if std::env::var("CHIMERA_UPDATE_PREBUILT").as_deref() == Ok("1") {
            let mut sums = String::new();
            for (b, file) in BUILTINS.iter().zip(FILES) {
                std::fs::write(prebuilt_dir().join(file), b.wasm).unwrap();
                sums.push_str(&format!("{}  {file}\n", sha256(b.wasm)));
            }
            std::fs::write(prebuilt_dir().join("SHA256SUMS"), sums).unwrap();
            println!("updated plugins/prebuilt/ from this build");
            return;
        }
        let m = manifest();
        let stale: Vec<String> = BUILTINS
            .iter()
            .zip(FILES)
            .filter(|(b, file)| {
                m.iter().find(|(f, _)| f == file).map(|(_, s)| s.as_str()) != Some(&sha256(b.wasm))
            })
            .map(|(_, file)| file.to_string())
            .collect();
        assert!(
            stale.is_empty(),
            "the from-source build of {stale:?} differs from plugins/prebuilt/: after changing a \
             plugin, plugin-sdk/ or Cargo.lock, run `CHIMERA_UPDATE_PREBUILT=1 cargo test -p \
             chimera --lib plugins::builtin` and commit the result"
        );
    }
}
