//! Native twin of the `lru` evictor, and the host's reference view of evictable blocks.
//!
//! Semantics (shared with the cache's own fallback): evictable = cached with no current user
//! (after `Stored` + `Released`, not `Hit` again); a victim must be a leaf; order by
//! `(last_access_step, block id)` ascending, last access being the step of the latest
//! `Stored`/`Hit`/`Released`; evicting a leaf can make its parent a leaf, which then competes
//! by its own last access. Besides answering, the Wasm evictor adapter uses this state to
//! validate a plugin's victims and to rebuild a fresh plugin instance's view.

use chimera_policy_core::Config;
use chimera_policy_core::lru::{LruState, ReplayEvents, VictimError};

use super::events_view;
use crate::policy::{CacheEvents, Decision, Evictor};

#[derive(Debug, Clone, Default)]
pub struct LruEvictor {
    state: LruState,
}

impl LruEvictor {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn from_config(config: &Config) -> Result<Self, String> {
        config.expect_keys(&[])?;
        Ok(Self::new())
    }

    /// Checks that evicting `victims` in this order is allowed right now.
    pub fn validate(&mut self, victims: &[u32]) -> Result<(), VictimError> {
        self.state.validate_victims(victims)
    }

    /// Events that rebuild the current view from empty, parents first.
    pub fn replay(&self) -> CacheEvents {
        let mut r = ReplayEvents::default();
        self.state.replay_events(&mut r);
        CacheEvents {
            kinds: r.kinds,
            blocks: r.blocks,
            parents: r.parents,
            steps: r.steps,
        }
    }

    /// Cached blocks currently known.
    pub fn cached_blocks(&self) -> usize {
        self.state.len()
    }

    /// Evictable leaves right now.
    pub fn evictable_leaves(&self) -> usize {
        self.state.evictable_leaves()
    }
}

impl Evictor for LruEvictor {
    fn on_events(&mut self, events: &CacheEvents) {
        self.state.apply(&events_view(events));
    }

    fn choose_victims(&mut self, count: u32, _step: u64) -> Decision<Vec<u32>> {
        Decision::Use(self.state.choose_victims(count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::EventKind;

    #[test]
    fn lru_contract_through_the_trait() {
        let mut lru = LruEvictor::new();
        let mut ev = CacheEvents::default();
        // Chain 1 <- 2 <- 3 and a lone block 9, all released at different steps.
        ev.push(EventKind::Stored, 1, u32::MAX, 1);
        ev.push(EventKind::Stored, 2, 1, 1);
        ev.push(EventKind::Stored, 3, 2, 1);
        ev.push(EventKind::Stored, 9, u32::MAX, 2);
        ev.push(EventKind::Released, 3, 0, 4);
        ev.push(EventKind::Released, 2, 0, 4);
        ev.push(EventKind::Released, 1, 0, 4);
        ev.push(EventKind::Released, 9, 0, 5);
        lru.on_events(&ev);
        assert_eq!(lru.choose_victims(4, 6), Decision::Use(vec![3, 2, 1, 9]));
        // Re-hit block 9: in use again, not evictable.
        ev.clear();
        ev.push(EventKind::Hit, 9, 0, 6);
        lru.on_events(&ev);
        assert_eq!(lru.choose_victims(4, 7), Decision::Use(vec![3, 2, 1]));
        assert!(lru.validate(&[9]).is_err());
        assert!(lru.validate(&[2]).is_err(), "2 still has child 3");
        // Removal of 3 makes 2 a leaf.
        ev.clear();
        ev.push(EventKind::Removed, 3, 0, 7);
        lru.on_events(&ev);
        assert_eq!(lru.choose_victims(1, 8), Decision::Use(vec![2]));
        assert_eq!(lru.cached_blocks(), 3);
        assert_eq!(lru.replay().len(), 3 + 2, "three stored, two released");
    }
}
