//! Scheduler statistics.

/// Lifetime counters kept by the scheduler.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub steps: u64,
    pub preemptions: u64,
    pub swap_preemptions: u64,
    pub host_prefix_hits: u64,
    pub disk_prefix_hits: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub resumed_queries: u64,
    pub resumed_hits: u64,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub aborted: u64,
    pub beam_forks: u64,
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_blocks_freed: u64,
}

impl Counters {
    /// Counts a sample that ended by a token (a stop or a length limit).
    pub fn count_finish(&mut self, reason: super::FinishReason) {
        match reason {
            super::FinishReason::Stop => self.finished_stop += 1,
            _ => self.finished_length += 1,
        }
    }
}

/// A statistic's value: a count or a fraction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StatValue {
    /// A number of blocks, tokens, samples, steps, ...
    Count(u64),
    /// A ratio in `0.0 ..= 1.0`.
    Fraction(f64),
}

impl From<usize> for StatValue {
    fn from(v: usize) -> Self {
        StatValue::Count(v as u64)
    }
}

impl From<u64> for StatValue {
    fn from(v: u64) -> Self {
        StatValue::Count(v)
    }
}

impl From<f64> for StatValue {
    fn from(v: f64) -> Self {
        StatValue::Fraction(v)
    }
}

/// Defines `SchedulerStats` from one field list: the struct (which the Python bindings expose
/// as `pagedkv.SchedulerStats`, one read-only attribute per field), its field names, and a walk
/// over the fields (`as_dict` in Python). A field is added here and nowhere else in Rust; the
/// stub python/pagedkv/_core.pyi is checked against it by tests/core/test_stubs.py.
macro_rules! scheduler_stats {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[doc = $doc:literal])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        pub struct $name {
            $($(#[doc = $doc])* pub $field: $ty,)*
        }

        impl $name {
            /// The field names, in declaration order.
            pub const FIELD_NAMES: &'static [&'static str] = &[$(stringify!($field)),*];

            /// Calls `f(name, value)` for every field, in declaration order.
            pub fn for_each_field(&self, mut f: impl FnMut(&'static str, StatValue)) {
                $(f(stringify!($field), StatValue::from(self.$field));)*
            }
        }
    };
}

