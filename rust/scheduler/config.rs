//! Scheduler configuration, validated on construction.

use crate::attention_span::AttentionSpan;
use crate::block_hash::HashMode;
use crate::block_pool::{MAX_BLOCK_SIZE, MAX_NUM_BLOCKS};
use crate::error::{CoreError, Result};
use crate::speculative::SpeculativeConfig;

/// Order in which waiting requests are admitted and running ones are preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served: arrival order; the latest arrival is preempted first.
    Fcfs,
    /// Lower `priority` value first, then arrival order; the lowest priority (highest value),
    /// latest arrival is preempted first.
    Priority,
}

impl Policy {
    /// Parses "fcfs" or "priority".
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            _ => Err(CoreError::Config(format!("policy must be \"fcfs\" or \"priority\", got {s:?}"))),
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }
}

/// What happens to a running branch's KV when it must make room (preemption).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Free its blocks (full ones stay in the prefix cache) and compute them again later.
    Recompute,
    /// Copy its blocks to the host tier and back later; recompute when the host tier is full.
    Swap,
    /// Per victim, whichever the cost model says is cheaper (see [`SchedulerConfig::swap_is_cheaper`]).
    Auto,
}

impl PreemptionMode {
    /// Parses "recompute", "swap" or "auto".
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "recompute" => Ok(PreemptionMode::Recompute),
            "swap" => Ok(PreemptionMode::Swap),
            "auto" => Ok(PreemptionMode::Auto),
            _ => Err(CoreError::Config(format!(
                "preemption_mode must be \"recompute\", \"swap\" or \"auto\", got {s:?}"
            ))),
        }
    }

    /// The mode's name.
    pub fn name(self) -> &'static str {
        match self {
            PreemptionMode::Recompute => "recompute",
            PreemptionMode::Swap => "swap",
            PreemptionMode::Auto => "auto",
        }
    }
}

/// Everything the scheduler needs to know about its pool and budgets.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token budget of one step, shared by decodes and prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) in tokens.
    pub max_model_len: usize,
    /// Reuse cached prompt blocks across requests.
    pub enable_prefix_caching: bool,
    /// Admission / preemption order.
    pub policy: Policy,
    /// Fraction of the pool kept free when admitting new requests (room to grow running
    /// ones before preempting), in `[0, 1)`.
    pub watermark: f64,
    /// Block hash mode (tests force collisions with [`HashMode::Truncated`]).
    pub hash_mode: HashMode,
    /// Blocks of the host tier (0: none). It holds swapped-out branches and, with prefix
    /// caching, the cached blocks the device pool evicts (written back, loaded on a hit).
    pub num_host_blocks: usize,
    /// Slots of the disk tier below the host tier (0: none; needs a host tier and prefix
    /// caching): cached host blocks evicted by reuse are written there, and read back on a hit.
    pub num_disk_blocks: usize,
    /// Recompute, swap, or auto (needs a host tier unless recompute).
    pub preemption_mode: PreemptionMode,
    /// Bytes of one block (all layers, K and V, scales): the cost model and the byte counts
    /// of the statistics (0: unknown, bytes reported as 0).
    pub bytes_per_block: usize,
    /// Measured copy bandwidth between the tiers, bytes per second (cost model).
    pub swap_bytes_per_second: f64,
    /// Measured forward throughput when recomputing, tokens per second (cost model).
    pub recompute_tokens_per_second: f64,
    /// The retention clock moves only by `Scheduler::advance_clock` (simulations on a
    /// simulated clock), not with wall time.
    pub manual_clock: bool,
    /// Log KV-cache events (blocks stored / removed on each tier, all cleared) for KV-aware
    /// routers, taken once per step with `Scheduler::take_kv_events` (see
    /// [`crate::kv_events`]). Needs prefix caching to produce anything.
    pub enable_kv_events: bool,
    /// KV cache groups: what the layers of each KV-cache column attend to, one block table per
    /// column per sequence over the one pool (kv_cache_manager.rs). One full column unless
    /// the model mixes attention types.
    pub attention_spans: Vec<AttentionSpan>,
    /// Speculative decoding: draft tokens for decoding branches and verify them in the step
    /// (see [`crate::speculative`]); `None`: off.
    pub speculative: Option<SpeculativeConfig>,
}

impl SchedulerConfig {
    /// The most blocks one sequence of `len` tokens holds at once, over every column: a full
    /// column all of its blocks, a sliding or chunked one at most what its window needs
    /// under this step budget.
    pub fn blocks_for_sequence(&self, len: usize) -> usize {
        let whole = crate::block_table::blocks_for(len, self.block_size);
        self.attention_spans
            .iter()
            .map(|s| s.max_live_blocks(self.max_num_batched_tokens, self.block_size).map_or(whole, |b| b.min(whole)))
            .sum()
    }

