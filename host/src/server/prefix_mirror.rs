//! A per-replica mirror of the engine's prefix index, kept from that replica's `KvEvent`s, and
//! the prompt block hashing the router uses to probe it.
//!
//! Owns: the set of block hashes a replica has announced as cached (and whether an SSM snapshot
//! exists at each block's boundary). Invariants: the mirror only changes through
//! [`PrefixMirror::apply`]; its size never exceeds `max_blocks` (when an engine announces more
//! than that, the mirror is cleared, which can only cost routing quality, never correctness).
//! It must not decide routes: it answers "how deep does this prompt hit here".
//!
//! [`prompt_block_hashes`] computes exactly what the cache's prefix index computes, by calling
//! the cache's own hash function. The server computes them once per prompt: the router probes
//! the mirrors with them and the engine adopts them (`GenerateRequest::block_hashes`).

use std::collections::HashMap;

use crate::cache::hash::{BlockHash, HashSeed};
use crate::engine::api::KvEvent;

/// Chained hashes of the prompt's full blocks, exactly as the engine's cache computes them
/// (`cache::hash`: `h_i = H(h_{i-1} ‖ tokens of block i)`, seeded with the salt); their
/// [`BlockHash::short`] forms are what `KvEvent`s carry. A trailing partial block has no hash.
pub fn prompt_block_hashes(salt: &str, tokens: &[u32], block_size: u32) -> Vec<BlockHash> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1) as usize);
    HashSeed::new(salt).extend(&mut hashes, tokens, block_size.max(1) as usize);
    hashes
}

/// What a prompt would reuse on one replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Leading prompt blocks cached in KV.
    pub kv_blocks: u32,
    /// Deepest block boundary (in blocks) within the KV hit that has an SSM snapshot.
    pub ssm_blocks: u32,
}

/// One replica's prefix index as announced by its cache events.
#[derive(Debug)]
pub struct PrefixMirror {
    /// hash → snapshot present at this block's end boundary.
    blocks: HashMap<u64, bool>,
    max_blocks: usize,
    /// Times the mirror was dropped for growing past `max_blocks`.
    overflows: u64,
}

impl PrefixMirror {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            max_blocks: max_blocks.max(1),
            overflows: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn overflows(&self) -> u64 {
        self.overflows
    }

    pub fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::Stored { blocks, .. } => {
                for b in blocks {
                    *self.blocks.entry(b.hash).or_insert(false) |= b.snapshot;
                }
                if self.blocks.len() > self.max_blocks {
                    self.blocks.clear();
                    self.overflows += 1;
                }
            }
            KvEvent::Removed { hashes } => {
                for h in hashes {
                    self.blocks.remove(h);
                }
            }
            KvEvent::SnapshotStored { hashes } => {
                for h in hashes {
                    if let Some(snap) = self.blocks.get_mut(h) {
                        *snap = true;
                    }
                }
            }
            KvEvent::SnapshotRemoved { hashes } => {
                for h in hashes {
                    if let Some(snap) = self.blocks.get_mut(h) {
                        *snap = false;
                    }
                }
            }
            KvEvent::Cleared => self.blocks.clear(),
        }
    }

    /// How many leading blocks of `hashes` this replica holds, and the deepest of those with a
    /// snapshot.
    pub fn hit(&self, hashes: &[BlockHash]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        for (i, h) in hashes.iter().enumerate() {
            match self.blocks.get(&h.short()) {
                Some(snap) => {
                    hit.kv_blocks = i as u32 + 1;
                    if *snap {
                        hit.ssm_blocks = i as u32 + 1;
                    }
                }
                None => break,
            }
        }
        hit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(kv_blocks: u32, ssm_blocks: u32) -> PrefixHit {
        PrefixHit {
            kv_blocks,
            ssm_blocks,
        }
    }

    #[test]
    fn hashes_are_chained_and_salted() {
        let a = prompt_block_hashes("m", &[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3);
        let b = prompt_block_hashes("m", &[1, 2, 3, 4, 9, 9], 2);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block content at a different depth hashes differently (chaining).
        let c = prompt_block_hashes("m", &[5, 6], 2);
        assert_ne!(c[0], a[2]);
        assert_ne!(prompt_block_hashes("other", &[1, 2], 2), a[..1]);
    }

    fn short(h: &[BlockHash]) -> Vec<u64> {
        h.iter().map(|h| h.short()).collect()
    }

    #[test]
    fn mirror_tracks_store_remove_snapshot_clear() {
        let h = prompt_block_hashes("m", &[1, 2, 3, 4, 5, 6], 2);
        let mut m = PrefixMirror::new(100);
        m.apply(&KvEvent::chain(&short(&h), &[false, true, false]));
        assert_eq!(m.hit(&h), hit(3, 2));
        m.apply(&KvEvent::SnapshotStored {
            hashes: vec![h[2].short()],
        });
        assert_eq!(m.hit(&h), hit(3, 3));
        m.apply(&KvEvent::SnapshotRemoved {
            hashes: vec![h[1].short(), h[2].short()],
        });
        assert_eq!(m.hit(&h), hit(3, 0));
        m.apply(&KvEvent::Removed {
            hashes: vec![h[1].short()],
        });
        assert_eq!(m.hit(&h), hit(1, 0));
        m.apply(&KvEvent::Cleared);
        assert!(m.is_empty());
        assert_eq!(m.hit(&h), PrefixHit::default());
    }

    #[test]
    fn mirror_is_bounded() {
        let mut m = PrefixMirror::new(2);
        m.apply(&KvEvent::chain(&[1, 2, 3], &[]));
        assert!(m.len() <= 2);
        assert_eq!(m.overflows(), 1);
    }
}
