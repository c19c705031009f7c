//! Sequence-level KV-cache management: block tables over the block pool, prefix-cache lookup
//! and registration, copy-on-write, fork and release — and the host tier: a second pool of
//! blocks in host memory that holds swapped-out sequences and the blocks the device prefix
//! cache evicts.
//!
//! A sequence knows its token ids (`tokens`: prompt and generated so far) and how many of
//! them hold a KV slot (`num_computed`): their KV is written, or is being written by the step
//! in flight. Slots are handed out in order by [`KvCacheManager::allocate_slots`]; the table
//! always holds exactly `ceil(num_computed / block_size)` blocks.
//!
//! Tiers. The device pool's blocks are the ones attention reads. With a host tier
//! ([`KvCacheManager::with_host_tier`]) the manager also owns a host pool — its own ids, ref
//! counts, free queue and verified prefix-cache index — and records block copies between the
//! two for the runner to execute before the step's forward, in this order:
//! 1. `swap_out` (device → host): a preempted sequence's blocks ([`KvCacheManager::swap_out`]),
//!    and cached device blocks that the pool reuses in this step (write-back on eviction;
//!    their KV is intact until this step's forward overwrites it);
//! 2. `swap_in` (host → device): a swapped sequence coming back ([`KvCacheManager::swap_in`]),
//!    and prefix-cache hits found on the host, loaded into fresh device blocks before the
//!    request's prefill;
//! 3. copy-on-write `copy_ops` (device → device).
//!
//! With a disk tier ([`KvCacheManager::with_disk_tier`], below the host tier) the cached host
//! blocks the host pool evicts are written to disk slots (`disk_store`, host → disk, run
//! before everything above, so the host block is read before this step overwrites it), and a
//! prefix hit found only on disk is read into a host block (`disk_load`, disk → host, run
//! after `swap_out` and before `swap_in`) and from there loaded to the device. The full order:
//! `disk_store`, `swap_out`, `disk_load`, `swap_in`, `copy_ops`. Disk slots read or written
//! by the step are pinned like host blocks. The manager only keeps the disk slots' identities;
//! the runner owns the files (one per slot).
//!
//! A block copied to the other tier keeps its node id (block_pool.rs), so one cached content
//! may be resident on the device, on the host, or on both, and a prefix match may continue
//! from device hits into host hits. Host blocks read by this step's swap-ins and written by
//! its swap-outs are pinned (an extra reference) until [`KvCacheManager::end_step`], so no
//! later allocation in the same step can reuse one of them as a copy target.
//!
//! Invariants (checked by [`KvCacheManager::check_invariants`], on top of both pools'):
//! - a sequence's blocks all live on one tier (its `tier`), and every block's ref count in a
//!   pool equals the number of that tier's block tables holding it (plus its pins, on the
//!   host);
//! - a device sequence's write window, the positions `write_start .. num_computed` that the
//!   step in flight writes, lies in blocks no other sequence writes; a block shared while
//!   written is a registered full block that the other holders reached by a verified prefix
//!   hit on the very tokens being written. So no slot is writable by two live sequences.
//!   Copy-on-write keeps this true when a sequence writes into a partial block it shares
//!   (after `fork`): it gets a private copy, and a copy op `(src, dst)` is recorded for the
//!   runner to execute before the forward pass;
//! - only full blocks are registered in the prefix cache (prompt blocks when the step that
//!   fills them is scheduled; blocks filled by decoding when the sequence is freed or swapped
//!   out), and no block is written again once full.
//!
//! KV cache groups ([`KvCacheManager::with_columns`]): a sequence has one block table per
//! *column*, each with an [`AttentionSpan`], all over the same tokens and the same pool. A
//! sliding or chunked column gives back, when a step gives the sequence slots, the blocks no
//! query from `write_start` on can see (registered first; their entries become
//! [`BlockId::NULL`]); allocation and admission count those blocks net.
//!
//! Prefix caching with columns. Column 0 is the *trunk*: its blocks chain as a one-column
//! sequence's do (a node per block, naming its parent's node). Every other column's block `k`
//! is a *leaf* of the trunk: its hash chains from the trunk's hash of block `k - 1`
//! ([`BlockHasher::extend_leaves`]) and its parent is the trunk's node of block `k - 1`, so it
//! is verified without any block of its own column before it. A prefix hit is the longest one
//! whose live blocks every column finds (all of them in a full column, those the next query
//! sees in a sliding one): a sliding column serves from its window after the blocks before it
//! were evicted.
//!
//! KV events ([`KvCacheManager::set_record_events`], off by default): every pool logs its
//! cache's changes ([`crate::kv_events`]; device `"GPU"`, host `"CPU"`, disk `"DISK"`) — the
//! trunk's blocks only — and [`KvCacheManager::take_kv_events`] hands them out as one
//! encoded batch.

use crate::attention_span::AttentionSpan;
use crate::block_hash::{BlockHash, BlockHasher, ExtraKey, HashMode};
use crate::block_pool::{BlockIdentity, BlockPool, ChainLink, Evicted};
use crate::block_table::{blocks_for, BlockTable};
use crate::error::{CoreError, Result};
use crate::eviction_queue::{Retention, DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY};
use crate::ids::{BlockId, SeqId};
use crate::kv_events::{encode_batch, KvEvent, Medium};
use crate::slab::Slab;
use smallvec::SmallVec;

/// The most columns (block tables per sequence) a manager has.
pub const MAX_COLUMNS: usize = 256;

/// A block copy `(source, destination)`; the tiers depend on the list it is in.
pub type BlockPair = (BlockId, BlockId);

/// Where a block (or a sequence's blocks) lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Accelerator memory: what attention reads.
    Device,
    /// Host memory: swapped-out sequences and blocks evicted from the device prefix cache.
    Host,
    /// Files: cached blocks evicted from the host tier (never holds a sequence).
    Disk,
}

/// How long a sequence's prompt blocks are kept in the prefix cache once free: a retention
/// priority in `0 ..= 100` (higher is kept longer; blocks filled by decoding get the default,
/// 35), an optional duration after which the priority falls back to the default, and
/// optionally how many leading prompt tokens it covers (e.g. a shared system prompt, not the
/// request's private tail, whose blocks keep the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Priority of the prompt's full blocks.
    pub priority: u8,
    /// Microseconds the priority holds after the block is freed (`None`: for good).
    pub duration_us: Option<u64>,
    /// Only the full blocks within the first this many prompt tokens get `priority` (`None`:
    /// the whole prompt).
    pub num_tokens: Option<usize>,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy { priority: DEFAULT_RETENTION_PRIORITY, duration_us: None, num_tokens: None }
    }
}

impl RetentionPolicy {
    /// Checks the priority range.
    pub fn validate(&self) -> Result<()> {
        if self.priority > MAX_RETENTION_PRIORITY {
            return Err(CoreError::InvalidArgument(format!(
                "retention priority must be in 0..={MAX_RETENTION_PRIORITY}, got {}",
                self.priority
            )));
        }
        Ok(())
    }
}

/// One block table of a sequence, with the prefix-cache chain of its blocks (module docs, "KV
/// cache groups"): every sequence has one per column of the manager, all over the same
/// tokens and the same pool.
#[derive(Debug, Clone)]
pub struct Column {
    table: BlockTable,
    /// Leading entries given back: their blocks are behind every future query of a sliding or
    /// chunked column, and the entries are [`BlockId::NULL`]. Always 0 in a full column.
    num_released: usize,
    /// Chained hashes of the first full blocks of the tokens under this column's key
    /// (computed lazily, kept for reuse).
    hashes: Vec<BlockHash>,
    /// Blocks `0 .. num_registered` were offered to the prefix cache (or came from it).
    num_registered: usize,
    /// How the chain of registered blocks continues after block `num_registered - 1`.
    link: ChainLink,
    /// The sequence's extra key in this column.
    extra: ExtraKey,
}

impl Column {
    fn new(table: BlockTable, hashes: Vec<BlockHash>, num_registered: usize, link: ChainLink, extra: ExtraKey) -> Self {
        Column { table, num_released: 0, hashes, num_registered, link, extra }
    }

    /// The block table; entries before [`Self::num_released`] are [`BlockId::NULL`].
    #[inline]
    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    /// Leading entries given back (null).
    #[inline]
    pub fn num_released(&self) -> usize {
        self.num_released
    }

    /// The blocks the column holds (its table without the given-back entries).
    #[inline]
    pub fn held(&self) -> &[BlockId] {
        &self.table.blocks()[self.num_released..]
    }
}

/// One sequence's state (see the module docs).
#[derive(Debug, Clone)]
pub struct Sequence {
    tokens: Vec<u32>,
    tier: Tier,
    num_computed: usize,
    write_start: usize,
    /// One per column of the manager; column 0 first. Inline for one column (a model
    /// without groups): the decode path reads its table without another pointer hop.
    cols: SmallVec<[Column; 1]>,
    /// Tokens known when the sequence was created (its prompt). Blocks within them are
    /// registered in the prefix cache as soon as their step is scheduled, so that concurrent
    /// requests sharing the prompt hit them; blocks filled later by decoding are registered
    /// when the sequence is freed (the first moment another request could usually use them),
    /// which keeps hashing off the per-step decode path.
    prompt_len: usize,
    extra: ExtraKey,
    retention: RetentionPolicy,
    /// Holds every block in every column: a sliding or chunked column gives nothing back
    /// (module docs, "KV cache groups"). Set for a sequence whose KV another engine reads
    /// (a `hold_kv` request and its lease) and for a KV-transfer reservation.
    keep_all: bool,
    /// Trailing tokens that are drafts (speculative decoding), not verified: they get slots
    /// and are computed like any token, but no block holding one is ever offered to the prefix
    /// cache, and [`KvCacheManager::accept_drafts`] keeps only the accepted ones. 0 outside a
    /// step.
    num_drafts: usize,
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

    /// The block table of column 0 (block ids of the sequence's tier).
    #[inline]
    pub fn table(&self) -> &BlockTable {
        &self.cols[0].table
    }

    /// Every column's block table and state, column 0 first.
    #[inline]
    pub fn columns(&self) -> &[Column] {
        &self.cols
    }

    /// Every block the sequence holds, all columns (given-back entries skipped).
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.cols.iter().flat_map(|c| c.held().iter().copied())
    }

    /// The tier holding the sequence's blocks.
    #[inline]
    pub fn tier(&self) -> Tier {
        self.tier
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

    /// Trailing draft tokens, unverified (see [`KvCacheManager::append_drafts`]).
    #[inline]
    pub fn num_drafts(&self) -> usize {
        self.num_drafts
    }

    /// Tokens that are not drafts.
    #[inline]
    pub fn num_verified(&self) -> usize {
        self.tokens.len() - self.num_drafts
    }

    /// Whether the sequence holds every block of every column (no give-back behind a window):
    /// see [`KvCacheManager::add_sequence_keeping_all`].
    #[inline]
    pub fn keeps_all(&self) -> bool {
        self.keep_all
    }
}

