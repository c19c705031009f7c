//! KV cache groups in the KV-cache manager: one block table per group over one pool; a
//! sliding or chunked group gives back, in the step that leaves them behind, the blocks no
//! later query sees; they stay prefix-cache candidates; a prefix hit is what every group
//! serves; fork, swap and a failed step keep every group consistent; a sequence whose KV
//! travels to another engine (KV transfer) keeps every group whole.

use pagedkv::attention_span::AttentionSpan;
use pagedkv::block_hash::{ExtraKey, HashMode};
use pagedkv::ids::{BlockId, SeqId};
use pagedkv::kv_cache_manager::{AddSequence, KvCacheManager};

const BS: usize = 4;

fn manager(num_blocks: usize, spans: Vec<AttentionSpan>) -> KvCacheManager {
    KvCacheManager::new(num_blocks, BS, true, HashMode::Xxh3)
        .unwrap()
        .with_kv_groups(spans)
        .unwrap()
}

fn gemma_like(num_blocks: usize) -> KvCacheManager {
    manager(
        num_blocks,
        vec![AttentionSpan::Full, AttentionSpan::SlidingWindow(8)],
    )
}

/// Adds `prompt` and gives every prompt token a slot in one step.
fn prefill(m: &mut KvCacheManager, prompt: Vec<u32>) -> (SeqId, usize) {
    let len = prompt.len();
    let (s, hit) = m.add_sequence(AddSequence::new(prompt, ExtraKey::new(None)));
    assert!(m.allocate_slots(s, len - hit).unwrap());
    m.check_invariants().unwrap();
    (s, hit)
}

fn decode(m: &mut KvCacheManager, s: SeqId, steps: u32) {
    for t in 0..steps {
        assert!(m.append_token_with_slot(s, 1000 + t).unwrap());
        m.check_invariants().unwrap();
    }
}

/// How many leading entries each group of `s` has given back.
fn given_back(m: &KvCacheManager, s: SeqId) -> Vec<usize> {
    m.seq(s).unwrap().kv_groups().iter().map(|c| c.num_released()).collect()
}

fn held(m: &KvCacheManager, s: SeqId, group: usize) -> Vec<BlockId> {
    m.seq(s).unwrap().kv_groups()[group].held().to_vec()
}

#[test]
fn sliding_group_gives_back_blocks_behind_the_window() {
    let mut m = gemma_like(64);
    let (s, _) = prefill(&mut m, (0..6).collect());
    // One prefill step: nothing is behind any query yet.
    assert_eq!(held(&m, s, 1).len(), 2);
    for step in 0..40u32 {
        decode(&mut m, s, 1);
        let seq = m.seq(s).unwrap();
        let (full, sliding) = (&seq.kv_groups()[0], &seq.kv_groups()[1]);
        // The step's query sits at `write_start`: it sees the keys from write_start - 7 on.
        let first_seen = (seq.write_start() + 1).saturating_sub(8);
        assert_eq!(
            full.held().len(),
            seq.num_computed().div_ceil(BS),
            "step {step}"
        );
        assert_eq!(
            sliding.num_released(),
            first_seen / BS,
            "step {step}: given back as soon as behind"
        );
        assert!(sliding.table().blocks()[..sliding.num_released()]
            .iter()
            .all(|b| b.is_null()));
        assert!(
            sliding.held().len() <= 3,
            "a window of 8 over blocks of 4 needs at most 3"
        );
        // The pool counts exactly what the two groups hold.
        assert_eq!(
            m.pool().num_used(),
            full.held().len() + sliding.held().len()
        );
    }
    m.free(s).unwrap();
    assert_eq!(m.pool().num_free(), 64);
    m.check_invariants().unwrap();
}

