//! A sequence's KV cache groups over one pool: giving slots (fresh blocks, copy-on-write of a
//! shared partial block, give-back behind a sliding or chunked window), offering full blocks to
//! the prefix cache, and releasing blocks with their retention. Free functions over the pieces of
//! the manager they touch, so that the manager can lend them disjoint fields.
//!
//! KV cache groups ([`super::KvCacheManager::with_kv_groups`]): a sequence has one block table per
//! *group*, each with an [`AttentionSpan`], all over the same tokens and the same pool. A
//! sliding or chunked group gives back, when a step gives the sequence slots, the blocks no
//! query from `write_start` on can see (registered first; their entries become
//! [`BlockId::NULL`]); allocation and admission count those blocks net.
//!
//! Prefix caching with groups. Group 0 is the *trunk*: its blocks chain as a one-group
//! sequence's do (a node per block, naming its parent's node). Every other group's block `k`
//! is a *leaf* of the trunk: its hash chains from the trunk's hash of block `k - 1`
//! ([`BlockHasher::extend_leaves`]) and its parent is the trunk's node of block `k - 1`, so it
//! is verified without any block of its own group before it. A prefix hit is the longest one
//! whose live blocks every group finds (module `prefix`).

use crate::attention_span::AttentionSpan;
use crate::block_hash::BlockHasher;
use crate::block_pool::BlockPool;
use crate::block_table::blocks_for;
use crate::eviction_queue::{Retention, DEFAULT_RETENTION_PRIORITY};
use crate::ids::BlockId;
use smallvec::SmallVec;

use super::sequence::{GroupTable, RetentionPolicy, Sequence};
use super::tier_ledger::{BlockPair, Tier};

/// What giving slots to `n` more tokens of `seq` takes from the pool, over its groups:
/// the blocks it needs (fresh ones and copy-on-write copies) and the blocks it gives back
/// to the free pool first (held by it alone, and behind every query from its next
/// position on).
pub(super) fn allocation_need(pool: &BlockPool, spans: &[AttentionSpan], seq: &Sequence, n: usize) -> (usize, usize) {
    if n == 0 {
        return (0, 0);
    }
    let bs = pool.block_size();
    let fresh = blocks_for(seq.num_computed + n, bs) - seq.groups[0].table.len();
    if let ([group], [AttentionSpan::Full]) = (&seq.groups[..], spans) {
        // One full group (no groups): nothing is ever given back.
        return (fresh + usize::from(cow_index(pool, group, seq.num_computed).is_some()), 0);
    }
    let (mut need, mut freed) = (fresh * seq.groups.len(), 0);
    for (group, &span) in seq.groups.iter().zip(spans) {
        need += usize::from(cow_index(pool, group, seq.num_computed).is_some());
        if !span.is_full() && !seq.keep_all {
            let dead = span.dead_blocks(seq.num_computed, bs).min(group.table.len());
            let behind = &group.table.blocks()[group.num_released.min(dead)..dead];
            freed += behind.iter().filter(|&&b| pool.ref_count_unchecked(b) == 1).count();
        }
    }
    (need, freed)
}

