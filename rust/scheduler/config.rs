//! Scheduler configuration, validated on construction, and the one table of its fields'
//! defaults and ranges ([`FIELDS`]).
//!
//! Every default and range of a scheduler or speculative-decoding setting is written once
//! here (or, for the speculative proposers' limits, as a constant of [`crate::speculative`]
//! that the table names). [`SchedulerConfig::new`] and [`SpeculativeArgs::resolve`] take their
//! defaults from it, [`SchedulerConfig::validate`] checks its ranges with [`FieldSpec::check_int`]
//! / [`FieldSpec::check_float`], and the Python bindings hand it to `pagedkv.config`, whose
//! dataclasses, `EngineArgs` and CLI flags read their defaults and ranges from it.

use crate::attention_span::AttentionSpan;
use crate::block_hash::HashMode;
use crate::block_pool::{MAX_BLOCK_SIZE, MAX_NUM_BLOCKS};
use crate::error::{CoreError, Result};
use crate::speculative::suffix::GRAM;
use crate::speculative::{
    SpecMethod, SpeculativeConfig, SuffixParams, MAX_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, MAX_SUFFIX_CACHED_REQUESTS,
    MAX_SUFFIX_TREE_DEPTH,
};

/// Tokens per KV block unless a config says otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Most sequences running at once unless a config says otherwise.
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
/// Token budget of one step unless a config says otherwise.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// Fraction of the pool kept free at admission unless a config says otherwise.
pub const DEFAULT_WATERMARK: f64 = 0.01;
/// The `max_model_len` a config without one gets: its pool's tokens, at most this.
pub const DEFAULT_MAX_MODEL_LEN_CAP: usize = 8192;
/// N-gram prompt lookup: the shortest suffix looked up unless a config says otherwise.
pub const DEFAULT_PROMPT_LOOKUP_MIN: usize = 2;
/// N-gram prompt lookup: the longest suffix looked up unless a config says otherwise.
pub const DEFAULT_PROMPT_LOOKUP_MAX: usize = 5;
/// The admission / preemption orders, by name.
pub const POLICIES: &[&str] = &["fcfs", "priority"];
/// The preemption modes, by name.
pub const PREEMPTION_MODES: &[&str] = &["recompute", "swap", "auto"];
/// The speculative proposers, by name (vLLM's).
pub const SPECULATIVE_METHODS: &[&str] = &["ngram", "suffix", "draft_model"];

/// A field's default value in [`FIELDS`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldDefault {
    /// No default: the field must be given (or is derived, e.g. `max_model_len`).
    Unset,
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A bool.
    Bool(bool),
    /// A name among the field's choices.
    Str(&'static str),
}

/// The values a field in [`FIELDS`] accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldRange {
    /// An integer in `min ..= max` (`max` None: no upper bound).
    Int {
        /// Smallest value.
        min: i64,
        /// Largest value, if any.
        max: Option<i64>,
    },
    /// A finite float above (or, `min_inclusive`, at least) `min` and below (or,
    /// `max_inclusive`, at most) `max` (`max` None: no upper bound).
    Float {
        /// Lower bound.
        min: f64,
        /// Whether `min` itself is allowed.
        min_inclusive: bool,
        /// Upper bound, if any.
        max: Option<f64>,
        /// Whether `max` itself is allowed.
        max_inclusive: bool,
    },
    /// A bool.
    Bool,
    /// One of these names.
    Choice(&'static [&'static str]),
}

/// One setting of [`SchedulerConfig`] or of speculative decoding: its name (the Python
/// keyword's), default and range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FieldSpec {
    /// The keyword's name (`SchedulerConfig(block_size=...)`).
    pub name: &'static str,
    /// The value used when it is not given.
    pub default: FieldDefault,
    /// The values accepted.
    pub range: FieldRange,
    /// What a special value means, said after the range (e.g. "0: no host tier"), or "".
    pub note: &'static str,
}

