//! The tier ledger: the host and disk tiers below the device pool, and the block copies between
//! the tiers that the step being planned records for the runner.
//!
//! It owns the host pool (swapped-out sequences, cached blocks the device pool evicted) and
//! the disk pool (cached blocks the host pool evicted; only the slots' identities: the runner
//! owns the files, one per slot), and records the step's copies, which the runner executes
//! before the step's forward pass in this order:
//! 1. `disk_store` (host → disk): cached host blocks the host pool reuses in this step, read
//!    before anything below overwrites them;
//! 2. `swap_out` (device → host): a preempted sequence's blocks, and cached device blocks the
//!    device pool reuses in this step (write-back: their KV is intact until this step's
//!    forward overwrites it);
//! 3. `disk_load` (disk → host): prefix hits found only on disk, on their way to the device;
//! 4. `swap_in` (host → device): a swapped sequence coming back, and host prefix hits;
//! 5. then the manager's own copy-on-write copies (device → device).
//!
//! Why apart from [`super::KvCacheManager`]: the manager keeps the device pool, the sequences'
//! block tables and the prefix logic; every block of a lower tier changes hands here, so the
//! rules of the copy lists hold in one place:
//! - a host block or disk slot that a recorded copy reads or writes, and that no sequence
//!   holds, is pinned (one extra reference) until [`TierLedger::end_step`], so no later
//!   allocation in the same step can take it as another copy's target;
//! - every block a copy of the step writes is listed until the next
//!   [`TierLedger::begin_step`]: if the step fails, [`TierLedger::rollback_copies`] takes their
//!   cached identities back, so content that never arrived is never served.
//!
//! The device pool is passed in by the manager wherever a copy starts or ends there.

use crate::block_hash::{BlockHash, BlockHasher, ExtraKey, HashMode};
use crate::block_pool::{BlockIdentity, BlockPool, Evicted};
use crate::error::{CoreError, Result};
use crate::eviction_queue::Retention;
use crate::ids::BlockId;
use crate::kv_events::Medium;

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

/// A cached block found by a prefix match, on any tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierBlock {
    /// The tier of `block`.
    pub tier: Tier,
    /// A block id of that tier's pool.
    pub block: BlockId,
}

/// The outcome of [`TierLedger::restore_disk_block`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restore {
    /// Restored in this slot.
    Done(BlockId),
    /// Its parent is not restored (yet): try again after the parent, or give up.
    MissingParent,
    /// Never restorable: a wrong hash, a duplicate, no free slot, or no disk tier.
    Rejected,
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

/// The host and disk pools, the copies recorded for the step being planned, and the pins and
/// copy targets that keep them safe (module docs).
#[derive(Debug, Clone, Default)]
pub struct TierLedger {
    host: Option<BlockPool>,
    disk: Option<BlockPool>,
    /// (device, host) copies recorded since the last `take_swap_ops`.
    swap_out: Vec<BlockPair>,
    /// (host, device) copies recorded since the last `take_swap_ops`.
    swap_in: Vec<BlockPair>,
    /// (host, disk slot) writes since the last `take_disk_ops`.
    disk_store: Vec<BlockPair>,
    /// (disk slot, host) reads since the last `take_disk_ops`.
    disk_load: Vec<BlockPair>,
    /// Host blocks holding an extra reference until `end_step`.
    pinned_host: Vec<BlockId>,
    /// Disk slots holding an extra reference until `end_step`.
    pinned_disk: Vec<BlockId>,
    /// Device blocks written by swap-ins since `begin_step`.
    step_loaded: Vec<BlockId>,
    /// Host blocks written by swap-outs and disk loads since `begin_step`.
    step_host_written: Vec<BlockId>,
    /// Disk slots written since `begin_step`.
    step_disk_written: Vec<BlockId>,
    counters: TierCounters,
}

/// A tier pool's configuration error, named after the tier.
fn tier_config(tier: &str, e: CoreError) -> CoreError {
    match e {
        CoreError::Config(m) => CoreError::Config(format!("{tier} tier: {m}")),
        e => e,
    }
}

impl TierLedger {
    /// Sets a host tier of `num_host_blocks` blocks (0: none) below `device`, whose evictions
    /// of cached blocks are then logged to be written back to it.
    pub fn set_host_tier(&mut self, device: &mut BlockPool, num_host_blocks: usize, record_events: bool) -> Result<()> {
        if num_host_blocks == 0 {
            self.host = None;
            device.set_log_evictions(false);
            return Ok(());
        }
        let mut host = BlockPool::new(num_host_blocks, device.block_size(), device.prefix_caching(), device.hash_mode())
            .map_err(|e| tier_config("host", e))?;
        host.keep_full_hashes();
        host.set_record_events(record_events, Medium::Cpu);
        self.host = Some(host);
        device.set_log_evictions(true);
        Ok(())
    }

