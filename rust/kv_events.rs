//! KV-cache events for KV-aware routers, in vLLM's wire format.
//!
//! A router that sends a request to the engine that already caches most of its prompt needs
//! to know which blocks each engine caches. Engines tell it with a stream of events: a block
//! was stored, a block was removed, everything was cleared. pagedkv produces them here, in
//! the core, as the pools change (no per-block work in Python), and encodes them exactly as
//! vLLM does (msgspec structs, `array_like=True, omit_defaults=True`, events `tag=True`), so
//! consumers of vLLM's events (Dynamo, llm-d, custom routers) read pagedkv's unchanged.
//!
//! # Events
//! - `BlockStored`: blocks entered a pool's prefix cache (their KV is, or is being, written).
//!   Consecutive blocks of one chain stored in one pool are coalesced into one event:
//!   `block_hashes` lists them in order, `token_ids` is all their tokens concatenated, and
//!   `parent_block_hash` is the parent of the first (`None` for a first block of a prompt).
//!   Within a run of stores with no removal in between, parents come before their children
//!   ([`order_parents_first`]: a tier below the device receives evicted blocks leaves first),
//!   so a consumer that links a block to its parent finds the parent. The parent need not be
//!   in the same medium: a block written back to the host whose parent stayed on the device
//!   names it all the same.
//! - `BlockRemoved`: blocks left a pool's prefix cache (reused for other content, dropped by a
//!   reset, or uncached because the step writing them failed). Consecutive removals in one
//!   pool are coalesced.
//! - `AllBlocksCleared`: no pool caches anything any more (a prefix-cache reset that left
//!   nothing cached).
//!
//! # Block hashes on the wire
//! A block's wire hash is its pool's 64-bit index key: the 128-bit chained block hash
//! ([`crate::block_hash`]) folded to 64 bits ([`crate::block_hash::index_key`]). A pool never
//! registers two blocks under one key (a duplicate is refused), so a consumer can key its
//! view of a pool by it; `parent_block_hash` is the key of the parent's 128-bit hash. The
//! keys of a prompt's full blocks are what a router computes for it
//! ([`wire_block_hashes`]; in Python `pagedkv._core.block_hashes`).
//!
//! # Media
//! `medium` names the pool: `"GPU"` for the device pool — vLLM's name for the engine's primary
//! KV pool, the one attention reads, so it is `"GPU"` also when the engine runs on a CPU —
//! `"CPU"` for the host tier and `"DISK"` for the disk tier. One content may be stored in
//! several media at once (a block written back to the host keeps its device copy until the
//! device reuses it), each with its own Stored / Removed events.
//!
//! # Batches
//! Events are taken once per step and encoded as one batch: a msgpack array `[ts, events]`
//! (`ts` a float64, seconds; vLLM's optional trailing `data_parallel_rank` is omitted), each
//! event an array whose first element is its tag:
//! - `["BlockStored", [hash, ...], parent_hash | nil, [token, ...], block_size, nil, medium]`
//!   (the nil is vLLM's `lora_id`);
//! - `["BlockRemoved", [hash, ...], medium]`;
//! - `["AllBlocksCleared"]`.
//!
//! [`encode_batch`] writes a batch with the `rmp` crate; [`decode_batch`] reads one back
//! (tests, and Rust consumers).

use rmp::encode;
use rmp::Marker;

use crate::block_hash::{index_key, BlockHasher, ExtraKey, HashMode};
use crate::error::{CoreError, Result};

/// Most blocks one coalesced event lists; the next block starts a new event. Keeps every
/// msgpack array well within its 32-bit length (65,536 blocks of at most 4,096 tokens).
pub const MAX_BLOCKS_PER_EVENT: usize = 1 << 16;

/// The pool a block event is about, named as vLLM names it on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The device pool (the one attention reads): `"GPU"`, vLLM's name for the engine's
    /// primary KV pool, also when the engine runs on a CPU.
    Gpu,
    /// The host tier: `"CPU"`.
    Cpu,
    /// The disk tier: `"DISK"`.
    Disk,
}

impl Medium {
    /// The name on the wire: `"GPU"`, `"CPU"` or `"DISK"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Disk => "DISK",
        }
    }

    /// The medium named `s` on the wire, if any.
    pub fn parse(s: &str) -> Option<Medium> {
        match s {
            "GPU" => Some(Medium::Gpu),
            "CPU" => Some(Medium::Cpu),
            "DISK" => Some(Medium::Disk),
            _ => None,
        }
    }
}

/// One KV-cache event (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks of one chain entered the prefix cache of a pool.
    BlockStored {
        /// Wire hashes of the blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Wire hash of the first block's parent; `None` for a first block.
        parent_block_hash: Option<u64>,
        /// The blocks' tokens, concatenated (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// The pool.
        medium: Medium,
    },
    /// Blocks left the prefix cache of a pool.
    BlockRemoved {
        /// Wire hashes of the blocks, in the order they left.
        block_hashes: Vec<u64>,
        /// The pool.
        medium: Medium,
    },
    /// No pool caches any block any more.
    AllBlocksCleared,
}

impl KvEvent {
    /// Merges `next` into `self` when it continues it (the coalescing rule of the module
    /// docs: a Stored event whose parent is the last block of a Stored event of the same
    /// pool, or a Removed event after a Removed event of the same pool, up to
    /// [`MAX_BLOCKS_PER_EVENT`] blocks). Gives `next` back when it does not.
    pub fn merge(&mut self, next: KvEvent) -> Option<KvEvent> {
        match (self, next) {
            (
                KvEvent::BlockStored { block_hashes, token_ids, block_size, medium, .. },
                KvEvent::BlockStored {
                    block_hashes: more,
                    parent_block_hash: Some(parent),
                    token_ids: more_tokens,
                    block_size: bs,
                    medium: m,
                },
            ) if *medium == m
                && *block_size == bs
                && block_hashes.last() == Some(&parent)
                && block_hashes.len() + more.len() <= MAX_BLOCKS_PER_EVENT =>
            {
                block_hashes.extend_from_slice(&more);
                token_ids.extend_from_slice(&more_tokens);
                None
            }
            (KvEvent::BlockRemoved { block_hashes, medium }, KvEvent::BlockRemoved { block_hashes: more, medium: m })
                if *medium == m && block_hashes.len() + more.len() <= MAX_BLOCKS_PER_EVENT =>
            {
                block_hashes.extend_from_slice(&more);
                None
            }
            (_, next) => Some(next),
        }
    }
}

/// The wire hashes of the full blocks of `tokens` (blocks of `block_size` tokens) under the
/// cache `salt`: what a pool hashing in `mode` names them in its events, so what a KV-aware
/// router computes for a prompt. A trailing partial block has none.
pub fn wire_block_hashes(tokens: &[u32], block_size: usize, salt: Option<&str>, mode: HashMode) -> Vec<u64> {
    let mut hasher = BlockHasher::new(mode);
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
    hasher.extend_chain(&mut hashes, tokens, block_size, &ExtraKey::new(salt), usize::MAX);
    hashes.into_iter().map(index_key).collect()
}

/// Coalesces consecutive events (see [`KvEvent::merge`]); order is kept.
pub fn coalesce(events: impl IntoIterator<Item = KvEvent>) -> Vec<KvEvent> {
    let mut out: Vec<KvEvent> = Vec::new();
    for e in events {
        push_coalesced(&mut out, e);
    }
    out
}

/// The events of one pool since they were last taken, coalesced as they are logged (a block
/// pool, block_pool.rs, keeps one when its events are on: this module sits below the pool and
/// names nothing of it).
#[derive(Debug, Clone)]
pub struct KvEventLog {
    medium: Medium,
    block_size: usize,
    events: Vec<KvEvent>,
}

impl KvEventLog {
    /// An empty log of a pool of `block_size`-token blocks in `medium`.
    pub fn new(medium: Medium, block_size: usize) -> Self {
        KvEventLog { medium, block_size, events: Vec::new() }
    }

