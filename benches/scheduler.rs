//! Scheduler step cost in pure Rust (criterion): `cargo bench --bench scheduler`.
//!
//! One step = `schedule()` (flat output arrays included) + `update()` with one sampled token
//! per row. Scenarios: 256 decodes at 2k-token contexts, with a fresh output per step
//! (`schedule`) and with two outputs reused in turn (`schedule_into`, as the Python bindings
//! reuse their arrays: only block-table rows that changed are written); a mixed step of
//! decodes and prefill chunks of arriving 1024-token prompts under a 2048-token budget. The
//! Python figures (with the numpy conversion) come from benches/bench_scheduler.py.
//!
//! Speculative decoding: the n-gram and suffix proposers alone for 256 rows with 2k-token
//! contexts (one new token per row per step, proposals of up to 5 tokens; contexts over 512
//! distinct tokens so that most lookups find earlier occurrences and walk their candidates: the
//! proposers' expensive case; suffix decoding also matches 1000 recent outputs of 256 tokens;
//! target <= 50 us per step), and a whole step with drafts (256 decodes, up to 4 drafts each,
//! verification in `update`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pagedkv::scheduler::{NewRequest, Scheduler, SchedulerConfig, StepOutput};
use pagedkv::speculative::{suffix, NgramIndex, RecentOutputs, SpecMethod, SpeculativeConfig, SuffixParams};

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 50_000)
        .collect()
}

fn decode_scheduler(num_seqs: usize, ctx: usize, steps: usize) -> Scheduler {
    let bs = 16;
    let max_new = steps + num_seqs * ctx / 8192 + 16;
    let max_len = ctx + max_new;
    let mut cfg = SchedulerConfig::new(bs, num_seqs * (max_len / bs + 1));
    cfg.max_model_len = max_len;
    cfg.max_num_seqs = num_seqs;
    cfg.max_num_batched_tokens = 8192;
    let mut s = Scheduler::new(cfg).unwrap();
    for i in 0..num_seqs {
        let mut r = NewRequest::new(format!("r{i}"), prompt(i as u32, ctx), max_new);
        r.ignore_eos = true;
        s.add_request(r).unwrap();
    }
    loop {
        let out = s.schedule().unwrap();
        let sampled = vec![0u32; out.num_sampled()];
        s.update(out.step_id, &sampled).unwrap();
        if out.num_rows() == num_seqs && out.num_tokens() == num_seqs {
            return s;
        }
    }
}

fn decode_step(c: &mut Criterion) {
    let (num_seqs, ctx, steps_per_setup) = (256, 2048, 1000);
    let sampled = vec![0u32; num_seqs];
    c.bench_function("schedule+update: 256 decodes, 2k contexts", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut s = decode_scheduler(num_seqs, ctx, steps_per_setup);
            let mut n = 0;
            for _ in 0..iters {
                if n == steps_per_setup {
                    s = decode_scheduler(num_seqs, ctx, steps_per_setup);
                    n = 0;
                }
                let t = Instant::now();
                let out = s.schedule().unwrap();
                black_box(s.update(out.step_id, &sampled).unwrap());
                total += t.elapsed();
                n += 1;
            }
            total
        })
    });
}

fn decode_step_reused(c: &mut Criterion) {
    let (num_seqs, ctx, steps_per_setup) = (256, 2048, 1000);
    let sampled = vec![0u32; num_seqs];
    c.bench_function(
        "schedule_into+update: 256 decodes, 2k contexts, 2 outputs reused",
        |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut s = decode_scheduler(num_seqs, ctx, steps_per_setup);
                let mut outs = [StepOutput::default(), StepOutput::default()];
                let mut n = 0;
                for _ in 0..iters {
                    if n == steps_per_setup {
                        s = decode_scheduler(num_seqs, ctx, steps_per_setup);
                        n = 0;
                    }
                    let out = &mut outs[n % 2];
                    let t = Instant::now();
                    s.schedule_into(out).unwrap();
                    black_box(s.update(out.step_id, &sampled).unwrap());
                    total += t.elapsed();
                    n += 1;
                }
                total
            })
        },
    );
}

fn mixed_step(c: &mut Criterion) {
    let mut cfg = SchedulerConfig::new(16, 40_000);
    cfg.max_model_len = 4096;
    cfg.max_num_seqs = 256;
    cfg.max_num_batched_tokens = 2048;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut next = 0u32;
    let mut feed = |s: &mut Scheduler| {
        while s.num_waiting() < 4 {
            let mut r = NewRequest::new(
                format!("m{next}"),
                prompt(next, 1024),
                100 + (next as usize * 37) % 300,
            );
            r.ignore_eos = true;
            s.add_request(r).unwrap();
            next += 1;
        }
    };
    let step = |s: &mut Scheduler| {
        let out = s.schedule().unwrap();
        let sampled = vec![0u32; out.num_sampled()];
        black_box(s.update(out.step_id, &sampled).unwrap());
    };
    for _ in 0..200 {
        feed(&mut s);
        step(&mut s);
    }
    c.bench_function(
        "schedule+update: mixed decodes + 1024-token prompt chunks, budget 2048",
        |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    feed(&mut s);
                    let t = Instant::now();
                    step(&mut s);
                    total += t.elapsed();
                }
                total
            })
        },
    );
}

/// Tokens over a small vocabulary with repeats (a copy-heavy context).
fn repetitive(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| ((i / 3).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 512).collect()
}

/// Times `propose(index, tokens, out)` for 256 rows with 2k-token contexts, one new token per
/// row per step (the contexts indexed once before timing).
fn time_proposals(iters: u64, mut propose: impl FnMut(&mut NgramIndex, &[u32], &mut Vec<u32>)) -> Duration {
    let (rows, ctx) = (256, 2048);
    let mut contexts: Vec<Vec<u32>> = (0..rows).map(|r| repetitive(r as u32, ctx)).collect();
    let mut indexes = vec![NgramIndex::default(); rows];
    let mut out = Vec::new();
    for (idx, t) in indexes.iter_mut().zip(&contexts) {
        propose(idx, t, &mut out);
    }
    let mut total = Duration::ZERO;
    for step in 0..iters {
        for (r, t) in contexts.iter_mut().enumerate() {
            let next = t[(step as usize * 7 + r) % ctx];
            t.push(next);
        }
        let start = Instant::now();
        for (idx, t) in indexes.iter_mut().zip(&contexts) {
            propose(idx, t, &mut out);
            black_box(&out);
        }
        total += start.elapsed();
    }
    total
}

fn ngram_proposals(c: &mut Criterion) {
    c.bench_function("ngram proposals: 256 rows, 2k contexts, k = 5", |b| {
        b.iter_custom(|iters| time_proposals(iters, |idx, t, out| idx.propose(t, 2, 5, 5, out)))
    });
}

fn suffix_proposals(c: &mut Criterion) {
    let params = SuffixParams::default();
    let mut recent = RecentOutputs::default();
    for r in 0..1000u32 {
        recent.add(&repetitive(r + 7919, 256), params.max_cached_requests);
    }
    c.bench_function("suffix proposals: 256 rows, 2k contexts, 1000 recent outputs, k = 5", |b| {
        b.iter_custom(|iters| time_proposals(iters, |idx, t, out| suffix::propose(idx, t, &recent, &params, 5, out)))
    });
}

fn spec_decode_step(c: &mut Criterion) {
    let (num_seqs, ctx, steps_per_setup) = (256, 2048, 200);
    // The token sampled after each logits row: a function of the row's last token, so the
    // drafts (copied from earlier occurrences) are right as often as the context repeats.
    let sample = |out: &StepOutput| -> Vec<u32> {
        out.logits_indices.iter().map(|&t| ((out.input_ids[t as usize] as u32) * 7 + 1) % 512).collect()
    };
    let setup = || {
        let max_len = ctx + 5 * steps_per_setup + 64;
        let mut cfg = SchedulerConfig::new(16, num_seqs * (max_len / 16 + 1));
        cfg.max_model_len = max_len;
        cfg.max_num_seqs = num_seqs;
        cfg.max_num_batched_tokens = 8192;
        let method = SpecMethod::Ngram { min: 2, max: 5 };
        cfg.speculative = Some(SpeculativeConfig { method, num_speculative_tokens: 4, adaptive: false });
        let mut s = Scheduler::new(cfg).unwrap();
        for i in 0..num_seqs {
            let mut r = NewRequest::new(format!("r{i}"), repetitive(i as u32, ctx), max_len - ctx);
            r.ignore_eos = true;
            s.add_request(r).unwrap();
        }
        // Prefill until every row decodes.
        loop {
            let out = s.schedule().unwrap();
            let done = out.num_rows() == num_seqs && out.num_sampled() >= num_seqs && out.num_tokens() < 4 * 8192;
            s.update(out.step_id, &sample(&out)).unwrap();
            if done && s.num_waiting() == 0 {
                return s;
            }
        }
    };
    c.bench_function("schedule+update with n-gram drafts: 256 decodes, 2k contexts, k = 4", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut s = setup();
            let mut n = 0;
            for _ in 0..iters {
                if n == steps_per_setup {
                    s = setup();
                    n = 0;
                }
                let t = Instant::now();
                let out = s.schedule().unwrap();
                let sampled = sample(&out);
                black_box(s.update(out.step_id, &sampled).unwrap());
                total += t.elapsed();
                n += 1;
            }
            total
        })
    });
}

criterion_group!(benches, decode_step, decode_step_reused, mixed_step, ngram_proposals, suffix_proposals, spec_decode_step);
criterion_main!(benches);