    /// Sets a disk tier of `num_disk_blocks` slots (0: none) below the host tier. Needs a host
    /// tier and prefix caching on `device`.
    pub fn set_disk_tier(&mut self, device: &BlockPool, num_disk_blocks: usize, record_events: bool) -> Result<()> {
        if num_disk_blocks == 0 {
            self.disk = None;
            return Ok(());
        }
        let Some(host) = self.host.as_mut() else {
            return Err(CoreError::Config("a disk tier needs a host tier (num_host_blocks > 0)".into()));
        };
        if !device.prefix_caching() {
            return Err(CoreError::Config("a disk tier needs prefix caching".into()));
        }
        host.set_log_evictions(true);
        let mut disk =
            BlockPool::new(num_disk_blocks, device.block_size(), true, device.hash_mode()).map_err(|e| tier_config("disk", e))?;
        disk.keep_full_hashes();
        disk.set_record_events(record_events, Medium::Disk);
        self.disk = Some(disk);
        Ok(())
    }

    /// The host pool, if there is a host tier.
    #[inline]
    pub fn host(&self) -> Option<&BlockPool> {
        self.host.as_ref()
    }

    /// The host pool, for the manager's host sequences (fork, free).
    #[inline]
    pub(super) fn host_mut(&mut self) -> Option<&mut BlockPool> {
        self.host.as_mut()
    }

    /// The disk tier's slots, if there is a disk tier.
    #[inline]
    pub fn disk(&self) -> Option<&BlockPool> {
        self.disk.as_ref()
    }

    /// The pool of a lower tier (`None` for the device, or a tier that does not exist).
    #[inline]
    pub fn pool(&self, tier: Tier) -> Option<&BlockPool> {
        match tier {
            Tier::Device => None,
            Tier::Host => self.host.as_ref(),
            Tier::Disk => self.disk.as_ref(),
        }
    }

    /// The lower tiers' pools that exist: host, then disk.
    pub fn pools(&self) -> impl Iterator<Item = &BlockPool> {
        [self.host.as_ref(), self.disk.as_ref()].into_iter().flatten()
    }

    /// The lower tiers' pools that exist, mutable (events and prefix-cache resets).
    pub(super) fn pools_mut(&mut self) -> impl Iterator<Item = &mut BlockPool> {
        [self.host.as_mut(), self.disk.as_mut()].into_iter().flatten()
    }

    /// Block movements between the tiers so far.
    #[inline]
    pub fn counters(&self) -> TierCounters {
        self.counters
    }

    /// Sets the clock (microseconds) that the host tier's retention durations expire on.
    pub fn set_now(&mut self, now_us: u64) {
        if let Some(h) = self.host.as_mut() {
            h.set_now(now_us);
        }
    }

    /// Turns KV events on or off on the host (`"CPU"`) and disk (`"DISK"`) pools.
    pub fn set_record_events(&mut self, on: bool) {
        if let Some(h) = self.host.as_mut() {
            h.set_record_events(on, Medium::Cpu);
        }
        if let Some(d) = self.disk.as_mut() {
            d.set_record_events(on, Medium::Disk);
        }
    }

    /// Evictions of the host and disk pools so far.
    pub fn evictions(&self) -> u64 {
        self.pools().map(|p| p.counters().evictions).sum()
    }

    /// The verified cached block for `hash` (its parent node `parent`, its `tokens`, its
    /// `extra` key) on the host, else on disk, with its node.
    pub fn lookup(&self, hash: BlockHash, parent: Option<u64>, tokens: &[u32], extra: &ExtraKey) -> Option<(TierBlock, u64)> {
        [(Tier::Host, self.host.as_ref()), (Tier::Disk, self.disk.as_ref())].into_iter().find_map(|(tier, pool)| {
            let (block, node) = pool?.lookup_verified(hash, parent, tokens, extra)?;
            Some((TierBlock { tier, block }, node))
        })
    }

    /// Takes a reference on a host or disk prefix hit and pins it until `end_step`, so that
    /// no allocation before its copy runs can evict it (device hits are the manager's).
    pub fn pin_hit(&mut self, hit: TierBlock) {
        let (pool, pins) = match hit.tier {
            Tier::Device => return,
            Tier::Host => (self.host.as_mut(), &mut self.pinned_host),
            Tier::Disk => (self.disk.as_mut(), &mut self.pinned_disk),
        };
        if let Some(pool) = pool {
            pool.acquire_unchecked(hit.block);
            pins.push(hit.block);
        }
    }

