//! The step output: flat arrays ready for the device, built once per step.

use std::sync::Arc;

use super::finish::FinishReason;
use super::request::{SampleKey, RequestKey};
use crate::ids::SeqId;
use crate::kv_cache_manager::KvCacheManager;

/// One scheduled step (docs/core.md, "Step output"). Rows are samples in batch
/// order: running ones first (decodes and continuing prefills), then newly admitted ones.
///
/// [`super::Scheduler::schedule_into`] refills an existing output in place, reusing its
/// buffers: a block-table row that already holds the right sequence is only extended.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Step number; `update` must be given this step's output.
    pub step_id: u64,
    /// Request of each row (a request with n > 1 appears once per sample); ids through
    /// `Scheduler::request_id` (every row's request is live when the step is built).
    pub row_requests: Vec<RequestKey>,
    /// Tokens computed per row: int32[B].
    pub num_scheduled_tokens: Vec<i32>,
    /// Token ids, rows concatenated: int64[T].
    pub input_ids: Vec<i64>,
    /// Position of each token in its sequence: int64[T].
    pub positions: Vec<i64>,
    /// Row offsets into the token arrays: int32[B + 1].
    pub cu_seqlens_q: Vec<i32>,
    /// KV length of each row after this step (cached + earlier + new tokens): int32[B].
    pub seq_lens: Vec<i32>,
    /// Block tables, one per KV cache group: int32[C, B, block_table_width] (C = 1 unless the
    /// model has KV cache groups), padded with 0; a given-back block (behind a sliding
    /// window) is -1.
    pub block_tables: Vec<i32>,
    /// KV cache groups `C` of `block_tables` and `slot_mapping`.
    pub num_kv_groups: usize,
    /// Width of `block_tables`: the most blocks any row's sequence holds.
    pub block_table_width: usize,
    /// Sequence of each row (the block tables are written from them).
    pub(crate) row_seqs: Vec<SeqId>,
    /// What each row of `block_tables` holds, for [`super::Scheduler::schedule_into`].
    pub(crate) table_rows: BlockTableRows,
    /// KV slot of each token in each KV cache group: int64[C, T].
    pub slot_mapping: Vec<i64>,
    /// Token rows whose logits are sampled: int64[S].
    pub logits_indices: Vec<i64>,
    /// Request of each sampled row.
    pub sampled_requests: Vec<RequestKey>,
    /// Sample index (0 .. n) of each sampled row: int32[S].
    pub sample_indices: Vec<i32>,
    /// Speculative decoding: for each sampled row, how many of its row's drafts come before the
    /// position it samples after (0 for a row without drafts, and for the first logits row of
    /// a row with drafts, which follows its pending token): int32[S].
    pub draft_offsets: Vec<i32>,
    /// Sampled rows (indices into `logits_indices`) of beam requests: their logits give the
    /// beam candidates of `Scheduler::update_with_beams`, not a sampled token: int64[R].
    pub beam_rows: Vec<i64>,
    /// Copy-on-write ops to run before the forward pass: int32[K, 2] as (src, dst) pairs.
    pub copy_ops: Vec<i32>,
    /// Device → host block copies, run after `disk_store`: int32[K, 2] as (device, host) pairs.
    pub swap_out: Vec<i32>,
    /// Host → device block copies, run after `disk_load`: int32[K, 2] as (host, device) pairs.
    pub swap_in: Vec<i32>,
    /// Host → disk block writes, run first of all: int32[K, 2] as (host, slot) pairs.
    pub disk_store: Vec<i32>,
    /// Disk → host block reads, run after `swap_out`: int32[K, 2] as (slot, host) pairs.
    pub disk_load: Vec<i32>,
    /// Requests preempted (recompute) while building this step.
    pub preempted_req_ids: Vec<Arc<str>>,
    /// Requests that ended since the previous step (finished in `update`, or aborted).
    pub finished: Vec<(Arc<str>, FinishReason)>,
}

impl StepOutput {
    /// Empties every array for the next step, keeping the buffers (and what the block-table
    /// rows hold, so that they can be reused).
    pub(crate) fn clear(&mut self, step_id: u64) {
        self.step_id = step_id;
        self.row_requests.clear();
        self.num_scheduled_tokens.clear();
        self.input_ids.clear();
        self.positions.clear();
        self.cu_seqlens_q.clear();
        self.seq_lens.clear();
        self.block_table_width = 0;
        self.row_seqs.clear();
        self.slot_mapping.clear();
        self.logits_indices.clear();
        self.sampled_requests.clear();
        self.sample_indices.clear();
        self.draft_offsets.clear();
        self.beam_rows.clear();
        self.copy_ops.clear();
        self.swap_out.clear();
        self.swap_in.clear();
        self.disk_store.clear();
        self.disk_load.clear();
        self.preempted_req_ids.clear();
        self.finished.clear();
    }

    /// Rows in the batch.
    pub fn num_rows(&self) -> usize {
        self.num_scheduled_tokens.len()
    }

    /// Tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Logits rows to sample.
    pub fn num_sampled(&self) -> usize {
        self.logits_indices.len()
    }
}

/// What each row of a reused `[KV cache groups, rows, width]` block-table buffer holds, so that the
/// next step rewrites only the rows that changed: in a decode step, a row whose sequence got a
/// new block gets one entry written per KV cache group, the others none. A buffer whose content is
/// unknown (new, or written by someone else) goes with an empty (default) value.
#[derive(Debug, Clone, Default)]
pub struct BlockTableRows {
    width: usize,
    num_rows: usize,
    /// `rows[c * num_rows + r]`: what row `r` of KV cache group `c` holds (`None`: unknown).
    rows: Vec<Option<RowTag>>,
}

