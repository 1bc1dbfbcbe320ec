//! Per-request measurements and their aggregation into one load point's summary.
//!
//! Owns [`RequestRecord`] (what one request measured), the percentile method, and
//! [`PointSummary`] (the aggregate that the table, the JSON file and the plot show).
//!
//! Definitions (times in the summary are milliseconds):
//! - TTFT: from just before the request is written to the first streamed chunk that carries
//!   text. E2E: from the same instant to the end of the stream.
//! - ITL: gaps between consecutive text-carrying chunks, pooled over all requests.
//! - TPOT: per request, `(e2e - ttft) / (completion_tokens - 1)`, for requests with at least
//!   two completion tokens.
//! - Token counts prefer the server's `usage`; without it, prompt tokens are the locally
//!   counted prompt and completion tokens are the number of text-carrying chunks.
//! - Throughputs divide completed requests and their tokens by the point's wall time (first
//!   send to last completion).
//! - Cache-hit ratio: summed `prompt_tokens_details.cached_tokens` over summed prompt tokens of
//!   completed requests; null when no response reported cached tokens.
//! - Percentiles: linear interpolation between closest ranks. For ascending `x[0..n]` and
//!   `p` in [0, 100], `r = p/100 * (n-1)`, result `x[floor r] + (r - floor r) *
//!   (x[ceil r] - x[floor r])` (NumPy's default method).
//!
//! Invariants: failed requests are counted in `failed` and `errors`, never dropped; latency
//! distributions use completed requests only. Must not do I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::arrivals::LoadPoint;

/// Why a request failed: a stable kind string and a human-readable message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub kind: String,
    pub message: String,
}

/// What one request measured. Times are seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub session: usize,
    pub turn: usize,
    pub group: Option<usize>,
    /// Send time, seconds after the load point started.
    pub start_s: f64,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    pub itl_s: Vec<f64>,
    /// Prompt tokens as counted locally with the benchmark's tokenizer.
    pub sent_prompt_tokens: usize,
    pub requested_output_tokens: u32,
    /// Text-carrying chunks received.
    pub output_chunks: usize,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub error: Option<Failure>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    fn prompt_count(&self) -> u64 {
        self.prompt_tokens.unwrap_or(self.sent_prompt_tokens as u64)
    }

    fn completion_count(&self) -> u64 {
        self.completion_tokens.unwrap_or(self.output_chunks as u64)
    }
}

/// Percentile `p` (0..=100) of ascending `sorted`, by linear interpolation between closest
/// ranks; None for an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let r = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = r.floor() as usize;
    let hi = r.ceil() as usize;
    Some(sorted[lo] + (r - lo as f64) * (sorted[hi] - sorted[lo]))
}

/// Summary of a sample (same unit as the input).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    pub count: usize,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Distribution {
    /// None for an empty sample; NaNs are ignored.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q| percentile(&v, q).unwrap_or(f64::NAN);
        Some(Self {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            p50: p(50.0),
            p90: p(90.0),
            p95: p(95.0),
            p99: p(99.0),
            max: v[v.len() - 1],
        })
    }
}

/// The offered load of a point, in JSON form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadSummary {
    /// `"concurrency"` or `"request_rate"`.
    pub mode: String,
    /// Clients, or requests per second; null for an infinite rate.
    pub value: Option<f64>,
    pub burstiness: Option<f64>,
    pub max_concurrency: Option<usize>,
}

