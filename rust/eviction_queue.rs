//! The free-block queue with retention priorities.
//!
//! Every free block is in the queue exactly once, in one of two parts:
//!
//! - **uncached** blocks hold nothing worth keeping. They are always reused before any cached
//!   block, most recently pushed first (a stack; `new_full` starts with every block here, block 0
//!   reused first);
//! - **cached** (evictable) blocks still hold a prefix the cache can hit. Each carries a
//!   retention priority `0 ..= MAX_RETENTION_PRIORITY` (default
//!   [`DEFAULT_RETENTION_PRIORITY`]) and optionally an expiry time after which its priority
//!   falls back to the default. They are evicted lowest *effective* priority first, and within
//!   one priority least recently pushed first (LRU).
//!
//! Reuse order is therefore: uncached (stack order), then cached by `(effective priority,
//! push stamp)`, where the stamp is a counter bumped on every `push_cached` (unique, increasing
//! with push time). The model is TensorRT-LLM's KV cache retention config.
//!
//! Cost: `push_uncached`, `push_cached` without expiry, `remove` of a non-demoted block and
//! `pop_front` / `peek_evictable` with no expiry due are O(1) and allocation-free; an expiring
//! push, a demotion and anything touching a demoted block are O(log n) (a demotion pass costs
//! O(log n) per expired entry, and each heap entry is popped at most once).
//! Times are microseconds on the caller's monotonic clock; if `now_us` goes backwards, blocks
//! already demoted stay demoted.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use crate::error::{CoreError, Result};
use crate::ids::BlockId;

/// The retention priority of a cached block that was given none, and the priority an expired
/// retention falls back to.
pub const DEFAULT_RETENTION_PRIORITY: u8 = 35;
/// The highest retention priority (kept longest).
pub const MAX_RETENTION_PRIORITY: u8 = 100;

const D: u8 = DEFAULT_RETENTION_PRIORITY;
/// Number of priority buckets.
const NUM_BUCKETS: u32 = MAX_RETENTION_PRIORITY as u32 + 1;
/// Sentinels after the `n` block nodes: buckets `0 ..= 100`, then the uncached list.
const UNCACHED: u32 = NUM_BUCKETS;
const NUM_SENTINELS: u32 = NUM_BUCKETS + 1;
/// `prev`/`next` of a node on no list.
const DETACHED: u32 = u32::MAX;
/// Slack of the expiry heap over twice the number of cached blocks before stale entries are
/// dropped.
const HEAP_SLACK: usize = 64;

/// How long a block keeps its priority. Times are microseconds on the caller's monotonic clock.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Eviction priority, `0 ..= MAX_RETENTION_PRIORITY`: lower is evicted first.
    pub priority: u8,
    /// When the priority falls back to [`DEFAULT_RETENTION_PRIORITY`]; `None`: never.
    pub expires_at_us: Option<u64>,
}

impl Retention {
    /// The default retention: [`DEFAULT_RETENTION_PRIORITY`], no expiry.
    pub const DEFAULT: Retention = Retention { priority: DEFAULT_RETENTION_PRIORITY, expires_at_us: None };
}

impl Default for Retention {
    /// [`Retention::DEFAULT`].
    fn default() -> Self {
        Retention::DEFAULT
    }
}

/// Where a block is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Place {
    /// Not queued (in use).
    Out,
    /// On the uncached list.
    Uncached,
    /// In the bucket of its priority.
    Bucket,
    /// In `demoted` (its priority is the default).
    Demoted,
}

/// A node of the intrusive lists: a block (`0 .. n`) or a sentinel (`n ..`). The fields after
/// the links are meaningful for blocks only.
#[derive(Copy, Clone, Debug)]
struct Node {
    prev: u32,
    next: u32,
    /// Push stamp of the last `push_cached` (valid while cached).
    stamp: u64,
    /// Effective priority as of the last demotion pass (valid while cached).
    priority: u8,
    place: Place,
}

impl Node {
    const DETACHED: Node = Node { prev: DETACHED, next: DETACHED, stamp: 0, priority: D, place: Place::Out };
}

/// Entry of the expiry heap: `(expires_at_us, stamp, block)`, smallest expiry on top.
type ExpiryEntry = Reverse<(u64, u64, u32)>;

