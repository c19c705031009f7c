//! Beam search on copy-on-write blocks.
//!
//! A beam request (`NewRequest::beam`) of width `W` starts as one sample (its prompt). Every
//! step that samples it, the caller gives, for each of its live beams, that beam's most likely
//! next tokens with their log-probabilities ([`BeamCandidates`]); `update` then makes the whole
//! step's decisions in one call:
//! - the candidates of all beams are ranked by cumulative log-probability and the best `2W`
//!   are walked in order: a stop token (eos or stop id) among the first `W` becomes a finished
//!   hypothesis, any other candidate a survivor, until `W` survivors are found;
//! - each survivor continues its parent: the first survivor of a parent takes the parent's
//!   sample over, the others fork from it (every block shared; the partial last block is copied
//!   on its next write), and a parent with no survivor is freed at once;
//! - finished hypotheses are kept, the best `W` by score `cumulative_logprob / len ** length_penalty`
//!   (`len`: generated tokens, the stop token included);
//! - the search ends when every beam reached `max_tokens` (or `max_model_len`; the live beams
//!   become hypotheses), when no survivor is left, or by the early-stopping rule of
//!   transformers' default (`early_stopping=False`): `W` hypotheses are finished and the best
//!   live beam's score at its current length is not above the worst of them.
//!
//! The search's result (its best `W` hypotheses, best first) is handed out by
//! [`Scheduler::take_beam_results`] after the `update` that ended it. The search state and
//! the pure decisions (ranking, scores, budget shares) are in [`super::beam_search`], below
//! both this module and the requests that hold a search.
//!
//! Scheduling is gang scheduling: the live beams of a request are all running or all waiting,
//! they are preempted together (swapped as a whole or recomputed as a whole), and a step either
//! samples all of them or none (a beam whose siblings cannot finish their pending tokens in the
//! step holds its last token back), so that every decision sees every beam.

use std::sync::Arc;

use super::beam_search::{barrier_shares, decide, BeamHypothesis};
use super::finish::FinishReason;
use super::output::RequestUpdate;
use super::request::{Sample, SampleKey, RequestKey};
use super::Release;
use super::{Scheduler, StepOutput, StepPlan};
use crate::error::{CoreError, Result};
use crate::ids::SeqId;
use crate::kv_cache_manager::{AddSequence, PrefixMatch, Tier};
use crate::speculative::SampleSpec;

/// The result of a beam search that ended in an `update`.
#[derive(Debug, Clone, PartialEq)]
pub struct BeamResult {
    /// The request's id.
    pub id: Arc<str>,
    /// Its best hypotheses (at most `W`), best first.
    pub hypotheses: Vec<BeamHypothesis>,
}

/// A step's beam candidates: for the `r`-th sampled row that belongs to a beam request (in
/// row order), `token_ids[r * k .. (r + 1) * k]` and `logprobs[r * k .. (r + 1) * k]` are that
/// beam's candidate next tokens and their log-probabilities (best first or not; the first
/// `min(k, 2W)` are used, so give at least `2W`, the vocabulary permitting).
#[derive(Debug, Clone, Copy)]
pub struct BeamCandidates<'a> {
    /// Candidate token ids: `[R * k]`, row-major.
    pub token_ids: &'a [u32],
    /// Their log-probabilities: `[R * k]`, row-major (finite or -inf; never NaN).
    pub logprobs: &'a [f32],
    /// Candidates per row.
    pub k: usize,
}

