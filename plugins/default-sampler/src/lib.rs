//! Built-in sampler `default`: greedy, temperature, top-k, min-p, top-p, seeded draws.
//!
//! Penalties are applied by the host before the candidates are taken. See
//! `chimera_policy_core::sampler` for the exact steps, shared with the host's native twin.
//! No config keys.

use chimera_plugin_sdk::algos::sampler;
use chimera_plugin_sdk::{Config, SamplerBatchView, SamplerPlugin};

#[derive(Default)]
pub struct DefaultSampler {
    scratch: Vec<f32>,
}

impl SamplerPlugin for DefaultSampler {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self::default())
    }

    fn sample(&mut self, batch: &SamplerBatchView<'_>) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        sampler::sample_batch(batch, &mut self.scratch, &mut out).then_some(out)
    }
}

chimera_plugin_sdk::export_sampler!(DefaultSampler);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::testing::SamplerInput;

    #[test]
    fn greedy_and_seeded_draws() {
        let mut s = DefaultSampler::init(&Config::default()).unwrap();
        let mut input = SamplerInput::new(3);
        input.push(0.0, 1, &[(5, 2.0), (6, 1.0), (7, 0.5)]);
        input.push(1.0, 9, &[(1, 0.0), (2, 0.0), (3, 0.0)]);
        let first = s.sample(&input.view()).unwrap();
        assert_eq!(first[0], 5);
        assert!([1, 2, 3].contains(&first[1]));
        assert_eq!(
            s.sample(&input.view()).unwrap(),
            first,
            "same seed and counter"
        );
    }
}
