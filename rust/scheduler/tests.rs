//! Unit tests of the scheduler internals: reused step buffers and statistics.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

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
        let scheduled: Vec<(BranchKey, SeqId)> = s
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
