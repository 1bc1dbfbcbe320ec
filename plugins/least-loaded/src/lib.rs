//! Built-in router `least-loaded`: the replica with the fewest waiting + running requests.
//!
//! Ties go to the replica with more free blocks, then the lower index. Takes no config keys.
//! The algorithm lives in `chimera-policy-core` and is shared with the host's native twin.

use chimera_plugin_sdk::{Config, ReplicaView, RouteRequestView, RouterPlugin, algos::router};

pub struct LeastLoaded;

impl RouterPlugin for LeastLoaded {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self)
    }

    fn route(
        &mut self,
        _request: &RouteRequestView<'_>,
        replicas: &ReplicaView<'_>,
    ) -> Option<u32> {
        router::least_loaded(replicas)
    }
}

chimera_plugin_sdk::export_router!(LeastLoaded);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::testing::Replicas;
    use chimera_plugin_sdk::{ConfigValue, RouteRequestView};

    #[test]
    fn routes_to_least_loaded_and_rejects_config() {
        let mut r = LeastLoaded::init(&Config::default()).unwrap();
        let mut cols = Replicas::default();
        cols.push(4, 4, 10, 100, 0)
            .push(1, 2, 10, 100, 0)
            .push(2, 2, 10, 100, 0);
        assert_eq!(r.route(&RouteRequestView::default(), &cols.view()), Some(1));
        let bad = Config::new(vec![("alpha".into(), ConfigValue::Float(0.5))]);
        assert!(LeastLoaded::init(&bad).is_err());
    }
}
