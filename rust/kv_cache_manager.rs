//! Sequence-level KV-cache management: block tables over the block pool, prefix-cache lookup
//! and registration, copy-on-write, fork and release.
//!
//! A sequence knows its token ids (`tokens`: prompt and generated so far) and how many of
//! them hold a KV slot (`num_computed`): their KV is written, or is being written by the step
//! in flight. Slots are handed out in order by [`KvCacheManager::allocate_slots`]; the table
//! always holds exactly `ceil(num_computed / block_size)` blocks.
//!
//! Invariants (checked by [`KvCacheManager::check_invariants`], on top of the pool's):
//! - every block's ref count equals the number of block tables holding it;
//! - a sequence's write window, the positions `write_start .. num_computed` that the step in
//!   flight writes, lies in blocks no other sequence writes; a block shared while written is a
//!   registered full block that the other holders reached by a verified prefix hit on the very
//!   tokens being written. So no slot is writable by two live sequences. Copy-on-write
//!   keeps this true when a sequence writes into a partial block it shares (after `fork`): it
//!   gets a private copy, and a copy op `(src, dst)` is recorded for the runner to execute
//!   before the forward pass;
//! - only full blocks are registered in the prefix cache (prompt blocks when the step that
//!   fills them is scheduled; blocks filled by decoding when the sequence is freed), and no
//!   block is written again once full.

use crate::block_hash::{BlockHash, BlockHasher, ExtraKey, HashMode};
use crate::block_pool::BlockPool;
use crate::block_table::{blocks_for, BlockTable};
use crate::error::{CoreError, Result};
use crate::ids::{BlockId, SeqId};
use crate::slab::Slab;

/// One sequence's state (see the module docs).
#[derive(Debug, Clone)]
pub struct Sequence {
    tokens: Vec<u32>,
    table: BlockTable,
    num_computed: usize,
    write_start: usize,
    /// Chained hashes of the first full blocks of `tokens` (computed lazily, kept for reuse).
    hashes: Vec<BlockHash>,
    /// Blocks `0 .. num_registered` were offered to the prefix cache (or came from it).
    num_registered: usize,
    /// Tokens known when the sequence was created (its prompt). Blocks within them are
    /// registered in the prefix cache as soon as their step is scheduled, so that concurrent
    /// requests sharing the prompt hit them; blocks filled later by decoding are registered
    /// when the sequence is freed (the first moment another request could usually use them),
    /// which keeps hashing off the per-step decode path.
    prompt_len: usize,
    extra: ExtraKey,
}

impl Sequence {
    /// All known token ids (prompt and generated).
    #[inline]
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of known tokens.
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Number of tokens that hold a KV slot.
    #[inline]
    pub fn num_computed(&self) -> usize {
        self.num_computed
    }

    /// Known tokens without a slot yet.
    #[inline]
    pub fn num_pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// The block table.
    #[inline]
    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    /// First position of the slots handed out by the last `allocate_slots`.
    #[inline]
    pub fn write_start(&self) -> usize {
        self.write_start
    }

    /// The cache salt of this sequence's blocks.
    pub fn extra_key(&self) -> &ExtraKey {
        &self.extra
    }
}

/// The verified cached prefix of a token sequence (from [`KvCacheManager::match_prefix`]).
#[derive(Debug, Clone, Default)]
pub struct PrefixMatch {
    /// Cached blocks holding the first `blocks.len() * block_size` tokens.
    pub blocks: Vec<BlockId>,
    /// Chained hashes computed on the way (at least one per hit block).
    pub hashes: Vec<BlockHash>,
    /// The pool's eviction count when matched: if blocks were evicted since, the match may be
    /// stale and is redone.
    evictions_at_match: u64,
}

impl PrefixMatch {
    /// Number of cached tokens.
    pub fn num_tokens(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }
}

/// Prefix-cache lookups, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCounters {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
}

/// Block tables of many sequences over one [`BlockPool`] (see the module docs).
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    hasher: BlockHasher,
    seqs: Slab<Sequence>,
    copy_ops: Vec<(BlockId, BlockId)>,
    prefix: PrefixCounters,
}

