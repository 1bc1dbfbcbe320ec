//! Plugin integration tests: built-in Wasm plugins against their native twins, a custom
//! plugin built outside the workspace, deliberately broken plugins and the fallback path,
//! ABI version checks, reload, and `check_plugin`.

use crate::plugins_support;

use std::process::Command;
use std::sync::Arc;

use chimera::plugins::{
    FallbackReason, Grants, PluginError, PluginKind, PluginMetrics, PluginsConfig, PolicyConfig,
    PolicyPlugins, PolicySpec, check_plugin,
};
use chimera::policy::native::{DefaultSampler, LeastLoadedRouter, LruEvictor, PrefixAwareRouter};
use chimera::policy::{
    CacheEvents, Decision, Evictor, ReplicaColumns, RouteRequest, Router, Sampler,
};
use chimera_policy_core::Config;
use chimera_policy_core::rng::Rng;
use plugins_support::*;

fn spec(plugin: &str, config: &str) -> PolicySpec {
    PolicySpec {
        plugin: plugin.into(),
        config: toml::from_str(config).expect("config table"),
        grants: Vec::new(),
    }
}

fn policies_with(router: PolicySpec, limits: PluginsConfig) -> (PolicyPlugins, Arc<PluginMetrics>) {
    let metrics = PluginMetrics::new();
    let policy = PolicyConfig {
        router,
        ..PolicyConfig::default()
    };
    let p = PolicyPlugins::new(&policy, &limits, metrics.clone()).expect("load policies");
    (p, metrics)
}

fn fallbacks(metrics: &PluginMetrics, plugin: &str, reason: FallbackReason) -> u64 {
    metrics
        .fallback_samples()
        .iter()
        .filter(|s| s.plugin == plugin && s.reason == reason.as_str())
        .map(|s| s.value)
        .sum()
}

fn total_fallbacks(metrics: &PluginMetrics) -> u64 {
    metrics.fallback_samples().iter().map(|s| s.value).sum()
}

// ---------------------------------------------------------------------------------------------
// Built-in plugins agree with their native twins
// ---------------------------------------------------------------------------------------------

#[test]
fn builtin_routers_agree_with_native_twins() {
    for (name, config) in [
        ("least-loaded", ""),
        ("prefix-aware", ""),
        ("prefix-aware", "alpha = 0.3\nsaturation_waiting = 3"),
    ] {
        let (p, metrics) = policies_with(
            spec(&format!("builtin:{name}"), config),
            PluginsConfig::default(),
        );
        let mut wasm = p.router();
        let cfg = PolicySpec {
            plugin: String::new(),
            config: toml::from_str(config).unwrap(),
            grants: Vec::new(),
        }
        .flat_config("policy.router")
        .unwrap();
        let mut native: Box<dyn Router> = match name {
            "least-loaded" => Box::new(LeastLoadedRouter::from_config(&cfg).unwrap()),
            _ => Box::new(PrefixAwareRouter::from_config(&cfg).unwrap()),
        };
        let mut rng = Rng::new(11, 0);
        for i in 0..2000 {
            let cols = random_replicas(&mut rng, 1 + (i % 16));
            let req = random_request(&mut rng);
            assert_eq!(
                wasm.route(&req, &cols),
                native.route(&req, &cols),
                "{name} input {i}"
            );
        }
        assert_eq!(
            total_fallbacks(&metrics),
            0,
            "every answer came from the Wasm build"
        );
        assert_eq!(
            metrics
                .counters(&format!("builtin:{name}"), PluginKind::Router)
                .calls(),
            2000
        );
    }
}

#[test]
fn builtin_sampler_agrees_with_native_twin() {
    let metrics = PluginMetrics::new();
    let p = PolicyPlugins::new(
        &PolicyConfig::default(),
        &PluginsConfig::default(),
        metrics.clone(),
    )
    .unwrap();
    let mut wasm = p.sampler();
    let mut native = DefaultSampler::default();
    let mut rng = Rng::new(5, 0);
    for i in 0..300 {
        let k = 1 + (i % 64);
        let batch = random_batch(&mut rng, 1 + (i % 40), k);
        assert_eq!(wasm.sample(&batch), native.sample(&batch), "batch {i}");
    }
    assert_eq!(total_fallbacks(&metrics), 0);
}

