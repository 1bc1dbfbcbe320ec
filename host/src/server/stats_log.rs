//! The periodic stats line, as vLLM logs one every few seconds: prompt and generation
//! throughput over the interval, running / waiting requests, KV cache usage and the
//! prefix-cache hit rate, summed over replicas.
//!
//! Owns: turning two readings of the replicas' [`EngineStats`] into one line, and the task that
//! writes it every `server.stats_log_interval_secs` while there is work (an idle server stays
//! quiet). It reads only the stats every engine already publishes; it must not touch engines.

use std::time::{Duration, Instant};

use crate::engine::api::EngineStats;

/// Counters summed over replicas at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub at: Instant,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub running: u64,
    pub waiting: u64,
    pub used_blocks: u64,
    pub total_blocks: u64,
}

impl Reading {
    pub fn of(stats: &[EngineStats], at: Instant) -> Self {
        let sum = |f: &dyn Fn(&EngineStats) -> u64| stats.iter().map(f).sum::<u64>();
        Self {
            at,
            prompt_tokens: sum(&|s| s.prompt_tokens_computed + s.prompt_tokens_cached),
            generation_tokens: sum(&|s| s.generation_tokens),
            prefix_queries: sum(&|s| s.prefix_cache_queries),
            prefix_hits: sum(&|s| s.prefix_cache_hits),
            preemptions: sum(&|s| s.preemptions),
            running: sum(&|s| u64::from(s.running)),
            waiting: sum(&|s| u64::from(s.waiting)),
            used_blocks: sum(&|s| u64::from(s.total_blocks.saturating_sub(s.free_blocks))),
            total_blocks: sum(&|s| u64::from(s.total_blocks)),
        }
    }

    /// The line for the interval from `prev` to `self`, or `None` when nothing ran, waited or
    /// moved in it.
    pub fn line_since(&self, prev: &Reading) -> Option<String> {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let prompt = d(self.prompt_tokens, prev.prompt_tokens);
        let generated = d(self.generation_tokens, prev.generation_tokens);
        if prompt == 0 && generated == 0 && self.running == 0 && self.waiting == 0 {
            return None;
        }
        let secs = self.at.duration_since(prev.at).as_secs_f64().max(1e-9);
        let queries = d(self.prefix_queries, prev.prefix_queries);
        let hits = d(self.prefix_hits, prev.prefix_hits);
        let pct = |n: u64, of: u64| {
            if of == 0 {
                0.0
            } else {
                100.0 * n as f64 / of as f64
            }
        };
        Some(format!(
            "prompt throughput: {:.1} tokens/s, generation throughput: {:.1} tokens/s, \
             running: {} reqs, waiting: {} reqs, KV cache usage: {:.1}%, prefix cache hit rate: {:.1}%, \
             preemptions: {}",
            prompt as f64 / secs,
            generated as f64 / secs,
            self.running,
            self.waiting,
            pct(self.used_blocks, self.total_blocks),
            pct(hits, queries),
            d(self.preemptions, prev.preemptions),
        ))
    }
}

/// Writes the stats line every `every` while there is work, until the process ends.
pub fn spawn(router: super::router::RouterHandle, every: Duration) {
    if every.is_zero() {
        return;
    }
    tokio::spawn(async move {
        let mut prev = Reading::of(&router.stats(), Instant::now());
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let now = Reading::of(&router.stats(), Instant::now());
            if let Some(line) = now.line_since(&prev) {
                tracing::info!(target: "chimera::stats", "{line}");
            }
            prev = now;
        }
    });
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn stats(prompt: u64, generated: u64, running: u32, free: u32) -> EngineStats {
        EngineStats {
            prompt_tokens_computed: prompt,
            generation_tokens: generated,
            prefix_cache_queries: prompt * 2,
            prefix_cache_hits: prompt,
            running,
            total_blocks: 100,
            free_blocks: free,
            ..Default::default()
        }
    }

    #[test]
    fn the_line_gives_rates_over_the_interval_summed_over_replicas() {
        let t0 = Instant::now();
        let a = Reading::of(&[stats(100, 10, 0, 100), stats(0, 0, 0, 100)], t0);
        let b = Reading::of(
            &[stats(300, 60, 2, 80), stats(100, 10, 1, 90)],
            t0 + Duration::from_secs(10),
        );
        let line = b.line_since(&a).unwrap();
        assert_eq!(
            line,
            "prompt throughput: 30.0 tokens/s, generation throughput: 6.0 tokens/s, running: 3 reqs, \
             waiting: 0 reqs, KV cache usage: 15.0%, prefix cache hit rate: 50.0%, preemptions: 0"
        );
        // Nothing moved and nothing runs: an idle server writes no line.
        let c = Reading::of(
            &[stats(300, 60, 0, 100), stats(100, 10, 0, 100)],
            t0 + Duration::from_secs(20),
        );
        let d = Reading::of(
            &[stats(300, 60, 0, 100), stats(100, 10, 0, 100)],
            t0 + Duration::from_secs(30),
        );
        assert_eq!(d.line_since(&c), None);
    }
}
