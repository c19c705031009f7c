//! Requests and their samples.
//!
//! A request has a prompt and stop parameters shared by its `n` parallel samples (the `n` of
//! `SamplingParams`; a beam search's live beams). Each *sample* has its own token ids, output
//! count and KV sequence. A request starts with one
//! sample; when its prompt has been computed and `n > 1`, the scheduler forks it into `n`
//! samples that share the prompt's blocks (copy-on-write on their first write). Samples are
//! what the scheduler queues, runs and preempts.

use std::sync::Arc;

use super::admission::WaitSet;
use super::beam_search::{BeamParams, BeamSearch};
use crate::block_hash::ExtraKey;
use crate::error::{CoreError, Result};
use crate::ids::SeqId;
use crate::kv_cache_manager::RetentionPolicy;
use crate::slab::SlabKey;
use crate::speculative::SampleSpec;

/// What a caller submits.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Caller's id, unique among live requests.
    pub id: String,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Parallel samples (>= 1).
    pub n: usize,
    /// Most tokens to generate per sample (>= 1).
    pub max_tokens: usize,
    /// Fewest tokens to generate before eos / stop ids may end a sample.
    pub min_tokens: usize,
    /// End-of-sequence ids (ignored with `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    /// Further ids that end a sample.
    pub stop_token_ids: Vec<u32>,
    /// Generate until a length limit even past eos.
    pub ignore_eos: bool,
    /// Lower values are served first under the priority policy.
    pub priority: i64,
    /// Prefix-cache namespace.
    pub cache_salt: Option<String>,
    /// Retention of the prompt's blocks in the prefix cache once free (priority 0..=100,
    /// optional duration).
    pub retention: RetentionPolicy,
    /// Keep the KV of the request when it ends, under a lease, for another engine to read
    /// (disaggregated prefill; see `Scheduler::kv_lease`).
    pub hold_kv: bool,
    /// Beam search instead of sampling (see `scheduler::beam_search`); needs `n == 1`.
    pub beam: Option<BeamParams>,
    /// Compute the whole prompt even where the prefix cache holds it: the caller needs the
    /// logits of every prompt position (prompt logprobs), which cached blocks do not have.
    /// The request's own blocks are still registered in the cache for others.
    pub skip_prefix_cache: bool,
    /// May draft tokens when the scheduler speculates (off for requests whose sampling
    /// depends on state the scheduler cannot see, e.g. a grammar). Beam requests never do.
    pub speculate: bool,
    /// What it waits for before it may be scheduled (empty: queued at once); see
    /// `scheduler::admission`.
    pub wait_for: WaitSet,
}

impl NewRequest {
    /// A request with defaults: n = 1, no stops besides `max_tokens`, priority 0, no salt.
    pub fn new(id: impl Into<String>, prompt: Vec<u32>, max_tokens: usize) -> Self {
        NewRequest {
            id: id.into(),
            prompt,
            n: 1,
            max_tokens,
            min_tokens: 0,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            cache_salt: None,
            retention: RetentionPolicy::default(),
            hold_kv: false,
            beam: None,
            skip_prefix_cache: false,
            speculate: true,
            wait_for: WaitSet::NONE,
        }
    }

    /// Checks the parameters that do not depend on the scheduler's config.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CoreError::InvalidArgument(m));
        if self.prompt.is_empty() {
            return bad(format!("request {:?}: the prompt is empty", self.id));
        }
        if self.n == 0 {
            return bad(format!("request {:?}: n must be >= 1, got 0", self.id));
        }
        if self.max_tokens == 0 {
            return bad(format!("request {:?}: max_tokens must be >= 1, got 0", self.id));
        }
        self.retention.validate().map_err(|e| match e {
            CoreError::InvalidArgument(m) => CoreError::InvalidArgument(format!("request {:?}: {m}", self.id)),
            e => e,
        })?;
        if let Some(beam) = self.beam {
            if beam.width == 0 {
                return bad(format!("request {:?}: beam_width must be >= 1, got 0", self.id));
            }
            if self.n != 1 {
                return bad(format!(
                    "request {:?}: beam search returns beam_width sequences; it cannot be combined with n = {} > 1",
                    self.id, self.n
                ));
            }
            if !beam.length_penalty.is_finite() {
                return bad(format!("request {:?}: length_penalty must be finite, got {}", self.id, beam.length_penalty));
            }
            if self.hold_kv {
                return bad(format!("request {:?}: beam search cannot hold its KV for another engine (hold_kv)", self.id));
            }
        }
        if self.min_tokens > self.max_tokens {
            return bad(format!(
                "request {:?}: min_tokens ({}) must not exceed max_tokens ({})",
                self.id, self.min_tokens, self.max_tokens
            ));
        }
        Ok(())
    }
}

/// Key of a request in the scheduler's slab.
pub type RequestKey = SlabKey;
/// Key of a sample in the scheduler's slab.
pub type SampleKey = SlabKey;

/// A live request (shared by its samples).
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub id: Arc<str>,
    pub n: usize,
    pub max_tokens: usize,
    pub min_tokens: usize,
    /// Empty when the request ignores eos.
    pub eos_token_ids: Vec<u32>,
    pub stop_token_ids: Vec<u32>,
    pub extra: ExtraKey,
    pub retention: RetentionPolicy,
    /// Live samples.
    pub samples: Vec<SampleKey>,
    /// Whether the `n`-way fork has happened.
    pub forked: bool,
    /// Prompt tokens found in the prefix cache at first admission.
    pub num_cached_tokens: usize,
    pub admitted_once: bool,
    /// Take a KV lease when the first sample ends (`NewRequest::hold_kv`).
    pub hold_kv: bool,
    /// The search state of a beam request (its samples are its live beams).
    pub beam: Option<BeamSearch>,
    /// Never admitted on prefix-cache hits (`NewRequest::skip_prefix_cache`).
    pub skip_prefix_cache: bool,
    /// Its samples may draft (`NewRequest::speculate`, and not a beam search).
    pub speculate: bool,
    /// What it still waits for; while not empty it is blocked: its one sample is in neither
    /// queue and holds no sequence (`scheduler::admission`).
    pub waiting_for: WaitSet,
}

/// One sample of a request: what the scheduler queues, runs and preempts.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub req: RequestKey,
    /// Sample index within the request (`0 .. n`).
    pub index: u32,
    /// Token ids while the sample waits to be recomputed; while it runs or is swapped out,
    /// its KV sequence holds them.
    pub tokens: Vec<u32>,
    /// The KV sequence while running (on the device) or swapped out (on the host).
    pub seq: Option<SeqId>,
    pub num_output: usize,
    /// Preempted and not yet re-admitted: its prefix hits are re-reads of its own blocks.
    pub resumed: bool,
    /// Ordering key: (priority under the priority policy else 0, arrival, index; for a beam,
    /// its fork number).
    pub order: (i64, u64, u32),
    /// A beam's cumulative log-probability (0 otherwise).
    pub cum_logprob: f64,
    /// Speculative decoding: the sample's n-gram index and running acceptance.
    pub spec: SampleSpec,
}
