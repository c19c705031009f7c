//! The block pool: ref counts, the free queue, and the prefix cache's index.
//!
//! Invariants (checked by [`BlockPool::check_invariants`]):
//! - a block is in the free queue if and only if its ref count is 0, so
//!   `num_free + num_used == num_blocks`;
//! - the free queue reuses every block without a cached hash before any block with one;
//!   cached ones go lowest retention priority first, least recently freed first within a
//!   priority ([`EvictionQueue`]);
//! - the cache index maps a hash to a block if and only if that block's metadata carries that
//!   hash; only full blocks are registered, and a registered block is never written again.
//!
//! Eviction is lazy: a freed cached block keeps its hash and stays findable until the pool
//! hands it out again, at which point its cache identity ends (the index entry is removed).
//!
//! Every registered block carries a *node id*: a number that names its content (its tokens
//! after its parent's content, under its salt) and is never reused. A child records its
//! parent's node, and a hit must match the parent node of the previous hit, so a chain of node
//! ids is a chain of verified blocks. Node ids do not depend on where a block lives: a block
//! copied to another tier (the host pool of a [`crate::kv_cache_manager::KvCacheManager`])
//! keeps its node, and a chain may continue from one tier into another. Only the pool that
//! computes KV (the device pool) creates nodes ([`BlockPool::register`]); copies reuse them
//! ([`BlockPool::register_copy`]).
//!
//! Optionally ([`BlockPool::set_record_events`], off by default) the pool logs the changes of
//! its cache for KV-aware routers ([`crate::kv_events`]): a Stored event when a block is
//! registered, a Removed event when a registered identity ends (eviction on reuse,
//! `uncache` after a failed step, [`BlockPool::reset_prefix_cache`]). Blocks are named on the wire by
//! their index key ([`index_key`]), unique among the pool's registered blocks. Off, the cost
//! is one branch per registration and per ended identity.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::block_hash::{index_key, BlockHash, BlockHasher, ExtraKey, HashMode};
use crate::error::{CoreError, Result};
use crate::eviction_queue::{EvictionQueue, Retention};
use crate::ids::BlockId;
use crate::kv_events::{KvEvent, KvEventLog, Medium};
use crate::token_store::TokenStore;

/// Largest pool accepted: block ids must fit in int32, and the per-block bookkeeping must fit
/// comfortably in host memory (16.7M blocks is far beyond any accelerator's KV cache).
pub const MAX_NUM_BLOCKS: usize = 1 << 24;
/// Largest block size accepted, in tokens.
pub const MAX_BLOCK_SIZE: usize = 1 << 12;

/// What a registered block's KV is: enough to verify a hit and to register a copy of the
/// block in another pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockIdentity {
    /// The chained hash of the block (names its whole prefix, but only as a candidate).
    pub hash: BlockHash,
    /// The node id of this content (see the module docs); never reused.
    pub node: u64,
    /// The node id of the previous block of the prefix; `None` for a first block.
    pub parent: Option<u64>,
    /// The chained hash of the previous block (what a restarted process relinks a block to
    /// its parent by, when node ids are gone: see the disk tier).
    pub parent_hash: Option<BlockHash>,
    /// The cache salt, checked at the first block.
    pub extra: ExtraKey,
    /// How long the block is kept once free (see [`EvictionQueue`]).
    pub retention: Retention,
}

/// A cached block whose identity ended because the pool reused it, logged when
/// [`BlockPool::set_log_evictions`] is on (the manager writes such blocks back to a lower tier
/// before their KV is overwritten).
#[derive(Debug, Clone)]
pub struct Evicted {
    /// The block, now handed out again: its KV is intact until the step that reused it runs.
    pub block: BlockId,
    /// Its identity before the eviction.
    pub identity: BlockIdentity,
    /// Its token ids.
    pub tokens: Vec<u32>,
}

/// Metadata of a block registered in the prefix cache: what lookups, frees and evictions read,
/// kept to one cache line (the full hashes, needed only to copy a block to another tier, are
/// in `BlockPool::full_hashes`).
#[derive(Debug, Clone)]
struct CachedBlock {
    /// Its index key (see [`index_key`]).
    key: u64,
    node: u64,
    /// The parent's node, 0 for a first block (node ids start at 1).
    parent: u64,
    /// Retention once free: priority and expiry (`u64::MAX`: none).
    priority: u8,
    expires_at_us: u64,
    extra: ExtraKey,
}

impl CachedBlock {
    fn retention(&self) -> Retention {
        Retention {
            priority: self.priority,
            expires_at_us: (self.expires_at_us != u64::MAX).then_some(self.expires_at_us),
        }
    }
}

/// Block hashes are already uniformly distributed: the index uses their low bits directly.
#[derive(Default)]
struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// The index is keyed by 64 bits folded from the 128-bit hash: half the entry size, so
/// fewer cache misses on the decode path. A collision of the folded keys can only cost a
/// cache hit (the second block is not registered), never a wrong one: every hit is verified.
type HashIndex = HashMap<u64, BlockId, BuildHasherDefault<PassThroughHasher>>;

/// Counters of the pool's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Cached blocks whose identity ended because the pool reused them.
    pub evictions: u64,
    /// Registrations skipped because another block already holds the same hash (the same
    /// content computed twice, or a hash collision).
    pub duplicate_registrations: u64,
}

/// How a chain of registered blocks continues (see [`BlockPool::register_chain`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ChainLink {
    /// At the start: the next block is a first block.
    #[default]
    Root,
    /// After the content with this node id.
    Node(u64),
    /// A block could not be registered nor matched: nothing after it is reachable.
    Broken,
}

