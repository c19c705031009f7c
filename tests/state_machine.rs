//! Property-based state machines over the Rust core, against simple models.
//!
//! `pool_*`: random allocate / free / fork on a `BlockPool` against a model of ref counts.
//! `manager_*`: random sequences (shared prompt prefixes, salts) driven through add (prefix
//! lookup), slot allocation (chunks and decodes, with copy-on-write), fork, free and cache
//! reset on a `KvCacheManager`, with a simulated KV cache: like real KV, what a slot holds
//! depends on the token at that position *and on the whole prefix before it* (a digest of
//! `tokens[..=pos]`); copy ops copy whole blocks. After every step the invariants hold and every
//! live sequence reads back exactly its own tokens through its block table — the property
//! attention depends on. At the end every sequence is freed and the pool must be whole.
//! With KV cache groups (several groups, some of them sliding or chunked) every group
//! writes its own content (the digest tagged with the group), so a block that two groups
//! or two sequences both believe theirs shows up as a wrong read; a sliding group reads back
//! every position a future query can see, and holds no more blocks than that needs.

#![allow(clippy::needless_range_loop)] // positions index both the tokens and the block table

use pagedkv::attention_span::AttentionSpan;
use pagedkv::block_hash::{ExtraKey, HashMode};
use pagedkv::block_pool::BlockPool;
use pagedkv::ids::{BlockId, SeqId};
use pagedkv::kv_cache_manager::{AddSequence, KvCacheManager};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum PoolOp {
    Allocate(usize),
    Free(usize),
    Fork(usize),
    FreeBogus(u32),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        (0usize..6).prop_map(PoolOp::Allocate),
        any::<usize>().prop_map(PoolOp::Free),
        any::<usize>().prop_map(PoolOp::Fork),
        (0u32..40).prop_map(PoolOp::FreeBogus),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_ref_count_model(ops in prop::collection::vec(pool_op(), 1..120)) {
        let n = 16;
        let mut pool = BlockPool::new(n, 4, false, HashMode::Xxh3).unwrap();
        let mut model = vec![0u32; n];
        // Handles the test holds: one entry per reference.
        let mut held: Vec<BlockId> = Vec::new();
        for op in ops {
            match op {
                PoolOp::Allocate(k) => {
                    let free = model.iter().filter(|&&r| r == 0).count();
                    match pool.allocate(k) {
                        Some(blocks) => {
                            prop_assert!(k <= free);
                            for b in blocks {
                                prop_assert_eq!(model[b.index()], 0);
                                model[b.index()] = 1;
                                held.push(b);
                            }
                        }
                        None => prop_assert!(k > free),
                    }
                }
                PoolOp::Free(i) if !held.is_empty() => {
                    let b = held.swap_remove(i % held.len());
                    pool.free(&[b]).unwrap();
                    model[b.index()] -= 1;
                }
                PoolOp::Fork(i) if !held.is_empty() => {
                    let b = held[i % held.len()];
                    pool.fork(&[b]).unwrap();
                    model[b.index()] += 1;
                    held.push(b);
                }
                PoolOp::FreeBogus(raw) => {
                    let b = BlockId(raw);
                    let before: Vec<u32> = (0..n).map(|i| pool.ref_count(BlockId(i as u32)).unwrap()).collect();
                    let valid = (raw as usize) < n && model[raw as usize] > 0;
                    if !valid {
                        prop_assert!(pool.free(&[b]).is_err());
                        let after: Vec<u32> = (0..n).map(|i| pool.ref_count(BlockId(i as u32)).unwrap()).collect();
                        prop_assert_eq!(before, after);
                    }
                }
                _ => {}
            }
            pool.check_invariants().unwrap();
            for (i, &r) in model.iter().enumerate() {
                prop_assert_eq!(pool.ref_count(BlockId(i as u32)).unwrap(), r);
            }
        }
        pool.free(&held).unwrap();
        prop_assert_eq!(pool.num_free(), n);
        pool.check_invariants().unwrap();
    }
}

#[derive(Debug, Clone)]
enum SeqOp {
    /// New sequence: base prompt index, extra suffix length, salt choice; `keep_all`: it keeps
    /// every block of every group (a `hold_kv` request's, whose KV another engine reads).
    Add { base: usize, suffix: usize, salt: u8, keep_all: bool },
    /// A KV-transfer reservation for a new prompt: its fresh blocks are written (the KV
    /// arriving), then committed into the prefix cache or cancelled.
    Transfer { base: usize, suffix: usize, commit: bool },
    /// Give slots to up to `n` pending tokens of a sequence.
    Allocate { seq: usize, n: usize },
    /// Append a token and give it a slot (decode step).
    Decode { seq: usize, token: u32 },
    /// Append tokens without slots (e.g. a user message of a multi-turn chat).
    Extend { seq: usize, len: usize },
    Fork { seq: usize },
    Free { seq: usize },
    ResetCache,
}

