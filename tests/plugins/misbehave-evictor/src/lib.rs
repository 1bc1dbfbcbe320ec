//! Test-only evictor plugin: the built-in LRU, except on demand.
//!
//! `choose_victims(count, step)` misbehaves by `count`: 13 traps, 14 names a block that is in
//! use, 15 returns more victims than asked. Otherwise it answers
//! like the built-in LRU from its own state, so after a trap the host must rebuild that state
//! in the new instance for the answers to stay right.

use std::collections::BTreeSet;

use chimera_plugin_sdk::algos::lru::LruState;
use chimera_plugin_sdk::{Config, EventsView, EvictorPlugin, event_kind};

pub struct Misbehave {
    lru: LruState,
    in_use: BTreeSet<u32>,
}

impl EvictorPlugin for Misbehave {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self { lru: LruState::new(), in_use: BTreeSet::new() })
    }

    fn on_events(&mut self, events: &EventsView<'_>) {
        for (k, b) in events.kinds.iter().zip(events.blocks) {
            match *k {
                event_kind::STORED | event_kind::HIT => {
                    self.in_use.insert(*b);
                }
                event_kind::RELEASED | event_kind::REMOVED => {
                    self.in_use.remove(b);
                }
                _ => {}
            }
        }
        self.lru.apply(events);
    }

    fn choose_victims(&mut self, count: u32, _step: u64) -> Option<Vec<u32>> {
        match count {
            13 => panic!("deliberate trap"),
            14 => Some(vec![self.in_use.first().copied().unwrap_or(u32::MAX - 1)]),
            15 => Some(vec![0; 16]),
            _ => Some(self.lru.choose_victims(count)),
        }
    }
}

chimera_plugin_sdk::export_evictor!(Misbehave);
