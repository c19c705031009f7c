//! The one error type of the crate.
//!
//! Every fallible operation returns `Result<_, CoreError>`; nothing on a path that input can
//! reach panics. Running out of blocks is *not* an error: allocation returns `None`/`false`,
//! the scheduler's normal signal to preempt. The Python bindings map each variant to one class
//! of the `pagedkv.errors` tree (rust/py/errors.rs, an exhaustive match).

use thiserror::Error;

/// What went wrong, with enough detail for a clear message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CoreError {
    /// A configuration value is out of range (pool size, block size, budgets, ...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A block id outside `0 .. num_blocks`.
    #[error("block id {block} is out of range: the pool has {num_blocks} blocks (ids 0..{num_blocks})")]
    BlockOutOfRange {
        /// The id as given.
        block: i64,
        /// Pool size.
        num_blocks: usize,
    },
    /// A block with ref count 0 was freed or forked (double free / use after free).
    #[error("block {0} is not allocated (ref count 0): double free or use after free")]
    BlockNotAllocated(u32),
    /// An argument has a wrong value, type or layout.
    #[error("{0}")]
    InvalidArgument(String),
    /// A token id is negative or does not fit in int32.
    #[error("token id {token} at index {index} is invalid: token ids must be in 0..=2147483647")]
    InvalidToken {
        /// The offending value.
        token: i64,
        /// Its position in the input.
        index: usize,
    },
    /// No live sequence has this id.
    #[error("unknown sequence id {0}: never created, or already freed")]
    UnknownSequence(u64),
    /// No live request has this id.
    #[error("unknown request id {0:?}: never added, already finished, or aborted")]
    UnknownRequest(String),
    /// A request with this id is already live.
    #[error("request id {0:?} is already in use by a live request")]
    DuplicateRequest(String),
    /// The prompt can never be served.
    #[error("{0}")]
    PromptTooLong(String),
    /// `update` got an output that is not the latest step's.
    #[error("{0}")]
    StaleOutput(String),
    /// Bookkeeping found inconsistent by `check_invariants` (a bug).
    #[error("invariant violated: {0}")]
    InvariantViolation(String),
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, CoreError>;
