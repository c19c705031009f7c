//! Unit tests of the scheduler internals: reused step buffers and statistics.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::attention_span::AttentionSpan;

/// Random workload (shared prefixes, n > 1 forks with copy-on-write, preemption, aborts,
/// finished samples) stepped with `schedule_into` over a ring of `ring` reused outputs: every
/// step's block tables equal the sequences' tables, zero padded, and every other array equals
/// what a fresh `StepOutput` would hold.
fn reused_outputs_match_fresh_ones(seed: u64, ring: usize, block_size: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cfg = SchedulerConfig::new(block_size, 640 / block_size);
    cfg.max_model_len = 200;
    cfg.max_num_seqs = 12;
    cfg.max_num_batched_tokens = 96;
    let mut s = Scheduler::new(cfg).unwrap();
    let system: Vec<u32> = (0..40).map(|_| rng.random_range(0..500)).collect();
    let mut outs: Vec<StepOutput> = (0..ring).map(|_| StepOutput::default()).collect();
    let mut next = 0usize;
    let mut widths_seen = std::collections::HashSet::new();
    for step in 0..1500 {
        if s.num_waiting() < 3 && next < 300 {
            let mut prompt = if rng.random_bool(0.5) { system.clone() } else { Vec::new() };
            prompt.extend((0..rng.random_range(1..60)).map(|_| rng.random_range(0..500u32)));
            let mut r = NewRequest::new(format!("q{next}"), prompt, rng.random_range(1..80));
            r.n = if rng.random_bool(0.2) { rng.random_range(2..4) } else { 1 };
            r.eos_token_ids = vec![7];
            s.add_request(r).unwrap();
            next += 1;
        }
        let out = &mut outs[step % ring];
        s.schedule_into(out).unwrap();
        let (rows, w) = (out.num_rows(), out.block_table_width);
        widths_seen.insert(w);
        assert_eq!(out.block_tables.len(), rows * w);
        for (r, &seq) in out.row_seqs.iter().enumerate() {
            let blocks = s.kv.seq(seq).unwrap().table().blocks();
            let row = &out.block_tables[r * w..(r + 1) * w];
            assert!(row[..blocks.len()].iter().zip(blocks).all(|(&d, b)| d == b.0 as i32), "step {step} row {r}");
            assert!(row[blocks.len()..].iter().all(|&d| d == 0), "step {step} row {r}: padding");
        }
        // The other arrays: a fresh build of the same rows gives the same values.
        let mut fresh = StepOutput::default();
        fresh.cu_seqlens_q.push(0);
        let scheduled: Vec<(SampleKey, SeqId)> = s
            .in_flight
            .as_ref()
            .unwrap()
            .scheduled
            .iter()
            .zip(&out.row_seqs)
            .map(|(&b, &q)| (b, q))
            .collect();
        let mut plan = StepPlan::default();
        s.build_rows(&scheduled, &mut fresh, &mut plan).unwrap();
        assert_eq!(fresh.input_ids, out.input_ids);
        assert_eq!(fresh.positions, out.positions);
        assert_eq!(fresh.slot_mapping, out.slot_mapping);
        assert_eq!(fresh.cu_seqlens_q, out.cu_seqlens_q);
        assert_eq!(fresh.seq_lens, out.seq_lens);
        assert_eq!(fresh.logits_indices, out.logits_indices);
        assert_eq!(fresh.sample_indices, out.sample_indices);
        assert_eq!(fresh.row_requests, out.row_requests);
        let sampled: Vec<u32> = (0..out.num_sampled()).map(|_| if rng.random_bool(0.03) { 7 } else { rng.random_range(0..500) }).collect();
        let step_id = out.step_id;
        let ups = s.update(step_id, &sampled).unwrap();
        for u in &ups {
            assert!(s.request_id(u.request).is_some(), "every updated request is named");
        }
        if rng.random_bool(0.05) {
            if let Some(u) = ups.first() {
                let id = s.request_id(u.request).unwrap().to_string();
                if rng.random_bool(0.5) {
                    let _ = s.abort_request(&id);
                } else {
                    let _ = s.finish_sample(&id, u.index);
                }
            }
        }
        s.check_invariants().unwrap();
    }
    assert!(s.counters.preemptions > 0, "the pool must be small enough to preempt");
    assert!(widths_seen.len() > 3);
}

