//! The scheduler side of KV transfer between engines (disaggregated prefill / decode).
//!
//! Two kinds of held sequences, neither of them a scheduled request:
//!
//! - A **lease** (prefill side). A request added with `hold_kv` keeps its KV when it ends:
//!   its first finished sample's sequence is forked into a lease that holds every block the
//!   sample held (a reference each, so nothing can reuse them), until
//!   [`Scheduler::release_kv_lease`]. A remote engine reads the blocks in between. The blocks
//!   were registered in the prefix cache as they filled, so once released they stay findable
//!   like any freed block. An aborted request takes no lease.
//! - A **reservation** (decode side). [`Scheduler::reserve_kv`] takes device blocks for a
//!   prompt's first full blocks — the ones this pool already caches are shared (only the rest
//!   is pulled) — and [`Scheduler::commit_kv`] (the KV arrived: the blocks enter the prefix
//!   cache) or [`Scheduler::cancel_kv`] (it did not) ends it. The request itself was added
//!   before, blocked on [`super::Wait::RemoteKv`] (`admission`), and is unblocked after the
//!   commit: it finds those blocks as a prefix hit at admission.
//!
//! Both are sequences of the KV-cache manager, so its invariants (ref counts = tables) cover
//! them, and `stats()` counts their blocks as used.
//!
//! **KV cache groups.** With several KV cache groups (one block table per KV cache group per sequence) both
//! carry every KV cache group, as one list of block ids, **group-major**: KV cache group 0's `n` blocks,
//! then KV cache group 1's `n`, and so on, every KV cache group the same length `n`. A `hold_kv` request's
//! sequence keeps every block of every KV cache group (a sliding or chunked KV cache group gives nothing
//! back behind its window: `AddSequence::keep_all`), so its lease holds
//! the whole prompt in every KV cache group; its memory is that of every layer whole, bounded by
//! its length. A reservation holds its hits in every KV cache group, also those behind a window;
//! the request unblocked after the commit gives those back at admission as usual.

use super::Scheduler;
use crate::block_hash::ExtraKey;
use crate::error::{CoreError, Result};

impl Scheduler {
    /// Fails when a `hold_kv` request of up to `len` tokens could never run: with a sliding
    /// or chunked KV cache group it keeps every block of every KV cache group (nothing given back behind a
    /// window), so it needs `KV cache groups * ceil(len / block_size)` blocks, which the whole pool
    /// must hold.
    pub(super) fn check_kv_lease_fits(&self, id: &str, len: usize) -> Result<()> {
        if self.kv.spans().iter().all(|s| s.is_full()) {
            return Ok(()); // as any request: max_model_len fits the pool
        }
        let groups = self.kv.num_kv_groups();
        let need = groups * crate::block_table::blocks_for(len, self.config.block_size);
        let have = self.kv.pool().num_blocks();
        if need > have {
            return Err(CoreError::InvalidArgument(format!(
                "request {id:?}: holding its KV for another engine (hold_kv) keeps all {len} tokens in each \
                 of the {groups} KV cache groups: {need} blocks, more than the pool's {have}"
            )));
        }
        Ok(())
    }

    /// Forks the sequence of `req`'s sample `seq` into a lease named after the request, once
    /// per request (called when a sample of a `hold_kv` request finishes, before it is freed).
    pub(super) fn take_kv_lease(&mut self, id: &std::sync::Arc<str>, seq: crate::ids::SeqId) {
        if self.kv_leases.contains_key(id) {
            return;
        }
        // The sample's sequence is live by construction, and keeps every block of every KV cache group
        // (`hold_kv`); a lease must hold all of them (a given-back entry could not travel).
        let whole = self.kv.seq(seq).is_ok_and(|s| s.kv_groups().iter().all(|c| c.num_released() == 0));
        if !whole {
            return;
        }
        if let Ok(lease) = self.kv.fork(seq) {
            self.kv_leases.insert(id.clone(), lease);
        }
    }

