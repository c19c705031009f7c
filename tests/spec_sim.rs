//! Speculative decoding in the scheduler, simulated with the fake model of `common` (it reads
//! the KV cache through the block tables, as attention does).
//!
//! The "model" samples a function of the whole context: mostly a short cycle over the last
//! token (so that prompt lookup finds and drafts continuations that are often right), now and
//! then a token derived from the context's digest (so that drafts are also often wrong, at
//! random positions). Each logits row's digest must equal the digest of the exact context it
//! stands for (the sample's verified tokens plus the drafts before that row), read through the
//! block tables: a rejected draft's stale slot read later, a wrong slot or a lost block changes
//! it. Under a pool small enough to force preemption, with `n > 1` forks, eos and length
//! limits, and steps that fail part-way and are rolled back, the outputs with speculation must
//! equal a contiguous reference token for token; after every schedule and every update the
//! invariants hold (no block holding a draft is in the prefix cache; every table holds exactly
//! the blocks of its computed tokens, so rejected slots and the blocks they emptied are back);
//! at the end every block is free.

mod common;

use std::collections::HashMap;

use pagedkv::scheduler::{FinishReason, NewRequest, Scheduler, SchedulerConfig, StepOutput};
use pagedkv::speculative::{SpecMethod, SpeculativeConfig, SuffixParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::{push_reference_token, reference_digest, FakeModel};
use pagedkv::attention_span::AttentionSpan;

const VOCAB: u64 = 500;
const EOS: u32 = 3;

/// The token sampled after a context whose digest is `digest` and whose last token is `last`.
fn next_token(digest: u64, last: u32) -> u32 {
    if digest.is_multiple_of(7) {
        ((digest >> 11) % VOCAB) as u32
    } else {
        (last * 5 + 1) % 40 + 10
    }
}

fn digest_of(tokens: &[u32]) -> u64 {
    let spans = [AttentionSpan::Full];
    let mut values = Vec::new();
    for &t in tokens {
        push_reference_token(&spans, &mut values, t);
    }
    reference_digest(&values)
}

struct Req {
    prompt: Vec<u32>,
    max_tokens: usize,
    eos: bool,
    n: usize,
}

/// What a contiguous cache would produce for one sample.
fn reference(r: &Req, max_model_len: usize) -> (Vec<u32>, FinishReason) {
    let mut ctx = r.prompt.clone();
    let mut out = Vec::new();
    loop {
        let t = next_token(digest_of(&ctx), *ctx.last().unwrap());
        ctx.push(t);
        out.push(t);
        if r.eos && t == EOS {
            return (out, FinishReason::Stop);
        }
        if out.len() >= r.max_tokens || ctx.len() >= max_model_len {
            return (out, FinishReason::Length);
        }
    }
}

/// One step's sampled tokens, checking each logits row's digest against its context.
fn sample_step(sched: &Scheduler, model: &mut FakeModel, out: &StepOutput, reqs: &HashMap<String, Req>, outputs: &HashMap<(String, u32), Vec<u32>>) -> Vec<u32> {
    let values = model.forward(out);
    let mut sampled = Vec::with_capacity(values.len());
    for (s, &value) in values.iter().enumerate() {
        let id = sched.request_id(out.sampled_requests[s]).unwrap().to_string();
        let index = out.sample_indices[s] as u32;
        let mut ctx = reqs[&id].prompt.clone();
        ctx.extend(outputs.get(&(id.clone(), index)).into_iter().flatten());
        let t = out.logits_indices[s] as usize;
        let j = out.draft_offsets[s] as usize;
        ctx.extend(out.input_ids[t + 1 - j..=t].iter().map(|&x| x as u32));
        assert_eq!(value, digest_of(&ctx), "{id} #{index}: logits row {s} read a context other than its own");
        sampled.push(next_token(value, *ctx.last().unwrap()));
    }
    sampled
}

struct Run {
    outputs: HashMap<(String, u32), (Vec<u32>, Option<FinishReason>)>,
    stats: pagedkv::scheduler::SchedulerStats,
    per_position: Vec<u64>,
}

fn run(seed: u64, speculate: Option<SpeculativeConfig>, fail_rate: f64) -> (Run, HashMap<String, Req>, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (bs, num_blocks, max_model_len) = (4, 96, 160);
    let mut cfg = SchedulerConfig::new(bs, num_blocks);
    cfg.max_model_len = max_model_len;
    cfg.max_num_batched_tokens = 64;
    cfg.max_num_seqs = 12;
    cfg.speculative = speculate;
    let mut sched = Scheduler::new(cfg).unwrap();
    let mut model = FakeModel::new(num_blocks, 0, 0, bs);
    let mut reqs = HashMap::new();
    let shared: Vec<u32> = (0..24).map(|_| rng.random_range(10..50)).collect();
    for i in 0..40 {
        let mut prompt: Vec<u32> = if rng.random_bool(0.3) { shared.clone() } else { Vec::new() };
        let len = rng.random_range(1..60);
        prompt.extend((0..len).map(|_| rng.random_range(10..50)));
        let r = Req { prompt, max_tokens: rng.random_range(1..120), eos: rng.random_bool(0.5), n: if rng.random_bool(0.2) { 2 } else { 1 } };
        let mut nr = NewRequest::new(format!("r{i}"), r.prompt.clone(), r.max_tokens);
        nr.n = r.n;
        if r.eos {
            nr.eos_token_ids = vec![EOS];
        }
        sched.add_request(nr).unwrap();
        reqs.insert(format!("r{i}"), r);
    }
    let mut outputs: HashMap<(String, u32), Vec<u32>> = HashMap::new();
    let mut reasons: HashMap<(String, u32), FinishReason> = HashMap::new();
    let mut steps = 0;
    while sched.has_unfinished_requests() {
        steps += 1;
        assert!(steps < 20_000, "no progress");
        let out = sched.schedule().unwrap();
        sched.check_invariants().unwrap();
        if rng.random_bool(fail_rate) {
            model.execute_failing(&out, &mut rng);
            sched.rollback_step(out.step_id).unwrap();
            sched.check_invariants().unwrap();
            continue;
        }
        let sampled = sample_step(&sched, &mut model, &out, &reqs, &outputs);
        let updates = sched.update(out.step_id, &sampled).unwrap();
        for u in updates {
            let key = (sched.request_id(u.request).unwrap().to_string(), u.index);
            assert_eq!(sampled[u.row.unwrap() as usize], u.token, "an update's row holds its token");
            outputs.entry(key.clone()).or_default().push(u.token);
            if let Some(reason) = u.finish_reason {
                reasons.insert(key, reason);
            }
        }
        if matches!(speculate.map(|s| s.method), Some(SpecMethod::Provided)) {
            // A "draft model": the true continuation of each live sample, sometimes corrupted.
            for ((id, index), out) in &outputs {
                if reasons.contains_key(&(id.clone(), *index)) {
                    continue;
                }
                let mut ctx = reqs[id].prompt.clone();
                ctx.extend(out);
                let len = ctx.len();
                let mut drafts = Vec::new();
                for _ in 0..rng.random_range(0..6) {
                    let t = if rng.random_bool(0.15) { rng.random_range(0..VOCAB as u32) } else { next_token(digest_of(&ctx), *ctx.last().unwrap()) };
                    drafts.push(t);
                    ctx.push(t);
                }
                sched.set_drafts(id, *index, len, &drafts).unwrap();
            }
        }
        sched.check_invariants().unwrap();
    }
    let stats = sched.stats();
    assert_eq!(stats.num_free_blocks, num_blocks, "every block is free at the end");
    let outputs = outputs.into_iter().map(|(k, v)| {
        let r = reasons.get(&k).copied();
        (k, (v, r))
    });
    let run = Run { outputs: outputs.collect(), stats, per_position: sched.spec_accepted_per_position().to_vec() };
    (run, reqs, max_model_len)
}

fn check_against_reference(run: &Run, reqs: &HashMap<String, Req>, max_model_len: usize) {
    for (id, r) in reqs {
        let (want, reason) = reference(r, max_model_len);
        for i in 0..r.n as u32 {
            let (got, got_reason) = &run.outputs[&(id.clone(), i)];
            assert_eq!(got, &want, "{id} #{i}: tokens differ from the contiguous reference");
            assert_eq!(*got_reason, Some(reason), "{id} #{i}");
        }
    }
}

fn ngram(k: usize) -> SpeculativeConfig {
    SpeculativeConfig { method: SpecMethod::Ngram { min: 1, max: 3 }, num_speculative_tokens: k, adaptive: false }
}

#[test]
fn drafts_verified_under_preemption_match_the_reference() {
    for seed in 0..6 {
        let (run, reqs, len) = run(seed, Some(ngram(1 + seed as usize % 5)), 0.0);
        check_against_reference(&run, &reqs, len);
        let s = run.stats;
        assert!(s.num_preemptions > 0, "seed {seed}: the pool is small enough to preempt");
        assert!(s.num_spec_draft_tokens > 200, "seed {seed}: drafts were verified ({s:?})");
        assert!(s.num_spec_accepted_tokens > s.num_spec_draft_tokens / 4, "seed {seed}: many were accepted");
        assert!(s.num_spec_accepted_tokens < s.num_spec_draft_tokens, "seed {seed}: some were rejected");
        assert!(s.num_spec_blocks_freed > 0, "seed {seed}: rejections emptied blocks, given back at once");
        assert_eq!(run.per_position.iter().sum::<u64>(), s.num_spec_accepted_tokens);
        assert!(run.per_position.windows(2).all(|w| w[0] >= w[1]), "a later draft is accepted only after the ones before it");
    }
}

#[test]
fn failed_steps_with_drafts_in_flight_roll_back_cleanly() {
    for seed in 10..14 {
        let (run, reqs, len) = run(seed, Some(ngram(4)), 0.15);
        check_against_reference(&run, &reqs, len);
        assert!(run.stats.num_spec_accepted_tokens > 0);
    }
}

#[test]
fn speculation_changes_no_token() {
    let (plain, reqs, len) = run(42, None, 0.0);
    check_against_reference(&plain, &reqs, len);
    let (spec, _, _) = run(42, Some(ngram(3)), 0.0);
    assert_eq!(plain.outputs, spec.outputs);
    assert!(spec.stats.num_steps < plain.stats.num_steps, "accepted drafts save steps");
    assert_eq!(plain.stats.num_spec_drafts, 0);
}

fn suffix(k: usize) -> SpeculativeConfig {
    let p = SuffixParams { max_depth: 12, max_spec_factor: 2.0, min_token_prob: 0.2, max_cached_requests: 16 };
    SpeculativeConfig { method: SpecMethod::Suffix(p), num_speculative_tokens: k, adaptive: false }
}

#[test]
fn suffix_drafts_match_the_reference_with_failed_steps() {
    for seed in 20..24 {
        let (run, reqs, len) = run(seed, Some(suffix(2 + seed as usize % 6)), if seed % 2 == 0 { 0.0 } else { 0.1 });
        check_against_reference(&run, &reqs, len);
        let s = run.stats;
        assert!(s.num_spec_draft_tokens > 200 && s.num_spec_accepted_tokens > s.num_spec_draft_tokens / 4, "seed {seed}: {s:?}");
        assert!(s.num_spec_accepted_tokens < s.num_spec_draft_tokens);
    }
}

#[test]
fn provided_drafts_match_the_reference() {
    let provided = SpeculativeConfig { method: SpecMethod::Provided, num_speculative_tokens: 4, adaptive: false };
    for seed in 30..34 {
        let (run, reqs, len) = run(seed, Some(provided), if seed % 2 == 0 { 0.0 } else { 0.1 });
        check_against_reference(&run, &reqs, len);
        let s = run.stats;
        assert!(s.num_spec_accepted_tokens > s.num_spec_draft_tokens / 3, "seed {seed}: {s:?}");
        assert!(s.num_spec_accepted_tokens < s.num_spec_draft_tokens && s.num_preemptions > 0);
    }
}