/// Gives slots to the next `n` pending tokens of the device sequence `seq`
/// (`n <= seq.num_pending()`), as `KvCacheManager::allocate_slots` describes. All-or-nothing:
/// false and no change when the pool has too few free blocks.
pub(super) fn allocate_slots(
    pool: &mut BlockPool,
    hasher: &mut BlockHasher,
    copy_ops: &mut Vec<BlockPair>,
    spans: &[AttentionSpan],
    seq: &mut Sequence,
    n: usize,
) -> bool {
    if n == 0 {
        return true;
    }
    if let ([group], [AttentionSpan::Full]) = (&mut seq.groups[..], spans) {
        // One full group (a model without groups): the decode path as it was before
        // groups, with nothing to give back.
        let target = seq.num_computed + n;
        let fresh = blocks_for(target, pool.block_size()) - group.table.len();
        let cow = cow_index(pool, group, seq.num_computed);
        if fresh + usize::from(cow.is_some()) > pool.num_free() {
            return false;
        }
        copy_on_write(pool, copy_ops, group, cow);
        pool.allocate_into(fresh, group.table.blocks_mut());
        seq.write_start = seq.num_computed;
        seq.num_computed = target;
        let upto = target.min(seq.prompt_len);
        register_full_blocks(pool, hasher, &seq.tokens, target, seq.tier, group, upto);
        return true;
    }
    let (need, freed) = allocation_need(pool, spans, seq, n);
    if need > pool.num_free() + freed {
        return false;
    }
    let bs = pool.block_size();
    let target = seq.num_computed + n;
    let fresh = blocks_for(target, bs) - seq.groups[0].table.len();
    let Sequence { tokens, groups, num_computed, tier, prompt_len, retention, keep_all, .. } = seq;
    // Every group gives back first, so that any group's allocation can use those blocks.
    // What it gives back is registered first, so that it stays a prefix-cache candidate
    // until evicted: the trunk (group 0) as far as any group gives back, then each
    // giving group (a leaf block links to the trunk's block before it).
    let dead: SmallVec<[usize; 8]> = groups
        .iter()
        .zip(spans)
        .map(|(group, &span)| if span.is_full() || *keep_all { 0 } else { span.dead_blocks(*num_computed, bs).min(group.table.len()) })
        .collect();
    let furthest = groups.iter().zip(&dead).filter(|(group, &d)| d > group.num_released).map(|(_, &d)| d).max();
    if let Some(furthest) = furthest {
        let (trunk, leaves) = groups.split_first_mut().expect("a manager has at least one group");
        register_full_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, furthest * bs);
        for (group, &d) in leaves.iter_mut().zip(&dead[1..]) {
            if d > group.num_released {
                register_leaf_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, group, d * bs);
            }
        }
        for (group, &d) in groups.iter_mut().zip(&dead) {
            release_behind(pool, *prompt_len, retention, group, d);
        }
    }
    for group in groups.iter_mut() {
        let cow = cow_index(pool, group, *num_computed);
        copy_on_write(pool, copy_ops, group, cow);
        let allocated = pool.allocate_into(fresh, group.table.blocks_mut());
        debug_assert!(allocated, "checked above: enough free blocks");
    }
    seq.write_start = seq.num_computed;
    seq.num_computed = target;
    let upto = seq.num_computed.min(seq.prompt_len);
    register_all(pool, hasher, seq, upto);
    true
}

/// The logical index of the shared partial block the group's next write would go into
/// (copy-on-write needed), if any.
#[inline]
fn cow_index(pool: &BlockPool, group: &GroupTable, num_computed: usize) -> Option<usize> {
    let bs = pool.block_size();
    if num_computed.is_multiple_of(bs) {
        return None; // the next write starts a fresh block
    }
    let i = num_computed / bs;
    (pool.ref_count_unchecked(group.table.blocks()[i]) > 1).then_some(i)
}

/// Gives `group` a private copy of its shared partial block `cow` (if any), recording the
/// copy for the runner. The caller checked that a block is free for it.
#[inline]
fn copy_on_write(pool: &mut BlockPool, copy_ops: &mut Vec<BlockPair>, group: &mut GroupTable, cow: Option<usize>) {
    if let Some(i) = cow {
        if let Some(private) = pool.allocate_one() {
            let shared = group.table.replace(i, private);
            pool.release_ref_unchecked(shared);
            copy_ops.push((shared, private));
        }
    }
}

/// Gives back the blocks of `group` before logical index `dead` that it still holds (the
/// caller checked that no query from now on reads them, and registered them), released
/// with the retention they would get when the sequence ends; their entries become
/// [`BlockId::NULL`].
fn release_behind(pool: &mut BlockPool, prompt_len: usize, retention: &RetentionPolicy, group: &mut GroupTable, dead: usize) {
    if dead <= group.num_released {
        return;
    }
    let first = group.num_released;
    let behind: Vec<BlockId> = (first..dead).map(|k| group.table.replace(k, BlockId::NULL)).collect();
    release_blocks(pool, retention, prompt_len, &behind, first);
    group.num_released = dead;
}

/// The block size and the number of full blocks within the first `upto` computed tokens,
/// when some of them were not offered to the prefix cache yet (device sequences with
/// caching on only).
fn blocks_to_offer(pool: &BlockPool, num_computed: usize, tier: Tier, group: &GroupTable, upto: usize) -> Option<(usize, usize)> {
    if !pool.prefix_caching() || tier != Tier::Device {
        return None;
    }
    let bs = pool.block_size();
    let full = upto.min(num_computed) / bs;
    (full > group.num_registered).then_some((bs, full))
}

