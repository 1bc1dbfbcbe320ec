//! Deterministic random numbers for workload generation and arrival schedules.
//!
//! Owns one small generator (xoshiro256**, seeded through splitmix64) and the few
//! distributions the benchmark needs: uniform integers, exponential and gamma variates, and
//! shuffles. Everything is written here rather than taken from a crate so that a seed gives the
//! same prompts and the same arrival times across dependency upgrades and platforms.
//!
//! Invariants: the stream depends only on the seed; `fork` derives independent streams from a
//! parent seed and a stream number without consuming the parent. Must not read any clock or
//! operating-system entropy.

/// xoshiro256** generator. Not cryptographic; reproducibility is the point.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose whole stream is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut st = seed;
        let s = [
            splitmix64(&mut st),
            splitmix64(&mut st),
            splitmix64(&mut st),
            splitmix64(&mut st),
        ];
        Self { s }
    }

    /// An independent stream identified by `(seed, stream)`, e.g. one per group or per sweep
    /// point, so adding draws to one stream never shifts another.
    pub fn fork(seed: u64, stream: u64) -> Self {
        let mut st = seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        Self::new(splitmix64(&mut st))
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (0, 1]: safe to take the logarithm of.
    fn next_open_f64(&mut self) -> f64 {
        1.0 - self.next_f64()
    }

    /// Uniform integer in `0..n` (n > 0), by rejection so there is no modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Uniform integer in `lo..=hi`; returns `lo` when `hi <= lo`.
    pub fn range_inclusive(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.below(hi - lo + 1)
    }

    /// Standard normal variate (Box–Muller, one value per call).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_open_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Exponential variate with the given mean.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.next_open_f64().ln()
    }

    /// Gamma variate with shape `k > 0` and scale `theta` (mean `k * theta`, variance
    /// `k * theta^2`), by Marsaglia and Tsang's squeeze method; shapes below 1 use the
    /// `Gamma(k + 1) * U^(1/k)` boost.
    pub fn gamma(&mut self, shape: f64, scale: f64) -> f64 {
        if shape < 1.0 {
            let u = self.next_open_f64();
            return self.gamma(shape + 1.0, scale) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = 1.0 + c * x;
            if v <= 0.0 {
                continue;
            }
            let v = v * v * v;
            let u = self.next_open_f64();
            if u < 1.0 - 0.0331 * x * x * x * x || u.ln() < 0.5 * x * x + d * (1.0 - v + v.ln()) {
                return d * v * scale;
            }
        }
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn mean_var(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let m = xs.iter().sum::<f64>() / n;
        let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n;
        (m, v)
    }

    #[test]
    fn same_seed_same_stream_and_forks_differ() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        let mut f1 = Rng::fork(7, 1);
        let mut f2 = Rng::fork(7, 2);
        assert_ne!(f1.next_u64(), f2.next_u64());
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn ranges_stay_inside_bounds_and_cover_them() {
        let mut r = Rng::new(1);
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let x = r.range_inclusive(10, 14);
            assert!((10..=14).contains(&x));
            seen[(x - 10) as usize] = true;
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(r.range_inclusive(5, 5), 5);
        assert_eq!(r.below(1), 0);
    }

    #[test]
    fn gamma_moments_match_shape_and_scale() {
        // Gamma(k, theta): mean k*theta, variance k*theta^2. 200k draws give a standard error
        // of the mean below 0.5% here, so a wrong formula (e.g. rate for scale) fails clearly.
        for &(k, theta) in &[(0.5, 2.0), (1.0, 0.25), (4.0, 0.5)] {
            let mut r = Rng::new(42);
            let xs: Vec<f64> = (0..200_000).map(|_| r.gamma(k, theta)).collect();
            let (m, v) = mean_var(&xs);
            assert!((m - k * theta).abs() < 0.02 * k * theta, "k={k} mean {m}");
            assert!(
                (v - k * theta * theta).abs() < 0.05 * k * theta * theta,
                "k={k} var {v}"
            );
            assert!(xs.iter().all(|&x| x > 0.0));
        }
    }

    #[test]
    fn exponential_mean_and_shuffle_is_a_permutation() {
        let mut r = Rng::new(3);
        let xs: Vec<f64> = (0..100_000).map(|_| r.exponential(0.1)).collect();
        let (m, _) = mean_var(&xs);
        assert!((m - 0.1).abs() < 0.002, "mean {m}");
        let mut v: Vec<u32> = (0..50).collect();
        r.shuffle(&mut v);
        assert_ne!(v, (0..50).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }
}
