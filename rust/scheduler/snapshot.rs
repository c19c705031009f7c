//! What a live view of the KV cache needs from the scheduler besides the device and host block
//! maps ([`Scheduler::memory_map`], [`Scheduler::tier_map`]): one summary per live request, and
//! the disk tier's slots.

use std::collections::HashSet;
use std::sync::Arc;

use super::{Scheduler, Wait};
use crate::ids::BlockId;
use crate::kv_cache_manager::Tier;

/// One live request as a dashboard shows it (no token ids, no text).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSummary {
    /// The caller's request id.
    pub id: Arc<str>,
    /// Arrival number (0, 1, ... in `add_request` order): what `memory_map`'s owners name.
    pub arrival: u64,
    /// "running" (a sample runs), "swapped" (a sample waits on the host tier), "waiting"
    /// (queued), or, for a blocked request, "waiting_for_grammar" / "waiting_for_remote_kv"
    /// (the grammar first when it waits for both).
    pub state: &'static str,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated so far (the longest sample).
    pub output_tokens: usize,
    /// Distinct device blocks its samples hold (shared between its samples counted once).
    pub num_blocks: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Live samples (`n` parallel samples, or a beam search's live beams).
    pub num_samples: usize,
}

impl Scheduler {
    /// A summary of every live request, in arrival order.
    pub fn request_summaries(&self) -> Vec<RequestSummary> {
        let running: HashSet<_> = self.running.iter().copied().collect();
        let mut out: Vec<RequestSummary> = self
            .requests
            .iter()
            .map(|(_, req)| {
                let mut state = match req.waiting_for.iter().next() {
                    Some(Wait::Grammar) => "waiting_for_grammar",
                    Some(Wait::RemoteKv) => "waiting_for_remote_kv",
                    None => "waiting",
                };
                let mut arrival = u64::MAX;
                let (mut tokens, mut output) = (0usize, 0usize);
                let mut blocks = HashSet::new();
                for &b in &req.samples {
                    let Some(sample) = self.samples.get(b) else { continue };
                    arrival = arrival.min(sample.order.1);
                    output = output.max(sample.num_output);
                    let seq = sample.seq.and_then(|s| self.kv.seq(s).ok());
                    tokens = tokens.max(seq.map_or(sample.tokens.len(), |s| s.num_tokens()));
                    if running.contains(&b) {
                        state = "running";
                    } else if state != "running" && seq.is_some_and(|s| s.tier() == Tier::Host) {
                        state = "swapped";
                    }
                    if let Some(s) = seq.filter(|s| s.tier() == Tier::Device) {
                        blocks.extend(s.held_blocks());
                    }
                }
                RequestSummary {
                    id: req.id.clone(),
                    arrival,
                    state,
                    prompt_tokens: tokens.saturating_sub(output),
                    output_tokens: output,
                    num_blocks: blocks.len(),
                    cached_tokens: req.num_cached_tokens,
                    num_samples: req.samples.len(),
                }
            })
            .collect();
        out.sort_by_key(|r| r.arrival);
        out
    }

    /// The disk tier slot by slot: `(ref_counts, cached)` (a slot is pinned only while a step
    /// copies it); empty without a disk tier.
    pub fn disk_map(&self) -> (Vec<i32>, Vec<bool>) {
        let Some(disk) = self.kv.disk_pool() else { return (Vec::new(), Vec::new()) };
        let n = disk.num_blocks();
        let refs = (0..n).map(|i| disk.ref_count_unchecked(BlockId(i as u32)) as i32).collect();
        let cached = (0..n).map(|i| disk.is_cached(BlockId(i as u32))).collect();
        (refs, cached)
    }
}
