/work/main/tests/plugins/target/debug/deps/clock_router.d: clock-router/src/lib.rs

/work/main/tests/plugins/target/debug/deps/libclock_router.so: clock-router/src/lib.rs

/work/main/tests/plugins/target/debug/deps/libclock_router.rlib: clock-router/src/lib.rs

clock-router/src/lib.rs:
