//! Scheduler simulations with a fake model that reads the KV cache the way attention does.
//!
//! The fake model keeps one value per KV slot: the digest of the token at that position
//! chained with the value of the previous position, read *through the row's block table*
//! (as attention reads earlier keys). A sampled token is a function of the last position's
//! value and the sample index. The reference computes the same chain over each sample's own
//! token list, as a contiguous cache would. Any error in block tables, slot mappings, prefix
//! hits, copy-on-write or preemption changes a digest and therefore the tokens.
//!
//! Thousands of requests with random prompt/output lengths, arrivals, priorities, shared
//! prefixes, parallel sampling, eos/stop ids and aborts run under a pool small enough to
//! force preemption. With a host tier the fake model also keeps one value per host slot and
//! runs the step's swap copies (device → host first, then host → device, then copy-on-write),
//! so a wrong swap, a stale host hit or a lost block changes the tokens; retention priorities
//! and durations (with the scheduler's clock moved forward) vary the eviction order. Some configurations also make the model fail mid-step (it runs part of
//! the copy ops and writes garbage into part of the step's slots) and roll the step back, with
//! aborts landing between schedule and rollback: any unwritten KV served later as a prefix hit
//! would change the tokens. After every step the invariants hold; at the end every request ended with
//! the right tokens and reason, and every block is free with ref count 0.
//!
//! KV-cache events are on in every simulation: after every step the events are decoded from
//! their wire bytes and replayed (Stored adds, Removed deletes, AllBlocksCleared clears), and
//! the replay must hold exactly the registered hashes of each pool (device, host, disk). Some
//! configurations also reset the prefix cache between steps, and every simulation ends with a
//! reset that leaves nothing cached (announced as AllBlocksCleared).

mod common;

use std::collections::{HashMap, HashSet};

use pagedkv::block_hash::HashMode;
use pagedkv::ids::BlockId;
use pagedkv::kv_cache_manager::RetentionPolicy;
use pagedkv::kv_events::{decode_batch, KvEvent, Medium};
use pagedkv::scheduler::{FinishReason, NewRequest, Policy, PreemptionMode, Scheduler, SchedulerConfig, StepOutput};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::{chain, push_reference_token, reference_digest, FakeModel};
use pagedkv::attention_span::AttentionSpan;

const VOCAB: u64 = 997;


fn sample(digest: u64, index: i32) -> u32 {
    (chain(digest, index as u32 + 7) % VOCAB) as u32
}

/// A forward of the fake model, then one sampled token per logits row.
fn execute(model: &mut FakeModel, out: &StepOutput) -> Vec<u32> {
    model.forward(out).iter().zip(&out.sample_indices).map(|(&v, &index)| sample(v, index)).collect()
}


#[derive(Debug, Clone)]
struct Expect {
    prompt: Vec<u32>,
    max_tokens: usize,
    min_tokens: usize,
    eos: Vec<u32>,
    n: usize,
    /// Output tokens received per sample index, and finish reasons.
    outputs: Vec<Vec<u32>>,
    reasons: Vec<Option<FinishReason>>,
    aborted: bool,
}

/// The tokens a sample must produce: the reference chain over its own tokens, in every
/// group, as a contiguous cache computes it.
fn reference_outputs(e: &Expect, index: usize, max_model_len: usize, spans: &[AttentionSpan]) -> (Vec<u32>, FinishReason) {
    let mut values = Vec::new();
    for &t in &e.prompt {
        push_reference_token(spans, &mut values, t);
    }
    let mut out = Vec::new();
    loop {
        let t = sample(reference_digest(&values), index as i32);
        out.push(t);
        if out.len() >= e.min_tokens && e.eos.contains(&t) {
            return (out, FinishReason::Stop);
        }
        if out.len() >= e.max_tokens || e.prompt.len() + out.len() >= max_model_len {
            return (out, FinishReason::Length);
        }
        push_reference_token(spans, &mut values, t);
    }
}

struct SimSpec {
    seed: u64,
    num_requests: usize,
    num_blocks: usize,
    block_size: usize,
    max_model_len: usize,
    budget: usize,
    max_num_seqs: usize,
    policy: Policy,
    caching: bool,
    hash_mode: HashMode,
    abort_prob: f64,
    /// Probability that a step's forward fails (and is rolled back).
    fail_prob: f64,
    /// Host tier size (0: none) and preemption mode.
    num_host_blocks: usize,
    /// Disk tier size (0: none; needs a host tier and caching).
    num_disk_blocks: usize,
    preemption_mode: PreemptionMode,
    /// Random retention priorities / durations per request, and clock moves between steps.
    retention: bool,
    /// Probability of a prefix-cache reset between two steps.
    reset_prob: f64,
    /// KV cache groups: what each group's layers attend to.
    spans: Vec<AttentionSpan>,
    /// Shared system prompts' lengths (a few are drawn; half the requests start with one).
    system_len: std::ops::Range<usize>,
}

/// What a consumer of the KV events believes each pool caches.
#[derive(Default)]
struct EventReplay {
    pools: HashMap<Medium, HashSet<u64>>,
    batches: u64,
    cleared: u64,
}

impl EventReplay {
    /// Applies the events the scheduler logged since the last call, then checks the replay
    /// against every pool's registered hashes.
    fn sync(&mut self, sched: &mut Scheduler, when: &str) {
        let ts = self.batches as f64 * 0.5;
        if let Some(bytes) = sched.take_kv_events(ts) {
            let (got_ts, events) = decode_batch(&bytes).unwrap();
            assert_eq!(got_ts, ts);
            assert!(!events.is_empty(), "{when}: an empty batch");
            self.batches += 1;
            for e in events {
                match e {
                    KvEvent::BlockStored { block_hashes, token_ids, block_size, medium, .. } => {
                        assert_eq!(token_ids.len(), block_hashes.len() * block_size, "{when}: tokens of a stored event");
                        let set = self.pools.entry(medium).or_default();
                        for h in block_hashes {
                            assert!(set.insert(h), "{when}: {h} stored twice in {medium:?}");
                        }
                    }
                    KvEvent::BlockRemoved { block_hashes, medium } => {
                        let set = self.pools.entry(medium).or_default();
                        for h in block_hashes {
                            assert!(set.remove(&h), "{when}: {h} removed from {medium:?} but never stored");
                        }
                    }
                    KvEvent::AllBlocksCleared => {
                        self.cleared += 1;
                        self.pools.clear();
                    }
                }
            }
        }
        let kv = sched.kv();
        for (medium, pool) in [(Medium::Gpu, Some(kv.pool())), (Medium::Cpu, kv.host_pool()), (Medium::Disk, kv.disk_pool())] {
            let want: HashSet<u64> = pool.map(|p| p.registered_keys().collect()).unwrap_or_default();
            let got = self.pools.get(&medium).cloned().unwrap_or_default();
            assert!(got == want, "{when}: the events of {medium:?} replay to {} blocks, the pool holds {}", got.len(), want.len());
        }
    }
}

impl SimSpec {
    /// A spec with the host tier off and no retention settings.
    #[allow(clippy::too_many_arguments)]
    fn basic(
        seed: u64,
        num_requests: usize,
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
        budget: usize,
        max_num_seqs: usize,
        policy: Policy,
        caching: bool,
        hash_mode: HashMode,
        abort_prob: f64,
        fail_prob: f64,
    ) -> Self {
        SimSpec {
            seed,
            num_requests,
            num_blocks,
            block_size,
            max_model_len,
            budget,
            max_num_seqs,
            policy,
            caching,
            hash_mode,
            abort_prob,
            fail_prob,
            num_host_blocks: 0,
            num_disk_blocks: 0,
            preemption_mode: PreemptionMode::Recompute,
            retention: false,
            reset_prob: 0.0,
            spans: vec![AttentionSpan::Full],
            system_len: 8..80,
        }
    }

    fn with_spans(mut self, spans: Vec<AttentionSpan>) -> Self {
        self.spans = spans;
        self
    }

    fn with_system_len(mut self, system_len: std::ops::Range<usize>) -> Self {
        self.system_len = system_len;
        self
    }

    fn with_resets(mut self, reset_prob: f64) -> Self {
        self.reset_prob = reset_prob;
        self
    }

    fn with_host(mut self, num_host_blocks: usize, mode: PreemptionMode, retention: bool) -> Self {
        self.num_host_blocks = num_host_blocks;
        self.preemption_mode = mode;
        self.retention = retention;
        self
    }

    fn with_disk(mut self, num_disk_blocks: usize) -> Self {
        self.num_disk_blocks = num_disk_blocks;
        self
    }
}

/// What a simulation counted.
#[derive(Debug)]
struct SimResult {
    preemptions: u64,
    prefix_hits: u64,
    swap_preemptions: u64,
    host_hits: u64,
    disk_hits: u64,
    blocks_swapped_in: u64,
    /// Prefix-hit tokens a sliding group served from its window alone.
    window_hits: u64,
}

fn run_sim(spec: &SimSpec) -> SimResult {
    let mut cfg = SchedulerConfig::new(spec.block_size, spec.num_blocks);
    cfg.max_model_len = spec.max_model_len;
    cfg.max_num_batched_tokens = spec.budget;
    cfg.max_num_seqs = spec.max_num_seqs;
    cfg.policy = spec.policy;
    cfg.enable_prefix_caching = spec.caching;
    cfg.hash_mode = spec.hash_mode;
    cfg.num_host_blocks = spec.num_host_blocks;
    cfg.num_disk_blocks = spec.num_disk_blocks;
    cfg.preemption_mode = spec.preemption_mode;
    // Auto: a model where recomputing is dearer than moving a block, but not always.
    cfg.bytes_per_block = 1000;
    cfg.swap_bytes_per_second = 1000.0;
    cfg.recompute_tokens_per_second = 1.0;
    cfg.enable_kv_events = true;
    cfg.attention_spans = spec.spans.clone();
    let mut sched = Scheduler::new(cfg).unwrap();
    let mut replay = EventReplay::default();
    let mut model = FakeModel::new(spec.num_blocks, spec.num_host_blocks, spec.num_disk_blocks, spec.block_size);
    model.spans = spec.spans.clone();
    let mut rng = StdRng::seed_from_u64(spec.seed);
    // A few shared system prompts so that the prefix cache gets hits.
    let systems: Vec<Vec<u32>> =
        (0..4).map(|_| (0..rng.random_range(spec.system_len.clone())).map(|_| rng.random_range(0..VOCAB as u32)).collect()).collect();
    let mut arrivals: Vec<(usize, String, Expect, NewRequest)> = (0..spec.num_requests)
        .map(|i| {
            let mut prompt = if rng.random_bool(0.5) { systems[rng.random_range(0..systems.len())].clone() } else { Vec::new() };
            let own = rng.random_range(1..(spec.max_model_len / 3).max(2));
            prompt.extend((0..own).map(|_| rng.random_range(0..VOCAB as u32)));
            prompt.truncate(spec.max_model_len);
            let max_tokens = rng.random_range(1..120);
            let min_tokens = if rng.random_bool(0.2) { rng.random_range(0..=max_tokens) } else { 0 };
            let eos: Vec<u32> = if rng.random_bool(0.7) { vec![rng.random_range(0..VOCAB as u32)] } else { vec![] };
            let n = if rng.random_bool(0.1) { rng.random_range(2..4usize).min(spec.max_num_seqs) } else { 1 };
            let id = format!("req-{i}");
            let mut r = NewRequest::new(id.clone(), prompt.clone(), max_tokens);
            r.min_tokens = min_tokens;
            r.eos_token_ids = eos.clone();
            r.n = n;
            r.priority = rng.random_range(-2..3);
            if spec.retention {
                r.retention = RetentionPolicy {
                    priority: rng.random_range(0..=100),
                    duration_us: rng.random_bool(0.5).then(|| rng.random_range(0..5_000_000)),
                    num_tokens: rng.random_bool(0.5).then(|| rng.random_range(0..80)),
                };
            }
            let e = Expect { prompt, max_tokens, min_tokens, eos, n, outputs: vec![Vec::new(); n], reasons: vec![None; n], aborted: false };
            (rng.random_range(0..spec.num_requests / 4 + 1), id, e, r)
        })
        .collect();
    arrivals.sort_by_key(|a| std::cmp::Reverse(a.0));
    let mut expect: HashMap<String, Expect> = HashMap::new();
    let mut step = 0usize;
    let mut reported_finished = 0usize;
    while !arrivals.is_empty() || sched.has_unfinished_requests() {
        while arrivals.last().is_some_and(|a| a.0 <= step) {
            let (_, id, e, r) = arrivals.pop().unwrap();
            sched.add_request(r).unwrap();
            expect.insert(id, e);
        }
        if spec.retention {
            sched.advance_clock(rng.random_range(0..200_000));
        }
        let out = sched.schedule().unwrap();
        sched.check_invariants().unwrap();
        if spec.fail_prob > 0.0 && rng.random_bool(spec.fail_prob) {
            model.execute_failing(&out, &mut rng);
            // An abort can land while the failed step is in flight.
            if rng.random_bool(0.3) {
                if let Some(row) = out.row_requests.first() {
                    let id = sched.request_id(*row).unwrap().to_string();
                    sched.abort_request(&id).unwrap();
                    expect.get_mut(&id).unwrap().aborted = true;
                }
            }
            let ids = sched.rollback_step(out.step_id).unwrap();
            assert!(ids.len() <= out.num_rows());
            assert!(sched.update(out.step_id, &[]).is_err(), "a rolled-back step cannot be updated");
            sched.check_invariants().unwrap();
            replay.sync(&mut sched, "after a rollback");
            step += 1;
            continue;
        }
        reported_finished += out.finished.len();
        let sampled = execute(&mut model, &out);
        let updates = sched.update(out.step_id, &sampled).unwrap();
        for u in &updates {
            let id = sched.request_id(u.request).expect("an updated request is named until the next schedule");
            let e = expect.get_mut(&**id).unwrap();
            let i = u.index as usize;
            assert!(e.reasons[i].is_none(), "token after finish for {id} #{i}");
            e.outputs[i].push(u.token);
            e.reasons[i] = u.finish_reason;
        }
        // Random aborts of live requests.
        if spec.abort_prob > 0.0 && rng.random_bool(spec.abort_prob) {
            let live: Vec<String> = expect.iter().filter(|(_, e)| !e.aborted && e.reasons.iter().any(|r| r.is_none())).map(|(k, _)| k.clone()).collect();
            if !live.is_empty() {
                let id = &live[rng.random_range(0..live.len())];
                if sched.abort_request(id).is_ok() {
                    expect.get_mut(id).unwrap().aborted = true;
                }
            }
        }
        if spec.reset_prob > 0.0 && rng.random_bool(spec.reset_prob) {
            replay.sync(&mut sched, "before a reset");
            sched.reset_prefix_cache();
        }
        sched.check_invariants().unwrap();
        replay.sync(&mut sched, "after a step");
        step += 1;
        assert!(step < 200_000, "simulation does not terminate");
    }
    // One more (empty) step reports the last finished ids.
    let out = sched.schedule().unwrap();
    reported_finished += out.finished.len();
    sched.update(out.step_id, &[]).unwrap();
    assert_eq!(reported_finished, spec.num_requests, "every request is reported finished once");
    for (id, e) in &expect {
        for i in 0..e.n {
            let (want, reason) = reference_outputs(e, i, spec.max_model_len, &spec.spans);
            if e.aborted {
                assert!(want.starts_with(&e.outputs[i]), "{id} #{i}: aborted output is not a prefix of the reference");
            } else {
                assert_eq!(e.outputs[i], want, "{id} #{i}: tokens differ from the contiguous reference");
                assert_eq!(e.reasons[i], Some(reason), "{id} #{i}: finish reason");
            }
        }
    }
    let stats = sched.stats();
    assert_eq!(stats.num_free_blocks, spec.num_blocks);
    for b in 0..spec.num_blocks {
        assert_eq!(sched.kv().pool().ref_count(BlockId(b as u32)).unwrap(), 0);
    }
    assert_eq!(stats.num_host_free_blocks, spec.num_host_blocks, "a host block leaked");
    assert_eq!(stats.num_swapped, 0);
    // Nothing in use: a reset leaves nothing cached, announced as one AllBlocksCleared.
    replay.sync(&mut sched, "at the end");
    let cleared = replay.cleared;
    sched.reset_prefix_cache();
    replay.sync(&mut sched, "after the final reset");
    if spec.caching {
        assert_eq!(replay.cleared, cleared + 1, "the final reset was not announced");
        assert!(replay.batches > 1);
    } else {
        assert_eq!(replay.batches, 0, "no prefix cache, no events");
    }
    SimResult {
        preemptions: stats.num_preemptions,
        prefix_hits: stats.prefix_cache_hits,
        swap_preemptions: stats.num_swap_preemptions,
        host_hits: stats.prefix_cache_host_hits,
        disk_hits: stats.prefix_cache_disk_hits,
        blocks_swapped_in: stats.blocks_swapped_in,
        window_hits: sched.kv().prefix_counters().window_hits,
    }
}