    /// The pool's medium.
    pub fn medium(&self) -> Medium {
        self.medium
    }

    /// Logs that the block with wire hash `hash`, after the block with wire hash `parent`
    /// (`None`: a first block), holding `tokens`, entered the cache.
    pub fn stored(&mut self, hash: u64, parent: Option<u64>, tokens: &[u32]) {
        // Coalescing in place: no event (and no vector) per block along a chain.
        if let (Some(KvEvent::BlockStored { block_hashes, token_ids, .. }), Some(p)) = (self.events.last_mut(), parent) {
            if block_hashes.last() == Some(&p) && block_hashes.len() < MAX_BLOCKS_PER_EVENT {
                block_hashes.push(hash);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.events.push(KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: self.block_size,
            medium: self.medium,
        });
    }

    /// Logs that the block with wire hash `hash` left the cache.
    pub fn removed(&mut self, hash: u64) {
        if let Some(KvEvent::BlockRemoved { block_hashes, .. }) = self.events.last_mut() {
            if block_hashes.len() < MAX_BLOCKS_PER_EVENT {
                block_hashes.push(hash);
                return;
            }
        }
        self.events.push(KvEvent::BlockRemoved { block_hashes: vec![hash], medium: self.medium });
    }

    /// The events logged and not yet taken, in order.
    pub fn events(&self) -> &[KvEvent] {
        &self.events
    }

    /// True when nothing is logged.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Takes the events logged since the last call, in order, parents first within each run
    /// of stores ([`order_parents_first`]).
    pub fn take(&mut self) -> Vec<KvEvent> {
        let events = std::mem::take(&mut self.events);
        if events.len() < 2 {
            return events;
        }
        order_parents_first(events)
    }
}

/// Reorders each run of consecutive `BlockStored` events of one medium so that an event whose
/// parent block is stored by another event of the run comes after it (parents first, in a
/// depth-first walk from the run's roots, otherwise in the original order), and coalesces
/// what then continues a chain. Other events, and the order between runs, are untouched. A
/// run stores distinct blocks, so replaying the events (stored adds, removed deletes) ends
/// with the same blocks as before.
pub fn order_parents_first(events: Vec<KvEvent>) -> Vec<KvEvent> {
    let mut out: Vec<KvEvent> = Vec::with_capacity(events.len());
    let mut run: Vec<KvEvent> = Vec::new();
    for e in events {
        let joins = match (&e, run.first()) {
            (KvEvent::BlockStored { medium, .. }, Some(KvEvent::BlockStored { medium: m, .. })) => medium == m,
            (KvEvent::BlockStored { .. }, None) => true,
            _ => false,
        };
        if !joins {
            flush_run(&mut run, &mut out);
        }
        if matches!(e, KvEvent::BlockStored { .. }) {
            run.push(e);
        } else {
            push_coalesced(&mut out, e);
        }
    }
    flush_run(&mut run, &mut out);
    out
}

fn push_coalesced(out: &mut Vec<KvEvent>, e: KvEvent) {
    let rest = match out.last_mut() {
        Some(last) => last.merge(e),
        None => Some(e),
    };
    out.extend(rest);
}

/// Appends a run of stores (see [`order_parents_first`]) to `out`, parents first.
fn flush_run(run: &mut Vec<KvEvent>, out: &mut Vec<KvEvent>) {
    let segments = std::mem::take(run);
    if segments.len() < 2 {
        segments.into_iter().for_each(|e| push_coalesced(out, e));
        return;
    }
    fn hashes_of(e: &KvEvent) -> &[u64] {
        match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes,
            _ => &[],
        }
    }
    let parent_of = |e: &KvEvent| match e {
        KvEvent::BlockStored { parent_block_hash, .. } => *parent_block_hash,
        _ => None,
    };
    let mut owner: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for (i, e) in segments.iter().enumerate() {
        for &h in hashes_of(e) {
            owner.insert(h, i);
        }
    }
    let n = segments.len();
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut has_parent = vec![false; n];
    for (i, e) in segments.iter().enumerate() {
        if let Some(&j) = parent_of(e).and_then(|p| owner.get(&p)) {
            if j != i {
                children[j].push(i);
                has_parent[i] = true;
            }
        }
    }
    let mut order = Vec::with_capacity(n);
    let mut seen = vec![false; n];
    // Roots first (in their order), then whatever a cycle of colliding hashes left over.
    let starts: Vec<usize> = (0..n).filter(|&i| !has_parent[i]).chain(0..n).collect();
    let mut stack = Vec::new();
    for s in starts {
        stack.push(s);
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            order.push(i);
            stack.extend(children[i].iter().rev());
        }
    }
    let mut slots: Vec<Option<KvEvent>> = segments.into_iter().map(Some).collect();
    for i in order {
        if let Some(e) = slots[i].take() {
            push_coalesced(out, e);
        }
    }
}