#[test]
fn schedule_into_reused_buffers_match_fresh_outputs() {
    for (seed, ring, bs) in [(1, 1, 16), (2, 2, 4), (3, 3, 8), (4, 2, 1)] {
        reused_outputs_match_fresh_ones(seed, ring, bs);
    }
}

#[test]
fn schedule_into_equals_schedule() {
    let run = |reuse: bool| {
        let mut cfg = SchedulerConfig::new(4, 64);
        cfg.max_num_batched_tokens = 20;
        let mut s = Scheduler::new(cfg).unwrap();
        for i in 0..6u32 {
            let mut r = NewRequest::new(format!("r{i}"), (0..10 + i).collect(), 12);
            r.n = 1 + (i as usize % 2);
            s.add_request(r).unwrap();
        }
        let mut buf = StepOutput::default();
        let mut tables = Vec::new();
        while s.has_unfinished_requests() {
            let out = if reuse {
                s.schedule_into(&mut buf).unwrap();
                buf.clone()
            } else {
                s.schedule().unwrap()
            };
            tables.push((out.block_tables.clone(), out.block_table_width, out.input_ids.clone(), out.finished.clone()));
            let toks: Vec<u32> = (0..out.num_sampled() as u32).collect();
            s.update(out.step_id, &toks).unwrap();
        }
        tables
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn schedule_into_a_stale_step_leaves_no_rows() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 16)).unwrap();
    s.add_request(NewRequest::new("a", vec![1, 2, 3], 2)).unwrap();
    let mut out = StepOutput::default();
    s.schedule_into(&mut out).unwrap();
    assert_eq!(out.num_rows(), 1);
    assert!(matches!(s.schedule_into(&mut out), Err(CoreError::StaleOutput(_))));
    assert_eq!((out.num_rows(), out.block_tables.len()), (0, 0));
}

#[test]
fn kv_utilization_is_zero_with_nothing_in_use() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 16)).unwrap();
    let st = s.stats();
    assert_eq!((st.num_used_blocks, st.slots_allocated, st.tokens_held), (0, 0, 0));
    assert_eq!(st.kv_utilization, 0.0);
    // 3 tokens in one block of 4: 0.75 while running; 0 again once finished.
    s.add_request(NewRequest::new("a", vec![1, 2, 3], 1)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(s.stats().kv_utilization, 0.75);
    s.update(out.step_id, &[9]).unwrap();
    let st = s.stats();
    assert_eq!((st.num_used_blocks, st.kv_utilization), (0, 0.0));
}

mod kv_events {
    use super::*;
    use crate::block_hash::BlockHasher;
    use crate::kv_events::{decode_batch, KvEvent, Medium};

    fn sched(num_blocks: usize, num_host: usize, num_disk: usize) -> Scheduler {
        let mut cfg = SchedulerConfig::new(4, num_blocks);
        cfg.max_model_len = 32;
        cfg.num_host_blocks = num_host;
        cfg.num_disk_blocks = num_disk;
        cfg.enable_kv_events = true;
        Scheduler::new(cfg).unwrap()
    }

    /// Runs every request to its end (one token each step).
    fn drain(s: &mut Scheduler) {
        while s.has_unfinished_requests() {
            let out = s.schedule().unwrap();
            let toks = vec![1; out.num_sampled()];
            s.update(out.step_id, &toks).unwrap();
        }
    }

    fn events(s: &mut Scheduler) -> Vec<KvEvent> {
        match s.take_kv_events(2.5) {
            Some(bytes) => {
                let (ts, ev) = decode_batch(&bytes).unwrap();
                assert_eq!(ts, 2.5);
                assert!(!ev.is_empty());
                ev
            }
            None => Vec::new(),
        }
    }

