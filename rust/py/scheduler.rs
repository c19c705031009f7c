//! `pagedkv.SchedulerConfig`, `pagedkv.Scheduler`, and the objects a step produces:
//! `SchedulerOutput` (numpy arrays written in Rust, adopted by torch without a copy),
//! `RequestUpdates` (a sequence of `RequestUpdate`) and `SchedulerStats`.
//!
//! A step's arrays and id lists are reused by later steps once nothing references them
//! (see `reuse`), so a decode step allocates almost nothing and rewrites only the block-table
//! rows that changed.

use numpy::ndarray::{Ix1, Ix2};
use numpy::{PyArray1, PyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySlice, PyString};

use super::args::{
    attention_spans_arg, beam_arg, beam_candidates_arg, bool_arg, count_arg, float_arg, hash_mode_arg, index_arg, int_arg, int_list_arg, object_arg, positive_arg, retention_arg, salt_arg,
    str_arg, str_obj_arg, token_ids_arg, wait_set_arg,
};
use super::errors::invalid_argument;
use super::reuse::{ArrayRing, EmptyLists, ListRing, TableRing};
use crate::scheduler::{
    BeamCandidates, FinishReason, NewRequest, Policy, PreemptionMode, RequestKey, RequestUpdate, Scheduler, SchedulerConfig,
    SchedulerStats, StatValue, StepOutput, Wait,
};
use crate::scheduler::DEFAULT_BLOCK_SIZE;

/// Scheduler configuration, validated on construction.
#[pyclass(module = "pagedkv._core", name = "SchedulerConfig", frozen, from_py_object)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (
        *, num_blocks, block_size = None, max_num_seqs = None, max_num_batched_tokens = None,
        max_model_len = None, enable_prefix_caching = None, policy = None, watermark = None, hash_bits = None,
        num_host_blocks = None, num_disk_blocks = None, preemption_mode = None, bytes_per_block = None, swap_bytes_per_second = None,
        recompute_tokens_per_second = None, manual_clock = None, enable_kv_events = None, attention_spans = None,
        num_speculative_tokens = None, speculative_method = None, prompt_lookup_min = None, prompt_lookup_max = None,
        speculative_adaptive = None, suffix_decoding_max_tree_depth = None, suffix_decoding_max_spec_factor = None,
        suffix_decoding_min_token_prob = None, suffix_decoding_max_cached_requests = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<&Bound<'_, PyAny>>,
        max_num_seqs: Option<&Bound<'_, PyAny>>,
        max_num_batched_tokens: Option<&Bound<'_, PyAny>>,
        max_model_len: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        policy: Option<&Bound<'_, PyAny>>,
        watermark: Option<&Bound<'_, PyAny>>,
        hash_bits: Option<&Bound<'_, PyAny>>,
        num_host_blocks: Option<&Bound<'_, PyAny>>,
        num_disk_blocks: Option<&Bound<'_, PyAny>>,
        preemption_mode: Option<&Bound<'_, PyAny>>,
        bytes_per_block: Option<&Bound<'_, PyAny>>,
        swap_bytes_per_second: Option<&Bound<'_, PyAny>>,
        recompute_tokens_per_second: Option<&Bound<'_, PyAny>>,
        manual_clock: Option<&Bound<'_, PyAny>>,
        enable_kv_events: Option<&Bound<'_, PyAny>>,
        attention_spans: Option<&Bound<'_, PyAny>>,
        num_speculative_tokens: Option<&Bound<'_, PyAny>>,
        speculative_method: Option<&Bound<'_, PyAny>>,
        prompt_lookup_min: Option<&Bound<'_, PyAny>>,
        prompt_lookup_max: Option<&Bound<'_, PyAny>>,
        speculative_adaptive: Option<&Bound<'_, PyAny>>,
        suffix_decoding_max_tree_depth: Option<&Bound<'_, PyAny>>,
        suffix_decoding_max_spec_factor: Option<&Bound<'_, PyAny>>,
        suffix_decoding_min_token_prob: Option<&Bound<'_, PyAny>>,
        suffix_decoding_max_cached_requests: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let bs = block_size.map(|o| positive_arg(o, "block_size")).transpose()?.unwrap_or(DEFAULT_BLOCK_SIZE);
        let mut c = SchedulerConfig::new(bs, positive_arg(num_blocks, "num_blocks")?);
        if let Some(o) = max_num_seqs {
            c.max_num_seqs = positive_arg(o, "max_num_seqs")?;
        }
        if let Some(o) = max_num_batched_tokens {
            c.max_num_batched_tokens = positive_arg(o, "max_num_batched_tokens")?;
        }
        if let Some(o) = max_model_len.filter(|o| !o.is_none()) {
            c.max_model_len = positive_arg(o, "max_model_len")?;
        }
        if let Some(o) = enable_prefix_caching {
            c.enable_prefix_caching = bool_arg(o, "enable_prefix_caching")?;
        }
        if let Some(o) = policy {
            c.policy = Policy::parse(&str_arg(o, "policy")?)?;
        }
        if let Some(o) = watermark {
            c.watermark = float_arg(o, "watermark")?;
        }
        if let Some(o) = hash_bits {
            c.hash_mode = hash_mode_arg(o)?;
        }
        if let Some(o) = num_host_blocks {
            c.num_host_blocks = count_arg(o, "num_host_blocks")?;
        }
        if let Some(o) = num_disk_blocks {
            c.num_disk_blocks = count_arg(o, "num_disk_blocks")?;
        }
        if let Some(o) = preemption_mode {
            c.preemption_mode = PreemptionMode::parse(&str_arg(o, "preemption_mode")?)?;
        }
        if let Some(o) = bytes_per_block {
            c.bytes_per_block = count_arg(o, "bytes_per_block")?;
        }
        if let Some(o) = swap_bytes_per_second {
            c.swap_bytes_per_second = float_arg(o, "swap_bytes_per_second")?;
        }
        if let Some(o) = recompute_tokens_per_second {
            c.recompute_tokens_per_second = float_arg(o, "recompute_tokens_per_second")?;
        }
        if let Some(o) = manual_clock {
            c.manual_clock = bool_arg(o, "manual_clock")?;
        }
        if let Some(o) = enable_kv_events {
            c.enable_kv_events = bool_arg(o, "enable_kv_events")?;
        }
        if let Some(o) = attention_spans.filter(|o| !o.is_none()) {
            c.attention_spans = attention_spans_arg(o)?;
        }
        if num_speculative_tokens.is_some_and(|o| !o.is_none()) {
            let given = [
                ("num_speculative_tokens", num_speculative_tokens),
                ("speculative_method", speculative_method),
                ("prompt_lookup_min", prompt_lookup_min),
                ("prompt_lookup_max", prompt_lookup_max),
                ("speculative_adaptive", speculative_adaptive),
                ("suffix_decoding_max_tree_depth", suffix_decoding_max_tree_depth),
                ("suffix_decoding_max_spec_factor", suffix_decoding_max_spec_factor),
                ("suffix_decoding_min_token_prob", suffix_decoding_min_token_prob),
                ("suffix_decoding_max_cached_requests", suffix_decoding_max_cached_requests),
            ];
            let args = super::config::speculative_args(|name| given.iter().find(|(n, _)| *n == name).and_then(|(_, o)| o.cloned()))?;
            c.speculative = Some(args.resolve()?);
        }
        c.validate()?;
        Ok(PySchedulerConfig { inner: c })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    /// Blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }
    /// Most sequences running at once.
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    /// Token budget per step.
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.max_num_batched_tokens
    }
    /// Longest sequence in tokens.
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }
    /// Whether the prefix cache is on.
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }
    /// "fcfs" or "priority".
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy.name()
    }
    /// Fraction of blocks kept free at admission.
    #[getter]
    fn watermark(&self) -> f64 {
        self.inner.watermark
    }
    /// Blocks of the host tier (0: none).
    #[getter]
    fn num_host_blocks(&self) -> usize {
        self.inner.num_host_blocks
    }
    /// Slots of the disk tier (0: none).
    #[getter]
    fn num_disk_blocks(&self) -> usize {
        self.inner.num_disk_blocks
    }
    /// "recompute", "swap" or "auto".
    #[getter]
    fn preemption_mode(&self) -> &'static str {
        self.inner.preemption_mode.name()
    }
    /// Bytes of one block (0: unknown).
    #[getter]
    fn bytes_per_block(&self) -> usize {
        self.inner.bytes_per_block
    }
    /// Whether KV-cache events are logged (`Scheduler.take_kv_events`).
    #[getter]
    fn enable_kv_events(&self) -> bool {
        self.inner.enable_kv_events
    }
    /// The most blocks (pages) one sequence of `len` tokens holds at once, over every KV cache group.
    fn blocks_for_sequence(&self, len: usize) -> usize {
        self.inner.blocks_for_sequence(len)
    }
    /// KV cache groups: each KV cache group's span as `(kind, size)`, KV cache group 0 first.
    #[getter]
    fn attention_spans(&self) -> Vec<(&'static str, Option<usize>)> {
        self.inner.attention_spans.iter().map(|s| s.name()).collect()
    }

    /// Most tokens drafted per row and step (0: speculative decoding off).
    #[getter]
    fn num_speculative_tokens(&self) -> usize {
        self.inner.speculative.map_or(0, |s| s.num_speculative_tokens)
    }

    /// The draft proposer ("ngram"), or None when speculative decoding is off.
    #[getter]
    fn speculative_method(&self) -> Option<&'static str> {
        self.inner.speculative.map(|s| s.method.name())
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(num_blocks={}, block_size={}, max_num_seqs={}, max_num_batched_tokens={}, \
             max_model_len={}, enable_prefix_caching={}, policy={:?}, watermark={}, num_host_blocks={}, \
             preemption_mode={:?})",
            c.num_blocks,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.max_model_len,
            if c.enable_prefix_caching { "True" } else { "False" },
            c.policy.name(),
            c.watermark,
            c.num_host_blocks,
            c.preemption_mode.name()
        )
    }
}

