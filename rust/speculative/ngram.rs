//! Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a
//! sequence's last `n` tokens (`prompt_lookup_min <= n <= prompt_lookup_max`), over its prompt
//! and output alike.
//!
//! A scan of the whole context per step costs O(length) per row: 2,000 tokens x 256 rows is
//! half a million comparisons, far over a step's budget. So each sample keeps an
//! [`NgramIndex`] that grows with its tokens (the hash chains of LZ77 compressors): the
//! position of the latest occurrence of every `min`-gram, and for each position the one
//! before it with the same `min`-gram. A proposal hashes the last `min` tokens, walks at most
//! [`MAX_CANDIDATES`] earlier occurrences (latest first), extends each match backwards up to
//! `max` tokens, and takes the longest (the latest among equals). Indexing costs O(min) per
//! new token; a proposal O(min + candidates x max).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Earlier occurrences of the last `min`-gram compared per proposal (latest first).
pub const MAX_CANDIDATES: usize = 8;

const NONE: u32 = u32::MAX;

/// The keys are already hashes: a hasher that passes them through.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b); // never used: keys are u64
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

fn gram_hash(gram: &[u32]) -> u64 {
    // FxHash-style fold, then a final mix so that the map's low bits spread.
    let mut h: u64 = 0;
    for &t in gram {
        h = (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    h ^ (h >> 29)
}

/// One sample's index of `min`-gram occurrences (see the module docs). It only ever covers
/// verified tokens: a proposal indexes up to the token before the last, and drafted tokens are
/// appended after it.
#[derive(Debug, Clone, Default)]
pub struct NgramIndex {
    /// The `min` the index was built for (0: empty).
    min: usize,
    /// Latest end position of each `min`-gram (by hash).
    head: HashMap<u64, u32, BuildHasherDefault<PassThrough>>,
    /// `prev[e]`: the previous end position of the `min`-gram ending at `e` (`NONE` if none or
    /// `e < min - 1`). Its length is the number of positions indexed.
    prev: Vec<u32>,
}

impl NgramIndex {
    /// Positions indexed so far.
    pub fn len(&self) -> usize {
        self.prev.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.prev.is_empty()
    }

    /// Indexes end positions up to `upto` (exclusive) of `text`, restarting if the index was
    /// built for another `min` or covers more tokens than there are.
    pub fn extend(&mut self, text: &[u32], min: usize, upto: usize) {
        if self.min != min || self.prev.len() > text.len() {
            *self = NgramIndex { min, ..NgramIndex::default() };
        }
        for e in self.prev.len()..upto {
            if e + 1 < min {
                self.prev.push(NONE);
                continue;
            }
            let key = gram_hash(&text[e + 1 - min..=e]);
            let before = self.head.insert(key, e as u32).unwrap_or(NONE);
            self.prev.push(before);
        }
    }

    /// Calls `f(end, n)` for the latest `limit` indexed occurrences in `text` of the last `min`
    /// tokens of `query` (latest first), `end` being the occurrence's last position and `n` how
    /// many tokens of `query` it matches backwards (`min ..= max`). Hash collisions are checked
    /// against `text`. Index `text` first ([`Self::extend`]).
    pub fn occurrences(&self, text: &[u32], query: &[u32], max: usize, limit: usize, mut f: impl FnMut(usize, usize)) {
        let (min, len) = (self.min, query.len());
        if min == 0 || len < min {
            return;
        }
        let suffix = &query[len - min..];
        let Some(&first) = self.head.get(&gram_hash(suffix)) else { return };
        let mut e = first;
        for _ in 0..limit {
            if e == NONE {
                break;
            }
            let end = e as usize;
            if text[end + 1 - min..=end] == *suffix {
                let mut n = min;
                while n < max && n <= end && n < len && text[end - n] == query[len - 1 - n] {
                    n += 1;
                }
                f(end, n);
            }
            e = self.prev[end];
        }
    }

    /// Writes into `out` (cleared first) up to `k` tokens that followed the latest earlier
    /// occurrence of the longest suffix of `tokens` of `min ..= max` tokens (nothing if the last
    /// `min` tokens never occurred before). `tokens` must extend the tokens indexed before.
    pub fn propose(&mut self, tokens: &[u32], min: usize, max: usize, k: usize, out: &mut Vec<u32>) {
        out.clear();
        let len = tokens.len();
        if k == 0 || min == 0 || len <= min {
            return;
        }
        // Occurrences must be followed by a token: index end positions up to len - 2.
        self.extend(tokens, min, len - 1);
        let (mut best_end, mut best_len) = (NONE as usize, 0);
        self.occurrences(tokens, tokens, max, MAX_CANDIDATES, |end, n| {
            if n > best_len {
                (best_end, best_len) = (end, n);
            }
        });
        if best_len > 0 {
            out.extend_from_slice(&tokens[best_end + 1..(best_end + 1 + k).min(len)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        // The longest suffix match (min..=max) among the last MAX_CANDIDATES occurrences of
        // the min-gram, latest first: the index's definition, by scanning.
        let len = tokens.len();
        if len <= min {
            return vec![];
        }
        let suffix = &tokens[len - min..];
        let ends: Vec<usize> = (min - 1..len - 1).rev().filter(|&e| tokens[e + 1 - min..=e] == *suffix).take(MAX_CANDIDATES).collect();
        let mut best: Option<(usize, usize)> = None;
        for e in ends {
            let mut n = min;
            while n < max && n <= e && tokens[e - n] == tokens[len - 1 - n] {
                n += 1;
            }
            if best.is_none_or(|(_, b)| n > b) {
                best = Some((e, n));
            }
        }
        best.map(|(e, _)| tokens[e + 1..(e + 1 + k).min(len)].to_vec()).unwrap_or_default()
    }

    #[test]
    fn copies_what_followed_the_latest_match() {
        let mut idx = NgramIndex::default();
        let mut out = Vec::new();
        // "a b c d x a b c e ... a b c" -> the latest "a b c" was followed by "e".
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        idx.propose(&t, 2, 4, 3, &mut out);
        assert_eq!(out, vec![5, 6, 1]);
        // A longer match wins over a later one.
        let t = [7, 1, 2, 3, 4, 8, 2, 3, 5, 7, 1, 2, 3];
        let mut idx = NgramIndex::default();
        idx.propose(&t, 2, 4, 2, &mut out);
        assert_eq!(out, vec![4, 8]);
        // No earlier occurrence: no draft.
        idx.propose(&[1, 2, 3, 4], 2, 4, 2, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn incremental_index_agrees_with_a_scan() {
        let mut state = 12345u64;
        for round in 0..40 {
            let vocab = 2 + round % 6;
            let (min, max) = (1 + round % 3, 1 + round % 3 + round % 4);
            let mut tokens = Vec::new();
            let mut idx = NgramIndex::default();
            let mut out = Vec::new();
            for _ in 0..300 {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                tokens.push(((state >> 33) % vocab as u64) as u32);
                idx.propose(&tokens, min, max, 4, &mut out);
                assert_eq!(out, brute(&tokens, min, max, 4), "round {round}, len {}", tokens.len());
            }
        }
    }
}