scheduler_stats! {
    /// A snapshot of the scheduler's state and counters.
    #[derive(Debug, Clone, Copy, PartialEq)]
    #[cfg_attr(feature = "python", pyo3::pyclass(module = "pagedkv._core", name = "SchedulerStats", frozen, get_all))]
    pub struct SchedulerStats {
        /// Blocks in the pool.
        pub num_blocks: usize,
        /// Free blocks (cached or not).
        pub num_free_blocks: usize,
        /// Blocks held by running sequences.
        pub num_used_blocks: usize,
        /// Blocks registered in the prefix cache (in use or free).
        pub num_cached_blocks: usize,
        /// Used / total blocks.
        pub kv_usage: f64,
        /// Filled slots / slots of the blocks in use (0 when none are in use, as in vLLM).
        pub kv_utilization: f64,
        /// Filled slots of the blocks in use (a shared block counts once).
        pub tokens_held: usize,
        /// Slots of the blocks in use.
        pub slots_allocated: usize,
        /// Running samples.
        pub num_running: usize,
        /// Waiting samples (queued for admission; blocked requests are not among them).
        pub num_waiting: usize,
        /// Blocked requests whose grammar is compiling (`scheduler::admission`).
        pub num_waiting_for_grammar: usize,
        /// Blocked requests whose prompt's KV is arriving from another engine.
        pub num_waiting_for_remote_kv: usize,
        /// Preemptions so far (recompute and swap).
        pub num_preemptions: u64,
        /// Prompt tokens looked up in the prefix cache at first admissions.
        pub prefix_cache_queries: u64,
        /// Of those, tokens served from the cache.
        pub prefix_cache_hits: u64,
        /// Tokens looked up when preempted samples were re-admitted.
        pub resumed_prefix_queries: u64,
        /// Of those, tokens found (mostly the sample's own freed blocks), counted apart.
        pub resumed_prefix_hits: u64,
        /// Steps scheduled.
        pub num_steps: u64,
        /// Samples ended by eos / stop ids.
        pub num_finished_stop: u64,
        /// Samples ended by max_tokens / max_model_len.
        pub num_finished_length: u64,
        /// Requests aborted.
        pub num_aborted: u64,
        /// Cached blocks evicted by reuse.
        pub num_evictions: u64,
        /// Blocks of the host tier (0: no host tier).
        pub num_host_blocks: usize,
        /// Free host blocks (cached or not).
        pub num_host_free_blocks: usize,
        /// Host blocks held by swapped-out samples (or pinned by the step being planned).
        pub num_host_used_blocks: usize,
        /// Host blocks registered in the prefix cache (in use or free).
        pub num_host_cached_blocks: usize,
        /// Used / total host blocks (0 without a host tier).
        pub host_kv_usage: f64,
        /// Cached host blocks evicted by reuse.
        pub num_host_evictions: u64,
        /// Samples swapped out to the host, waiting to come back.
        pub num_swapped: usize,
        /// Of `num_preemptions`, those that swapped the sample out (the rest recomputed).
        pub num_swap_preemptions: u64,
        /// Of `prefix_cache_hits`, tokens found only on the host tier (loaded back).
        pub prefix_cache_host_hits: u64,
        /// Blocks copied device → host (swap-outs and write-backs).
        pub blocks_swapped_out: u64,
        /// Blocks copied host → device (swap-ins and host prefix hits).
        pub blocks_swapped_in: u64,
        /// `blocks_swapped_out` in bytes (0 when the block size in bytes is unknown).
        pub bytes_swapped_out: u64,
        /// `blocks_swapped_in` in bytes.
        pub bytes_swapped_in: u64,
        /// Cached device blocks written back to the host tier when the device pool reused them.
        pub num_write_backs: u64,
        /// Evicted cached device blocks not written back (no room on the host).
        pub num_write_backs_skipped: u64,
        /// Slots of the disk tier (0: no disk tier).
        pub num_disk_blocks: usize,
        /// Disk slots holding a cached block.
        pub num_disk_cached_blocks: usize,
        /// Of `prefix_cache_hits`, tokens found only on the disk tier (read back).
        pub prefix_cache_disk_hits: u64,
        /// Cached host blocks written to the disk tier when the host pool reused them.
        pub blocks_written_to_disk: u64,
        /// Disk slots read back for prefix hits.
        pub blocks_read_from_disk: u64,
        /// Evicted cached host blocks not written to disk (no room).
        pub num_disk_writes_skipped: u64,
        /// KV leases held for remote readers (ended `hold_kv` requests; their blocks count as used).
        pub num_kv_leases: usize,
        /// Block reservations waiting for KV from another engine (their blocks count as used).
        pub num_kv_reservations: usize,
        /// Distinct device blocks held by running beams (beam search).
        pub beam_blocks_in_use: usize,
        /// Sum of the running beams' block-table lengths: the blocks they would hold with a
        /// private copy each (`1 - beam_blocks_in_use / beam_block_refs` is the saving).
        pub beam_block_refs: usize,
        /// Device blocks held by two or more running beams.
        pub beam_blocks_shared: usize,
        /// Beams forked from a parent beam so far (a parent with several survivors).
        pub num_beam_forks: u64,
        /// Speculative decoding: rows verified with drafts (vLLM's `num_drafts`).
        pub num_spec_drafts: u64,
        /// Draft tokens verified.
        pub num_spec_draft_tokens: u64,
        /// Of those, drafts accepted.
        pub num_spec_accepted_tokens: u64,
        /// Blocks given back at once because rejected drafts alone occupied them.
        pub num_spec_blocks_freed: u64,
    }
}

impl SchedulerStats {
    /// Prefix-cache hits / queries (first admissions only), 0 when nothing was queried.
    pub fn prefix_cache_hit_rate(&self) -> f64 {
        if self.prefix_cache_queries == 0 {
            0.0
        } else {
            self.prefix_cache_hits as f64 / self.prefix_cache_queries as f64
        }
    }
}