impl BeamCandidates<'_> {
    /// No candidates (a step without beam rows).
    pub const NONE: BeamCandidates<'static> = BeamCandidates { token_ids: &[], logprobs: &[], k: 0 };

    /// Rows given.
    pub fn num_rows(&self) -> usize {
        self.token_ids.len().checked_div(self.k).unwrap_or(0)
    }

    pub(super) fn validate(&self, rows: usize) -> Result<()> {
        let bad = |m: String| Err(CoreError::InvalidArgument(m));
        if self.token_ids.len() != self.logprobs.len() {
            return bad(format!(
                "beam candidates: {} token ids but {} logprobs",
                self.token_ids.len(),
                self.logprobs.len()
            ));
        }
        if rows == 0 {
            return if self.token_ids.is_empty() { Ok(()) } else { bad("beam candidates given for a step without beam rows".into()) };
        }
        if self.k == 0 || self.token_ids.len() != rows * self.k {
            return bad(format!(
                "beam candidates must be [{rows}, k] with k >= 1 (one row per sampled beam), got {} entries with k = {}",
                self.token_ids.len(),
                self.k
            ));
        }
        if self.logprobs.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
            return bad("beam candidate logprobs must be finite or -inf".into());
        }
        Ok(())
    }
}

impl Scheduler {
    /// The results of the beam searches that ended in the last `update`s, since the last call.
    pub fn take_beam_results(&mut self) -> Vec<BeamResult> {
        std::mem::take(&mut self.beam_results)
    }

    /// Refuses a beam request the pool could not hold with every beam private:
    /// `width * blocks_for(prompt + max_tokens) > num_blocks` (so a beam group alone on the
    /// device always fits, whatever it shares). Also `width` above `max_num_seqs` or
    /// `max_num_batched_tokens` (a step must hold one token of every beam).
    pub(super) fn check_beam_fits(&self, id: &str, width: usize, max_len: usize) -> Result<()> {
        let c = &self.config;
        let bad = |m: String| Err(CoreError::InvalidArgument(format!("request {id:?}: {m}")));
        if width > c.max_num_seqs {
            return bad(format!("beam_width = {width} exceeds max_num_seqs = {}", c.max_num_seqs));
        }
        if width > c.max_num_batched_tokens {
            return bad(format!("beam_width = {width} exceeds max_num_batched_tokens = {}", c.max_num_batched_tokens));
        }
        let blocks = c.blocks_for_sequence(max_len.min(c.max_model_len));
        if width.saturating_mul(blocks) > c.num_blocks {
            return bad(format!(
                "{width} beams of up to {blocks} blocks each need {} blocks, more than the pool's {}",
                width * blocks,
                c.num_blocks
            ));
        }
        Ok(())
    }

    /// Checks, before `update` changes anything, that every beam request with sampled rows in
    /// `plan` has one row per live beam, in a contiguous run.
    pub(super) fn check_beam_rows(&self, plan: &StepPlan) -> Result<()> {
        let mut i = 0;
        let mut seen: Vec<RequestKey> = Vec::new();
        while i < plan.sampled.len() {
            let Some(req) = self.beam_request_of(plan.sampled[i].0) else {
                i += 1;
                continue;
            };
            let mut e = i + 1;
            while e < plan.sampled.len() && self.samples.get(plan.sampled[e].0).is_some_and(|x| x.req == req) {
                e += 1;
            }
            let live = self.requests.get(req).map_or(0, |r| r.samples.len());
            if seen.contains(&req) || e - i != live {
                return Err(CoreError::InvariantViolation(format!(
                    "a beam request has {} sampled rows in the step for {live} live beams",
                    e - i
                )));
            }
            seen.push(req);
            i = e;
        }
        Ok(())
    }

    /// The beam request a sample belongs to, if it is one.
    pub(super) fn beam_request_of(&self, b: SampleKey) -> Option<RequestKey> {
        let req = self.samples.get(b)?.req;
        self.requests.get(req)?.beam.as_ref().map(|_| req)
    }

