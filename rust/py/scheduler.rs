//! `pagedkv.SchedulerConfig`, `pagedkv.Scheduler`, and the objects a step produces:
//! `SchedulerOutput` (numpy arrays built in Rust, adopted by torch without a copy),
//! `RequestUpdate` and `SchedulerStats`.

use numpy::{PyArray1, PyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use super::allocator::hash_mode_arg;
use super::args::{bool_arg, check_token_ids, count_arg, int_arg, int_list_arg, salt_arg, token_ids_arg};
use super::errors::invalid_type;
use super::manager::array2_i32;
use crate::error::CoreError;
use crate::scheduler::{
    FinishReason, NewRequest, Policy, RequestKey, RequestUpdate, Scheduler, SchedulerConfig, SchedulerStats,
    StepOutput,
};

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
        max_model_len = None, enable_prefix_caching = None, policy = None, watermark = None, hash_bits = None
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
    ) -> PyResult<Self> {
        let positive = |o: &Bound<'_, PyAny>, name: &str| -> PyResult<usize> {
            let v = int_arg(o, name)?;
            if v <= 0 {
                return Err(CoreError::Config(format!("{name} must be >= 1, got {v}")).into());
            }
            Ok(v as usize)
        };
        let bs = block_size.map(|o| positive(o, "block_size")).transpose()?.unwrap_or(16);
        let mut c = SchedulerConfig::new(bs, positive(num_blocks, "num_blocks")?);
        if let Some(o) = max_num_seqs {
            c.max_num_seqs = positive(o, "max_num_seqs")?;
        }
        if let Some(o) = max_num_batched_tokens {
            c.max_num_batched_tokens = positive(o, "max_num_batched_tokens")?;
        }
        if let Some(o) = max_model_len.filter(|o| !o.is_none()) {
            c.max_model_len = positive(o, "max_model_len")?;
        }
        if let Some(o) = enable_prefix_caching {
            c.enable_prefix_caching = bool_arg(o, "enable_prefix_caching")?;
        }
        if let Some(o) = policy {
            let s: String = o.extract().map_err(|_| invalid_type("policy must be a str"))?;
            c.policy = Policy::parse(&s)?;
        }
        if let Some(o) = watermark {
            c.watermark = o.extract::<f64>().map_err(|_| invalid_type("watermark must be a float"))?;
        }
        if let Some(o) = hash_bits {
            c.hash_mode = hash_mode_arg(o)?;
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

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(num_blocks={}, block_size={}, max_num_seqs={}, max_num_batched_tokens={}, \
             max_model_len={}, enable_prefix_caching={}, policy={:?}, watermark={})",
            c.num_blocks,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.max_model_len,
            if c.enable_prefix_caching { "True" } else { "False" },
            c.policy.name(),
            c.watermark
        )
    }
}

/// One step to execute: flat numpy arrays in batch order (see DESIGN.md, "Step output").
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
    #[pyo3(get)]
    logits_indices: Py<PyArray1<i64>>,
    #[pyo3(get)]
    sampled_req_ids: Py<PyList>,
    #[pyo3(get)]
    sample_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    copy_ops: Py<PyArray2<i32>>,
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

/// The effect of one sampled token on one request branch.
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
}

#[pymethods]
impl PyRequestUpdate {
    /// The new token ids (one per step).
    #[getter]
    fn new_token_ids(&self) -> Vec<u32> {
        vec![self.token]
    }

    /// "stop", "length" or "abort" when the branch ended with this token, else None.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.finish.map(FinishReason::as_str)
    }

    /// True when the branch ended with this token.
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

/// A snapshot of the scheduler's state and counters.
#[pyclass(module = "pagedkv._core", name = "SchedulerStats", frozen, get_all)]
pub struct PySchedulerStats {
    num_blocks: usize,
    num_free_blocks: usize,
    num_used_blocks: usize,
    num_cached_blocks: usize,
    kv_usage: f64,
    kv_utilization: f64,
    tokens_held: usize,
    slots_allocated: usize,
    num_running: usize,
    num_waiting: usize,
    num_preemptions: u64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    resumed_prefix_queries: u64,
    resumed_prefix_hits: u64,
    num_steps: u64,
    num_finished_stop: u64,
    num_finished_length: u64,
    num_aborted: u64,
    num_evictions: u64,
}