impl KvCacheManager {
    /// A manager over a fresh pool.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool, hash_mode: HashMode) -> Result<Self> {
        let pool = BlockPool::new(num_blocks, block_size, enable_prefix_caching, hash_mode)?;
        let hasher = pool.new_hasher();
        Ok(KvCacheManager {
            pool,
            hasher,
            seqs: Slab::default(),
            copy_ops: Vec::new(),
            prefix: PrefixCounters::default(),
        })
    }

    /// The underlying pool (read-only: blocks change hands only through sequences).
    #[inline]
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Number of live sequences.
    #[inline]
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Prefix-cache counters of `add_sequence` calls.
    pub fn prefix_counters(&self) -> PrefixCounters {
        self.prefix
    }

    /// The live sequence `id`.
    #[inline]
    pub fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(id.key()).ok_or(CoreError::UnknownSequence(id.0))
    }

    #[inline]
    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence> {
        self.seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))
    }

    fn insert(&mut self, seq: Sequence) -> SeqId {
        SeqId::from_key(self.seqs.insert(seq))
    }

    /// The longest verified cached prefix of `tokens` under `extra`, leaving at least one token
    /// to compute. Changes nothing.
    pub fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKey) -> PrefixMatch {
        let mut hashes = Vec::new();
        let blocks = self.pool.match_prefix(&mut self.hasher, tokens, extra, &mut hashes);
        PrefixMatch { blocks, hashes, evictions_at_match: self.pool.counters().evictions }
    }

    /// Blocks a new sequence takes from the free pool to get `m`'s cached prefix plus slots for
    /// `num_new_tokens` more tokens: fresh blocks, plus the cached blocks that are free now
    /// (taking them removes them from the free queue).
    pub fn admission_cost(&self, m: &PrefixMatch, num_new_tokens: usize) -> usize {
        let bs = self.block_size();
        let hit_tokens = m.num_tokens(bs);
        let fresh = blocks_for(hit_tokens + num_new_tokens, bs) - m.blocks.len();
        let revived = m.blocks.iter().filter(|&&b| self.pool.ref_count_unchecked(b) == 0).count();
        fresh + revived
    }

    /// Creates a sequence over `tokens` whose first blocks are `m`'s cached prefix (taking a
    /// reference on each). Returns the id and the number of cached tokens; those tokens count
    /// as computed. Never fails for lack of blocks: the cached blocks exist already.
    pub fn add_sequence(&mut self, tokens: Vec<u32>, extra: ExtraKey, mut m: PrefixMatch) -> (SeqId, usize) {
        if m.evictions_at_match != self.pool.counters().evictions {
            m = self.match_prefix(&tokens, &extra);
        }
        for &b in &m.blocks {
            self.pool.acquire_unchecked(b);
        }
        let bs = self.block_size();
        let hit_tokens = m.num_tokens(bs);
        self.prefix.queries += tokens.len() as u64;
        self.prefix.hits += hit_tokens as u64;
        let num_registered = m.blocks.len();
        let prompt_len = tokens.len();
        let seq = Sequence {
            tokens,
            table: BlockTable::from_blocks(m.blocks),
            num_computed: hit_tokens,
            write_start: hit_tokens,
            hashes: m.hashes,
            num_registered,
            prompt_len,
            extra,
        };
        (self.insert(seq), hit_tokens)
    }

    /// Looks up the cached prefix and creates the sequence (see [`Self::add_sequence`]).
    pub fn add_sequence_cached(&mut self, tokens: Vec<u32>, extra: ExtraKey) -> (SeqId, usize) {
        let m = self.match_prefix(&tokens, &extra);
        self.add_sequence(tokens, extra, m)
    }

    /// Blocks `allocate_slots(id, n)` would take from the free pool (copy-on-write included).
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        let seq = self.seq(id)?;
        Ok(self.blocks_needed_for(seq, n))
    }

    fn blocks_needed_for(&self, seq: &Sequence, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let fresh = blocks_for(seq.num_computed + n, self.block_size()) - seq.table.len();
        fresh + usize::from(cow_index(&self.pool, seq).is_some())
    }

    /// Gives slots to the next `n` pending tokens of `id` (positions `num_computed ..
    /// num_computed + n`), copying a shared partial block on write, and registers blocks that
    /// become full in the prefix cache. All-or-nothing: `Ok(false)` and no change when the pool
    /// has too few free blocks.
    pub fn allocate_slots(&mut self, id: SeqId, n: usize) -> Result<bool> {
        let KvCacheManager { pool, hasher, seqs, copy_ops, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        if n > seq.num_pending() {
            return Err(CoreError::InvalidArgument(format!(
                "cannot allocate slots for {n} tokens: sequence {id} has only {} tokens without a slot \
                 (append the token ids first)",
                seq.num_pending()
            )));
        }
        Ok(Self::allocate_slots_in(pool, hasher, copy_ops, seq, n))
    }

    /// [`Self::allocate_slots`] on a sequence already looked up (`n <= seq.num_pending()`).
    fn allocate_slots_in(
        pool: &mut BlockPool,
        hasher: &mut BlockHasher,
        copy_ops: &mut Vec<(BlockId, BlockId)>,
        seq: &mut Sequence,
        n: usize,
    ) -> bool {
        if n == 0 {
            return true;
        }
        let bs = pool.block_size();
        let target = seq.num_computed + n;
        let fresh = blocks_for(target, bs) - seq.table.len();
        let cow = cow_index(pool, seq);
        if fresh + usize::from(cow.is_some()) > pool.num_free() {
            return false;
        }
        if let Some(i) = cow {
            // Checked above: enough free blocks for the copy and the fresh blocks.
            if let Some(private) = pool.allocate_one() {
                let shared = seq.table.replace(i, private);
                pool.release_ref_unchecked(shared);
                copy_ops.push((shared, private));
            }
        }
        pool.allocate_into(fresh, seq.table.blocks_mut());
        seq.write_start = seq.num_computed;
        seq.num_computed = target;
        let upto = seq.num_computed.min(seq.prompt_len);
        Self::register_full_blocks(pool, hasher, seq, upto);
        true
    }

    /// Offers the sequence's full blocks within its first `upto` computed tokens, not offered
    /// yet, to the prefix cache.
    fn register_full_blocks(pool: &mut BlockPool, hasher: &mut BlockHasher, seq: &mut Sequence, upto: usize) {
        if !pool.prefix_caching() {
            return;
        }
        let bs = pool.block_size();
        let full = upto.min(seq.num_computed) / bs;
        if full <= seq.num_registered {
            return;
        }
        hasher.extend_chain(&mut seq.hashes, &seq.tokens, bs, &seq.extra, full);
        let blocks = seq.table.blocks();
        for k in seq.num_registered..full {
            let parent = k.checked_sub(1).map(|p| blocks[p]);
            pool.register(blocks[k], seq.hashes[k], parent, &seq.tokens[k * bs..(k + 1) * bs], &seq.extra);
        }
        seq.num_registered = full;
    }

    /// Appends known token ids (e.g. sampled ones) without giving them slots.
    pub fn append_tokens(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        self.seq_mut(id)?.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Appends one known token id (e.g. a sampled one) without giving it a slot; returns the
    /// sequence's new token count.
    pub fn append_token(&mut self, id: SeqId, token: u32) -> Result<usize> {
        let seq = self.seq_mut(id)?;
        seq.tokens.push(token);
        Ok(seq.tokens.len())
    }

    /// Decode step for one sequence: appends `token` and gives it a slot. All-or-nothing:
    /// `Ok(false)` and no change when no block is free.
    pub fn append_token_with_slot(&mut self, id: SeqId, token: u32) -> Result<bool> {
        let KvCacheManager { pool, hasher, seqs, copy_ops, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        seq.tokens.push(token);
        // One slot for the new token, plus any earlier pending ones (all of them, in order).
        let n = seq.num_pending();
        let ok = Self::allocate_slots_in(pool, hasher, copy_ops, seq, n);
        if !ok {
            seq.tokens.pop();
        }
        Ok(ok)
    }

    /// Decode step for a batch: appends `tokens[i]` to `ids[i]` and gives it a slot, each
    /// sequence all-or-nothing; `ok[i]` says which succeeded (the others need preemption).
    /// Fails, changing nothing, if any id is unknown or the lengths differ.
    pub fn append_tokens_with_slots(&mut self, ids: &[SeqId], tokens: &[u32], ok: &mut Vec<bool>) -> Result<()> {
        if ids.len() != tokens.len() {
            return Err(CoreError::InvalidArgument(format!(
                "got {} sequence ids but {} token ids",
                ids.len(),
                tokens.len()
            )));
        }
        for &id in ids {
            self.seq(id)?;
        }
        ok.clear();
        ok.reserve(ids.len());
        for (&id, &t) in ids.iter().zip(tokens) {
            ok.push(self.append_token_with_slot(id, t)?);
        }
        Ok(())
    }

    /// A new sequence sharing every block of `id` (ref counts + 1), with the same tokens.
    /// Both sequences' write windows close: fork after the step's KV writes are done.
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId> {
        let parent = self.seq_mut(id)?;
        parent.write_start = parent.num_computed;
        let child = parent.clone();
        for &b in child.table.blocks() {
            self.pool.acquire_unchecked(b);
        }
        Ok(self.insert(child))
    }

    /// Ends sequence `id`: its blocks lose a reference, the last block first, so that among a
    /// sequence's cached blocks the tail (the least shareable) is evicted first.
    pub fn free(&mut self, id: SeqId) -> Result<()> {
        self.free_take_tokens(id).map(drop)
    }

    /// Ends sequence `id` like [`Self::free`] and hands back its token ids (a preempted
    /// request keeps them to be recomputed later).
    pub fn free_take_tokens(&mut self, id: SeqId) -> Result<Vec<u32>> {
        let mut seq = self.seqs.remove(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        // Blocks filled by decoding become findable now (see `Sequence::prompt_len`).
        let upto = seq.num_computed;
        Self::register_full_blocks(&mut self.pool, &mut self.hasher, &mut seq, upto);
        for b in seq.table.take().into_iter().rev() {
            self.pool.release_ref_unchecked(b);
        }
        Ok(seq.tokens)
    }

    /// Ends sequence `id` like [`Self::free_take_tokens`] after the step that was writing its
    /// window (`write_start .. num_computed`) failed: those positions count as not computed,
    /// and blocks holding any of them lose their prefix-cache identity (the step may have
    /// registered them before writing them), so nothing unwritten is ever served as a hit.
    pub fn free_discarding_window(&mut self, id: SeqId) -> Result<Vec<u32>> {
        let seq = self.seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        let first_unsure = seq.write_start / self.pool.block_size();
        for k in first_unsure..seq.num_registered.min(seq.table.len()) {
            self.pool.uncache(seq.table.blocks()[k]);
        }
        seq.num_registered = seq.num_registered.min(first_unsure);
        seq.num_computed = seq.write_start;
        self.free_take_tokens(id)
    }

    /// Takes the copy-on-write ops recorded since the last call, in order.
    pub fn take_copy_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        std::mem::take(&mut self.copy_ops)
    }

    /// Drops the cached identity of every free cached block; returns how many.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.pool.reset_prefix_cache()
    }

    /// Ids of all live sequences (slab order).
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.iter().map(|(k, _)| SeqId::from_key(k)).collect()
    }

    /// Checks the pool's and the tables' invariants (module docs).
    pub fn check_invariants(&self) -> Result<()> {
        self.pool.check_invariants()?;
        let bs = self.block_size();
        let mut holders = vec![0u32; self.pool.num_blocks()];
        for (key, seq) in self.seqs.iter() {
            let slot = key.slot;
            let want = blocks_for(seq.num_computed, bs);
            if seq.table.len() != want {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot} holds {} blocks for {} computed tokens (want {want})",
                    seq.table.len(),
                    seq.num_computed
                )));
            }
            if seq.num_computed > seq.tokens.len() || seq.write_start > seq.num_computed {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot}: write_start {} <= computed {} <= tokens {} does not hold",
                    seq.write_start,
                    seq.num_computed,
                    seq.tokens.len()
                )));
            }
            for &b in seq.table.blocks() {
                holders[b.index()] += 1;
            }
        }
        for (i, &h) in holders.iter().enumerate() {
            let rc = self.pool.ref_count_unchecked(BlockId(i as u32));
            if rc != h {
                return Err(CoreError::InvariantViolation(format!(
                    "block {i} has ref count {rc} but {h} block tables hold it"
                )));
            }
        }
        // Write windows: no block is written by two sequences, and a block written while other
        // sequences hold it must be a registered full block, which they reached through a
        // verified prefix hit on exactly the tokens being written.
        let mut writers = vec![0u32; self.pool.num_blocks()];
        for (key, seq) in self.seqs.iter() {
            let slot = key.slot;
            if seq.write_start == seq.num_computed {
                continue;
            }
            let first = seq.write_start / bs;
            let last = (seq.num_computed - 1) / bs;
            for &b in &seq.table.blocks()[first..=last] {
                writers[b.index()] += 1;
                if writers[b.index()] > 1 {
                    return Err(CoreError::InvariantViolation(format!(
                        "block {b} is in the write window of two sequences (one in slot {slot})"
                    )));
                }
                if holders[b.index()] > 1 && !self.pool.is_cached(b) {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot} writes into block {b}, which {} sequences share",
                        holders[b.index()]
                    )));
                }
            }
        }
        Ok(())
    }
}

