//! [`KvEvent`]: the block-level events the cache publishes for routers and metrics.
//!
//! The cache manager collects them during a step and hands them out only after the step that
//! made them succeeded; the engine forwards them unchanged. Hashes are the first 8 bytes of the
//! prefix-index block hashes ([`super::BlockHash::short`]), so a router can mirror each
//! replica's prefix index exactly. Within one step's events, `Removed` and `SnapshotRemoved`
//! come before `Stored` and `SnapshotStored`, and a stored block comes after its parent.

/// A block newly in the prefix index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    pub hash: u64,
    /// The block before it in its sequence; `None` for a sequence's first block.
    pub parent: Option<u64>,
    /// Whether an SSM snapshot of the state after this block's last token is kept.
    pub snapshot: bool,
}

/// A block-level cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks indexed, with their tokens: `tokens` holds `block_size` ids per block, in the
    /// order of `blocks` (external routers hash tokens their own way).
    Stored {
        blocks: Vec<StoredBlock>,
        tokens: Vec<u32>,
    },
    /// Blocks indexed earlier that now have an SSM snapshot.
    SnapshotStored { hashes: Vec<u64> },
    /// Blocks no longer in the index (their snapshots went with them).
    Removed { hashes: Vec<u64> },
    /// Blocks still indexed whose snapshot was given up.
    SnapshotRemoved { hashes: Vec<u64> },
    /// Everything cached is gone.
    Cleared,
}

impl KvEvent {
    /// A `Stored` event of one chain of blocks (each the parent of the next), without tokens:
    /// what a test or a router simulation needs.
    pub fn chain(hashes: &[u64], snapshot: &[bool]) -> Self {
        let blocks = hashes
            .iter()
            .enumerate()
            .map(|(i, &hash)| StoredBlock {
                hash,
                parent: i.checked_sub(1).map(|p| hashes[p]),
                snapshot: snapshot.get(i).copied().unwrap_or(false),
            })
            .collect();
        Self::Stored {
            blocks,
            tokens: Vec::new(),
        }
    }

    /// The event's name, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Stored { .. } => "stored",
            Self::SnapshotStored { .. } => "snapshot_stored",
            Self::Removed { .. } => "removed",
            Self::SnapshotRemoved { .. } => "snapshot_removed",
            Self::Cleared => "cleared",
        }
    }

    /// A `Stored` event's tokens of block `i` (empty for other events or out of range).
    pub fn block_tokens(&self, i: usize) -> &[u32] {
        match self {
            Self::Stored { blocks, tokens } if i < blocks.len() => {
                let bs = tokens.len() / blocks.len();
                &tokens[i * bs..(i + 1) * bs]
            }
            _ => &[],
        }
    }
}