#[test]
fn a_sliding_sequence_runs_in_a_bounded_pool() {
    // Every layer sliding (Mistral's shape): a sequence decodes forever in three blocks.
    let mut m = manager(3, vec![AttentionSpan::SlidingWindow(4)]);
    let (s, _) = prefill(&mut m, (0..3).collect());
    for _ in 0..200 {
        let needed = m.blocks_needed(s, 0).unwrap();
        assert_eq!(needed, 0);
        decode(&mut m, s, 1);
    }
    assert_eq!(m.seq(s).unwrap().num_computed(), 203);
    assert!(m.pool().num_used() <= 2);
}

#[test]
fn chunked_group_gives_back_whole_chunks() {
    let mut m = manager(32, vec![AttentionSpan::ChunkedLocal(8)]);
    let (s, _) = prefill(&mut m, (0..7).collect());
    decode(&mut m, s, 1); // the query at 7 still sees the chunk 0..8
    assert_eq!(m.seq(s).unwrap().kv_groups()[0].num_released(), 0);
    decode(&mut m, s, 1); // the query at 8 starts a chunk: blocks 0 and 1 are dead
    assert_eq!(m.seq(s).unwrap().kv_groups()[0].num_released(), 2);
    assert_eq!(held(&m, s, 0).len(), 1);
}

#[test]
fn given_back_blocks_stay_findable_and_a_sliding_group_serves_from_its_window() {
    let mut m = gemma_like(64);
    let prompt: Vec<u32> = (0..30).collect();
    let (a, _) = prefill(&mut m, prompt.clone());
    decode(&mut m, a, 1); // the sliding group gives back blocks 0..5 of the prompt
    assert_eq!(m.seq(a).unwrap().kv_groups()[1].num_released(), 5);
    m.free(a).unwrap();
    // Same prompt: 7 full blocks, both groups still cache them all.
    let (b, hit) = m.add_sequence(AddSequence::new(prompt.clone(), ExtraKey::new(None)));
    assert_eq!(hit, 28);
    let seq = m.seq(b).unwrap();
    // The full group takes every hit; the sliding one only what the query at 28 sees.
    assert_eq!(seq.kv_groups()[0].held().len(), 7);
    assert_eq!(seq.kv_groups()[1].num_released(), (29 - 8) / BS);
    assert_eq!(seq.kv_groups()[1].held().len(), 7 - (29 - 8) / BS);
    m.check_invariants().unwrap();
    assert!(m.allocate_slots(b, 2).unwrap());
    let full_blocks = held(&m, b, 0)[..7].to_vec();
    m.free(b).unwrap();

    // Groups hash apart: the same tokens in another group are other content.
    let full_first = m.match_prefix(&prompt, &ExtraKey::new(None));
    assert_eq!(full_first.groups.len(), 2);
    assert_ne!(full_first.groups[0].hashes[0], full_first.groups[1].hashes[0]);

    // Evict what the sliding group gave back first (released first, the last block first):
    // the full group still holds the whole prompt, and the sliding group the blocks a
    // query after it sees (5 and 6), each verified as a leaf of the full group's chain: the
    // whole prompt is still served.
    // 14 blocks are cached (7 per group) and 50 free without content: 54 new blocks evict 4.
    let filler = m
        .add_sequence(AddSequence::new((500..500 + 4 * 60).collect(), ExtraKey::new(Some("other"))))
        .0;
    assert!(m.allocate_slots(filler, 4 * 27).unwrap());
    assert!(
        full_blocks.iter().all(|&b| m.pool().is_cached(b)),
        "the full group's prompt blocks are still cached"
    );
    let after = m.match_prefix(&prompt, &ExtraKey::new(None));
    assert_eq!(after.num_blocks(), 7, "served from the window's last blocks");
    let live: Vec<_> = after.groups[1].hits[5..].iter().map(|h| h.block).collect();
    assert!(live.iter().all(|&b| !b.is_null() && m.pool().is_cached(b)), "{live:?}");
    // A sequence admitted on it reads the full group's 7 blocks and the sliding group's 2.
    let (c, hit) = m.add_sequence(AddSequence::new(prompt.clone(), ExtraKey::new(None)));
    assert_eq!(hit, 28);
    assert_eq!(m.seq(c).unwrap().kv_groups()[1].held(), &live[..]);
    m.free(c).unwrap();
    // Another prompt with the same first 20 tokens: the full group serves 5 blocks, and the
    // sliding group's blocks for them (3 and 4, what a query at 20 sees) were evicted, so the
    // longest prefix both serve is shorter (the query at 4 sees block 0, still cached).
    let mut other = prompt[..20].to_vec();
    other.extend(900..920);
    let partial = m.match_prefix(&other, &ExtraKey::new(None));
    assert!(partial.num_blocks() < 5, "{}", partial.num_blocks());
    m.free(filler).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn fork_swap_and_a_failed_step_keep_every_group() {
    let mut m = KvCacheManager::new(48, BS, true, HashMode::Xxh3)
        .unwrap()
        .with_kv_groups(vec![
            AttentionSpan::Full,
            AttentionSpan::SlidingWindow(6),
            AttentionSpan::ChunkedLocal(8),
        ])
        .unwrap()
        .with_host_tier(48)
        .unwrap();
    let (a, _) = prefill(&mut m, (0..13).collect());
    decode(&mut m, a, 6);
    let child = m.fork(a).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(
        m.seq(child).unwrap().kv_groups()[1].num_released(),
        m.seq(a).unwrap().kv_groups()[1].num_released()
    );
    // Both decode on: the shared partial block is copied in every group.
    decode(&mut m, a, 1);
    decode(&mut m, child, 1);
    assert_eq!(m.take_copy_ops().len(), 3);
    // Swap the child out and back: given-back entries stay null, the rest comes back.
    m.begin_step();
    let released = given_back(&m, child);
    assert!(m.swap_out(child).unwrap());
    m.end_step();
    m.check_invariants().unwrap();
    let (outs, _) = m.take_swap_ops();
    let held_total: usize = m.seq(child).unwrap().held_blocks().count();
    assert_eq!(
        outs.len(),
        held_total,
        "one copy per held block, none for given-back ones"
    );
    m.begin_step();
    assert!(m.swap_in(child).unwrap());
    m.end_step();
    m.check_invariants().unwrap();
    assert_eq!(given_back(&m, child), released);
    decode(&mut m, child, 3);
    // A failed step: its window is discarded in every group, and every block returns.
    assert!(m.append_token_with_slot(a, 7).unwrap());
    m.free_discarding_window(a).unwrap();
    m.free(child).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), 48);
}

