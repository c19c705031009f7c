//! Unit tests of admission (`admission.rs`): blocked requests, `unblock`, and `abort_request`
//! in every state.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn blocked(id: &str, prompt: Vec<u32>, max_tokens: usize, wait: &[Wait]) -> NewRequest {
    let mut r = NewRequest::new(id, prompt, max_tokens);
    r.wait_for = wait.iter().copied().collect();
    r
}

/// The ids of the requests with rows in `out`.
fn scheduled_ids(s: &Scheduler, out: &StepOutput) -> HashSet<String> {
    out.row_requests.iter().filter_map(|&k| s.request_id(k)).map(|id| id.to_string()).collect()
}

/// One step sampling token 9 everywhere; the ids it scheduled.
fn step(s: &mut Scheduler) -> HashSet<String> {
    let out = s.schedule().unwrap();
    let ids = scheduled_ids(s, &out);
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    s.check_invariants().unwrap();
    ids
}

#[test]
fn a_blocked_request_is_never_scheduled_until_its_last_reason_is_lifted() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 64)).unwrap();
    s.add_request(blocked("g", (0..9).collect(), 3, &[Wait::Grammar])).unwrap();
    s.add_request(blocked("k", (10..19).collect(), 3, &[Wait::RemoteKv])).unwrap();
    s.add_request(blocked("both", (20..29).collect(), 3, &[Wait::Grammar, Wait::RemoteKv])).unwrap();
    s.add_request(NewRequest::new("plain", (30..39).collect(), 10)).unwrap();
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!((st.num_waiting, st.num_waiting_for_grammar, st.num_waiting_for_remote_kv), (1, 2, 2));
    assert_eq!((s.num_requests(), st.num_used_blocks), (4, 0), "blocked requests are live and hold no block");
    let states: HashMap<String, &str> = s.request_summaries().into_iter().map(|r| (r.id.to_string(), r.state)).collect();
    assert_eq!(states["g"], "waiting_for_grammar");
    assert_eq!(states["k"], "waiting_for_remote_kv");
    assert_eq!(states["both"], "waiting_for_grammar");
    assert_eq!(states["plain"], "waiting");
    // Ids are taken while blocked.
    assert!(matches!(s.add_request(NewRequest::new("g", vec![1], 1)), Err(CoreError::DuplicateRequest(_))));
    for _ in 0..3 {
        assert_eq!(step(&mut s), HashSet::from(["plain".to_string()]));
    }
    // Wrong reasons and unknown ids change nothing.
    assert!(matches!(s.unblock("k", Wait::Grammar), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(s.unblock("plain", Wait::Grammar), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(s.unblock("nobody", Wait::Grammar), Err(CoreError::UnknownRequest(_))));
    assert!(s.unblock("g", Wait::Grammar).unwrap());
    assert!(!s.unblock("both", Wait::Grammar).unwrap(), "still waits for its KV");
    assert_eq!(s.waiting_for("both"), Some(WaitSet::NONE.with(Wait::RemoteKv)));
    assert_eq!(s.waiting_for("g"), Some(WaitSet::NONE));
    assert_eq!(s.waiting_for("nobody"), None);
    assert!(matches!(s.unblock("g", Wait::Grammar), Err(CoreError::InvalidArgument(_))), "lifted once");
    assert_eq!(step(&mut s), HashSet::from(["g".to_string(), "plain".to_string()]));
    assert!(s.unblock("both", Wait::RemoteKv).unwrap());
    assert!(s.unblock("k", Wait::RemoteKv).unwrap());
    let st = s.stats();
    assert_eq!((st.num_waiting_for_grammar, st.num_waiting_for_remote_kv), (0, 0));
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn an_unblocked_request_takes_its_place_in_policy_order() {
    let mut cfg = SchedulerConfig::new(4, 64);
    cfg.policy = Policy::Priority;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut low = NewRequest::new("low", (0..5).collect(), 1);
    low.priority = 5;
    s.add_request(low).unwrap();
    let mut high = blocked("high", (10..15).collect(), 1, &[Wait::Grammar]);
    high.priority = 0;
    s.add_request(high).unwrap();
    assert!(s.unblock("high", Wait::Grammar).unwrap());
    let order: Vec<&str> = s.waiting.iter().map(|&b| &*s.requests.get(s.samples.get(b).unwrap().req).unwrap().id).collect();
    assert_eq!(order, ["high", "low"]);
    s.check_invariants().unwrap();
}

#[test]
fn abort_ends_a_request_in_every_state_and_says_what_it_waited_for() {
    let mut cfg = SchedulerConfig::new(4, 16);
    cfg.num_host_blocks = 16;
    cfg.preemption_mode = PreemptionMode::Swap;
    let mut s = Scheduler::new(cfg).unwrap();
    let prompt: Vec<u32> = (100..118).collect();
    // Remote KV arrives into a reservation of the request's name, taken once it is added.
    s.add_request(blocked("k", prompt.clone(), 4, &[Wait::RemoteKv])).unwrap();
    assert!(s.reserve_kv("k", prompt.clone(), 4, None).unwrap().is_some());
    s.add_request(blocked("g", (0..9).collect(), 4, &[Wait::Grammar])).unwrap();
    s.add_request(blocked("gk", (20..29).collect(), 4, &[Wait::Grammar, Wait::RemoteKv])).unwrap();
    // Two that run, then one that waits behind them.
    s.add_request(NewRequest::new("run", (30..50).collect(), 40)).unwrap();
    s.add_request(NewRequest::new("run2", (50..70).collect(), 40)).unwrap();
    step(&mut s);
    s.add_request(NewRequest::new("wait", (70..90).collect(), 4)).unwrap();
    // Decode until the pool runs out and a sample is swapped out to the host tier.
    let mut swapped = None;
    for _ in 0..40 {
        step(&mut s);
        swapped = s.request_summaries().into_iter().find(|r| r.state == "swapped").map(|r| r.id.to_string());
        if swapped.is_some() {
            break;
        }
    }
    let swapped = swapped.expect("a sample was swapped out");
    assert_eq!(s.abort_request(&swapped).unwrap(), WaitSet::NONE);
    for id in ["run", "run2", "wait"].into_iter().filter(|&id| id != swapped) {
        assert_eq!(s.abort_request(id).unwrap(), WaitSet::NONE);
        s.check_invariants().unwrap();
    }
    assert_eq!(s.abort_request("g").unwrap(), WaitSet::NONE.with(Wait::Grammar));
    assert_eq!(s.abort_request("gk").unwrap(), [Wait::Grammar, Wait::RemoteKv].into_iter().collect());
    assert_eq!(s.abort_request("k").unwrap(), WaitSet::NONE.with(Wait::RemoteKv));
    assert!(matches!(s.abort_request("k"), Err(CoreError::UnknownRequest(_))));
    s.check_invariants().unwrap();
    // The reservation outlives its aborted request (the read may still write its blocks):
    // a new request may not wait for remote KV under that name until the read ends.
    assert_eq!(s.stats().num_kv_reservations, 1);
    assert!(matches!(s.add_request(blocked("k", prompt.clone(), 4, &[Wait::RemoteKv])), Err(CoreError::DuplicateRequest(_))));
    assert_eq!(s.num_requests(), 0);
    assert!(s.cancel_kv("k"));
    let out = s.schedule().unwrap();
    let reported: HashSet<&str> = out.finished.iter().map(|(id, _)| &**id).collect();
    assert_eq!(reported, HashSet::from(["k", "g", "gk", "run", "run2", "wait"]));
    assert!(out.finished.iter().all(|(_, r)| *r == FinishReason::Abort));
    s.update(out.step_id, &[]).unwrap();
    let st = s.stats();
    assert_eq!((st.num_used_blocks, st.num_host_used_blocks, st.num_aborted), (0, 0, 6));
    s.check_invariants().unwrap();
}

#[test]
fn remote_kv_committed_before_the_unblock_is_a_prefix_hit() {
    let mut s = Scheduler::new(SchedulerConfig::new(4, 32)).unwrap();
    let prompt: Vec<u32> = (0..18).collect();
    s.add_request(blocked("d", prompt.clone(), 2, &[Wait::RemoteKv])).unwrap();
    let (hits, fresh) = s.reserve_kv("d", prompt, 10, None).unwrap().unwrap();
    assert_eq!((hits, fresh.len()), (0, 4));
    assert!(step(&mut s).is_empty(), "not scheduled while its KV arrives");
    assert!(s.commit_kv("d"));
    assert!(s.unblock("d", Wait::RemoteKv).unwrap());
    let out = s.schedule().unwrap();
    assert_eq!(out.num_tokens(), 2, "16 of 18 prompt tokens come from the reservation");
    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
    while s.has_unfinished_requests() {
        step(&mut s);
    }
    // Its name is free again for a new wait.
    s.add_request(blocked("d", vec![1, 2], 1, &[Wait::RemoteKv])).unwrap();
    s.abort_request("d").unwrap();
    assert_eq!(s.stats().num_used_blocks, 0);
}

/// Random adds (each waiting for a random set of reasons), unblocks, aborts and steps: after
/// every operation the invariants hold, no step schedules a request that is still blocked,
/// `waiting_for` agrees with a model of the reasons, and once everything is aborted or done
/// no block is held.
#[test]
fn random_admission_keeps_blocked_requests_out_of_every_step() {
    for seed in 0..24u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cfg = SchedulerConfig::new(4, 48);
        cfg.max_model_len = 64;
        cfg.max_num_seqs = 6;
        cfg.max_num_batched_tokens = 48;
        if seed % 2 == 1 {
            cfg.policy = Policy::Priority;
        }
        let mut s = Scheduler::new(cfg).unwrap();
        // The model: live request id -> the reasons it still waits for.
        let mut model: HashMap<String, WaitSet> = HashMap::new();
        let mut next = 0usize;
        for _ in 0..400 {
            match rng.random_range(0..10) {
                0..=2 if next < 120 => {
                    let id = format!("r{next}");
                    next += 1;
                    let wait: WaitSet = Wait::ALL.into_iter().filter(|_| rng.random_bool(0.4)).collect();
                    let prompt: Vec<u32> = (0..rng.random_range(1..30)).map(|_| rng.random_range(0..50u32)).collect();
                    let mut r = NewRequest::new(id.clone(), prompt, rng.random_range(1..12));
                    r.wait_for = wait;
                    r.n = rng.random_range(1..3);
                    r.priority = rng.random_range(0..3);
                    s.add_request(r).unwrap();
                    model.insert(id, wait);
                }
                3..=4 => {
                    let mut blocked: Vec<(&String, &WaitSet)> = model.iter().filter(|(_, w)| !w.is_empty()).collect();
                    blocked.sort_by_key(|(id, _)| *id);
                    if let Some(&(id, &w)) = blocked.get(rng.random_range(0..blocked.len().max(1))) {
                        let what = w.iter().next().unwrap();
                        let id = id.clone();
                        let now_free = s.unblock(&id, what).unwrap();
                        let left = w.without(what);
                        assert_eq!(now_free, left.is_empty());
                        model.insert(id, left);
                    }
                }
                5 => {
                    let mut ids: Vec<String> = model.keys().cloned().collect();
                    ids.sort();
                    if let Some(id) = ids.get(rng.random_range(0..ids.len().max(1))).cloned() {
                        assert_eq!(s.abort_request(&id).unwrap(), model.remove(&id).unwrap());
                    }
                }
                _ => {
                    let out = s.schedule().unwrap();
                    for id in scheduled_ids(&s, &out) {
                        assert_eq!(model[&id], WaitSet::NONE, "seed {seed}: blocked {id} was scheduled");
                    }
                    s.update(out.step_id, &vec![9u32; out.num_sampled()]).unwrap();
                    // Requests that ended in the step are gone; a blocked one never ends.
                    model.retain(|id, w| s.waiting_for(id).is_some() || !w.is_empty() && panic!("blocked {id} ended"));
                }
            }
            s.check_invariants().unwrap();
            for (id, &w) in &model {
                assert_eq!(s.waiting_for(id), Some(w), "seed {seed}: {id}");
            }
            let st = s.stats();
            assert_eq!(st.num_waiting_for_grammar, model.values().filter(|w| w.contains(Wait::Grammar)).count());
            assert_eq!(st.num_waiting_for_remote_kv, model.values().filter(|w| w.contains(Wait::RemoteKv)).count());
        }
        let mut ids: Vec<String> = model.keys().cloned().collect();
        ids.sort();
        for id in ids {
            s.abort_request(&id).unwrap();
        }
        let out = s.schedule().unwrap();
        s.update(out.step_id, &[]).unwrap();
        s.check_invariants().unwrap();
        assert_eq!((s.num_requests(), s.stats().num_used_blocks), (0, 0), "seed {seed}");
    }
}