    /// The waiting samples of beam request `req` are admitted together, each with the share
    /// of the budget [`barrier_shares`] gives it, or none is (false: admission stops). A group
    /// swapped out whole comes back by swap-in (when every beam fits, on a conservative count);
    /// otherwise every beam is re-added from its tokens (prefix hits shared: beams sharing
    /// history hit the same cached blocks) and all are given slots if the pool holds them all.
    pub(super) fn admit_beam_group(
        &mut self,
        req: RequestKey,
        budget: &mut usize,
        reserve: usize,
        scheduled: &mut Vec<(SampleKey, SeqId)>,
    ) -> bool {
        let group: Vec<SampleKey> = self.waiting.iter().copied().filter(|&w| self.samples.get(w).is_some_and(|x| x.req == req)).collect();
        let Some(request) = self.requests.get(req) else { return false };
        let (extra, retention) = (request.extra.clone(), request.retention);
        let seqs: Vec<Option<SeqId>> = group.iter().map(|&b| self.samples.get(b).and_then(|x| x.seq)).collect();
        let all_swapped = seqs.iter().all(Option::is_some);
        if all_swapped {
            let pending: Vec<usize> = seqs.iter().flatten().map(|&s| self.kv.seq(s).map_or(0, |x| x.num_pending())).collect();
            let total: usize = pending.iter().sum();
            // Each beam's blocks counted as if none were shared: an upper bound.
            let cost: usize = seqs
                .iter()
                .flatten()
                .zip(&pending)
                .map(|(&s, &p)| {
                    let grow = self.kv.seq(s).map_or(0, |x| self.kv.growth_blocks(x, p));
                    self.kv.swap_in_cost(s).unwrap_or(usize::MAX / 4) + grow
                })
                .sum();
            if total > *budget || cost + reserve > self.kv.pool().num_free() {
                return false;
            }
            for (&b, (&s, &p)) in group.iter().zip(seqs.iter().flatten().zip(&pending)) {
                let ok = matches!(self.kv.swap_in(s), Ok(true)) && matches!(self.kv.allocate_slots(s, p), Ok(true));
                if !ok {
                    // Cannot happen (an upper bound was checked).
                    return false;
                }
                self.waiting.retain(|&w| w != b);
                if let Some(sample) = self.samples.get_mut(b) {
                    sample.resumed = false;
                }
                self.insert_running(b);
                scheduled.push((b, s));
            }
            *budget -= total;
            return true;
        }
        // Mixed (some swapped, some not): the swapped ones are recomputed too.
        for (&b, &s) in group.iter().zip(&seqs) {
            let Some(s) = s else { continue };
            debug_assert_eq!(self.kv.seq(s).map(|x| x.tier()).ok(), Some(Tier::Host));
            if let (Ok(tokens), Some(sample)) = (self.kv.free_take_tokens(s), self.samples.get_mut(b)) {
                sample.tokens = tokens;
                sample.seq = None;
            }
        }
        // Add every beam (taking its prefix hits, which protects them), then give slots.
        let mut added: Vec<(SampleKey, SeqId, usize, usize)> = Vec::with_capacity(group.len());
        for &b in &group {
            let Some(sample) = self.samples.get_mut(b) else { continue };
            let tokens = std::mem::take(&mut sample.tokens);
            let num_tokens = tokens.len();
            let m = if self.config.enable_prefix_caching { self.kv.match_prefix(&tokens, &extra) } else { PrefixMatch::default() };
            let new = AddSequence { tokens, extra: extra.clone(), prefix: Some(m), retention, keep_all: false };
            let (seq, hit) = self.kv.add_sequence(new);
            added.push((b, seq, num_tokens, hit));
        }
        let pending: Vec<usize> = added.iter().map(|&(_, s, _, _)| self.kv.seq(s).map_or(0, |x| x.num_pending())).collect();
        let shares = barrier_shares(&pending, *budget);
        let need: usize = added.iter().zip(&shares).map(|(&(_, s, _, _), &n)| self.kv.blocks_needed(s, n).unwrap_or(usize::MAX / 4)).sum();
        let fits = need + reserve <= self.kv.pool().num_free() && shares.iter().any(|&n| n > 0);
        if fits {
            for (&(_, s, _, _), &n) in added.iter().zip(&shares) {
                if !matches!(self.kv.allocate_slots(s, n), Ok(true)) {
                    // Cannot happen (the exact need was checked); undone below.
                    return self.undo_group_admission(&added);
                }
            }
        } else {
            return self.undo_group_admission(&added);
        }
        for (&(b, s, num_tokens, hit), &n) in added.iter().zip(&shares) {
            self.waiting.retain(|&w| w != b);
            if let Some(sample) = self.samples.get_mut(b) {
                sample.seq = Some(s);
                let resumed = std::mem::replace(&mut sample.resumed, false);
                if resumed {
                    self.counters.resumed_queries += num_tokens as u64;
                    self.counters.resumed_hits += hit as u64;
                }
            }
            *budget -= n;
            self.insert_running(b);
            if n > 0 {
                scheduled.push((b, s));
            }
        }
        true
    }

    /// Takes back a group admission that did not fit: the sequences are freed (nothing was
    /// written) and the beams keep their tokens, still waiting. Returns false.
    fn undo_group_admission(&mut self, added: &[(SampleKey, SeqId, usize, usize)]) -> bool {
        for &(b, s, _, _) in added {
            let tokens = self.kv.free_discarding_window(s).unwrap_or_default();
            if let Some(sample) = self.samples.get_mut(b) {
                sample.tokens = tokens;
                sample.seq = None;
            }
        }
        false
    }

    /// Schedules the running beams `self.running[i..j]` of one request together: every beam
    /// gets its barrier share of the budget and slots for it, preempting from the back of the
    /// running queue as needed (a victim beam request goes whole). When the victim would be
    /// this request itself, the whole group is preempted (recomputed, the slots it got in this
    /// step given back) and `Err(())` tells the caller to stop scheduling running samples.
    /// Otherwise `Ok(preempted_any)`.
    pub(super) fn schedule_beam_group(
        &mut self,
        i: usize,
        j: usize,
        budget: &mut usize,
        scheduled: &mut Vec<(SampleKey, SeqId)>,
        out: &mut StepOutput,
        plan: &mut StepPlan,
    ) -> Result<std::result::Result<bool, ()>> {
        let group: Vec<SampleKey> = self.running[i..j].to_vec();
        let req = self.samples.get(group[0]).map(|x| x.req);
        let seqs: Vec<SeqId> = group.iter().filter_map(|&b| self.samples.get(b).and_then(|x| x.seq)).collect();
        if seqs.len() != group.len() {
            return Err(CoreError::InvariantViolation("a running beam has no sequence".into()));
        }
        let pending: Vec<usize> = seqs.iter().map(|&s| self.kv.seq(s).map_or(0, |x| x.num_pending())).collect();
        let shares = barrier_shares(&pending, *budget);
        let mut allocated: Vec<usize> = Vec::with_capacity(group.len());
        let mut preempted = false;
        for (x, (&s, &n)) in seqs.iter().zip(&shares).enumerate() {
            if n == 0 {
                continue;
            }
            while !self.kv.allocate_slots(s, n)? {
                preempted = true;
                let victim = self.running.last().copied();
                let victim_req = victim.and_then(|v| self.samples.get(v)).map(|x| x.req);
                if victim.is_none() || victim_req == req {
                    let allocated_seqs: Vec<SeqId> = allocated.iter().map(|&a| seqs[a]).collect();
                    self.preempt_beam_group_in_step(&group, &allocated_seqs, out)?;
                    return Ok(Err(()));
                }
                self.preempt_back(out, plan);
            }
            allocated.push(x);
        }
        for &x in &allocated {
            scheduled.push((group[x], seqs[x]));
            *budget -= shares[x];
        }
        Ok(Ok(preempted))
    }

