//! Unit tests of the tier ledger over a bare device pool: write-back on eviction, pins,
//! rollback, swap copies both ways, flush, disk loads and restores.

use super::*;

const BS: usize = 4;

fn device(n: usize) -> BlockPool {
    BlockPool::new(n, BS, true, HashMode::Xxh3).unwrap()
}

fn ledger(device: &mut BlockPool, host: usize, disk: usize) -> TierLedger {
    let mut l = TierLedger::default();
    l.set_host_tier(device, host, false).unwrap();
    l.set_disk_tier(device, disk, false).unwrap();
    l
}

fn toks(first: u32) -> Vec<u32> {
    (first..first + BS as u32).collect()
}

/// Registers a fresh device block holding `tokens` as a first block and frees it (cached);
/// returns it and its hash.
fn cache_free_block(device: &mut BlockPool, tokens: &[u32]) -> (BlockId, BlockHash) {
    let extra = ExtraKey::new(None);
    let hash = device.new_hasher().hash_block(None, &extra, tokens);
    let b = device.allocate_one().unwrap();
    device.register(b, hash, None, tokens, &extra).unwrap();
    device.release_ref_unchecked(b);
    (b, hash)
}

#[test]
fn evicted_device_block_is_written_back_and_pinned_until_end_step() {
    let mut dev = device(2);
    let mut l = ledger(&mut dev, 2, 0);
    let (b, hash) = cache_free_block(&mut dev, &toks(0));
    // Taking every device block evicts the cached one (uncached blocks go first).
    let taken = dev.allocate(2).unwrap();
    assert!(taken.contains(&b));
    l.write_back_evicted(&mut dev);
    let (outs, ins) = l.take_swap_ops();
    assert!(ins.is_empty());
    let [(src, h)] = outs[..] else { panic!("one write-back expected, got {outs:?}") };
    assert_eq!(src, b);
    let host = l.host().unwrap();
    assert_eq!(host.ref_count(h).unwrap(), 1, "the copy target is pinned");
    assert!(l.is_step_host_written(h));
    l.check_invariants(Vec::new()).unwrap();
    assert_eq!(l.counters().write_backs, 1);
    assert_eq!(l.counters().blocks_to_host, 1);
    l.end_step(&mut dev);
    assert_eq!(l.host().unwrap().ref_count(h).unwrap(), 0);
    let found = l.lookup(hash, None, &toks(0), &ExtraKey::new(None)).map(|(t, _)| t);
    assert_eq!(found, Some(TierBlock { tier: Tier::Host, block: h }));
    l.check_invariants(Vec::new()).unwrap();
}

#[test]
fn rollback_takes_back_every_copy_targets_identity() {
    let mut dev = device(2);
    let mut l = ledger(&mut dev, 2, 0);
    let (_, hash) = cache_free_block(&mut dev, &toks(0));
    dev.allocate(2).unwrap();
    l.begin_step();
    l.write_back_evicted(&mut dev);
    let (outs, _) = l.take_swap_ops();
    assert_eq!(outs.len(), 1);
    l.rollback_copies(&mut dev);
    assert!(!l.host().unwrap().is_cached(outs[0].1));
    assert!(!l.is_step_host_written(outs[0].1));
    assert!(l.lookup(hash, None, &toks(0), &ExtraKey::new(None)).is_none());
    // The pin stays until the plan ends.
    l.check_invariants(Vec::new()).unwrap();
    l.end_step(&mut dev);
    assert_eq!(l.host().unwrap().num_free(), 2);
}

#[test]
fn copy_out_then_copy_in_shares_what_is_still_cached() {
    let mut dev = device(4);
    let mut l = ledger(&mut dev, 2, 0);
    // A "sequence" of two device blocks, the first one cached.
    let extra = ExtraKey::new(None);
    let held = dev.allocate(2).unwrap();
    let hash = dev.new_hasher().hash_block(None, &extra, &toks(0));
    dev.register(held[0], hash, None, &toks(0), &extra).unwrap();
    let targets = l.copy_out(&dev, &[&held]).unwrap().expect("room for two blocks");
    assert_eq!(targets.len(), 1);
    let on_host = targets[0].clone();
    assert_eq!(on_host.len(), 2);
    let (outs, _) = l.take_swap_ops();
    assert_eq!(outs, vec![(held[0], on_host[0]), (held[1], on_host[1])]);
    assert!(l.host().unwrap().is_cached(on_host[0]), "the copy keeps the block's identity");
    // The caller releases the device blocks; the sequence holds the host blocks.
    for &d in &held {
        dev.release_ref_unchecked(d);
    }
    l.check_invariants(vec![1, 1]).unwrap();
    let c = l.counters();
    assert_eq!((c.swap_outs, c.blocks_to_host), (1, 2));
    // Back in: the cached block is shared again (still free on the device, so it counts), the
    // other one gets a fresh device block and a copy.
    assert_eq!(l.swap_in_cost(&dev, on_host.iter().copied()), 2);
    let back = l.copy_in(&mut dev, std::slice::from_ref(&on_host)).unwrap();
    assert_eq!(back[0][0], held[0]);
    let (_, ins) = l.take_swap_ops();
    assert_eq!(ins, vec![(on_host[1], back[0][1])]);
    // The host blocks are pins now (the sequence is on the device), released at end_step.
    l.check_invariants(vec![0, 0]).unwrap();
    l.end_step(&mut dev);
    assert_eq!(l.host().unwrap().num_free(), 2);
    assert_eq!(l.counters().swap_ins, 1);
}

