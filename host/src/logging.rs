//! Process-wide logging for the `chimera` binary: `tracing` events to stderr, as text or as
//! JSON lines.
//!
//! Owns: the log filter (`RUST_LOG` when set, `info` otherwise, with wasmtime's and
//! Cranelift's compiler chatter held at `warn` unless `RUST_LOG` names them), the output format
//! (`--log-format text|json`), and colour (ANSI codes only when stderr is a terminal and
//! `NO_COLOR` is unset, so a log redirected to a file or a collector stays plain text). It must
//! not be called by library code: tests and embedders install their own subscriber.

use std::io::IsTerminal;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields), for log collectors.
    Json,
}

/// Crates whose debug and info events describe compiling plugins, not serving: kept at `warn`
/// unless the filter names them.
pub const QUIET_TARGETS: [&str; 2] = ["wasmtime", "cranelift"];

/// The filter directives for a `RUST_LOG` value (`None`: unset).
pub fn filter_directives(rust_log: Option<&str>) -> String {
    let base = rust_log
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or("info");
    let mut directives = base.to_string();
    for target in QUIET_TARGETS {
        // A directive's target matches every target that starts with it (`cranelift` covers
        // `cranelift_codegen`, `wasmtime` covers `wasmtime_cranelift`).
        if !base.contains(target) {
            directives.push_str(&format!(",{target}=warn"));
        }
    }
    directives
}

/// Whether log lines may carry ANSI colour codes.
pub fn use_colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber. An invalid `RUST_LOG` is an error that says so.
pub fn init(format: LogFormat) -> anyhow::Result<()> {
    let rust_log = std::env::var("RUST_LOG").ok();
    let directives = filter_directives(rust_log.as_deref());
    let filter = tracing_subscriber::EnvFilter::builder()
        .parse(&directives)
        .map_err(|e| anyhow::anyhow!("RUST_LOG={directives:?}: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let done = match format {
        LogFormat::Text => builder.with_ansi(use_colour()).try_init(),
        LogFormat::Json => builder
            .json()
            .with_ansi(false)
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
    done.map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiler_chatter_is_quiet_unless_asked_for() {
        assert_eq!(filter_directives(None), "info,wasmtime=warn,cranelift=warn");
        assert_eq!(
            filter_directives(Some("chimera=debug")),
            "chimera=debug,wasmtime=warn,cranelift=warn"
        );
        assert_eq!(
            filter_directives(Some("debug,cranelift_codegen=info")),
            "debug,cranelift_codegen=info,wasmtime=warn"
        );
        assert_eq!(
            filter_directives(Some(" ")),
            "info,wasmtime=warn,cranelift=warn"
        );
    }

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn debug_for_everything_still_drops_cranelift_and_wasmtime_debug_lines() {
        let buf = Buffer::default();
        let filter = tracing_subscriber::EnvFilter::builder()
            .parse(filter_directives(Some("debug")))
            .unwrap();
        let w = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::debug!(target: "cranelift_codegen::timing", "noise one");
            tracing::info!(target: "wasmtime_cranelift::compiler", "noise two");
            tracing::warn!(target: "wasmtime::runtime", "a real warning");
            tracing::debug!(target: "chimera::server::pipeline", "request finished");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("noise"), "{text}");
        assert!(text.contains("a real warning"), "{text}");
        assert!(text.contains("request finished"), "{text}");
    }
}
