//! Native twin of the `default` sampler.

use chimera_policy_core::Config;
use chimera_policy_core::sampler::sample_batch;

use super::batch_view;
use crate::policy::{Decision, Sampler, SamplerBatch};

/// Greedy, temperature, top-k, min-p, top-p; draws seeded by (seed, counter).
#[derive(Debug, Clone, Default)]
pub struct DefaultSampler {
    scratch: Vec<f32>,
}

impl DefaultSampler {
    pub fn from_config(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self::default())
    }
}

impl Sampler for DefaultSampler {
    fn sample(&mut self, batch: &SamplerBatch) -> Decision<Vec<u32>> {
        let mut out = Vec::with_capacity(batch.len());
        if sample_batch(&batch_view(batch), &mut self.scratch, &mut out) {
            Decision::Use(out)
        } else {
            Decision::UseDefault
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_inconsistent_batches() {
        let mut s = DefaultSampler::default();
        let batch = SamplerBatch {
            k: 2,
            temperature: vec![0.0],
            top_k: vec![0],
            top_p: vec![1.0],
            min_p: vec![0.0],
            seed: vec![3],
            counter: vec![0],
            cand_tokens: vec![42, 7],
            cand_logits: vec![1.0, 0.5],
        };
        assert_eq!(s.sample(&batch), Decision::Use(vec![42]));
        let broken = SamplerBatch {
            cand_tokens: vec![42],
            ..batch
        };
        assert_eq!(s.sample(&broken), Decision::UseDefault);
    }
}
