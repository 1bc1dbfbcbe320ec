//! Counters of plugin calls, fallbacks and call latencies, readable by the server's `/metrics`.
//!
//! One [`PluginCounters`] per plugin name and kind (shared by all its instances, across
//! replicas), kept in a [`PluginMetrics`] registry. The hot path touches only atomics in counters it already
//! holds; the registry's lock is taken when an adapter is created and when metrics are read.
//! Each fallback reason is logged once per plugin, then only counted.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::PluginKind;
use crate::histogram::{Histogram, PLUGIN_BUCKETS};

/// Prometheus name of the fallback counter (labels `plugin`, `kind`, `reason`).
pub const FALLBACKS_METRIC: &str = "chimera:plugin_fallbacks_total";
/// Prometheus name of the plugin call counter (labels `plugin`, `kind`).
pub const CALLS_METRIC: &str = "chimera:plugin_calls_total";
/// Prometheus name of the histogram of calls into a plugin instance (labels `plugin`, `kind`):
/// every call that reached the plugin (route, sample, choose-victims, cache events), timed on
/// the thread that made it.
pub const LATENCY_METRIC: &str = "chimera:plugin_call_latency_seconds";

/// Why a call's answer came from the native default instead of the plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// The plugin trapped (panic, unreachable, out-of-bounds access...).
    Trap,
    /// The call ran past its deadline.
    Timeout,
    /// The plugin tried to grow its memory past the limit.
    Memory,
    /// The answer was malformed or not allowed (index out of range, victim in use...).
    Invalid,
    /// The plugin answered "use the default".
    Declined,
    /// No instance could be created (instantiation or `init` failed after a trap or reload).
    Unavailable,
    /// Not called: the plugin is quarantined after failing several calls in a row.
    Quarantined,
}

impl FallbackReason {
    pub const ALL: [FallbackReason; 7] = [
        FallbackReason::Trap,
        FallbackReason::Timeout,
        FallbackReason::Memory,
        FallbackReason::Invalid,
        FallbackReason::Declined,
        FallbackReason::Unavailable,
        FallbackReason::Quarantined,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::Trap => "trap",
            FallbackReason::Timeout => "timeout",
            FallbackReason::Memory => "memory",
            FallbackReason::Invalid => "invalid",
            FallbackReason::Declined => "declined",
            FallbackReason::Unavailable => "unavailable",
            FallbackReason::Quarantined => "quarantined",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counters of one plugin.
#[derive(Debug)]
pub struct PluginCounters {
    plugin: String,
    kind: PluginKind,
    calls: AtomicU64,
    fallbacks: [AtomicU64; FallbackReason::ALL.len()],
    logged: [AtomicBool; FallbackReason::ALL.len()],
    latency: Histogram,
}

impl PluginCounters {
    fn new(plugin: &str, kind: PluginKind) -> Self {
        Self {
            plugin: plugin.to_string(),
            kind,
            calls: AtomicU64::new(0),
            fallbacks: Default::default(),
            logged: Default::default(),
            latency: Histogram::new(PLUGIN_BUCKETS),
        }
    }

    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    pub fn kind(&self) -> PluginKind {
        self.kind
    }

    pub fn record_call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Records how long one call into a plugin instance took (whatever its outcome).
    pub fn record_latency(&self, took: Duration) {
        self.latency.observe(took.as_secs_f64());
    }

    /// Calls into a plugin instance timed so far.
    pub fn timed_calls(&self) -> u64 {
        self.latency.count()
    }

    /// Counts a fallback and logs the first one of each reason.
    pub fn record_fallback(&self, reason: FallbackReason, detail: &dyn fmt::Display) {
        self.fallbacks[reason.index()].fetch_add(1, Ordering::Relaxed);
        if reason != FallbackReason::Declined
            && !self.logged[reason.index()].swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                plugin = %self.plugin,
                kind = %self.kind,
                reason = reason.as_str(),
                %detail,
                "plugin call fell back to the native default; later fallbacks for this reason are only counted"
            );
        }
    }

    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    pub fn fallbacks(&self, reason: FallbackReason) -> u64 {
        self.fallbacks[reason.index()].load(Ordering::Relaxed)
    }

    pub fn total_fallbacks(&self) -> u64 {
        FallbackReason::ALL.iter().map(|r| self.fallbacks(*r)).sum()
    }
}

