//! The state and the decisions of one beam search, apart from the scheduler: the parameters,
//! the finished hypotheses kept best first, the ranking of one step's candidates
//! ([`decide`]) and the split of a step's budget between a beam group ([`barrier_shares`]).
//!
//! Nothing here knows requests, samples or blocks: a request (request.rs) holds a
//! [`BeamSearch`], and the scheduler's beam steps (beam.rs) apply what [`decide`] returns to
//! its samples and their KV. Keeping these pieces below both is what lets request.rs and
//! beam.rs depend on them without depending on each other. The rules themselves (ranking,
//! scores, the end of a search) are described in beam.rs's module docs.

use super::finish::FinishReason;

/// Beam-search parameters of a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamParams {
    /// Live beams kept per step (`W >= 1`).
    pub width: usize,
    /// Exponent of the length in a finished hypothesis' score (finite; 1.0 averages the
    /// log-probabilities, 0.0 sums them, larger values favour longer outputs).
    pub length_penalty: f64,
}

/// A finished hypothesis of a beam search.
#[derive(Debug, Clone, PartialEq)]
pub struct BeamHypothesis {
    /// Generated token ids (the stop token included when one ended it).
    pub tokens: Vec<u32>,
    /// Sum of the log-probabilities of `tokens`.
    pub cumulative_logprob: f64,
    /// `cumulative_logprob / tokens.len() ** length_penalty`: what hypotheses are ranked by.
    pub score: f64,
    /// `Stop` (a stop token) or `Length` (`max_tokens` or `max_model_len`).
    pub finish_reason: FinishReason,
}

/// A beam request's search state.
#[derive(Debug, Clone)]
pub(crate) struct BeamSearch {
    pub params: BeamParams,
    pub prompt_len: usize,
    /// Finished hypotheses, best first, at most `W`.
    pub finished: Vec<BeamHypothesis>,
    /// Next sample order number (each fork gets a fresh one, so that a request's samples stay
    /// adjacent and ordered in the running queue).
    pub next_order: u32,
}

impl BeamSearch {
    /// A search that has not stepped yet, over a prompt of `prompt_len` tokens.
    pub fn new(params: BeamParams, prompt_len: usize) -> Self {
        BeamSearch { params, prompt_len, finished: Vec::with_capacity(params.width), next_order: 1 }
    }

    /// A hypothesis' score: `cumulative_logprob / len ** length_penalty` (`len` at least 1).
    pub(super) fn score(&self, cumulative_logprob: f64, len: usize) -> f64 {
        cumulative_logprob / (len.max(1) as f64).powf(self.params.length_penalty)
    }

    /// Keeps `h` if it is among the best `W` (ties: the earlier one stays ahead).
    pub(super) fn offer(&mut self, h: BeamHypothesis) {
        let w = self.params.width;
        if self.finished.len() >= w && self.finished.last().is_some_and(|worst| h.score <= worst.score) {
            return;
        }
        let pos = self.finished.partition_point(|x| x.score >= h.score);
        self.finished.insert(pos, h);
        self.finished.truncate(w);
    }
}

/// One candidate continuation: (cumulative logprob, parent beam position, token).
type Candidate = (f64, usize, u32);

/// What one step decides for one beam request.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Decision {
    /// (parent position, token, new cumulative logprob), best first, at most `W`.
    pub survivors: Vec<Candidate>,
    /// Stop-token candidates that finish a hypothesis: (cumulative logprob, parent, token).
    pub stopped: Vec<Candidate>,
}

/// Ranks the candidates of all beams (`candidates`: (cumulative logprob, parent, token), any
/// order) and walks the best `2W` (see beam.rs's module docs). `is_stop(token)`: whether the token
/// ends a hypothesis at this length.
pub(crate) fn decide(width: usize, mut candidates: Vec<Candidate>, is_stop: impl Fn(u32) -> bool) -> Decision {
    // Best first; equal scores keep their (parent, candidate) order (a stable sort).
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut d = Decision::default();
    for (rank, &c) in candidates.iter().take(2 * width).enumerate() {
        if c.0 == f64::NEG_INFINITY {
            break;
        }
        if is_stop(c.2) {
            if rank < width {
                d.stopped.push(c);
            }
        } else if d.survivors.len() < width {
            d.survivors.push(c);
        }
    }
    d
}

/// Splits a step budget between a beam group's pending tokens so that either every beam
/// finishes its pending tokens in the step (and is sampled) or none does: when the budget
/// cannot cover them all, each beam's share stops one token short of its end.
pub(crate) fn barrier_shares(pending: &[usize], budget: usize) -> Vec<usize> {
    let total: usize = pending.iter().sum();
    if total <= budget {
        return pending.to_vec();
    }
    let mut left = budget;
    pending
        .iter()
        .map(|&p| {
            let n = p.saturating_sub(1).min(left);
            left -= n;
            n
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decide_keeps_the_best_and_finishes_top_ranked_stops() {
        // Two beams; token 9 is eos.
        let c = vec![(-1.0, 0, 1), (-0.5, 1, 9), (-2.0, 0, 2), (-0.7, 1, 3), (-3.0, 1, 4), (-0.9, 0, 9)];
        let d = decide(2, c, |t| t == 9);
        assert_eq!(d.stopped, vec![(-0.5, 1, 9)]); // rank 0; the other eos is rank 2 >= W
        assert_eq!(d.survivors, vec![(-0.7, 1, 3), (-1.0, 0, 1)]);
    }

    #[test]
    fn decide_skips_impossible_candidates() {
        let d = decide(2, vec![(f64::NEG_INFINITY, 0, 1), (-1.0, 0, 2)], |_| false);
        assert_eq!(d.survivors, vec![(-1.0, 0, 2)]);
    }

    #[test]
    fn barrier_holds_every_last_token_back_when_short() {
        assert_eq!(barrier_shares(&[1, 1, 1], 3), vec![1, 1, 1]);
        assert_eq!(barrier_shares(&[1, 1, 1], 2), vec![0, 0, 0]);
        assert_eq!(barrier_shares(&[5, 3], 6), vec![4, 2]);
        assert_eq!(barrier_shares(&[5, 3], 4), vec![4, 0]);
    }

    #[test]
    fn hypotheses_keep_the_best_width() {
        let p = BeamParams { width: 2, length_penalty: 1.0 };
        let mut s = BeamSearch::new(p, 3);
        for (cum, len) in [(-4.0, 2), (-3.0, 3), (-1.0, 4), (-9.0, 1)] {
            let score = s.score(cum, len);
            s.offer(BeamHypothesis { tokens: vec![0; len], cumulative_logprob: cum, score, finish_reason: FinishReason::Stop });
        }
        let scores: Vec<f64> = s.finished.iter().map(|h| h.score).collect();
        assert_eq!(scores, vec![-0.25, -1.0]);
    }
}
