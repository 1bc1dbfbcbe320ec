//! Test-only sampler plugin: the built-in default sampler, except on demand.
//!
//! Misbehaves when the first request's seed says so: 13 traps, 14 answers a token that is not
//! a candidate, 15 answers one token too few. Otherwise it samples like the built-in.

use chimera_plugin_sdk::algos::sampler;
use chimera_plugin_sdk::{Config, SamplerBatchView, SamplerPlugin};

pub struct Misbehave {
    scratch: Vec<f32>,
}

impl SamplerPlugin for Misbehave {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self { scratch: Vec::new() })
    }

    fn sample(&mut self, batch: &SamplerBatchView<'_>) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        if !sampler::sample_batch(batch, &mut self.scratch, &mut out) {
            return None;
        }
        match batch.seed.first() {
            Some(13) => panic!("deliberate trap"),
            Some(14) => out[0] = u32::MAX,
            Some(15) => {
                out.pop();
            }
            _ => {}
        }
        Some(out)
    }
}

chimera_plugin_sdk::export_sampler!(Misbehave);
