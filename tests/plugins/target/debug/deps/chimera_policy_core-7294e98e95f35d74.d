/work/main/tests/plugins/target/debug/deps/chimera_policy_core-7294e98e95f35d74.d: /work/main/plugins/policy-core/src/lib.rs /work/main/plugins/policy-core/src/columns.rs /work/main/plugins/policy-core/src/config.rs /work/main/plugins/policy-core/src/lru.rs /work/main/plugins/policy-core/src/math.rs /work/main/plugins/policy-core/src/rng.rs /work/main/plugins/policy-core/src/router.rs /work/main/plugins/policy-core/src/sampler.rs

/work/main/tests/plugins/target/debug/deps/libchimera_policy_core-7294e98e95f35d74.rlib: /work/main/plugins/policy-core/src/lib.rs /work/main/plugins/policy-core/src/columns.rs /work/main/plugins/policy-core/src/config.rs /work/main/plugins/policy-core/src/lru.rs /work/main/plugins/policy-core/src/math.rs /work/main/plugins/policy-core/src/rng.rs /work/main/plugins/policy-core/src/router.rs /work/main/plugins/policy-core/src/sampler.rs

/work/main/tests/plugins/target/debug/deps/libchimera_policy_core-7294e98e95f35d74.rmeta: /work/main/plugins/policy-core/src/lib.rs /work/main/plugins/policy-core/src/columns.rs /work/main/plugins/policy-core/src/config.rs /work/main/plugins/policy-core/src/lru.rs /work/main/plugins/policy-core/src/math.rs /work/main/plugins/policy-core/src/rng.rs /work/main/plugins/policy-core/src/router.rs /work/main/plugins/policy-core/src/sampler.rs

/work/main/plugins/policy-core/src/lib.rs:
/work/main/plugins/policy-core/src/columns.rs:
/work/main/plugins/policy-core/src/config.rs:
/work/main/plugins/policy-core/src/lru.rs:
/work/main/plugins/policy-core/src/math.rs:
/work/main/plugins/policy-core/src/rng.rs:
/work/main/plugins/policy-core/src/router.rs:
/work/main/plugins/policy-core/src/sampler.rs:
