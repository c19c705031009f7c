//! The step output: flat arrays ready for the device, built once per step.

use std::sync::Arc;

use super::request::{BranchKey, FinishReason, RequestKey};

/// One scheduled step (DESIGN.md, "Step output"). Rows are branches in batch order: running
/// ones first (decodes and continuing prefills), then newly admitted ones.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Step number; `update` must be given this step's output.
    pub step_id: u64,
    /// Request of each row (a request with n > 1 appears once per branch); ids through
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
    /// Block tables, row-major int32[B, block_table_width], padded with 0.
    pub block_tables: Vec<i32>,
    /// Width of `block_tables`.
    pub block_table_width: usize,
    /// KV slot of each token: int64[T].
    pub slot_mapping: Vec<i64>,
    /// Token rows whose logits are sampled: int64[S].
    pub logits_indices: Vec<i64>,
    /// Request of each sampled row.
    pub sampled_requests: Vec<RequestKey>,
    /// Sample index (0 .. n) of each sampled row: int32[S].
    pub sample_indices: Vec<i32>,
    /// Copy-on-write ops to run before the forward pass: int32[K, 2] as (src, dst) pairs.
    pub copy_ops: Vec<i32>,
    /// Requests preempted (recompute) while building this step.
    pub preempted_req_ids: Vec<Arc<str>>,
    /// Requests that ended since the previous step (finished in `update`, or aborted).
    pub finished: Vec<(Arc<str>, FinishReason)>,
}

impl StepOutput {
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

/// What the scheduler remembers of a step until its `update`.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepPlan {
    pub step_id: u64,
    /// Branch and sample index of each sampled row.
    pub sampled: Vec<(BranchKey, u32)>,
}

/// One sampled token's effect, from `update`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestUpdate {
    /// The request.
    pub request: RequestKey,
    /// Its id.
    pub request_id: Arc<str>,
    /// Sample index within the request.
    pub index: u32,
    /// The token appended.
    pub token: u32,
    /// Set when this branch ended with this token.
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at the request's first admission.
    pub num_cached_tokens: usize,
}