#[test]
fn admission_cost_counts_only_the_live_hits() {
    let mut m = gemma_like(64);
    let prompt: Vec<u32> = (0..41).collect();
    let (a, _) = prefill(&mut m, prompt.clone());
    m.free(a).unwrap();
    // 10 cached blocks per group, all free: the full group revives 10, the sliding one only
    // the blocks the query at 40 sees (keys 33..): blocks 8 and 9. Plus one fresh block each.
    let hit = m.match_prefix(&prompt, &ExtraKey::new(None));
    assert_eq!(hit.num_blocks(), 10);
    assert_eq!(m.admission_cost(&hit, 1), 10 + 2 + 2);
    let before = m.pool().num_free();
    let (b, cached) = m.add_sequence(AddSequence { prefix: Some(hit), ..AddSequence::new(prompt, ExtraKey::new(None)) });
    assert_eq!(cached, 40);
    assert!(m.allocate_slots(b, 1).unwrap());
    assert_eq!(before - m.pool().num_free(), 14);
    m.check_invariants().unwrap();
}

#[test]
fn one_full_group_hashes_as_before_groups() {
    // Group 0's key is the sequence's own: KV events and routers see the same hashes.
    let key = ExtraKey::new(Some("salt"));
    assert_eq!(key.for_group(0), key);
    assert_ne!(key.for_group(1), key);
    let mut plain = KvCacheManager::new(16, BS, true, HashMode::Xxh3).unwrap();
    let mut one = manager(16, vec![AttentionSpan::Full]);
    let prompt: Vec<u32> = (0..9).collect();
    assert_eq!(
        plain.match_prefix(&prompt, &key).groups[0].hashes,
        one.match_prefix(&prompt, &key).groups[0].hashes
    );
}