impl From<SchedulerStats> for PySchedulerStats {
    fn from(s: SchedulerStats) -> Self {
        PySchedulerStats {
            num_blocks: s.num_blocks,
            num_free_blocks: s.num_free_blocks,
            num_used_blocks: s.num_used_blocks,
            num_cached_blocks: s.num_cached_blocks,
            kv_usage: s.kv_usage,
            kv_utilization: s.kv_utilization,
            tokens_held: s.tokens_held,
            slots_allocated: s.slots_allocated,
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_preemptions: s.num_preemptions,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            resumed_prefix_queries: s.resumed_prefix_queries,
            resumed_prefix_hits: s.resumed_prefix_hits,
            num_steps: s.num_steps,
            num_finished_stop: s.num_finished_stop,
            num_finished_length: s.num_finished_length,
            num_aborted: s.num_aborted,
            num_evictions: s.num_evictions,
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    /// Prefix-cache hits / queries (first admissions only), 0 when nothing was queried.
    #[getter]
    fn prefix_cache_hit_rate(&self) -> f64 {
        if self.prefix_cache_queries == 0 {
            0.0
        } else {
            self.prefix_cache_hits as f64 / self.prefix_cache_queries as f64
        }
    }

    /// All fields as a dict.
    fn as_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let py = slf.py();
        let s = slf.get();
        let d = PyDict::new(py);
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("num_used_blocks", s.num_used_blocks)?;
        d.set_item("num_cached_blocks", s.num_cached_blocks)?;
        d.set_item("kv_usage", s.kv_usage)?;
        d.set_item("kv_utilization", s.kv_utilization)?;
        d.set_item("tokens_held", s.tokens_held)?;
        d.set_item("slots_allocated", s.slots_allocated)?;
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("prefix_cache_hit_rate", s.prefix_cache_hit_rate())?;
        d.set_item("resumed_prefix_queries", s.resumed_prefix_queries)?;
        d.set_item("resumed_prefix_hits", s.resumed_prefix_hits)?;
        d.set_item("num_steps", s.num_steps)?;
        d.set_item("num_finished_stop", s.num_finished_stop)?;
        d.set_item("num_finished_length", s.num_finished_length)?;
        d.set_item("num_aborted", s.num_aborted)?;
        d.set_item("num_evictions", s.num_evictions)?;
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

    /// The string for `key`, or a new one from `fallback` (the id itself) when not cached.
    fn get<'py>(&self, py: Python<'py>, key: RequestKey, fallback: Option<&str>) -> Bound<'py, PyString> {
        match self.slots.get(key.slot as usize) {
            Some(Some((g, s))) if *g == key.generation => s.bind(py).clone(),
            _ => PyString::new(py, fallback.unwrap_or("")),
        }
    }
}

/// Continuous-batching scheduler over a paged KV cache. Drive it once per step:
/// `out = schedule()`, run the model on `out`, `update(out, sampled_token_ids)`.
#[pyclass(module = "pagedkv._core", name = "Scheduler")]
pub struct PyScheduler {
    inner: Scheduler,
    config: Py<PySchedulerConfig>,
    names: IdStrings,
}