/// The free-block queue with retention priorities (see the module docs for the order).
///
/// Data structures (chosen so the common case costs what the plain LRU list did: O(1), no
/// allocation):
///
/// - one intrusive doubly linked list over index arrays (O(1) removal from the middle when a
///   prefix hit revives a block) with one sentinel per list: the uncached stack, and one
///   **bucket** per priority `0 ..= 100`. A cached block is appended to its priority's bucket,
///   so every bucket is in stamp order;
/// - `nonempty`: a 101-bit mask of the non-empty buckets; the lowest set bit is the lowest
///   priority present (`trailing_zeros`);
/// - `demoted`: a `BTreeSet<(stamp, block)>` of blocks whose retention expired while queued.
///   Demotion keeps a block's stamp (its LRU position among default-priority blocks), which
///   generally falls in the middle of the default bucket; instead of an O(n) sorted insert the
///   block moves to this set, and the default priority's order is the merge by stamp of the
///   default bucket and this set (each sorted by stamp). O(log n), and only blocks that were
///   given an expiring retention ever get here;
/// - `expiry`: a min-heap of `(expires_at_us, stamp, block)`, one entry per `push_cached` whose
///   block entered with a non-default priority and an expiry in the future. A demotion pass
///   (run by `pop_front` and `peek_evictable`) pops every entry with `expires_at_us <= now_us`
///   and, when the block is still in its bucket *from that same push* (same stamp), moves it
///   to `demoted`. Entries of blocks removed or pushed again since are stale and dropped when
///   popped. When the heap holds more than `2 * cached + 64` entries, the stale ones are
///   dropped in one O(heap) pass, which keeps the heap bounded and costs O(1) amortized per
///   push (the pass removes at least half of what it scans).
///
/// Invariants (checked by [`EvictionQueue::check`]):
/// - every block is in exactly one place: out of the queue, the uncached list, the bucket of
///   its priority, or `demoted` (then at the default priority); the per-block place agrees
///   with the lists and the set; `len == num_uncached + cached`;
/// - every bucket is in strictly increasing stamp order, its mask bit is set if and only if it
///   is non-empty, and every stamp is below the next one;
/// - a live heap entry (its block is in a bucket with the entry's stamp) belongs to a block
///   whose priority is not the default, and no block has two.
#[derive(Debug, Clone)]
pub struct EvictionQueue {
    /// Blocks `0 .. n`, then the bucket sentinels, then the uncached sentinel.
    nodes: Vec<Node>,
    /// Bit `p` set if and only if bucket `p` is non-empty.
    nonempty: u128,
    /// Blocks demoted by expiry while queued, by stamp.
    demoted: BTreeSet<(u64, u32)>,
    /// Pending demotions (may hold stale entries; see the module docs).
    expiry: BinaryHeap<ExpiryEntry>,
    num_uncached: usize,
    /// Blocks in buckets plus demoted blocks.
    num_cached: usize,
    /// The stamp the next `push_cached` gets.
    next_stamp: u64,
}

impl EvictionQueue {
    /// A queue of `num_blocks` blocks, all free and uncached, in id order (block 0 is reused
    /// first). A `Config` error when the bookkeeping cannot
    /// be allocated or the node ids would not fit in `u32`.
    pub fn new_full(num_blocks: usize) -> Result<Self> {
        let n = num_blocks;
        if n >= (DETACHED - NUM_SENTINELS) as usize {
            return Err(CoreError::Config(format!(
                "an eviction queue holds fewer than {} blocks, got {n}",
                DETACHED - NUM_SENTINELS
            )));
        }
        let mut nodes = Vec::new();
        nodes
            .try_reserve_exact(n + NUM_SENTINELS as usize)
            .map_err(|_| CoreError::Config(format!("cannot allocate an eviction queue of {n} blocks")))?;
        let un = n as u32 + UNCACHED;
        // Blocks: the uncached list in id order, wrapping through its sentinel.
        for i in 0..n as u32 {
            let prev = if i == 0 { un } else { i - 1 };
            let next = if i + 1 == n as u32 { un } else { i + 1 };
            nodes.push(Node { prev, next, place: Place::Uncached, ..Node::DETACHED });
        }
        // Sentinels: empty buckets link to themselves.
        for s in n as u32..un {
            nodes.push(Node { prev: s, next: s, ..Node::DETACHED });
        }
        let (head, tail) = if n == 0 { (un, un) } else { (0, n as u32 - 1) };
        nodes.push(Node { prev: tail, next: head, ..Node::DETACHED });
        Ok(EvictionQueue {
            nodes,
            nonempty: 0,
            demoted: BTreeSet::new(),
            expiry: BinaryHeap::new(),
            num_uncached: n,
            num_cached: 0,
            next_stamp: 0,
        })
    }

    /// Number of blocks (the node ids of the sentinels start here).
    #[inline]
    fn num_blocks(&self) -> u32 {
        self.nodes.len() as u32 - NUM_SENTINELS
    }

    /// The sentinel of bucket `priority`.
    #[inline]
    fn bucket(&self, priority: u8) -> u32 {
        self.num_blocks() + priority as u32
    }

    /// The sentinel of the uncached list.
    #[inline]
    fn uncached_sentinel(&self) -> u32 {
        self.num_blocks() + UNCACHED
    }