/// Offers the trunk's (group 0's) full blocks within the sequence's first `upto` computed
/// tokens, not offered yet, to the prefix cache as a chain (device sequences only).
fn register_full_blocks(
    pool: &mut BlockPool,
    hasher: &mut BlockHasher,
    tokens: &[u32],
    num_computed: usize,
    tier: Tier,
    group: &mut GroupTable,
    upto: usize,
) {
    let Some((bs, full)) = blocks_to_offer(pool, num_computed, tier, group, upto) else { return };
    hasher.extend_chain(&mut group.hashes, tokens, bs, &group.extra, full);
    // Given-back blocks were registered before they were given back (`release_behind`).
    debug_assert!(group.num_registered >= group.num_released);
    let (_, link) = pool.register_chain(group.table.blocks(), &group.hashes, tokens, &group.extra, group.num_registered, full, group.link);
    group.link = link;
    group.num_registered = full;
}

/// Offers the full blocks of a group other than 0 (a leaf group) within the sequence's
/// first `upto` computed tokens, not offered yet, to the prefix cache: block `k` under the
/// trunk's node of block `k - 1` (module docs, "Prefix caching with groups";
/// register the trunk that far first). A block whose trunk parent is not registered (the
/// trunk's chain broke, or a sliding trunk gave that block back) stays out of the cache: it
/// could never be verified.
#[allow(clippy::too_many_arguments)]
fn register_leaf_blocks(
    pool: &mut BlockPool,
    hasher: &mut BlockHasher,
    tokens: &[u32],
    num_computed: usize,
    tier: Tier,
    trunk: &mut GroupTable,
    group: &mut GroupTable,
    upto: usize,
) {
    let Some((bs, full)) = blocks_to_offer(pool, num_computed, tier, group, upto) else { return };
    hasher.extend_chain(&mut trunk.hashes, tokens, bs, &trunk.extra, full);
    hasher.extend_leaves(&mut group.hashes, &trunk.hashes, tokens, bs, &group.extra, full);
    debug_assert!(group.num_registered >= group.num_released);
    for k in group.num_registered..full {
        let block = group.table.blocks()[k];
        if block.is_null() || pool.node_of(block).is_some() {
            continue; // given back (cannot be: registered first), or a hit or a copy
        }
        let parent = match k.checked_sub(1) {
            None => None,
            Some(p) => match trunk.table.blocks().get(p).filter(|b| !b.is_null()).and_then(|&b| pool.node_of(b)) {
                Some(node) => Some((node, trunk.hashes[p])),
                None => continue,
            },
        };
        pool.register(block, group.hashes[k], parent, &tokens[k * bs..(k + 1) * bs], &group.extra);
    }
    group.num_registered = full;
}

/// Offers every group's full blocks within the first `upto` computed tokens to the
/// prefix cache: the trunk first, then the leaf groups that link to it.
pub(super) fn register_all(pool: &mut BlockPool, hasher: &mut BlockHasher, seq: &mut Sequence, upto: usize) {
    let Sequence { tokens, groups, num_computed, tier, .. } = seq;
    let (trunk, leaves) = groups.split_first_mut().expect("a manager has at least one group");
    register_full_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, upto);
    for group in leaves {
        register_leaf_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, group, upto);
    }
}

/// Drops a reference on each of `blocks` (logical indices `first ..`; null entries are
/// skipped), the last block first (so that among a sequence's cached blocks the tail, the
/// least shareable, is evicted first), setting each one's retention: the prompt's policy
/// for the full blocks it covers, the default for the others (blocks filled by decoding, a
/// private tail), and never above the block before it, so that a chain's leaves are
/// evicted before their parents. The covered blocks come first, so that rule only matters
/// past them: there a block gets the lower of the default and the prompt's retention.
fn release_blocks(pool: &mut BlockPool, retention: &RetentionPolicy, prompt_len: usize, blocks: &[BlockId], first: usize) {
    let covered_tokens = retention.num_tokens.map_or(prompt_len, |n| n.min(prompt_len));
    let covered = covered_tokens / pool.block_size();
    let prompt =
        Retention { priority: retention.priority, expires_at_us: retention.duration_us.map(|d| pool.now_us().saturating_add(d)) };
    let tail = if covered > 0 && prompt.priority < DEFAULT_RETENTION_PRIORITY { prompt } else { Retention::DEFAULT };
    for (k, &b) in blocks.iter().enumerate().rev() {
        if !b.is_null() {
            pool.release_with_retention(b, if first + k < covered { prompt } else { tail });
        }
    }
}

/// Releases every group's blocks of `seq` into `pool` (emptying its tables).
pub(super) fn release_groups(pool: &mut BlockPool, seq: &mut Sequence) {
    let Sequence { groups, retention, prompt_len, .. } = seq;
    for group in groups.iter_mut() {
        let blocks = group.table.take();
        release_blocks(pool, retention, *prompt_len, &blocks, 0);
        group.num_released = 0;
    }
}