fn str_list<'py>(py: Python<'py>, ids: impl IntoIterator<Item = Bound<'py, PyString>>) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ids)
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let cfg = config
            .cast::<PySchedulerConfig>()
            .map_err(|_| invalid_type("Scheduler(config) needs a pagedkv.SchedulerConfig"))?;
        let inner = Scheduler::new(cfg.get().inner.clone())?;
        Ok(PyScheduler { inner, config: cfg.clone().unbind(), names: IdStrings::default() })
    }

    /// The configuration.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PySchedulerConfig> {
        self.config.clone_ref(py)
    }

    /// Queues a request. Raises (changing nothing) on a duplicate id, an empty or too long
    /// prompt, invalid token ids or parameters.
    #[pyo3(signature = (
        request_id, prompt_token_ids, *, max_tokens, min_tokens = None, eos_token_ids = None,
        stop_token_ids = None, ignore_eos = None, priority = None, cache_salt = None, n = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        min_tokens: Option<&Bound<'_, PyAny>>,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        n: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let id_str = request_id
            .cast::<PyString>()
            .map_err(|_| invalid_type("request_id must be a str"))?
            .clone();
        let opt_ids = |o: Option<&Bound<'_, PyAny>>, name: &str| -> PyResult<Vec<u32>> {
            match o {
                Some(o) if !o.is_none() => token_ids_arg(o, name),
                _ => Ok(Vec::new()),
            }
        };
        let req = NewRequest {
            id: id_str.to_str()?.to_string(),
            prompt: token_ids_arg(prompt_token_ids, "prompt_token_ids")?,
            n: n.map(|o| count_arg(o, "n")).transpose()?.unwrap_or(1),
            max_tokens: count_arg(max_tokens, "max_tokens")?,
            min_tokens: min_tokens.map(|o| count_arg(o, "min_tokens")).transpose()?.unwrap_or(0),
            eos_token_ids: opt_ids(eos_token_ids, "eos_token_ids")?,
            stop_token_ids: opt_ids(stop_token_ids, "stop_token_ids")?,
            ignore_eos: ignore_eos.map(|o| bool_arg(o, "ignore_eos")).transpose()?.unwrap_or(false),
            priority: priority.map(|o| int_arg(o, "priority")).transpose()?.unwrap_or(0),
            cache_salt: salt_arg(cache_salt)?,
        };
        let key = self.inner.add_request(req)?;
        self.names.set(key, id_str.unbind());
        Ok(())
    }

    /// Builds the next step.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let inner = &mut self.inner;
        let out = py.detach(|| inner.schedule())?;
        self.to_python(py, out)
    }

    /// Applies one sampled token per logits row of `output` (int32/int64 array or list).
    /// Returns one RequestUpdate per sampled row of a live request. Raises, changing nothing,
    /// if `output` is not the step in flight or the tokens are malformed.
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        output: &Bound<'py, PyAny>,
        sampled_token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = output
            .cast::<PySchedulerOutput>()
            .map_err(|_| invalid_type("update() needs the SchedulerOutput returned by schedule()"))?;
        let step_id = out.get().step_id;
        let tokens = check_token_ids(&int_list_arg(sampled_token_ids, "sampled_token_ids")?)?;
        let inner = &mut self.inner;
        let updates = py.detach(|| inner.update(step_id, &tokens))?;
        let items = updates
            .into_iter()
            .map(|u| self.update_object(py, u))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Ends a request now, freeing its blocks; it is reported with reason "abort" in the
    /// next output's finished ids.
    fn abort_request(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id: String = request_id.extract().map_err(|_| invalid_type("request_id must be a str"))?;
        Ok(self.inner.abort_request(&id)?)
    }

    /// Ends one sample of a request with reason "stop" (e.g. a stop string matched), freeing
    /// its blocks; the request ends when its last sample does. Returns False if that sample had
    /// already ended.
    #[pyo3(signature = (request_id, index = None))]
    fn finish_sample(&mut self, request_id: &Bound<'_, PyAny>, index: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let id: String = request_id.extract().map_err(|_| invalid_type("request_id must be a str"))?;
        let index = index.map(|o| count_arg(o, "index")).transpose()?.unwrap_or(0);
        let index = u32::try_from(index).map_err(|_| CoreError::InvalidArgument(format!("index {index} is out of range")))?;
        Ok(self.inner.finish_sample(&id, index)?)
    }

    /// True while any request is waiting or running.
    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Branches waiting for admission.
    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    /// Branches running.
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    /// A snapshot of the scheduler's counters and KV-cache state.
    fn stats(&self) -> PySchedulerStats {
        self.inner.stats().into()
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
    fn update_object(&self, py: Python<'_>, u: RequestUpdate) -> PyResult<Py<PyRequestUpdate>> {
        Py::new(
            py,
            PyRequestUpdate {
                request_id: self.names.get(py, u.request, Some(&u.request_id)).unbind(),
                index: u.index,
                token: u.token,
                finish: u.finish_reason,
                num_cached_tokens: u.num_cached_tokens,
            },
        )
    }

    fn to_python(&self, py: Python<'_>, out: StepOutput) -> PyResult<PySchedulerOutput> {
        let rows = out.num_rows();
        let k = out.copy_ops.len() / 2;
        let name = |key: RequestKey| self.names.get(py, key, self.inner.request_id(key).map(|s| &**s));
        let req_ids = str_list(py, out.row_requests.iter().map(|&key| name(key)))?;
        let sampled = str_list(py, out.sampled_requests.iter().map(|&key| name(key)))?;
        let preempted = str_list(py, out.preempted_req_ids.iter().map(|id| PyString::new(py, id)))?;
        let finished = str_list(py, out.finished.iter().map(|(id, _)| PyString::new(py, id)))?;
        let reasons = PyList::new(py, out.finished.iter().map(|(_, r)| r.as_str()))?;
        Ok(PySchedulerOutput {
            step_id: out.step_id,
            num_tokens: out.input_ids.len(),
            req_ids: req_ids.unbind(),
            num_scheduled_tokens: PyArray1::from_vec(py, out.num_scheduled_tokens).unbind(),
            input_ids: PyArray1::from_vec(py, out.input_ids).unbind(),
            positions: PyArray1::from_vec(py, out.positions).unbind(),
            cu_seqlens_q: PyArray1::from_vec(py, out.cu_seqlens_q).unbind(),
            seq_lens: PyArray1::from_vec(py, out.seq_lens).unbind(),
            block_tables: array2_i32(py, out.block_tables, rows, out.block_table_width)?.unbind(),
            slot_mapping: PyArray1::from_vec(py, out.slot_mapping).unbind(),
            logits_indices: PyArray1::from_vec(py, out.logits_indices).unbind(),
            sampled_req_ids: sampled.unbind(),
            sample_indices: PyArray1::from_vec(py, out.sample_indices).unbind(),
            copy_ops: array2_i32(py, out.copy_ops, k, 2)?.unbind(),
            preempted_req_ids: preempted.unbind(),
            finished_req_ids: finished.unbind(),
            finish_reasons: reasons.unbind(),
        })
    }
}
