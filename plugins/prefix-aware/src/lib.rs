//! Built-in router `prefix-aware`: α · prefix-hit fraction + (1 − α) · free capacity, with a
//! saturation guard.
//!
//! Config keys: `alpha` (0..=1, default 0.7), `saturation_kv_usage` (0..=1, default 0.9),
//! `saturation_waiting` (default 8, 0 disables), `use_ssm_hits` (default false). A saturated
//! replica loses its prefix term so a popular prefix does not bury it. The algorithm lives in
//! `chimera-policy-core` and is shared with the host's native twin.

use chimera_plugin_sdk::algos::router::PrefixAware;
use chimera_plugin_sdk::{Config, ReplicaView, RouteRequestView, RouterPlugin};

pub struct PrefixAwareRouter(PrefixAware);

impl RouterPlugin for PrefixAwareRouter {
    fn init(config: &Config) -> Result<Self, String> {
        PrefixAware::from_config(config).map(Self)
    }

    fn route(&mut self, request: &RouteRequestView<'_>, replicas: &ReplicaView<'_>) -> Option<u32> {
        self.0.route(request, replicas)
    }
}

chimera_plugin_sdk::export_router!(PrefixAwareRouter);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::ConfigValue;
    use chimera_plugin_sdk::testing::Replicas;

    #[test]
    fn follows_the_prefix_and_honours_alpha() {
        let mut cols = Replicas::default();
        cols.push(0, 1, 50, 100, 8).push(0, 1, 90, 100, 0);
        let req = RouteRequestView {
            prompt_tokens: 128,
            prompt_blocks: 8,
            tenant: "",
        };
        let mut r = PrefixAwareRouter::init(&Config::default()).unwrap();
        assert_eq!(r.route(&req, &cols.view()), Some(0));
        let cfg = Config::new(vec![("alpha".into(), ConfigValue::Float(0.0))]);
        let mut capacity_only = PrefixAwareRouter::init(&cfg).unwrap();
        assert_eq!(capacity_only.route(&req, &cols.view()), Some(1));
    }
}