/// One step to execute: flat numpy arrays in batch order (see docs/core.md, "Step
/// output"). The arrays are read-only by contract: once nothing references them any more,
/// a later step may reuse them.
#[pyclass(module = "pagedkv._core", name = "SchedulerOutput", frozen)]
pub struct PySchedulerOutput {
    step_id: u64,
    num_tokens: usize,
    #[pyo3(get)]
    req_ids: Py<PyList>,
    #[pyo3(get)]
    num_scheduled_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    cu_seqlens_q: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    /// KV cache groups `C`: `block_tables` is `int32[C * B, W]` (KV cache group `c`'s rows are
    /// `c * B .. (c + 1) * B`; `.reshape(C, B, W)` is a view) and `slot_mapping`
    /// `int64[C * T]`; 1 unless the scheduler has KV cache groups.
    #[pyo3(get)]
    num_kv_groups: usize,
    #[pyo3(get)]
    logits_indices: Py<PyArray1<i64>>,
    #[pyo3(get)]
    sampled_req_ids: Py<PyList>,
    #[pyo3(get)]
    sample_indices: Py<PyArray1<i32>>,
    /// Speculative decoding: per sampled row, the drafts of its row before the position it
    /// samples after (0 where there are none): int32[S].
    #[pyo3(get)]
    draft_offsets: Py<PyArray1<i32>>,
    #[pyo3(get)]
    beam_rows: Py<PyArray1<i64>>,
    #[pyo3(get)]
    copy_ops: Py<PyArray2<i32>>,
    #[pyo3(get)]
    swap_out: Py<PyArray2<i32>>,
    #[pyo3(get)]
    swap_in: Py<PyArray2<i32>>,
    #[pyo3(get)]
    disk_store: Py<PyArray2<i32>>,
    #[pyo3(get)]
    disk_load: Py<PyArray2<i32>>,
    #[pyo3(get)]
    preempted_req_ids: Py<PyList>,
    #[pyo3(get)]
    finished_req_ids: Py<PyList>,
    #[pyo3(get)]
    finish_reasons: Py<PyList>,
}

#[pymethods]
impl PySchedulerOutput {
    /// The step number (`update` checks it).
    #[getter]
    fn step_id(&self) -> u64 {
        self.step_id
    }

    /// Rows (sequences) in the batch.
    #[getter]
    fn num_reqs(&self, py: Python<'_>) -> usize {
        self.req_ids.bind(py).len()
    }

    /// Tokens in the batch.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// True when nothing is scheduled.
    #[getter]
    fn is_empty(&self) -> bool {
        self.num_tokens == 0
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_reqs={}, num_tokens={}, num_sampled={}, preempted={}, finished={})",
            self.step_id,
            self.req_ids.bind(py).len(),
            self.num_tokens,
            self.sampled_req_ids.bind(py).len(),
            self.preempted_req_ids.bind(py).len(),
            self.finished_req_ids.bind(py).len()
        )
    }
}

/// The effect of one sampled token on one request sample.
#[pyclass(module = "pagedkv._core", name = "RequestUpdate", frozen)]
pub struct PyRequestUpdate {
    #[pyo3(get)]
    request_id: Py<PyString>,
    /// Sample index within the request (0 .. n).
    #[pyo3(get)]
    index: u32,
    token: u32,
    finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at the request's first admission.
    #[pyo3(get)]
    num_cached_tokens: usize,
    /// Beam search: the rank, before this step, of the beam this one continues (else None).
    #[pyo3(get)]
    parent: Option<u32>,
    /// Beam search: the beam's cumulative log-probability (else None).
    #[pyo3(get)]
    cumulative_logprob: Option<f64>,
    /// The logits row the token was sampled from (None for beam search). With speculative
    /// decoding one sample gets an update per emitted token, from consecutive rows.
    #[pyo3(get)]
    logits_row: Option<u32>,
}

#[pymethods]
impl PyRequestUpdate {
    /// The new token ids (one per step).
    #[getter]
    fn new_token_ids(&self) -> Vec<u32> {
        vec![self.token]
    }