    #[test]
    fn prompt_blocks_are_stored_removed_and_cleared() {
        let mut s = sched(8, 0, 0);
        assert_eq!(s.take_kv_events(0.0), None, "nothing happened yet");
        let prompt: Vec<u32> = (100..110).collect(); // two full blocks and a partial one
        s.add_request(NewRequest::new("a", prompt.clone(), 1)).unwrap();
        let out = s.schedule().unwrap();
        let hashes = s.block_hashes(&prompt, None);
        assert_eq!(hashes.len(), 2);
        assert_eq!(
            events(&mut s),
            vec![KvEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: None,
                token_ids: prompt[..8].to_vec(),
                block_size: 4,
                medium: Medium::Gpu,
            }]
        );
        s.update(out.step_id, &[5]).unwrap();
        assert_eq!(s.take_kv_events(0.0), None, "the partial block is never stored");
        // Other prompts fill the pool: the cached blocks are reused, and removed.
        for i in 0..2u32 {
            s.add_request(NewRequest::new(format!("b{i}"), (0..16).map(|t| 1000 * (i + 1) + t).collect(), 1)).unwrap();
        }
        drain(&mut s);
        let ev = events(&mut s);
        let removed: Vec<u64> = ev
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved { block_hashes, medium: Medium::Gpu } => Some(block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(hashes.iter().all(|h| removed.contains(h)), "{ev:?}");
        // A salt changes the hashes.
        assert_ne!(s.block_hashes(&prompt, Some("tenant")), hashes);
        assert_eq!(s.block_hashes(&prompt[..3], None), Vec::<u64>::new());
        // Nothing in use: a reset clears everything, announced as one event.
        assert!(s.reset_prefix_cache() > 0);
        assert_eq!(events(&mut s), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(s.reset_prefix_cache(), 0);
        assert_eq!(events(&mut s), vec![KvEvent::AllBlocksCleared]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_reset_with_blocks_in_use_removes_only_the_free_ones() {
        let mut s = sched(16, 0, 0);
        s.add_request(NewRequest::new("done", (0..8).collect(), 1)).unwrap();
        drain(&mut s);
        let done = s.block_hashes(&(0..8).collect::<Vec<u32>>(), None);
        s.add_request(NewRequest::new("live", (50..59).collect(), 5)).unwrap();
        let out = s.schedule().unwrap();
        events(&mut s);
        assert_eq!(s.reset_prefix_cache(), 2);
        // Only the finished request's blocks were free; the running one keeps its blocks.
        assert_eq!(events(&mut s), vec![KvEvent::BlockRemoved { block_hashes: vec![done[1], done[0]], medium: Medium::Gpu }]);
        s.update(out.step_id, &[1]).unwrap();
    }

    #[test]
    fn events_off_give_none() {
        let mut cfg = SchedulerConfig::new(4, 8);
        cfg.max_model_len = 32;
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request(NewRequest::new("a", (0..9).collect(), 2)).unwrap();
        drain(&mut s);
        assert_eq!(s.reset_prefix_cache(), 2);
        assert_eq!(s.take_kv_events(1.0), None);
    }

    #[test]
    fn a_rolled_back_step_stores_then_removes() {
        let mut s = sched(8, 0, 0);
        let prompt: Vec<u32> = (0..9).collect();
        s.add_request(NewRequest::new("a", prompt.clone(), 1)).unwrap();
        let out = s.schedule().unwrap();
        s.rollback_step(out.step_id).unwrap();
        let hashes = s.block_hashes(&prompt, None);
        assert_eq!(
            events(&mut s),
            vec![
                KvEvent::BlockStored {
                    block_hashes: hashes.clone(),
                    parent_block_hash: None,
                    token_ids: prompt[..8].to_vec(),
                    block_size: 4,
                    medium: Medium::Gpu,
                },
                KvEvent::BlockRemoved { block_hashes: hashes.clone(), medium: Medium::Gpu },
            ]
        );
        assert_eq!(s.kv().pool().num_cached_blocks(), 0);
        // Re-admitted and computed again: stored again.
        drain(&mut s);
        assert!(matches!(&events(&mut s)[..], [KvEvent::BlockStored { block_hashes, .. }] if *block_hashes == hashes));
    }

    #[test]
    fn host_write_backs_and_disk_restores_are_stored_in_their_medium() {
        let mut s = sched(8, 8, 16);
        let prompt: Vec<u32> = (0..17).collect();
        s.add_request(NewRequest::new("a", prompt.clone(), 1)).unwrap();
        drain(&mut s);
        let hashes = s.block_hashes(&prompt, None);
        events(&mut s);
        // Another prompt reuses the device blocks: they are written back to the host.
        s.add_request(NewRequest::new("b", (500..532).collect(), 1)).unwrap();
        drain(&mut s);
        let ev = events(&mut s);
        // Evicted leaves first, announced parents first as one chain, after the device's
        // events.
        assert_eq!(
            ev.last(),
            Some(&KvEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: None,
                token_ids: prompt[..16].to_vec(),
                block_size: 4,
                medium: Medium::Cpu,
            }),
            "{ev:?}"
        );
        assert!(ev[..ev.len() - 1].iter().all(|e| !matches!(e, KvEvent::BlockStored { medium: Medium::Cpu, .. })));
        // A restarted scheduler restores disk entries: stored with medium DISK.
        let mut hasher = BlockHasher::new(crate::block_hash::HashMode::Xxh3);
        let mut full = Vec::new();
        hasher.extend_chain(&mut full, &prompt, 4, &ExtraKey::new(None), usize::MAX);
        let entries: Vec<DiskEntry> =
            (0..4).map(|k| (full[k], k.checked_sub(1).map(|p| full[p]), prompt[k * 4..(k + 1) * 4].to_vec(), None, 0)).collect();
        let mut t = sched(8, 8, 16);
        assert!(t.restore_disk_blocks(&entries).iter().all(Option::is_some));
        assert_eq!(
            events(&mut t),
            vec![KvEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids: prompt[..16].to_vec(),
                block_size: 4,
                medium: Medium::Disk,
            }]
        );
    }
}

/// Runs steps, sampling token 9, until no request is left.
fn run_to_end(s: &mut Scheduler) {
    while s.has_unfinished_requests() {
        let out = s.schedule().unwrap();
        let sampled = vec![9u32; out.num_sampled()];
        s.update(out.step_id, &sampled).unwrap();
        s.check_invariants().unwrap();
    }
}

#[test]
fn kv_lease_holds_the_prompt_blocks_until_released() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 16)).unwrap();
    let prompt: Vec<u32> = (0..10).collect();
    let mut r = NewRequest::new("p", prompt.clone(), 1);
    r.hold_kv = true;
    s.add_request(r).unwrap();
    assert!(s.kv_lease("p").is_none(), "no lease before the request ends");
    run_to_end(&mut s);
    let (blocks, num_tokens) = s.kv_lease("p").unwrap();
    assert_eq!((blocks.len(), num_tokens), (3, 10));
    assert_eq!(s.stats().num_used_blocks, 3);
    assert_eq!(s.stats().num_kv_leases, 1);
    // Memory pressure cannot take them: a request needing every other block still runs.
    s.add_request(NewRequest::new("q", (100..150).collect(), 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.kv_lease("p").unwrap().0, blocks);
    assert!(s.release_kv_lease("p"));
    assert!(!s.release_kv_lease("p"), "a lease is released once");
    assert_eq!(s.stats().num_used_blocks, 0);
    s.check_invariants().unwrap();
    // Aborted requests take no lease.
    let mut r = NewRequest::new("a", prompt, 5);
    r.hold_kv = true;
    s.add_request(r).unwrap();
    let out = s.schedule().unwrap();
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    s.abort_request("a").unwrap();
    assert!(s.kv_lease("a").is_none());
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn kv_reservation_merges_local_hits_and_commits_into_the_prefix_cache() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 32)).unwrap();
    let prompt: Vec<u32> = (0..18).collect();
    // This pool already caches the first block.
    s.add_request(NewRequest::new("warm", prompt[..6].to_vec(), 1)).unwrap();
    run_to_end(&mut s);
    let (hits, fresh) = s.reserve_kv("r", prompt.clone(), 10, None).unwrap().unwrap();
    // (18 - 1) / 4 = 4 blocks at most; the first is a local hit.
    assert_eq!((hits, fresh.len()), (1, 3));
    assert_eq!(s.stats().num_kv_reservations, 1);
    s.check_invariants().unwrap();
    assert!(matches!(s.reserve_kv("r", prompt.clone(), 1, None), Err(CoreError::DuplicateRequest(_))));
    // Not findable while the KV is arriving.
    assert_eq!(s.kv.cached_prefix_blocks(&prompt), 1);
    assert!(s.commit_kv("r"));
    assert!(!s.commit_kv("r"));
    assert_eq!(s.kv.cached_prefix_blocks(&prompt), 4);
    s.add_request(NewRequest::new("d", prompt.clone(), 2)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_tokens(), 2, "16 of 18 prompt tokens come from the reservation");
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    run_to_end(&mut s);
    // A cancelled reservation leaves nothing cached past the hits.
    let other: Vec<u32> = (200..218).collect();
    let (hits, fresh) = s.reserve_kv("c", other.clone(), 4, None).unwrap().unwrap();
    assert_eq!((hits, fresh.len()), (0, 4));
    // No room (31 blocks wanted, 28 free): None, nothing changed.
    let big: Vec<u32> = (300..425).collect();
    assert!(s.reserve_kv("big", big, 40, None).unwrap().is_none());
    assert_eq!(s.stats().num_kv_reservations, 1);
    assert!(s.cancel_kv("c"));
    assert_eq!(s.kv.cached_prefix_blocks(&other), 0);
    assert_eq!(s.stats().num_used_blocks, 0);
    s.check_invariants().unwrap();
    assert!(matches!(s.reserve_kv("e", Vec::new(), 1, None), Err(CoreError::InvalidArgument(_))));
}