/// The first node id a pool hands out; 0 is never a node.
const FIRST_NODE: u64 = 1;

/// A fixed pool of KV blocks (see the module docs).
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    free: EvictionQueue,
    caching: bool,
    index: HashIndex,
    cached: Vec<Option<CachedBlock>>,
    /// The full hash and parent hash of each registered block, kept only when blocks are
    /// copied between tiers (`keep_full_hashes`); empty otherwise.
    full_hashes: Vec<(BlockHash, Option<BlockHash>)>,
    /// Token ids of each registered block, for verification.
    cached_tokens: TokenStore,
    counters: PoolCounters,
    hash_mode: HashMode,
    next_node: u64,
    /// The caller's clock (microseconds), for retention expiry.
    now_us: u64,
    /// When set, evicted identities are logged in `evicted` (see [`Evicted`]).
    log_evictions: bool,
    evicted: Vec<Evicted>,
    /// When set, the cache's changes are logged as KV events (see the module docs).
    events: Option<Box<KvEventLog>>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool, hash_mode: HashMode) -> Result<Self> {
        if num_blocks == 0 || num_blocks > MAX_NUM_BLOCKS {
            return Err(CoreError::Config(format!(
                "num_blocks must be in 1..={MAX_NUM_BLOCKS}, got {num_blocks}"
            )));
        }
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(CoreError::Config(format!(
                "block_size must be in 1..={MAX_BLOCK_SIZE}, got {block_size}"
            )));
        }
        let oom = |_| CoreError::Config(format!("cannot allocate bookkeeping for {num_blocks} blocks"));
        let mut ref_counts = Vec::new();
        ref_counts.try_reserve_exact(num_blocks).map_err(oom)?;
        ref_counts.resize(num_blocks, 0);
        // The index never holds more entries than blocks: size it up front (up to a bound) so
        // registration never pays for a rehash of the whole index mid-step.
        let mut index = HashIndex::default();
        if enable_prefix_caching {
            index.try_reserve(num_blocks.min(1 << 20)).map_err(|_| {
                CoreError::Config(format!("cannot allocate a prefix-cache index for {num_blocks} blocks"))
            })?;
        }
        let (cached, cached_tokens) = if enable_prefix_caching {
            let mut c = Vec::new();
            c.try_reserve_exact(num_blocks).map_err(oom)?;
            c.resize(num_blocks, None);
            (c, TokenStore::new(num_blocks, block_size))
        } else {
            (Vec::new(), TokenStore::new(0, block_size))
        };
        Ok(BlockPool {
            block_size,
            ref_counts,
            free: EvictionQueue::new_full(num_blocks)?,
            caching: enable_prefix_caching,
            index,
            cached,
            full_hashes: Vec::new(),
            cached_tokens,
            counters: PoolCounters::default(),
            hash_mode,
            next_node: FIRST_NODE,
            now_us: 0,
            log_evictions: false,
            evicted: Vec::new(),
            events: None,
        })
    }

    /// Total number of blocks.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether full blocks are registered in and looked up from the prefix cache.
    #[inline]
    pub fn prefix_caching(&self) -> bool {
        self.caching
    }

    /// The hash mode blocks are hashed with (a hasher for this pool: [`Self::new_hasher`]).
    #[inline]
    pub fn hash_mode(&self) -> HashMode {
        self.hash_mode
    }

    /// A block hasher that matches this pool's hash mode.
    pub fn new_hasher(&self) -> BlockHasher {
        BlockHasher::new(self.hash_mode)
    }

    /// Number of free blocks (ref count 0), cached or not.
    #[inline]
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Number of blocks with a ref count above 0.
    #[inline]
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.free.len()
    }

    /// Fraction of blocks in use, in `[0, 1]`.
    #[inline]
    pub fn usage(&self) -> f64 {
        self.num_used() as f64 / self.num_blocks() as f64
    }

    /// Lifetime counters.
    pub fn counters(&self) -> PoolCounters {
        self.counters
    }

    /// Number of blocks registered in the prefix cache (in use or free).
    pub fn num_cached_blocks(&self) -> usize {
        self.index.len()
    }

    /// Checks that `block` is a valid id.
    #[inline]
    pub fn check_id(&self, block: BlockId) -> Result<()> {
        if block.index() < self.num_blocks() {
            Ok(())
        } else {
            Err(CoreError::BlockOutOfRange { block: block.0 as i64, num_blocks: self.num_blocks() })
        }
    }

    /// Converts a caller's integer to a valid block id.
    pub fn block_id(&self, raw: i64) -> Result<BlockId> {
        if raw < 0 || raw as u64 >= self.num_blocks() as u64 {
            return Err(CoreError::BlockOutOfRange { block: raw, num_blocks: self.num_blocks() });
        }
        Ok(BlockId(raw as u32))
    }

    /// The ref count of `block`.
    pub fn ref_count(&self, block: BlockId) -> Result<u32> {
        self.check_id(block)?;
        Ok(self.ref_counts[block.index()])
    }

    /// The ref count of a block known to be valid.
    #[inline]
    pub(crate) fn ref_count_unchecked(&self, block: BlockId) -> u32 {
        self.ref_counts[block.index()]
    }

    /// True when `block` is registered in the prefix cache.
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.caching && self.cached[block.index()].is_some()
    }

    #[inline]
    fn meta(&self, block: BlockId) -> Option<&CachedBlock> {
        if !self.caching {
            return None;
        }
        self.cached.get(block.index())?.as_ref()
    }

    /// The identity of a registered block (`None` if it has none, or if this pool does not
    /// keep full hashes: see [`Self::keep_full_hashes`]).
    pub fn identity(&self, block: BlockId) -> Option<BlockIdentity> {
        let meta = self.meta(block)?;
        let &(hash, parent_hash) = self.full_hashes.get(block.index())?;
        Some(BlockIdentity {
            hash,
            node: meta.node,
            parent: (meta.parent != 0).then_some(meta.parent),
            parent_hash,
            extra: meta.extra.clone(),
            retention: meta.retention(),
        })
    }

    /// Keeps every registered block's full hash and parent hash, so that [`Self::identity`]
    /// can give them (a pool whose blocks are copied to or from another tier). Registered
    /// blocks must not exist yet.
    pub fn keep_full_hashes(&mut self) {
        if self.caching && self.full_hashes.is_empty() {
            self.full_hashes = vec![(BlockHash(0), None); self.num_blocks()];
        }
    }

    /// The node id of a registered block.
    #[inline]
    pub fn node_of(&self, block: BlockId) -> Option<u64> {
        self.meta(block).map(|m| m.node)
    }

    /// The KV cache group a registered block was registered in (its extra key's), if any.
    pub fn kv_group_of(&self, block: BlockId) -> Option<u32> {
        self.meta(block).map(|m| m.extra.group())
    }

    /// The token ids of a registered block (empty if it has none).
    pub fn cached_tokens(&self, block: BlockId) -> &[u32] {
        if self.is_cached(block) {
            self.cached_tokens.get(block)
        } else {
            &[]
        }
    }

    /// Sets the caller's clock (microseconds, monotonic): retention durations expire on it.
    #[inline]
    pub fn set_now(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
    }

    /// The clock last set.
    #[inline]
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Sets how long a registered block is kept once free (no-op for an unregistered block).
    /// Takes effect when the block is next freed.
    pub fn set_retention(&mut self, block: BlockId, retention: Retention) {
        if let Some(Some(c)) = self.cached.get_mut(block.index()) {
            c.priority = retention.priority;
            c.expires_at_us = retention.expires_at_us.unwrap_or(u64::MAX);
        }
    }

    /// Turns the eviction log on or off (see [`Evicted`]); on, the pool keeps full hashes.
    pub fn set_log_evictions(&mut self, on: bool) {
        self.log_evictions = on && self.caching;
        if self.log_evictions {
            self.keep_full_hashes();
        }
    }

    /// Takes the evictions logged since the last call, in order.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        std::mem::take(&mut self.evicted)
    }

    /// True when some evictions are logged and not yet taken.
    #[inline]
    pub fn has_evicted(&self) -> bool {
        !self.evicted.is_empty()
    }

    /// Turns the KV event log on or off (see the module docs and [`crate::kv_events`]); the
    /// events name the pool `medium`. Off, the log and any events not yet taken are dropped;
    /// turning it on when it is on keeps the log. Blocks registered while it was off are never
    /// announced. Without prefix caching nothing is ever registered, and the log stays off.
    pub fn set_record_events(&mut self, on: bool, medium: Medium) {
        if !(on && self.caching) {
            self.events = None;
        } else if self.events.is_none() {
            self.events = Some(Box::new(KvEventLog::new(medium, self.block_size)));
        }
    }

    /// True when the KV event log is on.
    #[inline]
    pub fn records_events(&self) -> bool {
        self.events.is_some()
    }

    /// Takes the KV events logged since the last call, in order (coalesced: see
    /// [`KvEventLog`]); empty when the log is off.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_deref_mut().map_or_else(Vec::new, KvEventLog::take)
    }

    /// True when KV events are logged and not yet taken.
    #[inline]
    pub fn has_events(&self) -> bool {
        self.events.as_deref().is_some_and(|l| !l.is_empty())
    }

    /// The index keys (wire hashes) of the registered blocks that KV events name (those of
    /// KV cache group 0: see [`BlockPool::register_copy`]), in no particular order.
    pub fn registered_keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.iter().filter(|(_, b)| self.cached[b.index()].as_ref().is_some_and(|m| m.extra.group() == 0)).map(|(&k, _)| k)
    }

    /// Free blocks without a cache identity (reused before any cached block).
    #[inline]
    pub fn num_free_uncached(&self) -> usize {
        self.free.num_uncached()
    }

    /// The retention priority of the cached block the next allocation would evict, once no
    /// uncached free block is left (`None`: no cached block is free).
    pub fn next_eviction_priority(&mut self) -> Option<u8> {
        self.free.peek_evictable(self.now_us).map(|(_, p)| p)
    }

    /// Takes one free block (ref count becomes 1), evicting its cached identity if it had one.
    #[inline]
    pub fn allocate_one(&mut self) -> Option<BlockId> {
        let block = self.free.pop_front(self.now_us)?;
        self.evict(block);
        self.ref_counts[block.index()] = 1;
        Some(block)
    }

    /// All-or-nothing: appends `n` fresh blocks to `out` and returns true, or returns false and
    /// changes nothing when fewer than `n` blocks are free.
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.free.len() {
            return false;
        }
        out.reserve(n);
        for _ in 0..n {
            // Cannot fail: n <= free blocks was checked above.
            if let Some(b) = self.allocate_one() {
                out.push(b);
            }
        }
        true
    }

    /// All-or-nothing allocation of `n` blocks; `None` (and no change) when too few are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out).then_some(out)
    }

    /// Shares allocated blocks: every ref count + 1. All-or-nothing: fails, changing nothing,
    /// if any id is out of range or not allocated.
    pub fn fork(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            self.check_id(b)?;
            if self.ref_counts[b.index()] == 0 {
                return Err(CoreError::BlockNotAllocated(b.0));
            }
        }
        for &b in blocks {
            self.ref_counts[b.index()] += 1;
        }
        Ok(())
    }

    /// Takes a reference on a block that is allocated or that is free but still cached
    /// (reviving it: it leaves the free queue). A free uncached block is an error: its content
    /// is garbage. All-or-nothing over `blocks`.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            self.check_id(b)?;
            if self.ref_counts[b.index()] == 0 && !self.is_cached(b) {
                return Err(CoreError::BlockNotAllocated(b.0));
            }
        }
        for &b in blocks {
            self.acquire_unchecked(b);
        }
        Ok(())
    }

    /// Reference on a valid block that is allocated or cached (see [`Self::touch`]).
    #[inline]
    pub(crate) fn acquire_unchecked(&mut self, block: BlockId) {
        let rc = &mut self.ref_counts[block.index()];
        if *rc == 0 {
            self.free.remove(block);
        }
        *rc += 1;
    }

    /// Drops one reference from a block the caller holds, setting its retention first (see
    /// [`Self::set_retention`]).
    #[inline]
    pub(crate) fn release_with_retention(&mut self, block: BlockId, retention: Retention) {
        self.set_retention(block, retention);
        self.release_ref_unchecked(block);
    }

    /// Drops one reference from each block; blocks reaching 0 return to the free queue in the
    /// order given (cached ones at the LRU end, others at the reuse-first end).
    /// All-or-nothing: a double free (also within `blocks`) or a bad id changes nothing.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<()> {
        for (i, &b) in blocks.iter().enumerate() {
            let err = match self.check_id(b) {
                Err(e) => Some(e),
                Ok(()) if self.ref_counts[b.index()] == 0 => Some(CoreError::BlockNotAllocated(b.0)),
                Ok(()) => None,
            };
            if let Some(e) = err {
                // Roll back the decrements done so far.
                for &r in &blocks[..i] {
                    self.ref_counts[r.index()] += 1;
                }
                return Err(e);
            }
            self.ref_counts[b.index()] -= 1;
        }
        for &b in blocks {
            // A block listed twice reaches 0 once; push it only if it is not queued yet.
            if self.ref_counts[b.index()] == 0 && !self.free.contains(b) {
                self.release(b);
            }
        }
        Ok(())
    }

    /// Drops one reference from a block the caller holds (a sequence's own block).
    #[inline]
    pub(crate) fn release_ref_unchecked(&mut self, block: BlockId) {
        let rc = &mut self.ref_counts[block.index()];
        debug_assert!(*rc > 0);
        *rc -= 1;
        if *rc == 0 {
            self.release(block);
        }
    }

    #[inline]
    fn release(&mut self, block: BlockId) {
        match self.meta(block).map(CachedBlock::retention) {
            Some(r) => self.free.push_cached(block, r, self.now_us),
            None => self.free.push_uncached(block),
        }
    }

    /// Ends the cached identity of `block`, in use or not (no-op if it has none): its KV is
    /// not what the identity says (the step writing it failed). A free block moves to the
    /// reuse-first end of the queue, like any uncached block.
    pub(crate) fn uncache(&mut self, block: BlockId) {
        if !self.is_cached(block) {
            return;
        }
        let queued = self.ref_counts[block.index()] == 0 && self.free.contains(block);
        if queued {
            self.free.remove(block);
        }
        self.drop_identity(block);
        if queued {
            self.free.push_uncached(block);
        }
    }

    /// Ends the cached identity of `block` because the pool reuses it (logged when the log is
    /// on).
    #[inline]
    fn evict(&mut self, block: BlockId) {
        if !self.caching || self.cached[block.index()].is_none() {
            return;
        }
        if self.log_evictions {
            let tokens = self.cached_tokens.get(block).to_vec();
            if let Some(identity) = self.identity(block) {
                self.evicted.push(Evicted { block, identity, tokens });
            }
        }
        self.drop_identity(block);
        self.counters.evictions += 1;
    }

    /// Removes the cached identity of `block` (if any) from the block and the index.
    fn drop_identity(&mut self, block: BlockId) {
        let Some(meta) = self.cached.get_mut(block.index()).and_then(Option::take) else { return };
        if self.index.get(&meta.key) == Some(&block) {
            self.index.remove(&meta.key);
            if let Some(log) = self.events.as_deref_mut().filter(|_| meta.extra.group() == 0) {
                log.removed(meta.key);
            }
        }
    }

    /// Registers the full, computed, allocated `block` under `hash`, after the block whose node
    /// and hash are `parent` (`None` for a first block), with a new node id, which it returns.
    /// `None` (no change) when caching is off, the block is registered already, or another
    /// block holds the hash (same content computed twice, or a collision).
    pub fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<(u64, BlockHash)>,
        tokens: &[u32],
        extra: &ExtraKey,
    ) -> Option<u64> {
        let node = self.next_node;
        let identity = BlockIdentity {
            hash,
            node,
            parent: parent.map(|p| p.0),
            parent_hash: parent.map(|p| p.1),
            extra: extra.clone(),
            retention: Retention::DEFAULT,
        };
        self.register_copy(block, identity, tokens).then(|| {
            self.next_node += 1;
            node
        })
    }

    /// A new node id, never handed out before by this pool (for content registered in another
    /// pool without a node, e.g. blocks restored from disk after a restart).
    pub fn mint_node(&mut self) -> u64 {
        self.next_node += 1;
        self.next_node - 1
    }

    /// Registers the allocated `block` as a copy of a block registered elsewhere (another
    /// tier), keeping its node id. False (no change) when caching is off, the block is
    /// registered already, or another block holds the hash.
    pub fn register_copy(&mut self, block: BlockId, identity: BlockIdentity, tokens: &[u32]) -> bool {
        if !self.caching || self.cached[block.index()].is_some() {
            return false;
        }
        debug_assert_eq!(tokens.len(), self.block_size);
        debug_assert!(self.ref_counts[block.index()] > 0);
        let key = index_key(identity.hash);
        if self.index.contains_key(&key) {
            self.counters.duplicate_registrations += 1;
            return false;
        }
        if !self.cached_tokens.set(block, tokens) {
            return false; // no memory for the verification copy: leave the block uncached
        }
        self.index.insert(key, block);
        // KV events name group 0's blocks only: a router recomputes hashes from tokens, and
        // those are group 0's (the other groups' blocks of KV cache groups are leaves of it).
        if let Some(log) = self.events.as_deref_mut().filter(|_| identity.extra.group() == 0) {
            log.stored(key, identity.parent_hash.map(index_key), tokens);
        }
        if let Some(h) = self.full_hashes.get_mut(block.index()) {
            *h = (identity.hash, identity.parent_hash);
        }
        self.cached[block.index()] = Some(CachedBlock {
            key,
            node: identity.node,
            parent: identity.parent.unwrap_or(0),
            priority: identity.retention.priority,
            expires_at_us: identity.retention.expires_at_us.unwrap_or(u64::MAX),
            extra: identity.extra,
        });
        true
    }

    /// The cached block for `hash` if it really holds `tokens` after the content `parent` (the
    /// node matched for the previous position, `None` at the start) under `extra`, with its
    /// node id. Pure.
    pub fn lookup_verified(
        &self,
        hash: BlockHash,
        parent: Option<u64>,
        tokens: &[u32],
        extra: &ExtraKey,
    ) -> Option<(BlockId, u64)> {
        if !self.caching {
            return None;
        }
        let &block = self.index.get(&index_key(hash))?;
        let meta = self.cached[block.index()].as_ref()?;
        // The extra key is compared at every block, not only at a first one: with KV cache
        // groups, the blocks of every group at position k share the parent (group 0's node
        // at k - 1) and the tokens, and only the group tells them apart.
        let parent_ok = meta.parent == parent.unwrap_or(0) && meta.extra == *extra;
        (parent_ok && self.cached_tokens.get(block) == tokens).then_some((block, meta.node))
    }

    /// Registers `blocks[k]` for `k` in `start..end` as blocks `k` of the chain of `tokens`
    /// (`hashes[k]` their chained hashes), the block before `start` being `link`. A block
    /// that cannot be registered (the same content is registered elsewhere, or a collision)
    /// links through the verified block with its content if there is one; otherwise the
    /// chain breaks and nothing after it is registered (it could never be reached). Returns
    /// the number of blocks newly registered and the link after `end`.
    #[allow(clippy::too_many_arguments)]
    pub fn register_chain(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        tokens: &[u32],
        extra: &ExtraKey,
        start: usize,
        end: usize,
        mut link: ChainLink,
    ) -> (usize, ChainLink) {
        let bs = self.block_size;
        let mut count = 0;
        for k in start..end {
            let parent = match link {
                ChainLink::Root => None,
                ChainLink::Node(n) => Some(n),
                ChainLink::Broken => break,
            };
            let t = &tokens[k * bs..(k + 1) * bs];
            let parent_full = parent.zip(k.checked_sub(1).map(|p| hashes[p]));
            let node = match self.node_of(blocks[k]) {
                Some(n) => Some(n), // already registered (a prefix hit, or a copy)
                None => match self.register(blocks[k], hashes[k], parent_full, t, extra) {
                    Some(n) => {
                        count += 1;
                        Some(n)
                    }
                    None => self.lookup_verified(hashes[k], parent, t, extra).map(|(_, n)| n),
                },
            };
            link = node.map_or(ChainLink::Broken, ChainLink::Node);
        }
        (count, link)
    }

    /// The block of `other` (another tier's pool) holding the same content as this pool's
    /// `block` (same node id), if both have it. Needs this pool's full hashes.
    #[inline]
    pub fn find_copy_in(&self, block: BlockId, other: &BlockPool) -> Option<BlockId> {
        let node = self.node_of(block)?;
        let &(hash, _) = self.full_hashes.get(block.index())?;
        other.find_node(hash, node)
    }

    /// The block registered under `hash` (a candidate: compare its identity).
    pub fn find_hash(&self, hash: BlockHash) -> Option<BlockId> {
        if !self.caching {
            return None;
        }
        self.index.get(&index_key(hash)).copied()
    }

    /// The block holding exactly the content `node` (registered under `hash`), if this pool
    /// has it.
    pub fn find_node(&self, hash: BlockHash, node: u64) -> Option<BlockId> {
        if !self.caching {
            return None;
        }
        let &block = self.index.get(&index_key(hash))?;
        (self.node_of(block) == Some(node)).then_some(block)
    }

    /// The longest verified cached prefix of `tokens`, in blocks, leaving at least one token to
    /// compute (its logits are needed). `hashes` holds the first blocks' chained hashes and is
    /// extended as needed (callers keep it to register blocks later without rehashing). Pure
    /// with respect to the pool.
    pub fn match_prefix(
        &self,
        hasher: &mut BlockHasher,
        tokens: &[u32],
        extra: &ExtraKey,
        hashes: &mut Vec<BlockHash>,
    ) -> Vec<BlockId> {
        let mut hits = Vec::new();
        if !self.caching || tokens.is_empty() {
            return hits;
        }
        let bs = self.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        hasher.extend_chain(hashes, tokens, bs, extra, max_blocks);
        let mut parent = None;
        for (k, &h) in hashes.iter().take(max_blocks).enumerate() {
            match self.lookup_verified(h, parent, &tokens[k * bs..(k + 1) * bs], extra) {
                Some((b, node)) => {
                    hits.push(b);
                    parent = Some(node);
                }
                None => break,
            }
        }
        hits
    }

    /// Ends the cached identity of every free cached block (they move to the reuse-first end).
    /// Blocks in use keep theirs. Returns how many were dropped.
    pub fn reset_prefix_cache(&mut self) -> usize {
        if !self.caching {
            return 0;
        }
        let victims: Vec<BlockId> = self.free.iter().filter(|&b| self.is_cached(b)).collect();
        for &b in &victims {
            self.free.remove(b);
            self.drop_identity(b);
            self.counters.evictions += 1;
            self.free.push_uncached(b);
        }
        victims.len()
    }

    /// The free blocks from reuse-first to reuse-last (for tests and the memory map).
    pub fn free_blocks(&self) -> Vec<BlockId> {
        self.free.iter().collect()
    }

    /// Checks the invariants of the module docs.
    pub fn check_invariants(&self) -> Result<()> {
        self.free.check()?;
        let mut used = 0usize;
        for (i, &rc) in self.ref_counts.iter().enumerate() {
            let b = BlockId(i as u32);
            if rc > 0 {
                used += 1;
            }
            if (rc == 0) != self.free.contains(b) {
                return Err(CoreError::InvariantViolation(format!(
                    "block {i} has ref count {rc} but is {}in the free queue",
                    if self.free.contains(b) { "" } else { "not " }
                )));
            }
        }
        if used + self.free.len() != self.num_blocks() {
            return Err(CoreError::InvariantViolation(format!(
                "free ({}) + used ({used}) != total ({})",
                self.free.len(),
                self.num_blocks()
            )));
        }
        if self.caching {
            let mut seen_cached = false;
            for b in self.free.iter() {
                let c = self.is_cached(b);
                if seen_cached && !c {
                    return Err(CoreError::InvariantViolation(format!(
                        "uncached free block {b} sits behind a cached one in the free queue"
                    )));
                }
                if c != self.free.priority_of(b).is_some() {
                    return Err(CoreError::InvariantViolation(format!(
                        "free block {b} is {}cached but queued as {}",
                        if c { "" } else { "not " },
                        if c { "uncached" } else { "cached" }
                    )));
                }
                seen_cached |= c;
            }
            let mut registered = 0usize;
            for (i, meta) in self.cached.iter().enumerate() {
                if let Some(m) = meta {
                    registered += 1;
                    if self.index.get(&m.key) != Some(&BlockId(i as u32)) {
                        return Err(CoreError::InvariantViolation(format!(
                            "block {i} is registered but the cache index does not point at it"
                        )));
                    }
                    if self.cached_tokens.get(BlockId(i as u32)).len() != self.block_size {
                        return Err(CoreError::InvariantViolation(format!(
                            "cached block {i} stores {} tokens, not {}",
                            self.cached_tokens.get(BlockId(i as u32)).len(),
                            self.block_size
                        )));
                    }
                }
            }
            if registered != self.index.len() {
                return Err(CoreError::InvariantViolation(format!(
                    "cache index has {} entries but {registered} blocks are registered",
                    self.index.len()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize, bs: usize) -> BlockPool {
        BlockPool::new(n, bs, true, HashMode::Xxh3).unwrap()
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(matches!(BlockPool::new(0, 16, true, HashMode::Xxh3), Err(CoreError::Config(_))));
        assert!(matches!(BlockPool::new(4, 0, true, HashMode::Xxh3), Err(CoreError::Config(_))));
        assert!(matches!(BlockPool::new(MAX_NUM_BLOCKS + 1, 16, true, HashMode::Xxh3), Err(CoreError::Config(_))));
        assert!(matches!(BlockPool::new(4, MAX_BLOCK_SIZE + 1, true, HashMode::Xxh3), Err(CoreError::Config(_))));
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut p = pool(4, 4);
        let a = p.allocate(3).unwrap();
        assert_eq!(a, vec![BlockId(0), BlockId(1), BlockId(2)]);
        assert_eq!(p.allocate(2), None);
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.allocate(1), Some(vec![BlockId(3)]));
        assert_eq!(p.allocate(0), Some(vec![]));
        p.check_invariants().unwrap();
    }

    #[test]
    fn free_and_fork_ref_counts() {
        let mut p = pool(4, 4);
        let a = p.allocate(2).unwrap();
        p.fork(&a).unwrap();
        assert_eq!(p.ref_count(a[0]).unwrap(), 2);
        p.free(&a).unwrap();
        assert_eq!(p.num_free(), 2);
        p.free(&a).unwrap();
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.free(&a), Err(CoreError::BlockNotAllocated(0)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn failed_free_changes_nothing() {
        let mut p = pool(4, 4);
        let a = p.allocate(2).unwrap();
        // Second entry duplicates the first: ref 1 cannot be dropped twice.
        assert_eq!(p.free(&[a[0], a[1], a[0]]), Err(CoreError::BlockNotAllocated(0)));
        assert_eq!(p.ref_count(a[0]).unwrap(), 1);
        assert_eq!(p.ref_count(a[1]).unwrap(), 1);
        assert!(matches!(p.free(&[a[0], BlockId(99)]), Err(CoreError::BlockOutOfRange { .. })));
        assert_eq!(p.num_free(), 2);
        assert!(matches!(p.fork(&[a[0], BlockId(3)]), Err(CoreError::BlockNotAllocated(3))));
        assert_eq!(p.ref_count(a[0]).unwrap(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn lru_eviction_order_and_uncached_first() {
        let mut p = pool(4, 2);
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        let blocks = p.allocate(4).unwrap();
        // Register blocks 0 and 1 (different content), leave 2 and 3 uncached.
        let h0 = h.hash_block(None, &key, &[1, 2]);
        let h1 = h.hash_block(None, &key, &[3, 4]);
        assert!(p.register(blocks[0], h0, None, &[1, 2], &key).is_some());
        assert!(p.register(blocks[1], h1, None, &[3, 4], &key).is_some());
        // Free cached 1 first, then cached 0, then uncached 2 and 3.
        p.free(&[blocks[1]]).unwrap();
        p.free(&[blocks[0]]).unwrap();
        p.free(&[blocks[2], blocks[3]]).unwrap();
        p.check_invariants().unwrap();
        // Uncached blocks come first, then cached ones least recently freed first.
        assert_eq!(p.free_blocks(), vec![BlockId(3), BlockId(2), BlockId(1), BlockId(0)]);
        // Freed cached blocks remain findable until reused.
        assert_eq!(p.lookup_verified(h0, None, &[1, 2], &key).map(|x| x.0), Some(BlockId(0)));
        let got = p.allocate(3).unwrap();
        assert_eq!(got, vec![BlockId(3), BlockId(2), BlockId(1)]);
        assert_eq!(p.lookup_verified(h1, None, &[3, 4], &key), None);
        assert_eq!(p.lookup_verified(h0, None, &[1, 2], &key).map(|x| x.0), Some(BlockId(0)));
        assert_eq!(p.counters().evictions, 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn touch_revives_cached_free_block() {
        let mut p = pool(2, 2);
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        let b = p.allocate(1).unwrap()[0];
        let hb = h.hash_block(None, &key, &[5, 6]);
        p.register(b, hb, None, &[5, 6], &key);
        p.free(&[b]).unwrap();
        assert_eq!(p.num_free(), 2);
        p.touch(&[b]).unwrap();
        assert_eq!(p.ref_count(b).unwrap(), 1);
        assert_eq!(p.num_free(), 1);
        // The other block is free and uncached: touching it is an error.
        assert_eq!(p.touch(&[BlockId(1)]), Err(CoreError::BlockNotAllocated(1)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn forced_collision_is_never_a_hit() {
        let mut p = BlockPool::new(4, 2, true, HashMode::Truncated(0)).unwrap();
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        let b = p.allocate(1).unwrap()[0];
        let hash = h.hash_block(None, &key, &[1, 1]);
        assert!(p.register(b, hash, None, &[1, 1], &key).is_some());
        let other = h.hash_block(None, &key, &[2, 2]);
        assert_eq!(hash, other);
        assert_eq!(p.lookup_verified(other, None, &[2, 2], &key), None);
        assert_eq!(p.lookup_verified(hash, None, &[1, 1], &key).map(|x| x.0), Some(b));
        // Same tokens, another salt: no hit either.
        assert_eq!(p.lookup_verified(hash, None, &[1, 1], &ExtraKey::new(Some("s"))), None);
    }

    #[test]
    fn parent_link_is_verified_by_node() {
        let mut p = BlockPool::new(3, 1, true, HashMode::Truncated(0)).unwrap();
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        let blocks = p.allocate(2).unwrap();
        let (a, b) = (blocks[0], blocks[1]);
        let ha = h.hash_block(None, &key, &[1]);
        let na = p.register(a, ha, None, &[1], &key).unwrap();
        // Child registered under a different hash value space is impossible in degenerate
        // mode, so use the real hasher for the child.
        let mut real = BlockHasher::new(HashMode::Xxh3);
        let hb = real.hash_block(Some(ha), &key, &[2]);
        let nb = p.register(b, hb, Some((na, ha)), &[2], &key).unwrap();
        assert_ne!(na, nb);
        assert_eq!(p.lookup_verified(hb, Some(na), &[2], &key), Some((b, nb)));
        assert_eq!(p.find_node(hb, nb), Some(b));
        assert_eq!(p.find_node(hb, na), None);
        // Evict and reuse the parent, then register other content in it: the child's link
        // names the old content, which no block holds any more.
        p.free(&[a]).unwrap();
        let c = p.allocate(2).unwrap();
        assert!(c.contains(&a));
        let na2 = p.register(a, ha, None, &[1], &key).unwrap();
        assert_ne!(na2, na);
        assert_eq!(p.lookup_verified(hb, Some(na2), &[2], &key), None);
    }

    #[test]
    fn eviction_log_and_retention_order() {
        let mut p = pool(3, 1);
        p.set_log_evictions(true);
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        let bl = p.allocate(3).unwrap();
        let mut nodes = Vec::new();
        for (i, &b) in bl.iter().enumerate() {
            let t = [i as u32];
            let hash = h.hash_block(None, &key, &t);
            nodes.push(p.register(b, hash, None, &t, &key).unwrap());
        }
        // Block 0 kept longest (priority 90), block 1 shortest (10), block 2 default.
        p.release_with_retention(bl[0], Retention { priority: 90, expires_at_us: None });
        p.release_with_retention(bl[1], Retention { priority: 10, expires_at_us: None });
        p.release_with_retention(bl[2], Retention::DEFAULT);
        p.check_invariants().unwrap();
        assert_eq!(p.next_eviction_priority(), Some(10));
        assert_eq!(p.allocate(2).unwrap(), vec![bl[1], bl[2]]);
        let ev = p.take_evicted();
        assert_eq!(ev.iter().map(|e| e.block).collect::<Vec<_>>(), vec![bl[1], bl[2]]);
        assert_eq!(ev[0].identity.node, nodes[1]);
        assert_eq!(ev[0].identity.retention.priority, 10);
        assert_eq!(ev[0].tokens, vec![1]);
        assert!(p.is_cached(bl[0]));
        p.check_invariants().unwrap();
    }

    #[test]
    fn reset_prefix_cache_drops_free_cached_blocks() {
        let mut p = pool(3, 1);
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        let bl = p.allocate(2).unwrap();
        for (i, &b) in bl.iter().enumerate() {
            let t = [i as u32];
            let hash = h.hash_block(None, &key, &t);
            p.register(b, hash, None, &t, &key);
        }
        p.free(&bl[..1]).unwrap();
        assert_eq!(p.reset_prefix_cache(), 1);
        assert_eq!(p.num_cached_blocks(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn event_log_records_registrations_and_ended_identities() {
        let mut p = pool(4, 2);
        let mut h = p.new_hasher();
        let key = ExtraKey::new(None);
        // Off by default: nothing is logged.
        let b = p.allocate(4).unwrap();
        let h0 = h.hash_block(None, &key, &[1, 2]);
        p.register(b[0], h0, None, &[1, 2], &key).unwrap();
        assert!(!p.records_events() && p.take_events().is_empty());
        p.set_record_events(true, Medium::Gpu);
        // A chain of two blocks after h0: one coalesced Stored event naming h0 as parent.
        let n0 = p.node_of(b[0]).unwrap();
        let h1 = h.hash_block(Some(h0), &key, &[3, 4]);
        let n1 = p.register(b[1], h1, Some((n0, h0)), &[3, 4], &key).unwrap();
        let h2 = h.hash_block(Some(h1), &key, &[5, 6]);
        p.register(b[2], h2, Some((n1, h1)), &[5, 6], &key).unwrap();
        // A duplicate is refused and not announced.
        assert_eq!(p.register(b[3], h2, Some((n1, h1)), &[5, 6], &key), None);
        assert!(p.has_events());
        assert_eq!(
            p.take_events(),
            vec![KvEvent::BlockStored {
                block_hashes: vec![index_key(h1), index_key(h2)],
                parent_block_hash: Some(index_key(h0)),
                token_ids: vec![3, 4, 5, 6],
                block_size: 2,
                medium: Medium::Gpu,
            }]
        );
        assert!(!p.has_events());
        // Uncache (failed step), eviction on reuse, and a reset each end an identity.
        p.uncache(b[2]);
        p.uncache(b[3]); // never registered: nothing
        p.free(&b).unwrap();
        assert_eq!(p.allocate(3).unwrap().len(), 3); // two uncached blocks, then evicts b[0]
        assert_eq!(p.reset_prefix_cache(), 1);
        assert_eq!(
            p.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![index_key(h2), index_key(h0), index_key(h1)],
                medium: Medium::Gpu,
            }]
        );
        assert_eq!(p.registered_keys().count(), 0);
        p.set_record_events(false, Medium::Gpu);
        assert!(!p.records_events());
        // Without prefix caching the log stays off.
        let mut off = BlockPool::new(2, 2, false, HashMode::Xxh3).unwrap();
        off.set_record_events(true, Medium::Gpu);
        assert!(!off.records_events());
    }

    #[test]
    fn copies_keep_their_parent_key() {
        let mut dev = pool(2, 1);
        let mut host = pool(2, 1);
        dev.keep_full_hashes();
        host.keep_full_hashes();
        host.set_record_events(true, Medium::Cpu);
        let mut h = dev.new_hasher();
        let key = ExtraKey::new(Some("salt"));
        let b = dev.allocate(2).unwrap();
        let h0 = h.hash_block(None, &key, &[7]);
        let n0 = dev.register(b[0], h0, None, &[7], &key).unwrap();
        let h1 = h.hash_block(Some(h0), &key, &[8]);
        dev.register(b[1], h1, Some((n0, h0)), &[8], &key).unwrap();
        // Copy only the child to the host: its parent is named although the host lacks it.
        let d = host.allocate(1).unwrap()[0];
        assert!(host.register_copy(d, dev.identity(b[1]).unwrap(), &[8]));
        assert_eq!(
            host.take_events(),
            vec![KvEvent::BlockStored {
                block_hashes: vec![index_key(h1)],
                parent_block_hash: Some(index_key(h0)),
                token_ids: vec![8],
                block_size: 1,
                medium: Medium::Cpu,
            }]
        );
        assert_eq!(host.registered_keys().collect::<Vec<_>>(), vec![index_key(h1)]);
    }
}