#[test]
fn builtin_lru_agrees_with_native_twin_over_a_cache_history() {
    let metrics = PluginMetrics::new();
    let p = PolicyPlugins::new(
        &PolicyConfig::default(),
        &PluginsConfig::default(),
        metrics.clone(),
    )
    .unwrap();
    let mut wasm = p.evictor();
    let mut native = LruEvictor::new();
    let mut history = CacheHistory::new(99);
    let mut ev = CacheEvents::default();
    let mut evicted = 0;
    for step in 0..600 {
        history.step(&mut ev);
        wasm.on_events(&ev);
        native.on_events(&ev);
        if step % 3 == 0 {
            let count = (step % 7) as u32;
            let a = wasm.choose_victims(count, history.step_number());
            let b = native.choose_victims(count, history.step_number());
            assert_eq!(a, b, "step {step}");
            if let Decision::Use(victims) = a {
                evicted += victims.len();
                history.evict(&victims, &mut ev);
                wasm.on_events(&ev);
                native.on_events(&ev);
            }
        }
    }
    assert!(evicted > 50, "the history evicted only {evicted} blocks");
    assert_eq!(total_fallbacks(&metrics), 0);
}

// ---------------------------------------------------------------------------------------------
// A custom plugin built outside the workspace
// ---------------------------------------------------------------------------------------------

#[test]
fn custom_pin_router_changes_routing() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("pin_router.wasm");
    let (p, metrics) = policies_with(
        spec(path.to_str().unwrap(), "replica = 2"),
        PluginsConfig::default(),
    );
    let mut router = p.router();
    let mut rng = Rng::new(3, 0);
    let mut native = PrefixAwareRouter::default();
    let mut differs = 0;
    for _ in 0..200 {
        let cols = random_replicas(&mut rng, 4);
        let req = random_request(&mut rng);
        assert_eq!(router.route(&req, &cols), Decision::Use(2));
        differs += usize::from(native.route(&req, &cols) != Decision::Use(2));
    }
    assert!(
        differs > 50,
        "the default would also have picked replica 2 ({differs} differ)"
    );
    // Two replicas only: the plugin declines and the default (prefix-aware) answers.
    let cols = random_replicas(&mut rng, 2);
    let req = random_request(&mut rng);
    assert_eq!(router.route(&req, &cols), native.route(&req, &cols));
    assert_eq!(
        fallbacks(&metrics, path.to_str().unwrap(), FallbackReason::Declined),
        1
    );

    let report = check_plugin(&path, &Config::default()).unwrap();
    assert_eq!(report.kind, PluginKind::Router);
    assert_eq!(report.abi.to_string(), "0.2.0");
    assert!(report.componentized);
    assert!(report.ok(), "{report}");
    let text = report.to_string();
    assert!(
        text.contains("routing@0.2.0") && text.contains("replica 0"),
        "{text}"
    );
}