#[test]
fn a_sequence_keeping_all_gives_nothing_back_and_reservations_fill_every_group() {
    // KV transfer (rust/scheduler/kv_transfer.rs): a hold_kv request's sequence keeps every
    // group whole, through admission on hits behind the window, decoding, fork and swap.
    let mut m = KvCacheManager::new(64, BS, true, HashMode::Xxh3)
        .unwrap()
        .with_kv_groups(vec![AttentionSpan::Full, AttentionSpan::SlidingWindow(6)])
        .unwrap()
        .with_host_tier(64)
        .unwrap();
    let prompt: Vec<u32> = (0..41).collect();
    let (a, _) = prefill(&mut m, prompt.clone());
    m.free(a).unwrap();
    // Every hit of every group is taken (the sliding group's behind the window too).
    let hit = m.match_prefix(&prompt, &ExtraKey::new(None));
    assert_eq!(m.admission_cost_keeping(&hit, 1, true), 2 * (10 + 1));
    let keeping = AddSequence { prefix: Some(hit), keep_all: true, ..AddSequence::new(prompt.clone(), ExtraKey::new(None)) };
    let (k, cached) = m.add_sequence(keeping);
    assert_eq!(cached, 40);
    assert!(m.allocate_slots(k, 1).unwrap());
    assert_eq!(m.pool().num_free(), 64 - 22);
    decode(&mut m, k, 9);
    let seq = m.seq(k).unwrap();
    assert!(seq.keeps_all());
    assert_eq!(given_back(&m, k), vec![0, 0]);
    assert_eq!(held(&m, k, 1).len(), 13, "50 tokens, every block held");
    // A fork keeps all too, and survives a swap out and in whole.
    let child = m.fork(k).unwrap();
    m.begin_step();
    assert!(m.swap_out(child).unwrap());
    m.end_step();
    m.begin_step();
    assert!(m.swap_in(child).unwrap());
    m.end_step();
    m.check_invariants().unwrap();
    decode(&mut m, child, 4);
    assert!(m.seq(child).unwrap().keeps_all());
    assert_eq!(given_back(&m, child), vec![0, 0]);
    m.free(child).unwrap();
    m.free(k).unwrap();
    m.check_invariants().unwrap();
    // A reservation: the cached prefix (10 blocks) is held in both groups, fresh blocks
    // after it in both.
    let longer: Vec<u32> = (0..57).collect();
    let free = m.pool().num_free();
    let (r, hits) = m
        .reserve_prefix(longer.clone(), ExtraKey::new(None), 14)
        .unwrap();
    assert_eq!(hits, 10);
    m.check_invariants().unwrap();
    for c in 0..2 {
        assert_eq!(held(&m, r, c).len(), 14);
    }
    assert_eq!(given_back(&m, r), vec![0, 0]);
    assert_eq!(
        free - m.pool().num_free(),
        2 * 14,
        "the cached hits taken, 4 fresh blocks each"
    );
    // Committed (freed): every group's chain reaches 14 blocks.
    m.free(r).unwrap();
    assert_eq!(
        m.match_prefix(&longer, &ExtraKey::new(None)).num_blocks(),
        14
    );
    // Cancelled: nothing past the hits.
    let other: Vec<u32> = (500..557).collect();
    let (r, hits) = m
        .reserve_prefix(other.clone(), ExtraKey::new(None), 14)
        .unwrap();
    assert_eq!(hits, 0);
    m.free_discarding_window(r).unwrap();
    assert_eq!(m.match_prefix(&other, &ExtraKey::new(None)).num_blocks(), 0);
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), 64);
}
