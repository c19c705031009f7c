//! Unit tests of the manager: slots, prefix hits, fork and copy-on-write, stale ids.

use super::*;
use crate::block_hash::HashMode;

fn mgr(n: usize, bs: usize) -> KvCacheManager {
    KvCacheManager::new(n, bs, true, HashMode::Xxh3).unwrap()
}

fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

#[test]
fn seven_tokens_hold_two_blocks() {
    let mut m = mgr(8, 4);
    let (s, hit) = m.add_sequence(AddSequence::new(toks(0..7), ExtraKey::new(None)));
    assert_eq!(hit, 0);
    assert!(m.allocate_slots(s, 7).unwrap());
    assert_eq!(m.seq(s).unwrap().table().len(), 2);
    assert_eq!(m.pool().num_free(), 6);
    m.check_invariants().unwrap();
    // 8th token fits in the second block; 9th needs a third.
    assert!(m.append_token_with_slot(s, 7).unwrap());
    assert_eq!(m.seq(s).unwrap().table().len(), 2);
    assert!(m.append_token_with_slot(s, 8).unwrap());
    assert_eq!(m.seq(s).unwrap().table().len(), 3);
    m.free(s).unwrap();
    assert_eq!(m.pool().num_free(), 8);
    m.check_invariants().unwrap();
}

#[test]
fn allocation_failure_changes_nothing() {
    let mut m = mgr(2, 4);
    let (s, _) = m.add_sequence(AddSequence::new(toks(0..12), ExtraKey::new(None)));
    assert!(!m.allocate_slots(s, 12).unwrap());
    assert_eq!(m.seq(s).unwrap().num_computed(), 0);
    assert!(m.allocate_slots(s, 8).unwrap());
    assert!(!m.append_token_with_slot(s, 99).unwrap_or(true) || m.seq(s).unwrap().num_tokens() == 12);
    assert_eq!(m.pool().num_free(), 0);
    m.check_invariants().unwrap();
    assert!(matches!(m.allocate_slots(s, 5), Err(CoreError::InvalidArgument(_))));
}

#[test]
fn prefix_hit_leaves_one_token_and_is_verified() {
    let mut m = mgr(16, 4);
    let prompt = toks(0..10);
    let (a, hit) = m.add_sequence(AddSequence::new(prompt.clone(), ExtraKey::new(None)));
    assert_eq!(hit, 0);
    m.allocate_slots(a, 10).unwrap();
    // Same prompt: two full blocks (8 tokens) cached, 2 left to compute.
    let (b, hit) = m.add_sequence(AddSequence::new(prompt.clone(), ExtraKey::new(None)));
    assert_eq!(hit, 8);
    assert_eq!(m.seq(b).unwrap().table().blocks(), &m.seq(a).unwrap().table().blocks()[..2]);
    // A prompt of exactly 8 tokens: at most 1 block may hit (one token must be computed).
    let (c, hit) = m.add_sequence(AddSequence::new(toks(0..8), ExtraKey::new(None)));
    assert_eq!(hit, 4);
    // Another salt: no hit.
    let (d, hit) = m.add_sequence(AddSequence::new(prompt, ExtraKey::new(Some("other"))));
    assert_eq!(hit, 0);
    m.check_invariants().unwrap();
    for s in [a, b, c, d] {
        m.free(s).unwrap();
    }
    assert_eq!(m.pool().num_free(), 16);
    m.check_invariants().unwrap();
    assert_eq!(m.prefix_counters(), PrefixCounters { queries: 38, hits: 12, host_hits: 0, disk_hits: 0, window_hits: 0 });
}

#[test]
fn freed_sequence_blocks_stay_findable() {
    let mut m = mgr(4, 2);
    let (a, _) = m.add_sequence(AddSequence::new(toks(0..5), ExtraKey::new(None)));
    m.allocate_slots(a, 5).unwrap();
    m.free(a).unwrap();
    let (b, hit) = m.add_sequence(AddSequence::new(toks(0..5), ExtraKey::new(None)));
    assert_eq!(hit, 4);
    assert_eq!(m.pool().num_free(), 2);
    m.free(b).unwrap();
}

#[test]
fn fork_then_copy_on_write() {
    let mut m = mgr(8, 4);
    let (a, _) = m.add_sequence(AddSequence::new(toks(0..6), ExtraKey::new(None)));
    m.allocate_slots(a, 6).unwrap();
    let b = m.fork(a).unwrap();
    let shared_last = m.seq(a).unwrap().table().blocks()[1];
    assert_eq!(m.pool().ref_count(shared_last).unwrap(), 2);
    m.check_invariants().unwrap();
    // a writes position 6 into the shared partial block: it gets a private copy.
    assert!(m.append_token_with_slot(a, 100).unwrap());
    let a_last = m.seq(a).unwrap().table().blocks()[1];
    assert_ne!(a_last, shared_last);
    assert_eq!(m.take_copy_ops(), vec![(shared_last, a_last)]);
    // b is now the only holder and writes in place, without a copy.
    assert!(m.append_token_with_slot(b, 200).unwrap());
    assert_eq!(m.seq(b).unwrap().table().blocks()[1], shared_last);
    assert!(m.take_copy_ops().is_empty());
    // The first (full) block stays shared.
    assert_eq!(m.pool().ref_count(m.seq(a).unwrap().table().blocks()[0]).unwrap(), 2);
    m.check_invariants().unwrap();
    m.free(a).unwrap();
    m.free(b).unwrap();
    assert_eq!(m.pool().num_free(), 8);
}

#[test]
fn stale_and_unknown_ids() {
    let mut m = mgr(4, 4);
    let (a, _) = m.add_sequence(AddSequence::new(toks(0..3), ExtraKey::new(None)));
    m.free(a).unwrap();
    assert_eq!(m.free(a), Err(CoreError::UnknownSequence(a.0)));
    let (b, _) = m.add_sequence(AddSequence::new(toks(0..3), ExtraKey::new(None)));
    assert_eq!(a.key().slot, b.key().slot);
    assert!(m.seq(a).is_err());
    assert!(m.seq(b).is_ok());
    assert!(m.allocate_slots(SeqId(12345), 1).is_err());
}
