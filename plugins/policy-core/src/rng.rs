//! A small seeded random number generator (SplitMix64) for reproducible sampling.
//!
//! A stream is identified by `(seed, counter)`: the sampler uses the request's seed and the
//! number of tokens it has sampled so far, so the same request replayed draws the same numbers
//! on any machine and in any build (native or Wasm). Not cryptographic.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for draw number `counter` of the stream `seed`.
    pub fn new(seed: u64, counter: u64) -> Self {
        // Mix the counter through one SplitMix step so nearby counters give unrelated streams.
        let key = mix(counter.wrapping_add(GOLDEN));
        Self { state: seed ^ key }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix(self.state)
    }

    /// Uniform in `[0, 1)` with 24 bits of resolution.
    pub fn next_f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32) * (1.0 / 16_777_216.0)
    }

    /// Uniform in `0..n` (`0` when `n == 0`), by multiply-shift.
    pub fn next_below(&mut self, n: u32) -> u32 {
        (((self.next_u64() >> 32) * n as u64) >> 32) as u32
    }
}

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_counter_repeat() {
        let a: [u64; 4] = core::array::from_fn({
            let mut r = Rng::new(7, 3);
            move |_| r.next_u64()
        });
        let b: [u64; 4] = core::array::from_fn({
            let mut r = Rng::new(7, 3);
            move |_| r.next_u64()
        });
        assert_eq!(a, b);
        assert_ne!(Rng::new(7, 3).next_u64(), Rng::new(7, 4).next_u64());
        assert_ne!(Rng::new(7, 3).next_u64(), Rng::new(8, 3).next_u64());
    }

    #[test]
    fn floats_are_in_unit_interval_and_roughly_uniform() {
        let mut r = Rng::new(42, 0);
        let mut buckets = [0u32; 10];
        for _ in 0..100_000 {
            let x = r.next_f32();
            assert!((0.0..1.0).contains(&x));
            buckets[(x * 10.0) as usize] += 1;
        }
        for b in buckets {
            assert!((9_000..11_000).contains(&b), "bucket count {b}");
        }
    }

    #[test]
    fn below_stays_below() {
        let mut r = Rng::new(1, 1);
        for n in 1..200 {
            assert!(r.next_below(n) < n);
        }
        assert_eq!(r.next_below(0), 0);
    }
}
