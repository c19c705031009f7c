//! What speculative decoding learns from requests, kept apart per tenant.
//!
//! Two things outlive a request: suffix decoding's outputs of recent requests (matched by every
//! later proposal) and the acceptance of recent verified rows (a new sample's prior, which sets
//! how many drafts it gets). Shared by every request, either would carry one tenant's outputs
//! into another's drafts: the tokens accepted, and the step times, tell the second tenant what
//! the first one generated. So both are kept per **cache salt**, the tenant key the prefix
//! cache already uses (`ExtraKey`): a request sees only what requests with its own salt left
//! behind (requests without a salt share one tenant, as they share prefix-cache blocks).
//!
//! Bounds: at most [`MAX_TENANTS`] tenants (the least recently used one goes first) and
//! [`MAX_CACHED_TOKENS`] tokens of recent outputs over all of them (the least recently used
//! tenant's oldest output goes first), so a client that invents a salt per request costs a
//! bounded amount of memory and evicts nothing but salts nobody uses.

use std::collections::HashMap;

use super::suffix::{RecentOutputs, MAX_CACHED_TOKENS};
use super::Acceptance;

/// Most tenants (cache salts) whose speculation state is kept.
pub const MAX_TENANTS: usize = 4096;

/// One tenant's speculation state.
#[derive(Debug, Clone)]
pub struct TenantSpec {
    /// Suffix decoding: the outputs of this tenant's recent finished requests.
    pub recent_outputs: RecentOutputs,
    /// The acceptance of this tenant's recent verified rows: its new samples' prior.
    pub acceptance: Acceptance,
    /// When it was last used ([`TenantSpecs`]' own counter): the eviction order.
    last_used: u64,
}

impl TenantSpec {
    fn new(last_used: u64) -> Self {
        // Until rows are verified: an even chance, worth a couple of rows.
        TenantSpec { recent_outputs: RecentOutputs::default(), acceptance: Acceptance::prior(0.5, 2.0), last_used }
    }
}

/// Every tenant's [`TenantSpec`], by cache salt (module docs).
#[derive(Debug, Clone, Default)]
pub struct TenantSpecs {
    /// Salted tenants, by salt.
    salted: HashMap<Box<str>, TenantSpec>,
    /// Requests without a salt.
    unsalted: Option<TenantSpec>,
    /// Uses so far (each lookup for an update is one).
    clock: u64,
    /// Live recent-output tokens over every tenant.
    tokens: usize,
}

/// The state a fresh tenant starts with (what [`TenantSpecs::get`] answers for an unknown salt).
static FRESH: std::sync::OnceLock<TenantSpec> = std::sync::OnceLock::new();

impl TenantSpecs {
    /// The state of tenant `salt` (a fresh one's when it has none yet); touches nothing.
    pub fn get(&self, salt: Option<&str>) -> &TenantSpec {
        let found = match salt {
            None => self.unsalted.as_ref(),
            Some(s) => self.salted.get(s),
        };
        found.unwrap_or_else(|| FRESH.get_or_init(|| TenantSpec::new(0)))
    }

    /// Tenant `salt`'s state for an update, made if it has none (evicting the least recently
    /// used tenant past [`MAX_TENANTS`]) and marked used.
    fn touch(&mut self, salt: Option<&str>) -> &mut TenantSpec {
        self.clock += 1;
        let now = self.clock;
        if let Some(s) = salt {
            if !self.salted.contains_key(s) && self.salted.len() >= MAX_TENANTS {
                self.evict_least_recent_tenant();
            }
        }
        let entry = match salt {
            None => self.unsalted.get_or_insert_with(|| TenantSpec::new(now)),
            Some(s) => self.salted.entry(Box::from(s)).or_insert_with(|| TenantSpec::new(now)),
        };
        entry.last_used = now;
        entry
    }

    fn evict_least_recent_tenant(&mut self) {
        let oldest = self.salted.iter().min_by_key(|(_, t)| t.last_used).map(|(k, _)| k.clone());
        if let Some(key) = oldest {
            if let Some(t) = self.salted.remove(&key) {
                self.tokens -= t.recent_outputs.live_tokens();
            }
        }
    }

    /// Folds one verified row of tenant `salt` into its acceptance (see [`Acceptance::record`]).
    pub fn record_acceptance(&mut self, salt: Option<&str>, drafted: usize, accepted: usize, decay: f64) {
        self.touch(salt).acceptance.record(drafted, accepted, decay);
    }