/// Encodes one batch of events (see the module docs for the layout) with timestamp `ts`
/// (seconds).
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(16 + 32 * events.len());
    // Writing into a Vec cannot fail.
    let written = encode_batch_into(&mut buf, ts, events);
    debug_assert!(written.is_ok());
    buf
}

/// A msgpack array length (every array here is far below 2^32 entries: see
/// [`MAX_BLOCKS_PER_EVENT`]).
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn encode_batch_into(buf: &mut Vec<u8>, ts: f64, events: &[KvEvent]) -> std::io::Result<()> {
    encode::write_array_len(buf, 2)?;
    encode::write_f64(buf, ts)?;
    encode::write_array_len(buf, len32(events.len()))?;
    for e in events {
        match e {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium } => {
                encode::write_array_len(buf, 7)?;
                encode::write_str(buf, "BlockStored")?;
                write_hashes(buf, block_hashes)?;
                match parent_block_hash {
                    Some(p) => {
                        encode::write_uint(buf, *p)?;
                    }
                    None => encode::write_nil(buf)?,
                }
                encode::write_array_len(buf, len32(token_ids.len()))?;
                for &t in token_ids {
                    encode::write_uint(buf, u64::from(t))?;
                }
                encode::write_uint(buf, *block_size as u64)?;
                encode::write_nil(buf)?; // lora_id
                encode::write_str(buf, medium.as_str())?;
            }
            KvEvent::BlockRemoved { block_hashes, medium } => {
                encode::write_array_len(buf, 3)?;
                encode::write_str(buf, "BlockRemoved")?;
                write_hashes(buf, block_hashes)?;
                encode::write_str(buf, medium.as_str())?;
            }
            KvEvent::AllBlocksCleared => {
                encode::write_array_len(buf, 1)?;
                encode::write_str(buf, "AllBlocksCleared")?;
            }
        }
    }
    Ok(())
}

fn write_hashes(buf: &mut Vec<u8>, hashes: &[u64]) -> std::io::Result<()> {
    encode::write_array_len(buf, len32(hashes.len()))?;
    for &h in hashes {
        encode::write_uint(buf, h)?;
    }
    Ok(())
}

/// Decodes a batch written by [`encode_batch`] (or by vLLM, for the fields pagedkv writes):
/// its timestamp and events. Errors on anything else (`InvalidArgument`).
pub fn decode_batch(bytes: &[u8]) -> Result<(f64, Vec<KvEvent>)> {
    let mut rd = Reader { rest: bytes };
    let n = rd.array_len()?;
    if !(2..=3).contains(&n) {
        return Err(malformed(format!("a batch has 2 or 3 fields, got {n}")));
    }
    let ts = rd.float()?;
    let count = rd.array_len()? as usize;
    let mut events = Vec::with_capacity(count.min(bytes.len()));
    for _ in 0..count {
        events.push(rd.event()?);
    }
    if n == 3 && !rd.nil()? {
        rd.uint()?; // data_parallel_rank
    }
    if !rd.rest.is_empty() {
        return Err(malformed(format!("{} bytes after the batch", rd.rest.len())));
    }
    Ok((ts, events))
}

