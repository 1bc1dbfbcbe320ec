/work/main/tests/plugins/target/debug/deps/clock_router-c6bdbd86ac114731.d: clock-router/src/lib.rs

/work/main/tests/plugins/target/debug/deps/clock_router-c6bdbd86ac114731: clock-router/src/lib.rs

clock-router/src/lib.rs:
