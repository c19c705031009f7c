//! Sequence-level KV-cache management: block tables over the device block pool, prefix-cache
//! lookup and registration, copy-on-write, fork and release, with a host tier and a disk tier
//! below the device pool kept by the [`tier_ledger`].
//!
//! A sequence knows its token ids (`tokens`: prompt and generated so far) and how many of
//! them hold a KV slot (`num_computed`): their KV is written, or is being written by the step
//! in flight. Slots are handed out in order by [`KvCacheManager::allocate_slots`]; the table
//! always holds exactly `ceil(num_computed / block_size)` blocks.
//!
//! Tiers. The device pool's blocks are the ones attention reads. With a host tier
//! ([`KvCacheManager::with_host_tier`]) swapped-out sequences and the cached device blocks
//! the pool evicts go to host blocks; with a disk tier ([`KvCacheManager::with_disk_tier`])
//! the cached host blocks the host evicts go to disk slots. The manager decides which
//! sequence moves; the [`tier_ledger::TierLedger`] it owns holds the lower pools and records
//! the copies, pins and rollback of each step (its docs give the order the runner runs them
//! in; the manager's own copy-on-write `copy_ops` run last). A block copied to another tier
//! keeps its node id (block_pool.rs), so one cached content may be resident on several tiers,
//! and a prefix match may continue from device hits into host and disk hits.
//!
//! Invariants (checked by [`KvCacheManager::check_invariants`], on top of every pool's):
//! - a sequence's blocks all live on one tier (its `tier`), and every block's ref count in a
//!   pool equals the number of that tier's block tables holding it (plus its pins, below the
//!   device);
//! - a device sequence's write window, the positions `write_start .. num_computed` that the
//!   step in flight writes, lies in blocks no other sequence writes; a block shared while
//!   written is a registered full block that the other holders reached by a verified prefix
//!   hit on the very tokens being written. Copy-on-write keeps this true when a sequence
//!   writes into a partial block it shares (after `fork`): it gets a private copy, and a copy
//!   op `(src, dst)` is recorded for the runner to execute before the forward pass;
//! - only full blocks are registered in the prefix cache (prompt blocks when the step that
//!   fills them is scheduled; blocks filled by decoding when the sequence is freed or swapped
//!   out), and no block is written again once full.
//!
//! KV cache groups ([`KvCacheManager::with_kv_groups`]): a sequence has one block table per
//! *group*, each with an [`AttentionSpan`], all over the same tokens and the same pool (module
//! `kv_groups` says how slots are given and taken back, and how groups share the prefix cache).
//!
//! KV events ([`KvCacheManager::set_record_events`], off by default): every pool logs its
//! cache's changes ([`crate::kv_events`]; device `"GPU"`, host `"CPU"`, disk `"DISK"`) — the
//! trunk's blocks only — and [`KvCacheManager::take_kv_events`] hands them out as one batch.

mod kv_groups;
mod events;
mod invariants;
mod prefix;
mod sequence;
pub mod tier_ledger;