#[test]
fn thousands_of_requests_under_preemption_match_contiguous_reference() {
    for (seed, policy, caching) in [(1, Policy::Fcfs, true), (2, Policy::Priority, true), (3, Policy::Fcfs, false)] {
        let r = run_sim(&SimSpec::basic(seed, 2000, 96, 16, 512, 256, 64, policy, caching, HashMode::Xxh3, 0.02, 0.0));
        assert!(r.preemptions > 100, "the pool must be small enough to force preemption (got {})", r.preemptions);
        if caching {
            assert!(r.prefix_hits > 0, "shared prompts must hit the prefix cache");
        }
    }
}

#[test]
fn hash_collisions_do_not_change_tokens() {
    run_sim(&SimSpec::basic(9, 400, 64, 8, 256, 64, 32, Policy::Fcfs, true, HashMode::Truncated(2), 0.05, 0.0));
}

#[test]
fn failed_steps_rolled_back_never_serve_unwritten_kv() {
    for (seed, policy, caching, bs) in [(11, Policy::Fcfs, true, 16), (12, Policy::Priority, true, 4), (13, Policy::Fcfs, false, 8)] {
        let r = run_sim(&SimSpec::basic(seed, 600, 512usize.div_ceil(bs) + 40, bs, 512, 128, 32, policy, caching, HashMode::Xxh3, 0.02, 0.15));
        assert!(r.preemptions > 0);
        if caching {
            assert!(r.prefix_hits > 0);
        }
    }
}