/// Row `r` holds the first `len` blocks of `seq`'s table as it was at `version`, then zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowTag {
    seq: SeqId,
    version: u32,
    len: u32,
}

impl BlockTableRows {
    /// Forgets what the buffer holds (every row is rewritten next time).
    pub fn clear(&mut self) {
        self.rows.clear();
        self.num_rows = 0;
    }

    /// Adapts the tags to a buffer of `groups` KV cache groups of `rows` rows: when the row count
    /// changes, every KV cache group but the first starts elsewhere, so only KV cache group 0's rows (and
    /// only those that still exist) keep what they hold.
    fn reshape(&mut self, groups: usize, rows: usize) {
        if rows == self.num_rows && self.rows.len() == groups * rows {
            return;
        }
        let keep = if self.rows.len() >= self.num_rows { self.num_rows.min(rows) } else { 0 };
        let mut tags = vec![None; groups * rows];
        tags[..keep].copy_from_slice(&self.rows[..keep]);
        self.rows = tags;
        self.num_rows = rows;
    }

    /// Writes the block tables of `seqs` (one row each per KV cache group, `width` entries, zero
    /// padded; given-back entries are -1) into `dst` (`KV cache groups * seqs.len() * width` entries,
    /// group-major then row-major), which holds what `self` says; rows that already hold a
    /// prefix of the right table are only extended. Fails on an unknown sequence or a table
    /// wider than `width` (leaving `self` consistent with `dst`).
    pub(crate) fn write(&mut self, kv: &KvCacheManager, seqs: &[SeqId], width: usize, dst: &mut [i32]) -> crate::error::Result<()> {
        let (groups, b) = (kv.num_kv_groups(), seqs.len());
        debug_assert_eq!(dst.len(), groups * b * width);
        if width != self.width {
            // Another row stride: nothing in the buffer is where a row would read it.
            self.clear();
            self.width = width;
        }
        self.reshape(groups, b);
        for (r, &seq) in seqs.iter().enumerate() {
            let groups = kv.seq(seq)?.kv_groups();
            for (c, group) in groups.iter().enumerate() {
                let table = group.table();
                let blocks = table.blocks();
                let i = c * b + r;
                if blocks.len() > width {
                    self.rows[i] = None;
                    return Err(crate::error::CoreError::InvariantViolation(format!(
                        "block table of sequence {seq} has {} blocks, wider than the step's {width}",
                        blocks.len()
                    )));
                }
                let row = &mut dst[i * width..(i + 1) * width];
                let tag = RowTag { seq, version: table.version(), len: blocks.len() as u32 };
                let from = match self.rows[i] {
                    Some(old) if old.seq == seq && old.version == tag.version && old.len <= tag.len => old.len as usize,
                    _ => {
                        row[blocks.len()..].fill(0);
                        0
                    }
                };
                // A given-back block (`BlockId::NULL`, u32::MAX) crosses as -1.
                for (d, b) in row[from..blocks.len()].iter_mut().zip(&blocks[from..]) {
                    *d = b.0 as i32;
                }
                self.rows[i] = Some(tag);
            }
        }
        Ok(())
    }
}

/// What the scheduler remembers of a step until its `update`.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepPlan {
    pub step_id: u64,
    /// The sample (its key and its index) of each sampled row.
    pub sampled: Vec<(SampleKey, u32)>,
    /// The step's beam rows (`StepOutput::beam_rows`).
    pub beam_rows: Vec<i64>,
    /// Every sample with rows in the step, in row order (what `rollback_step` undoes).
    pub scheduled: Vec<SampleKey>,
    /// Samples swapped out while building the step (their copies run with it).
    pub swapped_out: Vec<SampleKey>,
    /// The request ends the step reported (given back to the next step on rollback).
    pub reported: Vec<(Arc<str>, FinishReason)>,
}

/// One sampled token's effect, from `update`. For a beam request, one update per live beam
/// after the step (`index`: its rank, best first; `parent`: the rank of the beam it continues
/// before the step), or one with `finish_reason` set when the search ended (its result:
/// `Scheduler::take_beam_results`).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestUpdate {
    /// The request; its id is `Scheduler::request_id(request)` (also when it ended in this
    /// update, until the next `schedule`).
    pub request: RequestKey,
    /// Sample index within the request.
    pub index: u32,
    /// The token appended.
    pub token: u32,
    /// Set when this sample ended with this token.
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at the request's first admission.
    pub num_cached_tokens: usize,
    /// Beam search: the rank, before this step, of the beam this one continues.
    pub parent: Option<u32>,
    /// Beam search: the beam's cumulative log-probability (the best hypothesis' at the end).
    pub cumulative_logprob: Option<f64>,
    /// The logits row the token was sampled from (`None` for a beam update). With drafts a
    /// sample gets several updates in one step, one per emitted token, from consecutive rows.
    pub row: Option<u32>,
}

impl RequestUpdate {
    /// The update of a sampled (not beam) token.
    pub(crate) fn sampled(request: RequestKey, index: u32, token: u32, finish_reason: Option<FinishReason>, num_cached_tokens: usize, row: usize) -> Self {
        RequestUpdate { request, index, token, finish_reason, num_cached_tokens, parent: None, cumulative_logprob: None, row: Some(row as u32) }
    }
}
