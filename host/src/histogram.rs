//! A fixed-bucket Prometheus histogram updated with atomics, shared by the server's metrics and
//! the plugin call counters. Observing is lock-free (one bucket, the count and the sum); it
//! never blocks the engine loop or the router.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Buckets of policy plugin call latencies, in seconds.
pub const PLUGIN_BUCKETS: &[f64] = &[1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 1e-1];

/// A fixed-bucket histogram updated with atomics.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Appends the histogram's HELP, TYPE, bucket, sum and count lines; `labels` (possibly
    /// empty) go on every sample.
    pub fn render(&self, out: &mut String, name: &str, labels: &str, help: &str) {
        self.render_header(out, name, help);
        self.render_samples(out, name, labels);
    }

    /// The HELP and TYPE lines, once per metric family.
    pub fn render_header(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    }

    /// The bucket, sum and count samples of one labelled series.
    pub fn render_samples(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = f64::from_bits(self.sum_bits.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {sum}\n{name}_count{{{labels}}} {count}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.7, 9.0, f64::NAN] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "", "help");
        assert!(out.contains("x_bucket{le=\"1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"2\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_sum{} 12.7"), "{out}");
    }
}
