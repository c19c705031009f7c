//! A sequence's state: its tokens, how many hold a KV slot, and one block table per group,
//! with the retention policy its prompt blocks get in the prefix cache once free.

use crate::block_hash::{BlockHash, ExtraKey};
use crate::block_pool::ChainLink;
use crate::block_table::BlockTable;
use crate::error::{CoreError, Result};
use crate::eviction_queue::{DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY};
use crate::ids::BlockId;
use smallvec::SmallVec;

use super::prefix::PrefixMatch;
use super::tier_ledger::Tier;

/// How long a sequence's prompt blocks are kept in the prefix cache once free: a retention
/// priority in `0 ..= 100` (higher is kept longer; blocks filled by decoding get the default,
/// 35), an optional duration after which the priority falls back to the default, and
/// optionally how many leading prompt tokens it covers (e.g. a shared system prompt, not the
/// request's private tail, whose blocks keep the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Priority of the prompt's full blocks.
    pub priority: u8,
    /// Microseconds the priority holds after the block is freed (`None`: for good).
    pub duration_us: Option<u64>,
    /// Only the full blocks within the first this many prompt tokens get `priority` (`None`:
    /// the whole prompt).
    pub num_tokens: Option<usize>,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy { priority: DEFAULT_RETENTION_PRIORITY, duration_us: None, num_tokens: None }
    }
}

impl RetentionPolicy {
    /// Checks the priority range.
    pub fn validate(&self) -> Result<()> {
        if self.priority > MAX_RETENTION_PRIORITY {
            return Err(CoreError::InvalidArgument(format!(
                "retention priority must be in 0..={MAX_RETENTION_PRIORITY}, got {}",
                self.priority
            )));
        }
        Ok(())
    }
}

/// A new sequence for [`super::KvCacheManager::add_sequence`]: its prompt, salt, the cached
/// prefix it starts from and how its blocks are kept. `AddSequence::new(tokens, extra)` and
/// struct-update syntax (`..Default::default()`) for the rest.
#[derive(Debug, Clone, Default)]
pub struct AddSequence {
    /// Every known token id (the prompt).
    pub tokens: Vec<u32>,
    /// The cache salt of its blocks: prefix hits are found under it only.
    pub extra: ExtraKey,
    /// The cached prefix to start from, from [`super::KvCacheManager::match_prefix`] (or
    /// [`super::KvCacheManager::no_prefix_match`] to compute every token). Matched again when
    /// the pools evicted blocks since or it has no groups (`PrefixMatch::default()`); `None`:
    /// matched now.
    pub prefix: Option<PrefixMatch>,
    /// How long the prompt's blocks stay in the prefix cache once free (validate it first).
    pub retention: RetentionPolicy,
    /// The sequence (and every fork of it) holds every block of every group for its whole
    /// life: it takes every hit, also those behind a sliding or chunked group's window, and
    /// gives nothing back as it grows. For a sequence whose KV another engine reads whole (a
    /// `hold_kv` request: KV transfer carries every group's table). Its cost in a windowed
    /// group is its whole length, as in a full one; admission counts it with
    /// [`super::KvCacheManager::admission_cost_keeping`].
    pub keep_all: bool,
}

impl AddSequence {
    /// A sequence over `tokens` under `extra`, its prefix matched when it is added, with the
    /// default retention, giving back what its windows no longer see.
    pub fn new(tokens: Vec<u32>, extra: ExtraKey) -> Self {
        AddSequence { tokens, extra, ..Default::default() }
    }
}

/// One block table of a sequence, with the prefix-cache chain of its blocks (module
/// `kv_groups`): every sequence has one per KV cache group of the manager, all over the same
/// tokens and the same pool.
#[derive(Debug, Clone)]
pub struct GroupTable {
    pub(super) table: BlockTable,
    /// Leading entries given back: their blocks are behind every future query of a sliding or
    /// chunked group, and the entries are [`BlockId::NULL`]. Always 0 in a full group.
    pub(super) num_released: usize,
    /// Chained hashes of the first full blocks of the tokens under this group's key
    /// (computed lazily, kept for reuse).
    pub(super) hashes: Vec<BlockHash>,
    /// Blocks `0 .. num_registered` were offered to the prefix cache (or came from it).
    pub(super) num_registered: usize,
    /// How the chain of registered blocks continues after block `num_registered - 1`.
    pub(super) link: ChainLink,
    /// The sequence's extra key in this group.
    pub(super) extra: ExtraKey,
}

