//! Helpers for the plugin integration tests: building the out-of-workspace test plugins,
//! making deliberately broken modules, and random policy inputs.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use chimera::policy::{CacheEvents, ReplicaColumns, RouteRequest, SamplerBatch};
use chimera_policy_core::rng::Rng;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host/ is in the repo root")
        .to_path_buf()
}

/// Builds `tests/plugins` (its own workspace) for wasm32 once per test binary and returns
/// the directory holding `pin_router.wasm` and `misbehave_router.wasm`. `None` (and the
/// calling test prints that it is skipped) when the toolchain has no `wasm32-unknown-unknown`
/// target, unless `CHIMERA_REQUIRE_WASM=1` (CI), which makes that a failure.
pub fn test_plugins_dir() -> Option<&'static Path> {
    if !chimera::plugins::builtin::WASM_TARGET_INSTALLED {
        assert!(
            std::env::var("CHIMERA_REQUIRE_WASM").as_deref() != Ok("1"),
            "CHIMERA_REQUIRE_WASM=1, but the toolchain has no wasm32-unknown-unknown target"
        );
        // Straight to the process's stderr: the test harness does not capture it, so the skip
        // shows in a plain `cargo test`.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {}: needs the wasm32-unknown-unknown target to build tests/plugins \
             (`rustup target add wasm32-unknown-unknown`)",
            std::thread::current().name().unwrap_or("this test")
        );
        return None;
    }
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    Some(DIR.get_or_init(|| {
        let root = repo_root();
        let target_dir = match std::env::var("CARGO_TARGET_DIR") {
            Ok(d) if Path::new(&d).is_absolute() => PathBuf::from(d).join("test-plugins"),
            _ => root.join("target").join("test-plugins"),
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(root.join("tests/plugins"))
            .args([
                "build",
                "--release",
                "--locked",
                "--target",
                "wasm32-unknown-unknown",
                "--target-dir",
            ])
            .arg(&target_dir)
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_TARGET_DIR")
            .status()
            .expect("run cargo");
        assert!(status.success(), "building tests/plugins failed");
        target_dir.join("wasm32-unknown-unknown/release")
    }))
}

/// A core module implementing `world` of the 0.1.0 WIT with `@0.1.0` replaced by
/// `@{version}`: every function body is `unreachable`, so every call traps.
pub fn dummy_plugin(world: &str, version: &str) -> Vec<u8> {
    dummy_plugin_of("0.1.0", world, version)
}

/// As [`dummy_plugin`], from the WIT of release `release` (e.g. `0.2.0` for its new worlds).
pub fn dummy_plugin_of(release: &str, world: &str, version: &str) -> Vec<u8> {
    let wit =
        std::fs::read_to_string(repo_root().join(format!("plugin-sdk/wit/v{release}/plugin.wit")))
            .expect("read WIT");
    let wit = wit.replace(&format!("@{release}"), &format!("@{version}"));
    let mut resolve = wit_parser::Resolve::default();
    let pkg = resolve.push_str("plugin.wit", &wit).expect("parse WIT");
    let world = resolve.select_world(&[pkg], Some(world)).expect("world");
    let mut module = wit_component::dummy_module(
        &resolve,
        world,
        wit_parser::ManglingAndAbi::Legacy(wit_parser::LiftLowerAbi::Sync),
    );
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
    )
    .expect("embed metadata");
    module
}

pub fn random_replicas(rng: &mut Rng, n: usize) -> ReplicaColumns {
    let mut c = ReplicaColumns::default();
    for _ in 0..n {
        let total = 1 + rng.next_below(500);
        let free = rng.next_below(total + 1);
        c.waiting.push(rng.next_below(12));
        c.running.push(rng.next_below(12));
        c.free_blocks.push(free);
        c.total_blocks.push(total);
        c.kv_usage.push(1.0 - free as f32 / total as f32);
        c.prefix_hit_blocks.push(rng.next_below(20));
        c.ssm_hit_blocks.push(rng.next_below(20));
    }
    c
}

