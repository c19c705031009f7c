//! `pagedkv.KVCacheManager`: sequences with block tables over a block pool, for servers that
//! bring their own scheduler. Sequence ids are non-negative ints.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use super::allocator::PoolArgs;
use super::args::{count_arg, int_arg, salt_arg, seq_id_arg, seq_ids_arg, token_ids_arg};
use crate::block_hash::ExtraKey;
use crate::error::CoreError;
use crate::ids::SeqId;
use crate::kv_cache_manager::{AddSequence, KvCacheManager};

/// `rows` × `cols` int32 array from a row-major vector.
pub(crate) fn array2_i32<'py>(py: Python<'py>, data: Vec<i32>, rows: usize, cols: usize) -> PyResult<Bound<'py, PyArray2<i32>>> {
    PyArray1::from_vec(py, data).reshape([rows, cols])
}

/// Block tables of many sequences over one block pool, with prefix caching and copy-on-write.
#[pyclass(module = "pagedkv._core", name = "KVCacheManager")]
pub struct PyKvCacheManager {
    inner: KvCacheManager,
    ok_scratch: Vec<bool>,
}

impl PyKvCacheManager {
    fn seq_ids(&self, obj: &Bound<'_, PyAny>) -> PyResult<Vec<SeqId>> {
        seq_ids_arg(obj, "seq_ids")
    }
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = None, *, hash_bits = None))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        hash_bits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let a = PoolArgs::parse(num_blocks, block_size, enable_prefix_caching, hash_bits)?;
        let inner = KvCacheManager::new(a.num_blocks, a.block_size, a.enable_prefix_caching, a.hash_mode)?;
        Ok(PyKvCacheManager { inner, ok_scratch: Vec::new() })
    }

    /// Creates a sequence over `token_ids`, reusing its longest verified cached prefix.
    /// Returns `(seq_id, num_cached_tokens)`; the cached tokens count as computed.
    #[pyo3(signature = (token_ids, *, cache_salt = None))]
    fn add_sequence(
        &mut self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(u64, usize)> {
        let tokens = token_ids_arg(token_ids, "token_ids")?;
        let extra = ExtraKey::new(salt_arg(cache_salt)?.as_deref());
        let inner = &mut self.inner;
        let (id, hit) = py.detach(|| inner.add_sequence(AddSequence::new(tokens, extra)));
        Ok((id.0, hit))
    }

    /// Gives slots to the next `num_tokens` tokens without one (copy-on-write as needed).
    /// Returns False, changing nothing, when too few blocks are free.
    fn allocate_slots(&mut self, seq_id: &Bound<'_, PyAny>, num_tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = seq_id_arg(seq_id)?;
        let n = count_arg(num_tokens, "num_tokens")?;
        Ok(self.inner.allocate_slots(id, n)?)
    }

    /// Appends token ids (e.g. sampled ones) without giving them slots.
    fn append_token_ids(&mut self, seq_id: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq_id_arg(seq_id)?;
        let tokens = token_ids_arg(token_ids, "token_ids")?;
        Ok(self.inner.append_tokens(id, &tokens)?)
    }

    /// Decode step for a batch in one call: appends `token_ids[i]` to `seq_ids[i]` and gives it
    /// a slot. Returns a bool array: False where that sequence got no block (it is unchanged).
    fn append_decode_tokens<'py>(
        &mut self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let ids = self.seq_ids(seq_ids)?;
        let tokens = token_ids_arg(token_ids, "token_ids")?;
        self.inner.append_tokens_with_slots(&ids, &tokens, &mut self.ok_scratch)?;
        Ok(PyArray1::from_slice(py, &self.ok_scratch))
    }

    /// A new sequence sharing all blocks of `seq_id` (copy-on-write on the next write).
    fn fork(&mut self, seq_id: &Bound<'_, PyAny>) -> PyResult<u64> {
        let id = seq_id_arg(seq_id)?;
        Ok(self.inner.fork(id)?.0)
    }

    /// Ends a sequence; its blocks return to the pool (full ones stay in the prefix cache).
    fn free(&mut self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq_id_arg(seq_id)?;
        Ok(self.inner.free(id)?)
    }

    /// The block table of one sequence: int32[num_blocks].
    fn block_table<'py>(&self, py: Python<'py>, seq_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let s = self.inner.seq(seq_id_arg(seq_id)?)?;
        let v: Vec<i32> = s.table().blocks().iter().map(|b| b.0 as i32).collect();
        Ok(PyArray1::from_vec(py, v))
    }

    /// Block tables of several sequences: int32[B, max_blocks], rows padded with 0.
    fn block_tables<'py>(&self, py: Python<'py>, seq_ids: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = self.seq_ids(seq_ids)?;
        let mut width = 0;
        for &id in &ids {
            width = width.max(self.inner.seq(id)?.table().len());
        }
        let mut data = vec![0i32; ids.len() * width];
        for (row, &id) in ids.iter().enumerate() {
            for (j, b) in self.inner.seq(id)?.table().blocks().iter().enumerate() {
                data[row * width + j] = b.0 as i32;
            }
        }
        array2_i32(py, data, ids.len(), width)
    }

    /// KV slots of positions `start .. end` (default: the last allocated write window):
    /// int64[end - start].
    #[pyo3(signature = (seq_id, start = None, end = None))]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        start: Option<&Bound<'py, PyAny>>,
        end: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let s = self.inner.seq(seq_id_arg(seq_id)?)?;
        let start = start.map(|o| count_arg(o, "start")).transpose()?.unwrap_or(s.write_start());
        let end = end.map(|o| count_arg(o, "end")).transpose()?.unwrap_or(s.num_computed());
        if start > end || end > s.num_computed() {
            return Err(CoreError::InvalidArgument(format!(
                "slot range {start}..{end} is outside the {} tokens holding slots",
                s.num_computed()
            ))
            .into());
        }
        let mut out = Vec::new();
        s.table().extend_slots(start, end, self.inner.block_size(), &mut out);
        Ok(PyArray1::from_vec(py, out))
    }

    /// All token ids of a sequence: int32[num_tokens].
    fn token_ids<'py>(&self, py: Python<'py>, seq_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let s = self.inner.seq(seq_id_arg(seq_id)?)?;
        Ok(PyArray1::from_vec(py, s.tokens().iter().map(|&t| t as i32).collect()))
    }

    /// Number of known tokens of a sequence.
    fn num_tokens(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.inner.seq(seq_id_arg(seq_id)?)?.num_tokens())
    }

    /// Number of tokens of a sequence that hold a KV slot.
    fn num_computed_tokens(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.inner.seq(seq_id_arg(seq_id)?)?.num_computed())
    }

    /// Copy-on-write ops recorded since the last call: int32[K, 2] rows of (src, dst) blocks,
    /// to execute (in order) before the forward pass that writes the new slots.
    fn take_copy_ops<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ops = self.inner.take_copy_ops();
        let k = ops.len();
        let data = ops.into_iter().flat_map(|(s, d)| [s.0 as i32, d.0 as i32]).collect();
        array2_i32(py, data, k, 2)
    }

    /// The ref count of one block.
    fn ref_count(&self, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let pool = self.inner.pool();
        let b = pool.block_id(int_arg(block_id, "block_id")?)?;
        Ok(pool.ref_count(b)?)
    }

    /// Drops the cached identity of every free cached block; returns how many.
    fn reset_prefix_cache(&mut self) -> usize {
        self.inner.reset_prefix_cache()
    }

    /// Raises InvariantViolationError if the bookkeeping is inconsistent.
    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    /// Ids of the live sequences.
    fn sequence_ids(&self) -> Vec<u64> {
        self.inner.sequence_ids().into_iter().map(|s| s.0).collect()
    }

    /// Total blocks.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.pool().num_blocks()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// Free blocks (cached or not).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.pool().num_free()
    }

    /// Fraction of blocks in use.
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.pool().usage()
    }

    /// Number of live sequences.
    #[getter]
    fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
    }

    /// Prompt tokens looked up in the prefix cache by `add_sequence`.
    #[getter]
    fn prefix_cache_queries(&self) -> u64 {
        self.inner.prefix_counters().queries
    }

    /// Of those, tokens found cached.
    #[getter]
    fn prefix_cache_hits(&self) -> u64 {
        self.inner.prefix_counters().hits
    }

    fn __repr__(&self) -> String {
        let p = self.inner.pool();
        format!(
            "KVCacheManager(num_blocks={}, block_size={}, free={}, sequences={})",
            p.num_blocks(),
            p.block_size(),
            p.num_free(),
            self.inner.num_sequences()
        )
    }
}
