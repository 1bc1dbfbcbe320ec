//! Example router plugin: pins all traffic to replica `replica` (config key, default 0).
//!
//! Built outside the chimera workspace against `chimera-plugin-sdk`, as an author would.
//! Answers "use the default" when the pinned replica does not exist.

use chimera_plugin_sdk::{Config, ReplicaView, RouteRequestView, RouterPlugin};

pub struct PinRouter {
    replica: u32,
}

impl RouterPlugin for PinRouter {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&["replica"])?;
        Ok(Self { replica: config.u32_in("replica", 0, 0, 1024)? })
    }

    fn route(&mut self, _request: &RouteRequestView<'_>, replicas: &ReplicaView<'_>) -> Option<u32> {
        ((self.replica as usize) < replicas.len()).then_some(self.replica)
    }
}

chimera_plugin_sdk::export_router!(PinRouter);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::ConfigValue;
    use chimera_plugin_sdk::testing::Replicas;

    #[test]
    fn pins_and_declines_missing_replica() {
        let cfg = Config::new(vec![("replica".into(), ConfigValue::Integer(2))]);
        let mut r = PinRouter::init(&cfg).unwrap();
        let mut cols = Replicas::default();
        cols.push(0, 0, 1, 1, 0).push(0, 0, 1, 1, 0);
        assert_eq!(r.route(&RouteRequestView::default(), &cols.view()), None);
        cols.push(9, 9, 0, 1, 0);
        assert_eq!(r.route(&RouteRequestView::default(), &cols.view()), Some(2));
    }
}