/// The logical index of the shared partial block the sequence's next write would go into
/// (copy-on-write needed), if any.
#[inline]
fn cow_index(pool: &BlockPool, seq: &Sequence) -> Option<usize> {
    let bs = pool.block_size();
    if seq.num_computed % bs == 0 {
        return None; // the next write starts a fresh block
    }
    let i = seq.num_computed / bs;
    (pool.ref_count_unchecked(seq.table.blocks()[i]) > 1).then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr(n: usize, bs: usize) -> KvCacheManager {
        KvCacheManager::new(n, bs, true, HashMode::Xxh3).unwrap()
    }

    fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    #[test]
    fn seven_tokens_hold_two_blocks() {
        let mut m = mgr(8, 4);
        let (s, hit) = m.add_sequence_cached(toks(0..7), ExtraKey::new(None));
        assert_eq!(hit, 0);
        assert!(m.allocate_slots(s, 7).unwrap());
        assert_eq!(m.seq(s).unwrap().table().len(), 2);
        assert_eq!(m.pool().num_free(), 6);
        m.check_invariants().unwrap();
        // 8th token fits in the second block; 9th needs a third.
        assert!(m.append_token_with_slot(s, 7).unwrap());
        assert_eq!(m.seq(s).unwrap().table().len(), 2);
        assert!(m.append_token_with_slot(s, 8).unwrap());
        assert_eq!(m.seq(s).unwrap().table().len(), 3);
        m.free(s).unwrap();
        assert_eq!(m.pool().num_free(), 8);
        m.check_invariants().unwrap();
    }

    #[test]
    fn allocation_failure_changes_nothing() {
        let mut m = mgr(2, 4);
        let (s, _) = m.add_sequence_cached(toks(0..12), ExtraKey::new(None));
        assert!(!m.allocate_slots(s, 12).unwrap());
        assert_eq!(m.seq(s).unwrap().num_computed(), 0);
        assert!(m.allocate_slots(s, 8).unwrap());
        assert!(!m.append_token_with_slot(s, 99).unwrap_or(true) || m.seq(s).unwrap().num_tokens() == 12);
        assert_eq!(m.pool().num_free(), 0);
        m.check_invariants().unwrap();
        assert!(matches!(m.allocate_slots(s, 5), Err(CoreError::InvalidArgument(_))));
    }

    #[test]
    fn prefix_hit_leaves_one_token_and_is_verified() {
        let mut m = mgr(16, 4);
        let prompt = toks(0..10);
        let (a, hit) = m.add_sequence_cached(prompt.clone(), ExtraKey::new(None));
        assert_eq!(hit, 0);
        m.allocate_slots(a, 10).unwrap();
        // Same prompt: two full blocks (8 tokens) cached, 2 left to compute.
        let (b, hit) = m.add_sequence_cached(prompt.clone(), ExtraKey::new(None));
        assert_eq!(hit, 8);
        assert_eq!(m.seq(b).unwrap().table().blocks(), &m.seq(a).unwrap().table().blocks()[..2]);
        // A prompt of exactly 8 tokens: at most 1 block may hit (one token must be computed).
        let (c, hit) = m.add_sequence_cached(toks(0..8), ExtraKey::new(None));
        assert_eq!(hit, 4);
        // Another salt: no hit.
        let (d, hit) = m.add_sequence_cached(prompt, ExtraKey::new(Some("other")));
        assert_eq!(hit, 0);
        m.check_invariants().unwrap();
        for s in [a, b, c, d] {
            m.free(s).unwrap();
        }
        assert_eq!(m.pool().num_free(), 16);
        m.check_invariants().unwrap();
        assert_eq!(m.prefix_counters(), PrefixCounters { queries: 38, hits: 12 });
    }

    #[test]
    fn freed_sequence_blocks_stay_findable() {
        let mut m = mgr(4, 2);
        let (a, _) = m.add_sequence_cached(toks(0..5), ExtraKey::new(None));
        m.allocate_slots(a, 5).unwrap();
        m.free(a).unwrap();
        let (b, hit) = m.add_sequence_cached(toks(0..5), ExtraKey::new(None));
        assert_eq!(hit, 4);
        assert_eq!(m.pool().num_free(), 2);
        m.free(b).unwrap();
    }

    #[test]
    fn fork_then_copy_on_write() {
        let mut m = mgr(8, 4);
        let (a, _) = m.add_sequence_cached(toks(0..6), ExtraKey::new(None));
        m.allocate_slots(a, 6).unwrap();
        let b = m.fork(a).unwrap();
        let shared_last = m.seq(a).unwrap().table().blocks()[1];
        assert_eq!(m.pool().ref_count(shared_last).unwrap(), 2);
        m.check_invariants().unwrap();
        // a writes position 6 into the shared partial block: it gets a private copy.
        assert!(m.append_token_with_slot(a, 100).unwrap());
        let a_last = m.seq(a).unwrap().table().blocks()[1];
        assert_ne!(a_last, shared_last);
        assert_eq!(m.take_copy_ops(), vec![(shared_last, a_last)]);
        // b is now the only holder and writes in place, without a copy.
        assert!(m.append_token_with_slot(b, 200).unwrap());
        assert_eq!(m.seq(b).unwrap().table().blocks()[1], shared_last);
        assert!(m.take_copy_ops().is_empty());
        // The first (full) block stays shared.
        assert_eq!(m.pool().ref_count(m.seq(a).unwrap().table().blocks()[0]).unwrap(), 2);
        m.check_invariants().unwrap();
        m.free(a).unwrap();
        m.free(b).unwrap();
        assert_eq!(m.pool().num_free(), 8);
    }

    #[test]
    fn stale_and_unknown_ids() {
        let mut m = mgr(4, 4);
        let (a, _) = m.add_sequence_cached(toks(0..3), ExtraKey::new(None));
        m.free(a).unwrap();
        assert_eq!(m.free(a), Err(CoreError::UnknownSequence(a.0)));
        let (b, _) = m.add_sequence_cached(toks(0..3), ExtraKey::new(None));
        assert_eq!(a.key().slot, b.key().slot);
        assert!(m.seq(a).is_err());
        assert!(m.seq(b).is_ok());
        assert!(m.allocate_slots(SeqId(12345), 1).is_err());
    }
}