    /// Preempts a running beam group that could not get its slots in the step being built:
    /// every beam is recomputed later; the ones that got slots in this step (`allocated`) drop
    /// that window unwritten.
    fn preempt_beam_group_in_step(&mut self, group: &[SampleKey], allocated: &[SeqId], out: &mut StepOutput) -> Result<()> {
        for &b in group.iter().rev() {
            self.running.retain(|&k| k != b);
            let Some(seq) = self.samples.get(b).and_then(|x| x.seq) else { continue };
            self.requeue(b, if allocated.contains(&seq) { Release::DiscardWindow } else { Release::TakeTokens })?;
            self.counters.preemptions += 1;
        }
        if let Some(req) = group.first().and_then(|&b| self.samples.get(b)).and_then(|x| self.requests.get(x.req)) {
            out.preempted_req_ids.push(req.id.clone());
        }
        Ok(())
    }

    /// Preempts the back of the running queue: one sample, or every running sample of the
    /// beam request it belongs to (swapped as a whole when the mode chooses a swap, every beam
    /// is decoding and the host holds them all on a conservative count; else recomputed).
    pub(super) fn preempt_back(&mut self, out: &mut StepOutput, plan: &mut StepPlan) {
        let Some(&victim) = self.running.last() else { return };
        let Some(req) = self.beam_request_of(victim) else {
            self.running.pop();
            self.preempt(victim, out, plan, None);
            return;
        };
        let mut group = Vec::new();
        while let Some(&b) = self.running.last() {
            if self.samples.get(b).map(|x| x.req) != Some(req) {
                break;
            }
            self.running.pop();
            group.push(b);
        }
        group.reverse();
        let swap = self.beam_group_swaps(&group);
        // In reverse, so that the front of the waiting queue holds them in order.
        for &b in group.iter().rev() {
            self.preempt(b, out, plan, Some(swap));
        }
    }

    /// Whether a beam group being preempted is swapped (see [`Self::preempt_back`]).
    fn beam_group_swaps(&self, group: &[SampleKey]) -> bool {
        use super::PreemptionMode;
        let seqs: Vec<SeqId> = group.iter().filter_map(|&b| self.samples.get(b).and_then(|x| x.seq)).collect();
        let decoding = seqs.iter().all(|&s| self.kv.seq(s).is_ok_and(|x| x.num_pending() <= 1));
        let (mut blocks, mut tokens) = (0usize, 0usize);
        for &s in &seqs {
            match self.kv.swap_out_cost(s) {
                Ok(Some((b, t))) => {
                    blocks += b;
                    tokens += t;
                }
                _ => return false,
            }
        }
        // Each distinct device block takes at most one host block over the whole group (a
        // beam swapped out later shares the copies of the earlier ones): an upper bound, so the
        // group is swapped whole or not at all.
        let distinct: std::collections::HashSet<u32> =
            seqs.iter().filter_map(|&s| self.kv.seq(s).ok()).flat_map(|x| x.held_blocks().map(|b| b.0)).collect();
        let host_free = self.kv.host_pool().map_or(0, |h| h.num_free());
        let wanted = match self.config.preemption_mode {
            PreemptionMode::Recompute => false,
            PreemptionMode::Swap => true,
            PreemptionMode::Auto => self.config.swap_is_cheaper(blocks, tokens),
        };
        wanted && decoding && distinct.len() <= host_free
    }