    /// "stop", "length" or "abort" when the sample ended with this token, else None.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.finish.map(FinishReason::as_str)
    }

    /// True when the sample ended with this token.
    #[getter]
    fn finished(&self) -> bool {
        self.finish.is_some()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "RequestUpdate(request_id={:?}, index={}, new_token_ids=[{}], finish_reason={})",
            self.request_id.bind(py).to_string(),
            self.index,
            self.token,
            self.finish.map(|f| format!("{:?}", f.as_str())).unwrap_or_else(|| "None".into())
        )
    }
}

/// What `Scheduler.update` returns: one update per sampled row of a live request, in logits-row
/// order (a beam request: one per live beam after the step, or one when its search ended). A read-only sequence of `RequestUpdate` (`len`, indexing, slicing, iteration; each
/// item is built when accessed), with the same data as columns (`request_ids`, `indices`,
/// `token_ids`, `finish_reasons`, `num_cached_tokens`) for callers that read it in bulk.
#[pyclass(module = "pagedkv._core", name = "RequestUpdates", frozen, sequence)]
pub struct PyRequestUpdates {
    /// Request id of each update (never handed out: the getter copies it; the list is reused
    /// by later steps once this object is gone).
    request_ids: Py<PyList>,
    rows: Vec<RequestUpdate>,
}

impl PyRequestUpdates {
    fn item(&self, py: Python<'_>, i: usize) -> PyResult<Py<PyRequestUpdate>> {
        let u = &self.rows[i];
        let id = self.request_ids.bind(py).get_item(i)?.cast_into::<PyString>()?.unbind();
        Py::new(
            py,
            PyRequestUpdate {
                request_id: id,
                index: u.index,
                token: u.token,
                finish: u.finish_reason,
                num_cached_tokens: u.num_cached_tokens,
                parent: u.parent,
                cumulative_logprob: u.cumulative_logprob,
                logits_row: u.row,
            },
        )
    }
}

#[pymethods]
impl PyRequestUpdates {
    fn __len__(&self) -> usize {
        self.rows.len()
    }

    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        if let Ok(slice) = key.cast::<PySlice>() {
            let ix = slice.indices(self.rows.len() as isize)?;
            let mut items = Vec::with_capacity(ix.slicelength);
            let mut i = ix.start;
            for _ in 0..ix.slicelength {
                items.push(self.item(py, i as usize)?);
                i += ix.step;
            }
            return Ok(PyList::new(py, items)?.into_any().unbind());
        }
        let n = self.rows.len() as i64;
        let i = int_arg(key, "index")?;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!("update index {i} out of range for {n} updates")));
        }
        Ok(self.item(py, j as usize)?.into_any())
    }

    fn __iter__(slf: Bound<'_, Self>) -> PyRequestUpdatesIter {
        PyRequestUpdatesIter { updates: slf.unbind(), next: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// Request id of each update (a new list each time).
    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        let ids = self.request_ids.bind(py);
        ids.get_slice(0, ids.len())
    }

    /// Sample index (0 .. n) of each update.
    #[getter]
    fn indices(&self) -> Vec<u32> {
        self.rows.iter().map(|u| u.index).collect()
    }

    /// The token appended by each update.
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.rows.iter().map(|u| u.token).collect()
    }

    /// "stop", "length" or "abort" where the sample ended with the update's token, else None.
    #[getter]
    fn finish_reasons(&self) -> Vec<Option<&'static str>> {
        self.rows.iter().map(|u| u.finish_reason.map(FinishReason::as_str)).collect()
    }

    /// Prompt tokens served from the prefix cache at each update's request's first admission.
    #[getter]
    fn num_cached_tokens(&self) -> Vec<usize> {
        self.rows.iter().map(|u| u.num_cached_tokens).collect()
    }

    fn __repr__(&self) -> String {
        let ended = self.rows.iter().filter(|u| u.finish_reason.is_some()).count();
        format!("RequestUpdates(len={}, finished={ended})", self.rows.len())
    }
}

/// Iterator over a `RequestUpdates`.
#[pyclass(module = "pagedkv._core", name = "RequestUpdatesIterator", frozen)]
pub struct PyRequestUpdatesIter {
    updates: Py<PyRequestUpdates>,
    next: std::sync::atomic::AtomicUsize,
}

#[pymethods]
impl PyRequestUpdatesIter {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyRequestUpdate>>> {
        let ups = self.updates.get();
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if i >= ups.rows.len() {
            self.next.store(ups.rows.len(), std::sync::atomic::Ordering::Relaxed);
            return Ok(None);
        }
        ups.item(py, i).map(Some)
    }
}

/// `pagedkv.SchedulerStats` is the Rust struct itself (its fields are declared once, in
/// rust/scheduler/stats.rs); here only what is derived from them.
#[pymethods]
impl SchedulerStats {
    /// Prefix-cache hits / queries (first admissions only), 0 when nothing was queried.
    #[getter(prefix_cache_hit_rate)]
    fn py_prefix_cache_hit_rate(&self) -> f64 {
        self.prefix_cache_hit_rate()
    }

    /// All fields as a dict (and `prefix_cache_hit_rate`).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let mut result = Ok(());
        self.for_each_field(|name, v| {
            if result.is_ok() {
                result = match v {
                    StatValue::Count(c) => d.set_item(name, c),
                    StatValue::Fraction(f) => d.set_item(name, f),
                };
            }
        });
        result?;
        d.set_item("prefix_cache_hit_rate", self.prefix_cache_hit_rate())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(running={}, waiting={}, free_blocks={}/{}, kv_usage={:.3}, kv_utilization={:.3}, \
             preemptions={}, prefix_hits={}/{})",
            self.num_running,
            self.num_waiting,
            self.num_free_blocks,
            self.num_blocks,
            self.kv_usage,
            self.kv_utilization,
            self.num_preemptions,
            self.prefix_cache_hits,
            self.prefix_cache_queries
        )
    }
}

/// Interned request-id strings, indexed by request slot (checked by generation), so a step's
/// id lists reuse one Python string per request instead of creating new ones every step.
#[derive(Default)]
struct IdStrings {
    slots: Vec<Option<(u32, Py<PyString>)>>,
}

impl IdStrings {
    fn set(&mut self, key: RequestKey, s: Py<PyString>) {
        let i = key.slot as usize;
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some((key.generation, s));
    }

    /// The string of `key`, if cached.
    #[inline]
    fn get(&self, key: RequestKey) -> Option<&Py<PyString>> {
        match self.slots.get(key.slot as usize) {
            Some(Some((g, s))) if *g == key.generation => Some(s),
            _ => None,
        }
    }

    /// Caches the strings of `keys` not cached yet, from the scheduler's ids (every request
    /// is cached by `add_request`, so this is a fallback only).
    fn ensure(&mut self, py: Python<'_>, sched: &Scheduler, keys: impl IntoIterator<Item = RequestKey>) {
        for k in keys {
            if self.get(k).is_none() {
                let id = sched.request_id(k).map(|s| &**s).unwrap_or("");
                self.set(k, PyString::new(py, id).unbind());
            }
        }
    }

