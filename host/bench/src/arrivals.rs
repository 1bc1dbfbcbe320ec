//! When requests are sent: closed-loop clients or open-loop Poisson/gamma arrivals.
//!
//! Owns the load point ([`LoadPoint`]), the arrival-time generator for open-loop runs
//! ([`Arrivals`]) and the stop conditions ([`Bounds`]). Open-loop inter-arrival times are
//! gamma distributed with shape `burstiness` and mean `1 / rate` (the same process as
//! `vllm bench serve --burstiness`): burstiness 1 is a Poisson process, below 1 is burstier,
//! above 1 is more regular. An infinite rate sends every session at time zero.
//!
//! Invariants: offsets are non-decreasing, start at zero, and depend only on the seed and the
//! parameters. Must not sleep or spawn: the runner turns offsets into time.

use std::str::FromStr;
use std::time::Duration;

use super::rng::Rng;

/// A request rate in requests per second; `inf` means no pacing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(pub f64);

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("inf") {
            return Ok(Rate(f64::INFINITY));
        }
        match t.parse::<f64>() {
            Ok(r) if r > 0.0 && r.is_finite() => Ok(Rate(r)),
            _ => Err(format!(
                "`{s}` is not a rate: use a positive number or `inf`"
            )),
        }
    }
}

/// One point of offered load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadPoint {
    /// `n` clients, each sending its next session's turns as soon as the previous completes.
    Concurrency(usize),
    /// Sessions start at gamma-distributed times; at most `max_concurrency` requests in flight.
    Rate {
        rate: f64,
        burstiness: f64,
        max_concurrency: Option<usize>,
    },
}

impl LoadPoint {
    /// The x value of this point in a sweep: clients, or requests per second.
    pub fn offered(&self) -> f64 {
        match self {
            LoadPoint::Concurrency(n) => *n as f64,
            LoadPoint::Rate { rate, .. } => *rate,
        }
    }

    /// `"concurrency"` or `"request_rate"`: the name of the sweep axis.
    pub fn mode(&self) -> &'static str {
        match self {
            LoadPoint::Concurrency(_) => "concurrency",
            LoadPoint::Rate { .. } => "request_rate",
        }
    }

    pub fn describe(&self) -> String {
        match self {
            LoadPoint::Concurrency(n) => format!("concurrency {n}"),
            LoadPoint::Rate {
                rate,
                burstiness,
                max_concurrency,
            } => {
                let mut s = if rate.is_finite() {
                    format!("rate {rate} req/s")
                } else {
                    "rate inf".to_string()
                };
                if *burstiness != 1.0 {
                    s.push_str(&format!(", burstiness {burstiness}"));
                }
                if let Some(m) = max_concurrency {
                    s.push_str(&format!(", max concurrency {m}"));
                }
                s
            }
        }
    }
}

/// When to stop sending new requests. At least one bound is always set by the caller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub max_requests: Option<usize>,
    pub duration: Option<Duration>,
}

/// Generator of arrival offsets (seconds from the start of a run).
#[derive(Debug, Clone)]
pub struct Arrivals {
    rng: Rng,
    rate: f64,
    burstiness: f64,
    next: f64,
}

impl Arrivals {
    /// `rate > 0` (may be infinite) and `burstiness > 0`.
    pub fn new(rate: f64, burstiness: f64, seed: u64) -> Self {
        Self {
            rng: Rng::fork(seed, 0xA11),
            rate,
            burstiness,
            next: 0.0,
        }
    }

    /// The next arrival's offset; the first is 0.
    pub fn next_offset(&mut self) -> f64 {
        let now = self.next;
        if self.rate.is_finite() {
            let scale = 1.0 / (self.rate * self.burstiness);
            self.next += self.rng.gamma(self.burstiness, scale);
        }
        now
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn gaps(rate: f64, burstiness: f64, n: usize) -> Vec<f64> {
        let mut a = Arrivals::new(rate, burstiness, 17);
        let offs: Vec<f64> = (0..=n).map(|_| a.next_offset()).collect();
        assert_eq!(offs[0], 0.0);
        offs.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_cv2(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let m = xs.iter().sum::<f64>() / n;
        let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n;
        (m, v / (m * m))
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate() {
        let g = gaps(20.0, 1.0, 100_000);
        assert!(g.iter().all(|&x| x >= 0.0));
        let (m, cv2) = mean_cv2(&g);
        assert!((m - 0.05).abs() < 0.001, "mean {m}");
        // Exponential: squared coefficient of variation 1.
        assert!((cv2 - 1.0).abs() < 0.03, "cv2 {cv2}");
    }

    #[test]
    fn burstiness_changes_variance_not_mean() {
        // Gamma(k): CV^2 = 1/k.
        for k in [0.25, 4.0] {
            let g = gaps(5.0, k, 100_000);
            let (m, cv2) = mean_cv2(&g);
            assert!((m - 0.2).abs() < 0.005, "k={k} mean {m}");
            assert!((cv2 - 1.0 / k).abs() < 0.05 / k, "k={k} cv2 {cv2}");
        }
    }

    #[test]
    fn infinite_rate_sends_everything_at_once_and_seed_reproduces() {
        let mut a = Arrivals::new(f64::INFINITY, 1.0, 1);
        assert!((0..10).all(|_| a.next_offset() == 0.0));
        assert_eq!(gaps(3.0, 1.0, 50), gaps(3.0, 1.0, 50));
        assert_eq!("inf".parse::<Rate>().unwrap().0, f64::INFINITY);
        assert_eq!("2.5".parse::<Rate>().unwrap().0, 2.5);
        assert!("0".parse::<Rate>().is_err());
        assert!("-1".parse::<Rate>().is_err());
    }
}
