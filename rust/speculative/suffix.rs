//! Suffix decoding's drafts (Oliaro et al., "SuffixDecoding", 2024): match the longest suffix of
//! a sequence against its own tokens *and* the outputs of recent requests, then draft a
//! variable number of tokens, following the most frequent continuation of the matched text for
//! as long as its estimated probability stays above `min_token_prob`.
//!
//! The paper keeps a suffix tree per request and one over recent outputs; a node there is a
//! substring, its count the substring's occurrences, its children their continuations. The two
//! queries a proposal makes are: the deepest node matching a suffix of the sequence (up to
//! `max_depth` tokens), and the counts of that node's continuations, token after token. Both are
//! answered here from the hash chains of [`NgramIndex`] (over the sample's tokens, and over one
//! text of recent outputs with a separator after each): the latest [`MAX_OCCURRENCES`]
//! occurrences of the last [`GRAM`] tokens, each extended backwards to its match length; the
//! occurrences of the longest match are the node's, and their next tokens its children. The
//! walk is bounded (a tree's node holds every occurrence; here the latest 32 per text), and
//! nothing is built per substring: a sample's index costs one entry per token, where a
//! depth-bounded suffix trie costs up to `max_depth`.

use std::collections::VecDeque;

use super::ngram::NgramIndex;

/// Tokens every match starts from (the chains' gram length).
pub const GRAM: usize = 2;
/// Occurrences read per text and proposal (latest first).
pub const MAX_OCCURRENCES: usize = 32;
/// Ends each output in the text of recent outputs: no token id is this, so no match crosses it.
const SEPARATOR: u32 = u32::MAX;

/// Suffix decoding's settings (vLLM's `suffix_decoding_*` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SuffixParams {
    /// Longest suffix matched (tokens).
    pub max_depth: usize,
    /// Drafts per row at most `ceil(max_spec_factor * match length)`.
    pub max_spec_factor: f64,
    /// A draft's estimated probability (the product of its continuation frequencies) below
    /// which drafting stops.
    pub min_token_prob: f64,
    /// Outputs of finished requests kept to match against (0: the request's own tokens only).
    pub max_cached_requests: usize,
}

impl SuffixParams {
    /// vLLM's defaults (the scheduler config's table, `scheduler::config::FIELDS`, reads them).
    pub const DEFAULT: SuffixParams = SuffixParams { max_depth: 24, max_spec_factor: 1.0, min_token_prob: 0.1, max_cached_requests: 1000 };
}

impl Default for SuffixParams {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Most tokens of recent outputs kept, whatever `max_cached_requests` says: over every tenant
/// together (see [`super::tenants::TenantSpecs`]).
pub const MAX_CACHED_TOKENS: usize = 1 << 22;

/// The outputs of recent finished requests as one indexed text (module docs), oldest first,
/// bounded by request count (and, by its owner, in tokens). Evicted outputs stay in the text,
/// ignored, until half of it is dead; then it is rebuilt from the live ones (amortized O(1) per
/// token).
#[derive(Debug, Clone, Default)]
pub struct RecentOutputs {
    text: Vec<u32>,
    index: NgramIndex,
    /// Length (separator included) of each live output, oldest first.
    lengths: VecDeque<usize>,
    /// Positions before this are evicted.
    dead: usize,
}

impl RecentOutputs {
    /// Adds a finished request's output, evicting the oldest beyond `max_requests` (or
    /// [`MAX_CACHED_TOKENS`]).
    pub fn add(&mut self, output: &[u32], max_requests: usize) {
        if max_requests == 0 || output.len() < 2 {
            return;
        }
        self.text.extend_from_slice(output);
        self.text.push(SEPARATOR);
        self.lengths.push_back(output.len() + 1);
        while self.lengths.len() > max_requests || self.live_tokens() > MAX_CACHED_TOKENS {
            let Some(n) = self.lengths.pop_front() else { break };
            self.dead += n;
        }
        self.compact();
    }

    /// Evicts the oldest output; returns the tokens it held (separator included), 0 when
    /// there was none.
    pub fn evict_oldest(&mut self) -> usize {
        let Some(n) = self.lengths.pop_front() else { return 0 };
        self.dead += n;
        self.compact();
        n
    }

    /// Drops the dead text once it is half of the text, then indexes what is new.
    fn compact(&mut self) {
        if 2 * self.dead > self.text.len() {
            self.text.drain(..self.dead);
            self.dead = 0;
            self.index = NgramIndex::default();
        }
        self.index.extend(&self.text, GRAM, self.text.len());
    }

    /// Outputs kept.
    pub fn num_outputs(&self) -> usize {
        self.lengths.len()
    }

