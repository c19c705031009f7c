//! Prefix-cache lookups over every tier and every group: the verified cached prefix a new
//! sequence can start from, and what admitting it costs the pools.

use crate::attention_span::AttentionSpan;
use crate::block_hash::{BlockHash, ExtraKey};
use crate::block_pool::ChainLink;
use crate::block_table::blocks_for;
use crate::ids::BlockId;

use super::tier_ledger::{Tier, TierBlock};
use super::KvCacheManager;

/// The verified cached prefix of one group (part of a [`PrefixMatch`]).
#[derive(Debug, Clone, Default)]
pub struct GroupMatch {
    /// Cached blocks holding the group's first `hits.len() * block_size` tokens, in order; a
    /// block found only on the host is loaded into a fresh device block at admission. In a
    /// group other than 0 an entry may be [`BlockId::NULL`] (not found): only a group's live
    /// hits must be found, and a sliding group's earlier entries are never read.
    pub hits: Vec<TierBlock>,
    /// Chained hashes computed on the way (at least one per hit block).
    pub hashes: Vec<BlockHash>,
    /// How the chain continues after the last hit.
    pub(super) link: ChainLink,
}

/// The verified cached prefix of a token sequence (from [`KvCacheManager::match_prefix`]):
/// the longest prefix every group can serve, so every group has as many hits (a sliding or
/// chunked group needs only the hits a query after the prefix still sees; admission takes
/// those).
#[derive(Debug, Clone, Default)]
pub struct PrefixMatch {
    /// One per group, group 0 first (empty: no hits in any group).
    pub groups: Vec<GroupMatch>,
    /// The pools' eviction counts when matched: if blocks were evicted since, the match may
    /// be stale and is redone.
    pub(super) evictions_at_match: u64,
}

impl PrefixMatch {
    /// Number of cached blocks (per group).
    pub fn num_blocks(&self) -> usize {
        self.groups.first().map_or(0, |c| c.hits.len())
    }

    /// Number of cached tokens.
    pub fn num_tokens(&self, block_size: usize) -> usize {
        self.num_blocks() * block_size
    }

    /// Number of hits found only on the host (all groups).
    pub fn num_host_blocks(&self) -> usize {
        self.groups.iter().flat_map(|c| &c.hits).filter(|h| h.tier == Tier::Host).count()
    }

    /// Number of hits found only on disk (all groups).
    pub fn num_disk_blocks(&self) -> usize {
        self.groups.iter().flat_map(|c| &c.hits).filter(|h| h.tier == Tier::Disk).count()
    }
}

/// Prefix-cache lookups, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCounters {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Of those, tokens found cached (on either tier).
    pub hits: u64,
    /// Of the hits, tokens found only on the host (loaded back to the device).
    pub host_hits: u64,
    /// Of the hits, tokens found only on disk (read to the host, then loaded to the device).
    pub disk_hits: u64,
    /// Of the hits, tokens served while a group other than 0 lacked blocks before the ones
    /// its next query sees (KV cache groups: a sliding group served from its window alone).
    pub window_hits: u64,
}

impl KvCacheManager {
    /// Evictions of every pool so far (a match older than the last one may be stale).
    pub(super) fn evictions(&self) -> u64 {
        self.pool.counters().evictions + self.ledger.evictions()
    }