const fn int(name: &'static str, default: FieldDefault, min: i64, max: Option<i64>) -> FieldSpec {
    FieldSpec { name, default, range: FieldRange::Int { min, max }, note: "" }
}

const fn choice(name: &'static str, default: &'static str, names: &'static [&'static str]) -> FieldSpec {
    FieldSpec { name, default: FieldDefault::Str(default), range: FieldRange::Choice(names), note: "" }
}

const fn flag(name: &'static str, default: bool) -> FieldSpec {
    FieldSpec { name, default: FieldDefault::Bool(default), range: FieldRange::Bool, note: "" }
}

const MAX_BLOCKS: Option<i64> = Some(MAX_NUM_BLOCKS as i64);
const SUFFIX: SuffixParams = SuffixParams::DEFAULT;

/// Every scheduler and speculative-decoding setting a config may give, with its default and
/// range: the one place each is written.
pub static FIELDS: &[FieldSpec] = &[
    int("block_size", FieldDefault::Int(DEFAULT_BLOCK_SIZE as i64), 1, Some(MAX_BLOCK_SIZE as i64)),
    int("num_blocks", FieldDefault::Unset, 1, MAX_BLOCKS),
    int("max_num_seqs", FieldDefault::Int(DEFAULT_MAX_NUM_SEQS as i64), 1, None),
    int("max_num_batched_tokens", FieldDefault::Int(DEFAULT_MAX_NUM_BATCHED_TOKENS as i64), 1, None),
    int("max_model_len", FieldDefault::Unset, 1, None),
    flag("enable_prefix_caching", true),
    choice("policy", "fcfs", POLICIES),
    FieldSpec {
        name: "watermark",
        default: FieldDefault::Float(DEFAULT_WATERMARK),
        range: FieldRange::Float { min: 0.0, min_inclusive: true, max: Some(1.0), max_inclusive: false },
        note: "",
    },
    FieldSpec { note: "0: no host tier", ..int("num_host_blocks", FieldDefault::Int(0), 0, MAX_BLOCKS) },
    FieldSpec { note: "0: no disk tier", ..int("num_disk_blocks", FieldDefault::Int(0), 0, MAX_BLOCKS) },
    choice("preemption_mode", "recompute", PREEMPTION_MODES),
    flag("enable_kv_events", false),
    int("num_speculative_tokens", FieldDefault::Unset, 1, Some(MAX_SPECULATIVE_TOKENS as i64)),
    choice("speculative_method", "ngram", SPECULATIVE_METHODS),
    int("prompt_lookup_min", FieldDefault::Int(DEFAULT_PROMPT_LOOKUP_MIN as i64), 1, Some(MAX_PROMPT_LOOKUP as i64)),
    int("prompt_lookup_max", FieldDefault::Int(DEFAULT_PROMPT_LOOKUP_MAX as i64), 1, Some(MAX_PROMPT_LOOKUP as i64)),
    flag("speculative_adaptive", true),
    int(
        "suffix_decoding_max_tree_depth",
        FieldDefault::Int(SUFFIX.max_depth as i64),
        GRAM as i64,
        Some(MAX_SUFFIX_TREE_DEPTH as i64),
    ),
    FieldSpec {
        name: "suffix_decoding_max_spec_factor",
        default: FieldDefault::Float(SUFFIX.max_spec_factor),
        range: FieldRange::Float { min: 0.0, min_inclusive: false, max: None, max_inclusive: false },
        note: "",
    },
    FieldSpec {
        name: "suffix_decoding_min_token_prob",
        default: FieldDefault::Float(SUFFIX.min_token_prob),
        range: FieldRange::Float { min: 0.0, min_inclusive: true, max: Some(1.0), max_inclusive: true },
        note: "",
    },
    int(
        "suffix_decoding_max_cached_requests",
        FieldDefault::Int(SUFFIX.max_cached_requests as i64),
        0,
        Some(MAX_SUFFIX_CACHED_REQUESTS as i64),
    ),
];

/// The entry of [`FIELDS`] called `name`, if any.
pub fn field(name: &str) -> Option<&'static FieldSpec> {
    FIELDS.iter().find(|f| f.name == name)
}