    /// Number of queued blocks, cached or not.
    #[inline]
    pub fn len(&self) -> usize {
        self.num_uncached + self.num_cached
    }

    /// True when no block is queued.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of queued blocks with no cache identity (reused before any cached block).
    #[inline]
    pub fn num_uncached(&self) -> usize {
        self.num_uncached
    }

    /// True when `block` is queued (either part). False for an id out of range.
    #[inline]
    pub fn contains(&self, block: BlockId) -> bool {
        block.0 < self.num_blocks() && self.nodes[block.index()].place != Place::Out
    }

    /// Queues `block` as uncached, at the reuse-first end. `block` must be a valid id not in
    /// the queue.
    #[inline]
    pub fn push_uncached(&mut self, block: BlockId) {
        debug_assert!(!self.contains(block), "block {block} is already queued");
        let s = self.uncached_sentinel();
        let head = self.nodes[s as usize].next;
        self.link_between(block.0, s, head);
        self.nodes[block.index()].place = Place::Uncached;
        self.num_uncached += 1;
    }

    /// Queues `block` as cached (evictable), ordered by `(effective priority, push time)`.
    /// When `retention.expires_at_us <= now_us` the block enters at the default priority.
    /// `block` must be a valid id not in the queue; a priority above
    /// [`MAX_RETENTION_PRIORITY`] is a caller bug (clamped in release builds).
    pub fn push_cached(&mut self, block: BlockId, retention: Retention, now_us: u64) {
        debug_assert!(!self.contains(block), "block {block} is already queued");
        debug_assert!(
            retention.priority <= MAX_RETENTION_PRIORITY,
            "retention priority {} is above {MAX_RETENTION_PRIORITY}",
            retention.priority
        );
        let mut priority = retention.priority.min(MAX_RETENTION_PRIORITY);
        // The expiry that still matters: none if the priority is already the default (nothing
        // to demote) or the retention has expired (enter at the default right away).
        let mut pending_expiry = None;
        match retention.expires_at_us {
            Some(t) if t <= now_us => priority = D,
            Some(t) if priority != D => pending_expiry = Some(t),
            _ => {}
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        // Appending keeps the bucket in stamp order: this stamp is the largest yet.
        let s = self.bucket(priority);
        let tail = self.nodes[s as usize].prev;
        self.link_between(block.0, tail, s);
        let node = &mut self.nodes[block.index()];
        node.stamp = stamp;
        node.priority = priority;
        node.place = Place::Bucket;
        self.nonempty |= 1u128 << priority;
        self.num_cached += 1;
        if let Some(t) = pending_expiry {
            self.expiry.push(Reverse((t, stamp, block.0)));
            if self.expiry.len() > 2 * self.num_cached + HEAP_SLACK {
                self.drop_stale_expiries();
            }
        }
    }

    /// Takes `block` out of the queue wherever it is (a cached block revived by a prefix hit).
    /// Returns false (and does nothing) when it was not queued or the id is out of range.
    /// A pending expiry of the block becomes stale (dropped when popped).
    pub fn remove(&mut self, block: BlockId) -> bool {
        if block.0 >= self.num_blocks() {
            return false;
        }
        let node = self.nodes[block.index()];
        match node.place {
            Place::Out => return false,
            Place::Uncached => {
                self.unlink(block.0);
                self.num_uncached -= 1;
            }
            Place::Bucket => {
                self.unlink(block.0);
                let s = self.bucket(node.priority);
                if self.nodes[s as usize].next == s {
                    self.nonempty &= !(1u128 << node.priority);
                }
                self.num_cached -= 1;
            }
            Place::Demoted => {
                self.demoted.remove(&(node.stamp, block.0));
                self.num_cached -= 1;
            }
        }
        self.nodes[block.index()].place = Place::Out;
        true
    }

    /// Removes and returns the block to reuse next: the most recently pushed uncached block if
    /// any, else the cached block with the lowest effective priority, least recently pushed
    /// first. Every block whose expiry is `<= now_us` is demoted to the default priority first,
    /// keeping its push stamp.
    pub fn pop_front(&mut self, now_us: u64) -> Option<BlockId> {
        self.demote_expired(now_us);
        let s = self.uncached_sentinel();
        let head = self.nodes[s as usize].next;
        let block = if head != s { BlockId(head) } else { self.first_evictable()? };
        self.remove(block);
        Some(block)
    }

    /// The cached block `pop_front` would take next once no uncached block is left, and its
    /// effective priority (after demoting expired blocks, as `pop_front` does). Used to decide
    /// whether a write-back to a second tier should displace it.
    pub fn peek_evictable(&mut self, now_us: u64) -> Option<(BlockId, u8)> {
        self.demote_expired(now_us);
        let block = self.first_evictable()?;
        Some((block, self.nodes[block.index()].priority))
    }

    /// Effective priority of a queued cached block, as of the last demotion pass (the last
    /// `pop_front` / `peek_evictable`); `None` for an uncached, unqueued or out-of-range block.
    #[inline]
    pub fn priority_of(&self, block: BlockId) -> Option<u8> {
        let node = self.nodes.get(block.index()).filter(|_| block.0 < self.num_blocks())?;
        matches!(node.place, Place::Bucket | Place::Demoted).then_some(node.priority)
    }

    /// The queued blocks in reuse order: uncached (pop order), then cached by
    /// `(priority, push stamp)`, as of the last demotion pass. O(len + 101).
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let cached = (0..=MAX_RETENTION_PRIORITY).flat_map(move |p| {
            // Bucket `p`, merged by stamp with the demoted blocks when `p` is the default.
            let s = self.bucket(p);
            let mut cur = self.nodes[s as usize].next;
            let mut demoted = (p == D).then(|| self.demoted.iter()).into_iter().flatten().peekable();
            std::iter::from_fn(move || {
                let listed = (cur != s).then(|| self.nodes[cur as usize].stamp);
                match (listed, demoted.peek()) {
                    (None, None) => None,
                    (Some(a), Some(&&(b, block))) if b < a => {
                        demoted.next();
                        Some(BlockId(block))
                    }
                    (None, Some(&&(_, block))) => {
                        demoted.next();
                        Some(BlockId(block))
                    }
                    (Some(_), _) => {
                        let block = BlockId(cur);
                        cur = self.nodes[cur as usize].next;
                        Some(block)
                    }
                }
            })
        });
        self.list(self.uncached_sentinel()).chain(cached)
    }

