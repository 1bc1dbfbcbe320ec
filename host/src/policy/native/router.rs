//! Native twins of the `least-loaded` and `prefix-aware` routers.

use chimera_policy_core::Config;
use chimera_policy_core::router::PrefixAware;

use super::{replica_view, request_view};
use crate::policy::{Decision, ReplicaColumns, RouteRequest, Router};

/// Fewest waiting + running requests; ties to more free blocks, then the lower index.
#[derive(Debug, Clone, Default)]
pub struct LeastLoadedRouter;

/// The least-loaded replica of `replicas` (the first when there is none): the answer of
/// [`LeastLoadedRouter`], and the router's fallback when a policy answers nothing usable.
pub fn least_loaded(replicas: &ReplicaColumns) -> usize {
    chimera_policy_core::router::least_loaded(&replica_view(replicas)).unwrap_or(0) as usize
}

impl LeastLoadedRouter {
    pub fn from_config(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self)
    }
}

impl Router for LeastLoadedRouter {
    fn route(&mut self, _request: &RouteRequest, replicas: &ReplicaColumns) -> Decision<u32> {
        match chimera_policy_core::router::least_loaded(&replica_view(replicas)) {
            Some(i) => Decision::Use(i),
            None => Decision::UseDefault,
        }
    }
}

/// α · prefix-hit fraction + (1 − α) · free capacity, with a saturation guard.
#[derive(Debug, Clone, Default)]
pub struct PrefixAwareRouter(pub PrefixAware);

impl PrefixAwareRouter {
    pub fn from_config(config: &Config) -> Result<Self, String> {
        PrefixAware::from_config(config).map(Self)
    }
}

impl Router for PrefixAwareRouter {
    fn route(&mut self, request: &RouteRequest, replicas: &ReplicaColumns) -> Decision<u32> {
        match self
            .0
            .route(&request_view(request), &replica_view(replicas))
        {
            Some(i) => Decision::Use(i),
            None => Decision::UseDefault,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cols(load: &[u32], hits: &[u32]) -> ReplicaColumns {
        let n = load.len();
        ReplicaColumns {
            waiting: load.to_vec(),
            running: vec![0; n],
            free_blocks: vec![50; n],
            total_blocks: vec![100; n],
            kv_usage: vec![0.5; n],
            prefix_hit_blocks: hits.to_vec(),
            ssm_hit_blocks: vec![0; n],
        }
    }

    #[test]
    fn twins_route_through_the_trait() {
        let req = RouteRequest {
            prompt_tokens: 64,
            prompt_blocks: 4,
            tenant: String::new(),
        };
        let c = cols(&[3, 1, 2], &[0, 0, 4]);
        assert_eq!(LeastLoadedRouter.route(&req, &c), Decision::Use(1));
        assert_eq!(
            PrefixAwareRouter::default().route(&req, &c),
            Decision::Use(2)
        );
        assert_eq!(
            LeastLoadedRouter.route(&req, &ReplicaColumns::default()),
            Decision::UseDefault
        );
    }
}
