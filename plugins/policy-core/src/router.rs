//! Built-in routing algorithms: least-loaded and prefix-aware.
//!
//! Both return `None` ("let the host decide") when there is no replica or the columns are
//! inconsistent, and otherwise an index in `0..replicas.len()`. Ties are broken by the lower
//! load (waiting + running), then the lower index, so answers are deterministic.

use alloc::string::String;

use crate::columns::{ReplicaView, RouteRequestView};
use crate::config::Config;

fn load(r: &ReplicaView<'_>, i: usize) -> u64 {
    r.waiting[i] as u64 + r.running[i] as u64
}

/// The replica with the fewest waiting + running requests; ties go to more free blocks, then
/// the lower index.
pub fn least_loaded(replicas: &ReplicaView<'_>) -> Option<u32> {
    if replicas.is_empty() || !replicas.is_consistent() {
        return None;
    }
    let mut best = 0usize;
    for i in 1..replicas.len() {
        let (l, lb) = (load(replicas, i), load(replicas, best));
        if l < lb || (l == lb && replicas.free_blocks[i] > replicas.free_blocks[best]) {
            best = i;
        }
    }
    Some(best as u32)
}

/// Prefix-aware routing: score = α · prefix-hit fraction + (1 − α) · free-capacity fraction.
///
/// Saturation guard: a replica whose KV usage is at or above `saturation_kv_usage`, or whose
/// waiting queue is at or above `saturation_waiting` (0 disables that test), loses its prefix
/// term, so a replica holding a popular prefix is not handed every request that shares it.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixAware {
    pub alpha: f32,
    pub saturation_kv_usage: f32,
    pub saturation_waiting: u32,
    /// Count hits only where an SSM snapshot is usable too (hybrid models).
    pub use_ssm_hits: bool,
}

impl Default for PrefixAware {
    fn default() -> Self {
        Self {
            alpha: 0.7,
            saturation_kv_usage: 0.9,
            saturation_waiting: 8,
            use_ssm_hits: false,
        }
    }
}

impl PrefixAware {
    pub const KEYS: [&'static str; 4] = [
        "alpha",
        "saturation_kv_usage",
        "saturation_waiting",
        "use_ssm_hits",
    ];

    /// Parses `alpha` ∈ [0, 1], `saturation_kv_usage` ∈ [0, 1], `saturation_waiting` (0
    /// disables) and `use_ssm_hits`; any other key is an error.
    pub fn from_config(config: &Config) -> Result<Self, String> {
        config.expect_keys(&Self::KEYS)?;
        let d = Self::default();
        Ok(Self {
            alpha: config.f64_in("alpha", d.alpha as f64, 0.0, 1.0)? as f32,
            saturation_kv_usage: config.f64_in(
                "saturation_kv_usage",
                d.saturation_kv_usage as f64,
                0.0,
                1.0,
            )? as f32,
            saturation_waiting: config.u32_in(
                "saturation_waiting",
                d.saturation_waiting,
                0,
                u32::MAX,
            )?,
            use_ssm_hits: config.bool_or("use_ssm_hits", d.use_ssm_hits)?,
        })
    }

    fn saturated(&self, r: &ReplicaView<'_>, i: usize) -> bool {
        r.kv_usage[i] >= self.saturation_kv_usage
            || (self.saturation_waiting > 0 && r.waiting[i] >= self.saturation_waiting)
    }

    /// The score of replica `i` (higher is better).
    pub fn score(&self, request: &RouteRequestView<'_>, r: &ReplicaView<'_>, i: usize) -> f32 {
        let hits = if self.use_ssm_hits {
            r.ssm_hit_blocks[i]
        } else {
            r.prefix_hit_blocks[i]
        };
        let prefix = if request.prompt_blocks == 0 || self.saturated(r, i) {
            0.0
        } else {
            hits.min(request.prompt_blocks) as f32 / request.prompt_blocks as f32
        };
        let free = if r.total_blocks[i] == 0 {
            0.0
        } else {
            r.free_blocks[i].min(r.total_blocks[i]) as f32 / r.total_blocks[i] as f32
        };
        self.alpha * prefix + (1.0 - self.alpha) * free
    }

