//! Test-only router plugin that misbehaves on demand, to exercise the host's fallback path.
//!
//! Normally routes to replica `replica` (config key). The request's tenant selects a
//! misbehaviour: `trap` panics (a Wasm trap), `loop` never returns, `bomb` allocates until
//! memory runs out, `wrong` answers an out-of-range replica, `decline` answers "use the
//! default". `init` fails when the config has `reject = true`; with `tenant = "NAME"` every
//! request behaves as if it came from tenant NAME.

use std::hint::black_box;

use chimera_plugin_sdk::{Config, ReplicaView, RouteRequestView, RouterPlugin};

pub struct Misbehave {
    replica: u32,
    tenant: Option<String>,
    hoard: Vec<Vec<u8>>,
}

impl RouterPlugin for Misbehave {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&["replica", "reject", "tenant"])?;
        if config.bool_or("reject", false)? {
            return Err("configured to reject its config".into());
        }
        Ok(Self {
            replica: config.u32_in("replica", 0, 0, 1024)?,
            tenant: config.text("tenant")?.map(str::to_string),
            hoard: Vec::new(),
        })
    }

    fn route(&mut self, request: &RouteRequestView<'_>, replicas: &ReplicaView<'_>) -> Option<u32> {
        match self.tenant.as_deref().unwrap_or(request.tenant) {
            "trap" => panic!("deliberate trap"),
            "loop" => {
                let mut x = 0u64;
                loop {
                    x = black_box(x.wrapping_add(1));
                }
            }
            "bomb" => loop {
                self.hoard.push(vec![1u8; 1 << 20]);
                black_box(&self.hoard);
            },
            "wrong" => Some(replicas.len() as u32 + 7),
            "decline" => None,
            _ => Some(self.replica),
        }
    }
}

chimera_plugin_sdk::export_router!(Misbehave);
