//! The fake model of the scheduler simulations (`scheduler_sim.rs`, `beam_sim.rs`).
//!
//! It keeps one value per KV slot on each tier: the digest of the token at that position
//! chained with the value of the previous position, read *through the row's block table* (as
//! attention reads earlier keys). It runs a step's block copies in the runner's order, so a
//! wrong block table, slot mapping, prefix hit, copy-on-write, swap or lost block changes a
//! digest, and with it every later token.

#![allow(dead_code)] // each simulation uses its own part

use pagedkv::attention_span::AttentionSpan;
use pagedkv::kv_cache_manager::Tier;
use pagedkv::scheduler::StepOutput;
use rand::rngs::StdRng;
use rand::Rng;

/// The digest of the empty sequence.
pub const ROOT: u64 = 0x9E37_79B9_7F4A_7C15;

/// The digest after `token`, given the digest before it.
pub fn chain(prev: u64, token: u32) -> u64 {
    let mut z = prev ^ (token as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 29)
}

/// The value a group's layer writes at a position: the chain over the previous position's
/// value (`prev`, `ROOT` where the query cannot see it: at 0, at a chunk's start) and, in a
/// sliding or chunked group, the value at the first position the query sees (`first`, `ROOT`
/// when that is the query itself), so a wrong block anywhere in the window changes it. A full
/// group's value is the plain chain.
pub fn column_value(span: AttentionSpan, prev: u64, first: u64, token: u32) -> u64 {
    if span.is_full() {
        chain(prev, token)
    } else {
        chain(prev ^ first.rotate_left(17), token)
    }
}

/// What a contiguous cache holds in every group (`values[c][pos]`), grown a token at a time.
pub fn push_reference_token(spans: &[AttentionSpan], values: &mut Vec<Vec<u64>>, token: u32) {
    values.resize(spans.len(), Vec::new());
    for (span, group) in spans.iter().zip(values.iter_mut()) {
        let pos = group.len();
        let fv = span.first_visible(pos);
        let prev = if pos > fv { group[pos - 1] } else { ROOT };
        let first = if fv < pos { group[fv] } else { ROOT };
        group.push(column_value(*span, prev, first, token));
    }
}

/// The digest a sequence's logits see: its last position's value in every group, combined.
pub fn reference_digest(values: &[Vec<u64>]) -> u64 {
    values.iter().map(|group| *group.last().unwrap()).fold(0, |a, v| a ^ v)
}

/// The fake model: one value per slot of the device, host and disk tiers.
pub struct FakeModel {
    pub bs: usize,
    pub kv: Vec<Option<u64>>,
    pub host: Vec<Option<u64>>,
    pub disk: Vec<Option<u64>>,
    /// What each KV cache group's layer attends to (one full group by default).
    pub spans: Vec<AttentionSpan>,
}

impl FakeModel {
    pub fn new(num_blocks: usize, num_host_blocks: usize, num_disk_blocks: usize, bs: usize) -> Self {
        FakeModel {
            bs,
            kv: vec![None; num_blocks * bs],
            host: vec![None; num_host_blocks * bs],
            disk: vec![None; num_disk_blocks * bs],
            spans: vec![AttentionSpan::Full],
        }
    }

    /// The slots of one tier.
    pub fn slots(&mut self, tier: Tier) -> &mut [Option<u64>] {
        match tier {
            Tier::Device => &mut self.kv,
            Tier::Host => &mut self.host,
            Tier::Disk => &mut self.disk,
        }
    }

    /// Runs the step's block copies in the runner's order (disk stores, swap-outs, disk loads,
    /// swap-ins, copy-on-write); with `keep`, only the ops it accepts (a failing step).
    pub fn copy_blocks(&mut self, out: &StepOutput, mut keep: impl FnMut() -> bool) {
        let bs = self.bs;
        let lists = [
            (&out.disk_store, Tier::Host, Tier::Disk),
            (&out.swap_out, Tier::Device, Tier::Host),
            (&out.disk_load, Tier::Disk, Tier::Host),
            (&out.swap_in, Tier::Host, Tier::Device),
            (&out.copy_ops, Tier::Device, Tier::Device),
        ];
        for (ops, from, to) in lists {
            for op in ops.chunks(2) {
                if keep() {
                    let (src, dst) = (op[0] as usize * bs, op[1] as usize * bs);
                    let block = self.slots(from)[src..src + bs].to_vec();
                    self.slots(to)[dst..dst + bs].copy_from_slice(&block);
                }
            }
        }
    }

    /// The value at position `pos` of the row whose block table is `table`.
    pub fn read(&self, table: &[i32], pos: usize) -> u64 {
        let entry = table[pos / self.bs];
        assert!(entry >= 0, "attention read position {pos} through a given-back block");
        let slot = entry as usize * self.bs + pos % self.bs;
        self.kv[slot].expect("attention read a slot that was never written")
    }

    /// A forward that fails part-way: some copy ops run, some of the step's slots get garbage.
    pub fn execute_failing(&mut self, out: &StepOutput, rng: &mut StdRng) {
        self.copy_blocks(out, || rng.random_bool(0.5));
        for &slot in &out.slot_mapping {
            if rng.random_bool(0.5) {
                self.kv[slot as usize] = Some(rng.random());
            }
        }
    }

    /// A forward: the copies, then every scheduled token's value written to its slot in every
    /// group, and the value at each logits row (the groups' values of that row's last
    /// position, combined: the digest of the sequence as the KV holds it).
    pub fn forward(&mut self, out: &StepOutput) -> Vec<u64> {
        self.copy_blocks(out, || true);
        let (w, rows, tokens) = (out.block_table_width, out.num_rows(), out.num_tokens());
        assert_eq!(out.num_kv_groups, self.spans.len());
        assert_eq!(out.block_tables.len(), out.num_kv_groups * rows * w);
        assert_eq!(out.slot_mapping.len(), out.num_kv_groups * tokens);
        for (c, &span) in self.spans.clone().iter().enumerate() {
            // Positions of one row depend on earlier positions of the same row, so rows are
            // processed token by token in order (a causal forward).
            for row in 0..rows {
                let at = (c * rows + row) * w;
                let table = out.block_tables[at..at + w].to_vec();
                let (s, e) = (out.cu_seqlens_q[row] as usize, out.cu_seqlens_q[row + 1] as usize);
                for t in s..e {
                    let pos = out.positions[t] as usize;
                    // The query reads only keys it sees: the previous position unless a chunk
                    // starts here, and the first visible one.
                    let fv = span.first_visible(pos);
                    let prev = if pos > fv { self.read(&table, pos - 1) } else { ROOT };
                    let first = if fv < pos { self.read(&table, fv) } else { ROOT };
                    self.kv[out.slot_mapping[c * tokens + t] as usize] = Some(column_value(span, prev, first, out.input_ids[t] as u32));
                }
                assert_eq!(out.seq_lens[row] as i64, out.positions[e - 1] + 1);
            }
        }
        out.logits_indices
            .iter()
            .map(|&t| (0..out.num_kv_groups).map(|c| self.kv[out.slot_mapping[c * tokens + t as usize] as usize].unwrap()).fold(0, |a, v| a ^ v))
            .collect()
    }
}
