//! A sequence's block table: logical block `i` (tokens `i*bs .. (i+1)*bs`) lives in physical
//! block `blocks[i]`. The table grows one block at a time as tokens get slots, so a sequence
//! of `n` tokens holds exactly `ceil(n / bs)` blocks.

use crate::ids::BlockId;

/// Number of blocks that hold `num_tokens` tokens.
#[inline]
pub fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

/// Logical → physical block mapping of one sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    /// Bumped whenever an entry changes other than by appending (copy-on-write, take), so a
    /// copy of the first `k` entries made at the same version is still a prefix of the table.
    version: u32,
}

impl BlockTable {
    /// A table over the given blocks, in logical order.
    pub fn from_blocks(blocks: Vec<BlockId>) -> Self {
        BlockTable { blocks, version: 0 }
    }

    /// Changes whenever an entry is replaced or removed (appends keep it): the first `k`
    /// blocks seen at version `v` are still the first `k` blocks while the version is `v`.
    #[inline]
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The physical blocks in logical order.
    #[inline]
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of blocks held.
    #[inline]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when no block is held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Appends a physical block at the next logical index.
    #[inline]
    pub fn push(&mut self, block: BlockId) {
        self.blocks.push(block);
    }

    /// Replaces the physical block at logical index `i` (copy-on-write), returning the old one.
    #[inline]
    pub fn replace(&mut self, i: usize, block: BlockId) -> BlockId {
        self.version = self.version.wrapping_add(1);
        std::mem::replace(&mut self.blocks[i], block)
    }

    /// Mutable access for appending allocations in place (callers only push: the version
    /// does not change).
    #[inline]
    pub(crate) fn blocks_mut(&mut self) -> &mut Vec<BlockId> {
        &mut self.blocks
    }

    /// Drops the entries from logical index `len` on (rejected drafts' blocks), returning them.
    pub fn truncate(&mut self, len: usize) -> Vec<BlockId> {
        if len >= self.blocks.len() {
            return Vec::new();
        }
        self.version = self.version.wrapping_add(1);
        self.blocks.split_off(len)
    }

    /// Takes the blocks out, leaving the table empty.
    pub fn take(&mut self) -> Vec<BlockId> {
        self.version = self.version.wrapping_add(1);
        std::mem::take(&mut self.blocks)
    }

    /// The KV slot of token position `pos`: `block * block_size + offset`. `pos` must be
    /// covered by the table.
    #[inline]
    pub fn slot(&self, pos: usize, block_size: usize) -> i64 {
        let b = self.blocks[pos / block_size].0 as i64;
        b * block_size as i64 + (pos % block_size) as i64
    }

    /// Appends the slots of positions `start .. end` to `out`.
    pub fn extend_slots(&self, start: usize, end: usize, block_size: usize, out: &mut Vec<i64>) {
        if end == start + 1 {
            // A decode: one slot.
            out.push(self.slot(start, block_size));
            return;
        }
        out.reserve(end.saturating_sub(start));
        let mut pos = start;
        while pos < end {
            // One block at a time: consecutive positions of a block map to consecutive slots.
            let bi = pos / block_size;
            let block_end = ((bi + 1) * block_size).min(end);
            let base = self.blocks[bi].0 as i64 * block_size as i64;
            let off = (pos % block_size) as i64;
            out.extend((0..(block_end - pos) as i64).map(|k| base + off + k));
            pos = block_end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seven_tokens_two_blocks_of_four() {
        assert_eq!(blocks_for(7, 4), 2);
        assert_eq!(blocks_for(8, 4), 2);
        assert_eq!(blocks_for(9, 4), 3);
        assert_eq!(blocks_for(0, 4), 0);
    }

    #[test]
    fn slots_follow_the_table() {
        let t = BlockTable::from_blocks(vec![BlockId(5), BlockId(2)]);
        assert_eq!(t.slot(0, 4), 20);
        assert_eq!(t.slot(3, 4), 23);
        assert_eq!(t.slot(4, 4), 8);
        assert_eq!(t.slot(6, 4), 10);
        let mut out = Vec::new();
        t.extend_slots(2, 7, 4, &mut out);
        assert_eq!(out, vec![22, 23, 8, 9, 10]);
        t.extend_slots(5, 6, 4, &mut out);
        t.extend_slots(3, 3, 4, &mut out);
        assert_eq!(out, vec![22, 23, 8, 9, 10, 9]);
    }
}