/// The entry of [`FIELDS`] called `name` (a name of this module's own checks).
fn spec(name: &str) -> &'static FieldSpec {
    field(name).expect("every checked field is in FIELDS")
}

impl FieldSpec {
    /// What the field accepts, in words: "an int in 1 .. 4096", "in [0, 1)", "'fcfs' or 'priority'",
    /// "an int in 0 .. 16777216 (0: no host tier)".
    pub fn expected(&self) -> String {
        let range = self.range_words();
        if self.note.is_empty() {
            range
        } else {
            format!("{range} ({})", self.note)
        }
    }

    fn range_words(&self) -> String {
        match self.range {
            FieldRange::Int { min, max: Some(max) } => format!("an int in {min} .. {max}"),
            FieldRange::Int { min, max: None } => format!("an int >= {min}"),
            FieldRange::Float { min, min_inclusive, max, max_inclusive } => match max {
                None => format!("a finite number {} {min}", if min_inclusive { ">=" } else { ">" }),
                Some(max) => format!(
                    "in {}{min}, {max}{}",
                    if min_inclusive { "[" } else { "(" },
                    if max_inclusive { "]" } else { ")" }
                ),
            },
            FieldRange::Bool => "a bool".into(),
            FieldRange::Choice([a, b]) => format!("'{a}' or '{b}'"),
            FieldRange::Choice(names) => {
                let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
                format!("one of ({})", quoted.join(", "))
            }
        }
    }

    /// The error for a value outside the range (or of another type), shown as `got` (a Python
    /// repr at the boundary). A count from 1 is "a positive int" (its maximum, the core's
    /// limit, has its own message in [`FieldSpec::check_int`]).
    pub fn refuse(&self, got: &str) -> CoreError {
        let expected = match self.range {
            FieldRange::Int { min: 1, .. } => "a positive int".to_string(),
            _ => self.expected(),
        };
        CoreError::Config(format!("{} must be {expected}, got {got}", self.name))
    }

    /// Checks an integer value (a count, a size) against the range. Above the maximum, the
    /// message names the core's limit.
    pub fn check_int(&self, v: i64) -> Result<()> {
        match self.range {
            FieldRange::Int { max: Some(max), .. } if v > max => {
                Err(CoreError::Config(format!("{} must be at most {max} (the core's limit), got {v}", self.name)))
            }
            FieldRange::Int { min, .. } if v < min => Err(self.refuse(&v.to_string())),
            FieldRange::Int { .. } => Ok(()),
            _ => Err(self.refuse(&v.to_string())),
        }
    }

    /// Checks a float value against the range (NaN and infinities are refused).
    pub fn check_float(&self, v: f64) -> Result<()> {
        let FieldRange::Float { min, min_inclusive, max, max_inclusive } = self.range else {
            return Err(self.refuse(&v.to_string()));
        };
        let above = if min_inclusive { v >= min } else { v > min };
        let below = match max {
            None => true,
            Some(max) if max_inclusive => v <= max,
            Some(max) => v < max,
        };
        if v.is_finite() && above && below {
            Ok(())
        } else {
            Err(self.refuse(&v.to_string()))
        }
    }

    /// Checks a name against the choices.
    pub fn check_str(&self, v: &str) -> Result<()> {
        match self.range {
            FieldRange::Choice(names) if names.contains(&v) => Ok(()),
            _ => Err(self.refuse(&format!("'{v}'"))),
        }
    }
}

/// Order in which waiting requests are admitted and running ones are preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served: arrival order; the latest arrival is preempted first.
    Fcfs,
    /// Lower `priority` value first, then arrival order; the lowest priority (highest value),
    /// latest arrival is preempted first.
    Priority,
}

impl Policy {
    /// Parses "fcfs" or "priority".
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            _ => Err(spec("policy").refuse(&format!("'{s}'"))),
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }
}