use crate::attention_span::AttentionSpan;
use crate::block_hash::{BlockHash, BlockHasher, ExtraKey, HashMode};
use crate::block_pool::{BlockIdentity, BlockPool, ChainLink};
use crate::block_table::{blocks_for, BlockTable};
use crate::error::{CoreError, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv_events::KvEvent;
use crate::slab::Slab;
use smallvec::SmallVec;

pub use prefix::{GroupMatch, PrefixCounters, PrefixMatch};
pub use sequence::{AddSequence, GroupTable, RetentionPolicy, Sequence};
pub use tier_ledger::{BlockPair, Restore, Tier, TierBlock, TierCounters, TierLedger};

/// The most groups (block tables per sequence) a manager has.
pub const MAX_KV_GROUPS: usize = 256;

/// Block tables of many sequences over a device pool, with the lower tiers in a
/// [`TierLedger`] (see the module docs).
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    /// The host and disk tiers and the step's copies between tiers.
    ledger: TierLedger,
    hasher: BlockHasher,
    /// What each group's layers attend to (module `kv_groups`); one `Full`
    /// group unless [`KvCacheManager::with_kv_groups`] says otherwise.
    spans: Vec<AttentionSpan>,
    seqs: Slab<Sequence>,
    /// Copy-on-write (device, device) copies since the last `take_copy_ops`.
    copy_ops: Vec<BlockPair>,
    prefix: PrefixCounters,
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
            ledger: TierLedger::default(),
            hasher,
            spans: vec![AttentionSpan::Full],
            seqs: Slab::default(),
            copy_ops: Vec::new(),
            prefix: PrefixCounters::default(),
            record_events: false,
            pending_events: Vec::new(),
        })
    }

    /// Sets the groups: one block table per sequence for each, over the one pool, whose layers
    /// attend as `spans` says (module `kv_groups`). Group 0 comes first; a full
    /// group, if any, should be group 0 (its hash chain is the one KV events report). Only
    /// before the first sequence.
    pub fn with_kv_groups(mut self, spans: Vec<AttentionSpan>) -> Result<Self> {
        if spans.is_empty() {
            return Err(CoreError::Config("a KV cache needs at least one group".into()));
        }
        if spans.len() > MAX_KV_GROUPS {
            return Err(CoreError::Config(format!("at most {MAX_KV_GROUPS} KV cache groups, got {}", spans.len())));
        }
        for s in &spans {
            s.validate()?;
        }
        if !self.seqs.is_empty() {
            return Err(CoreError::InvalidArgument("groups are set before the first sequence".into()));
        }
        self.spans = spans;
        Ok(self)
    }

    /// What each group's layers attend to, group 0 first.
    #[inline]
    pub fn spans(&self) -> &[AttentionSpan] {
        &self.spans
    }

    /// The device pool block by block: the KV cache group each block serves — the group
    /// of the device sequence's table holding it, else (free) the group it is cached for —
    /// or -1 for a free block without a cached identity. For a live view of the groups.
    pub fn block_kv_groups(&self) -> Vec<i16> {
        let n = self.pool.num_blocks();
        let mut out: Vec<i16> = (0..n).map(|i| self.pool.kv_group_of(BlockId(i as u32)).map_or(-1, |c| c as i16)).collect();
        for (_, seq) in self.seqs.iter().filter(|(_, s)| s.tier == Tier::Device) {
            for (c, group) in seq.groups.iter().enumerate() {
                for b in group.held() {
                    out[b.index()] = c as i16;
                }
            }
        }
        out
    }

    /// Number of groups (block tables per sequence).
    #[inline]
    pub fn num_kv_groups(&self) -> usize {
        self.spans.len()
    }

    /// Adds a host tier of `num_host_blocks` blocks (0: none). With prefix caching on, cached
    /// device blocks evicted by reuse are written back to it.
    pub fn with_host_tier(mut self, num_host_blocks: usize) -> Result<Self> {
        self.ledger.set_host_tier(&mut self.pool, num_host_blocks, self.record_events)?;
        Ok(self)
    }

    /// Adds a disk tier of `num_disk_blocks` slots (0: none) below the host tier: cached host
    /// blocks the host pool evicts are written to it, and prefix hits found only there are
    /// read back. Needs a host tier and prefix caching.
    pub fn with_disk_tier(mut self, num_disk_blocks: usize) -> Result<Self> {
        self.ledger.set_disk_tier(&self.pool, num_disk_blocks, self.record_events)?;
        Ok(self)
    }

    /// The device pool (read-only: blocks change hands only through sequences).
    #[inline]
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The host and disk tiers and the copies recorded between the tiers (read-only).
    #[inline]
    pub fn tiers(&self) -> &TierLedger {
        &self.ledger
    }

    /// The host pool, if there is a host tier.
    #[inline]
    pub fn host_pool(&self) -> Option<&BlockPool> {
        self.ledger.host()
    }

    /// The disk tier's slots, if there is a disk tier.
    #[inline]
    pub fn disk_pool(&self) -> Option<&BlockPool> {
        self.ledger.disk()
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
        self.ledger.counters()
    }

    /// Sets the clock (microseconds, monotonic) that retention durations expire on.
    pub fn set_now(&mut self, now_us: u64) {
        self.pool.set_now(now_us);
        self.ledger.set_now(now_us);
    }

    /// The live sequence `id`.
    #[inline]
    pub fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(id.key()).ok_or(CoreError::UnknownSequence(id.0))
    }

    /// The live sequence `id`, mutable.
    #[inline]
    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence> {
        self.seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))
    }

    /// Stores a new sequence; returns its id.
    fn insert(&mut self, seq: Sequence) -> SeqId {
        SeqId::from_key(self.seqs.insert(seq))
    }

    /// Creates a device sequence over `new.tokens` whose first blocks are its cached prefix
    /// (`new.prefix`, or matched now): a reference is taken on each device hit, host and disk
    /// hits are loaded into fresh device blocks as far as the pools have room (the prefix
    /// ends before the first that does not fit). Returns the id and the number of cached
    /// tokens; those tokens count as computed.
    pub fn add_sequence(&mut self, new: AddSequence) -> (SeqId, usize) {
        let AddSequence { tokens, extra, prefix, retention, keep_all } = new;
        let mut m = match prefix {
            Some(m) => m,
            None => self.match_prefix(&tokens, &extra),
        };
        if m.evictions_at_match != self.evictions() || m.groups.len() != self.spans.len() {
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
        let window_hit = m.groups.iter().skip(1).any(|c| c.hits.iter().any(|h| h.block.is_null()));
        // Take every live hit first (device ones out of the free queue, host and disk ones
        // pinned), so that the fresh blocks allocated below can evict none of them.
        for (group, &span) in m.groups.iter().zip(&self.spans) {
            for hit in &group.hits[Self::live_hits(span, keep, bs, keep_all)] {
                match hit.tier {
                    Tier::Device => self.pool.acquire_unchecked(hit.block),
                    Tier::Host | Tier::Disk => self.ledger.pin_hit(*hit),
                }
            }
        }
        let (mut from_host, mut from_disk) = (0u64, 0u64);
        let mut groups: SmallVec<[GroupTable; 1]> = SmallVec::with_capacity(self.spans.len());
        let mut loaded_all = true;
        for (c, (cm, span)) in m.groups.into_iter().zip(self.spans.clone()).enumerate() {
            let live = Self::live_hits(span, keep, bs, keep_all);
            let mut blocks = vec![BlockId::NULL; live.start];
            for hit in &cm.hits[live.clone()] {
                // Room was counted above: the loads cannot fail.
                let loaded = match hit.tier {
                    Tier::Device => Some(hit.block),
                    Tier::Host => {
                        from_host += u64::from(c == 0);
                        self.ledger.load_from_host(&mut self.pool, hit.block)
                    }
                    Tier::Disk => {
                        from_disk += u64::from(c == 0);
                        let ledger = &mut self.ledger;
                        ledger.load_from_disk(hit.block).and_then(|h| ledger.load_from_host(&mut self.pool, h))
                    }
                };
                match loaded {
                    Some(d) => blocks.push(d),
                    None => break,
                }
            }
            loaded_all &= blocks.len() == keep;
            let mut group = GroupTable::new(BlockTable::from_blocks(blocks), cm.hashes, keep, cm.link, extra.for_group(c as u32));
            group.num_released = live.start;
            groups.push(group);
        }
        if !loaded_all {
            // Cannot happen (room was counted); stay safe: keep the prefix every group loaded.
            let held = groups.iter().map(|c| c.table.len()).min().unwrap_or(0);
            for group in &mut groups {
                for b in group.table.blocks_mut().drain(held..).filter(|b| !b.is_null()) {
                    self.pool.release_ref_unchecked(b);
                }
                group.num_registered = held;
                group.num_released = group.num_released.min(held);
                group.link = ChainLink::Broken;
            }
            keep = held;
        }
        self.ledger.write_back_evicted(&mut self.pool);
        let hit_tokens = keep * bs;
        if window_hit {
            self.prefix.window_hits += hit_tokens as u64;
        }
        self.prefix.queries += tokens.len() as u64;
        self.prefix.hits += hit_tokens as u64;
        self.prefix.host_hits += from_host * bs as u64;
        self.prefix.disk_hits += from_disk * bs as u64;
        let seq = Sequence::on_device(tokens, groups, (hit_tokens, hit_tokens), extra, retention, keep_all);
        (self.insert(seq), hit_tokens)
    }

    /// Reserves device blocks to receive the KV of `tokens`' first `num_blocks` full blocks
    /// from another engine (disaggregated prefill), in every group, or `None` (changing
    /// nothing) if the pool lacks room. The blocks this pool already caches (the longest
    /// verified *device* prefix hit every group's chain reaches; never more than
    /// `num_blocks`) are shared — every group holds all of them, also those behind a sliding
    /// group's window, since nothing is given back in a reservation — and the rest are fresh
    /// in every group. Returns the sequence and the number of leading blocks that were hits
    /// (the same in every group): the caller fills each group's blocks after them and then
    /// either `free`s the sequence, which registers them in the prefix cache like any computed
    /// block, or `free_discarding_window`s it (transfer failed), which registers nothing it did
    /// not already hold. At most `(tokens.len() - 1) / block_size` blocks per group, so a
    /// prompt always keeps a token to compute (like a prefix hit).
    ///
    /// Until one of those calls the fresh blocks are in the sequence's write window: not in
    /// the prefix cache, so no other request can hit them while their KV is arriving.
    pub fn reserve_prefix(&mut self, tokens: Vec<u32>, extra: ExtraKey, num_blocks: usize) -> Option<(SeqId, usize)> {
        let bs = self.block_size();
        let num_groups = self.spans.len();
        let num_blocks = num_blocks.min(tokens.len().saturating_sub(1) / bs);
        let mut m = self.match_prefix(&tokens, &extra);
        // Host and disk hits would need copies that only a scheduled step runs: stop at the
        // first one in any group, and at a leaf group's first block not found (a
        // reservation holds every hit of every group).
        let keep = m
            .groups
            .iter()
            .map(|c| c.hits.iter().take(num_blocks).take_while(|h| h.tier == Tier::Device && !h.block.is_null()).count())
            .min()
            .unwrap_or(0);
        self.truncate_match(&mut m, keep);
        let hits = m.groups.iter().flat_map(|c| &c.hits);
        let revived = hits.filter(|h| self.pool.ref_count_unchecked(h.block) == 0).count();
        if (num_blocks - keep) * num_groups + revived > self.pool.num_free() {
            return None;
        }
        // Every hit first, so that the fresh allocations below cannot evict one.
        for hit in m.groups.iter().flat_map(|c| &c.hits) {
            self.pool.acquire_unchecked(hit.block);
        }
        let mut groups: SmallVec<[GroupTable; 1]> = SmallVec::with_capacity(num_groups);
        for (c, cm) in m.groups.into_iter().enumerate() {
            let mut blocks: Vec<BlockId> = Vec::with_capacity(num_blocks);
            blocks.extend(cm.hits.iter().map(|h| h.block));
            let allocated = self.pool.allocate_into(num_blocks - keep, &mut blocks);
            debug_assert!(allocated, "checked above: enough free blocks");
            let key = extra.for_group(c as u32);
            groups.push(GroupTable::new(BlockTable::from_blocks(blocks), cm.hashes, keep, cm.link, key));
        }
        // A cached block this allocation evicted is not written back to the host tier: the
        // transfer overwrites it before any step could copy it out. It is only a cache miss.
        if self.pool.has_evicted() {
            drop(self.pool.take_evicted());
        }
        let seq = Sequence::on_device(tokens, groups, (keep * bs, num_blocks * bs), extra, RetentionPolicy::default(), true);
        Some((self.insert(seq), keep))
    }

    /// Fresh blocks `seq` takes to grow by `n` slots, in all groups, before any is given back
    /// and without copy-on-write: the bound a swapped-out sequence's resumption is costed by.
    pub fn growth_blocks(&self, seq: &Sequence, n: usize) -> usize {
        (blocks_for(seq.num_computed + n, self.block_size()) - seq.groups[0].table.len()) * seq.groups.len()
    }

    /// Blocks `allocate_slots(id, n)` would take from the free pool (copy-on-write included,
    /// net of the blocks it gives back first).
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        let seq = self.seq(id)?;
        Ok(self.blocks_needed_for(seq, n))
    }

    fn blocks_needed_for(&self, seq: &Sequence, n: usize) -> usize {
        let (need, freed) = kv_groups::allocation_need(&self.pool, &self.spans, seq, n);
        need.saturating_sub(freed)
    }

    /// Gives slots to the next `n` pending tokens of `id` (positions `num_computed ..
    /// num_computed + n`), copying a shared partial block on write, and registers blocks that
    /// become full in the prefix cache. In a sliding or chunked group it first gives back the
    /// blocks no query from `num_computed` on can see (module `kv_groups`).
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
        let ok = kv_groups::allocate_slots(pool, hasher, copy_ops, spans, seq, n);
        self.ledger.write_back_evicted(&mut self.pool);
        Ok(ok)
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
        let ok = kv_groups::allocate_slots(pool, hasher, copy_ops, spans, seq, n);
        if !ok {
            seq.tokens.pop();
        }
        self.ledger.write_back_evicted(&mut self.pool);
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
    /// now. Returns the blocks given back (over all groups). Fails, changing nothing, if
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
        for group in seq.groups.iter_mut() {
            // Never registered (drafts are not offered to the cache), so plain releases.
            debug_assert!(group.num_registered <= len / bs);
            group.num_registered = group.num_registered.min(len / bs);
            for b in group.table.truncate(keep) {
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
            Tier::Host => self.ledger.host_mut().ok_or_else(|| CoreError::InvariantViolation("host sequence without a host tier".into()))?,
            Tier::Disk => return Err(CoreError::InvariantViolation("a sequence on the disk tier".into())),
        };
        for b in child.held_blocks() {
            pool.acquire_unchecked(b);
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
        // Blocks filled by decoding become findable now (see `Sequence::prompt_len`); drafts
        // never do (they are dropped: a re-queued sample keeps its verified tokens only).
        let upto = seq.num_computed.min(seq.num_verified());
        let verified = seq.num_verified();
        seq.tokens.truncate(verified);
        seq.num_drafts = 0;
        kv_groups::register_all(&mut self.pool, &mut self.hasher, &mut seq, upto);
        match seq.tier {
            Tier::Device => kv_groups::release_groups(&mut self.pool, &mut seq),
            Tier::Host => {
                if let Some(host) = self.ledger.host_mut() {
                    kv_groups::release_groups(host, &mut seq);
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
            for group in &mut seq.groups {
                for k in first_unsure..group.num_registered.min(group.table.len()) {
                    let b = group.table.blocks()[k];
                    if !b.is_null() {
                        self.pool.uncache(b);
                    }
                }
                group.num_registered = group.num_registered.min(first_unsure);
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
        if seq.tier != Tier::Device {
            return Ok(None);
        }
        let Some(copies) = self.ledger.swap_out_copies(&self.pool, seq.held_blocks()) else { return Ok(None) };
        // A recompute finds again the prefix every group shares (a given-back entry ends it).
        let shared = seq
            .groups
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
        let KvCacheManager { pool, ledger, hasher, seqs, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        if ledger.host().is_none() {
            return Ok(false);
        }
        if seq.tier != Tier::Device {
            return Err(CoreError::InvalidArgument(format!("sequence {id} is already on the host")));
        }
        if seq.num_drafts > 0 {
            return Err(CoreError::InvalidArgument(format!(
                "sequence {id} has unverified drafts: verify them before swapping it out"
            )));
        }
        // Blocks filled by decoding get their identity now, so their content can be found on
        // either tier later (as when a sequence is freed).
        let upto = seq.num_computed;
        kv_groups::register_all(pool, hasher, seq, upto);
        let held: SmallVec<[&[BlockId]; 4]> = seq.groups.iter().map(GroupTable::held).collect();
        let targets = ledger.copy_out(pool, &held)?;
        drop(held);
        let Some(targets) = targets else { return Ok(false) };
        let released: SmallVec<[usize; 4]> = seq.groups.iter().map(|c| c.num_released).collect();
        kv_groups::release_groups(pool, seq);
        for ((group, group_targets), r) in seq.groups.iter_mut().zip(targets).zip(released) {
            let mut blocks = vec![BlockId::NULL; r];
            blocks.extend(group_targets);
            group.table = BlockTable::from_blocks(blocks);
            group.num_released = r;
        }
        seq.tier = Tier::Host;
        seq.write_start = seq.num_computed;
        // Host blocks evicted for the copies go to the disk tier.
        ledger.write_back_evicted(pool);
        Ok(true)
    }

    /// Device blocks that [`Self::swap_in`] of `id` would take from the free pool (fresh ones,
    /// plus cached ones that are free now).
    pub fn swap_in_cost(&self, id: SeqId) -> Result<usize> {
        let seq = self.seq(id)?;
        if seq.tier != Tier::Host {
            return Ok(0);
        }
        Ok(self.ledger.swap_in_cost(&self.pool, seq.held_blocks()))
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
        let KvCacheManager { pool, ledger, seqs, .. } = self;
        let seq = seqs.get_mut(id.key()).ok_or(CoreError::UnknownSequence(id.0))?;
        // The held blocks, without a second copy of the tables.
        let held: Vec<Vec<BlockId>> = seq
            .groups
            .iter_mut()
            .map(|c| {
                let mut held = c.table.take();
                held.drain(..c.num_released);
                held
            })
            .collect();
        let targets = ledger.copy_in(pool, &held)?;
        for (group, group_targets) in seq.groups.iter_mut().zip(targets) {
            let mut blocks = vec![BlockId::NULL; group.num_released];
            blocks.extend(group_targets);
            group.table = BlockTable::from_blocks(blocks);
        }
        seq.tier = Tier::Device;
        seq.write_start = seq.num_computed;
        ledger.write_back_evicted(pool);
        Ok(true)
    }

    /// Starts planning a step: forgets the previous step's copy targets (it ran).
    pub fn begin_step(&mut self) {
        self.ledger.begin_step();
    }

    /// Ends planning a step: writes back what was evicted and releases the pins of the lower
    /// tiers (see [`TierLedger::end_step`]). The step's copies are then final.
    pub fn end_step(&mut self) {
        self.ledger.end_step(&mut self.pool);
    }

    /// The step that was planned since [`Self::begin_step`] failed: its copies between tiers
    /// may not have run, so every block they targeted loses its cached identity. Sequences
    /// holding such blocks must be freed by the caller (their KV cannot be trusted).
    pub fn rollback_copies(&mut self) {
        self.ledger.rollback_copies(&mut self.pool);
    }

    /// Plans copies of every cached block one tier down where the lower tier lacks it
    /// ([`TierLedger::plan_flush`]). A flush before shutdown (repeated until it plans nothing)
    /// leaves the disk tier holding what the upper tiers cached, for a restarted engine.
    /// Returns the number of copies planned.
    pub fn plan_flush(&mut self) -> usize {
        self.ledger.plan_flush(&mut self.pool)
    }

    /// Takes the disk copies recorded since the last call: `(host, slot)` writes and
    /// `(slot, host)` reads, each in order (see [`tier_ledger`] for where they run in a step).
    pub fn take_disk_ops(&mut self) -> (Vec<BlockPair>, Vec<BlockPair>) {
        self.ledger.take_disk_ops()
    }

    /// What disk slot `slot` holds: its identity and token ids (`None`: no disk tier, a bad
    /// slot, or nothing cached there). The runner writes them into the slot's file so that a
    /// restarted engine can restore the entry ([`Self::restore_disk_block`]).
    pub fn disk_block(&self, slot: BlockId) -> Option<(BlockIdentity, &[u32])> {
        self.ledger.disk_block(slot)
    }

    /// Restores a disk entry written by an earlier process (see
    /// [`TierLedger::restore_disk_block`]).
    pub fn restore_disk_block(
        &mut self,
        hash: BlockHash,
        parent_hash: Option<BlockHash>,
        tokens: &[u32],
        extra: &ExtraKey,
    ) -> Restore {
        self.ledger.restore_disk_block(&mut self.hasher, &mut self.pool, hash, parent_hash, tokens, extra)
    }

    /// Ends the cached identity of disk slots whose file could not be written or read (the
    /// runner reports them): they are never served.
    pub fn invalidate_disk_blocks(&mut self, slots: &[BlockId]) {
        self.ledger.invalidate_disk_blocks(slots);
    }

    /// True when the host sequence `id` holds a block written by the step being planned.
    pub fn holds_step_host_written(&self, id: SeqId) -> Result<bool> {
        let seq = self.seq(id)?;
        Ok(seq.tier == Tier::Host && seq.held_blocks().any(|b| self.ledger.is_step_host_written(b)))
    }

    /// Takes the copy-on-write ops recorded since the last call, in order.
    pub fn take_copy_ops(&mut self) -> Vec<BlockPair> {
        std::mem::take(&mut self.copy_ops)
    }

    /// Takes the swap copies recorded since the last call: `(device, host)` swap-outs and
    /// `(host, device)` swap-ins, each in order (run all swap-outs first).
    pub fn take_swap_ops(&mut self) -> (Vec<BlockPair>, Vec<BlockPair>) {
        self.ledger.take_swap_ops()
    }

    /// Ids of all live sequences (slab order).
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.iter().map(|(k, _)| SeqId::from_key(k)).collect()
    }
}

#[cfg(test)]
mod tests;
