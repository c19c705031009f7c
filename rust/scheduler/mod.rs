//! Continuous-batching scheduler in the spirit of vLLM v1's unified scheduler.
//!
//! Each `schedule()` builds one step under one token budget (`max_num_batched_tokens`) and a
//! sequence cap (`max_num_seqs`):
//! 1. Running samples first, in policy order: each gets its pending tokens (1 for a decode,
//!    the next chunk of its prompt otherwise) up to the remaining budget. When the pool has no
//!    block for one, the lowest-priority / latest-arrived running sample that is not yet in
//!    this step is preempted, and the allocation is retried; a sample may have to preempt
//!    itself. Preemption ([`PreemptionMode`]) either recomputes (its blocks are freed — full
//!    ones stay in the prefix cache — its tokens are kept) or swaps (its blocks are copied to
//!    the host tier, `swap_out` ops); either way it goes back to the front of the waiting
//!    queue. A swap that does not fit in the host tier becomes a recompute.
//! 2. If nothing was preempted, waiting samples are admitted in policy order (head-of-line:
//!    admission stops at the first that does not fit): a swapped sample is copied back
//!    (`swap_in` ops) and continues where it stopped; any other starts after its longest
//!    verified cached prefix — device blocks shared, host blocks loaded into fresh device
//!    blocks — with a first chunk cut to the remaining budget.
//! 3. The step output is built as flat arrays (input ids, positions, slots, block tables,
//!    logits rows, swap and copy-on-write ops).
//!
//! A request enters at `add_request` ([`admission`]); one that waits for something outside
//! the scheduler (its grammar, its prompt's KV from another engine) is blocked — in neither
//! queue — until [`Scheduler::unblock`] lifts every [`Wait`]; `abort_request` ends a request
//! in any state.
//!
//! `update(step, sampled)` appends one sampled token per logits row, forks `n > 1` requests
//! into their samples at the end of their prompt, and applies the token-based stops (eos,
//! stop ids, min_tokens, max_tokens, max_model_len). A finished sample frees its blocks.
//!
//! With `enable_kv_events` the KV-cache manager logs its pools' cache changes and
//! [`Scheduler::take_kv_events`] hands them out, one batch per step, in vLLM's wire format
//! ([`crate::kv_events`]); [`Scheduler::block_hashes`] gives a prompt's wire hashes.

mod admission;
mod beam;
mod beam_search;
mod config;
mod finish;
mod kv_transfer;
mod output;
mod request;
mod snapshot;
mod stats;
#[cfg(test)]
mod admission_tests;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

pub use admission::{Wait, WaitSet};
pub use beam::{BeamCandidates, BeamResult};
pub use beam_search::{BeamHypothesis, BeamParams};
pub use config::{field, FieldDefault, FieldRange, FieldSpec, Policy, PreemptionMode, SchedulerConfig, SpeculativeArgs, DEFAULT_BLOCK_SIZE, FIELDS};
pub(crate) use output::BlockTableRows;
pub use output::{RequestUpdate, StepOutput};
pub use finish::FinishReason;
pub use request::{SampleKey, NewRequest, RequestKey};
pub use snapshot::RequestSummary;
pub use stats::{SchedulerStats, StatValue};

use crate::block_hash::{BlockHash, ExtraKey};
use crate::error::{CoreError, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv_cache_manager::{AddSequence, KvCacheManager, PrefixMatch, Restore, Tier};
use crate::slab::Slab;
use crate::speculative::{suffix, SampleSpec, SpecCostModel, SpecMethod, TenantSpecs, SAMPLE_DECAY, GLOBAL_DECAY, PRIOR_WEIGHT};
use output::StepPlan;
use request::{Sample, Request};
use stats::Counters;

/// A disk-tier entry as a file stores it: the block's chained hash, its parent's (`None`
/// for a first block), its token ids and its cache salt.
pub type DiskEntry = (BlockHash, Option<BlockHash>, Vec<u32>, Option<String>, u32);

/// What [`Scheduler::requeue`] does with a re-queued sample's sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// Freed; its tokens stay on the sample, to be recomputed (preemption).
    TakeTokens,
    /// Freed after dropping the step's unwritten window (a step that will not run).
    DiscardWindow,
    /// Kept: it was swapped out to the host tier and comes back from there.
    Keep,
}

/// The scheduler (see the module docs).
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: Slab<Request>,
    by_id: HashMap<Arc<str>, RequestKey>,
    samples: Slab<Sample>,
    /// Waiting samples in admission order.
    waiting: VecDeque<SampleKey>,
    /// Running samples sorted by their order key (preemption takes from the back).
    running: Vec<SampleKey>,
    next_arrival: u64,
    next_step: u64,
    in_flight: Option<StepPlan>,
    finished: Vec<(Arc<str>, FinishReason)>,
    /// Requests that ended since the last `schedule` (by key), so that `request_id` still
    /// names them: updates carry keys, not ids.
    ended: Vec<(RequestKey, Arc<str>)>,
    counters: Counters,
    /// The retention clock: microseconds since `clock_origin`, plus `clock_offset_us` (moved
    /// forward by [`Scheduler::advance_clock`] in tests and simulations).
    clock_origin: std::time::Instant,
    clock_offset_us: u64,
    /// KV leases of ended `hold_kv` requests, by request id (see `kv_transfer`).
    kv_leases: HashMap<Arc<str>, SeqId>,
    /// Blocks reserved for KV arriving from another engine, by reservation name.
    kv_reservations: HashMap<Arc<str>, SeqId>,
    /// Results of beam searches that ended, until [`Scheduler::take_beam_results`].
    beam_results: Vec<BeamResult>,
    /// Speculative decoding: the step-time model that decides how many drafts pay.
    spec_cost: SpecCostModel,
    /// Accepted drafts by position (index j: the (j+1)-th draft of a row), lifetime.
    spec_accepted_per_position: Vec<u64>,
    /// What speculation learned from finished requests and verified rows, per tenant (cache
    /// salt): suffix decoding's recent outputs and the acceptance prior of new samples. Never
    /// shared across salts, so one tenant's outputs never become another's drafts.
    spec_tenants: TenantSpecs,
    /// Scratch for a proposal.
    draft_buf: Vec<u32>,
}