/// One fallback counter value, for export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackSample {
    pub plugin: String,
    pub reason: &'static str,
    pub value: u64,
}

/// The registry of all plugins' counters.
#[derive(Debug, Default)]
pub struct PluginMetrics {
    counters: Mutex<Vec<Arc<PluginCounters>>>,
}

impl PluginMetrics {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The counters of `plugin`, created on first use.
    pub fn counters(&self, plugin: &str, kind: PluginKind) -> Arc<PluginCounters> {
        let mut all = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = all.iter().find(|c| c.plugin == plugin && c.kind == kind) {
            return c.clone();
        }
        let c = Arc::new(PluginCounters::new(plugin, kind));
        all.push(c.clone());
        c
    }

    /// Every (plugin, reason) fallback count, zeros included.
    pub fn fallback_samples(&self) -> Vec<FallbackSample> {
        let all = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for c in all.iter() {
            for r in FallbackReason::ALL {
                out.push(FallbackSample {
                    plugin: c.plugin.clone(),
                    reason: r.as_str(),
                    value: c.fallbacks(r),
                });
            }
        }
        out
    }

    /// Appends the counters in Prometheus text format.
    pub fn render_prometheus(&self, out: &mut String) {
        let all: Vec<Arc<PluginCounters>> = self
            .counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let labels =
            |c: &PluginCounters| format!("plugin=\"{}\",kind=\"{}\"", escape(&c.plugin), c.kind);
        let _ = writeln!(out, "# HELP {CALLS_METRIC} Policy plugin calls.");
        let _ = writeln!(out, "# TYPE {CALLS_METRIC} counter");
        for c in &all {
            let _ = writeln!(out, "{CALLS_METRIC}{{{}}} {}", labels(c), c.calls());
        }
        let _ = writeln!(
            out,
            "# HELP {FALLBACKS_METRIC} Policy plugin calls answered by the native default instead."
        );
        let _ = writeln!(out, "# TYPE {FALLBACKS_METRIC} counter");
        for c in &all {
            for r in FallbackReason::ALL {
                let _ = writeln!(
                    out,
                    "{FALLBACKS_METRIC}{{{},reason=\"{}\"}} {}",
                    labels(c),
                    r.as_str(),
                    c.fallbacks(r)
                );
            }
        }
        if let Some(first) = all.first() {
            first.latency.render_header(
                out,
                LATENCY_METRIC,
                "Time of one call into a policy plugin instance, in seconds.",
            );
        }
        for c in &all {
            c.latency.render_samples(out, LATENCY_METRIC, &labels(c));
        }
    }
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_shared_by_name_and_rendered() {
        let m = PluginMetrics::new();
        let a = m.counters("builtin:lru", PluginKind::Evictor);
        let b = m.counters("builtin:lru", PluginKind::Evictor);
        a.record_fallback(FallbackReason::Trap, &"boom");
        b.record_fallback(FallbackReason::Trap, &"boom");
        b.record_call();
        a.record_latency(Duration::from_micros(3));
        assert_eq!(a.fallbacks(FallbackReason::Trap), 2);
        assert_eq!(a.total_fallbacks(), 2);
        let mut text = String::new();
        m.render_prometheus(&mut text);
        assert!(
            text.contains(
                "chimera:plugin_fallbacks_total{plugin=\"builtin:lru\",kind=\"evictor\",reason=\"trap\"} 2"
            ),
            "{text}"
        );
        assert!(
            text.contains("chimera:plugin_calls_total{plugin=\"builtin:lru\",kind=\"evictor\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "chimera:plugin_call_latency_seconds_bucket{plugin=\"builtin:lru\",kind=\"evictor\",le=\"0.000005\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "chimera:plugin_call_latency_seconds_count{plugin=\"builtin:lru\",kind=\"evictor\"} 1"
            ),
            "{text}"
        );
        assert_eq!(
            text.matches("# TYPE chimera:plugin_call_latency_seconds ")
                .count(),
            1
        );
        let samples = m.fallback_samples();
        assert_eq!(samples.len(), FallbackReason::ALL.len());
        let quoted = m.counters("a\"b", PluginKind::Router);
        quoted.record_call();
        let mut text = String::new();
        m.render_prometheus(&mut text);
        assert!(text.contains("plugin=\"a\\\"b\""), "{text}");
    }
}