fn seq_op() -> impl Strategy<Value = SeqOp> {
    prop_oneof![
        3 => (0usize..4, 0usize..12, 0u8..3, prop::bool::weighted(0.2))
            .prop_map(|(base, suffix, salt, keep_all)| SeqOp::Add { base, suffix, salt, keep_all }),
        1 => (0usize..4, 0usize..12, any::<bool>()).prop_map(|(base, suffix, commit)| SeqOp::Transfer { base, suffix, commit }),
        4 => (any::<usize>(), 1usize..14).prop_map(|(seq, n)| SeqOp::Allocate { seq, n }),
        4 => (any::<usize>(), 0u32..5).prop_map(|(seq, token)| SeqOp::Decode { seq, token }),
        1 => (any::<usize>(), 1usize..6).prop_map(|(seq, len)| SeqOp::Extend { seq, len }),
        2 => any::<usize>().prop_map(|seq| SeqOp::Fork { seq }),
        2 => any::<usize>().prop_map(|seq| SeqOp::Free { seq }),
        1 => Just(SeqOp::ResetCache),
    ]
}

/// Digests of every prefix of `tokens`: `out[pos]` stands for the KV of position `pos`.
fn prefix_digests(tokens: &[u32]) -> Vec<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ t as u64).wrapping_mul(0x0100_0000_01b3).rotate_left(17);
            h
        })
        .collect()
}

struct Model {
    bs: usize,
    kv: Vec<Option<u64>>,
    seqs: Vec<SeqId>,
    next_token: u32,
}

impl Model {
    /// `base` and `suffix` new token ids after it.
    fn prompt(&mut self, base: &[u32], suffix: usize) -> Vec<u32> {
        let mut tokens = base.to_vec();
        for _ in 0..suffix {
            tokens.push(self.next_token);
            self.next_token += 1;
        }
        tokens
    }

    fn apply_copies(&mut self, m: &mut KvCacheManager) {
        for (src, dst) in m.take_copy_ops() {
            for off in 0..self.bs {
                self.kv[dst.index() * self.bs + off] = self.kv[src.index() * self.bs + off];
            }
        }
    }

    /// Writes the tokens of the sequence's write window into the simulated cache, in every
    /// group.
    fn write_window(&mut self, m: &KvCacheManager, id: SeqId) {
        let s = m.seq(id).unwrap();
        let digests = prefix_digests(s.tokens());
        for (c, group) in s.kv_groups().iter().enumerate() {
            for pos in s.write_start()..s.num_computed() {
                let slot = group.table().slot(pos, self.bs) as usize;
                self.kv[slot] = Some(column_digest(digests[pos], c));
            }
        }
    }

    fn check_reads(&self, m: &KvCacheManager) -> Result<(), TestCaseError> {
        for &id in &self.seqs {
            let s = m.seq(id).unwrap();
            let digests = prefix_digests(s.tokens());
            for (c, (group, &span)) in s.kv_groups().iter().zip(m.spans()).enumerate() {
                // Every position the step in flight (its queries start at `write_start`) or a
                // later one can see is held and reads back.
                prop_assert!(group.num_released() * self.bs <= span.first_visible(s.write_start()), "group {} gave back a visible block", c);
                for pos in group.num_released() * self.bs..s.num_computed() {
                    let slot = group.table().slot(pos, self.bs) as usize;
                    prop_assert_eq!(self.kv[slot], Some(column_digest(digests[pos], c)), "sequence {} group {} position {}", id, c, pos);
                }
                // A sliding or chunked group holds no more blocks than its window needs for the
                // largest step this machine schedules (`Allocate` gives at most 13 slots),
                // unless the sequence keeps all its blocks (then it gave none back).
                if s.keeps_all() {
                    prop_assert_eq!(group.num_released(), 0, "group {} of a keep-all sequence gave blocks back", c);
                } else if let Some(bound) = span.max_live_blocks(13, self.bs) {
                    prop_assert!(group.held().len() <= bound, "group {} holds {} blocks, bound {}", c, group.held().len(), bound);
                }
            }
        }
        Ok(())
    }
}