impl From<&LoadPoint> for LoadSummary {
    fn from(p: &LoadPoint) -> Self {
        let v = p.offered();
        match p {
            LoadPoint::Concurrency(_) => Self {
                mode: p.mode().into(),
                value: Some(v),
                burstiness: None,
                max_concurrency: None,
            },
            LoadPoint::Rate {
                burstiness,
                max_concurrency,
                ..
            } => Self {
                mode: p.mode().into(),
                value: v.is_finite().then_some(v),
                burstiness: Some(*burstiness),
                max_concurrency: *max_concurrency,
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestCounts {
    /// Requests sent (completed + failed).
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    /// Later turns of conversations not sent because an earlier turn failed.
    pub skipped_turns: usize,
    /// Completed requests whose stream carried no `usage`.
    pub without_usage: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenCounts {
    pub prompt: u64,
    pub completion: u64,
    pub cached: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub requests_per_s: f64,
    pub input_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Latencies {
    pub ttft: Option<Distribution>,
    pub tpot: Option<Distribution>,
    pub itl: Option<Distribution>,
    pub e2e: Option<Distribution>,
}

/// Aggregate of one load point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointSummary {
    pub load: LoadSummary,
    pub duration_s: f64,
    pub requests: RequestCounts,
    /// Failed requests by error kind.
    pub errors: BTreeMap<String, usize>,
    pub tokens: TokenCounts,
    pub throughput: Throughput,
    pub cache_hit_ratio: Option<f64>,
    /// Mean requests in flight: summed E2E of completed requests over the wall time.
    pub mean_in_flight: f64,
    pub latency_ms: Latencies,
}

impl PointSummary {
    pub fn compute(
        load: &LoadPoint,
        records: &[RequestRecord],
        duration_s: f64,
        skipped_turns: usize,
    ) -> Self {
        let done: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let mut errors = BTreeMap::new();
        for r in records {
            if let Some(f) = &r.error {
                *errors.entry(f.kind.clone()).or_insert(0) += 1;
            }
        }
        let prompt: u64 = done.iter().map(|r| r.prompt_count()).sum();
        let completion: u64 = done.iter().map(|r| r.completion_count()).sum();
        let cached: u64 = done.iter().filter_map(|r| r.cached_tokens).sum();
        let any_cached = done.iter().any(|r| r.cached_tokens.is_some());
        let with_usage: Vec<&&RequestRecord> =
            done.iter().filter(|r| r.prompt_tokens.is_some()).collect();
        let usage_prompt: u64 = with_usage.iter().map(|r| r.prompt_count()).sum();
        let cache_hit_ratio =
            (any_cached && usage_prompt > 0).then(|| cached as f64 / usage_prompt as f64);
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        let ms = 1000.0;
        let ttft: Vec<f64> = done
            .iter()
            .filter_map(|r| r.ttft_s)
            .map(|t| t * ms)
            .collect();
        let e2e: Vec<f64> = done.iter().map(|r| r.e2e_s * ms).collect();
        let itl: Vec<f64> = done
            .iter()
            .flat_map(|r| r.itl_s.iter().map(|t| t * ms))
            .collect();
        let tpot: Vec<f64> = done
            .iter()
            .filter_map(|r| {
                let n = r.completion_count();
                let t = r.ttft_s?;
                (n > 1).then(|| (r.e2e_s - t) * ms / (n - 1) as f64)
            })
            .collect();
        Self {
            load: LoadSummary::from(load),
            duration_s,
            requests: RequestCounts {
                sent: records.len(),
                completed: done.len(),
                failed: records.len() - done.len(),
                skipped_turns,
                without_usage: done.len() - with_usage.len(),
            },
            errors,
            tokens: TokenCounts {
                prompt,
                completion,
                cached,
            },
            throughput: Throughput {
                requests_per_s: per_s(done.len() as f64),
                input_tokens_per_s: per_s(prompt as f64),
                output_tokens_per_s: per_s(completion as f64),
                total_tokens_per_s: per_s((prompt + completion) as f64),
            },
            cache_hit_ratio,
            mean_in_flight: per_s(done.iter().map(|r| r.e2e_s).sum::<f64>()),
            latency_ms: Latencies {
                ttft: Distribution::of(&ttft),
                tpot: Distribution::of(&tpot),
                itl: Distribution::of(&itl),
                e2e: Distribution::of(&e2e),
            },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_on_exact_vectors() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert!(close(percentile(&v, 50.0).unwrap(), 2.5));
        // r = 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
        assert!(close(percentile(&v, 90.0).unwrap(), 3.7));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        // r = 0.99 * 99 = 98.01 -> 99 + 0.01
        assert!(close(percentile(&hundred, 99.0).unwrap(), 99.01));
        assert!(close(percentile(&hundred, 50.0).unwrap(), 50.5));
        let d = Distribution::of(&[3.0, 1.0, 2.0, f64::NAN]).unwrap();
        assert_eq!((d.count, d.min, d.p50, d.max), (3, 1.0, 2.0, 3.0));
        assert!(close(d.mean, 2.0));
        assert!(Distribution::of(&[]).is_none());
    }

    fn rec(ttft: f64, e2e: f64, n: u64, cached: Option<u64>) -> RequestRecord {
        RequestRecord {
            ttft_s: Some(ttft),
            e2e_s: e2e,
            itl_s: vec![(e2e - ttft) / (n - 1) as f64; (n - 1) as usize],
            sent_prompt_tokens: 100,
            output_chunks: n as usize,
            prompt_tokens: Some(100),
            completion_tokens: Some(n),
            cached_tokens: cached,
            ..Default::default()
        }
    }

    #[test]
    fn summary_counts_failures_and_computes_rates() {
        let mut records = vec![
            rec(0.05, 0.15, 11, Some(0)),
            rec(0.05, 0.15, 11, Some(50)),
            rec(0.10, 0.30, 21, None),
        ];
        records.push(RequestRecord {
            e2e_s: 0.01,
            error: Some(Failure {
                kind: "http_500".into(),
                message: "boom".into(),
            }),
            ..Default::default()
        });
        let s = PointSummary::compute(&LoadPoint::Concurrency(2), &records, 0.5, 1);
        assert_eq!(s.requests.sent, 4);
        assert_eq!(s.requests.completed, 3);
        assert_eq!(s.requests.failed, 1);
        assert_eq!(s.requests.skipped_turns, 1);
        assert_eq!(s.errors.get("http_500"), Some(&1));
        assert_eq!(s.tokens.prompt, 300);
        assert_eq!(s.tokens.completion, 43);
        assert_eq!(s.tokens.cached, 50);
        assert!(close(s.cache_hit_ratio.unwrap(), 50.0 / 300.0));
        assert!(close(s.throughput.requests_per_s, 6.0));
        assert!(close(s.throughput.output_tokens_per_s, 86.0));
        assert!(close(s.throughput.total_tokens_per_s, 686.0));
        assert!(close(s.mean_in_flight, 0.6 / 0.5));
        let tpot = s.latency_ms.tpot.unwrap();
        assert!(close(tpot.min, 10.0) && close(tpot.max, 10.0));
        assert_eq!(s.latency_ms.itl.unwrap().count, 40);
        let ttft = s.latency_ms.ttft.unwrap();
        assert!(close(ttft.p50, 50.0));
        assert!(close(ttft.max, 100.0));
    }

    #[test]
    fn no_cached_field_means_no_ratio() {
        let records = vec![rec(0.05, 0.15, 11, None)];
        let s = PointSummary::compute(&LoadPoint::Concurrency(1), &records, 1.0, 0);
        assert_eq!(s.cache_hit_ratio, None);
        let all_failed = vec![RequestRecord {
            error: Some(Failure {
                kind: "connect".into(),
                message: String::new(),
            }),
            ..Default::default()
        }];
        let s = PointSummary::compute(&LoadPoint::Concurrency(1), &all_failed, 1.0, 0);
        assert_eq!(s.requests.failed, 1);
        assert!(s.latency_ms.e2e.is_none());
        assert_eq!(s.throughput.requests_per_s, 0.0);
    }
}