/// The outcome of [`KvCacheManager::restore_disk_block`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restore {
    /// Restored in this slot.
    Done(BlockId),
    /// Its parent is not restored (yet): try again after the parent, or give up.
    MissingParent,
    /// Never restorable: a wrong hash, a duplicate, no free slot, or no disk tier.
    Rejected,
}

/// A cached block found by a prefix match, on any tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierBlock {
    /// The tier of `block`.
    pub tier: Tier,
    /// A block id of that tier's pool.
    pub block: BlockId,
}

/// The verified cached prefix of one column (part of a [`PrefixMatch`]).
#[derive(Debug, Clone, Default)]
pub struct ColumnMatch {
    /// Cached blocks holding the column's first `hits.len() * block_size` tokens, in order; a
    /// block found only on the host is loaded into a fresh device block at admission. In a
    /// column other than 0 an entry may be [`BlockId::NULL`] (not found): only a column's live
    /// hits must be found, and a sliding column's earlier entries are never read.
    pub hits: Vec<TierBlock>,
    /// Chained hashes computed on the way (at least one per hit block).
    pub hashes: Vec<BlockHash>,
    /// How the chain continues after the last hit.
    link: ChainLink,
}

/// The verified cached prefix of a token sequence (from [`KvCacheManager::match_prefix`]):
/// the longest prefix every column can serve, so every column has as many hits (a sliding or
/// chunked column needs only the hits a query after the prefix still sees; admission takes
/// those).
#[derive(Debug, Clone, Default)]
pub struct PrefixMatch {
    /// One per column, column 0 first (empty: no hits in any column).
    pub cols: Vec<ColumnMatch>,
    /// The pools' eviction counts when matched: if blocks were evicted since, the match may
    /// be stale and is redone.
    evictions_at_match: u64,
}

impl PrefixMatch {
    /// Number of cached blocks (per column).
    pub fn num_blocks(&self) -> usize {
        self.cols.first().map_or(0, |c| c.hits.len())
    }

    /// Number of cached tokens.
    pub fn num_tokens(&self, block_size: usize) -> usize {
        self.num_blocks() * block_size
    }

    /// Number of hits found only on the host (all columns).
    pub fn num_host_blocks(&self) -> usize {
        self.cols.iter().flat_map(|c| &c.hits).filter(|h| h.tier == Tier::Host).count()
    }

    /// Number of hits found only on disk (all columns).
    pub fn num_disk_blocks(&self) -> usize {
        self.cols.iter().flat_map(|c| &c.hits).filter(|h| h.tier == Tier::Disk).count()
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
    /// Of the hits, tokens served while a column other than 0 lacked blocks before the ones
    /// its next query sees (KV cache groups: a sliding column served from its window alone).
    pub window_hits: u64,
}

/// Block movements between the tiers, in blocks, over the manager's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Blocks copied device → host (swap-outs and write-backs).
    pub blocks_to_host: u64,
    /// Blocks copied host → device (swap-ins and host prefix hits).
    pub blocks_to_device: u64,
    /// Of `blocks_to_host`, evicted cached device blocks written back to the host tier.
    pub write_backs: u64,
    /// Evicted cached device blocks not written back (host tier full of blocks in use or of
    /// blocks with a higher retention priority).
    pub write_backs_skipped: u64,
    /// Sequences swapped out / swapped back in.
    pub swap_outs: u64,
    /// Sequences swapped back in.
    pub swap_ins: u64,
    /// Blocks written host → disk (cached host blocks evicted by reuse).
    pub blocks_to_disk: u64,
    /// Blocks read disk → host (prefix hits found only on disk).
    pub blocks_from_disk: u64,
    /// Evicted cached host blocks not written to disk (no room).
    pub disk_writes_skipped: u64,
}

/// Block tables of many sequences over a device pool and an optional host pool (see the
/// module docs).
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    host: Option<BlockPool>,
    disk: Option<BlockPool>,
    /// (host, disk slot) writes and (disk slot, host) reads since the last `take_disk_ops`.
    disk_store: Vec<BlockPair>,
    disk_load: Vec<BlockPair>,
    /// Disk slots holding an extra reference until `end_step`.
    pinned_disk: Vec<BlockId>,
    /// Disk slots written since `begin_step`.
    step_disk_written: Vec<BlockId>,
    hasher: BlockHasher,
    /// What each column's layers attend to (module docs, "KV cache groups"); one `Full`
    /// column unless [`KvCacheManager::with_columns`] says otherwise.
    spans: Vec<AttentionSpan>,
    seqs: Slab<Sequence>,
    copy_ops: Vec<(BlockId, BlockId)>,
    /// (device, host) copies recorded since the last `take_swap_ops`.
    swap_out: Vec<(BlockId, BlockId)>,
    /// (host, device) copies recorded since the last `take_swap_ops`.
    swap_in: Vec<(BlockId, BlockId)>,
    /// Host blocks holding an extra reference until `end_step` (module docs).
    pinned_host: Vec<BlockId>,
    /// Device blocks written by swap-ins / host blocks written by swap-outs since
    /// `begin_step`: their content is only real once the step has run (see `rollback_copies`).
    step_loaded: Vec<BlockId>,
    step_host_written: Vec<BlockId>,
    prefix: PrefixCounters,
    tiers: TierCounters,
    /// Whether the pools log KV events (`set_record_events`).
    record_events: bool,
    /// KV events taken from the pools before a reset, not yet handed out (they come before
    /// anything the pools logged since).
    pending_events: Vec<KvEvent>,
}

