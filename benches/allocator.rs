//! Allocator microbenchmarks (criterion): `cargo bench --bench allocator`.
//!
//! Targets (issue 2): <= 20 ns per single-block allocate+free; <= 5 us to append one token to
//! each of 256 sequences. benches/RESULTS.md records the figures.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::block_hash::{ExtraKey, HashMode};
use pagedkv::block_pool::BlockPool;
use pagedkv::kv_cache_manager::{AddSequence, KvCacheManager};

fn pool_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    let mut pool = BlockPool::new(65_536, 16, true, HashMode::Xxh3).unwrap();
    g.bench_function("allocate+free 1 block", |b| {
        b.iter(|| {
            let blk = pool.allocate_one().unwrap();
            pool.free(&[black_box(blk)]).unwrap();
        })
    });
    let mut out = Vec::with_capacity(16);
    g.throughput(Throughput::Elements(16));
    g.bench_function("allocate+free 16 blocks", |b| {
        b.iter(|| {
            out.clear();
            assert!(pool.allocate_into(16, &mut out));
            pool.free(black_box(&out)).unwrap();
        })
    });
    let held = pool.allocate(16).unwrap();
    g.bench_function("fork+free 16 blocks", |b| {
        b.iter(|| {
            pool.fork(black_box(&held)).unwrap();
            pool.free(black_box(&held)).unwrap();
        })
    });
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix cache");
    let mut m = KvCacheManager::new(4096, 16, true, HashMode::Xxh3).unwrap();
    let prompt: Vec<u32> = (0..2048u32)
        .map(|i| i.wrapping_mul(2654435761) % 50_000)
        .collect();
    let (s, _) = m.add_sequence(AddSequence::new(prompt.clone(), ExtraKey::new(None)));
    assert!(m.allocate_slots(s, prompt.len()).unwrap());
    let key = ExtraKey::new(None);
    g.throughput(Throughput::Elements(prompt.len() as u64));
    g.bench_function(
        "lookup 2k-token prompt (127 cached blocks, hash + verify)",
        |b| {
            b.iter(|| {
                let hit = m.match_prefix(black_box(&prompt), &key);
                assert_eq!(hit.num_blocks(), 127);
            })
        },
    );
    g.finish();
}

fn decode_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("sequences");
    let (num_seqs, ctx, bs, steps_per_cycle) = (256usize, 2048usize, 16usize, 1024usize);
    // 256 sequences at 2k context, decoding: each timed iteration is one batched append (one
    // token to each sequence), so block allocation and full-block hashing/registration happen
    // every 16th iteration, as in steady-state decoding. Every `steps_per_cycle` iterations the
    // sequences are recreated (untimed) so the pool never runs out. Token vectors are created
    // with room for the whole cycle, as the scheduler does (prompt + max_tokens).
    let setup = || {
        let mut m = KvCacheManager::new(
            num_seqs * ((ctx + steps_per_cycle) / bs + 1),
            bs,
            true,
            HashMode::Xxh3,
        )
        .unwrap();
        let ids: Vec<_> = (0..num_seqs)
            .map(|i| {
                let mut tokens: Vec<u32> = Vec::with_capacity(ctx + steps_per_cycle);
                tokens.extend((0..ctx as u32).map(|t| t ^ (i as u32) << 16));
                let (s, _) = m.add_sequence(AddSequence::new(tokens, ExtraKey::new(None)));
                assert!(m.allocate_slots(s, ctx).unwrap());
                s
            })
            .collect::<Vec<_>>();
        (m, ids)
    };
    let tokens: Vec<u32> = (0..num_seqs as u32).collect();
    g.throughput(Throughput::Elements(num_seqs as u64));
    g.bench_function(
        "append 1 token to each of 256 sequences (2k context)",
        |b| {
            let mut ok = Vec::with_capacity(num_seqs);
            b.iter_custom(|iters| {
                let mut total = std::time::Duration::ZERO;
                let mut state = setup();
                let mut steps = 0;
                for _ in 0..iters {
                    if steps == steps_per_cycle {
                        state = setup();
                        steps = 0;
                    }
                    let (m, ids) = &mut state;
                    let t = Instant::now();
                    m.append_tokens_with_slots(black_box(ids), &tokens, &mut ok)
                        .unwrap();
                    total += t.elapsed();
                    steps += 1;
                }
                total
            })
        },
    );
    g.finish();
}

criterion_group!(benches, pool_ops, prefix_lookup, decode_append);
criterion_main!(benches);