    /// The blocks leased by ended request `id` and the number of tokens whose KV they hold
    /// (the leading `num_tokens / block_size` blocks of each KV cache group are full), or `None` if
    /// no lease has that name (never taken, released, or the request has not ended yet).
    /// With several KV cache groups the ids are every KV cache group's table, group-major (KV cache group 0's `n`
    /// blocks, then KV cache group 1's `n`, ...; module docs), none given back.
    pub fn kv_lease(&self, id: &str) -> Option<(Vec<u32>, usize)> {
        let seq = self.kv.seq(*self.kv_leases.get(id)?).ok()?;
        let blocks = seq.kv_groups().iter().flat_map(|c| c.table().blocks()).map(|b| b.0).collect();
        Some((blocks, seq.num_computed()))
    }

    /// Ends lease `id`: its blocks lose the lease's reference (cached ones stay findable).
    /// Returns false if no lease has that name — it was released before, or never taken.
    pub fn release_kv_lease(&mut self, id: &str) -> bool {
        match self.kv_leases.remove(id) {
            Some(seq) => self.kv.free(seq).is_ok(),
            None => false,
        }
    }

    /// Names of the leases held, in no particular order.
    pub fn kv_lease_ids(&self) -> Vec<std::sync::Arc<str>> {
        self.kv_leases.keys().cloned().collect()
    }

    /// Reserves device blocks for the first `max_blocks` full blocks of `prompt` (at most
    /// `(len - 1) / block_size`: the last token is always computed here) under `cache_salt`,
    /// for KV arriving from another engine. Returns `(num_hit_blocks, fresh_block_ids)`: the
    /// leading blocks this pool already caches, shared (in every KV cache group: the longest prefix
    /// every KV cache group's chain reaches), and the fresh blocks for the blocks after them, in
    /// order; with several KV cache groups, every KV cache group's fresh blocks, group-major (module docs)
    /// — or `None` if the pool has no room now. Fails, changing nothing, on an empty or
    /// over-long prompt, a bad salt or a reservation of that name.
    pub fn reserve_kv(
        &mut self,
        id: &str,
        prompt: Vec<u32>,
        max_blocks: usize,
        cache_salt: Option<&str>,
    ) -> Result<Option<(usize, Vec<u32>)>> {
        if prompt.is_empty() {
            return Err(CoreError::InvalidArgument(format!("reservation {id:?}: the prompt is empty")));
        }
        if prompt.len() > self.config.max_model_len {
            return Err(CoreError::PromptTooLong(format!(
                "reservation {id:?}: prompt of {} tokens exceeds max_model_len = {}",
                prompt.len(),
                self.config.max_model_len
            )));
        }
        if self.kv_reservations.contains_key(id) {
            return Err(CoreError::DuplicateRequest(id.to_string()));
        }
        let Some((seq, hits)) = self.kv.reserve_prefix(prompt, ExtraKey::new(cache_salt), max_blocks) else {
            return Ok(None);
        };
        // Every KV cache group's blocks after the hits, group-major.
        let groups = self.kv.seq(seq)?.kv_groups();
        let fresh = groups.iter().flat_map(|c| &c.table().blocks()[hits..]).map(|b| b.0).collect();
        self.kv_reservations.insert(std::sync::Arc::from(id), seq);
        Ok(Some((hits, fresh)))
    }

    /// Ends reservation `id` after its KV arrived: the blocks enter the prefix cache and are
    /// freed, so the request added next finds them. Returns false for an unknown name.
    pub fn commit_kv(&mut self, id: &str) -> bool {
        match self.kv_reservations.remove(id) {
            Some(seq) => self.kv.free(seq).is_ok(),
            None => false,
        }
    }

    /// Ends reservation `id` without its KV (the transfer failed or was abandoned): the fresh
    /// blocks are freed uncached, the shared hits keep their identity. Returns false for an
    /// unknown name.
    pub fn cancel_kv(&mut self, id: &str) -> bool {
        match self.kv_reservations.remove(id) {
            Some(seq) => self.kv.free_discarding_window(seq).is_ok(),
            None => false,
        }
    }
}
