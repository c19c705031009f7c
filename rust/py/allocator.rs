//! `pagedkv.BlockAllocator`: the block pool with its prefix cache, for callers that manage
//! their own block tables.

use pyo3::prelude::*;

use super::args::{bool_arg, count_arg, hash_mode_arg, int_arg, int_list_arg, positive_arg, salt_arg, token_ids_arg};
use crate::block_hash::{ExtraKey, HashMode};
use crate::block_pool::{BlockPool, ChainLink};
use crate::error::CoreError;
use crate::ids::BlockId;

/// The validated constructor arguments of a pool.
pub(crate) struct PoolArgs {
    pub num_blocks: usize,
    pub block_size: usize,
    pub enable_prefix_caching: bool,
    pub hash_mode: HashMode,
}

impl PoolArgs {
    /// `(num_blocks, block_size, enable_prefix_caching=True, *, hash_bits=None)` as Python gives
    /// them: counts first (the pool checks its own limits after).
    pub(crate) fn parse(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        hash_bits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(PoolArgs {
            num_blocks: positive_arg(num_blocks, "num_blocks")?,
            block_size: positive_arg(block_size, "block_size")?,
            enable_prefix_caching: enable_prefix_caching
                .map(|o| bool_arg(o, "enable_prefix_caching"))
                .transpose()?
                .unwrap_or(true),
            hash_mode: hash_bits.map(hash_mode_arg).transpose()?.unwrap_or_default(),
        })
    }
}

/// A fixed pool of KV blocks with ref counts, copy-on-write sharing and a prefix cache.
#[pyclass(module = "pagedkv._core", name = "BlockAllocator")]
pub struct PyBlockAllocator {
    pool: BlockPool,
}

impl PyBlockAllocator {
    fn block_ids(&self, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<BlockId>> {
        let raw = int_list_arg(obj, name)?;
        raw.into_iter().map(|b| self.pool.block_id(b).map_err(PyErr::from)).collect()
    }
}

#[pymethods]
impl PyBlockAllocator {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = None, *, hash_bits = None))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        hash_bits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let a = PoolArgs::parse(num_blocks, block_size, enable_prefix_caching, hash_bits)?;
        Ok(PyBlockAllocator { pool: BlockPool::new(a.num_blocks, a.block_size, a.enable_prefix_caching, a.hash_mode)? })
    }

    /// Allocates `n` blocks (ref count 1 each), or returns None and changes nothing when fewer
    /// than `n` are free.
    fn allocate(&mut self, n: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
        let n = count_arg(n, "n")?;
        Ok(self.pool.allocate(n).map(|v| v.into_iter().map(|b| b.0).collect()))
    }

    /// Drops one reference from each block; all-or-nothing.
    fn free(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self.block_ids(block_ids, "block_ids")?;
        Ok(self.pool.free(&ids)?)
    }

    /// Shares allocated blocks (ref count + 1 each); all-or-nothing.
    fn fork(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self.block_ids(block_ids, "block_ids")?;
        Ok(self.pool.fork(&ids)?)
    }

    /// Takes a reference on allocated or free-but-cached blocks (reviving cached ones).
    fn touch(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self.block_ids(block_ids, "block_ids")?;
        Ok(self.pool.touch(&ids)?)
    }

    /// The ref count of one block.
    fn ref_count(&self, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = self.pool.block_id(int_arg(block_id, "block_id")?)?;
        Ok(self.pool.ref_count(b)?)
    }

    /// Registers the full blocks of `token_ids` held in `block_ids` (block k holds tokens
    /// `k*block_size ..`) in the prefix cache; returns how many were newly registered.
    #[pyo3(signature = (block_ids, token_ids, cache_salt = None))]
    fn cache_blocks(
        &mut self,
        py: Python<'_>,
        block_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let ids = self.block_ids(block_ids, "block_ids")?;
        let tokens = token_ids_arg(token_ids, "token_ids")?;
        let extra = ExtraKey::new(salt_arg(cache_salt)?.as_deref());
        let bs = self.pool.block_size();
        let full = (tokens.len() / bs).min(ids.len());
        for &b in &ids[..full] {
            if self.pool.ref_count(b)? == 0 {
                return Err(CoreError::BlockNotAllocated(b.0).into());
            }
        }
        let pool = &mut self.pool;
        Ok(py.detach(|| {
            let mut hasher = pool.new_hasher();
            let mut hashes = Vec::new();
            hasher.extend_chain(&mut hashes, &tokens, bs, &extra, full);
            pool.register_chain(&ids, &hashes, &tokens, &extra, 0, full, ChainLink::Root).0
        }))
    }

    /// Block ids of the longest verified cached prefix of `token_ids` (leaving at least one
    /// token uncached). Takes no references: `touch` them to use them.
    #[pyo3(signature = (token_ids, cache_salt = None))]
    fn find_cached_prefix(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let tokens = token_ids_arg(token_ids, "token_ids")?;
        let extra = ExtraKey::new(salt_arg(cache_salt)?.as_deref());
        let pool = &self.pool;
        Ok(py.detach(|| {
            let mut hasher = pool.new_hasher();
            let mut hashes = Vec::new();
            pool.match_prefix(&mut hasher, &tokens, &extra, &mut hashes).into_iter().map(|b| b.0).collect()
        }))
    }

    /// True when the block is registered in the prefix cache.
    fn is_cached(&self, block_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let b = self.pool.block_id(int_arg(block_id, "block_id")?)?;
        Ok(self.pool.is_cached(b))
    }

    /// Free block ids in reuse order (uncached first, then cached least recently freed first).
    fn free_block_ids(&self) -> Vec<u32> {
        self.pool.free_blocks().into_iter().map(|b| b.0).collect()
    }

    /// Drops the cached identity of every free cached block; returns how many.
    fn reset_prefix_cache(&mut self) -> usize {
        self.pool.reset_prefix_cache()
    }

    /// Raises InvariantViolationError if the bookkeeping is inconsistent.
    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.pool.check_invariants()?)
    }

    /// Total blocks.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Whether the prefix cache is on.
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.pool.prefix_caching()
    }

    /// Free blocks (cached or not).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks with a ref count above 0.
    #[getter]
    fn num_used_blocks(&self) -> usize {
        self.pool.num_used()
    }

    /// Fraction of blocks in use.
    #[getter]
    fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Blocks registered in the prefix cache.
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached_blocks()
    }

    /// Cached blocks evicted by reuse so far.
    #[getter]
    fn num_evictions(&self) -> u64 {
        self.pool.counters().evictions
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockAllocator(num_blocks={}, block_size={}, free={}, cached={})",
            self.pool.num_blocks(),
            self.pool.block_size(),
            self.pool.num_free(),
            self.pool.num_cached_blocks()
        )
    }
}
