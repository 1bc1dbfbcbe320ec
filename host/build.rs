//! Provides the built-in policy plugins (`plugins/*`) as `wasm32-unknown-unknown` modules in
//! `OUT_DIR`, where `src/plugins/builtin.rs` embeds them. Two ways:
//!
//! - **From source**, when the toolchain has the `wasm32-unknown-unknown` target: a nested
//!   `cargo build` with its own target directory (`<target>/wasm-plugins`, so it never waits
//!   on the lock of the outer build) and a size-and-speed release profile passed on the command
//!   line. The build is deterministic: the same toolchain gives the same bytes in any checkout.
//! - **From the committed binaries** in `plugins/prebuilt/` (checked against
//!   `plugins/prebuilt/SHA256SUMS`), when the target is missing — a toolchain installed
//!   without it, with rustup's automatic installation off (`RUSTUP_AUTO_INSTALL=0`) or
//!   offline — or when `CHIMERA_PREBUILT_PLUGINS=1`. The build says so in a warning. A test
//!   (`plugins::builtin::tests`) checks that a from-source build reproduces those files.
//!
//! Tells the crate which way it went (`CHIMERA_BUILTIN_PLUGINS` = `source` | `prebuilt`) and
//! whether the wasm target is installed (`CHIMERA_WASM_TARGET` = `1` | `0`). Reruns when
//! `plugins/`, `plugin-sdk/`, the lock file or the toolchain change.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// (package, embedded file name)
const PLUGINS: [(&str, &str); 6] = [
    ("chimera-plugin-least-loaded", "least_loaded.wasm"),
    ("chimera-plugin-prefix-aware", "prefix_aware.wasm"),
    ("chimera-plugin-lru", "lru.wasm"),
    ("chimera-plugin-default-sampler", "default_sampler.wasm"),
    ("chimera-plugin-llguidance", "llguidance.wasm"),
    ("chimera-plugin-tool-parsers", "tool_parsers.wasm"),
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
    for var in [
        "CARGO_TARGET_DIR",
        "CHIMERA_PREBUILT_PLUGINS",
        "RUSTUP_TOOLCHAIN",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    // Adding or removing a target changes the toolchain's `lib/rustlib`.
    if let Some(sysroot) = rustc_print(&["--print", "sysroot"]) {
        let rustlib = Path::new(&sysroot).join("lib").join("rustlib");
        if rustlib.is_dir() {
            println!("cargo:rerun-if-changed={}", rustlib.display());
        }
    }
    let installed = wasm_target_installed();
    println!(
        "cargo:rustc-env=CHIMERA_WASM_TARGET={}",
        if installed { 1 } else { 0 }
    );
    let forced = env::var("CHIMERA_PREBUILT_PLUGINS").is_ok_and(|v| v == "1");
    if installed && !forced {
        build_from_source(&root, &out_dir);
        println!("cargo:rustc-env=CHIMERA_BUILTIN_PLUGINS=source");
    } else {
        let why = if forced {
            "CHIMERA_PREBUILT_PLUGINS=1".to_string()
        } else {
            format!("the `{TARGET}` target is not installed")
        };
        copy_prebuilt(&root, &out_dir);
        println!(
            "cargo:warning=built-in Wasm plugins: using the committed binaries in \
             plugins/prebuilt/ (checksums verified) because {why}; to build them from source, \
             `rustup target add {TARGET}`"
        );
        println!("cargo:rustc-env=CHIMERA_BUILTIN_PLUGINS=prebuilt");
    }
}

/// `rustc <args>`'s output, trimmed (the `rustc` cargo uses).
fn rustc_print(args: &[&str]) -> Option<String> {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(rustc).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether the toolchain has the wasm target: its library folder holds a precompiled `core`.
fn wasm_target_installed() -> bool {
    let Some(dir) = rustc_print(&["--print", "target-libdir", "--target", TARGET]) else {
        return false;
    };
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("libcore-") && name.ends_with(".rlib")
        })
    })
}

fn build_from_source(root: &Path, out_dir: &Path) {
    let target_dir = wasm_target_dir(out_dir);
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
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
    // Paths of registry crates (in panic locations) must not depend on where CARGO_HOME is,
    // so the bytes are the same on every machine (workspace paths are already relative).
    // getrandom (ahash's seed in the llguidance plugin) takes its bytes from the plugin itself.
    let mut flags = vec![
        "-Ctarget-feature=+simd128".to_string(),
        "--cfg=getrandom_backend=\"custom\"".to_string(),
    ];
    if let Some(home) = cargo_home() {
        flags.push(format!("--remap-path-prefix={}=/cargo", home.display()));
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", flags.join("\u{1f}"));
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build the built-in plugins: {e}"));
    if !status.success() {
        panic!(
            "building the built-in Wasm plugins failed ({status}); set \
             CHIMERA_PREBUILT_PLUGINS=1 to use the committed binaries in plugins/prebuilt/"
        );
    }
    let artifacts = target_dir.join(TARGET).join("release");
    for (package, file) in PLUGINS {
        let built = artifacts.join(format!("{}.wasm", package.replace('-', "_")));
        let bytes = std::fs::read(&built)
            .unwrap_or_else(|e| panic!("built plugin {} missing: {e}", built.display()));
        write_if_changed(&out_dir.join(file), &bytes);
    }
}

fn cargo_home() -> Option<PathBuf> {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
}

/// Copies `plugins/prebuilt/*.wasm` after checking each against `SHA256SUMS`.
fn copy_prebuilt(root: &Path, out_dir: &Path) {
    let dir = root.join("plugins").join("prebuilt");
    let sums_path = dir.join("SHA256SUMS");
    let sums = std::fs::read_to_string(&sums_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", sums_path.display()));
    for (_, file) in PLUGINS {
        let expected = sums
            .lines()
            .filter_map(|l| l.split_once("  "))
            .find(|(_, name)| name.trim() == file)
            .map(|(sum, _)| sum.trim().to_string())
            .unwrap_or_else(|| panic!("{} lists no checksum for {file}", sums_path.display()));
        let path = dir.join(file);
        let bytes =
            std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let actual = hex(&Sha256::digest(&bytes));
        if actual != expected {
            panic!(
                "{} has SHA-256 {actual}, but {} says {expected}: the checkout is damaged \
                 (or the file was replaced without updating the list)",
                path.display(),
                sums_path.display()
            );
        }
        write_if_changed(&out_dir.join(file), &bytes);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

fn write_if_changed(to: &Path, bytes: &[u8]) {
    if std::fs::read(to).ok().as_deref() != Some(bytes) {
        std::fs::write(to, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", to.display()));
    }
}
