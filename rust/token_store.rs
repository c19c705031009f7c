//! Token ids of cached blocks, kept for verifying prefix-cache hits.
//!
//! Storage is paged: blocks are grouped `PAGE_BLOCKS` at a time into one flat vector that is
//! allocated the first time a block of the page is registered. Registration therefore almost
//! never allocates (once per page), memory grows only with the part of the pool that has ever
//! been cached, and a failed allocation is reported (the block simply stays uncached) instead
//! of aborting the process.

use crate::ids::BlockId;

const PAGE_BLOCKS: usize = 1024;

/// Token ids of registered blocks, `block_size` per block.
#[derive(Debug, Clone)]
pub struct TokenStore {
    block_size: usize,
    pages: Vec<Vec<u32>>,
}

impl TokenStore {
    /// An empty store for `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        TokenStore { block_size, pages: vec![Vec::new(); num_blocks.div_ceil(PAGE_BLOCKS)] }
    }

    #[inline]
    fn locate(&self, block: BlockId) -> (usize, usize) {
        let i = block.index();
        (i / PAGE_BLOCKS, (i % PAGE_BLOCKS) * self.block_size)
    }

    /// Stores `tokens` (exactly `block_size` of them) for `block`. Returns false if the page
    /// could not be allocated.
    pub fn set(&mut self, block: BlockId, tokens: &[u32]) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        let (p, off) = self.locate(block);
        let page = &mut self.pages[p];
        if page.is_empty() {
            let len = PAGE_BLOCKS * self.block_size;
            if page.try_reserve_exact(len).is_err() {
                return false;
            }
            page.resize(len, 0);
        }
        page[off..off + self.block_size].copy_from_slice(tokens);
        true
    }

    /// The tokens stored for `block` (meaningful only while it is registered).
    #[inline]
    pub fn get(&self, block: BlockId) -> &[u32] {
        let (p, off) = self.locate(block);
        self.pages[p].get(off..off + self.block_size).unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_and_get_across_pages() {
        let mut s = TokenStore::new(3000, 2);
        assert!(s.get(BlockId(5)).is_empty());
        assert!(s.set(BlockId(5), &[1, 2]));
        assert!(s.set(BlockId(2999), &[3, 4]));
        assert_eq!(s.get(BlockId(5)), &[1, 2]);
        assert_eq!(s.get(BlockId(2999)), &[3, 4]);
        assert_eq!(s.get(BlockId(6)), &[0, 0]);
        assert!(s.get(BlockId(1500)).is_empty());
    }
}
