//! Why a sample (or a beam search) stopped: the lowest piece of the scheduler's request
//! model, shared by the requests, the beam search and the step output, so that none of them
//! has to import another for it.

/// Why a sample stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos or stop token id was sampled.
    Stop,
    /// `max_tokens` or `max_model_len` was reached.
    Length,
    /// The request was aborted.
    Abort,
}

impl FinishReason {
    /// "stop", "length" or "abort".
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}