pub fn random_request(rng: &mut Rng) -> RouteRequest {
    RouteRequest {
        prompt_tokens: rng.next_below(4000),
        prompt_blocks: rng.next_below(25),
        tenant: "t".into(),
    }
}

pub fn random_batch(rng: &mut Rng, n: usize, k: usize) -> SamplerBatch {
    let mut b = SamplerBatch {
        k: k as u32,
        ..SamplerBatch::default()
    };
    for _ in 0..n {
        b.temperature.push(match rng.next_below(4) {
            0 => 0.0,
            _ => 0.05 + rng.next_f32() * 2.0,
        });
        b.top_k.push(if rng.next_below(2) == 0 {
            0
        } else {
            1 + rng.next_below(k as u32)
        });
        b.top_p.push(if rng.next_below(2) == 0 {
            1.0
        } else {
            0.05 + rng.next_f32() * 0.95
        });
        b.min_p.push(if rng.next_below(3) == 0 {
            rng.next_f32() * 0.3
        } else {
            0.0
        });
        b.seed.push(rng.next_u64());
        b.counter.push(rng.next_below(1000) as u64);
        let mut logit = rng.next_f32() * 20.0 - 10.0;
        for j in 0..k {
            b.cand_tokens.push(rng.next_below(50_000) + j as u32);
            b.cand_logits.push(logit);
            logit -= rng.next_f32() * 2.0;
        }
    }
    b
}

/// Random but valid cache histories, one step of events at a time.
pub struct CacheHistory {
    rng: Rng,
    step: u64,
    next: u32,
    /// block -> (parent, users, children)
    blocks: std::collections::BTreeMap<u32, (u32, u32, u32)>,
}

impl CacheHistory {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed, 0),
            step: 0,
            next: 0,
            blocks: Default::default(),
        }
    }

    /// Appends one step of events to `ev` (cleared first).
    pub fn step(&mut self, ev: &mut CacheEvents) {
        use chimera::policy::EventKind;
        ev.clear();
        self.step += 1;
        for _ in 0..1 + self.rng.next_below(12) {
            let ids: Vec<u32> = self.blocks.keys().copied().collect();
            match self.rng.next_below(5) {
                0 | 1 => {
                    let parent = if ids.is_empty() || self.rng.next_below(4) == 0 {
                        u32::MAX
                    } else {
                        ids[self.rng.next_below(ids.len() as u32) as usize]
                    };
                    let id = self.next;
                    self.next += 1;
                    if let Some(p) = self.blocks.get_mut(&parent) {
                        p.2 += 1;
                    }
                    self.blocks.insert(id, (parent, 1, 0));
                    ev.push(EventKind::Stored, id, parent, self.step);
                }
                2 if !ids.is_empty() => {
                    let b = ids[self.rng.next_below(ids.len() as u32) as usize];
                    if let Some(e) = self.blocks.get_mut(&b) {
                        e.1 += 1;
                    }
                    ev.push(EventKind::Hit, b, 0, self.step);
                }
                3 => {
                    let used: Vec<u32> = self
                        .blocks
                        .iter()
                        .filter(|(_, v)| v.1 > 0)
                        .map(|(b, _)| *b)
                        .collect();
                    if !used.is_empty() {
                        let b = used[self.rng.next_below(used.len() as u32) as usize];
                        if let Some(e) = self.blocks.get_mut(&b) {
                            e.1 -= 1;
                            if e.1 == 0 {
                                ev.push(EventKind::Released, b, 0, self.step);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Reports the eviction of `victims` (which must be valid) as `Removed` events.
    pub fn evict(&mut self, victims: &[u32], ev: &mut CacheEvents) {
        use chimera::policy::EventKind;
        ev.clear();
        for v in victims {
            if let Some((parent, users, children)) = self.blocks.remove(v) {
                assert_eq!((users, children), (0, 0), "victim {v} in use or not a leaf");
                if let Some(p) = self.blocks.get_mut(&parent) {
                    p.2 -= 1;
                }
            } else {
                panic!("victim {v} is not cached");
            }
            ev.push(EventKind::Removed, *v, 0, self.step);
        }
    }

    pub fn step_number(&self) -> u64 {
        self.step
    }
}