fn malformed(m: String) -> CoreError {
    CoreError::InvalidArgument(format!("malformed KV event batch: {m}"))
}

/// A msgpack reader over a byte slice, for exactly the shapes of a batch.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn array_len(&mut self) -> Result<u32> {
        rmp::decode::read_array_len(&mut self.rest).map_err(|e| malformed(format!("expected an array: {e}")))
    }

    fn uint(&mut self) -> Result<u64> {
        rmp::decode::read_int(&mut self.rest).map_err(|e| malformed(format!("expected an unsigned integer: {e}")))
    }

    /// A float64 (or float32) value.
    fn float(&mut self) -> Result<f64> {
        let (&marker, rest) = self.rest.split_first().ok_or_else(|| malformed("expected a float, got the end".into()))?;
        let width = match Marker::from_u8(marker) {
            Marker::F64 => 8,
            Marker::F32 => 4,
            m => return Err(malformed(format!("expected a float, got {m:?}"))),
        };
        if rest.len() < width {
            return Err(malformed("truncated float".into()));
        }
        let (data, rest) = rest.split_at(width);
        self.rest = rest;
        Ok(match data.try_into() {
            Ok(b8) => f64::from_be_bytes(b8),
            Err(_) => {
                let mut b4 = [0u8; 4];
                b4.copy_from_slice(data);
                f64::from(f32::from_be_bytes(b4))
            }
        })
    }

    /// Consumes a nil and returns true, or returns false (consuming nothing).
    fn nil(&mut self) -> Result<bool> {
        match self.rest.first() {
            Some(&b) if Marker::from_u8(b) == Marker::Null => {
                self.rest = &self.rest[1..];
                Ok(true)
            }
            Some(_) => Ok(false),
            None => Err(malformed("unexpected end".into())),
        }
    }

    fn str(&mut self) -> Result<&'a str> {
        let n = rmp::decode::read_str_len(&mut self.rest).map_err(|e| malformed(format!("expected a string: {e}")))? as usize;
        if self.rest.len() < n {
            return Err(malformed("truncated string".into()));
        }
        let (s, rest) = self.rest.split_at(n);
        self.rest = rest;
        std::str::from_utf8(s).map_err(|_| malformed("a string is not UTF-8".into()))
    }

    fn uints(&mut self) -> Result<Vec<u64>> {
        let n = self.array_len()? as usize;
        let mut v = Vec::with_capacity(n.min(self.rest.len()));
        for _ in 0..n {
            v.push(self.uint()?);
        }
        Ok(v)
    }

    fn medium(&mut self) -> Result<Medium> {
        let s = self.str()?;
        Medium::parse(s).ok_or_else(|| malformed(format!("unknown medium {s:?}")))
    }

    fn event(&mut self) -> Result<KvEvent> {
        let n = self.array_len()?;
        let tag = self.str()?;
        let fields = match tag {
            "BlockStored" => 7,
            "BlockRemoved" => 3,
            "AllBlocksCleared" => 1,
            _ => return Err(malformed(format!("unknown event tag {tag:?}"))),
        };
        if n != fields {
            return Err(malformed(format!("{tag} has {fields} fields, got {n}")));
        }
        Ok(match fields {
            7 => {
                let block_hashes = self.uints()?;
                let parent_block_hash = if self.nil()? { None } else { Some(self.uint()?) };
                let token_ids = self
                    .uints()?
                    .into_iter()
                    .map(|t| u32::try_from(t).map_err(|_| malformed(format!("token id {t} out of range"))))
                    .collect::<Result<Vec<u32>>>()?;
                let block_size = self.uint()? as usize;
                if !self.nil()? {
                    return Err(malformed("lora_id must be nil".into()));
                }
                let medium = self.medium()?;
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium }
            }
            3 => {
                let block_hashes = self.uints()?;
                KvEvent::BlockRemoved { block_hashes, medium: self.medium()? }
            }
            _ => KvEvent::AllBlocksCleared,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_coalesces_chains_and_removals_in_order() {
        let mut log = KvEventLog::new(Medium::Cpu, 2);
        log.stored(10, None, &[1, 2]);
        log.stored(11, Some(10), &[3, 4]);
        log.stored(12, Some(11), &[5, 6]);
        // Another chain (its parent is not the last block): a new event.
        log.stored(20, Some(99), &[7, 8]);
        log.removed(10);
        log.removed(11);
        log.stored(30, None, &[9, 9]);
        // A child of the last stored block after a removal is not merged across it.
        log.removed(12);
        log.stored(31, Some(30), &[1, 1]);
        let events = log.take();
        assert!(log.is_empty());
        assert_eq!(
            events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![10, 11, 12],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4, 5, 6],
                    block_size: 2,
                    medium: Medium::Cpu
                },
                KvEvent::BlockStored {
                    block_hashes: vec![20],
                    parent_block_hash: Some(99),
                    token_ids: vec![7, 8],
                    block_size: 2,
                    medium: Medium::Cpu
                },
                KvEvent::BlockRemoved { block_hashes: vec![10, 11], medium: Medium::Cpu },
                KvEvent::BlockStored {
                    block_hashes: vec![30],
                    parent_block_hash: None,
                    token_ids: vec![9, 9],
                    block_size: 2,
                    medium: Medium::Cpu
                },
                KvEvent::BlockRemoved { block_hashes: vec![12], medium: Medium::Cpu },
                KvEvent::BlockStored {
                    block_hashes: vec![31],
                    parent_block_hash: Some(30),
                    token_ids: vec![1, 1],
                    block_size: 2,
                    medium: Medium::Cpu
                },
            ]
        );
    }

    fn stored(hashes: &[u64], parent: Option<u64>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: hashes.iter().map(|&h| h as u32).collect(),
            block_size: 1,
            medium,
        }
    }

    #[test]
    fn coalesce_merges_only_continuations_of_one_pool() {
        let removed = |h: &[u64], m| KvEvent::BlockRemoved { block_hashes: h.to_vec(), medium: m };
        let events = vec![
            stored(&[1], None, Medium::Gpu),
            stored(&[2, 3], Some(1), Medium::Gpu),
            stored(&[4], Some(3), Medium::Cpu), // another pool
            removed(&[1], Medium::Gpu),
            removed(&[2], Medium::Gpu),
            removed(&[5], Medium::Disk),
            KvEvent::AllBlocksCleared,
            KvEvent::AllBlocksCleared,
        ];
        assert_eq!(
            coalesce(events),
            vec![
                stored(&[1, 2, 3], None, Medium::Gpu),
                stored(&[4], Some(3), Medium::Cpu),
                removed(&[1, 2], Medium::Gpu),
                removed(&[5], Medium::Disk),
                KvEvent::AllBlocksCleared,
                KvEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn stores_are_taken_parents_first() {
        // A chain 1-2-3-4 evicted leaves first into a lower tier, then another chain 10-11
        // whose child came first too, with a child 5 of block 2 (a branch), then a removal.
        let mut log = KvEventLog::new(Medium::Cpu, 1);
        log.stored(4, Some(3), &[4]);
        log.stored(3, Some(2), &[3]);
        log.stored(11, Some(10), &[11]);
        log.stored(5, Some(2), &[5]);
        log.stored(2, Some(1), &[2]);
        log.stored(1, None, &[1]);
        log.stored(10, Some(77), &[10]);
        log.removed(3);
        log.stored(3, Some(2), &[3]);
        let want = vec![
            stored(&[1, 2, 3, 4], None, Medium::Cpu),
            stored(&[5], Some(2), Medium::Cpu),
            stored(&[10, 11], Some(77), Medium::Cpu),
            KvEvent::BlockRemoved { block_hashes: vec![3], medium: Medium::Cpu },
            stored(&[3], Some(2), Medium::Cpu),
        ];
        assert_eq!(log.take(), want);
        // Colliding hashes may form a cycle: every event is still kept once.
        let cyc = vec![stored(&[1], Some(2), Medium::Gpu), stored(&[2], Some(1), Medium::Gpu), stored(&[3], Some(3), Medium::Gpu)];
        let got = order_parents_first(cyc);
        let mut blocks: Vec<u64> = got
            .iter()
            .flat_map(|e| match e {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                _ => vec![],
            })
            .collect();
        blocks.sort_unstable();
        assert_eq!(blocks, vec![1, 2, 3]);
        // Different media are separate runs, kept in their order.
        let mixed = vec![stored(&[2], Some(1), Medium::Gpu), stored(&[1], None, Medium::Cpu)];
        assert_eq!(order_parents_first(mixed.clone()), mixed);
    }

    #[test]
    fn a_coalesced_event_holds_at_most_max_blocks() {
        let mut log = KvEventLog::new(Medium::Gpu, 1);
        for h in 0..(MAX_BLOCKS_PER_EVENT as u64 + 3) {
            log.stored(h + 1, (h > 0).then_some(h), &[0]);
        }
        let events = log.take();
        assert_eq!(events.len(), 2);
        match &events[1] {
            KvEvent::BlockStored { block_hashes, parent_block_hash, .. } => {
                assert_eq!(block_hashes.len(), 3);
                assert_eq!(*parent_block_hash, Some(MAX_BLOCKS_PER_EVENT as u64));
            }
            e => panic!("unexpected {e:?}"),
        }
    }

    /// The exact bytes msgspec writes for vLLM's structs (worked out by hand from the msgpack
    /// spec: fixarray 0x9N, fixstr 0xA0+len, uint64 0xCF, float64 0xCB, nil 0xC0).
    #[test]
    fn encoder_writes_vllm_bytes() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![u64::MAX, 5],
                parent_block_hash: None,
                token_ids: vec![1, 300],
                block_size: 1,
                medium: Medium::Gpu,
            },
            KvEvent::BlockRemoved { block_hashes: vec![7], medium: Medium::Disk },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &events);
        let mut want = vec![0x92, 0xCB];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        want.push(0x97);
        want.push(0xA0 + 11);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x92, 0xCF]);
        want.extend_from_slice(&u64::MAX.to_be_bytes());
        want.push(0x05);
        want.push(0xC0); // parent: nil
        want.extend_from_slice(&[0x92, 0x01, 0xCD, 0x01, 0x2C]); // [1, 300]
        want.push(0x01); // block_size
        want.push(0xC0); // lora_id
        want.push(0xA3);
        want.extend_from_slice(b"GPU");
        want.push(0x93);
        want.push(0xA0 + 12);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x07, 0xA4]);
        want.extend_from_slice(b"DISK");
        want.push(0x91);
        want.push(0xA0 + 16);
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(bytes, want);
        assert_eq!(decode_batch(&bytes).unwrap(), (1.5, events));
    }

    #[test]
    fn decode_round_trips_and_refuses_garbage() {
        let events = vec![
            stored(&[1, 2], Some(u64::MAX - 1), Medium::Cpu),
            KvEvent::BlockRemoved { block_hashes: (0..300).collect(), medium: Medium::Gpu },
        ];
        let bytes = encode_batch(-0.25, &events);
        assert_eq!(decode_batch(&bytes).unwrap(), (-0.25, events));
        assert_eq!(decode_batch(&encode_batch(0.0, &[])).unwrap(), (0.0, vec![]));
        for cut in 0..bytes.len() {
            assert!(decode_batch(&bytes[..cut]).is_err(), "a batch cut at {cut} bytes decoded");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(decode_batch(&extra).is_err());
        assert!(decode_batch(&[0x92, 0xCB]).is_err());
        assert!(matches!(decode_batch(b"\x92\x00\x90"), Err(CoreError::InvalidArgument(_))));
    }
}
