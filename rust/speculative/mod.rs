//! Speculative decoding in the scheduler: which tokens to draft for a decoding sample, and how
//! many of them a step should verify.
//!
//! A decode step at small batch reads every weight to produce one token per row; verifying
//! `d` drafted tokens in the same forward costs little more, and every accepted draft is a
//! token gained. The scheduler drafts while it builds the step: for each decoding sample of a
//! request that allows it, a proposer ([`ngram`], [`suffix`]) suggests up to `num_speculative_tokens`
//! tokens, the [`SpecCostModel`] keeps as many as pay for their compute, and the drafts become
//! pending tokens of the sample's KV sequence (`KvCacheManager::append_drafts`), computed
//! with it in one row (`1 + d` tokens, `1 + d` logits rows). `update` takes one sampled token
//! per logits row: row `j` was sampled from the target's distribution after the sample's
//! tokens and drafts `1 ..= j`, so the drafts are accepted while each equals the token sampled
//! before it, the first mismatch is replaced by the sampled token, and when all match the
//! last row gives one more (the bonus). For a draft chosen without randomness (a point mass),
//! this *is* the rejection sampler of Leviathan et al. (arXiv 2211.17192): the draft `x` is
//! accepted with probability `p(x)`, and a rejection emits a token drawn from `p` given that
//! it is not `x`, the residual `(p - δx)+` renormalized. Every emitted token is thus
//! distributed exactly as without speculation. The rejected drafts' slots are given back, and
//! blocks they alone occupied return to the pool at once (`KvCacheManager::accept_drafts`).

pub mod ngram;
pub mod suffix;
pub mod tenants;

pub use ngram::NgramIndex;
pub use suffix::{RecentOutputs, SuffixParams};
pub use tenants::TenantSpecs;

use crate::error::{CoreError, Result};

/// Most tokens drafted per row and step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// N-gram prompt lookup: the longest suffix that may be looked up.
pub const MAX_PROMPT_LOOKUP: usize = 64;
/// Suffix decoding: the deepest suffix tree allowed.
pub const MAX_SUFFIX_TREE_DEPTH: usize = 256;
/// Suffix decoding: the most recent outputs that may be kept.
pub const MAX_SUFFIX_CACHED_REQUESTS: usize = 1_000_000;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpecMethod {
    /// Prompt lookup over the sample's own tokens (prompt and output): the tokens that followed
    /// the latest earlier occurrence of its last `min ..= max` tokens.
    Ngram {
        /// Shortest suffix looked up (>= 1).
        min: usize,
        /// Longest suffix matched (>= min).
        max: usize,
    },
    /// Suffix decoding: the longest suffix matched in the sample's tokens and in recent
    /// requests' outputs, a variable number of drafts by continuation frequency ([`suffix`]).
    Suffix(SuffixParams),
    /// Drafts handed in by the caller for each sample ([`crate::scheduler::Scheduler::set_drafts`]),
    /// e.g. from a smaller draft model run by the engine.
    Provided,
}

impl SpecMethod {
    /// The method's name (vLLM's).
    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::Ngram { .. } => "ngram",
            SpecMethod::Suffix(_) => "suffix",
            SpecMethod::Provided => "draft_model",
        }
    }
}

/// Speculative decoding settings (vLLM's `speculative_config` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeculativeConfig {
    /// The proposer.
    pub method: SpecMethod,
    /// Most tokens drafted per row and step (`1 ..= MAX_SPECULATIVE_TOKENS`).
    pub num_speculative_tokens: usize,
    /// Let the cost model choose fewer drafts (down to none) when they would not pay; off:
    /// always draft what the proposer finds, up to `num_speculative_tokens`.
    pub adaptive: bool,
}

