//! How a request enters the scheduler and how it leaves before it ends by itself.
//!
//! Every request enters at [`Scheduler::add_request`], where all the checks that can refuse
//! it run (duplicate id, parameters, a prompt that can never be served), so a request the
//! scheduler accepted can always be scheduled. A request may first have to *wait* for
//! something outside the scheduler ([`Wait`]): its grammar to compile (structured outputs),
//! or its prompt's KV to arrive from another engine (disaggregated prefill). It is then
//! **blocked**: live (its id is taken, it can be aborted, it shows in the summaries and the
//! stats) but in neither queue, so no step schedules it, and it holds no block. The caller
//! lifts each reason with [`Scheduler::unblock`] once the thing arrived; when none is left,
//! its sample enters the waiting queue in policy order (its arrival number is the one given
//! at `add_request`). A failure (the grammar did not compile, the KV did not arrive under
//! the `fail` policy) is an abort: [`Scheduler::abort_request`] ends a request in every state
//! — blocked, waiting, running, swapped — and says what it was still waiting for, so the
//! caller can drop what it holds for it (a compile, a read in flight).
//!
//! The KV of a request waiting for remote KV arrives into a *reservation* of the same name
//! (`kv_transfer`): the blocks belong to the reservation, not to the request, until the
//! reservation is committed (they enter the prefix cache, and the request, unblocked next,
//! finds them as a prefix hit at admission) or cancelled. An aborted request's reservation
//! lives on until the read ends (the read may still write its blocks), so a new request may
//! not take that name to wait for remote KV before then.

use std::sync::Arc;

use super::request::{Sample, NewRequest, Request, RequestKey};
use super::{beam_search, FinishReason, Policy, Scheduler};
use crate::block_hash::ExtraKey;
use crate::error::{CoreError, Result};
use crate::speculative::SampleSpec;

/// Something a blocked request waits for before it may be scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wait {
    /// Its grammar (structured outputs) is compiling.
    Grammar,
    /// Its prompt's KV is arriving from another engine.
    RemoteKv,
}

impl Wait {
    /// Every reason, in a fixed order.
    pub const ALL: [Wait; 2] = [Wait::Grammar, Wait::RemoteKv];

    /// "grammar" or "remote_kv".
    pub fn as_str(self) -> &'static str {
        match self {
            Wait::Grammar => "grammar",
            Wait::RemoteKv => "remote_kv",
        }
    }

    /// The reason named `name` ("grammar" or "remote_kv"); InvalidArgument otherwise.
    pub fn parse(name: &str) -> Result<Wait> {
        Wait::ALL.into_iter().find(|w| w.as_str() == name).ok_or_else(|| {
            CoreError::InvalidArgument(format!("unknown wait reason {name:?}: expected \"grammar\" or \"remote_kv\""))
        })
    }

    fn bit(self) -> u8 {
        match self {
            Wait::Grammar => 1,
            Wait::RemoteKv => 2,
        }
    }
}

/// A set of [`Wait`] reasons (empty: nothing to wait for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitSet(u8);

impl WaitSet {
    /// No reason.
    pub const NONE: WaitSet = WaitSet(0);

    /// The set with `w` added.
    #[must_use]
    pub fn with(self, w: Wait) -> WaitSet {
        WaitSet(self.0 | w.bit())
    }

    /// The set without `w`.
    #[must_use]
    pub fn without(self, w: Wait) -> WaitSet {
        WaitSet(self.0 & !w.bit())
    }