#[test]
fn swap_and_host_tier_match_contiguous_reference() {
    // (seed, mode, caching, host blocks, failing steps, retention, hash bits)
    let cases = [
        (21, PreemptionMode::Swap, true, 256, 0.0, false, None),
        (22, PreemptionMode::Auto, true, 256, 0.0, true, None),
        (23, PreemptionMode::Swap, false, 256, 0.0, false, None),
        // A host tier too small for every victim: swaps fall back to recompute.
        (24, PreemptionMode::Swap, true, 24, 0.0, true, None),
        (25, PreemptionMode::Recompute, true, 256, 0.0, true, None),
        (26, PreemptionMode::Swap, true, 128, 0.15, true, None),
        (27, PreemptionMode::Auto, true, 64, 0.0, false, Some(2u8)),
    ];
    for (seed, mode, caching, host, fail, retention, bits) in cases {
        let hash_mode = bits.map_or(HashMode::Xxh3, HashMode::Truncated);
        // A disk tier below every host tier that caches (some cases fail steps mid-copy).
        let disk = if caching { 512 } else { 0 };
        let spec = SimSpec::basic(seed, 1500, 96, 16, 512, 256, 64, Policy::Fcfs, caching, hash_mode, 0.02, fail)
            .with_host(host, mode, retention)
            .with_disk(disk)
            .with_resets(if seed == 26 { 0.01 } else { 0.0 });
        let r = run_sim(&spec);
        assert!(r.preemptions > 50, "{seed}: the device pool must force preemption ({r:?})");
        if mode == PreemptionMode::Swap {
            assert!(r.swap_preemptions > 0, "{seed}: nothing was swapped ({r:?})");
            assert!(r.blocks_swapped_in > 0, "{seed}: nothing came back ({r:?})");
        }
        if caching && bits.is_none() {
            assert!(r.host_hits > 0, "{seed}: the host tier never served a prefix hit ({r:?})");
        }
        if caching && bits.is_none() && host <= 64 {
            assert!(r.disk_hits > 0, "{seed}: the disk tier never served a prefix hit ({r:?})");
        }
    }
}