#[test]
fn copy_out_without_room_changes_nothing() {
    let mut dev = device(4);
    let mut l = ledger(&mut dev, 1, 0);
    let held = dev.allocate(2).unwrap();
    assert_eq!(l.swap_out_copies(&dev, held.iter().copied()), Some(2));
    assert!(l.copy_out(&dev, &[&held]).unwrap().is_none());
    assert_eq!(l.take_swap_ops(), (vec![], vec![]));
    assert_eq!(l.host().unwrap().num_free(), 1);
    assert_eq!(l.counters(), TierCounters::default());
    // Without a host tier there is nowhere to go.
    let mut none = TierLedger::default();
    assert!(none.copy_out(&dev, &[&held]).unwrap().is_none());
    assert_eq!(none.swap_out_copies(&dev, held.iter().copied()), None);
}

#[test]
fn disk_tier_needs_a_host_tier_and_prefix_caching() {
    let mut dev = device(2);
    let mut l = TierLedger::default();
    assert!(matches!(l.set_disk_tier(&dev, 4, false), Err(CoreError::Config(_))));
    let mut uncached = BlockPool::new(2, BS, false, HashMode::Xxh3).unwrap();
    l.set_host_tier(&mut uncached, 2, false).unwrap();
    assert!(matches!(l.set_disk_tier(&uncached, 4, false), Err(CoreError::Config(_))));
    let mut l = TierLedger::default();
    l.set_host_tier(&mut dev, 2, false).unwrap();
    l.set_disk_tier(&dev, 4, false).unwrap();
    assert!(l.disk().is_some());
    assert_eq!(l.pools().count(), 2);
}

#[test]
fn flush_copies_cached_blocks_down_one_tier_per_pass() {
    let mut dev = device(2);
    let mut l = ledger(&mut dev, 2, 4);
    let (b, hash) = cache_free_block(&mut dev, &toks(0));
    // First pass: device -> host (the host has nothing for the disk yet).
    l.begin_step();
    assert_eq!(l.plan_flush(&mut dev), 1);
    l.end_step(&mut dev);
    let (outs, _) = l.take_swap_ops();
    assert_eq!(outs.len(), 1);
    assert_eq!(outs[0].0, b);
    // Second pass: host -> disk.
    l.begin_step();
    assert_eq!(l.plan_flush(&mut dev), 1);
    l.end_step(&mut dev);
    let (stores, loads) = l.take_disk_ops();
    assert!(loads.is_empty());
    let [(_, slot)] = stores[..] else { panic!("one disk store expected, got {stores:?}") };
    let (identity, tokens) = l.disk_block(slot).unwrap();
    assert_eq!((identity.hash, tokens), (hash, &toks(0)[..]));
    assert_eq!(l.plan_flush(&mut dev), 0, "every tier holds the block now");
    l.check_invariants(vec![0, 0]).unwrap();
    // A disk hit is read back into a pinned host block.
    let h = l.load_from_disk(slot).unwrap();
    assert_eq!(l.take_disk_ops().1, vec![(slot, h)]);
    assert_eq!(l.host().unwrap().ref_count(h).unwrap(), 1);
    l.check_invariants(vec![0, 0]).unwrap();
    l.end_step(&mut dev);
    assert_eq!(l.counters().blocks_from_disk, 1);
}

#[test]
fn restore_accepts_exact_links_only() {
    let mut dev = device(2);
    let mut l = ledger(&mut dev, 2, 4);
    let mut hasher = dev.new_hasher();
    let extra = ExtraKey::new(None);
    let first = hasher.hash_block(None, &extra, &toks(0));
    let second = hasher.hash_block(Some(first), &extra, &toks(4));
    // The child before its parent: not yet.
    assert_eq!(l.restore_disk_block(&mut hasher, &mut dev, second, Some(first), &toks(4), &extra), Restore::MissingParent);
    // A hash that the tokens do not produce: never.
    assert_eq!(l.restore_disk_block(&mut hasher, &mut dev, second, None, &toks(0), &extra), Restore::Rejected);
    let Restore::Done(p) = l.restore_disk_block(&mut hasher, &mut dev, first, None, &toks(0), &extra) else {
        panic!("the first block restores")
    };
    assert_eq!(l.restore_disk_block(&mut hasher, &mut dev, first, None, &toks(0), &extra), Restore::Rejected, "a duplicate");
    let Restore::Done(c) = l.restore_disk_block(&mut hasher, &mut dev, second, Some(first), &toks(4), &extra) else {
        panic!("the child restores after its parent")
    };
    let (parent, _) = l.disk_block(p).unwrap();
    let (child, _) = l.disk_block(c).unwrap();
    assert_eq!(child.parent, Some(parent.node));
    l.invalidate_disk_blocks(&[c, BlockId(999)]);
    assert!(l.disk_block(c).is_none());
    l.check_invariants(vec![0, 0]).unwrap();
    // No disk tier: nothing to restore into.
    let mut none = TierLedger::default();
    assert_eq!(none.restore_disk_block(&mut hasher, &mut dev, first, None, &toks(0), &extra), Restore::Rejected);
}