    /// Applies one step's decision for beam request `req`, whose live beams had the sampled
    /// rows `beams` (in row order; `rows[x]`: the beam row ordinal of `beams[x]`).
    pub(super) fn apply_beam_step(
        &mut self,
        req: RequestKey,
        beams: &[SampleKey],
        rows: &[usize],
        cand: BeamCandidates<'_>,
        updates: &mut Vec<RequestUpdate>,
    ) -> Result<()> {
        let max_model_len = self.config.max_model_len;
        let Some(request) = self.requests.get(req) else { return Ok(()) };
        let Some(search) = request.beam.as_ref() else { return Ok(()) };
        let width = search.params.width;
        let take = cand.k.min(2 * width);
        let num_output = beams.first().and_then(|&b| self.samples.get(b)).map_or(0, |x| x.num_output);
        let new_len = num_output + 1;
        let past_min = new_len >= request.min_tokens;
        let (eos, stop) = (&request.eos_token_ids, &request.stop_token_ids);
        let mut candidates = Vec::with_capacity(beams.len() * take);
        for (x, (&b, &r)) in beams.iter().zip(rows).enumerate() {
            let cum = self.samples.get(b).map_or(0.0, |x| x.cum_logprob);
            for c in r * cand.k..r * cand.k + take {
                candidates.push((cum + f64::from(cand.logprobs[c]), x, cand.token_ids[c]));
            }
        }
        let is_stop = |t: u32| past_min && (eos.contains(&t) || stop.contains(&t));
        let decision = decide(width, candidates, is_stop);
        let (num_cached, prompt_len) = (request.num_cached_tokens, search.prompt_len);
        let output_of = |s: &Self, x: usize| -> Vec<u32> {
            let seq = beams.get(x).and_then(|&b| s.samples.get(b)).and_then(|b| b.seq).and_then(|q| s.kv.seq(q).ok());
            seq.map(|q| q.tokens()[prompt_len..].to_vec()).unwrap_or_default()
        };
        // Finished hypotheses of this step.
        let mut hyps = Vec::new();
        for &(cum, x, t) in &decision.stopped {
            let mut tokens = output_of(self, x);
            tokens.push(t);
            hyps.push((tokens, cum, FinishReason::Stop));
        }
        let at_length = new_len >= request.max_tokens || prompt_len + new_len >= max_model_len;
        if at_length {
            for &(cum, x, t) in &decision.survivors {
                let mut tokens = output_of(self, x);
                tokens.push(t);
                hyps.push((tokens, cum, FinishReason::Length));
            }
        }
        let Some(search) = self.requests.get_mut(req).and_then(|r| r.beam.as_mut()) else { return Ok(()) };
        for (tokens, cum, reason) in hyps {
            let score = search.score(cum, tokens.len());
            search.offer(BeamHypothesis { tokens, cumulative_logprob: cum, score, finish_reason: reason });
        }
        let early_stop = search.finished.len() >= width
            && decision.survivors.first().is_none_or(|&(cum, _, _)| search.score(cum, new_len) <= search.finished[width - 1].score);
        if at_length || decision.survivors.is_empty() || early_stop {
            self.end_beam_request(req, updates);
            return Ok(());
        }
        // Each parent's rank before this step (rows come in running order, not rank order):
        // what an update's `parent` names.
        let prior_ranks: Vec<u32> = beams.iter().map(|&b| self.samples.get(b).map_or(0, |x| x.index)).collect();
        // Survivors: the first of each parent takes the parent's sample over, the others fork
        // from it (before any token is appended); parents without survivors are freed.
        let mut targets: Vec<SampleKey> = Vec::with_capacity(decision.survivors.len());
        let mut taken = vec![false; beams.len()];
        for &(_, x, _) in &decision.survivors {
            if std::mem::replace(&mut taken[x], true) {
                targets.push(self.fork_beam(beams[x], req)?);
            } else {
                targets.push(beams[x]);
            }
        }
        for (x, &b) in beams.iter().enumerate() {
            if !taken[x] {
                self.running.retain(|&k| k != b);
                self.drop_sample(b);
                if let Some(r) = self.requests.get_mut(req) {
                    r.samples.retain(|&k| k != b);
                }
            }
        }
        for (k, (&t, &(cum, x, token))) in targets.iter().zip(&decision.survivors).enumerate() {
            let Some(sample) = self.samples.get_mut(t) else { continue };
            let Some(seq) = sample.seq else { continue };
            self.kv.append_token(seq, token)?;
            sample.index = k as u32;
            sample.num_output = new_len;
            sample.cum_logprob = cum;
            updates.push(RequestUpdate {
                request: req,
                index: k as u32,
                token,
                finish_reason: None,
                num_cached_tokens: num_cached,
                parent: Some(prior_ranks[x]),
                cumulative_logprob: Some(cum),
                row: None,
            });
        }
        Ok(())
    }