#[test]
fn skip_prefix_cache_computes_the_whole_prompt_and_still_caches_it() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 32)).unwrap();
    let prompt: Vec<u32> = (0..18).collect();
    s.add_request(NewRequest::new("warm", prompt.clone(), 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.kv.cached_prefix_blocks(&prompt), 4);
    // A request that needs every prompt position's logits computes them all, cache or not.
    let mut skip = NewRequest::new("skip", prompt.clone(), 1);
    skip.skip_prefix_cache = true;
    s.add_request(skip).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_tokens(), 18);
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    run_to_end(&mut s);
    s.check_invariants().unwrap();
    // The cache still serves the others.
    s.add_request(NewRequest::new("hit", prompt.clone(), 1)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_tokens(), 2);
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.stats().num_used_blocks, 0);
    s.check_invariants().unwrap();
}

/// A scheduler over a full and a sliding-window KV cache group (window 6, blocks of 4) that prefills
/// in chunks of 8 tokens, so the sliding KV cache group leaves blocks behind during the prefill.
fn grouped_scheduler(num_blocks: usize) -> Scheduler {
    let mut cfg = SchedulerConfig::new(4, num_blocks);
    cfg.max_num_batched_tokens = 8;
    cfg.attention_spans = vec![AttentionSpan::Full, AttentionSpan::SlidingWindow(6)];
    Scheduler::new(cfg).unwrap()
}

