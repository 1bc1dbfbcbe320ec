//! Built-in evictor `lru`: least recently used evictable leaf first, parent never before child.
//!
//! Keeps its view of the cache from events; see `chimera_policy_core::lru` for the exact
//! semantics, shared with the host's native twin and the cache's own fallback. No config keys.

use chimera_plugin_sdk::algos::lru::LruState;
use chimera_plugin_sdk::{Config, EventsView, EvictorPlugin};

pub struct Lru(LruState);

impl EvictorPlugin for Lru {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self(LruState::new()))
    }

    fn on_events(&mut self, events: &EventsView<'_>) {
        self.0.apply(events);
    }

    fn choose_victims(&mut self, count: u32, _step: u64) -> Option<Vec<u32>> {
        Some(self.0.choose_victims(count))
    }
}

chimera_plugin_sdk::export_evictor!(Lru);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::NO_PARENT;
    use chimera_plugin_sdk::testing::Events;

    #[test]
    fn evicts_child_before_parent() {
        let mut lru = Lru::init(&Config::default()).unwrap();
        let mut ev = Events::default();
        ev.stored(7, NO_PARENT, 1)
            .stored(8, 7, 2)
            .released(7, 3)
            .released(8, 9);
        lru.on_events(&ev.view());
        assert_eq!(lru.choose_victims(2, 10), Some(vec![8, 7]));
    }
}