    /// A new running beam sharing every block of `parent` (a survivor of the same parent).
    fn fork_beam(&mut self, parent: SampleKey, req: RequestKey) -> Result<SampleKey> {
        let p = self.samples.get(parent).ok_or_else(|| CoreError::InvariantViolation("fork of a missing beam".into()))?;
        let seq = p.seq.ok_or_else(|| CoreError::InvariantViolation("fork of a waiting beam".into()))?;
        let (num_output, cum, (prio, arrival, _)) = (p.num_output, p.cum_logprob, p.order);
        let order = match self.requests.get_mut(req).and_then(|r| r.beam.as_mut()) {
            Some(s) => {
                s.next_order += 1;
                s.next_order
            }
            None => 0,
        };
        let child_seq = self.kv.fork(seq)?;
        let child = self.samples.insert(Sample {
            req,
            index: 0,
            tokens: Vec::new(),
            seq: Some(child_seq),
            num_output,
            resumed: false,
            order: (prio, arrival, order),
            cum_logprob: cum,
            spec: SampleSpec::default(),
        });
        if let Some(r) = self.requests.get_mut(req) {
            r.samples.push(child);
        }
        self.counters.beam_forks += 1;
        self.insert_running(child);
        Ok(child)
    }

    /// Ends a beam search: every live beam is freed, the result is kept for
    /// [`Self::take_beam_results`], and one update (sample 0, the best hypothesis' last token
    /// and reason) reports the end.
    fn end_beam_request(&mut self, req: RequestKey, updates: &mut Vec<RequestUpdate>) {
        let samples = self.requests.get(req).map(|r| r.samples.clone()).unwrap_or_default();
        for b in samples {
            self.running.retain(|&k| k != b);
            self.waiting.retain(|&k| k != b);
            self.drop_sample(b);
        }
        let Some(mut request) = self.requests.remove(req) else { return };
        let hypotheses = request.beam.take().map(|s| s.finished).unwrap_or_default();
        let reason = hypotheses.first().map_or(FinishReason::Length, |h| h.finish_reason);
        self.counters.count_finish(reason);
        updates.push(RequestUpdate {
            request: req,
            index: 0,
            token: hypotheses.first().and_then(|h| h.tokens.last().copied()).unwrap_or(0),
            finish_reason: Some(reason),
            num_cached_tokens: request.num_cached_tokens,
            parent: None,
            cumulative_logprob: hypotheses.first().map(|h| h.cumulative_logprob),
            row: None,
        });
        self.by_id.remove(&request.id);
        self.ended.push((req, request.id.clone()));
        self.finished.push((request.id.clone(), reason));
        self.beam_results.push(BeamResult { id: request.id, hypotheses });
    }

    /// Beam-sharing gauges over the running beams: (distinct device blocks they hold, the sum
    /// of their block-table lengths — what private copies would take —, blocks held by two or
    /// more running beams).
    pub(super) fn beam_block_counts(&self) -> (usize, usize, usize) {
        let mut holders: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        let mut refs = 0usize;
        for &b in &self.running {
            let Some(sample) = self.samples.get(b) else { continue };
            if self.requests.get(sample.req).is_none_or(|r| r.beam.is_none()) {
                continue;
            }
            let Some(seq) = sample.seq.and_then(|s| self.kv.seq(s).ok()) else { continue };
            for blk in seq.held_blocks() {
                refs += 1;
                *holders.entry(blk.0).or_insert(0) += 1;
            }
        }
        let shared = holders.values().filter(|&&c| c > 1).count();
        (holders.len(), refs, shared)
    }
}
