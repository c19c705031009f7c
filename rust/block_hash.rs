//! Chained 128-bit hashes of full KV blocks, the keys of the prefix cache.
//!
//! `hash(block k) = xxh3_128(hash(block k-1) || extra-key hash || token ids of block k)`, so a
//! block's hash names its whole prefix. The extra key (cache salt, adapter id) separates cache
//! namespaces: the same tokens under another salt hash differently and never hit.
//!
//! A hash is only a candidate: the prefix cache verifies every hit against the stored token ids
//! and the parent link (block_pool.rs), so even a full collision cannot serve another
//! sequence's KV. [`HashMode::Truncated`] exists to prove that in tests: it keeps only a few
//! bits of each hash (0 bits: every block hashes alike), so collisions are the rule.

use std::sync::Arc;

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

/// 128-bit hash of a full block and, through the chain, of its whole prefix.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// The index key of a block hash: the 128-bit chained hash folded to 64 bits. A block pool
/// keys its prefix-cache index by it (half the entry size, so fewer cache misses on the
/// decode path) and never holds two registered blocks with one key; it is also the block's
/// hash on the wire of KV-cache events ([`crate::kv_events`]). It lives here, with the hash it
/// folds, so that both the pool and the events read it from below.
#[inline]
pub fn index_key(hash: BlockHash) -> u64 {
    (hash.0 as u64) ^ ((hash.0 >> 64) as u64)
}

/// The extra key of a sequence's blocks: an optional cache salt and the KV cache group the
/// blocks belong to (kv_cache_manager/kv_groups.rs: each group's blocks hold other
/// layers, so the same tokens in two groups are two contents), with its hash precomputed.
/// Equality compares the salt itself and the group, never only the hash.
#[derive(Clone, Debug, Default)]
pub struct ExtraKey {
    salt: Option<Arc<str>>,
    group: u32,
    hash: u64,
}

impl ExtraKey {
    /// The key for `salt` (`None`: the shared, unsalted namespace) in group 0.
    pub fn new(salt: Option<&str>) -> Self {
        match salt {
            None => ExtraKey::default(),
            // Salted keys hash their bytes; the unsalted key hashes to 0. A salt whose hash is 0
            // is still told apart by verification, which compares the strings.
            Some(s) => ExtraKey { salt: Some(Arc::from(s)), group: 0, hash: xxh3_64(s.as_bytes()) | 1 },
        }
    }

    /// The same salt in group `group`. Group 0 keeps the key's hash, so a model with one
    /// group hashes its blocks exactly as before groups existed (KV events and routers
    /// that recompute hashes from tokens agree with it).
    pub fn for_group(&self, group: u32) -> Self {
        let base = self.salt.as_deref().map_or(0, |s| xxh3_64(s.as_bytes()) | 1);
        let hash = if group == 0 { base } else { base ^ xxh3_64(&(u64::from(group) | (1 << 40)).to_le_bytes()) };
        ExtraKey { salt: self.salt.clone(), group, hash }
    }

    /// The salt, if any.
    pub fn salt(&self) -> Option<&str> {
        self.salt.as_deref()
    }

    /// The KV cache group.
    pub fn group(&self) -> u32 {
        self.group
    }
}

impl PartialEq for ExtraKey {
    fn eq(&self, other: &Self) -> bool {
        self.salt == other.salt && self.group == other.group
    }
}

impl Eq for ExtraKey {}

/// How block hashes are computed.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum HashMode {
    /// xxh3-128 over the chained input (production).
    #[default]
    Xxh3,
    /// Test hook: only the low `n` bits of the xxh3 hash are kept (`n` < 128), so different
    /// blocks collide often (always, for 0 bits) and only verification tells them apart.
    Truncated(u8),
}

/// Computes chained block hashes, reusing one scratch buffer.
#[derive(Debug, Default, Clone)]
pub struct BlockHasher {
    mode: HashMode,
    scratch: Vec<u8>,
}

impl BlockHasher {
    /// A hasher in the given mode.
    pub fn new(mode: HashMode) -> Self {
        BlockHasher { mode, scratch: Vec::new() }
    }

    /// The mode in use.
    pub fn mode(&self) -> HashMode {
        self.mode
    }

