//! The free-block queue: an intrusive doubly linked list over index arrays.
//!
//! Every free block is in the queue exactly once. `pop_front` gives the next block to reuse;
//! `push_front` is for blocks that should be reused first (they hold nothing worth keeping);
//! `push_back` is for blocks that still hold a cached prefix (reused last, least recently freed
//! first: LRU); `remove` takes a block out of the middle in O(1) when a cached block is revived
//! by a prefix hit. All operations are O(1) and allocation-free.
//!
//! Layout: nodes `0 .. n` are blocks; node `n` is a sentinel whose `next` is the head and whose
//! `prev` is the tail, which removes every empty-list special case. A block not in the queue
//! has `prev == next == DETACHED`.

use crate::error::{CoreError, Result};
use crate::ids::BlockId;

const DETACHED: u32 = u32::MAX;

/// Intrusive doubly linked list of free blocks (see the module docs).
#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue of `num_blocks` blocks, all free, in id order (block 0 is reused first).
    pub fn new_full(num_blocks: usize) -> Result<Self> {
        let n = num_blocks;
        let sentinel = n as u32;
        let mut prev = Vec::new();
        let mut next = Vec::new();
        prev.try_reserve_exact(n + 1)
            .and_then(|_| next.try_reserve_exact(n + 1))
            .map_err(|_| CoreError::Config(format!("cannot allocate a free queue of {n} blocks")))?;
        for i in 0..=n {
            // Node i links to i-1 and i+1, wrapping through the sentinel.
            prev.push(if i == 0 { sentinel } else { i as u32 - 1 });
            next.push(if i == n { 0 } else { i as u32 + 1 });
        }
        if n == 0 {
            prev[0] = sentinel;
            next[0] = sentinel;
        }
        Ok(FreeBlockQueue { prev, next, len: n })
    }

    #[inline]
    fn sentinel(&self) -> u32 {
        (self.prev.len() - 1) as u32
    }

    /// Number of free blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is free.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when `block` is in the queue. `block` must be a valid id.
    #[inline]
    pub fn contains(&self, block: BlockId) -> bool {
        self.next[block.index()] != DETACHED
    }

    /// The block `pop_front` would return, without removing it.
    #[inline]
    pub fn front(&self) -> Option<BlockId> {
        let head = self.next[self.sentinel() as usize];
        (head != self.sentinel()).then_some(BlockId(head))
    }

    /// Removes and returns the block to reuse next.
    #[inline]
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let block = self.front()?;
        self.unlink(block);
        Some(block)
    }

    /// Appends `block` at the reuse-last (LRU) end. `block` must not be in the queue.
    #[inline]
    pub fn push_back(&mut self, block: BlockId) {
        debug_assert!(!self.contains(block));
        let s = self.sentinel();
        let tail = self.prev[s as usize];
        self.link_between(block.0, tail, s);
    }

    /// Prepends `block` at the reuse-first end. `block` must not be in the queue.
    #[inline]
    pub fn push_front(&mut self, block: BlockId) {
        debug_assert!(!self.contains(block));
        let s = self.sentinel();
        let head = self.next[s as usize];
        self.link_between(block.0, s, head);
    }

    /// Takes `block` out of the middle of the queue. Returns false (and does nothing) when it
    /// was not in the queue.
    #[inline]
    pub fn remove(&mut self, block: BlockId) -> bool {
        if !self.contains(block) {
            return false;
        }
        self.unlink(block);
        true
    }

    #[inline]
    fn link_between(&mut self, node: u32, before: u32, after: u32) {
        self.prev[node as usize] = before;
        self.next[node as usize] = after;
        self.next[before as usize] = node;
        self.prev[after as usize] = node;
        self.len += 1;
    }

    #[inline]
    fn unlink(&mut self, block: BlockId) {
        let i = block.index();
        let (p, n) = (self.prev[i], self.next[i]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[i] = DETACHED;
        self.next[i] = DETACHED;
        self.len -= 1;
    }

    /// The free blocks from reuse-first to reuse-last. O(len).
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let s = self.sentinel();
        let mut cur = self.next[s as usize];
        std::iter::from_fn(move || {
            if cur == s {
                return None;
            }
            let b = BlockId(cur);
            cur = self.next[cur as usize];
            Some(b)
        })
    }

    /// Checks the list structure: links agree both ways, the walk visits `len` distinct blocks,
    /// and every block off the list is marked detached.
    pub fn check(&self) -> Result<()> {
        let s = self.sentinel() as usize;
        let mut seen = vec![false; s];
        let mut count = 0usize;
        let mut cur = s;
        loop {
            let nxt = self.next[cur] as usize;
            if nxt > s || self.prev[nxt] as usize != cur {
                return Err(CoreError::InvariantViolation(format!(
                    "free queue link broken between nodes {cur} and {nxt}"
                )));
            }
            if nxt == s {
                break;
            }
            if seen[nxt] {
                return Err(CoreError::InvariantViolation(format!("free queue visits block {nxt} twice")));
            }
            seen[nxt] = true;
            count += 1;
            cur = nxt;
        }
        if count != self.len {
            return Err(CoreError::InvariantViolation(format!(
                "free queue holds {count} blocks but counts {}",
                self.len
            )));
        }
        for (i, &in_list) in seen.iter().enumerate() {
            let detached = self.next[i] == DETACHED && self.prev[i] == DETACHED;
            if in_list == detached {
                return Err(CoreError::InvariantViolation(format!(
                    "block {i} membership flag disagrees with the free queue walk"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &FreeBlockQueue) -> Vec<u32> {
        q.iter().map(|b| b.0).collect()
    }

    #[test]
    fn starts_full_in_id_order() {
        let q = FreeBlockQueue::new_full(4).unwrap();
        assert_eq!(ids(&q), vec![0, 1, 2, 3]);
        assert_eq!(q.len(), 4);
        q.check().unwrap();
    }

    #[test]
    fn empty_queue_is_consistent() {
        let mut q = FreeBlockQueue::new_full(0).unwrap();
        assert!(q.is_empty());
        assert_eq!(q.pop_front(), None);
        q.check().unwrap();
    }

    #[test]
    fn pop_push_remove() {
        let mut q = FreeBlockQueue::new_full(5).unwrap();
        assert_eq!(q.pop_front(), Some(BlockId(0)));
        assert_eq!(q.pop_front(), Some(BlockId(1)));
        assert!(!q.contains(BlockId(0)));
        q.push_back(BlockId(0));
        q.push_front(BlockId(1));
        assert_eq!(ids(&q), vec![1, 2, 3, 4, 0]);
        assert!(q.remove(BlockId(3)));
        assert!(!q.remove(BlockId(3)));
        assert_eq!(ids(&q), vec![1, 2, 4, 0]);
        assert!(q.remove(BlockId(1)));
        assert!(q.remove(BlockId(0)));
        assert_eq!(ids(&q), vec![2, 4]);
        q.check().unwrap();
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn drain_and_refill() {
        let mut q = FreeBlockQueue::new_full(3).unwrap();
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        q.check().unwrap();
        q.push_back(BlockId(2));
        q.push_back(BlockId(0));
        q.push_front(BlockId(1));
        assert_eq!(ids(&q), vec![1, 2, 0]);
        q.check().unwrap();
    }
}
