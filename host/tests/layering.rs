//! The boundaries DESIGN.md §2 names, read from the source: modules import only downward
//! (backend ← model ← engine ← server; the cache below the engine); the server reaches a
//! replica only through the engine's public face; the engine's step loop holds no tokio types
//! and no plugin internals; the scheduler never touches block ids or free lists; the model
//! never sees how blocks are allocated; the plugin SDK depends on nothing of the host and the
//! host on none of its guest code. Each test fails on any path across its boundary.
//!
//! Paths are found after comments and string literals are stripped, in every spelling that
//! reaches the crate root: `crate::x`, `crate::{x, y::z}` and `super::…::x` chains that climb
//! to the root from the file's module.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Rust files under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The source without comments and string literals (each replaced by a space).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if b[i] == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
            // Raw string r"…" / r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            j += 1;
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            i = j + close.len();
            out.push(' ');
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            // Escaped char literal '\x', '\u{..}'.
            i += 2;
            while i < b.len() && b[i] != b'\'' {
                i += 1;
            }
            i += 1;
            out.push(' ');
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            // Char literal 'x' (a lifetime never has a quote two bytes on).
            i += 3;
            out.push(' ');
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else {
            let c = src[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Depth of the module a file defines below the crate root: `cache/mod.rs` is 1,
/// `cache/spec.rs` and `backend/cpu/mod.rs` are 2.
fn module_depth(rel: &Path) -> usize {
    let n = rel.components().count();
    if rel.file_name().is_some_and(|f| f == "mod.rs") {
        n - 1
    } else {
        n
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// First identifiers of the use tree at the start of `s` (`x`, or `x` and `y` of `{x, y::z}`).
fn tree_heads(s: &str) -> Vec<String> {
    let s = s.trim_start();
    if let Some(body) = s.strip_prefix('{') {
        let mut heads = Vec::new();
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    heads.extend(tree_heads(&body[start..i]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    heads.extend(tree_heads(&body[start..i]));
                    start = i + 1;
                }
                _ => {}
            }
        }
        heads
    } else {
        let id: String = s.chars().take_while(|&c| is_ident(c)).collect();
        if id.is_empty() { Vec::new() } else { vec![id] }
    }
}

/// Crate-root modules that `code` (comments stripped) names, from a module at `depth`.
fn root_modules(code: &str, depth: usize) -> Vec<String> {
    let mut found = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary = !code[..i].ends_with(|c: char| is_ident(c) || c == ':');
        if boundary && (rest.starts_with("crate") || rest.starts_with("super")) {
            let mut s = rest;
            let mut climbs = 0usize;
            let mut from_root = false;
            loop {
                let t = s.trim_start();
                if let Some(after) = t.strip_prefix("crate")
                    && climbs == 0
                    && !after.starts_with(is_ident)
                {
                    from_root = true;
                    s = after;
                } else if let Some(after) = t.strip_prefix("super")
                    && !after.starts_with(is_ident)
                {
                    climbs += 1;
                    s = after;
                } else {
                    break;
                }
                match s.trim_start().strip_prefix("::") {
                    Some(after) => s = after,
                    None => break,
                }
                if from_root {
                    break;
                }
            }
            if from_root || (climbs > 0 && climbs == depth) {
                found.extend(tree_heads(s));
            }
            i += rest.len() - s.len();
            if s.len() == rest.len() {
                i += rest.chars().next().map_or(1, char::len_utf8);
            }
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    found
}

/// `file: module` for every forbidden crate-root module named under `src/<dir>`.
fn violations(dir: &str, forbidden: &[&str]) -> Vec<String> {
    let root = src();
    let files = rust_files(&root.join(dir));
    assert!(!files.is_empty(), "no sources under src/{dir}");
    let mut bad = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&root).unwrap();
        let code = strip(&std::fs::read_to_string(&f).unwrap());
        for m in root_modules(&code, module_depth(rel)) {
            if forbidden.contains(&m.as_str()) {
                bad.push(format!("src/{}: crate::{m}", rel.display()));
            }
        }
    }
    bad
}

/// `file: word` for every forbidden identifier path named in the non-test code of `files`
/// (code after the file's first `#[cfg(test)]` is its tests, by this crate's layout).
fn mentions(files: &[PathBuf], words: &[&str]) -> Vec<String> {
    let root = src();
    let mut bad = Vec::new();
    for f in files {
        let code = strip(&std::fs::read_to_string(f).unwrap());
        let code = code.split("#[cfg(test)]").next().unwrap_or_default();
        for w in words {
            let hit = code.match_indices(w).any(|(i, _)| {
                let before = code[..i].chars().next_back();
                let after = code[i + w.len()..].chars().next();
                !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
            });
            if hit {
                let rel = f.strip_prefix(&root).unwrap_or(f);
                bad.push(format!("src/{}: {w}", rel.display()));
            }
        }
    }
    bad
}

fn files_of(dir: &str) -> Vec<PathBuf> {
    rust_files(&src().join(dir))
        .into_iter()
        .filter(|f| !f.to_string_lossy().ends_with("_tests.rs"))
        .collect()
}

#[test]
fn the_server_reaches_replicas_only_through_the_engines_public_face() {
    let mut bad = violations("server", &["model", "backend", "bench"]);
    // Of the engine: its API (handles, commands, events) only.
    bad.extend(mentions(
        &files_of("server"),
        &[
            "engine::core",
            "engine::scheduler",
            "engine::pipeline",
            "engine::model_runner",
            "engine::step_plan",
            "engine::executor",
            "Scheduler",
            "CacheManager",
            "BlockPool",
        ],
    ));
    assert!(
        bad.is_empty(),
        "the server reaches past the engine handles:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_engine_knows_no_http_and_no_plugin_internals() {
    let mut bad = violations("engine", &["server", "plugins", "bench"]);
    bad.extend(mentions(
        &files_of("engine"),
        &["wasmtime", "axum", "hyper"],
    ));
    assert!(
        bad.is_empty(),
        "the engine reaches into HTTP or plugins:\n{}",
        bad.join("\n")
    );
}

/// The step loop (scheduler, pipeline, step building, sampling, the engine itself) is plain
/// synchronous code: tokio stays at the edges (the API's channels, the thread's publisher).
#[test]
fn the_engine_loop_holds_no_tokio_types() {
    let loop_files: Vec<PathBuf> = [
        "core.rs",
        "pipeline.rs",
        "scheduler.rs",
        "step_plan.rs",
        "sampling.rs",
        "request.rs",
        "timings.rs",
        "model_runner.rs",
        "executor.rs",
    ]
    .iter()
    .map(|f| src().join("engine").join(f))
    .collect();
    let bad = mentions(&loop_files, &["tokio"]);
    assert!(
        bad.is_empty(),
        "tokio in the engine loop:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_scheduler_never_touches_block_ids_or_free_lists() {
    let files = [src().join("engine/scheduler.rs")];
    let bad = mentions(
        &files,
        &[
            "BlockPool",
            "pool",
            "block_table",
            "free_blocks",
            "allocate",
            "BlockId",
        ],
    );
    assert!(
        bad.is_empty(),
        "the scheduler reaches into the pool:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_model_never_sees_how_blocks_are_allocated() {
    let mut bad = violations("model", &["engine", "server", "plugins", "policy"]);
    bad.extend(mentions(
        &files_of("model"),
        &[
            "CacheManager",
            "BlockPool",
            "cache::pool",
            "cache::manager",
            "PrefixMatch",
        ],
    ));
    assert!(
        bad.is_empty(),
        "the model reaches into the cache:\n{}",
        bad.join("\n")
    );
}

/// `plugin-sdk` depends on nothing of the host; the host builds against the WIT files, not
/// the SDK's guest code (its tests may build plugins with it).
#[test]
fn the_plugin_sdk_and_the_host_stay_apart() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sdk: toml::Table = std::fs::read_to_string(root.join("plugin-sdk/Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let sdk_deps = sdk.get("dependencies").and_then(|d| d.as_table());
    assert!(
        sdk_deps.is_none_or(|d| !d.contains_key("chimera")),
        "plugin-sdk depends on the host"
    );
    let host: toml::Table = std::fs::read_to_string(root.join("host/Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let host_deps = host.get("dependencies").and_then(|d| d.as_table());
    assert!(
        host_deps.is_none_or(|d| !d.contains_key("chimera-plugin-sdk")),
        "the host depends on the SDK's guest code"
    );
}

#[test]
fn cache_imports_nothing_above_it() {
    let bad = violations(
        "cache",
        &["model", "engine", "server", "backend", "plugins"],
    );
    assert!(bad.is_empty(), "the cache reaches up:\n{}", bad.join("\n"));
}

#[test]
fn backend_imports_nothing_above_it() {
    let bad = violations(
        "backend",
        &["model", "engine", "server", "cache", "plugins", "policy"],
    );
    assert!(
        bad.is_empty(),
        "the backend reaches up:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_scanner_finds_every_spelling_of_a_root_path() {
    let heads = |code: &str, depth| root_modules(&strip(code), depth);
    assert_eq!(heads("use crate::model::CacheSpec;", 2), ["model"]);
    assert_eq!(
        heads(
            "use crate::{policy::Evictor, engine::{api::KvEvent, X}};",
            2
        ),
        ["policy", "engine"]
    );
    assert_eq!(heads("fn f(x: crate :: server::Y) {}", 1), ["server"]);
    // `super` climbs: from cache/spec.rs (depth 2) two steps reach the root, one does not.
    assert_eq!(heads("use super::super::model::X;", 2), ["model"]);
    assert_eq!(
        heads("use super::spec::CacheSpec;", 2),
        Vec::<String>::new()
    );
    assert_eq!(heads("use super::model::X;", 1), ["model"]);
    // Comments and strings are not imports; longer identifiers are not `crate`.
    assert_eq!(
        heads(
            "//! Unlike `crate::model`, ...\n/* crate::engine */ let s = \"crate::server\";\n\
             let t = r#\"crate::engine\"#; let q = '\"'; my_crate::model::X; 'a: loop {}",
            2
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        module_depth(Path::new("backend/cpu/mod.rs")),
        2,
        "mod.rs is its folder's module"
    );
    // And the real tree trips it: the model does import the backend and the cache.
    assert!(!violations("model", &["backend"]).is_empty());
    // The identifier check sees real uses, whole words only, and skips the tests.
    let engine = |f: &str| vec![src().join("engine").join(f)];
    assert!(!mentions(&engine("scheduler.rs"), &["CacheManager"]).is_empty());
    assert!(!mentions(&engine("thread.rs"), &["tokio"]).is_empty());
    assert!(mentions(&engine("scheduler.rs"), &["CacheMan"]).is_empty());
    assert!(mentions(&engine("step_plan.rs"), &["unbounded_channel"]).is_empty());
}