    /// The string of `key`, or `or` if not cached.
    #[inline]
    fn get_or<'a>(&'a self, key: RequestKey, or: &'a Py<PyString>) -> &'a Py<PyString> {
        self.get(key).unwrap_or(or)
    }
}

/// The Python objects reused from step to step (see `reuse`).
#[derive(Default)]
struct StepObjects {
    num_scheduled_tokens: ArrayRing<i32, Ix1>,
    input_ids: ArrayRing<i64, Ix1>,
    positions: ArrayRing<i64, Ix1>,
    cu_seqlens_q: ArrayRing<i32, Ix1>,
    seq_lens: ArrayRing<i32, Ix1>,
    block_tables: TableRing,
    slot_mapping: ArrayRing<i64, Ix1>,
    logits_indices: ArrayRing<i64, Ix1>,
    sample_indices: ArrayRing<i32, Ix1>,
    draft_offsets: ArrayRing<i32, Ix1>,
    beam_rows: ArrayRing<i64, Ix1>,
    copy_ops: ArrayRing<i32, Ix2>,
    swap_out: ArrayRing<i32, Ix2>,
    swap_in: ArrayRing<i32, Ix2>,
    disk_store: ArrayRing<i32, Ix2>,
    disk_load: ArrayRing<i32, Ix2>,
    req_ids: ListRing,
    sampled_req_ids: ListRing,
    update_ids: ListRing,
    /// Empty lists (preempted and finished ids and reasons are mostly empty).
    empty: EmptyLists,
}