impl SpeculativeConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(CoreError::Config(m));
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens) {
            return err(format!(
                "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS}, got {}",
                self.num_speculative_tokens
            ));
        }
        match self.method {
            SpecMethod::Ngram { min, max } => {
                if min == 0 || max < min || max > MAX_PROMPT_LOOKUP {
                    return err(format!(
                        "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= {MAX_PROMPT_LOOKUP}, got {min} and {max}"
                    ));
                }
            }
            SpecMethod::Suffix(p) => {
                if !(suffix::GRAM..=MAX_SUFFIX_TREE_DEPTH).contains(&p.max_depth) {
                    return err(format!("suffix_decoding_max_tree_depth must be in {}..={MAX_SUFFIX_TREE_DEPTH}, got {}", suffix::GRAM, p.max_depth));
                }
                if !(p.max_spec_factor.is_finite() && p.max_spec_factor > 0.0) {
                    return err(format!("suffix_decoding_max_spec_factor must be a finite number > 0, got {}", p.max_spec_factor));
                }
                if !(0.0..=1.0).contains(&p.min_token_prob) {
                    return err(format!("suffix_decoding_min_token_prob must be in [0, 1], got {}", p.min_token_prob));
                }
                if p.max_cached_requests > MAX_SUFFIX_CACHED_REQUESTS {
                    return err(format!("suffix_decoding_max_cached_requests must be at most {MAX_SUFFIX_CACHED_REQUESTS}, got {}", p.max_cached_requests));
                }
            }
            SpecMethod::Provided => {}
        }
        Ok(())
    }
}

/// How many drafts pay, per row (the "never slower" rule).
///
/// The step time is modelled as `overhead + per_token * tokens` (the engine measures both and
/// feeds them in; see `Scheduler::set_spec_cost`). A row with `d` drafts whose drafts are
/// accepted with probability `a` each emits `1 + a + a^2 + ... + a^d` tokens on average: its
/// `j`-th draft adds `a^j` expected tokens for `per_token` seconds. A step of `b` rows
/// without drafts yields `b / (overhead + per_token * b)` tokens per second; a draft raises that
/// rate iff its expected tokens per second beat it: `a^j > per_token * b / (overhead +
/// per_token * b)`. At batch 1 on a memory-bound forward `per_token` is small against
/// `overhead` and almost any draft pays; at large batch the threshold nears 1 and drafting
/// stops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecCostModel {
    /// Seconds of a step that do not grow with its tokens (weights read, launch, sampling).
    pub overhead_s: f64,
    /// Seconds each further token adds.
    pub per_token_s: f64,
}

impl Default for SpecCostModel {
    fn default() -> Self {
        // Until measured: a memory-bound decode (the overhead dominates).
        SpecCostModel { overhead_s: 0.05, per_token_s: 0.0005 }
    }
}

impl SpecCostModel {
    /// The acceptance a draft must beat in a step of `rows` rows (in `[0, 1)`).
    pub fn threshold(&self, rows: usize) -> f64 {
        let work = self.per_token_s * rows.max(1) as f64;
        work / (self.overhead_s + work)
    }

    /// Drafts worth verifying for a row whose drafts are accepted with probability
    /// `acceptance`, out of `available`: the most `d` with `acceptance^d > threshold`.
    pub fn drafts_worth(threshold: f64, acceptance: f64, available: usize) -> usize {
        let mut p = 1.0;
        for d in 0..available {
            p *= acceptance;
            if p <= threshold {
                return d;
            }
        }
        available
    }
}

/// Evidence on the per-position acceptance `a` of drafts (a draft is accepted with probability
/// `a` given the ones before it were): a row that drafted `d` and had `k` accepted was `k`
/// successes and, if `k < d`, one failure, so `a`'s estimate is successes / trials (the
/// maximum-likelihood one). Older evidence decays, so the estimate follows a request whose text
/// turns from copying to writing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acceptance {
    successes: f64,
    trials: f64,
}

impl Acceptance {
    /// Evidence worth `weight` trials at acceptance `rate`.
    pub fn prior(rate: f64, weight: f64) -> Self {
        Acceptance { successes: rate * weight, trials: weight }
    }