/// What happens to a running branch's KV when it must make room (preemption).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Free its blocks (full ones stay in the prefix cache) and compute them again later.
    Recompute,
    /// Copy its blocks to the host tier and back later; recompute when the host tier is full.
    Swap,
    /// Per victim, whichever the cost model says is cheaper (see [`SchedulerConfig::swap_is_cheaper`]).
    Auto,
}

impl PreemptionMode {
    /// Parses "recompute", "swap" or "auto".
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "recompute" => Ok(PreemptionMode::Recompute),
            "swap" => Ok(PreemptionMode::Swap),
            "auto" => Ok(PreemptionMode::Auto),
            _ => Err(spec("preemption_mode").refuse(&format!("'{s}'"))),
        }
    }

    /// The mode's name.
    pub fn name(self) -> &'static str {
        match self {
            PreemptionMode::Recompute => "recompute",
            PreemptionMode::Swap => "swap",
            PreemptionMode::Auto => "auto",
        }
    }
}

/// Everything the scheduler needs to know about its pool and budgets.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token budget of one step, shared by decodes and prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) in tokens.
    pub max_model_len: usize,
    /// Reuse cached prompt blocks across requests.
    pub enable_prefix_caching: bool,
    /// Admission / preemption order.
    pub policy: Policy,
    /// Fraction of the pool kept free when admitting new requests (room to grow running
    /// ones before preempting), in `[0, 1)`.
    pub watermark: f64,
    /// Block hash mode (tests force collisions with [`HashMode::Truncated`]).
    pub hash_mode: HashMode,
    /// Blocks of the host tier (0: none). It holds swapped-out branches and, with prefix
    /// caching, the cached blocks the device pool evicts (written back, loaded on a hit).
    pub num_host_blocks: usize,
    /// Slots of the disk tier below the host tier (0: none; needs a host tier and prefix
    /// caching): cached host blocks evicted by reuse are written there, and read back on a hit.
    pub num_disk_blocks: usize,
    /// Recompute, swap, or auto (needs a host tier unless recompute).
    pub preemption_mode: PreemptionMode,
    /// Bytes of one block (all layers, K and V, scales): the cost model and the byte counts
    /// of the statistics (0: unknown, bytes reported as 0).
    pub bytes_per_block: usize,
    /// Measured copy bandwidth between the tiers, bytes per second (cost model).
    pub swap_bytes_per_second: f64,
    /// Measured forward throughput when recomputing, tokens per second (cost model).
    pub recompute_tokens_per_second: f64,
    /// The retention clock moves only by `Scheduler::advance_clock` (simulations on a
    /// simulated clock), not with wall time.
    pub manual_clock: bool,
    /// Log KV-cache events (blocks stored / removed on each tier, all cleared) for KV-aware
    /// routers, taken once per step with `Scheduler::take_kv_events` (see
    /// [`crate::kv_events`]). Needs prefix caching to produce anything.
    pub enable_kv_events: bool,
    /// KV cache groups: what the layers of each KV-cache column attend to, one block table per
    /// column per sequence over the one pool (kv_cache_manager.rs). One full column unless
    /// the model mixes attention types.
    pub attention_spans: Vec<AttentionSpan>,
    /// Speculative decoding: draft tokens for decoding branches and verify them in the step
    /// (see [`crate::speculative`]); `None`: off.
    pub speculative: Option<SpeculativeConfig>,
}

impl SchedulerConfig {
    /// The most blocks one sequence of `len` tokens holds at once, over every column: a full
    /// column all of its blocks, a sliding or chunked one at most what its window needs
    /// under this step budget.
    pub fn blocks_for_sequence(&self, len: usize) -> usize {
        let whole = crate::block_table::blocks_for(len, self.block_size);
        self.attention_spans
            .iter()
            .map(|s| s.max_live_blocks(self.max_num_batched_tokens, self.block_size).map_or(whole, |b| b.min(whole)))
            .sum()
    }