    /// Checks the bookkeeping (see the module docs' invariants): the lists are sound and agree
    /// with each block's place, priority and stamp, buckets are in stamp order and agree with
    /// the mask, the demoted set agrees with its blocks, the counts add up, and live expiry
    /// entries belong to blocks above or below the default priority, one per block.
    pub fn check(&self) -> Result<()> {
        let fail = |msg: String| Err(CoreError::InvariantViolation(msg));
        let n = self.num_blocks() as usize;
        let total = self.nodes.len();
        // Walk every list; count the blocks seen per place.
        let mut seen = vec![false; n];
        let mut listed = [0usize; 2]; // uncached, bucketed
        for list in 0..NUM_SENTINELS {
            let s = n as u32 + list;
            let bucket = (list != UNCACHED).then_some(list as u8);
            let mut cur = s;
            let mut last_stamp = None;
            loop {
                let nxt = self.nodes[cur as usize].next;
                if nxt as usize >= total || self.nodes[nxt as usize].prev != cur {
                    return fail(format!("eviction queue link broken between nodes {cur} and {nxt}"));
                }
                if nxt == s {
                    break;
                }
                if nxt as usize >= n {
                    return fail(format!("list of sentinel {s} runs into sentinel {nxt}"));
                }
                let i = nxt as usize;
                if std::mem::replace(&mut seen[i], true) {
                    return fail(format!("block {i} is on the lists twice"));
                }
                let node = &self.nodes[i];
                match bucket {
                    None if node.place != Place::Uncached => {
                        return fail(format!("block {i} is on the uncached list but marked {:?}", node.place));
                    }
                    None => listed[0] += 1,
                    Some(p) => {
                        if node.place != Place::Bucket || node.priority != p {
                            return fail(format!(
                                "block {i} is in bucket {p} but marked {:?} at priority {}",
                                node.place, node.priority
                            ));
                        }
                        if last_stamp.is_some_and(|l| l >= node.stamp) || node.stamp >= self.next_stamp {
                            return fail(format!("bucket {p} is out of stamp order at block {i}"));
                        }
                        last_stamp = Some(node.stamp);
                        listed[1] += 1;
                    }
                }
                cur = nxt;
            }
            if let Some(p) = bucket {
                let bit = self.nonempty & (1u128 << p) != 0;
                if bit != last_stamp.is_some() {
                    return fail(format!("bucket {p} non-empty mask bit {bit} disagrees with its list"));
                }
            }
        }
        if self.nonempty >> NUM_BUCKETS != 0 {
            return fail(format!("non-empty mask {:#x} has bits above the last bucket", self.nonempty));
        }
        for &(stamp, raw) in &self.demoted {
            let ok = (raw as usize) < n && {
                let node = &self.nodes[raw as usize];
                node.place == Place::Demoted && node.stamp == stamp && node.priority == D && stamp < self.next_stamp
            };
            if !ok {
                return fail(format!("demoted entry (stamp {stamp}, block {raw}) disagrees with the block"));
            }
        }
        // Every block off the lists is out or demoted, detached; the counts add up.
        let mut num_demoted = 0usize;
        for (i, node) in self.nodes[..n].iter().enumerate() {
            if seen[i] {
                continue;
            }
            if node.prev != DETACHED || node.next != DETACHED {
                return fail(format!("block {i} is on no list but not detached"));
            }
            match node.place {
                Place::Out => {}
                Place::Demoted => num_demoted += 1,
                place => return fail(format!("block {i} is on no list but marked {place:?}")),
            }
        }
        if num_demoted != self.demoted.len()
            || listed[0] != self.num_uncached
            || listed[1] + num_demoted != self.num_cached
        {
            return fail(format!(
                "counts disagree: {} uncached, {} bucketed + {num_demoted} demoted ({} in the set) but counted {} \
                 uncached, {} cached",
                listed[0],
                listed[1],
                self.demoted.len(),
                self.num_uncached,
                self.num_cached
            ));
        }
        let mut live_expiry = vec![false; n];
        for &Reverse((_, stamp, raw)) in self.expiry.iter() {
            if raw as usize >= n {
                return fail(format!("expiry entry names block {raw} out of range"));
            }
            let node = &self.nodes[raw as usize];
            if node.place != Place::Bucket || node.stamp != stamp {
                continue; // stale: the block was removed, demoted or pushed again since
            }
            if node.priority == D {
                return fail(format!("block {raw} has a pending expiry but is already at the default priority"));
            }
            if std::mem::replace(&mut live_expiry[raw as usize], true) {
                return fail(format!("block {raw} has two pending expiries"));
            }
        }
        Ok(())
    }

