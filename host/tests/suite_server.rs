//! Test binary: the HTTP server over loopback (the mock executor and real models), the real
//! stack end to end (`e2e_real`), and the `chimera bench` client. See `suite_engine.rs` for
//! why the integration tests are grouped; `cargo test -p chimera --test suite_server
//! server_router::` runs one file's tests.

// The shared helpers are test code, like the files that declared them before.
#![allow(clippy::unwrap_used)]

mod plugins_support;
mod server_support;

#[path = "bench.rs"]
mod bench;
#[path = "e2e_real.rs"]
mod e2e_real;
#[path = "server_api.rs"]
mod server_api;
#[path = "server_engine.rs"]
mod server_engine;
#[path = "server_errors.rs"]
mod server_errors;
#[path = "server_lifecycle.rs"]
mod server_lifecycle;
#[path = "server_load.rs"]
mod server_load;
#[path = "server_multiturn.rs"]
mod server_multiturn;
#[path = "server_openai_py.rs"]
mod server_openai_py;
#[path = "server_router.rs"]
mod server_router;