    /// Whether `w` is in the set.
    pub fn contains(self, w: Wait) -> bool {
        self.0 & w.bit() != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The reasons in the set, in [`Wait::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = Wait> {
        Wait::ALL.into_iter().filter(move |&w| self.contains(w))
    }
}

impl FromIterator<Wait> for WaitSet {
    fn from_iter<I: IntoIterator<Item = Wait>>(iter: I) -> Self {
        iter.into_iter().fold(WaitSet::NONE, WaitSet::with)
    }
}

impl Scheduler {
    /// Adds a request. Fails, changing nothing, on a duplicate id, invalid parameters, a
    /// prompt that can never be served (longer than max_model_len or than the whole pool), or
    /// — for a request that waits for remote KV — a reservation of its name still held (the
    /// read of an aborted request of that id has not ended yet). With `r.wait_for` empty it is
    /// queued at once; else it is blocked until [`Self::unblock`] lifts every reason (module
    /// docs).
    pub fn add_request(&mut self, r: NewRequest) -> Result<RequestKey> {
        r.validate()?;
        if self.by_id.contains_key(r.id.as_str()) {
            return Err(CoreError::DuplicateRequest(r.id));
        }
        if r.wait_for.contains(Wait::RemoteKv) && self.kv_reservations.contains_key(r.id.as_str()) {
            return Err(CoreError::DuplicateRequest(r.id));
        }
        let max_len = self.config.max_model_len;
        if r.prompt.len() > max_len {
            return Err(CoreError::PromptTooLong(format!(
                "request {:?}: prompt of {} tokens exceeds max_model_len = {max_len}",
                r.id,
                r.prompt.len()
            )));
        }
        if r.n > self.config.max_num_seqs {
            return Err(CoreError::InvalidArgument(format!(
                "request {:?}: n = {} exceeds max_num_seqs = {}",
                r.id, r.n, self.config.max_num_seqs
            )));
        }
        if let Some(beam) = r.beam {
            self.check_beam_fits(&r.id, beam.width, r.prompt.len() + r.max_tokens)?;
        }
        if r.hold_kv {
            self.check_kv_lease_fits(&r.id, (r.prompt.len() + r.max_tokens).min(max_len))?;
        }
        let id: Arc<str> = Arc::from(r.id.as_str());
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let prompt_len = r.prompt.len();
        // Room for every token the sample can ever hold, so appends never reallocate.
        let capacity = (prompt_len + r.max_tokens).min(max_len + 1);
        let mut tokens = Vec::with_capacity(capacity);
        tokens.extend_from_slice(&r.prompt);
        let priority = match self.config.policy {
            Policy::Priority => r.priority,
            Policy::Fcfs => 0,
        };
        let key = self.requests.insert(Request {
            id: id.clone(),
            n: r.n,
            max_tokens: r.max_tokens,
            min_tokens: r.min_tokens,
            eos_token_ids: if r.ignore_eos { Vec::new() } else { r.eos_token_ids },
            stop_token_ids: r.stop_token_ids,
            extra: ExtraKey::new(r.cache_salt.as_deref()),
            retention: r.retention,
            samples: Vec::with_capacity(r.n),
            forked: r.n == 1,
            num_cached_tokens: 0,
            admitted_once: false,
            hold_kv: r.hold_kv,
            beam: r.beam.map(|p| beam_search::BeamSearch::new(p, prompt_len)),
            skip_prefix_cache: r.skip_prefix_cache,
            speculate: r.speculate && r.beam.is_none(),
            waiting_for: r.wait_for,
        });
        let sample = self.samples.insert(Sample {
            req: key,
            index: 0,
            tokens,
            seq: None,
            num_output: 0,
            resumed: false,
            order: (priority, arrival, 0),
            cum_logprob: 0.0,
            spec: SampleSpec::default(),
        });
        if let Some(req) = self.requests.get_mut(key) {
            req.samples.push(sample);
        }
        self.by_id.insert(id, key);
        if r.wait_for.is_empty() {
            self.enqueue_waiting(sample, false);
        }
        Ok(key)
    }

    /// Lifts reason `what` of blocked request `id`. Returns true when that was its last reason:
    /// its sample is now in the waiting queue, at its place in policy order. Fails, changing
    /// nothing, on an unknown id (UnknownRequest) or a request that does not wait for `what`.
    pub fn unblock(&mut self, id: &str, what: Wait) -> Result<bool> {
        let key = *self.by_id.get(id).ok_or_else(|| CoreError::UnknownRequest(id.to_string()))?;
        let Some(req) = self.requests.get_mut(key) else { return Err(CoreError::UnknownRequest(id.to_string())) };
        if !req.waiting_for.contains(what) {
            return Err(CoreError::InvalidArgument(format!("request {id:?} is not waiting for {}", what.as_str())));
        }
        req.waiting_for = req.waiting_for.without(what);
        if !req.waiting_for.is_empty() {
            return Ok(false);
        }
        // A blocked request has exactly its first sample (it never ran, so it never forked).
        let sample = req.samples[0];
        self.enqueue_waiting(sample, false);
        Ok(true)
    }

    /// What live request `id` still waits for (empty once it is queued or running), or
    /// `None` for an unknown id.
    pub fn waiting_for(&self, id: &str) -> Option<WaitSet> {
        let key = *self.by_id.get(id)?;
        self.requests.get(key).map(|r| r.waiting_for)
    }

    /// Live requests still waiting for `what` (blocked).
    pub fn num_waiting_for(&self, what: Wait) -> usize {
        self.requests.iter().filter(|(_, r)| r.waiting_for.contains(what)).count()
    }

    /// Ends a request now, in any state (blocked, waiting, running or swapped out): its blocks
    /// are freed and it is reported with reason "abort" in the next step's finished ids.
    /// Returns what it was still waiting for (empty unless it was blocked), so that the caller
    /// can drop what it holds for it. A reservation of its name (remote KV in flight) is not
    /// touched: it ends when the read does (`commit_kv` / `cancel_kv`).
    pub fn abort_request(&mut self, id: &str) -> Result<WaitSet> {
        let key = *self.by_id.get(id).ok_or_else(|| CoreError::UnknownRequest(id.to_string()))?;
        let (samples, waited) = self.requests.get(key).map(|r| (r.samples.clone(), r.waiting_for)).unwrap_or_default();
        for b in samples {
            self.running.retain(|&k| k != b);
            self.waiting.retain(|&k| k != b);
            self.drop_sample(b);
        }
        if let Some(req) = self.requests.remove(key) {
            self.by_id.remove(&req.id);
            self.ended.push((key, req.id.clone()));
            self.finished.push((req.id, FinishReason::Abort));
            self.counters.aborted += 1;
        }
        Ok(waited)
    }
}