    /// Copies host block `h` into a fresh `device` block registered with the same identity
    /// (recording the swap-in), or `None` if no device block is free.
    pub fn load_from_host(&mut self, device: &mut BlockPool, h: BlockId) -> Option<BlockId> {
        let host = self.host.as_ref()?;
        let d = device.allocate_one()?;
        if let Some(identity) = host.identity(h) {
            device.register_copy(d, identity, host.cached_tokens(h));
        }
        self.swap_in.push((h, d));
        self.step_loaded.push(d);
        self.counters.blocks_to_device += 1;
        Some(d)
    }

    /// Reads disk slot `slot` into a fresh host block registered with the same identity and
    /// pinned until `end_step` (recording the disk load), or `None` if no host block is free.
    pub fn load_from_disk(&mut self, slot: BlockId) -> Option<BlockId> {
        let (host, disk) = (self.host.as_mut()?, self.disk.as_ref()?);
        let h = host.allocate_one()?;
        if let Some(identity) = disk.identity(slot) {
            host.register_copy(h, identity, disk.cached_tokens(slot));
        }
        self.disk_load.push((slot, h));
        self.step_host_written.push(h);
        self.pinned_host.push(h);
        self.counters.blocks_from_disk += 1;
        Some(h)
    }

    /// Writes the cached blocks evicted since the last call one tier down: `device` blocks to
    /// the host tier (`swap_out`), then host blocks — including those just evicted to make
    /// room — to the disk tier (`disk_store`), room permitting (see `spill`).
    #[inline]
    pub fn write_back_evicted(&mut self, device: &mut BlockPool) {
        // The common case (nothing evicted, or no tier below) stays a couple of loads on the
        // decode path.
        if self.host.is_some() && (device.has_evicted() || self.host.as_ref().is_some_and(BlockPool::has_evicted)) {
            self.spill_evicted(device);
        }
    }

    /// [`Self::write_back_evicted`] when something was evicted.
    fn spill_evicted(&mut self, device: &mut BlockPool) {
        let Some(host) = self.host.as_mut() else { return };
        if device.has_evicted() {
            let (written, skipped) =
                spill(device.take_evicted(), host, &mut self.swap_out, &mut self.step_host_written, &mut self.pinned_host);
            self.counters.blocks_to_host += written;
            self.counters.write_backs += written;
            self.counters.write_backs_skipped += skipped;
        }
        if let Some(disk) = self.disk.as_mut() {
            if host.has_evicted() {
                let (written, skipped) =
                    spill(host.take_evicted(), disk, &mut self.disk_store, &mut self.step_disk_written, &mut self.pinned_disk);
                self.counters.blocks_to_disk += written;
                self.counters.disk_writes_skipped += skipped;
            }
        }
    }

    /// Blocks a swap-out of the device blocks `held` would copy to the host (those whose
    /// content the host does not hold yet); `None` without a host tier.
    pub fn swap_out_copies(&self, device: &BlockPool, held: impl Iterator<Item = BlockId>) -> Option<usize> {
        let host = self.host.as_ref()?;
        Some(held.filter(|&b| device.find_copy_in(b, host).is_none()).count())
    }

    /// The host blocks for a swap-out of the device blocks `held` (one list per group, in
    /// order): a host block already holding a block's content is shared (a reference taken),
    /// the others are fresh, copied by `swap_out` ops and registered with the device block's
    /// identity. All-or-nothing: `None`, changing nothing, without a host tier or with too few
    /// free host blocks. The caller then releases the device blocks.
    pub fn copy_out(&mut self, device: &BlockPool, held: &[&[BlockId]]) -> Result<Option<Vec<Vec<BlockId>>>> {
        let Some(host) = self.host.as_mut() else { return Ok(None) };
        let resident = |b: BlockId, host: &BlockPool| device.find_copy_in(b, host);
        // Host blocks taken from the free queue: fresh ones for the copies, plus free cached
        // ones that already hold a block's content.
        let taken = held
            .iter()
            .flat_map(|c| c.iter())
            .filter(|&&b| resident(b, host).is_none_or(|h| host.ref_count_unchecked(h) == 0))
            .count();
        if taken > host.num_free() {
            return Ok(None);
        }
        // Shared host blocks first, so the fresh allocations below cannot evict them.
        let mut targets: Vec<Vec<Option<BlockId>>> =
            held.iter().map(|c| c.iter().map(|&b| resident(b, host)).collect()).collect();
        for h in targets.iter().flatten().flatten() {
            host.acquire_unchecked(*h);
        }
        for (group, group_targets) in held.iter().zip(&mut targets) {
            for (&d, t) in group.iter().zip(group_targets.iter_mut()) {
                if t.is_some() {
                    continue;
                }
                let Some(h) = host.allocate_one() else {
                    return Err(CoreError::InvariantViolation("host pool ran out during a checked swap-out".into()));
                };
                if let Some(identity) = device.identity(d) {
                    host.register_copy(h, identity, device.cached_tokens(d));
                }
                self.swap_out.push((d, h));
                self.step_host_written.push(h);
                self.counters.blocks_to_host += 1;
                *t = Some(h);
            }
        }
        self.counters.swap_outs += 1;
        Ok(Some(targets.into_iter().map(|c| c.into_iter().flatten().collect()).collect()))
    }

