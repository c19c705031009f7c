//! Scheduler statistics.

/// Lifetime counters kept by the scheduler.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub steps: u64,
    pub preemptions: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub resumed_queries: u64,
    pub resumed_hits: u64,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub aborted: u64,
}

/// A snapshot of the scheduler's state and counters.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// Filled slots / slots of the blocks in use (1.0 when none are in use).
    pub kv_utilization: f64,
    /// Filled slots of the blocks in use (a shared block counts once).
    pub tokens_held: usize,
    /// Slots of the blocks in use.
    pub slots_allocated: usize,
    /// Running branches.
    pub num_running: usize,
    /// Waiting branches.
    pub num_waiting: usize,
    /// Recompute preemptions so far.
    pub num_preemptions: u64,
    /// Prompt tokens looked up in the prefix cache at first admissions.
    pub prefix_cache_queries: u64,
    /// Of those, tokens served from the cache.
    pub prefix_cache_hits: u64,
    /// Tokens looked up when preempted branches were re-admitted.
    pub resumed_prefix_queries: u64,
    /// Of those, tokens found (mostly the branch's own freed blocks), counted apart.
    pub resumed_prefix_hits: u64,
    /// Steps scheduled.
    pub num_steps: u64,
    /// Branches ended by eos / stop ids.
    pub num_finished_stop: u64,
    /// Branches ended by max_tokens / max_model_len.
    pub num_finished_length: u64,
    /// Requests aborted.
    pub num_aborted: u64,
    /// Cached blocks evicted by reuse.
    pub num_evictions: u64,
}