    /// The blocks of the list with sentinel `s`, head to tail.
    fn list(&self, s: u32) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.nodes[s as usize].next;
        std::iter::from_fn(move || {
            if cur == s {
                return None;
            }
            let block = BlockId(cur);
            cur = self.nodes[cur as usize].next;
            Some(block)
        })
    }

    /// The cached block to evict next (as of the last demotion pass): the head of the lowest
    /// non-empty bucket, where the default priority's order merges its bucket with `demoted`.
    fn first_evictable(&self) -> Option<BlockId> {
        let bucket_head = |p: u8| self.nodes[self.bucket(p) as usize].next;
        let lowest = (self.nonempty != 0).then(|| self.nonempty.trailing_zeros() as u8);
        let demoted = self.demoted.first().map(|&(stamp, raw)| (stamp, raw));
        let raw = match (lowest, demoted) {
            (None, None) => return None,
            (Some(p), None) => bucket_head(p),
            (None, Some((_, raw))) => raw,
            (Some(p), Some(_)) if p < D => bucket_head(p),
            (Some(p), Some((stamp, raw))) if p == D => {
                let head = bucket_head(p);
                if self.nodes[head as usize].stamp < stamp {
                    head
                } else {
                    raw
                }
            }
            (Some(_), Some((_, raw))) => raw,
        };
        Some(BlockId(raw))
    }

    /// Demotes every cached block whose expiry is `<= now_us` to the default priority, keeping
    /// its stamp (its LRU position): it leaves its bucket for `demoted`. O(1) when nothing is
    /// due; O(log n) per expiry entry popped.
    fn demote_expired(&mut self, now_us: u64) {
        while let Some(&Reverse((expires_at, stamp, raw))) = self.expiry.peek() {
            if expires_at > now_us {
                break;
            }
            self.expiry.pop();
            let node = self.nodes[raw as usize];
            // Stale unless the block is still in its bucket from the push this entry belongs to.
            if node.place == Place::Bucket && node.stamp == stamp && node.priority != D {
                self.remove(BlockId(raw));
                let node = &mut self.nodes[raw as usize];
                node.priority = D;
                node.place = Place::Demoted;
                self.demoted.insert((stamp, raw));
                self.num_cached += 1;
            }
        }
    }

    /// Drops the expiry entries whose block is no longer in its bucket from the same push.
    /// O(heap).
    fn drop_stale_expiries(&mut self) {
        let nodes = &self.nodes;
        self.expiry.retain(|&Reverse((_, stamp, raw))| {
            let node = &nodes[raw as usize];
            node.place == Place::Bucket && node.stamp == stamp && node.priority != D
        });
    }

    #[inline]
    fn link_between(&mut self, node: u32, before: u32, after: u32) {
        self.nodes[node as usize].prev = before;
        self.nodes[node as usize].next = after;
        self.nodes[before as usize].next = node;
        self.nodes[after as usize].prev = node;
    }

    #[inline]
    fn unlink(&mut self, node: u32) {
        let Node { prev, next, .. } = self.nodes[node as usize];
        self.nodes[prev as usize].next = next;
        self.nodes[next as usize].prev = prev;
        self.nodes[node as usize].prev = DETACHED;
        self.nodes[node as usize].next = DETACHED;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ret(priority: u8, expires_at_us: Option<u64>) -> Retention {
        Retention { priority, expires_at_us }
    }

    fn ids(q: &EvictionQueue) -> Vec<u32> {
        q.iter().map(|b| b.0).collect()
    }

    fn drain(q: &mut EvictionQueue, now: u64) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(b) = q.pop_front(now) {
            q.check().unwrap();
            out.push(b.0);
        }
        out
    }

    /// A queue of `n` blocks, none queued.
    fn empty(n: usize) -> EvictionQueue {
        let mut q = EvictionQueue::new_full(n).unwrap();
        while q.pop_front(0).is_some() {}
        q
    }

    #[test]
    fn retention_default() {
        assert_eq!(Retention::default(), Retention::DEFAULT);
        assert_eq!(Retention::DEFAULT, ret(D, None));
    }

    #[test]
    fn new_full_order() {
        let mut q = EvictionQueue::new_full(4).unwrap();
        q.check().unwrap();
        assert_eq!(q.len(), 4);
        assert_eq!(q.num_uncached(), 4);
        assert_eq!(ids(&q), vec![0, 1, 2, 3]);
        assert_eq!(q.priority_of(BlockId(0)), None);
        assert_eq!(q.peek_evictable(0), None);
        assert_eq!(drain(&mut q, 0), vec![0, 1, 2, 3]);
        assert!(q.is_empty());

        let mut z = EvictionQueue::new_full(0).unwrap();
        assert!(z.is_empty());
        assert_eq!(z.pop_front(0), None);
        assert!(!z.contains(BlockId(0)));
        assert!(!z.remove(BlockId(0)));
        z.check().unwrap();
    }

    #[test]
    fn uncached_before_cached() {
        let mut q = empty(6);
        q.push_cached(BlockId(0), ret(0, None), 0);
        q.push_uncached(BlockId(1));
        q.push_cached(BlockId(2), ret(100, None), 0);
        q.push_uncached(BlockId(3));
        q.check().unwrap();
        assert_eq!(q.num_uncached(), 2);
        assert_eq!(q.len(), 4);
        // Uncached: most recently pushed first; then cached by priority.
        assert_eq!(ids(&q), vec![3, 1, 0, 2]);
        assert_eq!(q.peek_evictable(0), Some((BlockId(0), 0)));
        assert_eq!(drain(&mut q, 0), vec![3, 1, 0, 2]);
    }

    #[test]
    fn lowest_priority_first_and_lru_within_priority() {
        let mut q = empty(8);
        q.push_cached(BlockId(0), ret(50, None), 0);
        q.push_cached(BlockId(1), ret(10, None), 0);
        q.push_cached(BlockId(2), ret(50, None), 0);
        q.push_cached(BlockId(3), Retention::DEFAULT, 0);
        q.push_cached(BlockId(4), ret(10, None), 0);
        q.push_cached(BlockId(5), ret(100, None), 0);
        q.push_cached(BlockId(6), Retention::DEFAULT, 0);
        q.check().unwrap();
        assert_eq!(q.priority_of(BlockId(5)), Some(100));
        assert_eq!(ids(&q), vec![1, 4, 3, 6, 0, 2, 5]);
        assert_eq!(drain(&mut q, 0), vec![1, 4, 3, 6, 0, 2, 5]);
    }

    #[test]
    fn expiry_demotes_at_the_right_time_keeping_lru_position() {
        let mut q = empty(6);
        q.push_cached(BlockId(0), Retention::DEFAULT, 0); // stamp 0
        q.push_cached(BlockId(1), ret(90, Some(100)), 0); // stamp 1, demoted at 100
        q.push_cached(BlockId(2), Retention::DEFAULT, 0); // stamp 2
        q.push_cached(BlockId(3), ret(20, Some(50)), 0); // stamp 3: low priority until 50
        q.push_cached(BlockId(4), ret(90, Some(1_000)), 0); // stamp 4
        assert_eq!(q.peek_evictable(49), Some((BlockId(3), 20)));
        assert_eq!(ids(&q), vec![3, 0, 2, 1, 4]);
        // At 50 block 3 rises to the default, behind the older default blocks 0 and 2.
        assert_eq!(q.peek_evictable(50), Some((BlockId(0), D)));
        assert_eq!(q.priority_of(BlockId(3)), Some(D));
        assert_eq!(ids(&q), vec![0, 2, 3, 1, 4]);
        // Just before 100 block 1 still has 90; at 100 it falls to the default between 0 and 2.
        assert_eq!(q.peek_evictable(99), Some((BlockId(0), D)));
        assert_eq!(q.priority_of(BlockId(1)), Some(90));
        assert_eq!(q.pop_front(100), Some(BlockId(0)));
        assert_eq!(q.priority_of(BlockId(1)), Some(D));
        assert_eq!(ids(&q), vec![1, 2, 3, 4]);
        q.check().unwrap();
        assert_eq!(drain(&mut q, 100), vec![1, 2, 3, 4]);
    }

    #[test]
    fn expired_on_push_enters_at_default() {
        let mut q = empty(3);
        q.push_cached(BlockId(0), ret(100, Some(10)), 10);
        q.push_cached(BlockId(1), ret(0, Some(5)), 10);
        q.push_cached(BlockId(2), ret(40, Some(11)), 10);
        assert_eq!(q.priority_of(BlockId(0)), Some(D));
        assert_eq!(q.priority_of(BlockId(1)), Some(D));
        assert_eq!(q.priority_of(BlockId(2)), Some(40));
        assert!(q.expiry.len() == 1, "only block 2 has a pending demotion");
        assert_eq!(drain(&mut q, 10), vec![0, 1, 2]);
    }

    #[test]
    fn remove_from_either_part() {
        let mut q = empty(6);
        q.push_uncached(BlockId(0));
        q.push_uncached(BlockId(1));
        q.push_cached(BlockId(2), ret(70, Some(5)), 0);
        q.push_cached(BlockId(3), ret(10, None), 0);
        q.push_cached(BlockId(4), Retention::DEFAULT, 0);
        assert!(q.remove(BlockId(0)));
        assert!(!q.remove(BlockId(0)));
        assert!(q.remove(BlockId(2)));
        assert!(!q.remove(BlockId(2)));
        assert!(!q.remove(BlockId(5)));
        assert!(!q.remove(BlockId(99)));
        assert!(!q.contains(BlockId(0)) && !q.contains(BlockId(2)) && !q.contains(BlockId(99)));
        assert_eq!(q.priority_of(BlockId(2)), None);
        q.check().unwrap();
        assert_eq!(q.len(), 3);
        assert_eq!(q.num_uncached(), 1);
        // Re-push block 2 at a new priority: its stale expiry entry must not demote it.
        q.push_cached(BlockId(2), ret(80, None), 1);
        assert_eq!(q.peek_evictable(10), Some((BlockId(3), 10)));
        assert_eq!(q.priority_of(BlockId(2)), Some(80));
        q.check().unwrap();
        assert_eq!(drain(&mut q, 10), vec![1, 3, 4, 2]);
    }

    #[test]
    fn peek_evictable_agrees_with_pop_front() {
        let mut q = empty(10);
        for i in 0..10u32 {
            let expiry = (i % 3 == 0).then_some(u64::from(i) * 7);
            q.push_cached(BlockId(i), ret(((i * 37) % 101) as u8, expiry), 0);
        }
        let mut now = 0;
        while let Some((b, p)) = q.peek_evictable(now) {
            assert_eq!(q.priority_of(b), Some(p));
            assert_eq!(q.pop_front(now), Some(b));
            q.check().unwrap();
            now += 5;
        }
        assert!(q.is_empty());
    }

    #[test]
    fn expiry_heap_stays_bounded() {
        let mut q = empty(4);
        for i in 0..10_000u64 {
            let b = BlockId((i % 4) as u32);
            q.push_cached(b, ret(90, Some(u64::MAX)), i);
            assert!(q.expiry.len() <= 2 * q.num_cached + HEAP_SLACK + 1);
            if i % 2 == 0 {
                assert!(q.remove(b));
            } else {
                q.pop_front(i);
            }
        }
        q.check().unwrap();
    }

    // ---- property test against a naive model ----

    #[derive(Debug, Clone)]
    enum Op {
        PushUncached(usize),
        /// (pick, priority, expiry relative to now: None, or now + delta - 5, floored at 0)
        PushCached(usize, u8, Option<u8>),
        Remove(u32),
        Pop,
        Peek,
        Advance(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let priority = prop_oneof![Just(D), Just(0u8), Just(MAX_RETENTION_PRIORITY), Just(50u8), 0u8..=100];
        prop_oneof![
            2 => any::<usize>().prop_map(Op::PushUncached),
            5 => (any::<usize>(), priority, prop::option::of(0u8..40)).prop_map(|(i, p, e)| Op::PushCached(i, p, e)),
            2 => (0u32..14).prop_map(Op::Remove),
            4 => Just(Op::Pop),
            1 => Just(Op::Peek),
            2 => (0u8..10).prop_map(Op::Advance),
        ]
    }

    /// Naive model: uncached as a stack, cached as a list scanned for the minimum.
    #[derive(Default)]
    struct Model {
        uncached: Vec<u32>,
        /// (block, priority as pushed, expiry, stamp)
        cached: Vec<(u32, u8, Option<u64>, u64)>,
        next_stamp: u64,
    }

    impl Model {
        fn effective(p: u8, e: Option<u64>, now: u64) -> u8 {
            if e.is_some_and(|t| t <= now) {
                D
            } else {
                p
            }
        }
        fn contains(&self, b: u32) -> bool {
            self.uncached.contains(&b) || self.cached.iter().any(|c| c.0 == b)
        }
        fn cached_order(&self, now: u64) -> Vec<(u32, u8)> {
            let mut v: Vec<(u8, u64, u32)> =
                self.cached.iter().map(|&(b, p, e, s)| (Self::effective(p, e, now), s, b)).collect();
            v.sort();
            v.into_iter().map(|(p, _, b)| (b, p)).collect()
        }
        fn min_cached(&self, now: u64) -> Option<usize> {
            (0..self.cached.len()).min_by_key(|&i| {
                let (_, p, e, s) = self.cached[i];
                (Self::effective(p, e, now), s)
            })
        }
        fn pop(&mut self, now: u64) -> Option<u32> {
            if let Some(b) = self.uncached.pop() {
                return Some(b);
            }
            let i = self.min_cached(now)?;
            Some(self.cached.remove(i).0)
        }
        fn remove(&mut self, b: u32) -> bool {
            if let Some(i) = self.uncached.iter().position(|&x| x == b) {
                self.uncached.remove(i);
                return true;
            }
            if let Some(i) = self.cached.iter().position(|c| c.0 == b) {
                self.cached.remove(i);
                return true;
            }
            false
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn matches_naive_model(start_full in any::<bool>(), ops in prop::collection::vec(op(), 1..200)) {
            let n = 12usize;
            let mut q = EvictionQueue::new_full(n).unwrap();
            let mut m = Model::default();
            if start_full {
                m.uncached = (0..n as u32).rev().collect();
            } else {
                while q.pop_front(0).is_some() {}
            }
            let mut now = 0u64;
            for op in ops {
                // Blocks not queued, for the pushes.
                let held: Vec<u32> = (0..n as u32).filter(|&b| !m.contains(b)).collect();
                let mut demoted_at = None;
                match op {
                    Op::PushUncached(i) if !held.is_empty() => {
                        let b = held[i % held.len()];
                        q.push_uncached(BlockId(b));
                        m.uncached.push(b);
                    }
                    Op::PushCached(i, p, e) if !held.is_empty() => {
                        let b = held[i % held.len()];
                        let expiry = e.map(|d| (now + u64::from(d)).saturating_sub(5));
                        q.push_cached(BlockId(b), ret(p, expiry), now);
                        m.cached.push((b, p, expiry, m.next_stamp));
                        m.next_stamp += 1;
                        // A retention expired on push enters at the default at once.
                        let want = Model::effective(p, expiry, now);
                        prop_assert_eq!(q.priority_of(BlockId(b)), Some(want));
                    }
                    Op::PushUncached(_) | Op::PushCached(..) => {}
                    Op::Remove(b) => {
                        prop_assert_eq!(q.remove(BlockId(b)), m.remove(b));
                    }
                    Op::Pop => {
                        let want = m.pop(now);
                        prop_assert_eq!(q.pop_front(now).map(|b| b.0), want);
                        demoted_at = Some(now);
                    }
                    Op::Peek => {
                        let want = m.min_cached(now).map(|i| {
                            let (b, p, e, _) = m.cached[i];
                            (BlockId(b), Model::effective(p, e, now))
                        });
                        prop_assert_eq!(q.peek_evictable(now), want);
                        demoted_at = Some(now);
                    }
                    Op::Advance(dt) => now += u64::from(dt),
                }
                q.check().unwrap();
                prop_assert_eq!(q.len(), m.uncached.len() + m.cached.len());
                prop_assert_eq!(q.num_uncached(), m.uncached.len());
                prop_assert_eq!(q.is_empty(), m.uncached.is_empty() && m.cached.is_empty());
                for b in 0..n as u32 + 2 {
                    prop_assert_eq!(q.contains(BlockId(b)), m.contains(b));
                }
                // Right after a demotion pass, priorities and the reuse order match the model.
                if let Some(t) = demoted_at {
                    let order = m.cached_order(t);
                    for &(b, p) in &order {
                        prop_assert_eq!(q.priority_of(BlockId(b)), Some(p));
                    }
                    let want: Vec<u32> =
                        m.uncached.iter().rev().copied().chain(order.iter().map(|&(b, _)| b)).collect();
                    prop_assert_eq!(ids(&q), want);
                }
            }
            // Draining gives the model's order.
            now += 1000;
            while let Some(want) = m.pop(now) {
                prop_assert_eq!(q.pop_front(now), Some(BlockId(want)));
            }
            prop_assert_eq!(q.pop_front(now), None);
            q.check().unwrap();
        }
    }
}