impl GroupTable {
    /// A group over `table`, of which the first `num_registered` blocks were offered to the
    /// prefix cache (or came from it), the chain continuing at `link`.
    pub(super) fn new(table: BlockTable, hashes: Vec<BlockHash>, num_registered: usize, link: ChainLink, extra: ExtraKey) -> Self {
        GroupTable { table, num_released: 0, hashes, num_registered, link, extra }
    }

    /// The block table; entries before [`Self::num_released`] are [`BlockId::NULL`].
    #[inline]
    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    /// Leading entries given back (null).
    #[inline]
    pub fn num_released(&self) -> usize {
        self.num_released
    }

    /// The blocks the group holds (its table without the given-back entries).
    #[inline]
    pub fn held(&self) -> &[BlockId] {
        &self.table.blocks()[self.num_released..]
    }
}

/// One sequence's state (see the manager's module docs).
#[derive(Debug, Clone)]
pub struct Sequence {
    pub(super) tokens: Vec<u32>,
    pub(super) tier: Tier,
    pub(super) num_computed: usize,
    pub(super) write_start: usize,
    /// One per group of the manager; group 0 first. Inline for one group (a model
    /// without groups): the decode path reads its table without another pointer hop.
    pub(super) groups: SmallVec<[GroupTable; 1]>,
    /// Tokens known when the sequence was created (its prompt). Blocks within them are
    /// registered in the prefix cache as soon as their step is scheduled, so that concurrent
    /// requests sharing the prompt hit them; blocks filled later by decoding are registered
    /// when the sequence is freed (the first moment another request could usually use them),
    /// which keeps hashing off the per-step decode path.
    pub(super) prompt_len: usize,
    pub(super) extra: ExtraKey,
    pub(super) retention: RetentionPolicy,
    /// Holds every block in every group: a sliding or chunked group gives nothing back
    /// (module `kv_groups`). Set for a sequence whose KV another engine reads
    /// (a `hold_kv` request and its lease) and for a KV-transfer reservation.
    pub(super) keep_all: bool,
    /// Trailing tokens that are drafts (speculative decoding), not verified: they get slots
    /// and are computed like any token, but no block holding one is ever offered to the prefix
    /// cache, and [`super::KvCacheManager::accept_drafts`] keeps only the accepted ones. 0 outside a
    /// step.
    pub(super) num_drafts: usize,
}

impl Sequence {
    /// A device sequence over `tokens` (all of them its prompt) with the groups `groups`, of
    /// which the first `num_computed` tokens hold slots and `write_start ..` are being written.
    pub(super) fn on_device(
        tokens: Vec<u32>,
        groups: SmallVec<[GroupTable; 1]>,
        (write_start, num_computed): (usize, usize),
        extra: ExtraKey,
        retention: RetentionPolicy,
        keep_all: bool,
    ) -> Self {
        let prompt_len = tokens.len();
        Sequence { tokens, tier: Tier::Device, num_computed, write_start, groups, prompt_len, extra, retention, keep_all, num_drafts: 0 }
    }

    /// All known token ids (prompt and generated).
    #[inline]
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of known tokens.
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Number of tokens that hold a KV slot.
    #[inline]
    pub fn num_computed(&self) -> usize {
        self.num_computed
    }

    /// Known tokens without a slot yet.
    #[inline]
    pub fn num_pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// The block table of group 0 (block ids of the sequence's tier).
    #[inline]
    pub fn table(&self) -> &BlockTable {
        &self.groups[0].table
    }

    /// Every group's block table and state, group 0 first.
    #[inline]
    pub fn kv_groups(&self) -> &[GroupTable] {
        &self.groups
    }

    /// Every block the sequence holds, all groups (given-back entries skipped).
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.groups.iter().flat_map(|c| c.held().iter().copied())
    }

    /// The tier holding the sequence's blocks.
    #[inline]
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// First position of the slots handed out by the last `allocate_slots`.
    #[inline]
    pub fn write_start(&self) -> usize {
        self.write_start
    }

    /// The cache salt of this sequence's blocks.
    pub fn extra_key(&self) -> &ExtraKey {
        &self.extra
    }

    /// Trailing draft tokens, unverified (see [`super::KvCacheManager::append_drafts`]).
    #[inline]
    pub fn num_drafts(&self) -> usize {
        self.num_drafts
    }

    /// Tokens that are not drafts.
    #[inline]
    pub fn num_verified(&self) -> usize {
        self.tokens.len() - self.num_drafts
    }

    /// Whether the sequence holds every block of every group (no give-back behind a window):
    /// see [`AddSequence::keep_all`].
    #[inline]
    pub fn keeps_all(&self) -> bool {
        self.keep_all
    }
}