fn used_blocks(s: &Scheduler) -> usize {
    s.stats().num_used_blocks
}

#[test]
fn kv_lease_with_groups_holds_every_group_whole() {
    let mut s = grouped_scheduler(64);
    let prompt: Vec<u32> = (0..30).collect();
    // Without hold_kv the sliding KV cache group gives back behind its window.
    s.add_request(NewRequest::new("plain", prompt.clone(), 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(used_blocks(&s), 0);
    for warm in [true, false] {
        if !warm {
            s.kv.reset_prefix_cache();
        }
        let id = format!("p{warm}");
        let mut r = NewRequest::new(id.clone(), prompt.clone(), 1);
        r.hold_kv = true;
        s.add_request(r).unwrap();
        let mut steps = 0;
        while s.has_unfinished_requests() {
            let out = s.schedule().unwrap();
            s.check_invariants().unwrap();
            for &seq in &out.row_seqs {
                // Nothing given back in any KV cache group, at any step.
                let q = s.kv.seq(seq).unwrap();
                assert!(q.keeps_all() && q.kv_groups().iter().all(|c| c.num_released() == 0));
            }
            let sampled = vec![9u32; out.num_sampled()];
            s.update(out.step_id, &sampled).unwrap();
            s.check_invariants().unwrap();
            steps += 1;
        }
        // Warm: the seven blocks "plain" cached in both KV cache groups are hits (the sliding KV cache group's
        // given back behind its window too, taken back); two tokens are computed. Cold: four
        // chunks of 8.
        assert_eq!(steps, if warm { 1 } else { 4 });
        let (blocks, num_tokens) = s.kv_lease(&id).unwrap();
        assert_eq!(num_tokens, 30);
        // Group-major: 8 blocks of KV cache group 0, then 8 of KV cache group 1, all distinct, none null.
        assert_eq!(blocks.len(), 16);
        assert!(blocks.iter().all(|&b| b != BlockId::NULL.0));
        assert_eq!(blocks.iter().collect::<std::collections::HashSet<_>>().len(), 16);
        assert_eq!(used_blocks(&s), 16);
        let lease = s.kv_leases[id.as_str()];
        let groups = s.kv.seq(lease).unwrap().kv_groups();
        assert_eq!(groups[0].table().blocks().iter().map(|b| b.0).collect::<Vec<_>>(), blocks[..8]);
        assert_eq!(groups[1].table().blocks().iter().map(|b| b.0).collect::<Vec<_>>(), blocks[8..]);
        // Memory pressure cannot take them: another request runs beside the lease.
        s.add_request(NewRequest::new(format!("q{warm}"), (100..160).collect(), 4)).unwrap();
        run_to_end(&mut s);
        assert_eq!(s.kv_lease(&id).unwrap().0, blocks);
        assert!(s.release_kv_lease(&id));
        assert_eq!(used_blocks(&s), 0);
        s.check_invariants().unwrap();
    }
    assert_eq!(s.kv.pool().num_free(), 64);
}

#[test]
fn hold_kv_with_groups_must_fit_the_pool_whole() {
    // 40 + 1 tokens in two KV cache groups keep 22 blocks: more than the pool's 16, so the request is
    // refused at once rather than waiting forever; without hold_kv it runs.
    let mut s = grouped_scheduler(16);
    let mut r = NewRequest::new("big", (0..40).collect(), 1);
    r.hold_kv = true;
    assert!(matches!(s.add_request(r), Err(CoreError::InvalidArgument(_))));
    s.add_request(NewRequest::new("big", (0..40).collect(), 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(used_blocks(&s), 0);
}

#[test]
fn kv_reservation_with_groups_reserves_every_group() {
    let mut s = grouped_scheduler(64);
    let prompt: Vec<u32> = (0..30).collect();
    // This pool caches the first two blocks of both KV cache groups.
    s.add_request(NewRequest::new("warm", prompt[..10].to_vec(), 1)).unwrap();
    run_to_end(&mut s);
    assert_eq!(s.kv.cached_prefix_blocks(&prompt), 2);
    let (hits, fresh) = s.reserve_kv("r", prompt.clone(), 10, None).unwrap().unwrap();
    s.check_invariants().unwrap();
    // (30 - 1) / 4 = 7 blocks per KV cache group, 2 of them hits: 5 fresh in each KV cache group.
    assert_eq!((hits, fresh.len()), (2, 10));
    let res = s.kv_reservations["r"];
    let groups = s.kv.seq(res).unwrap().kv_groups();
    for (c, group) in groups.iter().enumerate() {
        // Every hit held (none given back), then the KV cache group's fresh blocks, group-major.
        assert_eq!(group.num_released(), 0);
        let table: Vec<u32> = group.table().blocks().iter().map(|b| b.0).collect();
        assert_eq!(table[2..], fresh[c * 5..(c + 1) * 5]);
        for &b in &group.table().blocks()[..2] {
            assert!(s.kv.pool().is_cached(b) && s.kv.pool().ref_count(b).unwrap() == 1);
        }
    }
    assert_eq!(used_blocks(&s), 14);
    // Not findable while the KV is arriving; every KV cache group's blocks after the commit.
    assert_eq!(s.kv.cached_prefix_blocks(&prompt), 2);
    assert!(s.commit_kv("r"));
    s.check_invariants().unwrap();
    assert_eq!(used_blocks(&s), 0);
    assert_eq!(s.kv.cached_prefix_blocks(&prompt), 7);
    s.add_request(NewRequest::new("d", prompt.clone(), 3)).unwrap();
    let out = s.schedule().unwrap();
    s.check_invariants().unwrap();
    assert_eq!(out.num_tokens(), 2, "28 of 30 prompt tokens come from the reservation");
    // The sliding KV cache group starts with the entries behind the window given back.
    let d = out.row_seqs[0];
    let released: Vec<usize> = s.kv.seq(d).unwrap().kv_groups().iter().map(|c| c.num_released()).collect();
    assert_eq!(released, vec![0, AttentionSpan::SlidingWindow(6).dead_blocks(28, 4)]);
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    run_to_end(&mut s);
    // Cancelled: nothing cached past the hits, every block back.
    let other: Vec<u32> = (200..230).collect();
    let (hits, fresh) = s.reserve_kv("c", other.clone(), 4, None).unwrap().unwrap();
    assert_eq!((hits, fresh.len()), (0, 8));
    s.check_invariants().unwrap();
    // No room (2 x 31 blocks wanted, 56 free): None, nothing changed.
    assert!(s.reserve_kv("big", (300..425).collect(), 40, None).unwrap().is_none());
    assert_eq!(s.stats().num_kv_reservations, 1);
    assert!(s.cancel_kv("c"));
    assert_eq!(s.kv.cached_prefix_blocks(&other), 0);
    assert_eq!(used_blocks(&s), 0);
    assert_eq!(s.kv.pool().num_free(), 64);
    s.check_invariants().unwrap();
}