    /// Tokens of the live outputs (separators included).
    pub fn live_tokens(&self) -> usize {
        self.text.len() - self.dead
    }
}

/// One occurrence of the matched suffix: in the sample's own tokens or in the recent outputs,
/// and its last position there.
#[derive(Debug, Clone, Copy)]
struct Occurrence {
    global: bool,
    end: usize,
}

/// Writes into `out` (cleared first) up to `k` drafts for a sample whose tokens are `tokens`
/// and whose index is `local`, with `recent` the outputs of recent requests (module docs).
pub fn propose(local: &mut NgramIndex, tokens: &[u32], recent: &RecentOutputs, p: &SuffixParams, k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = tokens.len();
    if k == 0 || len <= GRAM {
        return;
    }
    local.extend(tokens, GRAM, len - 1);
    let mut best = 0;
    let mut found: Vec<(Occurrence, usize)> = Vec::new();
    local.occurrences(tokens, tokens, p.max_depth, MAX_OCCURRENCES, |end, n| {
        found.push((Occurrence { global: false, end }, n));
        best = best.max(n);
    });
    recent.index.occurrences(&recent.text, tokens, p.max_depth, MAX_OCCURRENCES, |end, n| {
        if end >= recent.dead {
            found.push((Occurrence { global: true, end }, n));
            best = best.max(n);
        }
    });
    if best == 0 {
        return;
    }
    // The deepest match's occurrences, and how many drafts its length allows.
    let mut live: Vec<Occurrence> = found.iter().filter(|(_, n)| *n == best).map(|&(o, _)| o).collect();
    let limit = k.min((p.max_spec_factor * best as f64).ceil() as usize);
    let mut prob = 1.0;
    let mut counts: Vec<(u32, usize)> = Vec::with_capacity(8);
    for j in 0..limit {
        counts.clear();
        let next = |o: &Occurrence| -> Option<u32> {
            let (text, at) = if o.global { (&recent.text[..], o.end + 1 + j) } else { (tokens, o.end + 1 + j) };
            text.get(at).copied().filter(|&t| t != SEPARATOR)
        };
        let mut total = 0;
        for o in &live {
            if let Some(t) = next(o) {
                total += 1;
                match counts.iter_mut().find(|(x, _)| *x == t) {
                    Some((_, c)) => *c += 1,
                    None => counts.push((t, 1)),
                }
            }
        }
        // The most frequent continuation (the latest occurrence's among equals: counts keep
        // first-seen order, and occurrences come latest first).
        let Some(&(token, count)) = counts.iter().reduce(|a, b| if b.1 > a.1 { b } else { a }) else { break };
        prob *= count as f64 / total as f64;
        if prob < p.min_token_prob {
            break;
        }
        out.push(token);
        live.retain(|o| next(o) == Some(token));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_follow_the_most_frequent_continuation_while_it_is_likely() {
        let p = SuffixParams { max_depth: 8, max_spec_factor: 4.0, min_token_prob: 0.3, max_cached_requests: 10 };
        let mut idx = NgramIndex::default();
        let mut out = Vec::new();
        // "1 2" was followed by "3 4" twice and "3 5" once: draft 3 (3/3), then 4 (2/3).
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3, 4, 7, 1, 2];
        propose(&mut idx, &t, &RecentOutputs::default(), &p, 5, &mut out);
        assert_eq!(out[..2], [3, 4]);
        // A stricter threshold stops after the certain token.
        let strict = SuffixParams { min_token_prob: 0.9, ..p };
        propose(&mut NgramIndex::default(), &t, &RecentOutputs::default(), &strict, 5, &mut out);
        assert_eq!(out, vec![3]);
        // The factor bounds the drafts by the match length (2 tokens here).
        let short = SuffixParams { max_spec_factor: 0.5, ..p };
        propose(&mut NgramIndex::default(), &t, &RecentOutputs::default(), &short, 5, &mut out);
        assert_eq!(out, vec![3]);
    }

    #[test]
    fn recent_outputs_are_matched_and_evicted() {
        let p = SuffixParams { max_depth: 8, max_spec_factor: 4.0, min_token_prob: 0.1, max_cached_requests: 2 };
        let mut recent = RecentOutputs::default();
        recent.add(&[5, 6, 7, 8, 9], p.max_cached_requests);
        let mut out = Vec::new();
        // The sample never saw "6 7" continue; an earlier request's output did.
        propose(&mut NgramIndex::default(), &[1, 2, 6, 7], &recent, &p, 4, &mut out);
        assert_eq!(out, vec![8, 9], "stops at the output's end");
        recent.add(&[20, 21, 22], p.max_cached_requests);
        recent.add(&[30, 31, 32], p.max_cached_requests);
        assert_eq!(recent.num_outputs(), 2);
        propose(&mut NgramIndex::default(), &[1, 2, 6, 7], &recent, &p, 4, &mut out);
        assert!(out.is_empty(), "the oldest output was evicted");
        for i in 0..50 {
            recent.add(&[40 + i, 41 + i, 42 + i], p.max_cached_requests);
        }
        assert!(recent.text.len() < 4 * 2 * 5, "dead outputs are dropped from the text");
        propose(&mut NgramIndex::default(), &[0, 89, 90], &recent, &p, 4, &mut out);
        assert_eq!(out, vec![91]);
    }
}