    /// A config with the given pool and the defaults of [`FIELDS`] elsewhere (max_model_len =
    /// the whole pool capped at [`DEFAULT_MAX_MODEL_LEN_CAP`]).
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        SchedulerConfig {
            block_size,
            num_blocks,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_model_len: block_size.saturating_mul(num_blocks).clamp(1, DEFAULT_MAX_MODEL_LEN_CAP),
            enable_prefix_caching: true,
            policy: Policy::Fcfs,
            watermark: DEFAULT_WATERMARK,
            hash_mode: HashMode::Xxh3,
            num_host_blocks: 0,
            num_disk_blocks: 0,
            preemption_mode: PreemptionMode::Recompute,
            bytes_per_block: 0,
            // Placeholders until the engine measures them: a PCIe-class link and a small
            // model's prefill rate (the ratio, not the values, decides).
            swap_bytes_per_second: 10e9,
            recompute_tokens_per_second: 10_000.0,
            manual_clock: false,
            enable_kv_events: false,
            attention_spans: vec![AttentionSpan::Full],
            speculative: None,
        }
    }

    /// Checks every field (against its range in [`FIELDS`]) and their relations.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(CoreError::Config(m));
        let count = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        for (name, v) in [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("num_host_blocks", self.num_host_blocks),
            ("num_disk_blocks", self.num_disk_blocks),
        ] {
            spec(name).check_int(count(v))?;
        }
        spec("watermark").check_float(self.watermark)?;
        if self.num_disk_blocks > 0 && (self.num_host_blocks == 0 || !self.enable_prefix_caching) {
            return err("a disk tier (num_disk_blocks > 0) needs a host tier (num_host_blocks > 0) and prefix caching".into());
        }
        if self.preemption_mode != PreemptionMode::Recompute && self.num_host_blocks == 0 {
            return err(format!(
                "preemption_mode = {:?} needs a host tier: set num_host_blocks",
                self.preemption_mode.name()
            ));
        }
        for (name, v) in [
            ("swap_bytes_per_second", self.swap_bytes_per_second),
            ("recompute_tokens_per_second", self.recompute_tokens_per_second),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return err(format!("{name} must be a positive finite number, got {v}"));
            }
        }
        if let Some(speculative) = &self.speculative {
            speculative.validate()?;
        }
        let capacity = self.block_size * self.num_blocks;
        if capacity < self.max_model_len {
            // Otherwise a request of max_model_len tokens could never run, even alone.
            return err(format!(
                "the KV pool holds {capacity} tokens ({} blocks x {}), fewer than max_model_len = {}: \
                 add blocks or lower max_model_len",
                self.num_blocks, self.block_size, self.max_model_len
            ));
        }
        Ok(())
    }

    /// The `auto` preemption rule: swapping a victim costs copying `blocks` blocks out and
    /// back (`2 * blocks * bytes_per_block / swap_bytes_per_second` seconds); recomputing it
    /// costs computing `tokens` tokens again (`tokens / recompute_tokens_per_second`). Swap
    /// when it is strictly cheaper. With `bytes_per_block` unknown (0) swapping counts as free.
    pub fn swap_is_cheaper(&self, blocks: usize, tokens: usize) -> bool {
        let swap = 2.0 * blocks as f64 * self.bytes_per_block as f64 / self.swap_bytes_per_second;
        let recompute = tokens as f64 / self.recompute_tokens_per_second;
        swap < recompute
    }

    /// Blocks kept free at admission.
    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * self.num_blocks as f64).floor() as usize
    }
}

