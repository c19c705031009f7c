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

/// A statistic's value: a count or a fraction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StatValue {
    /// A number of blocks, tokens, branches, steps, ...
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
/// stub python/pagedkv/_core.pyi is checked against it by tests/test_stubs.py.
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