/// Continuous-batching scheduler over a paged KV cache. Drive it once per step:
/// `out = schedule()`, run the model on `out`, `update(out, sampled_token_ids)`.
#[pyclass(module = "pagedkv._core", name = "Scheduler")]
pub struct PyScheduler {
    inner: Scheduler,
    config: Py<PySchedulerConfig>,
    names: IdStrings,
    /// The step arrays, refilled in place every step (never handed to Python: copied into the
    /// reused numpy arrays of `objects`, except the block tables, written row by row).
    step: StepOutput,
    objects: StepObjects,
    /// Stands for an id that is not cached (never in practice; see `IdStrings::ensure`).
    no_name: Py<PyString>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let cfg = object_arg::<PySchedulerConfig>(config, "Scheduler(config) needs a pagedkv.SchedulerConfig")?;
        let inner = Scheduler::new(cfg.get().inner.clone())?;
        Ok(PyScheduler {
            inner,
            config: cfg.clone().unbind(),
            names: IdStrings::default(),
            step: StepOutput::default(),
            objects: StepObjects::default(),
            no_name: PyString::intern(py, "").unbind(),
        })
    }

    /// The configuration.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PySchedulerConfig> {
        self.config.clone_ref(py)
    }

    /// Adds a request. Raises (changing nothing) on a duplicate id, an empty or too long
    /// prompt, invalid token ids or parameters. `wait_for` (names among "grammar",
    /// "remote_kv"): what it waits for before it may be scheduled; it is blocked (live, never
    /// scheduled, holding no block) until `unblock` lifts each. A request waiting for
    /// "remote_kv" is refused (DuplicateRequestError) while a reservation of its name is held.
    /// Without `wait_for` it is queued at once. The keyword form of `add`.
    #[pyo3(signature = (
        request_id, prompt_token_ids, *, max_tokens, min_tokens = None, eos_token_ids = None,
        stop_token_ids = None, ignore_eos = None, priority = None, cache_salt = None, n = None,
        retention_priority = None, retention_duration = None, retention_tokens = None, hold_kv = None,
        beam_width = None, length_penalty = None, skip_prefix_cache = None, speculate = None, wait_for = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request<'py>(
        &mut self,
        request_id: Bound<'py, PyAny>,
        prompt_token_ids: Bound<'py, PyAny>,
        max_tokens: Bound<'py, PyAny>,
        min_tokens: Option<Bound<'py, PyAny>>,
        eos_token_ids: Option<Bound<'py, PyAny>>,
        stop_token_ids: Option<Bound<'py, PyAny>>,
        ignore_eos: Option<Bound<'py, PyAny>>,
        priority: Option<Bound<'py, PyAny>>,
        cache_salt: Option<Bound<'py, PyAny>>,
        n: Option<Bound<'py, PyAny>>,
        retention_priority: Option<Bound<'py, PyAny>>,
        retention_duration: Option<Bound<'py, PyAny>>,
        retention_tokens: Option<Bound<'py, PyAny>>,
        hold_kv: Option<Bound<'py, PyAny>>,
        beam_width: Option<Bound<'py, PyAny>>,
        length_penalty: Option<Bound<'py, PyAny>>,
        skip_prefix_cache: Option<Bound<'py, PyAny>>,
        speculate: Option<Bound<'py, PyAny>>,
        wait_for: Option<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        self.add_fields(RequestFields {
            request_id, prompt_token_ids, max_tokens, min_tokens, eos_token_ids, stop_token_ids, ignore_eos, priority,
            cache_salt, n, retention_priority, retention_duration, retention_tokens, hold_kv, beam_width,
            length_penalty, skip_prefix_cache, speculate, wait_for,
        })
    }

    /// Adds `request`, an object with `add_request`'s argument names as attributes (the
    /// engine's `pagedkv.engine.admission.SchedulerRequest`): the same conversion and checks,
    /// the same typed errors. An object without one of the attributes is an
    /// InvalidArgumentError naming it.
    fn add(&mut self, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let fields = request
            .extract::<RequestFields<'_>>()
            .map_err(|e| invalid_argument(format!("add() needs a request with add_request's fields as attributes: {e}")))?;
        self.add_fields(fields)
    }

    /// Builds the next step.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let (inner, step) = (&mut self.inner, &mut self.step);
        py.detach(|| inner.schedule_rows(step))?;
        self.step_objects(py)
    }

    /// Applies one sampled token per logits row of `output` (int32/int64 array or list).
    /// Returns the updates (a sequence of RequestUpdate, one per sampled row of a live
    /// request). Raises, changing nothing, if `output` is not the step in flight or the tokens
    /// are malformed.
    ///
    /// A step with beam rows (`output.beam_rows`) needs their candidates: `beam_token_ids`
    /// and `beam_logprobs`, `[len(beam_rows), k]` (lists of rows, or 2-D arrays), each row a
    /// beam's candidate next tokens and their log-probabilities (at least `2 * beam_width` of
    /// them where the vocabulary allows). All beam decisions of the step are applied in this
    /// call; finished searches' results come from `take_beam_results()`.
    #[pyo3(signature = (output, sampled_token_ids, beam_token_ids = None, beam_logprobs = None))]
    fn update(
        &mut self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        sampled_token_ids: &Bound<'_, PyAny>,
        beam_token_ids: Option<&Bound<'_, PyAny>>,
        beam_logprobs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRequestUpdates> {
        let out = object_arg::<PySchedulerOutput>(output, "update() needs the SchedulerOutput returned by schedule()")?;
        let step_id = out.get().step_id;
        let tokens = token_ids_arg(sampled_token_ids, "sampled_token_ids")?;
        let (beam_tokens, beam_lps, k) = beam_candidates_arg(beam_token_ids, beam_logprobs)?;
        let inner = &mut self.inner;
        let cand = BeamCandidates { token_ids: &beam_tokens, logprobs: &beam_lps, k };
        let rows = py.detach(|| inner.update_with_beams(step_id, &tokens, cand))?;
        self.names.ensure(py, &self.inner, rows.iter().map(|u| u.request));
        let (names, no_name) = (&self.names, &self.no_name);
        let request_ids = self.objects.update_ids.fill(py, rows.iter().map(|u| names.get_or(u.request, no_name)))?;
        Ok(PyRequestUpdates { request_ids, rows })
    }

    /// The results of the beam searches that ended since the last call: `(request_id,
    /// [(token_ids, cumulative_logprob, score, finish_reason), ...])`, the hypotheses best
    /// first (`token_ids`: the generated tokens; `score`: the length-penalised one).
    #[allow(clippy::type_complexity)]
    fn take_beam_results(&mut self) -> Vec<(String, Vec<(Vec<u32>, f64, f64, &'static str)>)> {
        self.inner
            .take_beam_results()
            .into_iter()
            .map(|r| {
                let hyps = r.hypotheses.into_iter().map(|h| (h.tokens, h.cumulative_logprob, h.score, h.finish_reason.as_str())).collect();
                (r.id.to_string(), hyps)
            })
            .collect()
    }

    /// Undoes the step in flight (`output`) after its forward pass or sampling failed: its
    /// samples go back to the front of the waiting queue with only what was computed before
    /// the step, and the blocks the step registered leave the prefix cache. Returns the ids of
    /// the requests that had rows in the step. Raises StaleOutputError, changing nothing, if
    /// `output` is not the step in flight.
    fn rollback_step(&mut self, py: Python<'_>, output: &Bound<'_, PyAny>) -> PyResult<Vec<Py<PyString>>> {
        let out = object_arg::<PySchedulerOutput>(output, "rollback_step() needs the SchedulerOutput returned by schedule()")?;
        let ids = self.inner.rollback_step(out.get().step_id)?;
        Ok(ids.iter().map(|id| PyString::new(py, id).unbind()).collect())
    }

    /// Ends a request now, in any state (blocked, waiting, running, swapped), freeing its
    /// blocks; it is reported with reason "abort" in the next output's finished ids. Returns
    /// what it was still waiting for (e.g. `["grammar"]`; empty unless it was blocked), so
    /// the caller can drop what it holds for it. A reservation of its name is left to
    /// `commit_kv` / `cancel_kv`.
    fn abort_request(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
        let waited = self.inner.abort_request(str_obj_arg(request_id, "request_id")?.to_str()?)?;
        Ok(waited.iter().map(Wait::as_str).collect())
    }

    /// Lifts `what` ("grammar" or "remote_kv") of blocked request `request_id`. Returns True
    /// when it was the last reason: the request is now queued for scheduling. Raises
    /// UnknownRequestError for an unknown id, InvalidArgumentError for a request that does
    /// not wait for `what`.
    fn unblock(&mut self, request_id: &Bound<'_, PyAny>, what: &Bound<'_, PyAny>) -> PyResult<bool> {
        let what = Wait::parse(str_obj_arg(what, "what")?.to_str()?)?;
        Ok(self.inner.unblock(str_obj_arg(request_id, "request_id")?.to_str()?, what)?)
    }

    /// What live request `request_id` still waits for (empty once queued or running), None
    /// for an unknown id.
    fn waiting_for(&self, request_id: &Bound<'_, PyAny>) -> PyResult<Option<Vec<&'static str>>> {
        let id = str_obj_arg(request_id, "request_id")?.to_str()?;
        Ok(self.inner.waiting_for(id).map(|w| w.iter().map(Wait::as_str).collect()))
    }

    /// Ends one sample of a request with reason "stop" (e.g. a stop string matched), freeing
    /// its blocks; the request ends when its last sample does. Returns False if that sample had
    /// already ended.
    #[pyo3(signature = (request_id, index = None))]
    fn finish_sample(&mut self, request_id: &Bound<'_, PyAny>, index: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let index = index.map(|o| index_arg(o, "index")).transpose()?.unwrap_or(0);
        Ok(self.inner.finish_sample(str_obj_arg(request_id, "request_id")?.to_str()?, index)?)
    }

    /// True while any request is waiting or running.
    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Samples waiting for admission.
    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    /// Samples running.
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    /// A snapshot of the scheduler's counters and KV-cache state.
    fn stats(&self) -> SchedulerStats {
        self.inner.stats()
    }

    /// Speculative decoding's step-time model: `overhead_s` seconds per step plus
    /// `per_token_s` per token, as measured. A draft is verified only if its expected gain
    /// beats the tokens per second of a step without it (docs/engine.md, "Speculative
    /// decoding").
    fn set_spec_cost(&mut self, overhead_s: &Bound<'_, PyAny>, per_token_s: &Bound<'_, PyAny>) -> PyResult<()> {
        Ok(self.inner.set_spec_cost(float_arg(overhead_s, "overhead_s")?, float_arg(per_token_s, "per_token_s")?)?)
    }

    /// Hands in drafts for sample `index` of `request_id`, whose `num_tokens` tokens (prompt and
    /// output) they follow: the next step that schedules it verifies them (method
    /// "draft_model"). Returns False when nothing was kept (request gone or not running, or
    /// another method).
    fn set_drafts(&mut self, request_id: &Bound<'_, PyAny>, index: &Bound<'_, PyAny>, num_tokens: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<bool> {
        let drafts = token_ids_arg(token_ids, "token_ids")?;
        let id = str_obj_arg(request_id, "request_id")?;
        Ok(self.inner.set_drafts(id.to_str()?, index_arg(index, "index")?, count_arg(num_tokens, "num_tokens")?, &drafts)?)
    }

    /// How many drafts the cost model would verify for a sample in a step with the samples
    /// running now (method "draft_model": the draft model drafts no more; 0 when off).
    fn spec_drafts_worth(&self) -> usize {
        self.inner.spec_drafts_worth()
    }

    /// Drafts accepted so far by position within a row's drafts (entry j: accepted
    /// (j+1)-th drafts), vLLM's `num_accepted_tokens_per_pos`.
    fn spec_accepted_per_position(&self) -> Vec<u64> {
        self.inner.spec_accepted_per_position().to_vec()
    }

    /// Sets the `auto` preemption cost model from measurements: the copy bandwidth between
    /// the tiers (bytes/s), the forward throughput when recomputing (tokens/s) and the bytes
    /// of one block. Swapping a victim is chosen when copying its blocks out and back is
    /// cheaper than recomputing its tokens.
    fn set_cost_model(
        &mut self,
        swap_bytes_per_second: &Bound<'_, PyAny>,
        recompute_tokens_per_second: &Bound<'_, PyAny>,
        bytes_per_block: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        Ok(self.inner.set_cost_model(
            float_arg(swap_bytes_per_second, "swap_bytes_per_second")?,
            float_arg(recompute_tokens_per_second, "recompute_tokens_per_second")?,
            count_arg(bytes_per_block, "bytes_per_block")?,
        )?)
    }

    /// A step with no rows that copies cached blocks one tier down (device → host, host →
    /// disk) where the lower tier lacks them; run it and `update(out, [])`. Repeat until it
    /// plans no copy to leave the disk tier holding what the tiers cache (before shutdown).
    fn schedule_flush(&mut self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let (inner, step) = (&mut self.inner, &mut self.step);
        py.detach(|| inner.schedule_flush_into(step))?;
        self.step_objects(py)
    }

    /// What each disk slot in `slots` holds, for its file: `(hash, parent_hash, token_ids,
    /// cache_salt, KV cache group)` with the hashes as 16 little-endian bytes (`parent_hash` None for a
    /// first block) and `KV cache group` the KV cache group the block belongs to (0 without KV cache
    /// groups), or None for a slot that holds nothing cached.
    #[allow(clippy::type_complexity)]
    fn disk_block_info<'py>(
        &self,
        py: Python<'py>,
        slots: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Option<(Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>, Vec<u32>, Option<String>, u32)>>> {
        let slots = int_list_arg(slots, "slots")?;
        Ok(slots
            .into_iter()
            .map(|s| {
                let info = u32::try_from(s).ok().and_then(|s| self.inner.disk_block_info(s))?;
                let (hash, parent, tokens, salt, group) = info;
                Some((
                    PyBytes::new(py, &hash.0.to_le_bytes()),
                    parent.map(|p| PyBytes::new(py, &p.0.to_le_bytes())),
                    tokens,
                    salt,
                    group,
                ))
            })
            .collect())
    }

    /// Restores disk entries written by an earlier process, each `(hash, parent_hash,
    /// token_ids, cache_salt, KV cache group)` as `disk_block_info` gives them, in any order. Each
    /// block's hash is recomputed from its parent's, its tokens and its KV cache group's key and must
    /// match; an entry whose parent is not restored, or whose KV cache group this pool does not have,
    /// is left out. Returns the slot each entry now occupies (its file
    /// must be renamed to it), or None.
    #[allow(clippy::type_complexity)]
    fn restore_disk_blocks(&mut self, entries: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u32>>> {
        let mut parsed = Vec::new();
        let items = entries.try_iter().map_err(|_| {
            super::errors::invalid_type(format!(
                "restore_disk_blocks() takes an iterable of (hash, parent_hash, token_ids, cache_salt, kv_group) tuples, got {}",
                entries.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?;
        for item in items {
            let item = item?;
            #[allow(clippy::type_complexity)]
            let (hash, parent, tokens, salt, group): (
                Vec<u8>,
                Option<Vec<u8>>,
                Bound<'_, PyAny>,
                Option<Bound<'_, PyAny>>,
                u32,
            ) = item.extract().map_err(|_| {
                crate::error::CoreError::InvalidArgument(
                    "restore_disk_blocks() takes (hash bytes, parent_hash bytes or None, token ids, salt or None, \
                     kv_group int >= 0) tuples"
                        .into(),
                )
            })?;
            let hash = hash_bytes(&hash)?;
            let parent = parent.map(|p| hash_bytes(&p)).transpose()?;
            parsed.push((hash, parent, token_ids_arg(&tokens, "token_ids")?, salt_arg(salt.as_ref())?, group));
        }
        Ok(self.inner.restore_disk_blocks(&parsed))
    }

    /// Forgets disk slots whose files could not be written or read: they are never served.
    fn invalidate_disk_blocks(&mut self, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let slots: Vec<u32> = int_list_arg(slots, "slots")?.into_iter().filter_map(|s| u32::try_from(s).ok()).collect();
        self.inner.invalidate_disk_blocks(&slots);
        Ok(())
    }

    /// Moves the retention clock forward by `seconds` (tests and simulations: retention
    /// durations expire without waiting).
    fn advance_clock(&mut self, seconds: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = float_arg(seconds, "seconds")?;
        if !(s.is_finite() && s >= 0.0) {
            return Err(crate::error::CoreError::InvalidArgument(format!("seconds must be finite and >= 0, got {s}")).into());
        }
        self.inner.advance_clock((s * 1e6) as u64);
        Ok(())
    }

    /// The tiers block by block: `(on_host bool[N], host_ref_counts int32[H], host_cached
    /// bool[H])` — for each device block whether its cached content is also resident on the
    /// host, and the host pool's ref counts and cache flags (H = 0 without a host tier).
    #[allow(clippy::type_complexity)]
    fn tier_map<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<bool>>, Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<bool>>) {
        let (on_host, refs, cached) = self.inner.tier_map();
        (PyArray1::from_vec(py, on_host), PyArray1::from_vec(py, refs), PyArray1::from_vec(py, cached))
    }

    /// The KV-cache events since the last call as one msgpack batch in vLLM's wire format
    /// (`[timestamp, [event, ...]]`; events BlockStored / BlockRemoved / AllBlocksCleared with
    /// medium "GPU" for the device pool, "CPU" for the host tier, "DISK" for the disk tier),
    /// or None when events are off (`SchedulerConfig(enable_kv_events=True)`) or nothing
    /// happened. Call it once per step, after `update` or `rollback_step`; events are kept
    /// until taken. `timestamp` is seconds (e.g. `time.time()`), finite.
    fn take_kv_events<'py>(&mut self, py: Python<'py>, timestamp: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let ts = float_arg(timestamp, "timestamp")?;
        if !ts.is_finite() {
            return Err(crate::error::CoreError::InvalidArgument(format!("timestamp must be finite, got {ts}")).into());
        }
        Ok(self.inner.take_kv_events(ts).map(|b| PyBytes::new(py, &b)))
    }

    /// Drops every free cached block from the prefix cache on every tier; blocks in use stay
    /// cached. Returns how many were dropped. With KV events on, a reset that leaves nothing
    /// cached is announced as one AllBlocksCleared event.
    fn reset_prefix_cache(&mut self) -> usize {
        self.inner.reset_prefix_cache()
    }

    /// The hashes KV events give the full blocks of `token_ids` under `cache_salt` (what a
    /// KV-aware router computes for a prompt): one unsigned 64-bit int per full block.
    #[pyo3(signature = (token_ids, cache_salt = None))]
    fn block_hashes(&self, token_ids: &Bound<'_, PyAny>, cache_salt: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u64>> {
        let tokens = token_ids_arg(token_ids, "token_ids")?;
        let salt = salt_arg(cache_salt)?;
        Ok(self.inner.block_hashes(&tokens, salt.as_deref()))
    }

    /// The KV lease of ended request `request_id` (added with `hold_kv=True`): `(block_ids,
    /// num_tokens)` — the blocks it held, in order, and how many leading tokens' KV they hold
    /// (the first `num_tokens // block_size` blocks of each KV cache group are full) — or None if
    /// there is none. With KV cache groups the ids are every KV cache group's table, group-major:
    /// KV cache group 0's `n` blocks, then KV cache group 1's `n`, ... (`len(block_ids) == num_kv_groups * n`).
    fn kv_lease(&self, request_id: &Bound<'_, PyAny>) -> PyResult<Option<(Vec<u32>, usize)>> {
        Ok(self.inner.kv_lease(str_obj_arg(request_id, "request_id")?.to_str()?))
    }

    /// Ends the KV lease of `request_id`, freeing its blocks (cached ones stay findable).
    /// Returns False if there was none (already released, or never taken).
    fn release_kv_lease(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.release_kv_lease(str_obj_arg(request_id, "request_id")?.to_str()?))
    }

    /// The request ids whose KV leases are held.
    fn kv_lease_ids(&self) -> Vec<String> {
        self.inner.kv_lease_ids().iter().map(|s| s.to_string()).collect()
    }

    /// Reserves device blocks for KV of `prompt_token_ids`' first `max_blocks` full blocks
    /// arriving from another engine (at most `(len - 1) // block_size`, so the last token is
    /// computed here), under `cache_salt`. Returns `(num_hit_blocks, block_ids)`: the leading
    /// blocks already cached here (shared, not to be transferred) and the fresh blocks that
    /// receive blocks `num_hit_blocks, num_hit_blocks + 1, ...` — or None when the pool has no
    /// room now. With KV cache groups the hits are the same in every KV cache group and the fresh
    /// blocks are every KV cache group's, group-major (`len(block_ids) // num_kv_groups` per KV cache group).
    /// End it with `commit_kv` (the KV arrived) or `cancel_kv`.
    #[pyo3(signature = (reservation_id, prompt_token_ids, max_blocks, cache_salt = None))]
    fn reserve_kv(
        &mut self,
        reservation_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_blocks: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<(usize, Vec<u32>)>> {
        let id = str_obj_arg(reservation_id, "reservation_id")?.to_str()?.to_string();
        let prompt = token_ids_arg(prompt_token_ids, "prompt_token_ids")?;
        let max_blocks = count_arg(max_blocks, "max_blocks")?;
        let salt = salt_arg(cache_salt)?;
        Ok(self.inner.reserve_kv(&id, prompt, max_blocks, salt.as_deref())?)
    }

    /// Ends reservation `reservation_id` once its KV arrived: its blocks enter the prefix
    /// cache (a request for the prompt added now hits them). False for an unknown name.
    fn commit_kv(&mut self, reservation_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.commit_kv(str_obj_arg(reservation_id, "reservation_id")?.to_str()?))
    }

    /// Ends reservation `reservation_id` without its KV: the reserved blocks are freed
    /// uncached. False for an unknown name.
    fn cancel_kv(&mut self, reservation_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.cancel_kv(str_obj_arg(reservation_id, "reservation_id")?.to_str()?))
    }

    /// The disk tier slot by slot: `(ref_counts int32[D], cached bool[D])`, D = 0 without one.
    #[allow(clippy::type_complexity)]
    fn disk_map<'py>(&self, py: Python<'py>) -> (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<bool>>) {
        let (refs, cached) = self.inner.disk_map();
        (PyArray1::from_vec(py, refs), PyArray1::from_vec(py, cached))
    }

    /// One summary per live request, in arrival order: `(request_id, arrival, state,
    /// prompt_tokens, output_tokens, num_blocks, cached_tokens, num_samples)` with `state`
    /// "running", "swapped" or "waiting", `arrival` what `memory_map`'s owners name, and
    /// `num_blocks` the distinct device blocks its samples hold. No token ids.
    #[allow(clippy::type_complexity)]
    fn request_summaries(&self) -> Vec<(String, u64, &'static str, usize, usize, usize, usize, usize)> {
        self.inner
            .request_summaries()
            .into_iter()
            .map(|r| {
                (
                    r.id.to_string(),
                    r.arrival,
                    r.state,
                    r.prompt_tokens,
                    r.output_tokens,
                    r.num_blocks,
                    r.cached_tokens,
                    r.num_samples,
                )
            })
            .collect()
    }

    /// Raises InvariantViolationError if any bookkeeping is inconsistent.
    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    /// The pool block by block: `(ref_counts int32[N], cached bool[N], owner int64[N])`, where
    /// `owner` is the arrival number (0, 1, ... in add_request order) of the earliest-arrived
    /// running request holding the block, or -1 for a free block.
    #[allow(clippy::type_complexity)]
    fn memory_map<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<bool>>, Bound<'py, PyArray1<i64>>) {
        let (refs, cached, owner) = self.inner.memory_map();
        (PyArray1::from_vec(py, refs), PyArray1::from_vec(py, cached), PyArray1::from_vec(py, owner))
    }

    /// int16[num_blocks]: the KV cache group each device block serves (the KV cache group of the
    /// block table holding it, or, free, the one it is cached for), -1 for a free block with no
    /// cached identity. For a live view of KV cache groups.
    fn block_kv_groups<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i16>> {
        PyArray1::from_vec(py, self.inner.block_kv_groups())
    }

    fn __repr__(&self) -> String {
        format!(
            "Scheduler(running={}, waiting={}, requests={})",
            self.inner.num_running(),
            self.inner.num_waiting(),
            self.inner.num_requests()
        )
    }
}

impl PyScheduler {
    /// The Python output of the step just scheduled into `self.step` (arrays and lists reused
    /// where possible, block tables written row by row).
    fn step_objects(&mut self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let out = &self.step;
        let o = &mut self.objects;
        let (rows, t, s, k) = (out.num_rows(), out.num_tokens(), out.num_sampled(), out.copy_ops.len() / 2);
        let (k_out, k_in) = (out.swap_out.len() / 2, out.swap_in.len() / 2);
        let (k_store, k_load) = (out.disk_store.len() / 2, out.disk_load.len() / 2);
        self.names.ensure(py, &self.inner, out.row_requests.iter().chain(&out.sampled_requests).copied());
        let (names, no_name) = (&self.names, &self.no_name);
        let req_ids = o.req_ids.fill(py, out.row_requests.iter().map(|&k| names.get_or(k, no_name)))?;
        let sampled = o.sampled_req_ids.fill(py, out.sampled_requests.iter().map(|&k| names.get_or(k, no_name)))?;
        let preempted = if out.preempted_req_ids.is_empty() {
            o.empty.get(py)?
        } else {
            PyList::new(py, out.preempted_req_ids.iter().map(|id| PyString::new(py, id)))?.unbind()
        };
        let (finished, reasons) = if out.finished.is_empty() {
            (o.empty.get(py)?, o.empty.get(py)?)
        } else {
            (
                PyList::new(py, out.finished.iter().map(|(id, _)| PyString::new(py, id)))?.unbind(),
                PyList::new(py, out.finished.iter().map(|(_, r)| r.as_str()))?.unbind(),
            )
        };
        Ok(PySchedulerOutput {
            step_id: out.step_id,
            num_tokens: t,
            req_ids,
            num_scheduled_tokens: o.num_scheduled_tokens.fill(py, Ix1(rows), &out.num_scheduled_tokens)?,
            input_ids: o.input_ids.fill(py, Ix1(t), &out.input_ids)?,
            positions: o.positions.fill(py, Ix1(t), &out.positions)?,
            cu_seqlens_q: o.cu_seqlens_q.fill(py, Ix1(rows + 1), &out.cu_seqlens_q)?,
            seq_lens: o.seq_lens.fill(py, Ix1(rows), &out.seq_lens)?,
            block_tables: o.block_tables.fill(py, &self.inner, out)?,
            slot_mapping: o.slot_mapping.fill(py, Ix1(out.num_kv_groups * t), &out.slot_mapping)?,
            num_kv_groups: out.num_kv_groups,
            logits_indices: o.logits_indices.fill(py, Ix1(s), &out.logits_indices)?,
            sampled_req_ids: sampled,
            sample_indices: o.sample_indices.fill(py, Ix1(s), &out.sample_indices)?,
            draft_offsets: o.draft_offsets.fill(py, Ix1(s), &out.draft_offsets)?,
            beam_rows: o.beam_rows.fill(py, Ix1(out.beam_rows.len()), &out.beam_rows)?,
            copy_ops: o.copy_ops.fill(py, Ix2(k, 2), &out.copy_ops)?,
            swap_out: o.swap_out.fill(py, Ix2(k_out, 2), &out.swap_out)?,
            swap_in: o.swap_in.fill(py, Ix2(k_in, 2), &out.swap_in)?,
            disk_store: o.disk_store.fill(py, Ix2(k_store, 2), &out.disk_store)?,
            disk_load: o.disk_load.fill(py, Ix2(k_load, 2), &out.disk_load)?,
            preempted_req_ids: preempted,
            finished_req_ids: finished,
            finish_reasons: reasons,
        })
    }
}

/// A block hash from its 16 little-endian bytes.
fn hash_bytes(b: &[u8]) -> PyResult<crate::block_hash::BlockHash> {
    let arr: [u8; 16] = b
        .try_into()
        .map_err(|_| crate::error::CoreError::InvalidArgument(format!("a block hash is 16 bytes, got {}", b.len())))?;
    Ok(crate::block_hash::BlockHash(u128::from_le_bytes(arr)))
}

/// `block_hashes(token_ids, block_size, cache_salt=None)`: the hashes KV events give the full
/// blocks of `token_ids` in an engine with `block_size`-token blocks, under `cache_salt`: one
/// unsigned 64-bit int per full block (what a KV-aware router computes for a prompt, without
/// an engine or a scheduler). `Scheduler.block_hashes` is the same for its own block size.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, cache_salt = None))]
pub fn block_hashes(
    token_ids: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    cache_salt: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    let bs = positive_arg(block_size, "block_size")?;
    crate::scheduler::field("block_size").map_or(Ok(()), |f| f.check_int(bs as i64))?;
    let tokens = token_ids_arg(token_ids, "token_ids")?;
    let salt = salt_arg(cache_salt)?;
    Ok(crate::kv_events::wire_block_hashes(&tokens, bs, salt.as_deref(), crate::block_hash::HashMode::Xxh3))
}


/// A new request's fields as Python hands them over, unconverted: `Scheduler.add_request`'s
/// keyword arguments, or the attributes of the object `Scheduler.add` takes. One conversion
/// (`Scheduler::add_fields`) turns them into the core's `NewRequest`.
#[derive(FromPyObject)]
struct RequestFields<'py> {
    request_id: Bound<'py, PyAny>,
    prompt_token_ids: Bound<'py, PyAny>,
    max_tokens: Bound<'py, PyAny>,
    min_tokens: Option<Bound<'py, PyAny>>,
    eos_token_ids: Option<Bound<'py, PyAny>>,
    stop_token_ids: Option<Bound<'py, PyAny>>,
    ignore_eos: Option<Bound<'py, PyAny>>,
    priority: Option<Bound<'py, PyAny>>,
    cache_salt: Option<Bound<'py, PyAny>>,
    n: Option<Bound<'py, PyAny>>,
    retention_priority: Option<Bound<'py, PyAny>>,
    retention_duration: Option<Bound<'py, PyAny>>,
    retention_tokens: Option<Bound<'py, PyAny>>,
    hold_kv: Option<Bound<'py, PyAny>>,
    beam_width: Option<Bound<'py, PyAny>>,
    length_penalty: Option<Bound<'py, PyAny>>,
    skip_prefix_cache: Option<Bound<'py, PyAny>>,
    speculate: Option<Bound<'py, PyAny>>,
    wait_for: Option<Bound<'py, PyAny>>,
}

/// A field that was given: present and not None.
fn given<'py>(o: &Option<Bound<'py, PyAny>>) -> Option<Bound<'py, PyAny>> {
    o.as_ref().filter(|o| !o.is_none()).cloned()
}