/// Speculative decoding as a config gives it: the proposer by name and each parameter, `None`
/// where not given. [`SpeculativeArgs::resolve`] fills in the defaults of [`FIELDS`] and checks
/// the whole (the one check: `pagedkv.config.SpeculativeConfig` and the binding's
/// `SchedulerConfig` both call it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpeculativeArgs {
    /// "ngram" (the default), "suffix" or "draft_model".
    pub method: Option<String>,
    /// Most tokens drafted per row and step (required).
    pub num_speculative_tokens: Option<i64>,
    /// N-gram: the shortest suffix looked up.
    pub prompt_lookup_min: Option<i64>,
    /// N-gram: the longest suffix looked up.
    pub prompt_lookup_max: Option<i64>,
    /// Let the cost model draft fewer tokens where drafts would not pay.
    pub adaptive: Option<bool>,
    /// Suffix decoding: the longest suffix matched.
    pub suffix_decoding_max_tree_depth: Option<i64>,
    /// Suffix decoding: drafts per row at most this times the match length.
    pub suffix_decoding_max_spec_factor: Option<f64>,
    /// Suffix decoding: drafting stops below this estimated probability.
    pub suffix_decoding_min_token_prob: Option<f64>,
    /// Suffix decoding: recent outputs matched against.
    pub suffix_decoding_max_cached_requests: Option<i64>,
}

