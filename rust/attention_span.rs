//! What the layers of one KV cache group attend to, and so which of a sequence's blocks they
//! can still read: the rule behind KV cache groups (kv_cache_manager.rs).
//!
//! Transformers' conventions, the same as `pagedkv.attention_span` in Python: with a sliding
//! window `w` the query at position `p` sees the keys `p - w < k <= p`; with chunks of `C`
//! the keys `k // C == p // C` (and `k <= p`). A query at a later position never sees a key
//! an earlier query could not, so once a sequence's next query is at `p`, every block wholly
//! before `first_visible(p)` is dead for it for good.

use crate::error::{CoreError, Result};

/// What one group's layers attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionSpan {
    /// Every earlier key (and the query's own).
    #[default]
    Full,
    /// The last `w` keys, the query's own included (`w >= 1`).
    SlidingWindow(usize),
    /// The keys of the query's own chunk of `C` positions, up to the query (`C >= 1`).
    ChunkedLocal(usize),
}

impl AttentionSpan {
    /// The lowest key position the query at `pos` sees.
    #[inline]
    pub fn first_visible(self, pos: usize) -> usize {
        match self {
            AttentionSpan::Full => 0,
            AttentionSpan::SlidingWindow(w) => (pos + 1).saturating_sub(w),
            AttentionSpan::ChunkedLocal(c) => pos / c * c,
        }
    }

    /// The leading blocks (of `block_size` tokens) that no query at `pos` or later reads.
    #[inline]
    pub fn dead_blocks(self, pos: usize, block_size: usize) -> usize {
        self.first_visible(pos) / block_size
    }

    /// The most blocks a sequence holds at once in this group while its queries run
    /// `step_tokens` at a time (a bound for admission arithmetic): unbounded (`None`) for
    /// full attention.
    pub fn max_live_blocks(self, step_tokens: usize, block_size: usize) -> Option<usize> {
        let reach = match self {
            AttentionSpan::Full => return None,
            AttentionSpan::SlidingWindow(w) => w - 1 + step_tokens,
            AttentionSpan::ChunkedLocal(c) => c + step_tokens,
        };
        // The live span can start anywhere inside a block: one more block than it fills.
        Some(reach.div_ceil(block_size) + 1)
    }

    /// The span named `kind` (`"full"`, `"sliding_window"`, `"chunked_local"`) of `size`
    /// tokens (none for full attention), as the Python bindings take it.
    pub fn from_name(kind: &str, size: Option<usize>) -> Result<Self> {
        let span = match (kind, size) {
            ("full", None) => AttentionSpan::Full,
            ("sliding_window", Some(w)) => AttentionSpan::SlidingWindow(w),
            ("chunked_local", Some(c)) => AttentionSpan::ChunkedLocal(c),
            _ => {
                return Err(CoreError::Config(format!(
                    "an attention span is (\"full\", None), (\"sliding_window\", w) or (\"chunked_local\", C), \
                     got ({kind:?}, {size:?})"
                )))
            }
        };
        span.validate()?;
        Ok(span)
    }

    /// The span's name and size, as [`Self::from_name`] takes them.
    pub fn name(self) -> (&'static str, Option<usize>) {
        match self {
            AttentionSpan::Full => ("full", None),
            AttentionSpan::SlidingWindow(w) => ("sliding_window", Some(w)),
            AttentionSpan::ChunkedLocal(c) => ("chunked_local", Some(c)),
        }
    }

    /// True for full attention.
    #[inline]
    pub fn is_full(self) -> bool {
        self == AttentionSpan::Full
    }

    /// Fails on a zero window or chunk.
    pub fn validate(self) -> Result<()> {
        match self {
            AttentionSpan::SlidingWindow(0) | AttentionSpan::ChunkedLocal(0) => {
                Err(CoreError::Config(format!(
                    "{self:?}: a window or chunk must be at least 1 token"
                )))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force over transformers' mask rule.
    fn sees(span: AttentionSpan, p: usize, k: usize) -> bool {
        k <= p
            && match span {
                AttentionSpan::Full => true,
                AttentionSpan::SlidingWindow(w) => p < k + w,
                AttentionSpan::ChunkedLocal(c) => k / c == p / c,
            }
    }

    #[test]
    fn first_visible_is_the_mask_rule() {
        for span in [
            AttentionSpan::Full,
            AttentionSpan::SlidingWindow(1),
            AttentionSpan::SlidingWindow(5),
            AttentionSpan::ChunkedLocal(4),
        ] {
            for p in 0..40 {
                let first = (0..=p).find(|&k| sees(span, p, k)).unwrap();
                assert_eq!(span.first_visible(p), first, "{span:?} at {p}");
                assert!(
                    (first..=p).all(|k| sees(span, p, k)),
                    "{span:?}: visible keys are contiguous"
                );
            }
        }
    }

    #[test]
    fn dead_blocks_are_never_seen_again() {
        for span in [
            AttentionSpan::SlidingWindow(7),
            AttentionSpan::ChunkedLocal(8),
        ] {
            for p in 0..60 {
                let dead = span.dead_blocks(p, 4);
                for later in p..80 {
                    assert!(
                        (0..dead * 4).all(|k| !sees(span, later, k)),
                        "{span:?}: block dead at {p} seen at {later}"
                    );
                }
            }
        }
    }

    #[test]
    fn live_blocks_stay_within_the_bound() {
        for span in [
            AttentionSpan::SlidingWindow(7),
            AttentionSpan::ChunkedLocal(8),
            AttentionSpan::SlidingWindow(16),
        ] {
            for step in [1, 3, 16] {
                let bound = span.max_live_blocks(step, 4).unwrap();
                for start in 0..80 {
                    let live = (start + step).div_ceil(4) - span.dead_blocks(start, 4);
                    assert!(
                        live <= bound,
                        "{span:?} step {step} at {start}: {live} > {bound}"
                    );
                }
            }
        }
        assert_eq!(AttentionSpan::Full.max_live_blocks(1, 4), None);
        assert!(AttentionSpan::SlidingWindow(0).validate().is_err());
    }
}