    /// Folds in one verified row (`accepted` of `drafted`, `drafted > 0`), after decaying the
    /// old evidence by `decay`.
    pub fn record(&mut self, drafted: usize, accepted: usize, decay: f64) {
        self.successes = decay * self.successes + accepted as f64;
        self.trials = decay * self.trials + accepted as f64 + f64::from(u8::from(accepted < drafted));
    }

    /// The estimate, pulled toward `prior` as if it were `weight` more trials (no evidence: the
    /// prior).
    pub fn rate_with(&self, prior: f64, weight: f64) -> f64 {
        (self.successes + weight * prior) / (self.trials + weight)
    }

    /// The estimate alone (0.5 without evidence).
    pub fn rate(&self) -> f64 {
        self.rate_with(0.5, 1e-9)
    }
}

impl Default for Acceptance {
    fn default() -> Self {
        Acceptance { successes: 0.0, trials: 0.0 }
    }
}

/// A sample's speculation state: its n-gram index, the drafts handed in for it, and its
/// acceptance so far.
#[derive(Debug, Clone, Default)]
pub struct SampleSpec {
    /// The sample's n-gram index (prompt lookup, suffix decoding).
    pub index: NgramIndex,
    /// Drafts handed in by the caller ([`SpecMethod::Provided`]), for the sample at
    /// `provided_at` tokens: stale (ignored) once the sample has another length.
    pub provided: Vec<u32>,
    /// The sample's token count the `provided` drafts follow.
    pub provided_at: usize,
    /// The sample's own acceptance evidence (decaying by [`SAMPLE_DECAY`] per verified row).
    pub acceptance: Acceptance,
}

/// Decay of a sample's acceptance evidence per verified row.
pub const SAMPLE_DECAY: f64 = 0.9;
/// Decay of the scheduler-wide acceptance evidence per verified row.
pub const GLOBAL_DECAY: f64 = 0.995;
/// How many trials the scheduler-wide acceptance counts for in a sample's estimate: a new
/// sample drafts as the recent samples' drafts fared, its own rows take over within a few.
pub const PRIOR_WEIGHT: f64 = 4.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafting_stops_when_the_batch_is_compute_bound() {
        let cost = SpecCostModel { overhead_s: 0.09, per_token_s: 0.001 };
        let small = cost.threshold(1);
        let large = cost.threshold(256);
        assert!(small < 0.02 && large > 0.7);
        assert_eq!(SpecCostModel::drafts_worth(small, 0.6, 5), 5);
        assert_eq!(SpecCostModel::drafts_worth(large, 0.6, 5), 0);
        assert_eq!(SpecCostModel::drafts_worth(0.3, 0.6, 5), 2); // 0.6, 0.36 > 0.3; 0.216 not
    }

    #[test]
    fn acceptance_is_the_geometric_estimate_pulled_to_the_prior() {
        let mut a = Acceptance::default();
        a.record(4, 4, 1.0); // 4 successes, no failure
        a.record(4, 1, 1.0); // 1 success, 1 failure
        assert!((a.rate() - 5.0 / 6.0).abs() < 1e-8);
        assert!((a.rate_with(0.2, 6.0) - (5.0 + 1.2) / 12.0).abs() < 1e-12);
        assert!((Acceptance::default().rate_with(0.3, 4.0) - 0.3).abs() < 1e-12);
    }

    #[test]
    fn bad_configs_are_refused() {
        let ok = SpeculativeConfig { method: SpecMethod::Ngram { min: 1, max: 4 }, num_speculative_tokens: 4, adaptive: true };
        ok.validate().unwrap();
        assert!(SpeculativeConfig { num_speculative_tokens: 0, ..ok }.validate().is_err());
        assert!(SpeculativeConfig { num_speculative_tokens: 17, ..ok }.validate().is_err());
        assert!(SpeculativeConfig { method: SpecMethod::Ngram { min: 3, max: 2 }, ..ok }.validate().is_err());
    }
}