    /// A config with the given pool and defaults elsewhere (256 sequences, 2048-token budget,
    /// max_model_len = the whole pool capped at 8192, prefix caching on, FCFS, 1% watermark).
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        SchedulerConfig {
            block_size,
            num_blocks,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: (block_size * num_blocks).clamp(1, 8192),
            enable_prefix_caching: true,
            policy: Policy::Fcfs,
            watermark: 0.01,
            hash_mode: HashMode::Xxh3,
            num_host_blocks: 0,
            num_disk_blocks: 0,
            preemption_mode: PreemptionMode::Recompute,
            bytes_per_block: 0,
            // Placeholders until the engine measures them: a PCIe-class link and a small
            // model's prefill rate (the ratio, not the values, decides).
            swap_bytes_per_second: 10e9,
            recompute_tokens_per_second: 10_000.0,
            manual_clock: false,
            enable_kv_events: false,
            attention_spans: vec![AttentionSpan::Full],
            speculative: None,
        }
    }

    /// Checks every field and their relations.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(CoreError::Config(m));
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return err(format!("block_size must be in 1..={MAX_BLOCK_SIZE}, got {}", self.block_size));
        }
        if self.num_blocks == 0 || self.num_blocks > MAX_NUM_BLOCKS {
            return err(format!("num_blocks must be in 1..={MAX_NUM_BLOCKS}, got {}", self.num_blocks));
        }
        if self.max_num_seqs == 0 {
            return err("max_num_seqs must be >= 1".into());
        }
        if self.max_num_batched_tokens == 0 {
            return err("max_num_batched_tokens must be >= 1".into());
        }
        if self.max_model_len == 0 {
            return err("max_model_len must be >= 1".into());
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return err(format!("watermark must be in [0, 1), got {}", self.watermark));
        }
        if self.num_host_blocks > MAX_NUM_BLOCKS {
            return err(format!("num_host_blocks must be in 0..={MAX_NUM_BLOCKS}, got {}", self.num_host_blocks));
        }
        if self.num_disk_blocks > MAX_NUM_BLOCKS {
            return err(format!("num_disk_blocks must be in 0..={MAX_NUM_BLOCKS}, got {}", self.num_disk_blocks));
        }
        if self.num_disk_blocks > 0 && (self.num_host_blocks == 0 || !self.enable_prefix_caching) {
            return err("a disk tier (num_disk_blocks > 0) needs a host tier (num_host_blocks > 0) and prefix caching".into());
        }
        if self.preemption_mode != PreemptionMode::Recompute && self.num_host_blocks == 0 {
            return err(format!(
                "preemption_mode = {:?} needs a host tier: set num_host_blocks",
                self.preemption_mode.name()
            ));
        }
        for (name, v) in [
            ("swap_bytes_per_second", self.swap_bytes_per_second),
            ("recompute_tokens_per_second", self.recompute_tokens_per_second),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return err(format!("{name} must be a positive finite number, got {v}"));
            }
        }
        if let Some(spec) = &self.speculative {
            spec.validate()?;
        }
        let capacity = self.block_size * self.num_blocks;
        if capacity < self.max_model_len {
            // Otherwise a request of max_model_len tokens could never run, even alone.
            return err(format!(
                "the KV pool holds {capacity} tokens ({} blocks x {}), fewer than max_model_len = {}: \
                 add blocks or lower max_model_len",
                self.num_blocks, self.block_size, self.max_model_len
            ));
        }
        Ok(())
    }

    /// The `auto` preemption rule: swapping a victim costs copying `blocks` blocks out and
    /// back (`2 * blocks * bytes_per_block / swap_bytes_per_second` seconds); recomputing it
    /// costs computing `tokens` tokens again (`tokens / recompute_tokens_per_second`). Swap
    /// when it is strictly cheaper. With `bytes_per_block` unknown (0) swapping counts as free.
    pub fn swap_is_cheaper(&self, blocks: usize, tokens: usize) -> bool {
        let swap = 2.0 * blocks as f64 * self.bytes_per_block as f64 / self.swap_bytes_per_second;
        let recompute = tokens as f64 / self.recompute_tokens_per_second;
        swap < recompute
    }

    /// Blocks kept free at admission.
    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * self.num_blocks as f64).floor() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_do_not() {
        SchedulerConfig::new(16, 64).validate().unwrap();
        let mut c = SchedulerConfig::new(16, 64);
        c.max_model_len = 16 * 64 + 1;
        assert!(c.validate().is_err());
        let mut c = SchedulerConfig::new(16, 64);
        c.watermark = 1.0;
        assert!(c.validate().is_err());
        let mut c = SchedulerConfig::new(16, 64);
        c.max_num_seqs = 0;
        assert!(c.validate().is_err());
        assert!(SchedulerConfig::new(0, 64).validate().is_err());
        assert!(Policy::parse("lifo").is_err());
        assert_eq!(Policy::parse("priority").unwrap(), Policy::Priority);
    }
}
