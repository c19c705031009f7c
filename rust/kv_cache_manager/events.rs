//! KV-cache events of every tier (the manager's module docs, "KV events"), and the prefix-cache
//! reset that clears every tier's cache.

use crate::block_pool::BlockPool;
use crate::kv_events::{encode_batch, KvEvent, Medium};

use super::KvCacheManager;

impl KvCacheManager {
    /// The pools that exist: device, host, disk.
    fn pools(&self) -> impl Iterator<Item = &BlockPool> {
        std::iter::once(&self.pool).chain(self.ledger.pools())
    }

    /// The pools that exist, mutable.
    fn pools_mut(&mut self) -> impl Iterator<Item = &mut BlockPool> {
        std::iter::once(&mut self.pool).chain(self.ledger.pools_mut())
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

    /// Turns KV-cache events on or off on every pool (device, host and disk: see
    /// [`crate::kv_events`]). Needs prefix caching (without it nothing is ever cached, and
    /// events stay off). Off, events not yet taken are dropped. While on, take them regularly
    /// ([`Self::take_kv_events`], once per step): they are kept until taken.
    pub fn set_record_events(&mut self, on: bool) {
        let on = on && self.pool.prefix_caching();
        self.record_events = on;
        self.pool.set_record_events(on, Medium::Gpu);
        self.ledger.set_record_events(on);
        if !on {
            self.pending_events.clear();
        }
    }

    /// True when KV-cache events are on.
    #[inline]
    pub fn records_events(&self) -> bool {
        self.record_events
    }

    /// Every pool's events, device first.
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
}