    /// Hash of one full block given its parent's hash (`None` for the first block).
    pub fn hash_block(&mut self, parent: Option<BlockHash>, extra: &ExtraKey, tokens: &[u32]) -> BlockHash {
        let buf = &mut self.scratch;
        buf.clear();
        buf.reserve(25 + 4 * tokens.len());
        match parent {
            // The marker byte keeps "no parent" apart from a parent whose hash is 0.
            Some(p) => {
                buf.push(1);
                buf.extend_from_slice(&p.0.to_le_bytes());
            }
            None => {
                buf.push(0);
                buf.extend_from_slice(&[0u8; 16]);
            }
        }
        buf.extend_from_slice(&extra.hash.to_le_bytes());
        for &t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let h = xxh3_128(buf);
        match self.mode {
            HashMode::Xxh3 => BlockHash(h),
            HashMode::Truncated(bits) if bits >= 128 => BlockHash(h),
            HashMode::Truncated(bits) => BlockHash(h & ((1u128 << bits) - 1)),
        }
    }

    /// Appends to `hashes` the chained hashes of the full blocks of `tokens` that are not
    /// hashed yet (`hashes` holds the first blocks' hashes already), up to `max_blocks` in all.
    pub fn extend_chain(
        &mut self,
        hashes: &mut Vec<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKey,
        max_blocks: usize,
    ) {
        self.extend_with(hashes, tokens, block_size, extra, max_blocks, |hashes, k| k.checked_sub(1).map(|p| hashes[p]));
    }

    /// Extends `hashes` with the *leaf* hashes of the first full blocks of `tokens` (at most
    /// `max_blocks`) under `extra`: block `k`'s hash chains from `trunk[k - 1]` (the trunk
    /// chain's hash of the block before it; none for a first block), not from `hashes[k - 1]`.
    /// KV cache groups hash every group but group 0 this way (kv_cache_manager/kv_groups.rs,
    /// "Prefix caching with groups"), so a block's hash needs no hash of its own group before it.
    /// `trunk` must hold at least the first `min(full, max_blocks) - 1` hashes.
    pub fn extend_leaves(
        &mut self,
        hashes: &mut Vec<BlockHash>,
        trunk: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKey,
        max_blocks: usize,
    ) {
        self.extend_with(hashes, tokens, block_size, extra, max_blocks, |_, k| k.checked_sub(1).map(|p| trunk[p]));
    }

    /// Appends the hashes of the full blocks of `tokens` not hashed yet, up to `max_blocks`
    /// in all, block `k` chained from `parent(hashes, k)`.
    fn extend_with(
        &mut self,
        hashes: &mut Vec<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKey,
        max_blocks: usize,
        parent: impl Fn(&[BlockHash], usize) -> Option<BlockHash>,
    ) {
        let full = (tokens.len() / block_size).min(max_blocks);
        while hashes.len() < full {
            let k = hashes.len();
            let h = self.hash_block(parent(hashes, k), extra, &tokens[k * block_size..(k + 1) * block_size]);
            hashes.push(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix_tokens_and_salt() {
        let mut h = BlockHasher::new(HashMode::Xxh3);
        let none = ExtraKey::new(None);
        let a = h.hash_block(None, &none, &[1, 2, 3, 4]);
        let b = h.hash_block(None, &none, &[1, 2, 3, 5]);
        assert_ne!(a, b);
        assert_eq!(a, h.hash_block(None, &none, &[1, 2, 3, 4]));
        // Same block tokens, different parents.
        let c1 = h.hash_block(Some(a), &none, &[7, 7, 7, 7]);
        let c2 = h.hash_block(Some(b), &none, &[7, 7, 7, 7]);
        assert_ne!(c1, c2);
        // Salt separates namespaces.
        let salted = ExtraKey::new(Some("tenant-1"));
        assert_ne!(a, h.hash_block(None, &salted, &[1, 2, 3, 4]));
        assert_ne!(ExtraKey::new(Some("x")), ExtraKey::new(None));
        assert_eq!(ExtraKey::new(Some("x")), ExtraKey::new(Some("x")));
    }

    #[test]
    fn extend_chain_hashes_only_full_blocks() {
        let mut h = BlockHasher::new(HashMode::Xxh3);
        let key = ExtraKey::new(None);
        let tokens: Vec<u32> = (0..10).collect();
        let mut hashes = Vec::new();
        h.extend_chain(&mut hashes, &tokens, 4, &key, usize::MAX);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[1], h.hash_block(Some(hashes[0]), &key, &[4, 5, 6, 7]));
        let mut capped = Vec::new();
        h.extend_chain(&mut capped, &tokens, 4, &key, 1);
        assert_eq!(capped, hashes[..1]);
    }

    #[test]
    fn truncated_mode_collides() {
        let mut h = BlockHasher::new(HashMode::Truncated(0));
        let key = ExtraKey::new(None);
        assert_eq!(h.hash_block(None, &key, &[1]), h.hash_block(None, &key, &[2]));
    }
}
