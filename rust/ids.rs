//! Id newtypes. No raw `usize` ids cross module borders: a block id and a sequence id cannot be
//! confused with each other or with a count.

use std::fmt;

use crate::slab::{SlabKey, GENERATION_MASK};

/// A physical block of the KV cache: an index into the pool, `0 .. num_blocks`.
///
/// Block ids fit in `i32` (they cross to Python and the kernels as int32 block tables), which
/// the pool guarantees by capping `num_blocks` at [`crate::block_pool::MAX_NUM_BLOCKS`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The entry of a block table whose block was given back (a sliding-window or chunked
    /// group's blocks behind every future query): no block. It crosses to Python as `-1`.
    pub const NULL: BlockId = BlockId(u32::MAX);

    /// True for [`Self::NULL`].
    #[inline]
    pub fn is_null(self) -> bool {
        self == Self::NULL
    }

    /// The block's index into per-block arrays.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A live sequence of a [`crate::kv_cache_manager::KvCacheManager`].
///
/// Packs a slot index (low 32 bits) and that slot's generation (next 31 bits), so an id that
/// outlives its sequence is recognised as stale instead of aliasing the slot's next occupant.
/// Ids are non-negative `i64` values, so they cross to Python and numpy int64 unchanged.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl SeqId {
    /// The id of the sequence stored under `key`.
    #[inline]
    pub fn from_key(key: SlabKey) -> Self {
        SeqId((((key.generation & GENERATION_MASK) as u64) << 32) | key.slot as u64)
    }

    /// The slab key this id packs.
    #[inline]
    pub fn key(self) -> SlabKey {
        SlabKey { slot: (self.0 & 0xFFFF_FFFF) as u32, generation: (self.0 >> 32) as u32 }
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