    /// Adds a finished request's output to tenant `salt`'s recent outputs (at most
    /// `max_requests` of them), then evicts the least recently used tenants' oldest outputs
    /// until every tenant together holds at most [`MAX_CACHED_TOKENS`].
    pub fn add_output(&mut self, salt: Option<&str>, output: &[u32], max_requests: usize) {
        let recent = &mut self.touch(salt).recent_outputs;
        let before = recent.live_tokens();
        recent.add(output, max_requests);
        let after = recent.live_tokens();
        self.tokens = self.tokens + after - before;
        while self.tokens > MAX_CACHED_TOKENS {
            let victim = self
                .salted
                .values_mut()
                .chain(self.unsalted.iter_mut())
                .filter(|t| t.recent_outputs.num_outputs() > 0)
                .min_by_key(|t| t.last_used);
            let Some(victim) = victim else { break };
            self.tokens -= victim.recent_outputs.evict_oldest();
        }
    }

    /// Tenants with state.
    pub fn num_tenants(&self) -> usize {
        self.salted.len() + usize::from(self.unsalted.is_some())
    }

    /// Live recent-output tokens over every tenant.
    pub fn num_tokens(&self) -> usize {
        self.tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::suffix::{propose, SuffixParams};
    use crate::speculative::NgramIndex;

    fn drafts(specs: &TenantSpecs, salt: Option<&str>, tokens: &[u32]) -> Vec<u32> {
        let p = SuffixParams { max_depth: 8, max_spec_factor: 4.0, min_token_prob: 0.1, max_cached_requests: 8 };
        let mut out = Vec::new();
        propose(&mut NgramIndex::default(), tokens, &specs.get(salt).recent_outputs, &p, 4, &mut out);
        out
    }

    #[test]
    fn a_tenants_outputs_and_acceptance_are_its_own() {
        let mut specs = TenantSpecs::default();
        specs.add_output(Some("a"), &[5, 6, 7, 8, 9], 8);
        assert_eq!(drafts(&specs, Some("a"), &[1, 2, 6, 7]), vec![8, 9]);
        assert!(drafts(&specs, Some("b"), &[1, 2, 6, 7]).is_empty(), "b never sees a's output");
        assert!(drafts(&specs, None, &[1, 2, 6, 7]).is_empty(), "nor does the unsalted tenant");
        let fresh = specs.get(Some("b")).acceptance.rate();
        for _ in 0..20 {
            specs.record_acceptance(Some("a"), 4, 4, 0.9);
        }
        assert!(specs.get(Some("a")).acceptance.rate() > 0.9);
        assert_eq!(specs.get(Some("b")).acceptance.rate(), fresh, "b's prior is untouched by a's rows");
        assert_eq!(specs.get(None).acceptance.rate(), fresh);
    }

    #[test]
    fn tenants_and_tokens_are_bounded_least_recent_first() {
        let mut specs = TenantSpecs::default();
        for i in 0..MAX_TENANTS + 10 {
            specs.add_output(Some(&format!("t{i}")), &[1, 2, 3], 8);
        }
        assert_eq!(specs.num_tenants(), MAX_TENANTS);
        assert!(drafts(&specs, Some("t0"), &[9, 1, 2]).is_empty(), "the least recent tenant went first");
        assert_eq!(drafts(&specs, Some(&format!("t{}", MAX_TENANTS + 9)), &[9, 1, 2]), vec![3]);
        assert_eq!(specs.num_tokens(), 4 * MAX_TENANTS);

        // Tokens over every tenant: a big output evicts the least recent tenant's first.
        let mut specs = TenantSpecs::default();
        specs.add_output(Some("old"), &[1, 2, 3], 8);
        specs.add_output(Some("new"), &[4, 5, 6], 8);
        let big: Vec<u32> = (0..(MAX_CACHED_TOKENS as u32 - 6)).map(|t| 100 + t % 1000).collect();
        specs.add_output(Some("big"), &big, 8);
        assert!(specs.num_tokens() <= MAX_CACHED_TOKENS);
        assert!(drafts(&specs, Some("old"), &[9, 1, 2]).is_empty(), "old's output went first");
        assert_eq!(drafts(&specs, Some("new"), &[9, 4, 5]), vec![6], "new's stayed");
    }
}
