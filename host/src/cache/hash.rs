//! Chained prefix-block hashes: the keys of the prefix index.
//!
//! Block `i` of a prompt (its `block_size` token ids) hashes to
//! `h_i = SHA-256(h_{i-1} ‖ token ids of block i as u32 little-endian)`, truncated to 128 bits,
//! with `h_{-1} = SHA-256("chimera-prefix-v1" ‖ salt)`. The salt is the model id (and revision):
//! two models never share cache entries. Only *full* blocks are hashed; a partial tail block has
//! no hash. Because each hash covers its whole prefix, equal hashes mean equal prefixes (up to a
//! 2^-64 birthday bound at 2^32 blocks), and a lookup can stop at the first miss.
//!
//! This module only computes hashes; it knows nothing of blocks, pools or requests.

use sha2::{Digest, Sha256};

/// A 128-bit chained block hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The first 8 bytes of the digest, as published in `KvEvent`s for routers.
    pub fn short(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

/// The hash every chain starts from, derived from the salt (model id / revision).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashSeed(BlockHash);

impl HashSeed {
    pub fn new(salt: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"chimera-prefix-v1");
        h.update((salt.len() as u64).to_le_bytes());
        h.update(salt.as_bytes());
        Self(truncate(&h.finalize()))
    }

    /// Hash of one full block given its parent's hash (`None` for the first block).
    pub fn block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let parent = parent.unwrap_or(self.0);
        let mut h = Sha256::new();
        h.update(parent.0.to_be_bytes());
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(buf.len() / 4) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        truncate(&h.finalize())
    }

    /// Extends `hashes` (the chain over the first `hashes.len()` full blocks of `tokens`) to
    /// cover every full block of `tokens`. Existing entries are kept: a chain only grows.
    pub fn extend(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
        let full = tokens.len() / block_size;
        while hashes.len() < full {
            let i = hashes.len();
            let parent = hashes.last().copied();
            let h = self.block(parent, &tokens[i * block_size..(i + 1) * block_size]);
            hashes.push(h);
        }
    }
}

fn truncate(digest: &[u8]) -> BlockHash {
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    BlockHash(u128::from_be_bytes(b))
}

/// A `Hasher` for maps keyed by [`BlockHash`]: the key is already a uniform digest, so the map
/// uses its low 64 bits instead of running SipHash over it.
#[derive(Default, Clone, Copy)]
pub struct DigestHasher(u64);

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys that are not a single u128; fold them in (FNV-1a).
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

pub type DigestBuildHasher = std::hash::BuildHasherDefault<DigestHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_whole_prefix() {
        let s = HashSeed::new("m");
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[3] = 999;
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        s.extend(&mut ha, &a, 16);
        s.extend(&mut hb, &b, 16);
        assert_eq!(ha.len(), 2);
        // Block 1 has the same tokens in both, but its parent differs.
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
    }

    #[test]
    fn equal_blocks_at_different_depths_differ() {
        let s = HashSeed::new("m");
        let zeros = vec![0u32; 64];
        let mut h = Vec::new();
        s.extend(&mut h, &zeros, 16);
        assert_eq!(h.len(), 4);
        for i in 0..4 {
            for j in 0..i {
                assert_ne!(h[i], h[j]);
            }
        }
    }

    #[test]
    fn salt_separates_models() {
        let t: Vec<u32> = (0..16).collect();
        let a = HashSeed::new("model-a").block(None, &t);
        let b = HashSeed::new("model-b").block(None, &t);
        assert_ne!(a, b);
    }

    #[test]
    fn partial_tail_has_no_hash_and_extend_is_incremental() {
        let s = HashSeed::new("m");
        let t: Vec<u32> = (0..40).collect();
        let mut h = Vec::new();
        s.extend(&mut h, &t[..20], 16);
        assert_eq!(h.len(), 1);
        s.extend(&mut h, &t, 16);
        let mut fresh = Vec::new();
        s.extend(&mut fresh, &t, 16);
        assert_eq!(h, fresh);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn short_is_the_leading_eight_bytes() {
        let h = BlockHash(0x0102_0304_0506_0708_1111_2222_3333_4444);
        assert_eq!(h.short(), 0x0102_0304_0506_0708);
    }

    #[test]
    fn known_answer_pins_the_format() {
        // Routers outside this process recompute these hashes; the format must not drift.
        let s = HashSeed::new("");
        let mut seed = Sha256::new();
        seed.update(b"chimera-prefix-v1");
        seed.update(0u64.to_le_bytes());
        let seed = seed.finalize();
        let mut blk = Sha256::new();
        blk.update(&seed[..16]);
        blk.update(1u32.to_le_bytes());
        blk.update(2u32.to_le_bytes());
        let want = truncate(&blk.finalize());
        assert_eq!(s.block(None, &[1, 2]), want);
    }
}