#[test]
fn bad_config_is_rejected_with_the_plugin_message() {
    let metrics = PluginMetrics::new();
    let policy = PolicyConfig {
        router: spec("builtin:prefix-aware", "alpha = 2.0"),
        ..PolicyConfig::default()
    };
    let err = PolicyPlugins::new(&policy, &PluginsConfig::default(), metrics.clone())
        .err()
        .expect("must fail");
    let text = err.to_string();
    assert!(text.contains("alpha") && text.contains("[0, 1]"), "{text}");

    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("misbehave_router.wasm");
    let policy = PolicyConfig {
        router: spec(path.to_str().unwrap(), "reject = true"),
        ..PolicyConfig::default()
    };
    let err = PolicyPlugins::new(&policy, &PluginsConfig::default(), metrics)
        .err()
        .expect("must fail");
    assert!(matches!(err, PluginError::Init { .. }), "{err}");
    assert!(
        err.to_string().contains("configured to reject its config"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Misbehaving plugins fall back, are counted, and the host keeps serving
// ---------------------------------------------------------------------------------------------

#[test]
fn misbehaving_router_falls_back_and_recovers() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("misbehave_router.wasm");
    let name = path.to_str().unwrap().to_string();
    let limits = PluginsConfig {
        deadline_ms: 50,
        memory_bytes: 16 << 20,
        max_instances: 8,
        ..PluginsConfig::default()
    };
    let (p, metrics) = policies_with(spec(&name, "replica = 3"), limits);
    let mut router = p.router();
    let mut native = PrefixAwareRouter::default();
    let mut rng = Rng::new(8, 0);
    let cols: ReplicaColumns = random_replicas(&mut rng, 5);
    let good = RouteRequest {
        tenant: "good".into(),
        ..random_request(&mut rng)
    };
    assert_eq!(router.route(&good, &cols), Decision::Use(3));

    for (tenant, reason) in [
        ("trap", FallbackReason::Trap),
        ("loop", FallbackReason::Timeout),
        ("bomb", FallbackReason::Memory),
        ("wrong", FallbackReason::Invalid),
        ("decline", FallbackReason::Declined),
    ] {
        let req = RouteRequest {
            tenant: tenant.into(),
            ..good.clone()
        };
        let started = std::time::Instant::now();
        assert_eq!(
            router.route(&req, &cols),
            native.route(&req, &cols),
            "{tenant}: native answer"
        );
        assert!(
            started.elapsed().as_secs() < 5,
            "{tenant} took {:?}",
            started.elapsed()
        );
        assert_eq!(
            fallbacks(&metrics, &name, reason),
            1,
            "{tenant} counted as {reason}"
        );
        // The next well-behaved call is answered by the plugin again (a new instance after a
        // trap, timeout or memory failure).
        assert_eq!(
            router.route(&good, &cols),
            Decision::Use(3),
            "recovered after {tenant}"
        );
    }
    let mut text = String::new();
    metrics.render_prometheus(&mut text);
    assert!(
        text.contains(&format!(
            "chimera:plugin_fallbacks_total{{plugin=\"{name}\",kind=\"router\",reason=\"timeout\"}} 1"
        )),
        "{text}"
    );
}

#[test]
fn plugin_failing_every_call_is_quarantined_then_tried_again() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("misbehave_router.wasm");
    let name = path.to_str().unwrap().to_string();
    let deadline_ms = 20;
    let limits = PluginsConfig {
        deadline_ms,
        memory_bytes: 16 << 20,
        max_instances: 8,
        ..PluginsConfig::default()
    };
    let (p, metrics) = policies_with(spec(&name, "replica = 3"), limits);
    let mut router = p.router();
    let mut native = PrefixAwareRouter::default();
    let mut rng = Rng::new(9, 0);
    let cols: ReplicaColumns = random_replicas(&mut rng, 5);
    let good = RouteRequest {
        tenant: "good".into(),
        ..random_request(&mut rng)
    };
    let looping = RouteRequest {
        tenant: "loop".into(),
        ..good.clone()
    };
    let want = native.route(&looping, &cols);

    // Three timeouts in a row start a quarantine.
    for _ in 0..3 {
        assert_eq!(router.route(&looping, &cols), want);
    }
    assert_eq!(fallbacks(&metrics, &name, FallbackReason::Timeout), 3);
    // While quarantined the plugin is not called: the next 20 calls are answered natively
    // without running into the deadline. (A stall on a busy machine may end a quarantine
    // early; three more timeouts then start a longer one. Without quarantine all 20 would
    // time out.)
    for _ in 0..20 {
        assert_eq!(router.route(&looping, &cols), want);
    }
    let timeouts = fallbacks(&metrics, &name, FallbackReason::Timeout);
    let skipped = fallbacks(&metrics, &name, FallbackReason::Quarantined);
    assert!(timeouts <= 3 + 6, "{timeouts} timeouts");
    assert_eq!(
        skipped + (timeouts - 3),
        20,
        "every call is either skipped or timed out"
    );
    // Good requests are answered natively too while it lasts...
    assert_eq!(router.route(&good, &cols), native.route(&good, &cols));
    // ...and by a fresh instance of the plugin once it is over: poll until the plugin's own
    // answer (replica 3) comes back. Quarantines last 100 ms and then double; a fresh one
    // after the last timeouts above ends well within the deadline.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while router.route(&good, &cols) != Decision::Use(3) {
        assert!(
            std::time::Instant::now() < until,
            "the plugin was never called again after its quarantine"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let mut text = String::new();
    metrics.render_prometheus(&mut text);
    assert!(text.contains("reason=\"quarantined\""), "{text}");
}

#[test]
fn host_functions_load_only_with_their_grants_and_work() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("clock_router.wasm");
    let name = path.to_str().unwrap().to_string();
    let load = |grants: &[&str]| {
        let mut s = spec(&name, "switch_after_ms = 400");
        s.grants = grants.iter().map(|g| g.to_string()).collect();
        let policy = PolicyConfig {
            router: s,
            ..PolicyConfig::default()
        };
        PolicyPlugins::new(&policy, &PluginsConfig::default(), PluginMetrics::new())
    };
    // Without a grant the plugin is refused at load, naming the function and the grant.
    for (grants, missing) in [
        (&[][..], None),
        (&["clock"][..], Some("log")),
        (&["log"][..], Some("clock")),
    ] {
        let err = load(grants)
            .err()
            .expect("refused without every grant")
            .to_string();
        assert!(err.contains("grants = ["), "{err}");
        if let Some(g) = missing {
            assert!(err.contains(&format!("[\"{g}\"]")), "{grants:?}: {err}");
        }
    }
    let err = load(&["clock", "filesystem"])
        .err()
        .expect("unknown grant")
        .to_string();
    assert!(
        err.contains("policy.router.grants.1") && err.contains("filesystem"),
        "{err}"
    );
    // With both it loads, and its clock moves: replica 0 first, replica 1 after 400 ms.
    // Before the plugin's `init` reads the clock, so every elapsed time below is an upper
    // bound of the plugin's own.
    let loaded = std::time::Instant::now();
    let p = load(&["clock", "log"]).expect("loads with its grants");
    let mut router = p.router();
    let mut rng = Rng::new(5, 0);
    let cols = random_replicas(&mut rng, 3);
    let req = random_request(&mut rng);
    assert_eq!(router.route(&req, &cols), Decision::Use(0));
    // Poll until it switches: never before 400 ms on the host's clock, and within seconds.
    let switched = loop {
        let d = router.route(&req, &cols);
        let elapsed = loaded.elapsed();
        if d == Decision::Use(1) {
            break elapsed;
        }
        assert_eq!(d, Decision::Use(0), "after {elapsed:?}");
        assert!(
            elapsed < std::time::Duration::from_secs(10),
            "never switched"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert!(
        switched >= std::time::Duration::from_millis(400),
        "switched after {switched:?}"
    );
    let report = check_plugin(&path, &Config::default()).unwrap();
    assert_eq!(report.abi.to_string(), "0.2.0");
    let text = report.to_string();
    assert!(
        text.contains("host.now-ns (needs grants = [\"clock\"])"),
        "{text}"
    );
}

#[test]
fn plugin_whose_init_traps_is_refused_at_load() {
    let dir = std::env::temp_dir().join(format!("chimera-dummy-plugins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let evictor = dir.join("evictor.wasm");
    let sampler = dir.join("sampler.wasm");
    std::fs::write(&evictor, dummy_plugin("evictor", "0.1.0")).unwrap();
    std::fs::write(&sampler, dummy_plugin("sampler", "0.1.0")).unwrap();
    // Every function of a dummy plugin traps, `init` included: loading must fail cleanly.
    let metrics = PluginMetrics::new();
    let policy = PolicyConfig {
        evictor: spec(evictor.to_str().unwrap(), ""),
        ..PolicyConfig::default()
    };
    let err = PolicyPlugins::new(&policy, &PluginsConfig::default(), metrics)
        .err()
        .expect("init traps");
    assert!(matches!(err, PluginError::Instantiate { .. }), "{err}");
    let policy = PolicyConfig {
        sampler: spec(sampler.to_str().unwrap(), ""),
        ..PolicyConfig::default()
    };
    assert!(PolicyPlugins::new(&policy, &PluginsConfig::default(), PluginMetrics::new()).is_err());
}

#[test]
fn misbehaving_evictor_falls_back_and_its_state_is_rebuilt_after_a_trap() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("misbehave_evictor.wasm");
    let name = path.to_str().unwrap().to_string();
    let metrics = PluginMetrics::new();
    let policy = PolicyConfig {
        evictor: spec(&name, ""),
        ..PolicyConfig::default()
    };
    let p = PolicyPlugins::new(&policy, &PluginsConfig::default(), metrics.clone()).unwrap();
    let mut wasm = p.evictor();
    let mut native = LruEvictor::new();
    let mut history = CacheHistory::new(4);
    let mut ev = CacheEvents::default();
    for _ in 0..200 {
        history.step(&mut ev);
        wasm.on_events(&ev);
        native.on_events(&ev);
    }
    assert!(
        native.evictable_leaves() > 15,
        "history too small: {}",
        native.evictable_leaves()
    );
    let step = history.step_number();
    for (count, reason) in [
        (13, FallbackReason::Trap),
        (14, FallbackReason::Invalid),
        (15, FallbackReason::Invalid),
    ] {
        assert_eq!(
            wasm.choose_victims(count, step),
            native.choose_victims(count, step),
            "count {count}"
        );
        assert!(
            fallbacks(&metrics, &name, reason) >= 1,
            "count {count} counted as {reason}"
        );
        // Well-behaved calls after the failure agree with the native LRU: after the trap the
        // new instance must have been given the whole cache state again.
        for c in [1, 5, 9] {
            assert_eq!(
                wasm.choose_victims(c, step),
                native.choose_victims(c, step),
                "after {count}"
            );
        }
    }
    assert_eq!(fallbacks(&metrics, &name, FallbackReason::Trap), 1);
    assert_eq!(fallbacks(&metrics, &name, FallbackReason::Invalid), 2);
}

#[test]
fn misbehaving_sampler_falls_back_to_the_native_sampler() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let path = test_plugins.join("misbehave_sampler.wasm");
    let name = path.to_str().unwrap().to_string();
    let metrics = PluginMetrics::new();
    let policy = PolicyConfig {
        sampler: spec(&name, ""),
        ..PolicyConfig::default()
    };
    let p = PolicyPlugins::new(&policy, &PluginsConfig::default(), metrics.clone()).unwrap();
    let mut wasm = p.sampler();
    let mut native = DefaultSampler::default();
    let mut rng = Rng::new(77, 0);
    for (seed, reason) in [
        (13, FallbackReason::Trap),
        (14, FallbackReason::Invalid),
        (15, FallbackReason::Invalid),
    ] {
        let mut batch = random_batch(&mut rng, 8, 16);
        batch.seed[0] = seed;
        assert_eq!(wasm.sample(&batch), native.sample(&batch), "seed {seed}");
        assert!(
            fallbacks(&metrics, &name, reason) >= 1,
            "seed {seed} counted as {reason}"
        );
        // The next good batch is answered by the plugin (a new instance after the trap).
        let good = random_batch(&mut rng, 8, 16);
        assert_eq!(wasm.sample(&good), native.sample(&good));
    }
    assert_eq!(
        total_fallbacks(&metrics),
        3,
        "good batches were answered by the plugin"
    );
    assert_eq!(fallbacks(&metrics, &name, FallbackReason::Trap), 1);
    assert_eq!(fallbacks(&metrics, &name, FallbackReason::Invalid), 2);
}

#[test]
fn plugin_reloaded_while_serving_swaps_at_the_next_call_and_bad_reload_keeps_old() {
    let (p, metrics) = policies_with(spec("builtin:least-loaded", ""), PluginsConfig::default());
    let mut router = p.router();
    let mut rng = Rng::new(21, 0);
    let cols = random_replicas(&mut rng, 6);
    let req = random_request(&mut rng);
    let before = router.route(&req, &cols);
    assert_eq!(before, LeastLoadedRouter.route(&req, &cols));

    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let wasm = std::fs::read(test_plugins.join("pin_router.wasm")).unwrap();
    let cfg = spec("x.wasm", "replica = 5")
        .flat_config("policy.router")
        .unwrap();
    // Compile off the serving thread, as the admin endpoint would.
    let reloaded = std::thread::scope(|s| {
        s.spawn(|| p.reload(PluginKind::Router, "pin-router", &wasm, &cfg, Grants::NONE))
            .join()
            .unwrap()
    });
    assert!(reloaded.is_ok());
    assert_eq!(router.route(&req, &cols), Decision::Use(5));

    // A broken reload (not Wasm, wrong kind, bad config) is refused; the pin router stays.
    assert!(matches!(
        p.reload(
            PluginKind::Router,
            "junk",
            b"not wasm",
            &Config::default(),
            Grants::NONE
        ),
        Err(PluginError::NotWasm { .. })
    ));
    let lru = chimera::plugins::builtin::find(PluginKind::Evictor, "lru").unwrap();
    assert!(matches!(
        p.reload(
            PluginKind::Router,
            "lru",
            lru.wasm,
            &Config::default(),
            Grants::NONE
        ),
        Err(PluginError::WrongKind { .. })
    ));
    let bad_cfg = spec("x.wasm", "replica = 5000")
        .flat_config("policy.router")
        .unwrap();
    assert!(matches!(
        p.reload(PluginKind::Router, "pin", &wasm, &bad_cfg, Grants::NONE),
        Err(PluginError::Init { .. })
    ));
    assert_eq!(router.route(&req, &cols), Decision::Use(5));
    assert_eq!(total_fallbacks(&metrics), 0);
}

// ---------------------------------------------------------------------------------------------
// ABI versions and `check_plugin`
// ---------------------------------------------------------------------------------------------

#[test]
fn wrong_abi_version_is_refused_at_load_naming_both_versions() {
    let dir = std::env::temp_dir().join(format!("chimera-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for version in ["0.9.0", "1.0.0", "0.0.4"] {
        let path = dir.join(format!("router-{version}.wasm"));
        std::fs::write(&path, dummy_plugin("router", version)).unwrap();
        let err = check_plugin(&path, &Config::default())
            .err()
            .unwrap_or_else(|| panic!("must be refused"));
        let text = err.to_string();
        assert!(matches!(err, PluginError::AbiVersion { .. }), "{text}");
        assert!(
            text.contains(version) && text.contains(">=0.1.0, <0.3.0"),
            "{text}"
        );
        let policy = PolicyConfig {
            router: spec(path.to_str().unwrap(), ""),
            ..PolicyConfig::default()
        };
        assert!(
            PolicyPlugins::new(&policy, &PluginsConfig::default(), PluginMetrics::new()).is_err()
        );
    }
    // A later patch of the accepted minor loads (its init traps, which check reports).
    let path = dir.join("router-0.1.9.wasm");
    std::fs::write(&path, dummy_plugin("router", "0.1.9")).unwrap();
    let report = check_plugin(&path, &Config::default()).expect("0.1.9 is accepted");
    assert_eq!(report.abi.to_string(), "0.1.9");
    assert!(report.init.is_err() && !report.ok(), "{report}");
}

#[test]
fn check_reports_every_builtin() {
    let dir = std::env::temp_dir().join(format!("chimera-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for b in chimera::plugins::builtin::BUILTINS {
        let path = dir.join(format!("{}.wasm", b.name));
        std::fs::write(&path, b.wasm).unwrap();
        let report = check_plugin(&path, &Config::default()).unwrap();
        assert_eq!(report.kind, b.kind);
        assert!(report.ok(), "{report}");
        // Built against ABI 0.2.0 and calling no host function: they need no grant.
        assert_eq!(report.abi.to_string(), "0.2.0");
        assert!(report.host_functions.is_empty(), "{report}");
    }
    let junk = dir.join("junk.wasm");
    std::fs::write(&junk, b"\0asm\x01\0\0\0garbage").unwrap();
    assert!(check_plugin(&junk, &Config::default()).is_err());
    assert!(matches!(
        check_plugin(dir.join("missing.wasm"), &Config::default()),
        Err(PluginError::Io { .. })
    ));
}

/// `chimera plugin check FILE --config TOML` as an author runs it: a good plugin and config
/// pass with the ABI version and timing shown; a plugin that traps in its dry call, a config
/// the plugin rejects and TOML that does not parse each fail with the reason.
#[test]
fn plugin_check_dry_runs_a_plugin_with_a_given_config() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let plugin = test_plugins.join("misbehave_router.wasm");
    let check = |config: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_chimera"))
            .args(["plugin", "check"])
            .arg(&plugin)
            .args(["--config", config])
            .env_remove("RUST_LOG")
            .output()
            .expect("run chimera");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };

    let (ok, text) = check("{ replica = 2 }");
    assert!(ok, "{text}");
    for want in [
        "kind:      router",
        "abi:       0.2.0",
        "init:      ok with config { replica = 2 }",
        "-> replica 2",
        "µs incl. instantiation",
        "verdict:   ok",
    ] {
        assert!(text.contains(want), "missing {want:?}:\n{text}");
    }

    // The same config from a file of `key = value` lines.
    let dir = std::env::temp_dir().join(format!("chimera-check-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("router.toml");
    std::fs::write(&file, "replica = 1\n").unwrap();
    let (ok, text) = check(file.to_str().unwrap());
    assert!(ok && text.contains("-> replica 1"), "{text}");

    // A plugin whose call traps: reported, and the command fails.
    let (ok, text) = check(r#"{ tenant = "trap" }"#);
    assert!(!ok, "{text}");
    assert!(text.contains("dry call:  FAILED"), "{text}");
    assert!(text.contains("trap"), "{text}");
    assert!(text.contains("not usable with this config"), "{text}");

    // A config the plugin rejects.
    let (ok, text) = check("{ reject = true }");
    assert!(!ok, "{text}");
    assert!(
        text.contains("init:      rejected config { reject = true }: ")
            && text.contains("configured to reject its config"),
        "{text}"
    );
    let (ok, text) = check("{ colour = 3 }");
    assert!(!ok && text.contains("unknown key `colour`"), "{text}");

    // TOML that does not parse never reaches the plugin.
    let (ok, text) = check("{ replica = ");
    assert!(!ok, "{text}");
    assert!(text.contains("--config: not a TOML table"), "{text}");
    assert!(!text.contains("kind:"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The plugin crates `plugin-sdk/README.md` shows (router, sampler, evictor) build as an author
/// would build them: each alone in a folder outside the repository, depending on the SDK by
/// the README's `git` line pointed at a local clone of this repository; each result loads,
/// is of its section's kind and passes `check_plugin`.
#[test]
fn sdk_readme_plugins_build_outside_the_repo_from_a_git_dependency() {
    let Some(test_plugins) = test_plugins_dir() else {
        return;
    };
    let readme = std::fs::read_to_string(repo_root().join("plugin-sdk/README.md")).unwrap();
    let block = |section: &str, lang: &str| -> String {
        let start = section
            .find(&format!("```{lang}\n"))
            .unwrap_or_else(|| panic!("no {lang} block in {section}"));
        let body = &section[start + lang.len() + 4..];
        body[..body.find("```").expect("closing fence")].to_string()
    };
    let examples: Vec<(&str, String, String)> = readme
        .split("\n## ")
        .filter(|s| s.starts_with("A complete"))
        .map(|s| {
            let heading = s.lines().next().unwrap_or_default();
            let kind = heading.rsplit(' ').next().unwrap_or_default();
            (kind, block(s, "toml"), block(s, "rust"))
        })
        .collect();
    let kinds: Vec<&str> = examples.iter().map(|e| e.0).collect();
    assert_eq!(kinds, ["router", "sampler", "evictor"]);

    let dir = std::env::temp_dir().join(format!("chimera-sdk-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A clone of the committed repository, reachable only through its git URL.
    let clone = dir.join("chimera.git");
    let status = Command::new("git")
        .args(["clone", "--quiet", "--bare"])
        .arg(repo_root())
        .arg(&clone)
        .status()
        .expect("run git");
    assert!(status.success(), "git clone failed");
    let url = format!("file://{}", clone.display());
    // Beside the test plugins' target folder (`<target>/test-plugins/wasm32-…/release`), not
    // in it: the README's router has the name of a test plugin.
    let target_dir = test_plugins
        .ancestors()
        .nth(3)
        .expect("the cargo target folder")
        .join("test-plugins-readme");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for (kind, manifest, code) in &examples {
        let line = manifest
            .lines()
            .find(|l| l.starts_with("chimera-plugin-sdk"))
            .expect("SDK dependency line");
        assert!(
            line.contains("git = \"") && !line.contains("path ="),
            "{kind}: the README's dependency must not be a path: {line}"
        );
        let readme_url = line.split('"').nth(1).expect("git URL");
        let name = manifest
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
            .expect("package name");
        let krate = dir.join(name);
        std::fs::create_dir_all(krate.join("src")).unwrap();
        std::fs::write(krate.join("Cargo.toml"), manifest.replace(readme_url, &url)).unwrap();
        std::fs::write(krate.join("src/lib.rs"), code).unwrap();
        // The versions the repository's test plugins are locked to (all in the local cache).
        std::fs::copy(
            repo_root().join("tests/plugins/Cargo.lock"),
            krate.join("Cargo.lock"),
        )
        .unwrap();
        let status = Command::new(&cargo)
            .current_dir(&krate)
            .args([
                "build",
                "--quiet",
                "--release",
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
        assert!(
            status.success(),
            "{kind}: building the README's {name} failed"
        );
        let wasm = target_dir
            .join("wasm32-unknown-unknown/release")
            .join(format!("{}.wasm", name.replace('-', "_")));
        let report = check_plugin(&wasm, &Config::default()).expect("loads");
        assert_eq!(report.kind.section(), *kind, "{report}");
        assert!(report.ok(), "{report}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The constraint and parser kinds exist from ABI 0.2.0 on: a component exporting one of their
/// interfaces under an 0.1.x version is refused at load, naming the version that defines it;
/// under 0.2.0 it passes the ABI checks (and is refused only because its dummy `init` traps).
#[test]
fn agent_kinds_load_only_from_the_abi_that_defines_them() {
    let dir = std::env::temp_dir().join(format!("chimera-agent-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (world, interface) in [("constraint", "constraining"), ("parser", "parsing")] {
        let early = dir.join(format!("{world}-0.1.5.wasm"));
        std::fs::write(&early, dummy_plugin_of("0.2.0", world, "0.1.5")).unwrap();
        let err = check_plugin(&early, &Config::default()).expect_err("refused");
        let text = err.to_string();
        assert!(matches!(err, PluginError::Exports { .. }), "{text}");
        assert!(text.contains(interface) && text.contains("0.2.0"), "{text}");

        let current = dir.join(format!("{world}-0.2.0.wasm"));
        std::fs::write(&current, dummy_plugin_of("0.2.0", world, "0.2.0")).unwrap();
        match check_plugin(&current, &Config::default()) {
            Ok(report) => {
                assert_eq!(report.abi.to_string(), "0.2.0");
                assert!(!report.ok(), "a dummy's init cannot succeed: {report}");
            }
            Err(e) => assert!(
                !matches!(
                    e,
                    PluginError::Exports { .. } | PluginError::AbiVersion { .. }
                ),
                "{e}"
            ),
        }
    }
}