impl KvCacheManager {
    /// A manager over a fresh device pool, without a host tier.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool, hash_mode: HashMode) -> Result<Self> {
        let pool = BlockPool::new(num_blocks, block_size, enable_prefix_caching, hash_mode)?;
        let hasher = pool.new_hasher();
        Ok(KvCacheManager {
            pool,
            host: None,
            disk: None,
            disk_store: Vec::new(),
            disk_load: Vec::new(),
            pinned_disk: Vec::new(),
            step_disk_written: Vec::new(),
            hasher,
            spans: vec![AttentionSpan::Full],
            seqs: Slab::default(),
            copy_ops: Vec::new(),
            swap_out: Vec::new(),
            swap_in: Vec::new(),
            pinned_host: Vec::new(),
            step_loaded: Vec::new(),
            step_host_written: Vec::new(),
            prefix: PrefixCounters::default(),
            tiers: TierCounters::default(),
            record_events: false,
            pending_events: Vec::new(),
        })
    }

    /// Sets the columns: one block table per sequence for each, over the one pool, whose layers
    /// attend as `spans` says (module docs, "KV cache groups"). Column 0 comes first; a full
    /// column, if any, should be column 0 (its hash chain is the one KV events report). Only
    /// before the first sequence.
    pub fn with_columns(mut self, spans: Vec<AttentionSpan>) -> Result<Self> {
        if spans.is_empty() {
            return Err(CoreError::Config("a KV cache needs at least one column".into()));
        }
        if spans.len() > MAX_COLUMNS {
            return Err(CoreError::Config(format!("at most {MAX_COLUMNS} KV-cache columns, got {}", spans.len())));
        }
        for s in &spans {
            s.validate()?;
        }
        if !self.seqs.is_empty() {
            return Err(CoreError::InvalidArgument("columns are set before the first sequence".into()));
        }
        self.spans = spans;
        Ok(self)
    }

    /// What each column's layers attend to, column 0 first.
    #[inline]
    pub fn spans(&self) -> &[AttentionSpan] {
        &self.spans
    }

    /// The device pool block by block: the KV-cache column each block serves — the column
    /// of the device sequence's table holding it, else (free) the column it is cached for —
    /// or -1 for a free block without a cached identity. For a live view of the groups.
    pub fn block_columns(&self) -> Vec<i16> {
        let n = self.pool.num_blocks();
        let mut out: Vec<i16> = (0..n).map(|i| self.pool.column_of(BlockId(i as u32)).map_or(-1, |c| c as i16)).collect();
        for (_, seq) in self.seqs.iter() {
            if seq.tier != Tier::Device {
                continue;
            }
            for (c, col) in seq.cols.iter().enumerate() {
                for b in col.held() {
                    out[b.index()] = c as i16;
                }
            }
        }
        out
    }

    /// Number of columns (block tables per sequence).
    #[inline]
    pub fn num_columns(&self) -> usize {
        self.spans.len()
    }

    /// Adds a host tier of `num_host_blocks` blocks (0: none). With prefix caching on, cached
    /// device blocks evicted by reuse are written back to it.
    pub fn with_host_tier(mut self, num_host_blocks: usize) -> Result<Self> {
        if num_host_blocks == 0 {
            self.host = None;
            self.pool.set_log_evictions(false);
            return Ok(self);
        }
        let host = BlockPool::new(num_host_blocks, self.pool.block_size(), self.pool.prefix_caching(), self.pool.hash_mode())
            .map_err(|e| match e {
                CoreError::Config(m) => CoreError::Config(format!("host tier: {m}")),
                e => e,
            })?;
        let mut host = host;
        host.keep_full_hashes();
        host.set_record_events(self.record_events, Medium::Cpu);
        self.host = Some(host);
        self.pool.set_log_evictions(true);
        Ok(self)
    }

    /// Adds a disk tier of `num_disk_blocks` slots (0: none) below the host tier: cached host
    /// blocks the host pool evicts are written to it, and prefix hits found only there are
    /// read back. Needs a host tier and prefix caching.
    pub fn with_disk_tier(mut self, num_disk_blocks: usize) -> Result<Self> {
        if num_disk_blocks == 0 {
            self.disk = None;
            return Ok(self);
        }
        let Some(host) = self.host.as_mut() else {
            return Err(CoreError::Config("a disk tier needs a host tier (num_host_blocks > 0)".into()));
        };
        if !self.pool.prefix_caching() {
            return Err(CoreError::Config("a disk tier needs prefix caching".into()));
        }
        host.set_log_evictions(true);
        let disk = BlockPool::new(num_disk_blocks, self.pool.block_size(), true, self.pool.hash_mode()).map_err(|e| match e {
            CoreError::Config(m) => CoreError::Config(format!("disk tier: {m}")),
            e => e,
        })?;
        let mut disk = disk;
        disk.keep_full_hashes();
        disk.set_record_events(self.record_events, Medium::Disk);
        self.disk = Some(disk);
        Ok(self)
    }

    /// The disk tier's slots, if there is a disk tier.
    #[inline]
    pub fn disk_pool(&self) -> Option<&BlockPool> {
        self.disk.as_ref()
    }

    /// The device pool (read-only: blocks change hands only through sequences).
    #[inline]
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The host pool, if there is a host tier.
    #[inline]
    pub fn host_pool(&self) -> Option<&BlockPool> {
        self.host.as_ref()
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Number of live sequences (both tiers).
    #[inline]
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Prefix-cache counters of `add_sequence` calls.
    pub fn prefix_counters(&self) -> PrefixCounters {
        self.prefix
    }

    /// Block movements between the tiers.
    pub fn tier_counters(&self) -> TierCounters {
        self.tiers
    }

    /// Sets the clock (microseconds, monotonic) that retention durations expire on.
    pub fn set_now(&mut self, now_us: u64) {
        self.pool.set_now(now_us);
        if let Some(h) = self.host.as_mut() {
            h.set_now(now_us);
        }
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

    fn evictions(&self) -> u64 {
        [Some(&self.pool), self.host.as_ref(), self.disk.as_ref()].into_iter().flatten().map(|p| p.counters().evictions).sum()
    }

    /// The longest verified cached prefix of `tokens` under `extra` that every column holds,
    /// leaving at least one token to compute: device hits first at each position, then host
    /// hits, then disk hits. Changes nothing.
    pub fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKey) -> PrefixMatch {
        let mut m = self.no_prefix_match();
        if !self.pool.prefix_caching() || tokens.is_empty() {
            return m;
        }
        let bs = self.block_size();
        // Column 0 (the trunk) walks its chain of verified nodes.
        let limit = (tokens.len() - 1) / bs;
        let (trunk, leaves) = m.cols.split_first_mut().expect("a manager has at least one column");
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
        // Every other column's block k is a leaf of the trunk's node k - 1, so it is verified
        // on its own: a sliding column serves a prefix from the blocks its next query sees
        // even when the blocks before them were evicted. The hit is the longest prefix every
        // column can serve (for a sliding column, one whose live blocks are all found).
        // A block not found is a null entry: a prefix whose live hits include one is not served.
        let missing = TierBlock { tier: Tier::Device, block: BlockId::NULL };
        for (c, col) in leaves.iter_mut().enumerate() {
            let key = extra.for_column(c as u32 + 1);
            self.hasher.extend_leaves(&mut col.hashes, &trunk.hashes, tokens, bs, &key, len);
            col.hits = (0..len)
                .map(|k| {
                    let parent = k.checked_sub(1).map(|p| nodes[p]);
                    let found = self.lookup_tiers(col.hashes[k], parent, &tokens[k * bs..(k + 1) * bs], &key);
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

    /// Whether every column of `m` has found its live hits of the prefix of `len` blocks
    /// (a leaf column's other entries may be null: blocks not found, never read), for a
    /// sequence that keeps all its blocks when `keep_all` (every entry must be found).
    fn serves(&self, m: &PrefixMatch, len: usize, keep_all: bool) -> bool {
        let bs = self.block_size();
        m.cols.iter().zip(&self.spans).all(|(col, &span)| {
            col.hits.len() >= len && col.hits[Self::live_hits(span, len, bs, keep_all)].iter().all(|h| !h.block.is_null())
        })
    }

    /// The verified cached block for `hash` (its parent node `parent`, its `tokens`, its
    /// `extra` key) on the device, else the host, else the disk tier, with its node.
    fn lookup_tiers(&self, hash: BlockHash, parent: Option<u64>, tokens: &[u32], extra: &ExtraKey) -> Option<(TierBlock, u64)> {
        [(Tier::Device, Some(&self.pool)), (Tier::Host, self.host.as_ref()), (Tier::Disk, self.disk.as_ref())].into_iter().find_map(
            |(tier, pool)| {
                let (block, node) = pool?.lookup_verified(hash, parent, tokens, extra)?;
                Some((TierBlock { tier, block }, node))
            },
        )
    }

    /// Cuts every column of `m` to its first `keep` hits (the chain continues after the last).
    fn truncate_match(&self, m: &mut PrefixMatch, keep: usize) {
        for col in &mut m.cols {
            if col.hits.len() > keep {
                col.hits.truncate(keep);
                col.link = match col.hits.last() {
                    None => ChainLink::Root,
                    Some(h) if h.block.is_null() => ChainLink::Broken, // a leaf column's unused entry
                    Some(h) => self.node_of(*h).map_or(ChainLink::Broken, ChainLink::Node),
                };
            }
        }
    }

    /// A match with no hits, current with the pools' evictions (so `add_sequence` keeps it as
    /// it is): the sequence computes every token, and its full blocks are still registered.
    pub fn no_prefix_match(&self) -> PrefixMatch {
        PrefixMatch { cols: vec![ColumnMatch::default(); self.spans.len()], evictions_at_match: self.evictions() }
    }

    /// The hits of each column a sequence admitted with `hits` cached blocks keeps: those a
    /// query at the first position after them still sees (all of them in a full column, and
    /// in every column for a sequence that keeps all its blocks).
    #[inline]
    fn live_hits(span: AttentionSpan, hits: usize, block_size: usize, keep_all: bool) -> std::ops::Range<usize> {
        if keep_all {
            return 0..hits;
        }
        span.dead_blocks(hits * block_size, block_size)..hits
    }

    /// Blocks a new sequence takes from the free device pool to get `m`'s cached prefix plus
    /// slots for `num_new_tokens` more tokens: fresh blocks (for new tokens and for host hits),
    /// plus the cached device blocks that are free now (taking them removes them from the
    /// free queue), in every column.
    pub fn admission_cost(&self, m: &PrefixMatch, num_new_tokens: usize) -> usize {
        self.admission_cost_keeping(m, num_new_tokens, false)
    }

    /// [`Self::admission_cost`] of a sequence that keeps all its blocks when `keep_all` (it
    /// takes every hit of every column, see [`Self::add_sequence_keeping_all`]).
    pub fn admission_cost_keeping(&self, m: &PrefixMatch, num_new_tokens: usize, keep_all: bool) -> usize {
        let bs = self.block_size();
        let k = m.num_blocks();
        let fresh = blocks_for(k * bs + num_new_tokens, bs) - k;
        let mut cost = fresh * self.spans.len();
        for (c, &span) in self.spans.iter().enumerate() {
            let Some(col) = m.cols.get(c) else { continue };
            // A leaf entry not found (null) is computed in a fresh block, if the sequence keeps
            // it (admission then takes a shorter hit: this counts about what that costs).
            cost += col.hits[Self::live_hits(span, k, bs, keep_all)]
                .iter()
                .filter(|h| h.block.is_null() || h.tier != Tier::Device || self.pool.ref_count_unchecked(h.block) == 0)
                .count();
        }
        cost
    }

    /// Creates a sequence over `tokens` whose first blocks are `m`'s cached prefix (taking a
    /// reference on each device hit; host hits are loaded into fresh device blocks, as many as
    /// the free pool allows, and the prefix ends before the first that does not fit). Returns
    /// the id and the number of cached tokens; those tokens count as computed.
    pub fn add_sequence(&mut self, tokens: Vec<u32>, extra: ExtraKey, m: PrefixMatch) -> (SeqId, usize) {
        self.add_sequence_with_retention(tokens, extra, m, RetentionPolicy::default())
    }

    /// Whether the pools have room to take the live hits of `m`'s first `k` blocks: a host hit
    /// needs a fresh device block, a disk hit a fresh host block too (free blocks that are
    /// hits themselves are taken out of the free queue first, so they do not count as room).
    fn hits_fit(&self, m: &PrefixMatch, k: usize, keep_all: bool) -> bool {
        let bs = self.block_size();
        let (mut device_need, mut host_need, mut device_revived, mut host_revived) = (0usize, 0usize, 0usize, 0usize);
        for (col, &span) in m.cols.iter().zip(&self.spans) {
            for hit in &col.hits[Self::live_hits(span, k, bs, keep_all)] {
                match hit.tier {
                    Tier::Device => device_revived += usize::from(self.pool.ref_count_unchecked(hit.block) == 0),
                    Tier::Host => {
                        device_need += 1;
                        host_revived += usize::from(self.host.as_ref().is_some_and(|h| h.ref_count_unchecked(hit.block) == 0));
                    }
                    Tier::Disk => {
                        device_need += 1;
                        host_need += 1;
                    }
                }
            }
        }
        let device_room = self.pool.num_free() - device_revived;
        let host_room = self.host.as_ref().map_or(0, |h| h.num_free() - host_revived);
        device_need <= device_room && host_need <= host_room
    }

    /// [`Self::add_sequence`] with the retention of the prompt's blocks (validate it first).
    pub fn add_sequence_with_retention(
        &mut self,
        tokens: Vec<u32>,
        extra: ExtraKey,
        m: PrefixMatch,
        retention: RetentionPolicy,
    ) -> (SeqId, usize) {
        self.add_sequence_keeping_all(tokens, extra, m, retention, false)
    }

    /// [`Self::add_sequence_with_retention`]; with `keep_all` the sequence (and every fork of
    /// it) holds every block of every column for its whole life: it takes every hit, also
    /// those behind a sliding or chunked column's window, and gives nothing back as it grows.
    /// For a sequence whose KV another engine reads whole (a `hold_kv` request: KV transfer
    /// carries every column's table). Its cost in a windowed column is its whole length, as
    /// in a full one; admission counts it with [`Self::admission_cost_keeping`].
    pub fn add_sequence_keeping_all(
        &mut self,
        tokens: Vec<u32>,
        extra: ExtraKey,
        mut m: PrefixMatch,
        retention: RetentionPolicy,
        keep_all: bool,
    ) -> (SeqId, usize) {
        if m.evictions_at_match != self.evictions() || m.cols.len() != self.spans.len() {
            m = self.match_prefix(&tokens, &extra);
        }
        let bs = self.block_size();
        // Keep the longest prefix whose live hits the pools have room for. Only host and disk
        // hits need room, so this is the whole match unless the pools are short.
        let mut keep = m.num_blocks();
        while keep > 0 && !(self.serves(&m, keep, keep_all) && self.hits_fit(&m, keep, keep_all)) {
            keep -= 1;
        }
        self.truncate_match(&mut m, keep);
        let window_hit = m.cols.iter().skip(1).any(|c| c.hits.iter().any(|h| h.block.is_null()));
        // Take every live hit first (device ones out of the free queue, host and disk ones
        // pinned), so that the fresh blocks allocated below can evict none of them.
        for (col, &span) in m.cols.iter().zip(&self.spans) {
            for hit in &col.hits[Self::live_hits(span, keep, bs, keep_all)] {
                match hit.tier {
                    Tier::Device => self.pool.acquire_unchecked(hit.block),
                    Tier::Host => {
                        if let Some(host) = self.host.as_mut() {
                            host.acquire_unchecked(hit.block);
                            self.pinned_host.push(hit.block);
                        }
                    }
                    Tier::Disk => {
                        if let Some(disk) = self.disk.as_mut() {
                            disk.acquire_unchecked(hit.block);
                            self.pinned_disk.push(hit.block);
                        }
                    }
                }
            }
        }
        let (mut from_host, mut from_disk) = (0u64, 0u64);
        let mut cols: SmallVec<[Column; 1]> = SmallVec::with_capacity(self.spans.len());
        let mut loaded_all = true;
        for (c, (cm, span)) in m.cols.into_iter().zip(self.spans.clone()).enumerate() {
            let live = Self::live_hits(span, keep, bs, keep_all);
            let mut blocks = vec![BlockId::NULL; live.start];
            for hit in &cm.hits[live.clone()] {
                // Room was counted above: the loads cannot fail.
                let loaded = match hit.tier {
                    Tier::Device => Some(hit.block),
                    Tier::Host => {
                        from_host += u64::from(c == 0);
                        self.load_from_host(hit.block)
                    }
                    Tier::Disk => {
                        from_disk += u64::from(c == 0);
                        self.load_from_disk(hit.block).and_then(|h| self.load_from_host(h))
                    }
                };
                match loaded {
                    Some(d) => blocks.push(d),
                    None => break,
                }
            }
            loaded_all &= blocks.len() == keep;
            let mut col = Column::new(BlockTable::from_blocks(blocks), cm.hashes, keep, cm.link, extra.for_column(c as u32));
            col.num_released = live.start;
            cols.push(col);
        }
        if !loaded_all {
            // Cannot happen (room was counted); stay safe: keep the prefix every column loaded.
            let held = cols.iter().map(|c| c.table.len()).min().unwrap_or(0);
            for col in &mut cols {
                for b in col.table.blocks_mut().drain(held..).filter(|b| !b.is_null()) {
                    self.pool.release_ref_unchecked(b);
                }
                col.num_registered = held;
                col.num_released = col.num_released.min(held);
                col.link = ChainLink::Broken;
            }
            keep = held;
        }
        self.write_back_evicted();
        let hit_tokens = keep * bs;
        if window_hit {
            self.prefix.window_hits += hit_tokens as u64;
        }
        self.prefix.queries += tokens.len() as u64;
        self.prefix.hits += hit_tokens as u64;
        self.prefix.host_hits += from_host * bs as u64;
        self.prefix.disk_hits += from_disk * bs as u64;
        let prompt_len = tokens.len();
        let seq = Sequence {
            tokens,
            tier: Tier::Device,
            num_computed: hit_tokens,
            write_start: hit_tokens,
            cols,
            prompt_len,
            extra,
            retention,
            keep_all,
            num_drafts: 0,
        };
        (self.insert(seq), hit_tokens)
    }

    fn node_of(&self, b: TierBlock) -> Option<u64> {
        self.tier_pool(b.tier).and_then(|p| p.node_of(b.block))
    }

    fn tier_pool(&self, tier: Tier) -> Option<&BlockPool> {
        match tier {
            Tier::Device => Some(&self.pool),
            Tier::Host => self.host.as_ref(),
            Tier::Disk => self.disk.as_ref(),
        }
    }

    /// Copies host block `h` into a fresh device block registered with the same identity
    /// (recording the swap-in), or `None` if no device block is free.
    fn load_from_host(&mut self, h: BlockId) -> Option<BlockId> {
        let host = self.host.as_ref()?;
        let d = self.pool.allocate_one()?;
        if let Some(identity) = host.identity(h) {
            self.pool.register_copy(d, identity, host.cached_tokens(h));
        }
        self.swap_in.push((h, d));
        self.step_loaded.push(d);
        self.tiers.blocks_to_device += 1;
        Some(d)
    }

    /// Reads disk slot `slot` into a fresh host block registered with the same identity and
    /// pinned until `end_step` (recording the disk load), or `None` if no host block is free.
    fn load_from_disk(&mut self, slot: BlockId) -> Option<BlockId> {
        let (host, disk) = (self.host.as_mut()?, self.disk.as_ref()?);
        let h = host.allocate_one()?;
        if let Some(identity) = disk.identity(slot) {
            host.register_copy(h, identity, disk.cached_tokens(slot));
        }
        self.disk_load.push((slot, h));
        self.step_host_written.push(h);
        self.pinned_host.push(h);
        self.tiers.blocks_from_disk += 1;
        Some(h)
    }

    /// Writes the cached blocks evicted since the last call one tier down: device blocks to
    /// the host tier (`swap_out`), then host blocks — including those just evicted to make
    /// room — to the disk tier (`disk_store`). See [`spill`].
    #[inline]
    fn write_back_evicted(&mut self) {
        // The common case (nothing evicted, or no tier below) stays a couple of loads on the
        // decode path.
        if self.host.is_some() && (self.pool.has_evicted() || self.host.as_ref().is_some_and(BlockPool::has_evicted)) {
            self.spill_evicted();
        }
    }

    fn spill_evicted(&mut self) {
        if let Some(host) = self.host.as_mut() {
            if self.pool.has_evicted() {
                let (written, skipped) = spill(
                    self.pool.take_evicted(),
                    host,
                    &mut self.swap_out,
                    &mut self.step_host_written,
                    &mut self.pinned_host,
                );
                self.tiers.blocks_to_host += written;
                self.tiers.write_backs += written;
                self.tiers.write_backs_skipped += skipped;
            }
            if let Some(disk) = self.disk.as_mut() {
                if host.has_evicted() {
                    let (written, skipped) = spill(
                        host.take_evicted(),
                        disk,
                        &mut self.disk_store,
                        &mut self.step_disk_written,
                        &mut self.pinned_disk,
                    );
                    self.tiers.blocks_to_disk += written;
                    self.tiers.disk_writes_skipped += skipped;
                }
            }
        }
    }

    /// Looks up the cached prefix and creates the sequence (see [`Self::add_sequence`]).
    pub fn add_sequence_cached(&mut self, tokens: Vec<u32>, extra: ExtraKey) -> (SeqId, usize) {
        let m = self.match_prefix(&tokens, &extra);
        self.add_sequence(tokens, extra, m)
    }

    /// Reserves device blocks to receive the KV of `tokens`' first `num_blocks` full blocks
    /// from another engine (disaggregated prefill), in every column, or `None` (changing
    /// nothing) if the pool lacks room. The blocks this pool already caches (the longest
    /// verified *device* prefix hit every column's chain reaches; never more than
    /// `num_blocks`) are shared — every column holds all of them, also those behind a sliding
    /// column's window, since nothing is given back in a reservation — and the rest are fresh
    /// in every column. Returns the sequence and the number of leading blocks that were hits
    /// (the same in every column): the caller fills each column's blocks after them and then
    /// either `free`s the sequence, which registers them in the prefix cache like any computed
    /// block, or `free_discarding_window`s it (transfer failed), which registers nothing it did
    /// not already hold. At most `(tokens.len() - 1) / block_size` blocks per column, so a
    /// prompt always keeps a token to compute (like a prefix hit).
    ///
    /// Until one of those calls the fresh blocks are in the sequence's write window: not in
    /// the prefix cache, so no other request can hit them while their KV is arriving.
    pub fn reserve_prefix(&mut self, tokens: Vec<u32>, extra: ExtraKey, num_blocks: usize) -> Option<(SeqId, usize)> {
        let bs = self.block_size();
        let num_cols = self.spans.len();
        let num_blocks = num_blocks.min(tokens.len().saturating_sub(1) / bs);
        let mut m = self.match_prefix(&tokens, &extra);
        // Host and disk hits would need copies that only a scheduled step runs: stop at the
        // first one in any column, and at a leaf column's first block not found (a
        // reservation holds every hit of every column).
        let keep = m
            .cols
            .iter()
            .map(|c| c.hits.iter().take(num_blocks).take_while(|h| h.tier == Tier::Device && !h.block.is_null()).count())
            .min()
            .unwrap_or(0);
        self.truncate_match(&mut m, keep);
        let hits = m.cols.iter().flat_map(|c| &c.hits);
        let revived = hits.filter(|h| self.pool.ref_count_unchecked(h.block) == 0).count();
        if (num_blocks - keep) * num_cols + revived > self.pool.num_free() {
            return None;
        }
        // Every hit first, so that the fresh allocations below cannot evict one.
        for hit in m.cols.iter().flat_map(|c| &c.hits) {
            self.pool.acquire_unchecked(hit.block);
        }
        let mut cols: SmallVec<[Column; 1]> = SmallVec::with_capacity(num_cols);
        for (c, cm) in m.cols.into_iter().enumerate() {
            let mut blocks: Vec<BlockId> = Vec::with_capacity(num_blocks);
            blocks.extend(cm.hits.iter().map(|h| h.block));
            let allocated = self.pool.allocate_into(num_blocks - keep, &mut blocks);
            debug_assert!(allocated, "checked above: enough free blocks");
            let key = extra.for_column(c as u32);
            cols.push(Column::new(BlockTable::from_blocks(blocks), cm.hashes, keep, cm.link, key));
        }
        // A cached block this allocation evicted is not written back to the host tier: the
        // transfer overwrites it before any step could copy it out. It is only a cache miss.
        if self.pool.has_evicted() {
            drop(self.pool.take_evicted());
        }
        let prompt_len = tokens.len();
        let seq = Sequence {
            tokens,
            tier: Tier::Device,
            num_computed: num_blocks * bs,
            write_start: keep * bs,
            cols,
            prompt_len,
            extra,
            retention: RetentionPolicy::default(),
            keep_all: true,
            num_drafts: 0,
        };
        Some((self.insert(seq), keep))
    }

    /// Blocks of the cached prefix of `tokens` (no salt) a new sequence would find (tests).
    #[cfg(test)]
    pub(crate) fn cached_prefix_blocks(&mut self, tokens: &[u32]) -> usize {
        self.match_prefix(tokens, &ExtraKey::new(None)).num_blocks()
    }

    /// Fresh blocks `seq` takes to grow by `n` slots, in all columns, before any is given back
    /// and without copy-on-write: the bound a swapped-out sequence's resumption is costed by.
    pub fn growth_blocks(&self, seq: &Sequence, n: usize) -> usize {
        (blocks_for(seq.num_computed + n, self.block_size()) - seq.cols[0].table.len()) * seq.cols.len()
    }

    /// Blocks `allocate_slots(id, n)` would take from the free pool (copy-on-write included,
    /// net of the blocks it gives back first).
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        let seq = self.seq(id)?;
        Ok(self.blocks_needed_for(seq, n))
    }

    fn blocks_needed_for(&self, seq: &Sequence, n: usize) -> usize {
        let (need, freed) = Self::allocation_need(&self.pool, &self.spans, seq, n);
        need.saturating_sub(freed)
    }

    /// What giving slots to `n` more tokens of `seq` takes from the pool, over its columns:
    /// the blocks it needs (fresh ones and copy-on-write copies) and the blocks it gives back
    /// to the free pool first (held by it alone, and behind every query from its next
    /// position on).
    fn allocation_need(pool: &BlockPool, spans: &[AttentionSpan], seq: &Sequence, n: usize) -> (usize, usize) {
        if n == 0 {
            return (0, 0);
        }
        let bs = pool.block_size();
        let fresh = blocks_for(seq.num_computed + n, bs) - seq.cols[0].table.len();
        if let ([col], [AttentionSpan::Full]) = (&seq.cols[..], spans) {
            // One full column (no groups): nothing is ever given back.
            return (fresh + usize::from(cow_index(pool, col, seq.num_computed).is_some()), 0);
        }
        let (mut need, mut freed) = (fresh * seq.cols.len(), 0);
        for (col, &span) in seq.cols.iter().zip(spans) {
            need += usize::from(cow_index(pool, col, seq.num_computed).is_some());
            if !span.is_full() && !seq.keep_all {
                let dead = span.dead_blocks(seq.num_computed, bs).min(col.table.len());
                freed += col.table.blocks()[col.num_released.min(dead)..dead]
                    .iter()
                    .filter(|&&b| pool.ref_count_unchecked(b) == 1)
                    .count();
            }
        }
        (need, freed)
    }

    /// Gives slots to the next `n` pending tokens of `id` (positions `num_computed ..
    /// num_computed + n`), copying a shared partial block on write, and registers blocks that
    /// become full in the prefix cache. In a sliding or chunked column it first gives back the
    /// blocks no query from `num_computed` on can see (module docs, "KV cache groups").
    /// All-or-nothing: `Ok(false)` and no change when the pool has too few free blocks. The
    /// sequence must be on the device.
    pub fn allocate_slots(&mut self, id: SeqId, n: usize) -> Result<bool> {
        let KvCacheManager { pool, hasher, seqs, copy_ops, spans, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        if n > seq.num_pending() {
            return Err(CoreError::InvalidArgument(format!(
                "cannot allocate slots for {n} tokens: sequence {id} has only {} tokens without a slot \
                 (append the token ids first)",
                seq.num_pending()
            )));
        }
        if seq.tier != Tier::Device {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} is swapped out to the host: swap it in before giving it slots"
            )));
        }
        let ok = Self::allocate_slots_in(pool, hasher, copy_ops, spans, seq, n);
        self.write_back_evicted();
        Ok(ok)
    }

    /// [`Self::allocate_slots`] on a sequence already looked up (`n <= seq.num_pending()`).
    fn allocate_slots_in(
        pool: &mut BlockPool,
        hasher: &mut BlockHasher,
        copy_ops: &mut Vec<(BlockId, BlockId)>,
        spans: &[AttentionSpan],
        seq: &mut Sequence,
        n: usize,
    ) -> bool {
        if n == 0 {
            return true;
        }
        if let ([col], [AttentionSpan::Full]) = (&mut seq.cols[..], spans) {
            // One full column (a model without groups): the decode path as it was before
            // columns, with nothing to give back.
            let target = seq.num_computed + n;
            let fresh = blocks_for(target, pool.block_size()) - col.table.len();
            let cow = cow_index(pool, col, seq.num_computed);
            if fresh + usize::from(cow.is_some()) > pool.num_free() {
                return false;
            }
            Self::copy_on_write(pool, copy_ops, col, cow);
            pool.allocate_into(fresh, col.table.blocks_mut());
            seq.write_start = seq.num_computed;
            seq.num_computed = target;
            let upto = target.min(seq.prompt_len);
            Self::register_full_blocks(pool, hasher, &seq.tokens, target, seq.tier, col, upto);
            return true;
        }
        let (need, freed) = Self::allocation_need(pool, spans, seq, n);
        if need > pool.num_free() + freed {
            return false;
        }
        let bs = pool.block_size();
        let target = seq.num_computed + n;
        let fresh = blocks_for(target, bs) - seq.cols[0].table.len();
        let Sequence { tokens, cols, num_computed, tier, prompt_len, retention, keep_all, .. } = seq;
        // Every column gives back first, so that any column's allocation can use those blocks.
        // What it gives back is registered first, so that it stays a prefix-cache candidate
        // until evicted: the trunk (column 0) as far as any column gives back, then each
        // giving column (a leaf block links to the trunk's block before it).
        let dead: SmallVec<[usize; 8]> = cols
            .iter()
            .zip(spans)
            .map(|(col, &span)| if span.is_full() || *keep_all { 0 } else { span.dead_blocks(*num_computed, bs).min(col.table.len()) })
            .collect();
        let furthest = cols.iter().zip(&dead).filter(|(col, &d)| d > col.num_released).map(|(_, &d)| d).max();
        if let Some(furthest) = furthest {
            let (trunk, leaves) = cols.split_first_mut().expect("a manager has at least one column");
            Self::register_full_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, furthest * bs);
            for (col, &d) in leaves.iter_mut().zip(&dead[1..]) {
                if d > col.num_released {
                    Self::register_leaf_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, col, d * bs);
                }
            }
            for (col, &d) in cols.iter_mut().zip(&dead) {
                Self::release_behind(pool, *prompt_len, retention, col, d);
            }
        }
        for col in cols.iter_mut() {
            let cow = cow_index(pool, col, *num_computed);
            Self::copy_on_write(pool, copy_ops, col, cow);
            let allocated = pool.allocate_into(fresh, col.table.blocks_mut());
            debug_assert!(allocated, "checked above: enough free blocks");
        }
        seq.write_start = seq.num_computed;
        seq.num_computed = target;
        let upto = seq.num_computed.min(seq.prompt_len);
        Self::register_all(pool, hasher, seq, upto);
        true
    }

    /// Gives `col` a private copy of its shared partial block `cow` (if any), recording the
    /// copy for the runner. The caller checked that a block is free for it.
    #[inline]
    fn copy_on_write(pool: &mut BlockPool, copy_ops: &mut Vec<BlockPair>, col: &mut Column, cow: Option<usize>) {
        if let Some(i) = cow {
            if let Some(private) = pool.allocate_one() {
                let shared = col.table.replace(i, private);
                pool.release_ref_unchecked(shared);
                copy_ops.push((shared, private));
            }
        }
    }

    /// Gives back the blocks of `col` before logical index `dead` that it still holds (the
    /// caller checked that no query from now on reads them, and registered them), released
    /// with the retention they would get when the sequence ends; their entries become
    /// [`BlockId::NULL`].
    fn release_behind(pool: &mut BlockPool, prompt_len: usize, retention: &RetentionPolicy, col: &mut Column, dead: usize) {
        if dead <= col.num_released {
            return;
        }
        let first = col.num_released;
        let behind: Vec<BlockId> = (first..dead).map(|k| col.table.replace(k, BlockId::NULL)).collect();
        Self::release_blocks(pool, retention, prompt_len, &behind, first);
        col.num_released = dead;
    }

    /// The block size and the number of full blocks within the first `upto` computed tokens,
    /// when some of them were not offered to the prefix cache yet (device sequences with
    /// caching on only).
    fn blocks_to_offer(pool: &BlockPool, num_computed: usize, tier: Tier, col: &Column, upto: usize) -> Option<(usize, usize)> {
        if !pool.prefix_caching() || tier != Tier::Device {
            return None;
        }
        let bs = pool.block_size();
        let full = upto.min(num_computed) / bs;
        (full > col.num_registered).then_some((bs, full))
    }

    /// Offers the trunk's (column 0's) full blocks within the sequence's first `upto` computed
    /// tokens, not offered yet, to the prefix cache as a chain (device sequences only).
    fn register_full_blocks(
        pool: &mut BlockPool,
        hasher: &mut BlockHasher,
        tokens: &[u32],
        num_computed: usize,
        tier: Tier,
        col: &mut Column,
        upto: usize,
    ) {
        let Some((bs, full)) = Self::blocks_to_offer(pool, num_computed, tier, col, upto) else { return };
        hasher.extend_chain(&mut col.hashes, tokens, bs, &col.extra, full);
        // Given-back blocks were registered before they were given back (`release_behind`).
        debug_assert!(col.num_registered >= col.num_released);
        let (_, link) = pool.register_chain(col.table.blocks(), &col.hashes, tokens, &col.extra, col.num_registered, full, col.link);
        col.link = link;
        col.num_registered = full;
    }

    /// Offers the full blocks of a column other than 0 (a leaf column) within the sequence's
    /// first `upto` computed tokens, not offered yet, to the prefix cache: block `k` under the
    /// trunk's node of block `k - 1` (module docs, "Prefix caching with columns"; register the
    /// trunk that far first). A block whose trunk parent is not registered (the trunk's chain
    /// broke, or a sliding trunk gave that block back) stays out of the cache: it could never
    /// be verified.
    #[allow(clippy::too_many_arguments)]
    fn register_leaf_blocks(
        pool: &mut BlockPool,
        hasher: &mut BlockHasher,
        tokens: &[u32],
        num_computed: usize,
        tier: Tier,
        trunk: &mut Column,
        col: &mut Column,
        upto: usize,
    ) {
        let Some((bs, full)) = Self::blocks_to_offer(pool, num_computed, tier, col, upto) else { return };
        hasher.extend_chain(&mut trunk.hashes, tokens, bs, &trunk.extra, full);
        hasher.extend_leaves(&mut col.hashes, &trunk.hashes, tokens, bs, &col.extra, full);
        debug_assert!(col.num_registered >= col.num_released);
        for k in col.num_registered..full {
            let block = col.table.blocks()[k];
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
            pool.register(block, col.hashes[k], parent, &tokens[k * bs..(k + 1) * bs], &col.extra);
        }
        col.num_registered = full;
    }

    /// Offers every column's full blocks within the first `upto` computed tokens to the
    /// prefix cache: the trunk first, then the leaf columns that link to it.
    fn register_all(pool: &mut BlockPool, hasher: &mut BlockHasher, seq: &mut Sequence, upto: usize) {
        let Sequence { tokens, cols, num_computed, tier, .. } = seq;
        let (trunk, leaves) = cols.split_first_mut().expect("a manager has at least one column");
        Self::register_full_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, upto);
        for col in leaves {
            Self::register_leaf_blocks(pool, hasher, tokens, *num_computed, *tier, trunk, col, upto);
        }
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
        let KvCacheManager { pool, hasher, seqs, copy_ops, spans, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        if seq.tier != Tier::Device {
            return Err(CoreError::InvalidArgument(format!("sequence {id} is swapped out to the host")));
        }
        seq.tokens.push(token);
        // One slot for the new token, plus any earlier pending ones (all of them, in order).
        let n = seq.num_pending();
        let ok = Self::allocate_slots_in(pool, hasher, copy_ops, spans, seq, n);
        if !ok {
            seq.tokens.pop();
        }
        self.write_back_evicted();
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
            if self.seq(id)?.tier != Tier::Device {
                return Err(CoreError::InvalidArgument(format!("sequence {id} is swapped out to the host")));
            }
        }
        ok.clear();
        ok.reserve(ids.len());
        for (&id, &t) in ids.iter().zip(tokens) {
            ok.push(self.append_token_with_slot(id, t)?);
        }
        Ok(())
    }

    /// Appends `drafts` (speculative decoding) to sequence `id` as unverified tokens: give
    /// them slots with the pending token before them (`allocate_slots`), compute them, then
    /// keep the accepted ones with [`Self::accept_drafts`], or drop them unscheduled with
    /// [`Self::discard_drafts`]. Fails, changing nothing, if the sequence already has drafts or
    /// is not on the device.
    pub fn append_drafts(&mut self, id: SeqId, drafts: &[u32]) -> Result<()> {
        let seq = self.seq_mut(id)?;
        if seq.num_drafts > 0 || seq.tier != Tier::Device {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} cannot take drafts: it has {} already or is not on the device",
                seq.num_drafts
            )));
        }
        seq.tokens.extend_from_slice(drafts);
        seq.num_drafts = drafts.len();
        Ok(())
    }

    /// Drops the drafts of `id` that have no slot yet (an allocation for them failed).
    pub fn discard_drafts(&mut self, id: SeqId) -> Result<()> {
        let seq = self.seq_mut(id)?;
        let verified = seq.num_verified();
        if seq.num_computed > verified {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id}: its drafts have slots; verify them with accept_drafts"
            )));
        }
        seq.tokens.truncate(verified);
        seq.num_drafts = 0;
        Ok(())
    }

    /// Ends the verification of the computed drafts of `id`: the first `accepted` become
    /// verified tokens (their KV, computed in the step, stands), the others are dropped with
    /// their slots, and every block that only rejected drafts occupied goes back to the pool
    /// now. Returns the blocks given back (over all columns). Fails, changing nothing, if
    /// `accepted` exceeds the drafts or they were not all computed.
    pub fn accept_drafts(&mut self, id: SeqId, accepted: usize) -> Result<usize> {
        let KvCacheManager { pool, seqs, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        if accepted > seq.num_drafts || seq.num_computed != seq.tokens.len() || seq.tier != Tier::Device {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id}: cannot accept {accepted} of {} drafts ({} of {} tokens computed)",
                seq.num_drafts,
                seq.num_computed,
                seq.tokens.len()
            )));
        }
        let len = seq.num_verified() + accepted;
        seq.tokens.truncate(len);
        seq.num_drafts = 0;
        seq.num_computed = len;
        seq.write_start = seq.write_start.min(len);
        let bs = pool.block_size();
        let keep = blocks_for(len, bs);
        let mut freed = 0;
        for col in seq.cols.iter_mut() {
            // Never registered (drafts are not offered to the cache), so plain releases.
            debug_assert!(col.num_registered <= len / bs);
            col.num_registered = col.num_registered.min(len / bs);
            for b in col.table.truncate(keep) {
                if !b.is_null() {
                    pool.release_ref_unchecked(b);
                    freed += 1;
                }
            }
        }
        Ok(freed)
    }

    /// A new sequence sharing every block of `id` (ref counts + 1), with the same tokens.
    /// Both sequences' write windows close: fork after the step's KV writes are done.
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId> {
        if self.seq(id)?.num_drafts > 0 {
            return Err(CoreError::InvalidArgument(format!("sequence {id} has unverified drafts: verify them before forking")));
        }
        let parent = self.seq_mut(id)?;
        parent.write_start = parent.num_computed;
        let child = parent.clone();
        let pool = match child.tier {
            Tier::Device => &mut self.pool,
            Tier::Host => self.host.as_mut().ok_or_else(|| CoreError::InvariantViolation("host sequence without a host tier".into()))?,
            Tier::Disk => return Err(CoreError::InvariantViolation("a sequence on the disk tier".into())),
        };
        for b in child.held_blocks() {
            pool.acquire_unchecked(b);
        }
        Ok(self.insert(child))
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
        let prompt = Retention {
            priority: retention.priority,
            expires_at_us: retention.duration_us.map(|d| pool.now_us().saturating_add(d)),
        };
        let tail = if covered > 0 && prompt.priority < DEFAULT_RETENTION_PRIORITY { prompt } else { Retention::DEFAULT };
        for (k, &b) in blocks.iter().enumerate().rev() {
            if !b.is_null() {
                pool.release_with_retention(b, if first + k < covered { prompt } else { tail });
            }
        }
    }

    /// Releases every column's blocks of `seq` into `pool` (emptying its tables).
    fn release_columns(pool: &mut BlockPool, seq: &mut Sequence) {
        let Sequence { cols, retention, prompt_len, .. } = seq;
        for col in cols.iter_mut() {
            let blocks = col.table.take();
            Self::release_blocks(pool, retention, *prompt_len, &blocks, 0);
            col.num_released = 0;
        }
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
        // Blocks filled by decoding become findable now (see `Sequence::prompt_len`); drafts
        // never do (they are dropped: a re-queued branch keeps its verified tokens only).
        let upto = seq.num_computed.min(seq.num_verified());
        let verified = seq.num_verified();
        seq.tokens.truncate(verified);
        seq.num_drafts = 0;
        Self::register_all(&mut self.pool, &mut self.hasher, &mut seq, upto);
        match seq.tier {
            Tier::Device => Self::release_columns(&mut self.pool, &mut seq),
            Tier::Host => {
                if let Some(host) = self.host.as_mut() {
                    Self::release_columns(host, &mut seq);
                }
            }
            Tier::Disk => {} // never: no sequence lives on disk
        }
        Ok(seq.tokens)
    }

    /// Ends sequence `id` like [`Self::free_take_tokens`] after the step that was writing its
    /// window (`write_start .. num_computed`) failed: those positions count as not computed,
    /// and blocks holding any of them lose their prefix-cache identity (the step may have
    /// registered them before writing them), so nothing unwritten is ever served as a hit.
    pub fn free_discarding_window(&mut self, id: SeqId) -> Result<Vec<u32>> {
        let seq = self.seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        if seq.tier == Tier::Device {
            let first_unsure = seq.write_start / self.pool.block_size();
            for col in &mut seq.cols {
                for k in first_unsure..col.num_registered.min(col.table.len()) {
                    let b = col.table.blocks()[k];
                    if !b.is_null() {
                        self.pool.uncache(b);
                    }
                }
                col.num_registered = col.num_registered.min(first_unsure);
            }
            seq.num_computed = seq.write_start;
        }
        self.free_take_tokens(id)
    }

    /// What swapping `id` out would cost: the blocks to copy to the host (its blocks whose
    /// content the host does not hold yet) and the tokens a recompute would compute again
    /// (its computed tokens minus the leading full blocks other sequences share, which stay
    /// cached on the device). `None` without a host tier or for a host sequence.
    pub fn swap_out_cost(&self, id: SeqId) -> Result<Option<(usize, usize)>> {
        let seq = self.seq(id)?;
        let Some(host) = self.host.as_ref() else { return Ok(None) };
        if seq.tier != Tier::Device {
            return Ok(None);
        }
        let on_host = |b: BlockId| self.pool.find_copy_in(b, host).is_some();
        let copies = seq.held_blocks().filter(|&b| !on_host(b)).count();
        // A recompute finds again the prefix every column shares (a given-back entry ends it).
        let shared = seq
            .cols
            .iter()
            .map(|c| {
                c.table
                    .blocks()
                    .iter()
                    .take_while(|&&b| !b.is_null() && self.pool.ref_count_unchecked(b) > 1 && self.pool.is_cached(b))
                    .count()
            })
            .min()
            .unwrap_or(0);
        let recompute = seq.num_computed.saturating_sub(shared * self.block_size());
        Ok(Some((copies, recompute)))
    }

    /// Moves device sequence `id` to the host tier: each block's content goes to a host block
    /// (one already holding it is shared; others are fresh blocks, copied by a `swap_out` op
    /// and registered there when the device block is registered), and the device blocks lose
    /// the sequence's reference (cached ones stay findable on the device). Given-back entries
    /// stay given back. All-or-nothing: `Ok(false)` and no change without a host tier or with
    /// too few free host blocks (the caller recomputes instead). The sequence's window must be
    /// closed (its last step ran).
    pub fn swap_out(&mut self, id: SeqId) -> Result<bool> {
        let KvCacheManager { pool, host, hasher, seqs, swap_out, step_host_written, tiers, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        let Some(host) = host.as_mut() else { return Ok(false) };
        if seq.tier != Tier::Device {
            return Err(CoreError::InvalidArgument(format!("sequence {id} is already on the host")));
        }
        if seq.num_drafts > 0 {
            return Err(CoreError::InvalidArgument(format!("sequence {id} has unverified drafts: verify them before swapping it out")));
        }
        // Blocks filled by decoding get their identity now, so their content can be found on
        // either tier later (as when a sequence is freed).
        let upto = seq.num_computed;
        Self::register_all(pool, hasher, seq, upto);
        let resident = |b: BlockId, host: &BlockPool| pool.find_copy_in(b, host);
        // Host blocks taken from the free queue: fresh ones for the copies, plus free cached
        // ones that already hold a block's content.
        let taken = seq.held_blocks().filter(|&b| resident(b, host).is_none_or(|h| host.ref_count_unchecked(h) == 0)).count();
        if taken > host.num_free() {
            return Ok(false);
        }
        // Shared host blocks first, so the fresh allocations below cannot evict them.
        let mut targets: Vec<Vec<Option<BlockId>>> =
            seq.cols.iter().map(|c| c.held().iter().map(|&b| resident(b, host)).collect()).collect();
        for h in targets.iter().flatten().flatten() {
            host.acquire_unchecked(*h);
        }
        for (col, col_targets) in seq.cols.iter().zip(&mut targets) {
            for (k, t) in col_targets.iter_mut().enumerate() {
                if t.is_some() {
                    continue;
                }
                let d = col.held()[k];
                let Some(h) = host.allocate_one() else {
                    return Err(CoreError::InvariantViolation("host pool ran out during a checked swap-out".into()));
                };
                if let Some(identity) = pool.identity(d) {
                    host.register_copy(h, identity, pool.cached_tokens(d));
                }
                swap_out.push((d, h));
                step_host_written.push(h);
                tiers.blocks_to_host += 1;
                *t = Some(h);
            }
        }
        let released: Vec<usize> = seq.cols.iter().map(|c| c.num_released).collect();
        Self::release_columns(pool, seq);
        for ((col, col_targets), r) in seq.cols.iter_mut().zip(targets).zip(released) {
            let mut blocks = vec![BlockId::NULL; r];
            blocks.extend(col_targets.into_iter().flatten());
            col.table = BlockTable::from_blocks(blocks);
            col.num_released = r;
        }
        seq.tier = Tier::Host;
        seq.write_start = seq.num_computed;
        tiers.swap_outs += 1;
        // Host blocks evicted for the copies go to the disk tier.
        self.write_back_evicted();
        Ok(true)
    }

    /// Device blocks that [`Self::swap_in`] of `id` would take from the free pool (fresh ones,
    /// plus cached ones that are free now).
    pub fn swap_in_cost(&self, id: SeqId) -> Result<usize> {
        let seq = self.seq(id)?;
        let Some(host) = self.host.as_ref() else { return Ok(0) };
        if seq.tier != Tier::Host {
            return Ok(0);
        }
        Ok(seq
            .held_blocks()
            .filter(|&h| match host.find_copy_in(h, &self.pool) {
                Some(d) => self.pool.ref_count_unchecked(d) == 0,
                None => true,
            })
            .count())
    }

    /// Moves host sequence `id` back to the device: a block whose content is still cached on
    /// the device is shared (no copy); the others get fresh device blocks, copied by `swap_in`
    /// ops and registered there when the host block is registered. The host blocks lose the
    /// sequence's reference at [`Self::end_step`]. All-or-nothing: `Ok(false)` and no change
    /// when too few device blocks are free.
    pub fn swap_in(&mut self, id: SeqId) -> Result<bool> {
        if self.seq(id)?.tier != Tier::Host {
            return Err(CoreError::InvalidArgument(format!("sequence {id} is not swapped out")));
        }
        if self.swap_in_cost(id)? > self.pool.num_free() {
            return Ok(false);
        }
        let host_tables: Vec<(usize, Vec<BlockId>)> = match self.seqs.get_mut(id.key()) {
            Some(seq) => seq
                .cols
                .iter_mut()
                .map(|c| {
                    // The held blocks, without a second copy of the table.
                    let mut held = c.table.take();
                    held.drain(..c.num_released);
                    (c.num_released, held)
                })
                .collect(),
            None => return Err(CoreError::UnknownSequence(id.0)),
        };
        let Some(host) = self.host.as_ref() else {
            return Err(CoreError::InvariantViolation("host sequence without a host tier".into()));
        };
        // Device blocks still holding the content first (out of the free queue), then fresh
        // ones, so the fresh allocations cannot evict them.
        let mut targets: Vec<Vec<Option<BlockId>>> =
            host_tables.iter().map(|(_, hb)| hb.iter().map(|&h| host.find_copy_in(h, &self.pool)).collect()).collect();
        for d in targets.iter().flatten().flatten() {
            self.pool.acquire_unchecked(*d);
        }
        for ((_, host_blocks), col_targets) in host_tables.iter().zip(&mut targets) {
            for (k, t) in col_targets.iter_mut().enumerate() {
                if t.is_none() {
                    *t = self.load_from_host(host_blocks[k]);
                    if t.is_none() {
                        return Err(CoreError::InvariantViolation("device pool ran out during a checked swap-in".into()));
                    }
                }
            }
        }
        // The host blocks stay referenced until the step's copies are planned (end_step).
        for (_, host_blocks) in &host_tables {
            self.pinned_host.extend_from_slice(host_blocks);
        }
        let seq = self.seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        for ((col, col_targets), (r, _)) in seq.cols.iter_mut().zip(targets).zip(&host_tables) {
            let mut blocks = vec![BlockId::NULL; *r];
            blocks.extend(col_targets.into_iter().flatten());
            col.table = BlockTable::from_blocks(blocks);
        }
        seq.tier = Tier::Device;
        seq.write_start = seq.num_computed;
        self.tiers.swap_ins += 1;
        self.write_back_evicted();
        Ok(true)
    }

    /// Starts planning a step: forgets the previous step's copy targets (it ran).
    pub fn begin_step(&mut self) {
        self.step_loaded.clear();
        self.step_host_written.clear();
        self.step_disk_written.clear();
    }

    /// Ends planning a step: writes back what was evicted and releases the host pins
    /// (module docs). The step's copies are then final.
    pub fn end_step(&mut self) {
        self.write_back_evicted();
        if let Some(host) = self.host.as_mut() {
            for h in self.pinned_host.drain(..) {
                host.release_ref_unchecked(h);
            }
        }
        if let Some(disk) = self.disk.as_mut() {
            for d in self.pinned_disk.drain(..) {
                disk.release_ref_unchecked(d);
            }
        }
    }

    /// The step that was planned since [`Self::begin_step`] failed: its swap copies may not
    /// have run, so every block they targeted loses its cached identity (device blocks loaded
    /// from the host, host blocks written from the device). Sequences holding such blocks must
    /// be freed by the caller (their KV cannot be trusted).
    pub fn rollback_copies(&mut self) {
        for &d in &self.step_loaded {
            self.pool.uncache(d);
        }
        if let Some(host) = self.host.as_mut() {
            for &h in &self.step_host_written {
                host.uncache(h);
            }
        }
        if let Some(disk) = self.disk.as_mut() {
            for &d in &self.step_disk_written {
                disk.uncache(d);
            }
        }
        self.step_loaded.clear();
        self.step_host_written.clear();
        self.step_disk_written.clear();
    }

    /// Plans copies of every cached block one tier down where the lower tier lacks it (room
    /// permitting, as for evictions): host blocks to disk first, then device blocks to the
    /// host (evicted host blocks go to disk too). Nothing is freed or lost; the blocks stay
    /// where they are. A flush before shutdown (repeated until it plans nothing) leaves the
    /// disk tier holding what the upper tiers cached, for a restarted engine. Returns the
    /// number of copies planned.
    pub fn plan_flush(&mut self) -> usize {
        let before = self.swap_out.len() + self.disk_store.len();
        let cached_missing_below = |upper: &BlockPool, lower: &BlockPool| -> Vec<Evicted> {
            (0..upper.num_blocks() as u32)
                .map(BlockId)
                .filter(|&b| upper.find_copy_in(b, lower).is_none())
                .filter_map(|b| Some(Evicted { block: b, identity: upper.identity(b)?, tokens: upper.cached_tokens(b).to_vec() }))
                .collect()
        };
        if let (Some(host), Some(disk)) = (self.host.as_ref(), self.disk.as_mut()) {
            let todo = cached_missing_below(host, disk);
            let (written, skipped) = spill(todo, disk, &mut self.disk_store, &mut self.step_disk_written, &mut self.pinned_disk);
            self.tiers.blocks_to_disk += written;
            self.tiers.disk_writes_skipped += skipped;
        }
        if let Some(host) = self.host.as_mut() {
            let todo = cached_missing_below(&self.pool, host);
            let (written, skipped) = spill(todo, host, &mut self.swap_out, &mut self.step_host_written, &mut self.pinned_host);
            self.tiers.blocks_to_host += written;
            self.tiers.write_backs += written;
            self.tiers.write_backs_skipped += skipped;
        }
        self.write_back_evicted();
        self.swap_out.len() + self.disk_store.len() - before
    }

    /// Takes the disk copies recorded since the last call: `(host, slot)` writes and
    /// `(slot, host)` reads, each in order (module docs for where they run in a step).
    pub fn take_disk_ops(&mut self) -> (Vec<BlockPair>, Vec<BlockPair>) {
        (std::mem::take(&mut self.disk_store), std::mem::take(&mut self.disk_load))
    }

    /// What disk slot `slot` holds: its identity and token ids (`None`: no disk tier, a bad
    /// slot, or nothing cached there). The runner writes them into the slot's file so that a
    /// restarted engine can restore the entry ([`Self::restore_disk_block`]).
    pub fn disk_block(&self, slot: BlockId) -> Option<(BlockIdentity, &[u32])> {
        let disk = self.disk.as_ref()?;
        disk.check_id(slot).ok()?;
        Some((disk.identity(slot)?, disk.cached_tokens(slot)))
    }

    /// Restores a disk entry written by an earlier process: the block of `tokens` (one block)
    /// under `extra`, whose chained hash is `hash`, after the block whose hash is
    /// `parent_hash` (`None`: a first block). The hash is recomputed from the parent's and
    /// the tokens and must equal `hash`, and the parent must be restored already, so a
    /// restored chain is a chain of exact hash links; node ids are new. Nothing changes unless
    /// it is [`Restore::Done`]. Only with the full 128-bit hash: with a truncated test hash a
    /// link proves nothing, and nothing is restored.
    pub fn restore_disk_block(
        &mut self,
        hash: BlockHash,
        parent_hash: Option<BlockHash>,
        tokens: &[u32],
        extra: &ExtraKey,
    ) -> Restore {
        let Some(disk) = self.disk.as_mut() else { return Restore::Rejected };
        if disk.hash_mode() != HashMode::Xxh3
            || tokens.len() != disk.block_size()
            || self.hasher.hash_block(parent_hash, extra, tokens) != hash
        {
            return Restore::Rejected;
        }
        let parent = match parent_hash {
            None => None,
            Some(ph) => match disk.find_hash(ph).and_then(|b| disk.identity(b)) {
                // A leaf column's block links to the trunk (column 0) block before it.
                Some(id) if id.hash == ph && id.extra == extra.for_column(0) => Some(id.node),
                _ => return Restore::MissingParent,
            },
        };
        if disk.find_hash(hash).is_some() || disk.num_free_uncached() == 0 {
            return Restore::Rejected;
        }
        let Some(slot) = disk.allocate_one() else { return Restore::Rejected };
        let identity = BlockIdentity {
            hash,
            node: self.pool.mint_node(),
            parent,
            parent_hash,
            extra: extra.clone(),
            retention: Retention::DEFAULT,
        };
        let ok = disk.register_copy(slot, identity, tokens);
        disk.release_ref_unchecked(slot);
        if ok {
            Restore::Done(slot)
        } else {
            Restore::Rejected
        }
    }

    /// Ends the cached identity of disk slots whose file could not be written or read (the
    /// runner reports them): they are never served.
    pub fn invalidate_disk_blocks(&mut self, slots: &[BlockId]) {
        if let Some(disk) = self.disk.as_mut() {
            for &s in slots {
                if disk.check_id(s).is_ok() {
                    disk.uncache(s);
                }
            }
        }
    }

    /// True when the host sequence `id` holds a block written by the step being planned.
    pub fn holds_step_host_written(&self, id: SeqId) -> Result<bool> {
        let seq = self.seq(id)?;
        Ok(seq.tier == Tier::Host && seq.held_blocks().any(|b| self.step_host_written.contains(&b)))
    }

    /// Takes the copy-on-write ops recorded since the last call, in order.
    pub fn take_copy_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        std::mem::take(&mut self.copy_ops)
    }

    /// Takes the swap copies recorded since the last call: `(device, host)` swap-outs and
    /// `(host, device)` swap-ins, each in order (run all swap-outs first).
    pub fn take_swap_ops(&mut self) -> (Vec<BlockPair>, Vec<BlockPair>) {
        (std::mem::take(&mut self.swap_out), std::mem::take(&mut self.swap_in))
    }

    /// Drops the cached identity of every free cached block on every tier (device, host,
    /// disk); returns how many. Blocks in use keep theirs. With KV events on, when afterwards
    /// no pool holds a cached block, the call logs one `AllBlocksCleared` instead of a
    /// removal per block.
    pub fn reset_prefix_cache(&mut self) -> usize {
        if self.record_events {
            // What the pools logged so far happened before the reset.
            let before = self.drain_pool_events();
            self.pending_events.extend(before);
        }
        let dropped = self.pools_mut().map(BlockPool::reset_prefix_cache).sum();
        if self.record_events && self.pools().all(|p| p.num_cached_blocks() == 0) {
            for p in self.pools_mut() {
                p.take_events(); // the removals of this call: all cleared instead
            }
            self.pending_events.push(KvEvent::AllBlocksCleared);
        }
        dropped
    }

    /// The pools that exist: device, host, disk.
    fn pools(&self) -> impl Iterator<Item = &BlockPool> {
        [Some(&self.pool), self.host.as_ref(), self.disk.as_ref()].into_iter().flatten()
    }

    fn pools_mut(&mut self) -> impl Iterator<Item = &mut BlockPool> {
        [Some(&mut self.pool), self.host.as_mut(), self.disk.as_mut()].into_iter().flatten()
    }

    /// Turns KV-cache events on or off on every pool (device, host and disk: see
    /// [`crate::kv_events`]). Needs prefix caching (without it nothing is ever cached, and
    /// events stay off). Off, events not yet taken are dropped. While on, take them regularly
    /// ([`Self::take_kv_events`], once per step): they are kept until taken.
    pub fn set_record_events(&mut self, on: bool) {
        let on = on && self.pool.prefix_caching();
        self.record_events = on;
        self.pool.set_record_events(on, Medium::Gpu);
        if let Some(h) = self.host.as_mut() {
            h.set_record_events(on, Medium::Cpu);
        }
        if let Some(d) = self.disk.as_mut() {
            d.set_record_events(on, Medium::Disk);
        }
        if !on {
            self.pending_events.clear();
        }
    }

    /// True when KV-cache events are on.
    #[inline]
    pub fn records_events(&self) -> bool {
        self.record_events
    }

    fn drain_pool_events(&mut self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        for p in self.pools_mut() {
            out.extend(p.take_events());
        }
        out
    }

    /// Takes the KV events logged since the last call: those of the device pool, then the
    /// host's, then the disk's, each pool's in order (an `AllBlocksCleared` comes after
    /// everything logged before it). Empty when events are off or nothing happened.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        if !self.record_events {
            return Vec::new();
        }
        let mut out = std::mem::take(&mut self.pending_events);
        out.extend(self.drain_pool_events());
        out
    }

    /// Takes the KV events logged since the last call ([`Self::take_events`]) as one batch
    /// in vLLM's wire format with timestamp `ts` (seconds; see
    /// [`crate::kv_events::encode_batch`]), or `None` when there are none.
    pub fn take_kv_events(&mut self, ts: f64) -> Option<Vec<u8>> {
        if !self.record_events || (self.pending_events.is_empty() && !self.pools().any(BlockPool::has_events)) {
            return None;
        }
        let events = self.take_events();
        Some(encode_batch(ts, &events))
    }

    /// Ids of all live sequences (slab order).
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.iter().map(|(k, _)| SeqId::from_key(k)).collect()
    }

    /// Checks both pools' and the tables' invariants (module docs).
    pub fn check_invariants(&self) -> Result<()> {
        self.pool.check_invariants()?;
        if let Some(h) = &self.host {
            h.check_invariants()?;
        }
        let bs = self.block_size();
        let mut holders = vec![0u32; self.pool.num_blocks()];
        let mut host_holders = vec![0u32; self.host.as_ref().map_or(0, |h| h.num_blocks())];
        for &h in &self.pinned_host {
            host_holders[h.index()] += 1;
        }
        for (key, seq) in self.seqs.iter() {
            let slot = key.slot;
            let want = blocks_for(seq.num_computed, bs);
            if seq.cols.len() != self.spans.len() {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot} has {} columns, the manager {}",
                    seq.cols.len(),
                    self.spans.len()
                )));
            }
            for (c, (col, span)) in seq.cols.iter().zip(&self.spans).enumerate() {
                if col.table.len() != want {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot} holds {} blocks in column {c} for {} computed tokens (want {want})",
                        col.table.len(),
                        seq.num_computed
                    )));
                }
                // Only blocks no query from `write_start` on sees are given back, and exactly they
                // are null.
                let nulls_ok = col.table.blocks().iter().enumerate().all(|(k, b)| b.is_null() == (k < col.num_released));
                // A sequence that keeps all its blocks gives none back.
                let limit = if seq.keep_all { 0 } else { span.dead_blocks(seq.write_start, bs) };
                let released_ok = col.num_released <= limit;
                if !nulls_ok || !released_ok {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot}, column {c} ({span:?}): {} entries given back of {:?} at write start {}",
                        col.num_released,
                        col.table.blocks(),
                        seq.write_start
                    )));
                }
            }
            // No block holding a draft is offered to the prefix cache.
            let first_draft_block = seq.num_verified() / bs;
            let cached = |b: &BlockId| !b.is_null() && self.pool.is_cached(*b);
            if seq.tier == Tier::Device
                && seq.num_drafts > 0
                && seq.cols.iter().any(|c| c.table.blocks().iter().skip(first_draft_block).any(cached))
            {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot}: a block holding one of its {} drafts is in the prefix cache",
                    seq.num_drafts
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
            let counts = match seq.tier {
                Tier::Device => &mut holders,
                Tier::Host if self.host.is_some() => &mut host_holders,
                Tier::Host | Tier::Disk => {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot} is on tier {:?}, which cannot hold it",
                        seq.tier
                    )))
                }
            };
            for b in seq.held_blocks() {
                counts[b.index()] += 1;
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
        if let Some(disk) = &self.disk {
            disk.check_invariants()?;
            let mut pins = vec![0u32; disk.num_blocks()];
            for &d in &self.pinned_disk {
                pins[d.index()] += 1;
            }
            for (i, &p) in pins.iter().enumerate() {
                let rc = disk.ref_count_unchecked(BlockId(i as u32));
                if rc != p {
                    return Err(CoreError::InvariantViolation(format!("disk slot {i} has ref count {rc} but {p} pins")));
                }
            }
        }
        if let Some(host) = &self.host {
            for (i, &h) in host_holders.iter().enumerate() {
                let rc = host.ref_count_unchecked(BlockId(i as u32));
                if rc != h {
                    return Err(CoreError::InvariantViolation(format!(
                        "host block {i} has ref count {rc} but {h} block tables and pins hold it"
                    )));
                }
            }
        }
        // Write windows: no block is written by two sequences, and a block written while other
        // sequences hold it must be a registered full block, which they reached through a
        // verified prefix hit on exactly the tokens being written.
        let mut writers = vec![0u32; self.pool.num_blocks()];
        for (key, seq) in self.seqs.iter() {
            let slot = key.slot;
            if seq.write_start == seq.num_computed || seq.tier != Tier::Device {
                continue;
            }
            let first = seq.write_start / bs;
            let last = (seq.num_computed - 1) / bs;
            for &b in seq.cols.iter().flat_map(|c| &c.table.blocks()[first..=last]) {
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

/// Copies cached blocks that one tier evicted into `lower` (the next tier down), recording a
/// `(source, destination)` op per block, unless `lower` already holds their content or has no
/// room for them: room is a free block that holds nothing cached, or a cached one whose
/// retention priority is not above the evicted block's. Destinations are pinned (`pins`)
/// until the step's plan ends and listed in `written` (rollback). Returns the blocks written
/// and skipped.
fn spill(
    evicted: Vec<Evicted>,
    lower: &mut BlockPool,
    ops: &mut Vec<BlockPair>,
    written: &mut Vec<BlockId>,
    pins: &mut Vec<BlockId>,
) -> (u64, u64) {
    let (mut n_written, mut n_skipped) = (0, 0);
    for ev in evicted {
        if lower.find_node(ev.identity.hash, ev.identity.node).is_some() {
            continue; // resident there already
        }
        let room =
            lower.num_free_uncached() > 0 || lower.next_eviction_priority().is_some_and(|p| p <= ev.identity.retention.priority);
        let Some(dst) = room.then(|| lower.allocate_one()).flatten() else {
            n_skipped += 1;
            continue;
        };
        if lower.register_copy(dst, ev.identity, &ev.tokens) {
            ops.push((ev.block, dst));
            written.push(dst);
            pins.push(dst);
            n_written += 1;
        } else {
            // Another block there holds the hash (a duplicate or a collision).
            lower.release_ref_unchecked(dst);
            n_skipped += 1;
        }
    }
    (n_written, n_skipped)
}

/// The logical index of the shared partial block the column's next write would go into
/// (copy-on-write needed), if any.
#[inline]
fn cow_index(pool: &BlockPool, col: &Column, num_computed: usize) -> Option<usize> {
    let bs = pool.block_size();
    if num_computed.is_multiple_of(bs) {
        return None; // the next write starts a fresh block
    }
    let i = num_computed / bs;
    (pool.ref_count_unchecked(col.table.blocks()[i]) > 1).then_some(i)
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
        assert_eq!(m.prefix_counters(), PrefixCounters { queries: 38, hits: 12, host_hits: 0, disk_hits: 0, window_hits: 0 });
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