impl PyScheduler {
    /// Converts and checks a new request's fields (each error names its field) and adds it.
    fn add_fields(&mut self, f: RequestFields<'_>) -> PyResult<()> {
        let id_str = str_obj_arg(&f.request_id, "request_id")?.clone();
        let opt_ids = |o: &Option<Bound<'_, PyAny>>, name: &str| -> PyResult<Vec<u32>> {
            match given(o) {
                Some(o) => token_ids_arg(&o, name),
                None => Ok(Vec::new()),
            }
        };
        let flag = |o: &Option<Bound<'_, PyAny>>, name: &str, default: bool| -> PyResult<bool> {
            given(o).map(|o| bool_arg(&o, name)).transpose().map(|v| v.unwrap_or(default))
        };
        let req = NewRequest {
            id: id_str.to_str()?.to_string(),
            prompt: token_ids_arg(&f.prompt_token_ids, "prompt_token_ids")?,
            n: given(&f.n).map(|o| count_arg(&o, "n")).transpose()?.unwrap_or(1),
            max_tokens: count_arg(&f.max_tokens, "max_tokens")?,
            min_tokens: given(&f.min_tokens).map(|o| count_arg(&o, "min_tokens")).transpose()?.unwrap_or(0),
            eos_token_ids: opt_ids(&f.eos_token_ids, "eos_token_ids")?,
            stop_token_ids: opt_ids(&f.stop_token_ids, "stop_token_ids")?,
            ignore_eos: flag(&f.ignore_eos, "ignore_eos", false)?,
            priority: given(&f.priority).map(|o| int_arg(&o, "priority")).transpose()?.unwrap_or(0),
            cache_salt: salt_arg(given(&f.cache_salt).as_ref())?,
            retention: retention_arg(f.retention_priority.as_ref(), f.retention_duration.as_ref(), f.retention_tokens.as_ref())?,
            hold_kv: flag(&f.hold_kv, "hold_kv", false)?,
            beam: beam_arg(f.beam_width.as_ref(), f.length_penalty.as_ref())?,
            skip_prefix_cache: flag(&f.skip_prefix_cache, "skip_prefix_cache", false)?,
            speculate: flag(&f.speculate, "speculate", true)?,
            wait_for: given(&f.wait_for).map(|o| wait_set_arg(&o)).transpose()?.unwrap_or_default(),
        };
        let key = self.inner.add_request(req)?;
        self.names.set(key, id_str.unbind());
        Ok(())
    }
}