impl SpeculativeArgs {
    /// The checked config these arguments describe, the defaults filled in. An n-gram range
    /// given by one end only keeps the other end's default where it can (`prompt_lookup_max
    /// = 1` alone gives `1 ..= 1`). Parameters of another method than the one chosen are refused.
    pub fn resolve(&self) -> Result<SpeculativeConfig> {
        let err = |m: String| Err(CoreError::Config(m));
        let method = self.method.as_deref().unwrap_or("ngram");
        if !SPECULATIVE_METHODS.contains(&method) {
            let names: Vec<String> = SPECULATIVE_METHODS.iter().map(|n| format!("'{n}'")).collect();
            return err(format!("method '{method}' is not supported; supported: [{}]", names.join(", ")));
        }
        let Some(k) = self.num_speculative_tokens else {
            return err(format!("num_speculative_tokens is required (1 .. {MAX_SPECULATIVE_TOKENS})"));
        };
        spec("num_speculative_tokens").check_int(k)?;
        let suffix_given: Vec<&str> = [
            ("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth.is_some()),
            ("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor.is_some()),
            ("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob.is_some()),
            ("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect();
        if method != "suffix" && !suffix_given.is_empty() {
            return err(format!("{suffix_given:?} apply to method 'suffix', not '{method}'"));
        }
        if method != "ngram" && (self.prompt_lookup_min.is_some() || self.prompt_lookup_max.is_some()) {
            return err(format!("prompt_lookup_min / prompt_lookup_max apply to method 'ngram', not '{method}'"));
        }
        let int = |v: Option<i64>, name: &str| -> Result<usize> {
            let s = spec(name);
            let v = v.unwrap_or(match s.default {
                FieldDefault::Int(d) => d,
                _ => 0,
            });
            s.check_int(v)?;
            Ok(v as usize)
        };
        let float = |v: Option<f64>, name: &str| -> Result<f64> {
            let s = spec(name);
            let v = v.unwrap_or(match s.default {
                FieldDefault::Float(d) => d,
                _ => 0.0,
            });
            s.check_float(v)?;
            Ok(v)
        };
        let method = match method {
            "ngram" => {
                let (lo, hi) = (self.prompt_lookup_min, self.prompt_lookup_max);
                // Each end as given first, then the range they make with the defaults.
                for (v, name) in [(lo, "prompt_lookup_min"), (hi, "prompt_lookup_max")] {
                    v.map_or(Ok(()), |v| spec(name).check_int(v))?;
                }
                let lo = lo.unwrap_or_else(|| hi.map_or(DEFAULT_PROMPT_LOOKUP_MIN as i64, |h| h.min(DEFAULT_PROMPT_LOOKUP_MIN as i64)));
                let hi = hi.unwrap_or_else(|| lo.max(DEFAULT_PROMPT_LOOKUP_MAX as i64));
                let (min, max) = (int(Some(lo), "prompt_lookup_min")?, int(Some(hi), "prompt_lookup_max")?);
                if min > max {
                    return err(format!("prompt_lookup_min ({min}) must not exceed prompt_lookup_max ({max})"));
                }
                SpecMethod::Ngram { min, max }
            }
            "suffix" => SpecMethod::Suffix(SuffixParams {
                max_depth: int(self.suffix_decoding_max_tree_depth, "suffix_decoding_max_tree_depth")?,
                max_spec_factor: float(self.suffix_decoding_max_spec_factor, "suffix_decoding_max_spec_factor")?,
                min_token_prob: float(self.suffix_decoding_min_token_prob, "suffix_decoding_min_token_prob")?,
                max_cached_requests: int(self.suffix_decoding_max_cached_requests, "suffix_decoding_max_cached_requests")?,
            }),
            _ => SpecMethod::Provided,
        };
        let config = SpeculativeConfig { method, num_speculative_tokens: k as usize, adaptive: self.adaptive.unwrap_or(true) };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_do_not() {
        SchedulerConfig::new(16, 64).validate().unwrap();
        let mut c = SchedulerConfig::new(16, 64);
        c.max_model_len = 16 * 64 + 1;
        assert!(c.validate().is_err());
        let mut c = SchedulerConfig::new(16, 64);
        c.watermark = 1.0;
        assert!(c.validate().is_err());
        let mut c = SchedulerConfig::new(16, 64);
        c.max_num_seqs = 0;
        assert!(c.validate().is_err());
        assert!(SchedulerConfig::new(0, 64).validate().is_err());
        assert!(Policy::parse("lifo").is_err());
        assert_eq!(Policy::parse("priority").unwrap(), Policy::Priority);
        let mut c = SchedulerConfig::new(16, 64);
        c.num_host_blocks = MAX_NUM_BLOCKS + 1;
        assert!(c.validate().unwrap_err().to_string().contains("at most"));
    }

    #[test]
    fn the_table_holds_the_defaults_new_uses() {
        let c = SchedulerConfig::new(DEFAULT_BLOCK_SIZE, 64);
        let int = |name: &str| match field(name).unwrap().default {
            FieldDefault::Int(v) => v as usize,
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!((c.block_size, c.max_num_seqs, c.max_num_batched_tokens), (int("block_size"), int("max_num_seqs"), int("max_num_batched_tokens")));
        assert_eq!(field("watermark").unwrap().default, FieldDefault::Float(c.watermark));
        assert_eq!(field("policy").unwrap().default, FieldDefault::Str(c.policy.name()));
        assert_eq!(field("preemption_mode").unwrap().default, FieldDefault::Str(c.preemption_mode.name()));
        assert!(FIELDS.iter().all(|f| FIELDS.iter().filter(|g| g.name == f.name).count() == 1));
    }

    #[test]
    fn speculative_args_resolve_to_the_defaults_and_refuse_the_rest() {
        let args = SpeculativeArgs { num_speculative_tokens: Some(4), ..Default::default() };
        let c = args.resolve().unwrap();
        assert_eq!(c.method, SpecMethod::Ngram { min: DEFAULT_PROMPT_LOOKUP_MIN, max: DEFAULT_PROMPT_LOOKUP_MAX });
        let only_max = SpeculativeArgs { prompt_lookup_max: Some(1), ..args.clone() };
        assert_eq!(only_max.resolve().unwrap().method, SpecMethod::Ngram { min: 1, max: 1 });
        let suffix = SpeculativeArgs { method: Some("suffix".into()), ..args.clone() };
        assert_eq!(suffix.resolve().unwrap().method, SpecMethod::Suffix(SuffixParams::DEFAULT));
        for bad in [
            SpeculativeArgs { num_speculative_tokens: None, ..args.clone() },
            SpeculativeArgs { num_speculative_tokens: Some(MAX_SPECULATIVE_TOKENS as i64 + 1), ..args.clone() },
            SpeculativeArgs { method: Some("eagle".into()), ..args.clone() },
            SpeculativeArgs { prompt_lookup_min: Some(4), prompt_lookup_max: Some(2), ..args.clone() },
            SpeculativeArgs { suffix_decoding_max_tree_depth: Some(8), ..args.clone() },
            SpeculativeArgs { suffix_decoding_min_token_prob: Some(1.5), ..suffix.clone() },
        ] {
            assert!(bad.resolve().is_err(), "{bad:?}");
        }
    }
}