/// What group `c` writes for a position whose prefix digest is `d` (group 0: `d` itself).
fn column_digest(d: u64, c: usize) -> u64 {
    d ^ (c as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn run_manager_machine(ops: Vec<SeqOp>, hash_mode: HashMode) -> Result<(), TestCaseError> {
    run_columns_machine(ops, hash_mode, vec![AttentionSpan::Full])
}

fn run_columns_machine(ops: Vec<SeqOp>, hash_mode: HashMode, spans: Vec<AttentionSpan>) -> Result<(), TestCaseError> {
    let bs = 4;
    let n = 24 * spans.len();
    let mut m = KvCacheManager::new(n, bs, true, hash_mode).unwrap().with_kv_groups(spans).unwrap();
    let mut model = Model { bs, kv: vec![None; n * bs], seqs: Vec::new(), next_token: 1000 };
    // Base prompts: three share a first block, so hits of different depths happen; the
    // fourth starts differently, so a wrong first-block hit would be visible.
    let bases: [Vec<u32>; 4] = [
        (0..9).collect(),
        (0..4).chain(50..57).collect(),
        (0..4).chain(50..54).chain(90..95).collect(),
        (20..31).collect(),
    ];
    for op in ops {
        match op {
            SeqOp::Add { base, suffix, salt, keep_all } => {
                let tokens = model.prompt(&bases[base], suffix);
                let key = match salt {
                    0 | 1 => ExtraKey::new(None),
                    _ => ExtraKey::new(Some("tenant")),
                };
                let len = tokens.len();
                let found = m.match_prefix(&tokens, &key);
                let (id, hit) = m.add_sequence(AddSequence { prefix: Some(found), keep_all, ..AddSequence::new(tokens, key) });
                prop_assert!(hit % bs == 0 && hit < len);
                prop_assert_eq!(m.seq(id).unwrap().keeps_all(), keep_all);
                model.seqs.push(id);
            }
            SeqOp::Transfer { base, suffix, commit } => {
                let tokens = model.prompt(&bases[base], suffix);
                let full = (tokens.len() - 1) / bs;
                if let Some((id, hits)) = m.reserve_prefix(tokens, ExtraKey::new(None), full) {
                    prop_assert!(hits <= full);
                    // The KV arrives in the fresh blocks of every group (its write window).
                    model.write_window(&m, id);
                    if commit {
                        m.free(id).unwrap();
                    } else {
                        m.free_discarding_window(id).unwrap();
                    }
                }
            }
            SeqOp::Allocate { seq, n: want } if !model.seqs.is_empty() => {
                let id = model.seqs[seq % model.seqs.len()];
                let k = want.min(m.seq(id).unwrap().num_pending());
                let before = m.seq(id).unwrap().num_computed();
                let free_before = m.pool().num_free();
                let needed = m.blocks_needed(id, k).unwrap();
                if m.allocate_slots(id, k).unwrap() {
                    prop_assert!(needed <= free_before);
                    model.apply_copies(&mut m);
                    model.write_window(&m, id);
                } else {
                    prop_assert!(needed > free_before);
                    prop_assert_eq!(m.seq(id).unwrap().num_computed(), before);
                    prop_assert_eq!(m.pool().num_free(), free_before);
                }
            }
            SeqOp::Decode { seq, token } if !model.seqs.is_empty() => {
                let id = model.seqs[seq % model.seqs.len()];
                if m.seq(id).unwrap().num_pending() == 0 && m.append_token_with_slot(id, token).unwrap() {
                    model.apply_copies(&mut m);
                    model.write_window(&m, id);
                }
            }
            SeqOp::Extend { seq, len } if !model.seqs.is_empty() => {
                let id = model.seqs[seq % model.seqs.len()];
                let toks: Vec<u32> = (0..len as u32).map(|i| 7 + i).collect();
                m.append_tokens(id, &toks).unwrap();
            }
            SeqOp::Fork { seq } if !model.seqs.is_empty() => {
                let id = model.seqs[seq % model.seqs.len()];
                let child = m.fork(id).unwrap();
                model.seqs.push(child);
            }
            SeqOp::Free { seq } if !model.seqs.is_empty() => {
                let id = model.seqs.swap_remove(seq % model.seqs.len());
                m.free(id).unwrap();
                prop_assert!(m.free(id).is_err());
            }
            SeqOp::ResetCache => {
                m.reset_prefix_cache();
            }
            _ => {}
        }
        m.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        model.check_reads(&m)?;
    }
    for id in model.seqs.drain(..) {
        m.free(id).unwrap();
    }
    m.check_invariants().unwrap();
    prop_assert_eq!(m.pool().num_free(), n);
    for b in 0..n {
        prop_assert_eq!(m.pool().ref_count(BlockId(b as u32)).unwrap(), 0);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn manager_reads_back_its_tokens(ops in prop::collection::vec(seq_op(), 1..150)) {
        run_manager_machine(ops, HashMode::Xxh3)?;
    }

    /// Every block hashes alike: only verification stands between a lookup and wrong KV.
    #[test]
    fn manager_survives_total_hash_collision(ops in prop::collection::vec(seq_op(), 1..150)) {
        run_manager_machine(ops, HashMode::Truncated(0))?;
    }

    /// 3-bit hashes: frequent collisions, yet chains of several blocks get cached, so parent
    /// links (and their generations) must be verified too.
    #[test]
    fn manager_survives_frequent_hash_collisions(ops in prop::collection::vec(seq_op(), 1..150)) {
        run_manager_machine(ops, HashMode::Truncated(3))?;
    }

    /// KV cache groups: a full group and a sliding one (Gemma's shape).
    #[test]
    fn columns_read_back_their_tokens(ops in prop::collection::vec(seq_op(), 1..150)) {
        run_columns_machine(ops, HashMode::Xxh3, vec![AttentionSpan::Full, AttentionSpan::SlidingWindow(6)])?;
    }

    /// Sliding, chunked and full groups under frequent hash collisions: a hit must be
    /// verified in every group.
    #[test]
    fn mixed_columns_survive_hash_collisions(ops in prop::collection::vec(seq_op(), 1..150)) {
        run_columns_machine(
            ops,
            HashMode::Truncated(3),
            vec![AttentionSpan::SlidingWindow(5), AttentionSpan::ChunkedLocal(8), AttentionSpan::Full, AttentionSpan::SlidingWindow(1)],
        )?;
    }
}