    /// The longest verified cached prefix of `tokens` under `extra` that every group holds,
    /// leaving at least one token to compute: device hits first at each position, then host
    /// hits, then disk hits. Changes nothing.
    pub fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKey) -> PrefixMatch {
        let mut m = self.no_prefix_match();
        if !self.pool.prefix_caching() || tokens.is_empty() {
            return m;
        }
        let bs = self.block_size();
        // Group 0 (the trunk) walks its chain of verified nodes.
        let limit = (tokens.len() - 1) / bs;
        let (trunk, leaves) = m.groups.split_first_mut().expect("a manager has at least one group");
        self.hasher.extend_chain(&mut trunk.hashes, tokens, bs, extra, limit);
        let mut nodes: Vec<u64> = Vec::new();
        for (k, &h) in trunk.hashes.iter().take(limit).enumerate() {
            let Some((hit, node)) = self.lookup_tiers(h, nodes.last().copied(), &tokens[k * bs..(k + 1) * bs], extra) else {
                break;
            };
            trunk.hits.push(hit);
            nodes.push(node);
        }
        trunk.link = nodes.last().map_or(ChainLink::Root, |&n| ChainLink::Node(n));
        let mut len = trunk.hits.len();
        if leaves.is_empty() || len == 0 {
            return m;
        }
        // Every other group's block k is a leaf of the trunk's node k - 1, so it is verified
        // on its own: a sliding group serves a prefix from the blocks its next query sees
        // even when the blocks before them were evicted. The hit is the longest prefix every
        // group can serve (for a sliding group, one whose live blocks are all found).
        // A block not found is a null entry: a prefix whose live hits include one is not served.
        let missing = TierBlock { tier: Tier::Device, block: BlockId::NULL };
        for (c, group) in leaves.iter_mut().enumerate() {
            let key = extra.for_group(c as u32 + 1);
            self.hasher.extend_leaves(&mut group.hashes, &trunk.hashes, tokens, bs, &key, len);
            group.hits = (0..len)
                .map(|k| {
                    let parent = k.checked_sub(1).map(|p| nodes[p]);
                    let found = self.lookup_tiers(group.hashes[k], parent, &tokens[k * bs..(k + 1) * bs], &key);
                    found.map_or(missing, |(hit, _)| hit)
                })
                .collect();
        }
        while len > 0 && !self.serves(&m, len, false) {
            len -= 1;
        }
        self.truncate_match(&mut m, len);
        m
    }

    /// Whether every group of `m` has found its live hits of the prefix of `len` blocks
    /// (a leaf group's other entries may be null: blocks not found, never read), for a
    /// sequence that keeps all its blocks when `keep_all` (every entry must be found).
    pub(super) fn serves(&self, m: &PrefixMatch, len: usize, keep_all: bool) -> bool {
        let bs = self.block_size();
        m.groups.iter().zip(&self.spans).all(|(group, &span)| {
            group.hits.len() >= len && group.hits[Self::live_hits(span, len, bs, keep_all)].iter().all(|h| !h.block.is_null())
        })
    }

    /// The verified cached block for `hash` (its parent node `parent`, its `tokens`, its
    /// `extra` key) on the device, else the host, else the disk tier, with its node.
    fn lookup_tiers(&self, hash: BlockHash, parent: Option<u64>, tokens: &[u32], extra: &ExtraKey) -> Option<(TierBlock, u64)> {
        match self.pool.lookup_verified(hash, parent, tokens, extra) {
            Some((block, node)) => Some((TierBlock { tier: Tier::Device, block }, node)),
            None => self.ledger.lookup(hash, parent, tokens, extra),
        }
    }

    /// The node of a cached block on any tier.
    fn node_of(&self, b: TierBlock) -> Option<u64> {
        match b.tier {
            Tier::Device => self.pool.node_of(b.block),
            tier => self.ledger.pool(tier).and_then(|p| p.node_of(b.block)),
        }
    }

    /// Cuts every group of `m` to its first `keep` hits (the chain continues after the last).
    pub(super) fn truncate_match(&self, m: &mut PrefixMatch, keep: usize) {
        for group in &mut m.groups {
            if group.hits.len() > keep {
                group.hits.truncate(keep);
                group.link = match group.hits.last() {
                    None => ChainLink::Root,
                    Some(h) if h.block.is_null() => ChainLink::Broken, // a leaf group's unused entry
                    Some(h) => self.node_of(*h).map_or(ChainLink::Broken, ChainLink::Node),
                };
            }
        }
    }

    /// A match with no hits, current with the pools' evictions (so `add_sequence` keeps it as
    /// it is): the sequence computes every token, and its full blocks are still registered.
    pub fn no_prefix_match(&self) -> PrefixMatch {
        PrefixMatch { groups: vec![GroupMatch::default(); self.spans.len()], evictions_at_match: self.evictions() }
    }

    /// The hits of each group a sequence admitted with `hits` cached blocks keeps: those a
    /// query at the first position after them still sees (all of them in a full group, and
    /// in every group for a sequence that keeps all its blocks).
    #[inline]
    pub(super) fn live_hits(span: AttentionSpan, hits: usize, block_size: usize, keep_all: bool) -> std::ops::Range<usize> {
        if keep_all {
            return 0..hits;
        }
        span.dead_blocks(hits * block_size, block_size)..hits
    }

    /// Blocks a new sequence takes from the free device pool to get `m`'s cached prefix plus
    /// slots for `num_new_tokens` more tokens: fresh blocks (for new tokens and for host hits),
    /// plus the cached device blocks that are free now (taking them removes them from the
    /// free queue), in every group.
    pub fn admission_cost(&self, m: &PrefixMatch, num_new_tokens: usize) -> usize {
        self.admission_cost_keeping(m, num_new_tokens, false)
    }

    /// [`Self::admission_cost`] of a sequence that keeps all its blocks when `keep_all` (it
    /// takes every hit of every group, see [`super::AddSequence::keep_all`]).
    pub fn admission_cost_keeping(&self, m: &PrefixMatch, num_new_tokens: usize, keep_all: bool) -> usize {
        let bs = self.block_size();
        let k = m.num_blocks();
        let fresh = blocks_for(k * bs + num_new_tokens, bs) - k;
        let mut cost = fresh * self.spans.len();
        for (c, &span) in self.spans.iter().enumerate() {
            let Some(group) = m.groups.get(c) else { continue };
            // A leaf entry not found (null) is computed in a fresh block, if the sequence keeps
            // it (admission then takes a shorter hit: this counts about what that costs).
            cost += group.hits[Self::live_hits(span, k, bs, keep_all)]
                .iter()
                .filter(|h| h.block.is_null() || h.tier != Tier::Device || self.pool.ref_count_unchecked(h.block) == 0)
                .count();
        }
        cost
    }

    /// Whether the pools have room to take the live hits of `m`'s first `k` blocks: a host hit
    /// needs a fresh device block, a disk hit a fresh host block too (free blocks that are
    /// hits themselves are taken out of the free queue first, so they do not count as room).
    pub(super) fn hits_fit(&self, m: &PrefixMatch, k: usize, keep_all: bool) -> bool {
        let bs = self.block_size();
        let host = self.ledger.host();
        let (mut device_need, mut host_need, mut device_revived, mut host_revived) = (0usize, 0usize, 0usize, 0usize);
        for (group, &span) in m.groups.iter().zip(&self.spans) {
            for hit in &group.hits[Self::live_hits(span, k, bs, keep_all)] {
                match hit.tier {
                    Tier::Device => device_revived += usize::from(self.pool.ref_count_unchecked(hit.block) == 0),
                    Tier::Host => {
                        device_need += 1;
                        host_revived += usize::from(host.is_some_and(|h| h.ref_count_unchecked(hit.block) == 0));
                    }
                    Tier::Disk => {
                        device_need += 1;
                        host_need += 1;
                    }
                }
            }
        }
        let device_room = self.pool.num_free() - device_revived;
        let host_room = host.map_or(0, |h| h.num_free() - host_revived);
        device_need <= device_room && host_need <= host_room
    }

    /// Blocks of the cached prefix of `tokens` (no salt) a new sequence would find (tests).
    #[cfg(test)]
    pub(crate) fn cached_prefix_blocks(&mut self, tokens: &[u32]) -> usize {
        self.match_prefix(tokens, &ExtraKey::new(None)).num_blocks()
    }
}
