//! Test router plugin using the host functions of ABI 0.1.1: it logs a line at `init`, then
//! routes to replica 0 until `switch_after_ms` (config, default 200) have passed on the host
//! clock since `init`, and to replica 1 after that. Loads only with grants = ["clock", "log"].

use chimera_plugin_sdk::host::{self, Level};
use chimera_plugin_sdk::{Config, ReplicaView, RouteRequestView, RouterPlugin};

pub struct ClockRouter {
    started_ns: u64,
    switch_after_ns: u64,
}

impl RouterPlugin for ClockRouter {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&["switch_after_ms"])?;
        let ms = config.u32_in("switch_after_ms", 200, 1, 60_000)?;
        host::log(Level::Info, "clock router ready");
        Ok(Self { started_ns: host::now_ns(), switch_after_ns: u64::from(ms) * 1_000_000 })
    }

    fn route(&mut self, _request: &RouteRequestView<'_>, replicas: &ReplicaView<'_>) -> Option<u32> {
        let late = host::now_ns().saturating_sub(self.started_ns) >= self.switch_after_ns;
        let replica = u32::from(late);
        ((replica as usize) < replicas.len()).then_some(replica)
    }
}

chimera_plugin_sdk::export_router!(ClockRouter);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::testing::{Replicas, set_now_ns};

    #[test]
    fn switches_after_the_configured_time() {
        set_now_ns(1_000);
        let mut r = ClockRouter::init(&Config::default()).unwrap();
        let mut cols = Replicas::default();
        cols.push(0, 0, 1, 1, 0).push(0, 0, 1, 1, 0);
        assert_eq!(r.route(&RouteRequestView::default(), &cols.view()), Some(0));
        set_now_ns(1_000 + 200_000_000);
        assert_eq!(r.route(&RouteRequestView::default(), &cols.view()), Some(1));
    }
}
