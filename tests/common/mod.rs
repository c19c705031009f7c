//! The fake model of the scheduler simulations (`scheduler_sim.rs`, `beam_sim.rs`).
//!
//! It keeps one value per KV slot on each tier: the digest of the token at that position
//! chained with the value of the previous position, read *through the row's block table* (as
//! attention reads earlier keys). It runs a step's block copies in the runner's order, so a
//! wrong block table, slot mapping, prefix hit, copy-on-write, swap or lost block changes a
//! digest, and with it every later token.

#![allow(dead_code)] // each simulation uses its own part

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

/// The fake model: one value per slot of the device, host and disk tiers.
pub struct FakeModel {
    pub bs: usize,
    pub kv: Vec<Option<u64>>,
    pub host: Vec<Option<u64>>,
    pub disk: Vec<Option<u64>>,
}

impl FakeModel {
    pub fn new(num_blocks: usize, num_host_blocks: usize, num_disk_blocks: usize, bs: usize) -> Self {
        FakeModel { bs, kv: vec![None; num_blocks * bs], host: vec![None; num_host_blocks * bs], disk: vec![None; num_disk_blocks * bs] }
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
        let slot = table[pos / self.bs] as usize * self.bs + pos % self.bs;
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

    /// A forward: the copies, then every scheduled token's value written to its slot, and the
    /// value at each logits row (the digest of that row's sequence as the KV holds it).
    pub fn forward(&mut self, out: &StepOutput) -> Vec<u64> {
        self.copy_blocks(out, || true);
        let w = out.block_table_width;
        // Positions of one row depend on earlier positions of the same row, so rows are
        // processed token by token in order (a causal forward).
        for row in 0..out.num_rows() {
            let table = &out.block_tables[row * w..(row + 1) * w];
            let (s, e) = (out.cu_seqlens_q[row] as usize, out.cu_seqlens_q[row + 1] as usize);
            for t in s..e {
                let pos = out.positions[t] as usize;
                let prev = if pos == 0 { ROOT } else { self.read(table, pos - 1) };
                self.kv[out.slot_mapping[t] as usize] = Some(chain(prev, out.input_ids[t] as u32));
            }
            assert_eq!(out.seq_lens[row] as i64, out.positions[e - 1] + 1);
        }
        out.logits_indices.iter().map(|&t| self.kv[out.slot_mapping[t as usize] as usize].unwrap()).collect()
    }
}