    /// Device blocks that [`Self::copy_in`] of the host blocks `held` would take from the free
    /// `device` pool (fresh ones, plus cached ones that are free now).
    pub fn swap_in_cost(&self, device: &BlockPool, held: impl Iterator<Item = BlockId>) -> usize {
        let Some(host) = self.host.as_ref() else { return 0 };
        held.filter(|&h| host.find_copy_in(h, device).is_none_or(|d| device.ref_count_unchecked(d) == 0)).count()
    }

    /// The device blocks for a swap-in of the host blocks `held` (one list per group, in
    /// order): a block whose content is still cached on the device is shared (a reference
    /// taken); the others get fresh device blocks, copied by `swap_in` ops. The host blocks
    /// keep the sequence's reference as pins until `end_step`. The caller checked the room
    /// ([`Self::swap_in_cost`]).
    pub fn copy_in(&mut self, device: &mut BlockPool, held: &[Vec<BlockId>]) -> Result<Vec<Vec<BlockId>>> {
        let Some(host) = self.host.as_ref() else {
            return Err(CoreError::InvariantViolation("host sequence without a host tier".into()));
        };
        // Device blocks still holding the content first (out of the free queue), then fresh
        // ones, so the fresh allocations cannot evict them.
        let mut targets: Vec<Vec<Option<BlockId>>> =
            held.iter().map(|c| c.iter().map(|&h| host.find_copy_in(h, device)).collect()).collect();
        for d in targets.iter().flatten().flatten() {
            device.acquire_unchecked(*d);
        }
        for (group, group_targets) in held.iter().zip(&mut targets) {
            for (&h, t) in group.iter().zip(group_targets.iter_mut()) {
                if t.is_none() {
                    *t = self.load_from_host(device, h);
                    if t.is_none() {
                        return Err(CoreError::InvariantViolation("device pool ran out during a checked swap-in".into()));
                    }
                }
            }
        }
        // The host blocks stay referenced until the step's copies are planned (end_step).
        for group in held {
            self.pinned_host.extend_from_slice(group);
        }
        self.counters.swap_ins += 1;
        Ok(targets.into_iter().map(|c| c.into_iter().flatten().collect()).collect())
    }

    /// True when host block `h` was written by a copy of the step being planned.
    pub fn is_step_host_written(&self, h: BlockId) -> bool {
        self.step_host_written.contains(&h)
    }

    /// Starts planning a step: forgets the previous step's copy targets (it ran).
    pub fn begin_step(&mut self) {
        self.step_loaded.clear();
        self.step_host_written.clear();
        self.step_disk_written.clear();
    }

