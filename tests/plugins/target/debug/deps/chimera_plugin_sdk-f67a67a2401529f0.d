/work/main/tests/plugins/target/debug/deps/chimera_plugin_sdk-f67a67a2401529f0.d: /work/main/plugin-sdk/src/lib.rs /work/main/plugin-sdk/src/testing.rs

/work/main/tests/plugins/target/debug/deps/libchimera_plugin_sdk-f67a67a2401529f0.rlib: /work/main/plugin-sdk/src/lib.rs /work/main/plugin-sdk/src/testing.rs

/work/main/tests/plugins/target/debug/deps/libchimera_plugin_sdk-f67a67a2401529f0.rmeta: /work/main/plugin-sdk/src/lib.rs /work/main/plugin-sdk/src/testing.rs

/work/main/plugin-sdk/src/lib.rs:
/work/main/plugin-sdk/src/testing.rs:
