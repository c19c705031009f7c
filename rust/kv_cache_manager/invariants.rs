//! [`KvCacheManager::check_invariants`]: the pools', the ledger's and the block tables'
//! invariants (the manager's module docs), for tests and debug checks.

use crate::block_table::blocks_for;
use crate::error::{CoreError, Result};
use crate::ids::BlockId;

use super::tier_ledger::Tier;
use super::KvCacheManager;

impl KvCacheManager {
    /// Checks every pool's and the tables' invariants (module docs).
    pub fn check_invariants(&self) -> Result<()> {
        self.pool.check_invariants()?;
        let bs = self.block_size();
        let mut holders = vec![0u32; self.pool.num_blocks()];
        let mut host_holders = vec![0u32; self.ledger.host().map_or(0, |h| h.num_blocks())];
        for (key, seq) in self.seqs.iter() {
            let slot = key.slot;
            let want = blocks_for(seq.num_computed, bs);
            if seq.groups.len() != self.spans.len() {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot} has {} groups, the manager {}",
                    seq.groups.len(),
                    self.spans.len()
                )));
            }
            for (c, (group, span)) in seq.groups.iter().zip(&self.spans).enumerate() {
                if group.table.len() != want {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot} holds {} blocks in group {c} for {} computed tokens (want {want})",
                        group.table.len(),
                        seq.num_computed
                    )));
                }
                // Only blocks no query from `write_start` on sees are given back, and exactly they
                // are null.
                let nulls_ok = group.table.blocks().iter().enumerate().all(|(k, b)| b.is_null() == (k < group.num_released));
                // A sequence that keeps all its blocks gives none back.
                let limit = if seq.keep_all { 0 } else { span.dead_blocks(seq.write_start, bs) };
                let released_ok = group.num_released <= limit;
                if !nulls_ok || !released_ok {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot}, group {c} ({span:?}): {} entries given back of {:?} at write start {}",
                        group.num_released,
                        group.table.blocks(),
                        seq.write_start
                    )));
                }
            }
            // No block holding a draft is offered to the prefix cache.
            let first_draft_block = seq.num_verified() / bs;
            let cached = |b: &BlockId| !b.is_null() && self.pool.is_cached(*b);
            if seq.tier == Tier::Device
                && seq.num_drafts > 0
                && seq.groups.iter().any(|c| c.table.blocks().iter().skip(first_draft_block).any(cached))
            {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot}: a block holding one of its {} drafts is in the prefix cache",
                    seq.num_drafts
                )));
            }
            if seq.num_computed > seq.tokens.len() || seq.write_start > seq.num_computed {
                return Err(CoreError::InvariantViolation(format!(
                    "sequence in slot {slot}: write_start {} <= computed {} <= tokens {} does not hold",
                    seq.write_start,
                    seq.num_computed,
                    seq.tokens.len()
                )));
            }
            let counts = match seq.tier {
                Tier::Device => &mut holders,
                Tier::Host if self.ledger.host().is_some() => &mut host_holders,
                Tier::Host | Tier::Disk => {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot} is on tier {:?}, which cannot hold it",
                        seq.tier
                    )))
                }
            };
            for b in seq.held_blocks() {
                counts[b.index()] += 1;
            }
        }
        for (i, &h) in holders.iter().enumerate() {
            let rc = self.pool.ref_count_unchecked(BlockId(i as u32));
            if rc != h {
                return Err(CoreError::InvariantViolation(format!(
                    "block {i} has ref count {rc} but {h} block tables hold it"
                )));
            }
        }
        // The lower tiers: their pools, and host ref counts = host tables + pins.
        self.ledger.check_invariants(host_holders)?;
        // Write windows: no block is written by two sequences, and a block written while other
        // sequences hold it must be a registered full block, which they reached through a
        // verified prefix hit on exactly the tokens being written.
        let mut writers = vec![0u32; self.pool.num_blocks()];
        for (key, seq) in self.seqs.iter() {
            let slot = key.slot;
            if seq.write_start == seq.num_computed || seq.tier != Tier::Device {
                continue;
            }
            let first = seq.write_start / bs;
            let last = (seq.num_computed - 1) / bs;
            for &b in seq.groups.iter().flat_map(|c| &c.table.blocks()[first..=last]) {
                writers[b.index()] += 1;
                if writers[b.index()] > 1 {
                    return Err(CoreError::InvariantViolation(format!(
                        "block {b} is in the write window of two sequences (one in slot {slot})"
                    )));
                }
                if holders[b.index()] > 1 && !self.pool.is_cached(b) {
                    return Err(CoreError::InvariantViolation(format!(
                        "sequence in slot {slot} writes into block {b}, which {} sequences share",
                        holders[b.index()]
                    )));
                }
            }
        }
        Ok(())
    }
}
