//! Builds the built-in policy plugins (`plugins/*`) for `wasm32-unknown-unknown` and places
//! the modules in `OUT_DIR`, where `src/plugins/builtin.rs` embeds them.
//!
//! Runs a nested `cargo build` with its own target directory (`<target>/wasm-plugins`), so
//! it never waits on the lock of the outer build, and with a size-and-speed release profile
//! passed on the command line. Reruns only when `plugins/`, `plugin-sdk/` or the lock file
//! change.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// (package, embedded file name)
const PLUGINS: [(&str, &str); 4] = [
    ("chimera-plugin-least-loaded", "least_loaded.wasm"),
    ("chimera-plugin-prefix-aware", "prefix_aware.wasm"),
    ("chimera-plugin-lru", "lru.wasm"),
    ("chimera-plugin-default-sampler", "default_sampler.wasm"),
];

const TARGET: &str = "wasm32-unknown-unknown";

fn main() {
    let manifest_dir =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .expect("host/ lives in the workspace root")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    for watched in ["plugins", "plugin-sdk", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let target_dir = wasm_target_dir(&out_dir);
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .arg("build")
        .arg("--release")
        .arg("--locked")
        .args(["--target", TARGET])
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--config", "profile.release.lto=true"])
        .args(["--config", "profile.release.codegen-units=1"])
        .args(["--config", "profile.release.opt-level=3"])
        .args(["--config", "profile.release.panic=\"abort\""])
        .args(["--config", "profile.release.debug=false"])
        .args(["--config", "profile.release.strip=true"]);
    for (package, _) in PLUGINS {
        cmd.args(["-p", package]);
    }
    // Settings meant for the outer (host) build must not leak into the Wasm build.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    // 128-bit SIMD lets the sampler's loops vectorise; every Wasm engine in use supports it.
    cmd.env("CARGO_ENCODED_RUSTFLAGS", "-Ctarget-feature=+simd128");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build the built-in plugins: {e}"));
    if !status.success() {
        panic!(
            "building the built-in Wasm plugins failed ({status}); the `{TARGET}` target must be \
             installed (rust-toolchain.toml lists it: `rustup target add {TARGET}`)"
        );
    }
    let artifacts = target_dir.join(TARGET).join("release");
    for (package, file) in PLUGINS {
        let built = artifacts.join(format!("{}.wasm", package.replace('-', "_")));
        copy_if_changed(&built, &out_dir.join(file));
    }
}

/// `<target>/wasm-plugins`, next to the outer build's profile directories.
fn wasm_target_dir(out_dir: &Path) -> PathBuf {
    if let Ok(dir) = env::var("CARGO_TARGET_DIR") {
        let dir = PathBuf::from(dir);
        if dir.is_absolute() {
            return dir.join("wasm-plugins");
        }
    }
    // OUT_DIR is <target>[/<triple>]/<profile>/build/<pkg>-<hash>/out.
    out_dir
        .ancestors()
        .nth(4)
        .map(|t| t.join("wasm-plugins"))
        .unwrap_or_else(|| out_dir.join("wasm-plugins"))
}

fn copy_if_changed(from: &Path, to: &Path) {
    let new = std::fs::read(from)
        .unwrap_or_else(|e| panic!("built plugin {} missing: {e}", from.display()));
    if std::fs::read(to).ok().as_deref() != Some(new.as_slice()) {
        std::fs::write(to, new).unwrap_or_else(|e| panic!("cannot write {}: {e}", to.display()));
    }
}