    /// Ends planning a step: writes back what `device` and the host evicted and releases the
    /// pins. The step's copies are then final.
    pub fn end_step(&mut self, device: &mut BlockPool) {
        self.write_back_evicted(device);
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

    /// The step planned since [`Self::begin_step`] failed: its copies may not have run, so
    /// every block they targeted loses its cached identity (`device` blocks loaded from the
    /// host, host blocks written from the device or disk, disk slots written from the host).
    pub fn rollback_copies(&mut self, device: &mut BlockPool) {
        for &d in &self.step_loaded {
            device.uncache(d);
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
        self.begin_step();
    }

    /// Plans copies of every cached block one tier down where the lower tier lacks it (room
    /// permitting, as for evictions): host blocks to disk first, then `device` blocks to the
    /// host (evicted host blocks go to disk too). Nothing is freed; the blocks stay where they
    /// are. Returns the number of copies planned.
    pub fn plan_flush(&mut self, device: &mut BlockPool) -> usize {
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
            self.counters.blocks_to_disk += written;
            self.counters.disk_writes_skipped += skipped;
        }
        if let Some(host) = self.host.as_mut() {
            let todo = cached_missing_below(device, host);
            let (written, skipped) = spill(todo, host, &mut self.swap_out, &mut self.step_host_written, &mut self.pinned_host);
            self.counters.blocks_to_host += written;
            self.counters.write_backs += written;
            self.counters.write_backs_skipped += skipped;
        }
        self.write_back_evicted(device);
        self.swap_out.len() + self.disk_store.len() - before
    }

    /// Takes the swap copies recorded since the last call: `(device, host)` swap-outs and
    /// `(host, device)` swap-ins, each in order.
    pub fn take_swap_ops(&mut self) -> (Vec<BlockPair>, Vec<BlockPair>) {
        (std::mem::take(&mut self.swap_out), std::mem::take(&mut self.swap_in))
    }

    /// Takes the disk copies recorded since the last call: `(host, slot)` writes and
    /// `(slot, host)` reads, each in order.
    pub fn take_disk_ops(&mut self) -> (Vec<BlockPair>, Vec<BlockPair>) {
        (std::mem::take(&mut self.disk_store), std::mem::take(&mut self.disk_load))
    }

    /// What disk slot `slot` holds: its identity and token ids (`None`: no disk tier, a bad
    /// slot, or nothing cached there).
    pub fn disk_block(&self, slot: BlockId) -> Option<(BlockIdentity, &[u32])> {
        let disk = self.disk.as_ref()?;
        disk.check_id(slot).ok()?;
        Some((disk.identity(slot)?, disk.cached_tokens(slot)))
    }

    /// Restores a disk entry written by an earlier process: the block of `tokens` (one block)
    /// under `extra`, whose chained hash is `hash`, after the block whose hash is
    /// `parent_hash` (`None`: a first block). The hash is recomputed (with `hasher`) from the
    /// parent's and the tokens and must equal `hash`, and the parent must be restored already,
    /// so a restored chain is a chain of exact hash links; node ids are new, minted by
    /// `device` (node ids are shared by every tier). Nothing changes unless it is
    /// [`Restore::Done`]. Only with the full 128-bit hash: with a truncated test hash a link
    /// proves nothing, and nothing is restored.
    pub fn restore_disk_block(
        &mut self,
        hasher: &mut BlockHasher,
        device: &mut BlockPool,
        hash: BlockHash,
        parent_hash: Option<BlockHash>,
        tokens: &[u32],
        extra: &ExtraKey,
    ) -> Restore {
        let Some(disk) = self.disk.as_mut() else { return Restore::Rejected };
        if disk.hash_mode() != HashMode::Xxh3
            || tokens.len() != disk.block_size()
            || hasher.hash_block(parent_hash, extra, tokens) != hash
        {
            return Restore::Rejected;
        }
        let parent = match parent_hash {
            None => None,
            Some(ph) => match disk.find_hash(ph).and_then(|b| disk.identity(b)) {
                // A leaf group's block links to the trunk (group 0) block before it.
                Some(id) if id.hash == ph && id.extra == extra.for_group(0) => Some(id.node),
                _ => return Restore::MissingParent,
            },
        };
        if disk.find_hash(hash).is_some() || disk.num_free_uncached() == 0 {
            return Restore::Rejected;
        }
        let Some(slot) = disk.allocate_one() else { return Restore::Rejected };
        let identity = BlockIdentity {
            hash,
            node: device.mint_node(),
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

    /// Ends the cached identity of disk slots whose file could not be written or read: they
    /// are never served.
    pub fn invalidate_disk_blocks(&mut self, slots: &[BlockId]) {
        if let Some(disk) = self.disk.as_mut() {
            for &s in slots {
                if disk.check_id(s).is_ok() {
                    disk.uncache(s);
                }
            }
        }
    }

    /// Checks the lower pools' invariants, and that every host block's ref count equals
    /// `host_holders` (the host sequences' tables holding it, one entry per host block) plus
    /// its pins, and every disk slot's equals its pins.
    pub fn check_invariants(&self, mut host_holders: Vec<u32>) -> Result<()> {
        if let Some(host) = &self.host {
            host.check_invariants()?;
            host_holders.resize(host.num_blocks(), 0);
            for &h in &self.pinned_host {
                host_holders[h.index()] += 1;
            }
            for (i, &h) in host_holders.iter().enumerate() {
                let rc = host.ref_count_unchecked(BlockId(i as u32));
                if rc != h {
                    return Err(CoreError::InvariantViolation(format!(
                        "host block {i} has ref count {rc} but {h} block tables and pins hold it"
                    )));
                }
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

#[cfg(test)]
#[path = "tier_ledger_tests.rs"]
mod tests;