    pub fn route(&self, request: &RouteRequestView<'_>, replicas: &ReplicaView<'_>) -> Option<u32> {
        if replicas.is_empty() || !replicas.is_consistent() {
            return None;
        }
        let mut best = 0usize;
        let mut best_score = self.score(request, replicas, 0);
        for i in 1..replicas.len() {
            let s = self.score(request, replicas, i);
            // `!(s <= best)` would let NaN win; scores are finite by construction.
            if s > best_score || (s == best_score && load(replicas, i) < load(replicas, best)) {
                best = i;
                best_score = s;
            }
        }
        Some(best as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigValue;
    use alloc::string::ToString;
    use alloc::vec;
    use alloc::vec::Vec;

    struct Cols {
        waiting: Vec<u32>,
        running: Vec<u32>,
        free: Vec<u32>,
        total: Vec<u32>,
        usage: Vec<f32>,
        hits: Vec<u32>,
        ssm: Vec<u32>,
    }

    impl Cols {
        fn new(n: usize) -> Self {
            Self {
                waiting: vec![0; n],
                running: vec![0; n],
                free: vec![100; n],
                total: vec![100; n],
                usage: vec![0.0; n],
                hits: vec![0; n],
                ssm: vec![0; n],
            }
        }
        fn view(&self) -> ReplicaView<'_> {
            ReplicaView {
                waiting: &self.waiting,
                running: &self.running,
                free_blocks: &self.free,
                total_blocks: &self.total,
                kv_usage: &self.usage,
                prefix_hit_blocks: &self.hits,
                ssm_hit_blocks: &self.ssm,
            }
        }
    }

    #[test]
    fn least_loaded_picks_min_load_then_free_then_index() {
        let mut c = Cols::new(4);
        c.waiting = vec![3, 1, 1, 2];
        c.running = vec![0, 2, 1, 0];
        assert_eq!(least_loaded(&c.view()), Some(2));
        c.waiting[1] = 0;
        c.free = vec![0, 50, 10, 0];
        // replicas 1 and 2 both have load 2; 1 has more free blocks.
        assert_eq!(least_loaded(&c.view()), Some(1));
        assert_eq!(least_loaded(&Cols::new(0).view()), None);
        c.running.pop();
        assert_eq!(least_loaded(&c.view()), None, "inconsistent columns");
    }

    #[test]
    fn prefix_aware_prefers_hits_until_saturated() {
        let p = PrefixAware::default();
        let req = RouteRequestView {
            prompt_tokens: 160,
            prompt_blocks: 10,
            tenant: "",
        };
        let mut c = Cols::new(3);
        c.hits = vec![0, 10, 2];
        c.free = vec![90, 60, 90];
        assert_eq!(p.route(&req, &c.view()), Some(1));
        // Saturate replica 1 by KV usage: its prefix term is dropped, free capacity wins.
        c.usage[1] = 0.95;
        assert_eq!(p.route(&req, &c.view()), Some(2));
        c.usage[1] = 0.1;
        c.waiting[1] = 8;
        assert_eq!(p.route(&req, &c.view()), Some(2));
    }

    #[test]
    fn prefix_aware_alpha_zero_is_free_capacity_only() {
        let p = PrefixAware {
            alpha: 0.0,
            ..PrefixAware::default()
        };
        let req = RouteRequestView {
            prompt_tokens: 32,
            prompt_blocks: 2,
            tenant: "t",
        };
        let mut c = Cols::new(2);
        c.hits = vec![2, 0];
        c.free = vec![10, 20];
        assert_eq!(p.route(&req, &c.view()), Some(1));
    }

    #[test]
    fn prefix_aware_config_is_parsed_and_checked() {
        let cfg = Config::new(vec![
            ("alpha".to_string(), ConfigValue::Float(0.25)),
            ("saturation_waiting".to_string(), ConfigValue::Integer(0)),
        ]);
        let p = PrefixAware::from_config(&cfg).unwrap();
        assert_eq!(p.alpha, 0.25);
        assert_eq!(p.saturation_waiting, 0);
        let bad = Config::new(vec![("alpha".to_string(), ConfigValue::Float(1.5))]);
        assert!(
            PrefixAware::from_config(&bad)
                .unwrap_err()
                .contains("alpha")
        );
        let unknown = Config::new(vec![("beta".to_string(), ConfigValue::Float(0.5))]);
        assert!(
            PrefixAware::from_config(&unknown)
                .unwrap_err()
                .contains("beta")
        );
    }
}