impl Scheduler {
    /// A scheduler over a fresh pool.
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let mut kv = KvCacheManager::new(config.num_blocks, config.block_size, config.enable_prefix_caching, config.hash_mode)?
            .with_kv_groups(config.attention_spans.clone())?
            .with_host_tier(config.num_host_blocks)?
            .with_disk_tier(config.num_disk_blocks)?;
        kv.set_record_events(config.enable_kv_events);
        Ok(Scheduler {
            config,
            kv,
            requests: Slab::default(),
            by_id: HashMap::new(),
            samples: Slab::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival: 0,
            next_step: 0,
            in_flight: None,
            finished: Vec::new(),
            ended: Vec::new(),
            counters: Counters::default(),
            clock_origin: std::time::Instant::now(),
            clock_offset_us: 0,
            kv_leases: HashMap::new(),
            kv_reservations: HashMap::new(),
            beam_results: Vec::new(),
            spec_cost: SpecCostModel::default(),
            spec_accepted_per_position: Vec::new(),
            spec_tenants: TenantSpecs::default(),
            draft_buf: Vec::new(),
        })
    }

    /// The retention clock, in microseconds (monotonic): wall time since the scheduler was
    /// built plus [`Self::advance_clock`]'s moves, or only the latter with `manual_clock`.
    pub fn now_us(&self) -> u64 {
        if self.config.manual_clock {
            return self.clock_offset_us;
        }
        let elapsed = self.clock_origin.elapsed().as_micros().min(u64::MAX as u128) as u64;
        elapsed.saturating_add(self.clock_offset_us)
    }

    /// Moves the retention clock forward by `us` microseconds (tests and simulations: a
    /// retention duration can expire without waiting for it).
    pub fn advance_clock(&mut self, us: u64) {
        self.clock_offset_us = self.clock_offset_us.saturating_add(us);
    }

    /// Speculative decoding's step-time model (see [`SpecCostModel`]): `overhead_s` seconds
    /// per step plus `per_token_s` per token, as the engine measures them.
    pub fn set_spec_cost(&mut self, overhead_s: f64, per_token_s: f64) -> Result<()> {
        for (name, v) in [("overhead_s", overhead_s), ("per_token_s", per_token_s)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(CoreError::InvalidArgument(format!("{name} must be a finite number >= 0, got {v}")));
            }
        }
        self.spec_cost = SpecCostModel { overhead_s: overhead_s.max(1e-9), per_token_s };
        Ok(())
    }

    /// Speculative decoding: how many drafts a new sample of the most accepting tenant among
    /// the running requests would verify in a step with the samples running now (the cost
    /// model's choice; all of `num_speculative_tokens` when not adaptive, 0 when speculation
    /// is off). A caller that makes drafts (a draft model) makes no more than this; each
    /// sample then keeps as many as its own tenant's acceptance pays for, so no tenant's
    /// drafts depend on another's.
    pub fn spec_drafts_worth(&self) -> usize {
        match self.config.speculative {
            None => 0,
            Some(spec) if !spec.adaptive => spec.num_speculative_tokens,
            Some(spec) => {
                let threshold = self.spec_cost.threshold(self.running.len());
                let best = self
                    .running
                    .iter()
                    .filter_map(|&b| self.samples.get(b).and_then(|x| self.requests.get(x.req)))
                    .map(|r| self.spec_tenants.get(r.extra.salt()).acceptance.rate())
                    .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))))
                    .unwrap_or_else(|| self.spec_tenants.get(None).acceptance.rate());
                SpecCostModel::drafts_worth(threshold, best, spec.num_speculative_tokens)
            }
        }
    }

    /// Speculative decoding: drafts accepted so far by position within a row's drafts
    /// (entry `j`: how many `(j+1)`-th drafts were accepted).
    pub fn spec_accepted_per_position(&self) -> &[u64] {
        &self.spec_accepted_per_position
    }

    /// Sets the `auto` preemption cost model from measurements (see
    /// [`SchedulerConfig::swap_is_cheaper`]): copy bandwidth between the tiers in bytes per
    /// second, forward throughput in tokens per second, and bytes per block. Fails, changing
    /// nothing, unless the rates are positive and finite.
    pub fn set_cost_model(&mut self, swap_bytes_per_second: f64, recompute_tokens_per_second: f64, bytes_per_block: usize) -> Result<()> {
        let mut c = self.config.clone();
        c.swap_bytes_per_second = swap_bytes_per_second;
        c.recompute_tokens_per_second = recompute_tokens_per_second;
        c.bytes_per_block = bytes_per_block;
        c.validate()?;
        self.config = c;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV-cache manager (read-only).
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Samples waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Samples running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// True while any request is waiting, running, or has an end not yet reported in a step.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Live requests.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// The id of a live request, or of one that ended since the last `schedule` (e.g. in the
    /// `update` whose [`RequestUpdate`]s name it by key).
    pub fn request_id(&self, key: RequestKey) -> Option<&Arc<str>> {
        match self.requests.get(key) {
            Some(r) => Some(&r.id),
            None => self.ended.iter().find(|(k, _)| *k == key).map(|(_, id)| id),
        }
    }

    /// Ends one sample of a request with reason "stop", e.g. when a stop string
    /// matched in the detokenized text: its blocks are freed at once, and the request ends
    /// (reported in the next step's finished ids) when its last sample does. Returns false if
    /// that sample had already ended.
    pub fn finish_sample(&mut self, id: &str, index: u32) -> Result<bool> {
        let key = *self.by_id.get(id).ok_or_else(|| CoreError::UnknownRequest(id.to_string()))?;
        let Some(req) = self.requests.get_mut(key) else { return Ok(false) };
        if req.beam.is_some() {
            return Err(CoreError::InvalidArgument(format!(
                "request {id:?} is a beam search: its beams end by the search's own rules (abort it to stop it)"
            )));
        }
        // Before the n-way fork only sample 0 exists; ending it ends the request.
        req.forked = true;
        let found = req.samples.iter().copied().find(|&b| self.samples.get(b).is_some_and(|x| x.index == index));
        let Some(b) = found else { return Ok(false) };
        self.running.retain(|&k| k != b);
        self.waiting.retain(|&k| k != b);
        self.counters.finished_stop += 1;
        self.end_sample(b, FinishReason::Stop);
        Ok(true)
    }

    /// Hands in the drafts for sample `index` of request `id` (speculative decoding with drafts
    /// from the caller, e.g. a draft model): used by the next step that schedules the sample,
    /// if its token count is still `num_tokens` (the tokens the drafts follow), cut to what the
    /// step allows. Returns false (nothing kept) for a request or sample that is gone or is not
    /// running, a request that does not speculate, or a scheduler whose method takes no drafts.
    /// Fails on more drafts than a step verifies.
    pub fn set_drafts(&mut self, id: &str, index: u32, num_tokens: usize, drafts: &[u32]) -> Result<bool> {
        if !matches!(self.config.speculative.map(|s| s.method), Some(SpecMethod::Provided)) {
            return Ok(false);
        }
        if drafts.len() > crate::speculative::MAX_SPECULATIVE_TOKENS {
            return Err(CoreError::InvalidArgument(format!(
                "{} drafts for request {id:?}: at most {} are verified per step",
                drafts.len(),
                crate::speculative::MAX_SPECULATIVE_TOKENS
            )));
        }
        let Some(&key) = self.by_id.get(id) else { return Ok(false) };
        let Some(req) = self.requests.get(key) else { return Ok(false) };
        if !req.speculate {
            return Ok(false);
        }
        let found = req.samples.iter().copied().find(|&b| self.samples.get(b).is_some_and(|x| x.index == index && x.seq.is_some()));
        let Some(sample) = found.and_then(|b| self.samples.get_mut(b)) else { return Ok(false) };
        sample.spec.provided.clear();
        sample.spec.provided.extend_from_slice(drafts);
        sample.spec.provided_at = num_tokens;
        Ok(true)
    }

    /// Frees a sample's sequence and removes it (not from the queues).
    fn drop_sample(&mut self, b: SampleKey) {
        if let Some(sample) = self.samples.remove(b) {
            if let Some(seq) = sample.seq {
                // A sample with rows in the step in flight (aborted mid-step) may never get its
                // window written, if that step fails: its window is not offered to the prefix
                // cache. The sequence is live by construction; nothing to report otherwise.
                let in_flight = self.in_flight.as_ref().is_some_and(|p| p.scheduled.contains(&b));
                let _ = if in_flight { self.kv.free_discarding_window(seq).map(drop) } else { self.kv.free(seq) };
            }
        }
    }

    fn order_of(&self, b: SampleKey) -> (i64, u64, u32) {
        self.samples.get(b).map(|x| x.order).unwrap_or((i64::MAX, u64::MAX, u32::MAX))
    }

    /// Puts a sample in the waiting queue: new ones at their place in policy order (the back,
    /// under FCFS), preempted ones at the front (under priority: the front of their priority).
    fn enqueue_waiting(&mut self, b: SampleKey, preempted: bool) {
        let key = self.order_of(b);
        match (self.config.policy, preempted) {
            (Policy::Fcfs, false) => self.waiting.push_back(b),
            (Policy::Fcfs, true) => self.waiting.push_front(b),
            (Policy::Priority, _) => {
                let pos = if preempted {
                    self.waiting.partition_point(|&w| self.order_of(w).0 < key.0)
                } else {
                    self.waiting.partition_point(|&w| self.order_of(w) <= key)
                };
                self.waiting.insert(pos, b);
            }
        }
    }

    /// Sends sample `b` back to the front of the waiting queue (its priority's front) as a
    /// resumed sample: the one re-queueing path of preemption, a beam group's preemption in the
    /// step being built and `rollback_step`. `release` says what happens to its sequence:
    /// freed with its tokens kept on the sample (recomputed later), freed with the step's
    /// unwritten window dropped first (a step that never ran), or kept (swapped out, it comes
    /// back from the host tier). The caller takes it out of `running` and counts it.
    fn requeue(&mut self, b: SampleKey, release: Release) -> Result<()> {
        let Some(sample) = self.samples.get_mut(b) else { return Ok(()) }; // aborted since
        if release != Release::Keep {
            let Some(seq) = sample.seq.take() else { return Ok(()) };
            sample.tokens = match release {
                Release::DiscardWindow => self.kv.free_discarding_window(seq)?,
                _ => self.kv.free_take_tokens(seq)?,
            };
        }
        sample.resumed = true;
        self.enqueue_waiting(b, true);
        Ok(())
    }

    fn insert_running(&mut self, b: SampleKey) {
        let key = self.order_of(b);
        let pos = self.running.partition_point(|&r| self.order_of(r) <= key);
        self.running.insert(pos, b);
    }

    /// Preempts a running sample (not in this step): swapped to the host tier when the mode
    /// and the cost model say so and the host has room, else recomputed later.
    /// `swap`: the choice already made for the sample's whole beam group, if it has one.
    fn preempt(&mut self, b: SampleKey, out: &mut StepOutput, plan: &mut StepPlan, swap: Option<bool>) {
        let Some(seq) = self.samples.get(b).and_then(|x| x.seq) else { return };
        let swap = swap.unwrap_or_else(|| match self.config.preemption_mode {
            PreemptionMode::Recompute => false,
            PreemptionMode::Swap => true,
            PreemptionMode::Auto => match self.kv.swap_out_cost(seq) {
                Ok(Some((blocks, tokens))) => self.config.swap_is_cheaper(blocks, tokens),
                _ => false,
            },
        });
        let swapped = swap && self.kv.swap_out(seq).unwrap_or(false);
        if swapped {
            plan.swapped_out.push(b);
            self.counters.swap_preemptions += 1;
        }
        let Some(req) = self.samples.get(b).map(|x| x.req) else { return };
        if self.requeue(b, if swapped { Release::Keep } else { Release::TakeTokens }).is_err() {
            return; // cannot happen: the sample's sequence is live
        }
        self.counters.preemptions += 1;
        if let Some(req) = self.requests.get(req) {
            if out.preempted_req_ids.last() != Some(&req.id) {
                out.preempted_req_ids.push(req.id.clone());
            }
        }
    }

    /// Builds the next step. Fails only if the previous step's `update` is still owed.
    pub fn schedule(&mut self) -> Result<StepOutput> {
        let mut out = StepOutput::default();
        self.schedule_into(&mut out)?;
        Ok(out)
    }

    /// Builds the next step into `out` (the output of an earlier step, or a default one),
    /// reusing its buffers: a block-table row that already holds a prefix of its sequence's
    /// table is only extended, so a decode step writes one entry per row that got a new block.
    /// The result is the same as [`Self::schedule`]'s. Fails only if the previous step's
    /// `update` is still owed (`out` is left empty then).
    pub fn schedule_into(&mut self, out: &mut StepOutput) -> Result<()> {
        if let Err(e) = self.schedule_rows(out) {
            out.block_tables.clear();
            out.table_rows.clear();
            return Err(e);
        }
        let rows = out.num_rows();
        let width = out.block_table_width;
        out.block_tables.resize(out.num_kv_groups * rows * width, 0);
        let StepOutput { row_seqs, table_rows, block_tables, .. } = out;
        table_rows.write(&self.kv, row_seqs, width, block_tables)
    }

    /// Writes the block tables of `out`, the step just scheduled, into `dst`
    /// (`out.num_kv_groups * out.num_rows() * out.block_table_width` entries), which holds what `rows`
    /// says (see [`BlockTableRows`]).
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub(crate) fn write_block_tables(&self, out: &StepOutput, dst: &mut [i32], rows: &mut BlockTableRows) -> Result<()> {
        rows.write(&self.kv, &out.row_seqs, out.block_table_width, dst)
    }

    /// [`Self::schedule_into`] without the block tables: everything but their content is in
    /// `out` (their width and each row's sequence included), for [`Self::write_block_tables`].
    pub(crate) fn schedule_rows(&mut self, out: &mut StepOutput) -> Result<()> {
        let step_id = self.open_step(out)?;
        let mut plan = StepPlan { step_id, ..StepPlan::default() };
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<(SampleKey, SeqId)> = Vec::with_capacity(self.running.len() + 1);

        // 1. Running samples.
        let threshold = match self.config.speculative {
            Some(spec) if spec.adaptive => self.spec_cost.threshold(self.running.len()),
            _ => -1.0, // every draft the proposer finds
        };
        let mut i = 0;
        let mut preempted_any = false;
        while i < self.running.len() && budget > 0 {
            let b = self.running[i];
            if let Some(req) = self.beam_request_of(b) {
                // A beam request's running beams are adjacent: scheduled together or not at all.
                let mut j = i + 1;
                while j < self.running.len() && self.samples.get(self.running[j]).is_some_and(|x| x.req == req) {
                    j += 1;
                }
                match self.schedule_beam_group(i, j, &mut budget, &mut scheduled, out, &mut plan)? {
                    Ok(preempted) => {
                        preempted_any |= preempted;
                        i = j;
                        continue;
                    }
                    Err(()) => {
                        preempted_any = true;
                        break;
                    }
                }
            }
            let Some(seq) = self.samples.get(b).and_then(|x| x.seq) else {
                i += 1;
                continue;
            };
            let pending = self.kv.seq(seq).map(|s| s.num_pending()).unwrap_or(0);
            if pending == 0 {
                i += 1;
                continue;
            }
            if pending == 1 && budget > 1 && self.config.speculative.is_some() {
                // A decoding sample drafts what the budget, its limits and the cost model allow,
                // and only into free blocks: speculation never preempts anyone.
                let d = self.propose_drafts(b, seq, budget - 1, threshold)?;
                if d > 0 {
                    if self.kv.allocate_slots(seq, 1 + d)? {
                        budget -= 1 + d;
                        scheduled.push((b, seq));
                        i += 1;
                        continue;
                    }
                    self.kv.discard_drafts(seq)?;
                }
            }
            let n = pending.min(budget);
            let mut preempted_self = false;
            while !self.kv.allocate_slots(seq, n)? {
                preempted_any = true;
                // The back of `running` is the lowest priority / latest arrival, and is not
                // scheduled yet (scheduled ones are in front of index i).
                let Some(&victim) = self.running.last() else {
                    // Cannot happen: b itself is running.
                    preempted_self = true;
                    break;
                };
                self.preempt_back(out, &mut plan);
                if victim == b {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            budget -= n;
            scheduled.push((b, seq));
            i += 1;
        }

        // 2. Waiting samples (not in a step that had to preempt).
        if !preempted_any {
            self.admit_waiting(&mut budget, &mut scheduled);
        }

        // 3. Arrays.
        self.kv.end_step();
        self.build_rows(&scheduled, out, &mut plan)?;
        plan.scheduled = scheduled.iter().map(|&(b, _)| b).collect();
        plan.beam_rows.clone_from(&out.beam_rows);
        self.take_copies(out);
        out.finished = std::mem::take(&mut self.finished);
        plan.reported.clone_from(&out.finished);
        self.counters.steps += 1;
        self.in_flight = Some(plan);
        Ok(())
    }

    /// Builds a step with no rows that copies cached blocks one tier down (see
    /// [`KvCacheManager::plan_flush`]); run it and close it with `update(step, [])` like any
    /// step. Call it until it plans no copy (`swap_out` and `disk_store` empty) to leave the
    /// disk tier holding every cached block there is room for, before shutting down.
    pub fn schedule_flush_into(&mut self, out: &mut StepOutput) -> Result<()> {
        let step_id = self.open_step(out)?;
        self.kv.plan_flush();
        self.kv.end_step();
        self.take_copies(out);
        out.finished = std::mem::take(&mut self.finished);
        let plan = StepPlan { step_id, reported: out.finished.clone(), ..StepPlan::default() };
        self.in_flight = Some(plan);
        out.block_tables.clear();
        Ok(())
    }

    /// Starts building a step into `out` (emptied): refuses while a step is in flight, takes
    /// the next step id, forgets the ends reported by the last step, and starts the KV
    /// manager's step (clock, copy targets).
    fn open_step(&mut self, out: &mut StepOutput) -> Result<u64> {
        out.clear(self.next_step);
        out.num_kv_groups = self.kv.num_kv_groups();
        if let Some(plan) = &self.in_flight {
            return Err(CoreError::StaleOutput(format!(
                "step {} was scheduled but update() was not called for it",
                plan.step_id
            )));
        }
        let step_id = self.next_step;
        self.next_step += 1;
        self.ended.clear();
        out.cu_seqlens_q.push(0);
        self.kv.set_now(self.now_us());
        self.kv.begin_step();
        Ok(step_id)
    }

    /// [`Self::schedule_flush_into`] into a new output.
    pub fn schedule_flush(&mut self) -> Result<StepOutput> {
        let mut out = StepOutput::default();
        self.schedule_flush_into(&mut out)?;
        Ok(out)
    }

    /// Moves the planned copies (swap, disk and copy-on-write) into the step output.
    fn take_copies(&mut self, out: &mut StepOutput) {
        for (src, dst) in self.kv.take_copy_ops() {
            out.copy_ops.push(src.0 as i32);
            out.copy_ops.push(dst.0 as i32);
        }
        let (disk_store, disk_load) = self.kv.take_disk_ops();
        out.disk_store.extend(disk_store.iter().flat_map(|&(h, s)| [h.0 as i32, s.0 as i32]));
        out.disk_load.extend(disk_load.iter().flat_map(|&(s, h)| [s.0 as i32, h.0 as i32]));
        let (swap_out, swap_in) = self.kv.take_swap_ops();
        out.swap_out.extend(swap_out.iter().flat_map(|&(d, h)| [d.0 as i32, h.0 as i32]));
        out.swap_in.extend(swap_in.iter().flat_map(|&(h, d)| [h.0 as i32, d.0 as i32]));
    }

    fn admit_waiting(&mut self, budget: &mut usize, scheduled: &mut Vec<(SampleKey, SeqId)>) {
        let bs = self.config.block_size;
        while *budget > 0 {
            let Some(&b) = self.waiting.front() else { break };
            let Some(sample) = self.samples.get(b) else {
                self.waiting.pop_front();
                continue;
            };
            let Some(req) = self.requests.get(sample.req) else {
                self.waiting.pop_front();
                continue;
            };
            // An unforked request will become n samples, a beam request W beams: reserve room
            // for all of them.
            let seats = match &req.beam {
                Some(s) => s.params.width,
                None if req.forked => 1,
                None => req.n,
            };
            if self.running.len() + seats > self.config.max_num_seqs {
                break;
            }
            // The watermark keeps room for running samples to grow; a lone request may use
            // the whole pool (else a request near max_model_len could never start).
            let reserve = if self.running.is_empty() { 0 } else { self.config.watermark_blocks() };
            if req.beam.is_some() && req.samples.len() > 1 {
                // A preempted beam group comes back whole.
                let req_key = sample.req;
                if !self.admit_beam_group(req_key, budget, reserve, scheduled) {
                    break;
                }
                continue;
            }
            if let Some(seq) = sample.seq {
                // Swapped out: copy it back and continue where it stopped.
                if !self.resume_swapped(b, seq, budget, reserve, scheduled) {
                    break;
                }
                continue;
            }
            let extra = req.extra.clone();
            let retention = req.retention;
            // A request whose KV another engine reads keeps every KV cache group's blocks.
            let keep_all = req.hold_kv;
            let m = if !self.config.enable_prefix_caching {
                PrefixMatch::default()
            } else if req.skip_prefix_cache {
                self.kv.no_prefix_match()
            } else {
                self.kv.match_prefix(&sample.tokens, &extra)
            };
            let hit = m.num_tokens(bs);
            let n = (sample.tokens.len() - hit).min(*budget);
            let cost = self.kv.admission_cost_keeping(&m, n, keep_all);
            if cost + reserve > self.kv.pool().num_free() {
                break;
            }
            self.waiting.pop_front();
            let Some(sample) = self.samples.get_mut(b) else { continue };
            let tokens = std::mem::take(&mut sample.tokens);
            let num_tokens = tokens.len();
            let before = self.kv.prefix_counters();
            let (seq, hit) = self.kv.add_sequence(AddSequence { tokens, extra, prefix: Some(m), retention, keep_all });
            let after = self.kv.prefix_counters();
            match self.kv.allocate_slots(seq, n) {
                Ok(true) => {}
                _ => {
                    // Cannot happen (cost was checked); undo and stop admitting.
                    if let Ok(tokens) = self.kv.free_take_tokens(seq) {
                        sample.tokens = tokens;
                    }
                    self.waiting.push_front(b);
                    break;
                }
            }
            sample.seq = Some(seq);
            let resumed = std::mem::replace(&mut sample.resumed, false);
            let req_key = sample.req;
            if resumed {
                self.counters.resumed_queries += num_tokens as u64;
                self.counters.resumed_hits += hit as u64;
            } else {
                self.counters.prefix_queries += num_tokens as u64;
                self.counters.prefix_hits += hit as u64;
                self.counters.host_prefix_hits += after.host_hits - before.host_hits;
                self.counters.disk_prefix_hits += after.disk_hits - before.disk_hits;
            }
            if let Some(req) = self.requests.get_mut(req_key) {
                if !req.admitted_once {
                    req.admitted_once = true;
                    req.num_cached_tokens = hit;
                }
            }
            *budget -= n;
            self.insert_running(b);
            scheduled.push((b, seq));
        }
    }

    /// Admits the swapped-out waiting sample `b` (at the front of the queue) by copying its
    /// blocks back and giving its pending tokens slots within the budget. False (nothing
    /// changed) when the device pool lacks room.
    fn resume_swapped(
        &mut self,
        b: SampleKey,
        seq: SeqId,
        budget: &mut usize,
        reserve: usize,
        scheduled: &mut Vec<(SampleKey, SeqId)>,
    ) -> bool {
        let (Ok(s), Ok(cost)) = (self.kv.seq(seq), self.kv.swap_in_cost(seq)) else { return false };
        let n = s.num_pending().min(*budget);
        if n == 0 {
            // A swapped sample always has a token to compute (its last sampled one) and the
            // budget is not spent here; resuming one without a row would leave its swap-in out
            // of the step's rollback.
            return false;
        }
        // After the swap-in the partial last block is private (a fresh copy), so no
        // copy-on-write: only the blocks for new slots.
        let grow = self.kv.growth_blocks(s, n);
        if cost + grow + reserve > self.kv.pool().num_free() {
            return false;
        }
        if !matches!(self.kv.swap_in(seq), Ok(true)) {
            return false;
        }
        if !matches!(self.kv.allocate_slots(seq, n), Ok(true)) {
            // Cannot happen (the cost was checked); the sample stays admitted without a row and
            // gets its slots in a later step.
            self.waiting.pop_front();
            self.insert_running(b);
            return false;
        }
        self.waiting.pop_front();
        if let Some(sample) = self.samples.get_mut(b) {
            sample.resumed = false;
        }
        *budget -= n;
        self.insert_running(b);
        scheduled.push((b, seq));
        true
    }

    fn build_rows(&self, scheduled: &[(SampleKey, SeqId)], out: &mut StepOutput, plan: &mut StepPlan) -> Result<()> {
        let bs = self.config.block_size;
        let vanished = || CoreError::InvariantViolation("a scheduled sample vanished".into());
        let mut rows = Vec::with_capacity(scheduled.len());
        let (mut width, mut total) = (0, 0);
        for &(b, seq_id) in scheduled {
            let seq = self.kv.seq(seq_id)?;
            let sample = self.samples.get(b).ok_or_else(vanished)?;
            let req = self.requests.get(sample.req).ok_or_else(vanished)?;
            width = width.max(seq.table().len());
            total += seq.num_computed() - seq.write_start();
            rows.push((b, seq_id, seq, sample, req));
        }
        out.block_table_width = width;
        let n = rows.len();
        out.row_seqs.reserve(n);
        out.row_requests.reserve(n);
        out.num_scheduled_tokens.reserve(n);
        out.cu_seqlens_q.reserve(n);
        out.seq_lens.reserve(n);
        out.logits_indices.reserve(n);
        out.sampled_requests.reserve(n);
        out.sample_indices.reserve(n);
        plan.sampled.reserve(n);
        out.input_ids.reserve(total);
        out.positions.reserve(total);
        out.slot_mapping.reserve(total * out.num_kv_groups);
        for (b, seq_id, seq, sample, req) in rows.iter().copied() {
            let (start, end) = (seq.write_start(), seq.num_computed());
            out.row_seqs.push(seq_id);
            out.row_requests.push(sample.req);
            out.num_scheduled_tokens.push((end - start) as i32);
            out.input_ids.extend(seq.tokens()[start..end].iter().map(|&t| t as i64));
            out.positions.extend((start as i64)..(end as i64));
            seq.table().extend_slots(start, end, bs, &mut out.slot_mapping);
            out.cu_seqlens_q.push(out.input_ids.len() as i32);
            out.seq_lens.push(end as i32);
            let drafts = seq.num_drafts();
            if drafts > 0 && end == seq.num_tokens() {
                // A decoding row with drafts: the logits after its pending token and after each
                // draft (row j samples the token that would follow draft j; `update` verifies).
                for j in 0..=drafts {
                    out.logits_indices.push((out.input_ids.len() - drafts + j) as i64 - 1);
                    out.sampled_requests.push(sample.req);
                    out.sample_indices.push(sample.index as i32);
                    out.draft_offsets.push(j as i32);
                    plan.sampled.push((b, sample.index));
                }
            } else if end == seq.num_tokens() {
                // Every known token is computed: this row's last logits give the next token,
                // one row per sample the request will have after this step.
                let rows = if req.forked { 1 } else { req.n as u32 };
                if req.beam.is_some() {
                    out.beam_rows.push(out.logits_indices.len() as i64);
                }
                for k in 0..rows {
                    let index = if req.forked { sample.index } else { k };
                    out.logits_indices.push(out.input_ids.len() as i64 - 1);
                    out.sampled_requests.push(sample.req);
                    out.sample_indices.push(index as i32);
                    out.draft_offsets.push(0);
                    plan.sampled.push((b, index));
                }
            }
        }
        // Group-major slots: KV cache group 0's for the whole batch came with the rows above, then
        // every other KV cache group's (same positions, that KV cache group's blocks).
        for c in 1..out.num_kv_groups {
            for &(_, _, seq, _, _) in &rows {
                seq.kv_groups()[c].table().extend_slots(seq.write_start(), seq.num_computed(), bs, &mut out.slot_mapping);
            }
        }
        Ok(())
    }

    /// The plan of the step in flight if it is step `step_id`; `what` names the caller.
    fn plan_in_flight(&self, step_id: u64, what: &str) -> Result<&StepPlan> {
        match &self.in_flight {
            Some(p) if p.step_id == step_id => Ok(p),
            Some(p) => Err(CoreError::StaleOutput(format!(
                "{what} got the output of step {step_id}, but step {} is in flight",
                p.step_id
            ))),
            None => Err(CoreError::StaleOutput(format!(
                "{what} got the output of step {step_id}, but no step is in flight (already updated?)"
            ))),
        }
    }

    /// Undoes the step in flight when its forward pass (or its sampling) failed, so none of
    /// its KV writes can be trusted. Every sample with rows in the step is preempted as if the
    /// step had not been scheduled: only the tokens computed before it count as computed, and
    /// every block the step registered in the prefix cache loses its cached identity, so no
    /// request can ever hit KV that was not written. The samples keep their tokens and go to
    /// the front of the waiting queue (recomputed from their cached prefix when re-admitted);
    /// request ends that the step reported are reported again by the next step. Returns the
    /// ids of the requests that had rows in the step, each once, in row order. Fails, changing
    /// nothing, if `step_id` is not the step in flight.
    pub fn rollback_step(&mut self, step_id: u64) -> Result<Vec<Arc<str>>> {
        self.plan_in_flight(step_id, "rollback_step()")?;
        let plan = self.in_flight.take().unwrap_or_default();
        // The step's swap copies may not have run: samples swapped out by it are recomputed
        // instead (their host blocks are not trusted), and every block a copy targeted loses
        // its cached identity.
        for &b in &plan.swapped_out {
            let Some(sample) = self.samples.get_mut(b) else { continue }; // aborted since
            let Some(seq) = sample.seq.take() else { continue };
            sample.tokens = self.kv.free_take_tokens(seq)?;
        }
        self.kv.rollback_copies();
        let mut ids: Vec<Arc<str>> = Vec::new();
        // A beam request goes back whole: its running beams without rows in the step too.
        let mut undo: Vec<SampleKey> = Vec::with_capacity(plan.scheduled.len());
        for &b in &plan.scheduled {
            match self.beam_request_of(b) {
                Some(req) => {
                    for &r in &self.running {
                        if self.samples.get(r).is_some_and(|x| x.req == req) && !undo.contains(&r) {
                            undo.push(r);
                        }
                    }
                }
                None => undo.push(b),
            }
        }
        // Reverse row order: each sample goes to the front, so the first row ends up first.
        for &b in undo.iter().rev() {
            let Some(sample) = self.samples.get(b) else { continue }; // aborted since
            if sample.seq.is_none() {
                continue;
            }
            if let Some(req) = self.requests.get(sample.req) {
                if !ids.contains(&req.id) {
                    ids.push(req.id.clone());
                }
            }
            self.running.retain(|&k| k != b);
            self.requeue(b, Release::DiscardWindow)?;
        }
        ids.reverse();
        let mut reported = plan.reported;
        reported.append(&mut self.finished);
        self.finished = reported;
        Ok(ids)
    }

    /// Applies the sampled tokens of the step in flight (one per logits row of `step`).
    /// Fails, changing nothing, if `step` is not the step in flight or the tokens do not fit.
    /// A step with beam requests needs [`Self::update_with_beams`].
    pub fn update(&mut self, step_id: u64, sampled: &[u32]) -> Result<Vec<RequestUpdate>> {
        self.update_with_beams(step_id, sampled, BeamCandidates::NONE)
    }

    /// [`Self::update`] for a step that may sample beam requests: `beams` holds the candidates
    /// of its beam rows (`StepOutput::beam_rows`), and every beam request's decisions are
    /// applied here, in this one call (see [`beam`]). The entries of `sampled` at beam rows
    /// are ignored. Fails, changing nothing, on malformed candidates.
    pub fn update_with_beams(&mut self, step_id: u64, sampled: &[u32], beams: BeamCandidates<'_>) -> Result<Vec<RequestUpdate>> {
        let plan = self.plan_in_flight(step_id, "update()")?;
        if sampled.len() != plan.sampled.len() {
            return Err(CoreError::InvalidArgument(format!(
                "sampled_token_ids has {} entries, but step {step_id} has {} logits rows",
                sampled.len(),
                plan.sampled.len()
            )));
        }
        beams.validate(plan.beam_rows.len())?;
        self.check_beam_rows(plan)?;
        let plan = self.in_flight.take().unwrap_or_default();
        let mut updates = Vec::with_capacity(sampled.len());
        let mut ended: Vec<(SampleKey, FinishReason)> = Vec::new();
        let mut i = 0;
        while i < plan.sampled.len() {
            let (b, index) = plan.sampled[i];
            let Some(sample) = self.samples.get(b) else {
                i += 1; // aborted after scheduling: its tokens are dropped
                continue;
            };
            let req_key = sample.req;
            if self.requests.get(req_key).is_some_and(|r| r.beam.is_some()) {
                // Rows i .. e are this beam request's live beams (checked above).
                let mut e = i + 1;
                while e < plan.sampled.len() && self.samples.get(plan.sampled[e].0).is_some_and(|x| x.req == req_key) {
                    e += 1;
                }
                let group: Vec<SampleKey> = plan.sampled[i..e].iter().map(|&(b, _)| b).collect();
                let ordinals: Vec<usize> = (i..e).map(|row| plan.beam_rows.partition_point(|&r| (r as usize) < row)).collect();
                self.apply_beam_step(req_key, &group, &ordinals, beams, &mut updates)?;
                i = e;
                continue;
            }
            let forking = index == 0 && self.requests.get(req_key).is_some_and(|r| !r.forked);
            if forking {
                // Rows i .. i+n are this request's n samples: fork before appending.
                let n = self.requests.get(req_key).map(|r| r.n).unwrap_or(1);
                let mut targets = vec![b];
                for k in 1..n {
                    targets.push(self.fork_sample(b, k as u32)?);
                }
                if let Some(r) = self.requests.get_mut(req_key) {
                    r.forked = true;
                }
                for (k, &t) in targets.iter().enumerate() {
                    self.append_sampled(t, sampled[i + k], i + k, &mut updates, &mut ended)?;
                }
                i += n;
            } else {
                let drafts = sample.seq.and_then(|s| self.kv.seq(s).ok()).map_or(0, |s| s.num_drafts());
                if drafts > 0 {
                    // Rows i ..= i + drafts are this sample's (build_rows).
                    self.verify_drafts(b, &sampled[i..=i + drafts], i, &mut updates, &mut ended)?;
                    i += drafts + 1;
                } else {
                    self.append_sampled(b, sampled[i], i, &mut updates, &mut ended)?;
                    i += 1;
                }
            }
        }
        if !ended.is_empty() {
            self.running.retain(|k| !ended.iter().any(|(e, _)| e == k));
            for (b, reason) in ended {
                self.end_sample(b, reason);
            }
        }
        Ok(updates)
    }

    /// A new running sample sharing all of `parent`'s blocks.
    fn fork_sample(&mut self, parent: SampleKey, index: u32) -> Result<SampleKey> {
        let p = self.samples.get(parent).ok_or_else(|| CoreError::InvariantViolation("fork of a missing sample".into()))?;
        let seq = p.seq.ok_or_else(|| CoreError::InvariantViolation("fork of a waiting sample".into()))?;
        let (req, order) = (p.req, (p.order.0, p.order.1, index));
        let child_seq = self.kv.fork(seq)?;
        let child = self.samples.insert(Sample {
            req,
            index,
            tokens: Vec::new(),
            seq: Some(child_seq),
            num_output: 0,
            resumed: false,
            order,
            cum_logprob: 0.0,
            spec: SampleSpec::default(),
        });
        if let Some(r) = self.requests.get_mut(req) {
            r.samples.push(child);
        }
        self.insert_running(child);
        Ok(child)
    }

    /// Appends the token sampled at logits row `row` to sample `b` and applies the stops.
    fn append_sampled(
        &mut self,
        b: SampleKey,
        token: u32,
        row: usize,
        updates: &mut Vec<RequestUpdate>,
        ended: &mut Vec<(SampleKey, FinishReason)>,
    ) -> Result<()> {
        let max_model_len = self.config.max_model_len;
        let Some((sample, req, seq)) = running_sample(&mut self.samples, &self.requests, b) else { return Ok(()) };
        let num_tokens = self.kv.append_token(seq, token)?;
        sample.num_output += 1;
        let finish = stop_reason(req, sample.num_output, token, num_tokens, max_model_len);
        updates.push(RequestUpdate::sampled(sample.req, sample.index, token, finish, req.num_cached_tokens, row));
        if let Some(reason) = finish {
            ended.push((b, reason));
            self.counters.count_finish(reason);
        }
        Ok(())
    }

    /// Verifies the drafts of sample `b` against `sampled`, the tokens sampled at its logits
    /// rows `first_row ..` (one after its pending token, one after each draft; see
    /// [`crate::speculative`]): drafts are accepted while each equals the token sampled before
    /// it; the sampled tokens up to the first mismatch (or all of them, the last being the
    /// bonus) are emitted in order, each through the stops, and the sample ends at the first
    /// that stops it. The rejected drafts' slots go back, with the blocks they emptied.
    fn verify_drafts(
        &mut self,
        b: SampleKey,
        sampled: &[u32],
        first_row: usize,
        updates: &mut Vec<RequestUpdate>,
        ended: &mut Vec<(SampleKey, FinishReason)>,
    ) -> Result<()> {
        let max_model_len = self.config.max_model_len;
        let Some((sample, req, seq)) = running_sample(&mut self.samples, &self.requests, b) else { return Ok(()) };
        let s = self.kv.seq(seq)?;
        let (base, drafted) = (s.num_verified(), s.num_drafts());
        let accepted = s.tokens()[base..].iter().zip(sampled).take_while(|(d, t)| d == t).count();
        let (mut emitted, mut finish) = (0, None);
        for (j, &token) in sampled[..=accepted].iter().enumerate() {
            emitted = j + 1;
            finish = stop_reason(req, sample.num_output + emitted, token, base + emitted, max_model_len);
            if finish.is_some() {
                break;
            }
        }
        // The emitted tokens before the last are accepted drafts, already in the sequence.
        let freed = self.kv.accept_drafts(seq, emitted - 1)?;
        self.kv.append_token(seq, sampled[emitted - 1])?;
        sample.num_output += emitted;
        sample.spec.acceptance.record(drafted, accepted, SAMPLE_DECAY);
        self.spec_tenants.record_acceptance(req.extra.salt(), drafted, accepted, GLOBAL_DECAY);
        let c = &mut self.counters;
        c.spec_drafts += 1;
        c.spec_draft_tokens += drafted as u64;
        c.spec_accepted_tokens += accepted as u64;
        c.spec_blocks_freed += freed as u64;
        if self.spec_accepted_per_position.len() < drafted {
            self.spec_accepted_per_position.resize(drafted, 0);
        }
        for n in &mut self.spec_accepted_per_position[..accepted] {
            *n += 1;
        }
        for (j, &token) in sampled[..emitted].iter().enumerate() {
            let last = j + 1 == emitted;
            let reason = if last { finish } else { None };
            updates.push(RequestUpdate::sampled(sample.req, sample.index, token, reason, req.num_cached_tokens, first_row + j));
        }
        if let Some(reason) = finish {
            ended.push((b, reason));
            self.counters.count_finish(reason);
        }
        Ok(())
    }

    /// Chooses and appends the drafts of decoding sample `b` (sequence `seq`, one pending
    /// token) for this step: up to `budget` tokens, the request's limits (its remaining
    /// `max_tokens` and `max_model_len` leave room for the drafts and the token after them) and
    /// what the cost model finds worth verifying at this step's `threshold`. Returns how many
    /// were appended (0 for a request that does not speculate or a proposal that found none).
    fn propose_drafts(&mut self, b: SampleKey, seq: SeqId, budget: usize, threshold: f64) -> Result<usize> {
        let Some(spec) = self.config.speculative else { return Ok(0) };
        let Some(sample) = self.samples.get_mut(b) else { return Ok(0) };
        let Some(req) = self.requests.get(sample.req) else { return Ok(0) };
        if !req.speculate || !req.forked {
            return Ok(0);
        }
        let s = self.kv.seq(seq)?;
        let len = s.num_tokens();
        let room = req
            .max_tokens
            .saturating_sub(sample.num_output + 1)
            .min(self.config.max_model_len.saturating_sub(len + 1))
            .min(budget)
            .min(spec.num_speculative_tokens);
        let tenant = self.spec_tenants.get(req.extra.salt());
        let acceptance = sample.spec.acceptance.rate_with(tenant.acceptance.rate(), PRIOR_WEIGHT);
        let k = SpecCostModel::drafts_worth(threshold, acceptance, room);
        if k == 0 {
            return Ok(0);
        }
        match spec.method {
            SpecMethod::Ngram { min, max } => sample.spec.index.propose(s.tokens(), min, max, k, &mut self.draft_buf),
            SpecMethod::Suffix(p) => suffix::propose(&mut sample.spec.index, s.tokens(), &tenant.recent_outputs, &p, k, &mut self.draft_buf),
            SpecMethod::Provided => {
                self.draft_buf.clear();
                if sample.spec.provided_at == len {
                    let n = sample.spec.provided.len().min(k);
                    self.draft_buf.extend_from_slice(&sample.spec.provided[..n]);
                }
                sample.spec.provided.clear();
            }
        }
        let d = self.draft_buf.len();
        if d > 0 {
            self.kv.append_drafts(seq, &self.draft_buf)?;
        }
        Ok(d)
    }

    /// Removes a finished (already unqueued) sample; the request ends with its last sample,
    /// and is reported with that sample's reason.
    fn end_sample(&mut self, b: SampleKey, reason: FinishReason) {
        let req_key = self.samples.get(b).map(|x| x.req);
        let seq = self.samples.get(b).and_then(|x| x.seq);
        if let (Some(SpecMethod::Suffix(p)), Some(seq), Some(sample)) =
            (self.config.speculative.map(|s| s.method), seq, self.samples.get(b))
        {
            // Suffix decoding matches later requests of the same tenant against this output too.
            let salt = self.requests.get(sample.req).and_then(|r| r.extra.salt());
            if let Ok(s) = self.kv.seq(seq) {
                let tokens = &s.tokens()[..s.num_verified()];
                let output = &tokens[tokens.len().saturating_sub(sample.num_output)..];
                self.spec_tenants.add_output(salt, output, p.max_cached_requests);
            }
        }
        if let (Some(req), Some(seq)) = (req_key.and_then(|k| self.requests.get(k)), seq) {
            if req.hold_kv {
                let id = req.id.clone();
                self.take_kv_lease(&id, seq);
            }
        }
        self.drop_sample(b);
        let Some(req_key) = req_key else { return };
        let done = match self.requests.get_mut(req_key) {
            Some(r) => {
                r.samples.retain(|&k| k != b);
                r.samples.is_empty() && r.forked
            }
            None => false,
        };
        if done {
            if let Some(req) = self.requests.remove(req_key) {
                self.by_id.remove(&req.id);
                self.ended.push((req_key, req.id.clone()));
                // Requests ending in update are reported too, so a runner can drop their state.
                self.finished.push((req.id, reason));
            }
        }
    }

    /// Current statistics.
    pub fn stats(&self) -> SchedulerStats {
        let bs = self.config.block_size;
        let pool = self.kv.pool();
        // Filled slots of the blocks in use: a shared block counts once. All holders of a
        // shared block see it equally filled (it is never written while shared: copy-on-write),
        // so each block's fill is taken from whichever holder comes first.
        let mut seen = vec![false; pool.num_blocks()];
        let mut tokens_held = 0usize;
        for &b in &self.running {
            if let Some(seq) = self.samples.get(b).and_then(|x| x.seq).and_then(|s| self.kv.seq(s).ok()) {
                let n = seq.num_computed();
                for group in seq.kv_groups() {
                    for (j, blk) in group.table().blocks().iter().enumerate().skip(group.num_released()) {
                        if !std::mem::replace(&mut seen[blk.index()], true) {
                            tokens_held += (n - j * bs).min(bs);
                        }
                    }
                }
            }
        }
        let slots = pool.num_used() * bs;
        let (beam_blocks_in_use, beam_block_refs, beam_blocks_shared) = self.beam_block_counts();
        let c = &self.counters;
        let host = self.kv.host_pool();
        let disk = self.kv.disk_pool();
        let t = self.kv.tier_counters();
        let bpb = self.config.bytes_per_block as u64;
        SchedulerStats {
            num_blocks: pool.num_blocks(),
            num_free_blocks: pool.num_free(),
            num_used_blocks: pool.num_used(),
            num_cached_blocks: pool.num_cached_blocks(),
            kv_usage: pool.usage(),
            kv_utilization: if slots == 0 { 0.0 } else { tokens_held as f64 / slots as f64 },
            tokens_held,
            slots_allocated: slots,
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_waiting_for_grammar: self.num_waiting_for(Wait::Grammar),
            num_waiting_for_remote_kv: self.num_waiting_for(Wait::RemoteKv),
            num_preemptions: c.preemptions,
            prefix_cache_queries: c.prefix_queries,
            prefix_cache_hits: c.prefix_hits,
            resumed_prefix_queries: c.resumed_queries,
            resumed_prefix_hits: c.resumed_hits,
            num_steps: c.steps,
            num_finished_stop: c.finished_stop,
            num_finished_length: c.finished_length,
            num_aborted: c.aborted,
            num_evictions: pool.counters().evictions,
            num_host_blocks: host.map_or(0, |h| h.num_blocks()),
            num_host_free_blocks: host.map_or(0, |h| h.num_free()),
            num_host_used_blocks: host.map_or(0, |h| h.num_used()),
            num_host_cached_blocks: host.map_or(0, |h| h.num_cached_blocks()),
            host_kv_usage: host.map_or(0.0, |h| h.usage()),
            num_host_evictions: host.map_or(0, |h| h.counters().evictions),
            num_swapped: self.waiting.iter().filter(|&&b| self.samples.get(b).is_some_and(|x| x.seq.is_some())).count(),
            num_swap_preemptions: c.swap_preemptions,
            prefix_cache_host_hits: c.host_prefix_hits,
            blocks_swapped_out: t.blocks_to_host,
            blocks_swapped_in: t.blocks_to_device,
            bytes_swapped_out: t.blocks_to_host * bpb,
            bytes_swapped_in: t.blocks_to_device * bpb,
            num_write_backs: t.write_backs,
            num_write_backs_skipped: t.write_backs_skipped,
            num_disk_blocks: disk.map_or(0, |d| d.num_blocks()),
            num_disk_cached_blocks: disk.map_or(0, |d| d.num_cached_blocks()),
            prefix_cache_disk_hits: c.disk_prefix_hits,
            blocks_written_to_disk: t.blocks_to_disk,
            blocks_read_from_disk: t.blocks_from_disk,
            num_disk_writes_skipped: t.disk_writes_skipped,
            num_kv_leases: self.kv_leases.len(),
            num_kv_reservations: self.kv_reservations.len(),
            beam_blocks_in_use,
            beam_block_refs,
            beam_blocks_shared,
            num_beam_forks: c.beam_forks,
            num_spec_drafts: c.spec_drafts,
            num_spec_draft_tokens: c.spec_draft_tokens,
            num_spec_accepted_tokens: c.spec_accepted_tokens,
            num_spec_blocks_freed: c.spec_blocks_freed,
        }
    }

    /// The pool block by block, for drawing memory maps: each block's ref count, whether it
    /// is registered in the prefix cache, and its owner — the arrival number (0, 1, ... in
    /// `add_request` order) of the earliest-arrived running request holding it, or -1.
    pub fn memory_map(&self) -> (Vec<i32>, Vec<bool>, Vec<i64>) {
        let pool = self.kv.pool();
        let n = pool.num_blocks();
        let mut owner = vec![-1i64; n];
        for &b in &self.running {
            let Some(sample) = self.samples.get(b) else { continue };
            let Some(seq) = sample.seq.and_then(|s| self.kv.seq(s).ok()) else { continue };
            let arrival = sample.order.1 as i64;
            for blk in seq.held_blocks() {
                let o = &mut owner[blk.index()];
                if *o < 0 || arrival < *o {
                    *o = arrival;
                }
            }
        }
        let refs = (0..n).map(|i| pool.ref_count_unchecked(BlockId(i as u32)) as i32).collect();
        let cached = (0..n).map(|i| pool.is_cached(BlockId(i as u32))).collect();
        (refs, cached, owner)
    }

    /// The device pool block by block: the KV cache group each block serves (the KV cache group of
    /// the table holding it, or the one it is cached for), -1 for a free uncached block (see
    /// [`KvCacheManager::block_kv_groups`]). With one KV cache group, 0 or -1.
    pub fn block_kv_groups(&self) -> Vec<i16> {
        self.kv.block_kv_groups()
    }

    /// What disk slot `slot` holds, for its file: `(hash, parent hash, token ids, cache salt,
    /// KV cache group)` (`None`: no disk tier, a bad slot, or nothing cached there).
    pub fn disk_block_info(&self, slot: u32) -> Option<DiskEntry> {
        let (id, tokens) = self.kv.disk_block(BlockId(slot))?;
        Some((id.hash, id.parent_hash, tokens.to_vec(), id.extra.salt().map(str::to_string), id.extra.group()))
    }

    /// Restores disk entries written by an earlier process (see
    /// [`KvCacheManager::restore_disk_block`]), in any order: passes over the entries are
    /// repeated while some entry's parent got restored in the last pass. Returns the slot each
    /// entry now occupies, or `None` where it was not restored (rejected, or its parent
    /// never was).
    pub fn restore_disk_blocks(&mut self, entries: &[DiskEntry]) -> Vec<Option<u32>> {
        let mut slots = vec![None; entries.len()];
        let mut pending: Vec<usize> = (0..entries.len()).collect();
        loop {
            let before = pending.len();
            pending.retain(|&i| {
                let (hash, parent, tokens, salt, group) = &entries[i];
                // A KV cache group this pool does not have cannot be served (its hash would check out).
                if *group as usize >= self.kv.num_kv_groups() {
                    return false;
                }
                let extra = ExtraKey::new(salt.as_deref()).for_group(*group);
                match self.kv.restore_disk_block(*hash, *parent, tokens, &extra) {
                    Restore::Done(slot) => {
                        slots[i] = Some(slot.0);
                        false
                    }
                    Restore::MissingParent => true,
                    Restore::Rejected => false,
                }
            });
            if pending.is_empty() || pending.len() == before {
                return slots;
            }
        }
    }

    /// Forgets disk slots whose files could not be written or read (see
    /// [`KvCacheManager::invalidate_disk_blocks`]).
    pub fn invalidate_disk_blocks(&mut self, slots: &[u32]) {
        let ids: Vec<BlockId> = slots.iter().map(|&s| BlockId(s)).collect();
        self.kv.invalidate_disk_blocks(&ids);
    }

    /// Takes the KV-cache events since the last call as one batch in vLLM's wire format, with
    /// timestamp `ts` (seconds): the device pool's events, then the host's, then the disk's
    /// (see [`crate::kv_events`]). `None` when events are off (`enable_kv_events`) or nothing
    /// happened. Call it once per step (after `update` or `rollback_step`): events are kept
    /// until taken.
    pub fn take_kv_events(&mut self, ts: f64) -> Option<Vec<u8>> {
        self.kv.take_kv_events(ts)
    }

    /// Drops every free cached block from the prefix cache on every tier (device, host,
    /// disk); blocks in use (running or swapped samples) stay cached. Returns how many were
    /// dropped. With KV events on, a reset that leaves nothing cached is announced as one
    /// `AllBlocksCleared`; otherwise each dropped block as removed.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.kv.reset_prefix_cache()
    }

    /// The wire hashes of the full blocks of `tokens` under the cache salt `salt` (what a
    /// KV-aware router computes for a prompt): the 64-bit index keys of their chained block
    /// hashes, equal to the hashes KV events give the same blocks ([`crate::kv_events`]). A
    /// partial last block has none.
    pub fn block_hashes(&self, tokens: &[u32], salt: Option<&str>) -> Vec<u64> {
        crate::kv_events::wire_block_hashes(tokens, self.config.block_size, salt, self.config.hash_mode)
    }

    /// The tiers block by block: for each device block whether its cached content is also
    /// resident on the host; the host pool's ref counts and cache flags (empty without a host
    /// tier).
    pub fn tier_map(&self) -> (Vec<bool>, Vec<i32>, Vec<bool>) {
        let pool = self.kv.pool();
        let Some(host) = self.kv.host_pool() else {
            return (vec![false; pool.num_blocks()], Vec::new(), Vec::new());
        };
        let on_host = (0..pool.num_blocks())
            .map(|i| pool.find_copy_in(BlockId(i as u32), host).is_some())
            .collect();
        let n = host.num_blocks();
        let refs = (0..n).map(|i| host.ref_count_unchecked(BlockId(i as u32)) as i32).collect();
        let cached = (0..n).map(|i| host.is_cached(BlockId(i as u32))).collect();
        (on_host, refs, cached)
    }

    /// Checks the KV manager's invariants and the scheduler's own bookkeeping: every running
    /// sample has a sequence and every waiting one has its tokens; a blocked request's one
    /// sample is in no queue and holds no sequence; queues and request lists agree; ids map
    /// both ways.
    pub fn check_invariants(&self) -> Result<()> {
        self.kv.check_invariants()?;
        let bad = |m: String| Err(CoreError::InvariantViolation(m));
        let mut seen = 0usize;
        for &b in &self.running {
            match self.samples.get(b) {
                Some(x) if x.seq.is_some() && x.tokens.is_empty() => seen += 1,
                _ => return bad(format!("running sample {b:?} is missing or has no sequence")),
            }
        }
        for w in self.running.windows(2) {
            if self.order_of(w[0]) > self.order_of(w[1]) {
                return bad("running samples are out of policy order".into());
            }
        }
        let mut swapped = 0usize;
        for &b in &self.waiting {
            match self.samples.get(b) {
                Some(x) if x.seq.is_none() && !x.tokens.is_empty() => seen += 1,
                // Swapped out: its host sequence holds its tokens.
                Some(x) if x.tokens.is_empty() && x.seq.and_then(|s| self.kv.seq(s).ok()).is_some_and(|s| s.tier() == Tier::Host) => {
                    seen += 1;
                    swapped += 1;
                }
                _ => return bad(format!("waiting sample {b:?} is missing, has a device sequence, or has no tokens")),
            }
        }
        // Blocked requests (admission.rs): one sample each, never run, holding its tokens only.
        for (_, req) in self.requests.iter().filter(|(_, r)| !r.waiting_for.is_empty()) {
            let ok = req.samples.len() == 1
                && !req.admitted_once
                && self.samples.get(req.samples[0]).is_some_and(|x| x.seq.is_none() && !x.tokens.is_empty() && x.num_output == 0);
            if !ok || self.waiting.contains(&req.samples[0]) || self.running.contains(&req.samples[0]) {
                return bad(format!("blocked request {:?} has a queued, running or started sample", req.id));
            }
            seen += 1;
        }
        for &b in &self.running {
            if self.samples.get(b).and_then(|x| x.seq).and_then(|s| self.kv.seq(s).ok()).is_some_and(|s| s.tier() != Tier::Device) {
                return bad(format!("running sample {b:?} is not on the device"));
            }
        }
        if seen != self.samples.len() {
            return bad(format!("{} samples exist but {seen} are queued", self.samples.len()));
        }
        let held = self.kv_leases.len() + self.kv_reservations.len();
        if self.kv.num_sequences() != self.running.len() + swapped + held {
            return bad(format!(
                "{} sequences for {} running and {swapped} swapped samples and {held} KV leases / reservations",
                self.kv.num_sequences(),
                self.running.len()
            ));
        }
        for &seq in self.kv_leases.values().chain(self.kv_reservations.values()) {
            if self.kv.seq(seq).map_or(true, |s| s.tier() != Tier::Device) {
                return bad(format!("KV lease or reservation {seq} is not a device sequence"));
            }
        }
        let mut sample_count = 0;
        for (key, req) in self.requests.iter() {
            if self.by_id.get(&req.id) != Some(&key) {
                return bad(format!("request {:?} is not indexed by its id", req.id));
            }
            for &b in &req.samples {
                if self.samples.get(b).map(|x| x.req) != Some(key) {
                    return bad(format!("request {:?} lists a sample that is not its own", req.id));
                }
            }
            sample_count += req.samples.len();
        }
        for (_, req) in self.requests.iter() {
            let Some(search) = &req.beam else { continue };
            let running = req.samples.iter().filter(|b| self.running.contains(b)).count();
            if running != 0 && running != req.samples.len() {
                return bad(format!("beam request {:?} has {running} of its {} beams running", req.id, req.samples.len()));
            }
            if req.samples.len() > search.params.width {
                return bad(format!("beam request {:?} has {} live beams for a width of {}", req.id, req.samples.len(), search.params.width));
            }
        }
        if sample_count != self.samples.len() || self.by_id.len() != self.requests.len() {
            return bad("request and sample tables disagree".into());
        }
        Ok(())
    }
}

/// Why a sample of `req` ends with `token`, its `num_output`-th output token, which makes its
/// sequence `num_tokens` long (eos and stop ids from `min_tokens` on, then the length limits).
fn stop_reason(req: &Request, num_output: usize, token: u32, num_tokens: usize, max_model_len: usize) -> Option<FinishReason> {
    let past_min = num_output >= req.min_tokens;
    if past_min && (req.eos_token_ids.contains(&token) || req.stop_token_ids.contains(&token)) {
        Some(FinishReason::Stop)
    } else if num_output >= req.max_tokens || num_tokens >= max_model_len {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Sample `b`, its request and its sequence, if all three are live (a sample aborted after its
/// step was scheduled is gone: its tokens are dropped).
fn running_sample<'a>(samples: &'a mut Slab<Sample>, requests: &'a Slab<Request>, b: SampleKey) -> Option<(&'a mut Sample, &'a Request, SeqId)> {
    let sample = samples.get_mut(b)?;
    let req = requests.get(sample.req)?;
    let seq = sample.seq?;
    Some((sample, req, seq))
}