/// KV cache groups: a full group with sliding and chunked ones (Gemma, gpt-oss and Llama 4
/// shapes), under preemption, prefix hits, failed steps and the host and disk tiers. Every
/// group's layer reads its whole window through its own table, so a block given back too
/// early, a wrong hit in one group or a lost swap changes the tokens.
#[test]
fn kv_cache_groups_match_contiguous_reference() {
    let gemma = vec![AttentionSpan::Full, AttentionSpan::SlidingWindow(24), AttentionSpan::SlidingWindow(24)];
    let mixed = vec![AttentionSpan::SlidingWindow(9), AttentionSpan::ChunkedLocal(32), AttentionSpan::Full];
    let r = run_sim(&SimSpec::basic(31, 600, 160, 8, 256, 128, 32, Policy::Fcfs, true, HashMode::Xxh3, 0.02, 0.0).with_spans(gemma.clone()));
    assert!(r.preemptions > 20 && r.prefix_hits > 0, "{r:?}");
    // Long shared prompts in a tight pool: the sliding groups' early blocks (given back
    // first, so evicted first) go while the full group and the windows still cache the
    // prompts, and hits are served from the windows alone (verified as the trunk's leaves;
    // a wrong block would change the tokens).
    let r = run_sim(
        &SimSpec::basic(36, 400, 120, 8, 256, 128, 16, Policy::Fcfs, true, HashMode::Xxh3, 0.0, 0.0)
            .with_spans(gemma.clone())
            .with_system_len(120..200),
    );
    assert!(r.window_hits > 0, "{r:?}");
    let r = run_sim(&SimSpec::basic(32, 400, 120, 4, 256, 64, 32, Policy::Priority, true, HashMode::Truncated(3), 0.02, 0.1).with_spans(mixed.clone()));
    assert!(r.preemptions > 0, "{r:?}");
    // Without prefix caching, and with every layer sliding (Mistral's shape).
    run_sim(&SimSpec::basic(33, 300, 48, 8, 256, 64, 16, Policy::Fcfs, false, HashMode::Xxh3, 0.02, 0.05).with_spans(vec![AttentionSpan::SlidingWindow(16)]));
    for (seed, mode) in [(34, PreemptionMode::Swap), (35, PreemptionMode::Auto)] {
        let spec = SimSpec::basic(seed, 500, 160, 8, 256, 128, 32, Policy::Fcfs, true, HashMode::Xxh3, 0.02, 0.1)
            .with_host(256, mode, true)
            .with_disk(256)
            .with_spans(if seed == 34 { gemma.clone() } else { mixed.clone() });
        let r = run_sim(&spec);
        assert!(r.preemptions > 0, "{seed}: {r:?}");
        if mode == PreemptionMode::Swap {
            assert!(r.swap_preemptions > 0 && r.blocks_swapped_in > 0, "{seed}: {r:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_configs_match_reference(
        seed in any::<u64>(),
        bs in prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        extra_blocks in 0usize..40,
        budget in 1usize..100,
        max_num_seqs in 1usize..12,
        priority in any::<bool>(),
        caching in any::<bool>(),
        abort_prob in 0.0f64..0.2,
        fail_prob in prop::sample::select(vec![0.0f64, 0.0, 0.2]),
        host_blocks in prop::sample::select(vec![0usize, 0, 1, 4, 16, 64]),
        mode in prop::sample::select(vec![PreemptionMode::Recompute, PreemptionMode::Swap, PreemptionMode::Auto]),
        retention in any::<bool>(),
        hash_bits in prop::sample::select(vec![None, None, Some(0u8), Some(3u8)]),
        disk_blocks in prop::sample::select(vec![0usize, 1, 8, 64]),
        resets in any::<bool>(),
    ) {
        let max_model_len: usize = 64;
        let mode = if host_blocks == 0 { PreemptionMode::Recompute } else { mode };
        let disk_blocks = if host_blocks > 0 && caching { disk_blocks } else { 0 };
        let hash_mode = hash_bits.map_or(HashMode::Xxh3, HashMode::Truncated);
        let policy = if priority { Policy::Priority } else { Policy::Fcfs };
        let num_blocks = max_model_len.div_ceil(bs) + extra_blocks;
        run_sim(
            &SimSpec::basic(seed, 60, num_blocks, bs, max_model_len, budget, max_num_seqs, policy, caching, hash_mode, abort_prob, fail_prob)
                .with_host(host_blocks, mode, retention)
                .with_disk(disk_blocks)
                .with_resets(if resets { 0.05 } else { 0.0 }),
        );
    }
}


/// A restarted scheduler restores the disk tier's entries (as a restarted engine reads its
/// files) and serves prefix hits from them; the tokens stay those of the reference.
#[test]
fn restarted_scheduler_serves_hits_from_restored_disk_entries() {
    restart_from_disk_entries(&[AttentionSpan::Full]);
}

/// The same with KV cache groups: every group's entries carry their group, restore under
/// its key, and serve hits in every group; an entry of a group the pool lacks is refused.
#[test]
fn restarted_scheduler_with_kv_groups_restores_every_group() {
    restart_from_disk_entries(&[AttentionSpan::Full, AttentionSpan::SlidingWindow(12), AttentionSpan::SlidingWindow(12)]);
}

fn restart_from_disk_entries(spans: &[AttentionSpan]) {
    let bs = 8;
    let mut cfg = SchedulerConfig::new(bs, 24 * spans.len());
    cfg.attention_spans = spans.to_vec();
    cfg.max_model_len = 128;
    cfg.max_num_batched_tokens = 64;
    cfg.num_host_blocks = 8 * spans.len();
    cfg.num_disk_blocks = 256 * spans.len();
    cfg.enable_kv_events = true;
    let mut rng = StdRng::seed_from_u64(5);
    let prompts: Vec<Vec<u32>> = (0..24).map(|_| (0..rng.random_range(20..100)).map(|_| rng.random_range(0..VOCAB as u32)).collect()).collect();
    let run = |sched: &mut Scheduler, model: &mut FakeModel, tag: &str| -> HashMap<String, Vec<u32>> {
        for (i, p) in prompts.iter().enumerate() {
            sched.add_request(NewRequest::new(format!("{tag}-{i}"), p.clone(), 4)).unwrap();
        }
        let mut outputs: HashMap<String, Vec<u32>> = HashMap::new();
        while sched.has_unfinished_requests() {
            let out = sched.schedule().unwrap();
            let sampled = execute(model, &out);
            for u in sched.update(out.step_id, &sampled).unwrap() {
                outputs.entry(sched.request_id(u.request).unwrap().to_string()).or_default().push(u.token);
            }
            sched.check_invariants().unwrap();
        }
        outputs
    };
    let check = |outputs: &HashMap<String, Vec<u32>>, tag: &str| {
        for (i, p) in prompts.iter().enumerate() {
            let e = Expect { prompt: p.clone(), max_tokens: 4, min_tokens: 0, eos: vec![], n: 1, outputs: vec![], reasons: vec![], aborted: false };
            assert_eq!(outputs[&format!("{tag}-{i}")], reference_outputs(&e, 0, 128, spans).0, "{tag}-{i}");
        }
    };
    let mut first = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(24 * spans.len(), 8 * spans.len(), 256 * spans.len(), bs);
    model.spans = spans.to_vec();
    let outputs = run(&mut first, &mut model, "a");
    check(&outputs, "a");
    assert!(first.stats().blocks_written_to_disk > 0, "the small host tier must spill to disk");
    // Shutdown: flush what the device and host tiers cache down to disk.
    for _ in 0..64 {
        let out = first.schedule_flush().unwrap();
        let empty = out.swap_out.is_empty() && out.disk_store.is_empty();
        assert!(execute(&mut model, &out).is_empty());
        first.update(out.step_id, &[]).unwrap();
        first.check_invariants().unwrap();
        if empty {
            break;
        }
    }
    // "Files": every cached disk slot's identity and KV, as the runner writes them.
    let entries: Vec<_> = (0..256 * spans.len() as u32).filter_map(|s| first.disk_block_info(s).map(|info| (s, info))).collect();
    assert!(!entries.is_empty());
    let (slots, infos): (Vec<u32>, Vec<_>) = entries.into_iter().rev().unzip(); // children first: order must not matter
    let mut second = Scheduler::new(cfg).unwrap();
    let restored = second.restore_disk_blocks(&infos);
    // An entry whose parent never reached the disk (evicted from the device in a step whose
    // write-backs had filled the small host tier) cannot be linked, and is left out.
    let n_restored = restored.iter().filter(|s| s.is_some()).count();
    assert!(n_restored * 4 >= restored.len() * 3, "{n_restored} of {} entries restored", restored.len());
    // The restored entries are announced as stored on DISK (and nothing else); events name
    // group 0's blocks only.
    let n_announced = infos.iter().zip(&restored).filter(|(info, s)| info.4 == 0 && s.is_some()).count();
    let mut replay = EventReplay::default();
    replay.sync(&mut second, "after the restore");
    assert_eq!(replay.pools.get(&Medium::Disk).map_or(0, HashSet::len), n_announced);
    assert_eq!(replay.pools.values().map(HashSet::len).sum::<usize>(), n_announced);
    let mut model2 = FakeModel::new(24 * spans.len(), 8 * spans.len(), 256 * spans.len(), bs);
    model2.spans = spans.to_vec();
    for (old, new) in slots.iter().zip(&restored) {
        if let Some(new) = new {
            let (o, n) = (*old as usize * bs, *new as usize * bs);
            model2.disk[n..n + bs].copy_from_slice(&model.disk[o..o + bs]);
        }
    }
    // A tampered entry (tokens that do not match its hash) is refused, and so is an entry
    // moved to another group (its hash is its group's) or to a group the pool lacks.
    let (h, p, mut t, salt, group) = infos[0].clone();
    t[0] ^= 1;
    assert_eq!(second.restore_disk_blocks(&[(h, p, t, salt.clone(), group)]), vec![None]);
    let (h, p, t, salt, group) = infos[0].clone();
    let other = (group + 1) % spans.len() as u32;
    if other != group {
        assert_eq!(second.restore_disk_blocks(&[(h, p, t.clone(), salt.clone(), other)]), vec![None]);
    }
    assert_eq!(second.restore_disk_blocks(&[(h, p, t, salt, spans.len() as u32)]), vec![None]);
    if spans.len() > 1 {
        let groups: HashSet<u32> = infos.iter().map(|info| info.4).collect();
        assert_eq!(groups.len(), spans.len(), "every group reached the disk: {groups:?}");
    }
    let outputs = run(&mut second, &mut model2, "b");
    check(&outputs, "b");
    replay.sync(&mut second, "after the second run");
    assert!(second.stats().prefix_cache_disk_hits > 0, "the restarted scheduler never hit the disk tier");
}
