//! Paged decode attention on the CPU, read straight from the block-structured cache.
//!
//! The torch fallback gathers each decode sequence's K and V into a contiguous padded copy and
//! then runs SDPA: the KV bytes cross memory three times (read, write, read again). On the CPU
//! decode attention is bound by memory bandwidth, so this kernel reads every K and V row once,
//! through the block table, and never copies the cache.
//!
//! For one decode row (the last token of its sequence, which sees every key), with query head
//! `h` reading KV head `h / G` (`G = num_heads / num_kv_heads`):
//! 1. scores `s[h][p] = scale * q[h] · K[p][h / G]`, streaming the K rows (all KV heads of a
//!    position, contiguous) once for all query heads;
//! 2. per query head, `m = max s`, `e = exp(s - m)` (a vectorisable polynomial exp), `z = Σ e`;
//! 3. `out[h] = Σ_p e[h][p] V[p][h / G] / z`, streaming each V row once.
//!
//! Steps 1 and 3 go through the positions in tiles of `TILE` (8): the scores of one query
//! head for a tile are one vector (8 dot products, reduced together), and a tile of V rows
//! updates an output head held in registers. The rows a few tiles ahead are prefetched: a
//! sequence's blocks are scattered over the pool, and the hardware prefetcher stops at every
//! block boundary. The inner loops exist twice (trait `Isa`): AVX2 + FMA + F16C intrinsics, used
//! when the CPU has them (runtime check), and portable Rust for the baseline target.
//!
//! KV precision (python/pagedkv/kernels/kv_quant.py). The caches are float32, or
//! quantized ([`KvCaches`]): int8, fp8 e4m3 (`float8_e4m3fn`) or fp8 e5m2 codes
//! `[num_blocks, block_size, Hkv, D]` with one bfloat16 scale per (slot, KV head)
//! `[num_blocks, block_size, Hkv]`, so that a stored value is `x ≈ float(q) * scale`. Nothing
//! is dequantized ahead: the rows `[Hkv, D]` of a tile's positions are converted to f32
//! *unscaled* into a per-thread tile buffer (one row per position, L1-resident) right before
//! they are used, and the scales are folded into the scalar factors the loops already have:
//! `s[h][p] = (scale * k_scale[p][g]) * (q[h] · k_raw[p][g])` and
//! `out[h] += (e[h][p] * v_scale[p][g]) * v_raw[p][g]`. A float32 cache is read in place (its
//! scale is the constant 1, folded away at compile time).
//!
//! fp8 → f32 is exact for every code (subnormals, and the NaN codes, which our quantizer never
//! writes): on the AVX2 path with F16C instructions (an e5m2 byte is the top byte of an IEEE
//! half; an e4m3 byte is a half with the exponent 8 lower, times 256), elsewhere with a
//! 256-entry table. Either way every fp8 value becomes a normal f32 (or zero): the subnormal
//! codes never reach float arithmetic as subnormal operands, which can be very slow on x86.
//! (Subnormal f32 values can only arise from scales near bfloat16's smallest normal, 2^-126,
//! i.e. vectors whose largest magnitude is below ~1e-35.)
//!
//! Layer variants (python/pagedkv/kernels/layer_attention.py; [`LayerVariant`]): a
//! sliding window or a chunk makes a row start at its first visible position, so the blocks
//! before it are never read (their table entries are not even looked at); soft-capping maps
//! each scaled score `s` to `cap * tanh(s / cap)`; a sink is one more logit per query head in
//! the softmax, attending to nothing: it joins the max and the normaliser, not the sum over V.
//!
//! Work is split across the crate's threads ([`crate::thread_pool`]) by rows, balanced by
//! sequence length; each thread writes its own rows into a private buffer that is copied into
//! `out` after the join, so no two threads ever hold the same output memory. Every length and index is checked before any work starts:
//! bad input is an error, never a panic or an out-of-bounds read.

use crate::error::{CoreError, Result};
use crate::thread_pool::run_jobs;

/// Shapes of a paged-attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// Query heads.
    pub num_heads: usize,
    /// KV heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in each cache.
    pub num_blocks: usize,
}

/// One decode row: query row `row` of the packed batch attends the `seq_len` KV tokens of the
/// sequence whose block table is `table`.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRow<'a> {
    /// Row index into `query` / `out` (`[T, H, D]`).
    pub row: usize,
    /// KV tokens of the sequence (>= 1), the new one included.
    pub seq_len: usize,
    /// The sequence's block table (at least `ceil(seq_len / block_size)` entries).
    pub table: &'a [i32],
}

/// What a layer's attention does besides full causal attention (all `None`: full attention).
/// Conventions of transformers: the query at position `p` sees keys `p - w < k <= p` under a
/// sliding window `w`, and `k // C == p // C` under chunked local attention `C`.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerVariant<'a> {
    /// Sliding window `w >= 1`: the last `w` positions, the query's own included.
    pub sliding_window: Option<usize>,
    /// Chunk size `C >= 1`: the positions of the query's own chunk.
    pub chunk_size: Option<usize>,
    /// Soft-cap `cap > 0`: scaled scores `s -> cap * tanh(s / cap)`.
    pub logits_soft_cap: Option<f32>,
    /// One sink logit per query head (`num_heads` values).
    pub sinks: Option<&'a [f32]>,
}

impl LayerVariant<'_> {
    /// Full causal attention over the whole context.
    pub const FULL: LayerVariant<'static> = LayerVariant {
        sliding_window: None,
        chunk_size: None,
        logits_soft_cap: None,
        sinks: None,
    };

    /// The lowest key position the query at `position` sees.
    pub fn first_visible(&self, position: usize) -> usize {
        let mut first = 0;
        if let Some(w) = self.sliding_window {
            first = first.max((position + 1).saturating_sub(w));
        }
        if let Some(c) = self.chunk_size {
            first = first.max(position / c * c);
        }
        first
    }
}

/// One quantized K or V cache: the stored codes and their scales.
#[derive(Debug, Clone, Copy)]
pub struct Quantized<'a, T> {
    /// The codes, row-major `[num_blocks, block_size, Hkv, D]`.
    pub data: &'a [T],
    /// One bfloat16 scale per (slot, KV head) as its bit pattern, `[num_blocks, block_size,
    /// Hkv]`: the vector of slot `s` and KV head `g` is
    /// `data[(s * Hkv + g) * D ..][..D] * bf16_to_f32(scales[s * Hkv + g])`.
    pub scales: &'a [u16],
}

/// The K and V caches of one layer. K and V always share one storage format.
#[derive(Debug, Clone, Copy)]
pub enum KvCaches<'a> {
    /// float32 values, `[num_blocks, block_size, Hkv, D]` each.
    F32 {
        /// The key cache.
        key: &'a [f32],
        /// The value cache.
        value: &'a [f32],
    },
    /// int8 codes (`x ≈ q * scale`, `|q| <= 127`).
    Int8 {
        /// The key cache.
        key: Quantized<'a, i8>,
        /// The value cache.
        value: Quantized<'a, i8>,
    },
    /// fp8 e4m3 bytes (`torch.float8_e4m3fn`: bias 7, no infinities, max 448).
    Fp8E4M3 {
        /// The key cache.
        key: Quantized<'a, u8>,
        /// The value cache.
        value: Quantized<'a, u8>,
    },
    /// fp8 e5m2 bytes (`torch.float8_e5m2`: bias 15, IEEE-like, max finite 57344).
    Fp8E5M2 {
        /// The key cache.
        key: Quantized<'a, u8>,
        /// The value cache.
        value: Quantized<'a, u8>,
    },
}

impl KvCaches<'_> {
    /// The format's name, as `kv_format` spells it in the Python binding.
    pub fn format_name(&self) -> &'static str {
        match self {
            KvCaches::F32 { .. } => "float32",
            KvCaches::Int8 { .. } => "int8",
            KvCaches::Fp8E4M3 { .. } => "fp8_e4m3",
            KvCaches::Fp8E5M2 { .. } => "fp8_e5m2",
        }
    }

    /// Lengths of (key data, value data, key scales, value scales); no scales for float32.
    fn lengths(&self) -> (usize, usize, Option<(usize, usize)>) {
        fn quant<T>(
            k: &Quantized<'_, T>,
            v: &Quantized<'_, T>,
        ) -> (usize, usize, Option<(usize, usize)>) {
            (
                k.data.len(),
                v.data.len(),
                Some((k.scales.len(), v.scales.len())),
            )
        }
        match self {
            KvCaches::F32 { key, value } => (key.len(), value.len(), None),
            KvCaches::Int8 { key, value } => quant(key, value),
            KvCaches::Fp8E4M3 { key, value } | KvCaches::Fp8E5M2 { key, value } => {
                quant(key, value)
            }
        }
    }
}

/// The f32 value of a bfloat16 bit pattern (exact: bfloat16 is the top half of a float32).
#[inline(always)]
pub const fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The value of an fp8 e4m3 (`float8_e4m3fn`) code: bias 7, 3 mantissa bits, subnormals
/// `m * 2^-9`, no infinities, `S.1111.111` is NaN; the largest finite magnitude is 448.
pub const fn fp8_e4m3_to_f32(code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let (exp, man) = (((code >> 3) & 0xF) as u32, (code & 0x7) as u32);
    let bits = if exp == 0xF && man == 0x7 {
        0x7FC0_0000
    } else if exp == 0 {
        // m * 2^-9: exact in f32 (a normal float for m >= 1; +0 for m = 0).
        (man as f32 * (1.0 / 512.0)).to_bits()
    } else {
        // Rebias 7 -> 127; the 3 mantissa bits go to the top of f32's 23.
        ((exp + 120) << 23) | (man << 20)
    };
    f32::from_bits(sign | bits)
}

/// The value of an fp8 e5m2 (`float8_e5m2`) code: the top byte of an IEEE half (bias 15,
/// 2 mantissa bits, subnormals `m * 2^-16`, infinities and NaNs); max finite 57344.
pub const fn fp8_e5m2_to_f32(code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let (exp, man) = (((code >> 2) & 0x1F) as u32, (code & 0x3) as u32);
    let bits = if exp == 0x1F {
        if man == 0 {
            0x7F80_0000
        } else {
            0x7FC0_0000
        }
    } else if exp == 0 {
        (man as f32 * (1.0 / 65536.0)).to_bits()
    } else {
        ((exp + 112) << 23) | (man << 21)
    };
    f32::from_bits(sign | bits)
}

const fn fp8_table(e4m3: bool) -> [f32; 256] {
    let mut table = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = if e4m3 {
            fp8_e4m3_to_f32(i as u8)
        } else {
            fp8_e5m2_to_f32(i as u8)
        };
        i += 1;
    }
    table
}

/// Every e4m3 / e5m2 code's f32 value, for the portable conversion.
static E4M3_TABLE: [f32; 256] = fp8_table(true);
static E5M2_TABLE: [f32; 256] = fp8_table(false);

/// `out[row] = softmax(scale * q K^T) V` for every decode row, reading float32 K/V through
/// the block tables: [`paged_decode_attention_kv`] with [`KvCaches::F32`].
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    query: &[f32],
    key_cache: &[f32],
    value_cache: &[f32],
    dims: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    out: &mut [f32],
    num_threads: usize,
) -> Result<()> {
    let caches = KvCaches::F32 {
        key: key_cache,
        value: value_cache,
    };
    paged_decode_attention_kv(query, caches, dims, rows, scale, out, num_threads)
}

/// `out[row] = softmax(scale * q K^T) V` for every decode row, reading K/V (dequantized on
/// the fly for a quantized format) through the block tables. `query`, `out`: `[T, H, D]` f32,
/// row-major; caches: see [`KvCaches`]. Rows not listed are left untouched. Errors (before
/// any work): shapes that disagree, a data or scales slice of the wrong length, a row outside
/// `query`, a block table too short for its `seq_len` or naming a block outside the cache.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_kv(
    query: &[f32],
    caches: KvCaches<'_>,
    dims: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    out: &mut [f32],
    num_threads: usize,
) -> Result<()> {
    paged_decode_attention_layer(
        query,
        caches,
        dims,
        rows,
        scale,
        LayerVariant::FULL,
        out,
        num_threads,
    )
}

/// [`paged_decode_attention_kv`] for a layer with a sliding window, a chunk, soft-capping or
/// sinks ([`LayerVariant`]). A row reads only the blocks from its first visible position on:
/// the block-table entries before that block are neither read nor checked (a sliding-window
/// group gives those blocks back). Errors, besides the shapes: a window or chunk of 0, a
/// soft-cap that is not finite and positive, sinks that are not one per query head.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_layer(
    query: &[f32],
    caches: KvCaches<'_>,
    dims: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    variant: LayerVariant<'_>,
    out: &mut [f32],
    num_threads: usize,
) -> Result<()> {
    validate_variant(&variant, dims)?;
    validate(query, &caches, dims, rows, &variant, out)?;
    let row_elems = dims.num_heads * dims.head_dim;
    let chunks = balance(rows, &variant, num_threads.max(1));
    let results = run_jobs(chunks.len(), |i| {
        let (a, b) = chunks[i];
        attend_rows_dispatch(query, caches, dims, &rows[a..b], scale, &variant)
    });
    let mut produced = 0;
    for ((a, b), buf) in chunks.iter().zip(&results) {
        if buf.len() != (b - a) * row_elems {
            return Err(CoreError::InvariantViolation(
                "a CPU attention worker failed".into(),
            ));
        }
        for (k, r) in rows[*a..*b].iter().enumerate() {
            out[r.row * row_elems..(r.row + 1) * row_elems]
                .copy_from_slice(&buf[k * row_elems..(k + 1) * row_elems]);
        }
        produced += b - a;
    }
    debug_assert_eq!(produced, rows.len());
    Ok(())
}

fn validate_variant(v: &LayerVariant<'_>, d: AttentionDims) -> Result<()> {
    let bad = |m: String| Err(CoreError::InvalidArgument(m));
    if v.sliding_window == Some(0) || v.chunk_size == Some(0) {
        return bad(format!(
            "sliding_window and chunk_size must be >= 1, got {:?} / {:?}",
            v.sliding_window, v.chunk_size
        ));
    }
    if let Some(cap) = v.logits_soft_cap {
        if !(cap.is_finite() && cap > 0.0) {
            return bad(format!(
                "logits_soft_cap must be a finite number > 0, got {cap}"
            ));
        }
    }
    if let Some(sinks) = v.sinks {
        if sinks.len() != d.num_heads {
            return bad(format!(
                "sinks has {} logits but the query has {} heads: one per query head",
                sinks.len(),
                d.num_heads
            ));
        }
    }
    Ok(())
}

fn validate(
    query: &[f32],
    caches: &KvCaches<'_>,
    d: AttentionDims,
    rows: &[DecodeRow<'_>],
    variant: &LayerVariant<'_>,
    out: &[f32],
) -> Result<()> {
    let bad = |m: String| Err(CoreError::InvalidArgument(m));
    if d.num_kv_heads == 0
        || d.head_dim == 0
        || d.block_size == 0
        || !d.num_heads.is_multiple_of(d.num_kv_heads)
    {
        return bad(format!("invalid attention shape {d:?}"));
    }
    // Checked products: the lengths come from the caller, an overflow must not wrap to a
    // length that happens to match.
    let slots = d
        .num_blocks
        .checked_mul(d.block_size)
        .and_then(|n| n.checked_mul(d.num_kv_heads));
    let Some(cache_len) = slots.and_then(|n| n.checked_mul(d.head_dim)) else {
        return bad(format!("attention shape {d:?} is too large"));
    };
    let num_scales = cache_len / d.head_dim;
    let (k_len, v_len, scales) = caches.lengths();
    let format = caches.format_name();
    if k_len != cache_len || v_len != cache_len {
        return bad(format!(
            "{format} caches hold {k_len} / {v_len} values, expected {cache_len}"
        ));
    }
    if let Some((ks, vs)) = scales {
        if ks != num_scales || vs != num_scales {
            return bad(format!(
                "{format} caches need one scale per (slot, KV head): key / value scales hold {ks} / {vs}, expected \
                 {num_scales} ([{}, {}, {}])",
                d.num_blocks, d.block_size, d.num_kv_heads
            ));
        }
    }
    let row_elems = d.num_heads * d.head_dim;
    if row_elems == 0 || !query.len().is_multiple_of(row_elems) || out.len() != query.len() {
        return bad(format!(
            "query ({}) and out ({}) must be [T, {}, {}]",
            query.len(),
            out.len(),
            d.num_heads,
            d.head_dim
        ));
    }
    let num_rows = query.len() / row_elems;
    for r in rows {
        if r.row >= num_rows {
            return bad(format!(
                "decode row {} is outside the {num_rows} query rows",
                r.row
            ));
        }
        let blocks = r.seq_len.div_ceil(d.block_size);
        if r.seq_len == 0 || blocks > r.table.len() {
            return bad(format!(
                "row {}: seq_len {} needs {blocks} blocks, the block table has {}",
                r.row,
                r.seq_len,
                r.table.len()
            ));
        }
        // The blocks before the first visible position are never read.
        let first_block = variant.first_visible(r.seq_len - 1) / d.block_size;
        if let Some(&b) = r.table[first_block..blocks]
            .iter()
            .find(|&&b| b < 0 || b as usize >= d.num_blocks)
        {
            return bad(format!(
                "row {}: block id {b} is outside the cache's {} blocks",
                r.row, d.num_blocks
            ));
        }
    }
    Ok(())
}

/// Contiguous row ranges, one per thread, with about equal total work (positions attended).
fn balance(
    rows: &[DecodeRow<'_>],
    variant: &LayerVariant<'_>,
    threads: usize,
) -> Vec<(usize, usize)> {
    let work = |r: &DecodeRow<'_>| r.seq_len - variant.first_visible(r.seq_len - 1);
    let total: usize = rows.iter().map(work).sum();
    let threads = threads.min(rows.len()).max(1);
    let target = total.div_ceil(threads).max(1);
    let mut out = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0);
    for (i, r) in rows.iter().enumerate() {
        acc += work(r);
        if acc >= target && out.len() + 1 < threads {
            out.push((start, i + 1));
            start = i + 1;
            acc = 0;
        }
    }
    if start < rows.len() || out.is_empty() {
        out.push((start, rows.len()));
    }
    out
}

// ------------------------------------------------------------------------------ KV rows

/// Positions processed together: the scores of one query head for a tile of positions are
/// one vector, and the V rows of a tile update an output head held in registers.
const TILE: usize = 8;

/// Where the rows of one cache come from. Invariant of every implementation: `validate` has
/// checked the data (`slots * Hkv * D` values) and scales (`slots * Hkv`) lengths, so every
/// slot a validated block table reaches, and its `(slot, g)` scales, are in bounds.
trait KvRows: Copy + Send + Sync {
    /// The unscaled f32 rows `[Hkv * D]` (`row_len` values) of the tile's positions
    /// `slots[..n]`: the cache itself for float32, else the codes converted into `buf`
    /// (`TILE * row_len` long, one row per position); positions `n..` are `zeros`.
    fn rows<'s>(
        &'s self,
        slots: &[usize; TILE],
        n: usize,
        row_len: usize,
        buf: &'s mut [f32],
        zeros: &'s [f32],
    ) -> [&'s [f32]; TILE];
    /// The scale of the vector at (slot, KV head) index `slot * Hkv + g`.
    fn scale(&self, index: usize) -> f32;
    /// Hint the CPU to fetch the row (and scales) of `slot` into the cache.
    fn prefetch(&self, slot: usize, hkv: usize, dim: usize);
}

/// Prefetch hints for the cache lines of `data[start..start + len]` (never faults, whatever
/// the address; a no-op off x86-64).
#[inline(always)]
fn prefetch_range<T>(data: &[T], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let base = data.as_ptr().wrapping_add(start).cast::<i8>();
        let bytes = len * std::mem::size_of::<T>();
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: a prefetch is a hint: it never faults and has no effect on memory.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(offset)) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, start, len);
}

/// A float32 cache, read in place; its scale is the constant 1 (folded away).
#[derive(Clone, Copy)]
struct F32Rows<'a>(&'a [f32]);

impl KvRows for F32Rows<'_> {
    #[inline(always)]
    fn rows<'s>(
        &'s self,
        slots: &[usize; TILE],
        n: usize,
        row_len: usize,
        _buf: &'s mut [f32],
        zeros: &'s [f32],
    ) -> [&'s [f32]; TILE] {
        let mut rows = [zeros; TILE];
        for (row, &slot) in rows.iter_mut().zip(slots).take(n) {
            *row = &self.0[slot * row_len..(slot + 1) * row_len];
        }
        rows
    }

    #[inline(always)]
    fn scale(&self, _index: usize) -> f32 {
        1.0
    }

    #[inline(always)]
    fn prefetch(&self, slot: usize, hkv: usize, dim: usize) {
        prefetch_range(self.0, slot * hkv * dim, hkv * dim);
    }
}

/// A quantized storage format: its code type and how codes become (unscaled) f32 values.
trait Format: Copy + Send + Sync {
    /// The stored code type.
    type Code: Copy + Send + Sync;
    /// `dst[i] = value(src[i])` for `i < min(len)`, with `I`'s instructions.
    fn decode<I: Isa>(src: &[Self::Code], dst: &mut [f32]);
}

/// int8: the integer itself (vectorises to sign-extend + int-to-float on any target).
#[derive(Clone, Copy)]
struct Int8;

impl Format for Int8 {
    type Code = i8;
    #[inline(always)]
    fn decode<I: Isa>(src: &[i8], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s as f32;
        }
    }
}

/// fp8, e4m3 (`E4M3`) or e5m2.
#[derive(Clone, Copy)]
struct Fp8<const E4M3: bool>;

impl<const E4M3: bool> Format for Fp8<E4M3> {
    type Code = u8;
    #[inline(always)]
    fn decode<I: Isa>(src: &[u8], dst: &mut [f32]) {
        I::fp8_to_f32::<E4M3>(src, dst)
    }
}

/// A quantized cache: codes of format `F` decoded with `I`, one bf16 scale per (slot, KV head).
struct ScaledRows<'a, F: Format, I: Isa> {
    data: &'a [F::Code],
    scales: &'a [u16],
    _isa: I,
}

// Manual impls: a derive would require `F: Clone`, not just the references.
impl<F: Format, I: Isa> Clone for ScaledRows<'_, F, I> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F: Format, I: Isa> Copy for ScaledRows<'_, F, I> {}

impl<'a, F: Format, I: Isa> ScaledRows<'a, F, I> {
    fn new(q: Quantized<'a, F::Code>, isa: I) -> Self {
        ScaledRows {
            data: q.data,
            scales: q.scales,
            _isa: isa,
        }
    }
}

impl<F: Format, I: Isa> KvRows for ScaledRows<'_, F, I> {
    #[inline(always)]
    fn rows<'s>(
        &'s self,
        slots: &[usize; TILE],
        n: usize,
        row_len: usize,
        buf: &'s mut [f32],
        zeros: &'s [f32],
    ) -> [&'s [f32]; TILE] {
        let buf = &mut buf[..TILE * row_len];
        // The common case (a full tile inside one block, or across physically adjacent
        // blocks): the tile's slots are consecutive, its codes one run.
        if n == TILE && slots.windows(2).all(|w| w[1] == w[0] + 1) {
            F::decode::<I>(
                &self.data[slots[0] * row_len..(slots[0] + TILE) * row_len],
                buf,
            );
        } else {
            for (dst, &slot) in buf.chunks_exact_mut(row_len).zip(slots).take(n) {
                F::decode::<I>(&self.data[slot * row_len..(slot + 1) * row_len], dst);
            }
        }
        let mut rows = [zeros; TILE];
        for (row, src) in rows.iter_mut().zip(buf.chunks_exact(row_len)).take(n) {
            *row = src;
        }
        rows
    }

    #[inline(always)]
    fn scale(&self, index: usize) -> f32 {
        bf16_to_f32(self.scales[index])
    }

    #[inline(always)]
    fn prefetch(&self, slot: usize, hkv: usize, dim: usize) {
        prefetch_range(self.data, slot * hkv * dim, hkv * dim);
        prefetch_range(self.scales, slot * hkv, 1);
    }
}

// ---------------------------------------------------------------------- instruction sets

/// The inner loops, per instruction set. `rows` are the rows of the `TILE` positions of a
/// tile, whose head vector is `rows[i][at..at + dim]` (a padding position is a zero row).
trait Isa: Copy + Send + Sync {
    /// `[q[..dim] · rows[i][at..at + dim] for i in 0..TILE]`.
    fn dot_tile(q: &[f32], rows: &[&[f32]; TILE], at: usize, dim: usize) -> [f32; TILE];
    /// `acc[..dim] += Σ_i w[i] * rows[i][at..at + dim]`, `i` in order for each value.
    fn axpy_tile(w: &[f32; TILE], rows: &[&[f32]; TILE], at: usize, acc: &mut [f32], dim: usize);
    /// fp8 codes (e4m3 when `E4M3`, else e5m2) to f32, exact, for `i < min(len)`.
    fn fp8_to_f32<const E4M3: bool>(src: &[u8], dst: &mut [f32]);
}

/// Plain Rust, compiled for the baseline target.
#[derive(Clone, Copy)]
struct Portable;

impl Isa for Portable {
    #[inline(always)]
    fn dot_tile(q: &[f32], rows: &[&[f32]; TILE], at: usize, dim: usize) -> [f32; TILE] {
        let mut out = [0f32; TILE];
        for (o, r) in out.iter_mut().zip(rows) {
            *o = dot(&q[..dim], &r[at..at + dim]);
        }
        out
    }

    #[inline(always)]
    fn axpy_tile(w: &[f32; TILE], rows: &[&[f32]; TILE], at: usize, acc: &mut [f32], dim: usize) {
        for (&wi, r) in w.iter().zip(rows) {
            axpy(wi, &r[at..at + dim], &mut acc[..dim]);
        }
    }

    #[inline(always)]
    fn fp8_to_f32<const E4M3: bool>(src: &[u8], dst: &mut [f32]) {
        let table = if E4M3 { &E4M3_TABLE } else { &E5M2_TABLE };
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = table[s as usize];
        }
    }
}

/// AVX2 + FMA + F16C intrinsics.
///
/// Only ever instantiated inside [`attend_rows_avx2`], which runs only after the three
/// features were detected at runtime: that is what makes the `unsafe` calls below sound.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    #[inline(always)]
    fn dot_tile(q: &[f32], rows: &[&[f32]; TILE], at: usize, dim: usize) -> [f32; TILE] {
        // SAFETY: see the type's invariant (instantiated only after the features' detection).
        unsafe { avx2::dot_tile(q, rows, at, dim) }
    }

    #[inline(always)]
    fn axpy_tile(w: &[f32; TILE], rows: &[&[f32]; TILE], at: usize, acc: &mut [f32], dim: usize) {
        // SAFETY: as above.
        unsafe { avx2::axpy_tile(w, rows, at, acc, dim) }
    }

    #[inline(always)]
    fn fp8_to_f32<const E4M3: bool>(src: &[u8], dst: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx2::fp8_to_f32::<E4M3>(src, dst) }
    }
}

/// The AVX2 inner loops. Each checks the lengths it relies on once, up front, and hands
/// anything shorter to [`Portable`] (never the case for the kernel's own calls), so the raw
/// loads and stores stay in bounds.
///
/// They are `#[inline(always)]` functions *without* `#[target_feature]` (the two cannot be
/// combined): inlined into [`attend_rows_avx2`], which has the features, the intrinsics inline
/// too. A `#[target_feature]` function would stay an out-of-line call per tile and head, whose
/// result goes through memory and whose latency the next call cannot overlap.
///
/// # Safety (every function)
///
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Isa, Portable, TILE};
    use std::arch::x86_64::*;

    #[inline(always)]
    pub(super) unsafe fn dot_tile(
        q: &[f32],
        rows: &[&[f32]; TILE],
        at: usize,
        dim: usize,
    ) -> [f32; TILE] {
        if q.len() < dim || rows.iter().any(|r| r.len() < at + dim) {
            return Portable::dot_tile(q, rows, at, dim);
        }
        let full = dim - dim % 8;
        let mut acc = [_mm256_setzero_ps(); TILE];
        let mut c = 0;
        while c < full {
            // SAFETY: `c + 8 <= full <= dim <= q.len()` and `at + c + 8 <= at + dim <= len`
            // of every row (checked above).
            let qv = _mm256_loadu_ps(q.as_ptr().add(c));
            for (a, r) in acc.iter_mut().zip(rows) {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r.as_ptr().add(at + c)), *a);
            }
            c += 8;
        }
        // Transpose-reduce the 8 accumulators into one vector of their 8 sums.
        let u0 = _mm256_hadd_ps(
            _mm256_hadd_ps(acc[0], acc[1]),
            _mm256_hadd_ps(acc[2], acc[3]),
        );
        let u1 = _mm256_hadd_ps(
            _mm256_hadd_ps(acc[4], acc[5]),
            _mm256_hadd_ps(acc[6], acc[7]),
        );
        let sums = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        );
        let mut out = [0f32; TILE];
        // SAFETY: `out` holds 8 floats.
        _mm256_storeu_ps(out.as_mut_ptr(), sums);
        if full < dim {
            for (o, r) in out.iter_mut().zip(rows) {
                *o += q[full..dim]
                    .iter()
                    .zip(&r[at + full..at + dim])
                    .map(|(a, b)| a * b)
                    .sum::<f32>();
            }
        }
        out
    }

    #[inline(always)]
    pub(super) unsafe fn axpy_tile(
        w: &[f32; TILE],
        rows: &[&[f32]; TILE],
        at: usize,
        acc: &mut [f32],
        dim: usize,
    ) {
        if acc.len() < dim || rows.iter().any(|r| r.len() < at + dim) {
            return Portable::axpy_tile(w, rows, at, acc, dim);
        }
        let mut wv = [_mm256_setzero_ps(); TILE];
        for (v, &x) in wv.iter_mut().zip(w) {
            *v = _mm256_set1_ps(x);
        }
        let out = acc.as_mut_ptr();
        let mut c = 0;
        // 64 values (8 registers) of the output head at a time, updated by the whole tile.
        // SAFETY (every load and store below): `c + 64` (resp. `c + 8`) `<= dim <= acc.len()`
        // and `at + dim <= len` of every row (checked above).
        while c + 64 <= dim {
            let mut a = [_mm256_setzero_ps(); 8];
            for (j, aj) in a.iter_mut().enumerate() {
                *aj = _mm256_loadu_ps(out.add(c + 8 * j));
            }
            for (wi, r) in wv.iter().zip(rows) {
                let src = r.as_ptr().add(at + c);
                for (j, aj) in a.iter_mut().enumerate() {
                    *aj = _mm256_fmadd_ps(*wi, _mm256_loadu_ps(src.add(8 * j)), *aj);
                }
            }
            for (j, aj) in a.iter().enumerate() {
                _mm256_storeu_ps(out.add(c + 8 * j), *aj);
            }
            c += 64;
        }
        while c + 8 <= dim {
            let mut a = _mm256_loadu_ps(out.add(c));
            for (wi, r) in wv.iter().zip(rows) {
                a = _mm256_fmadd_ps(*wi, _mm256_loadu_ps(r.as_ptr().add(at + c)), a);
            }
            _mm256_storeu_ps(out.add(c), a);
            c += 8;
        }
        for t in c..dim {
            for (&wi, r) in w.iter().zip(rows) {
                acc[t] += wi * r[at + t];
            }
        }
    }

    /// Each code widened to 16 bits becomes a half with the code's value (e5m2: `byte << 8`;
    /// e4m3: the code sign-extended, `<< 7` and bit 14 cleared is a half with the value / 256,
    /// the NaN code's exponent then set to 31), then `vcvtph2ps` (exact, subnormal halves
    /// included) and, for e4m3, `* 256` (exact). 16 codes per step; the tail (`len % 16`) goes
    /// through the table.
    #[inline(always)]
    pub(super) unsafe fn fp8_to_f32<const E4M3: bool>(src: &[u8], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` bounds the 16-byte load from `src` and the 16 floats
            // stored into `dst` (unaligned loads and stores).
            let bytes = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
            let half = if E4M3 {
                // S.EEEE.MMM sign-extended to 16 bits and shifted: S at 15 (and 14), EEEE at
                // 13..10, MMM at 9..7; 0xBF80 keeps all but bit 14: the half S.0EEEE.MMM0000000.
                let wide = _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(bytes));
                let h = _mm256_and_si256(wide, _mm256_set1_epi16(0xBF80u16 as i16));
                // S.1111.111 is NaN: set bit 14 too (exponent 31, mantissa non-zero).
                let all_ones = _mm256_set1_epi16(0x3F80);
                let nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, all_ones), all_ones);
                _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)))
            } else {
                _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(bytes))
            };
            let mut lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
            let mut hi = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(half));
            if E4M3 {
                // Exponent bias 15 -> 7 (the results are at most 448 in magnitude).
                lo = _mm256_mul_ps(lo, _mm256_set1_ps(256.0));
                hi = _mm256_mul_ps(hi, _mm256_set1_ps(256.0));
            }
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), lo);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i + 8), hi);
            i += 16;
        }
        Portable::fp8_to_f32::<E4M3>(&src[i..n], &mut dst[i..n]);
    }
}

// ------------------------------------------------------------------------- the kernel

/// [`attend_rows`] compiled for AVX2 + FMA + F16C when the CPU has them (runtime check),
/// else for the baseline target. The wheel targets baseline x86-64, whose SSE2 has no vector
/// `floor` (the exp), no FMA and no half conversion.
fn attend_rows_dispatch(
    q: &[f32],
    caches: KvCaches<'_>,
    d: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    variant: &LayerVariant<'_>,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu_isa::attention_path() == "avx2" {
            // SAFETY: the features this function is compiled for were just detected at runtime.
            return unsafe { attend_rows_avx2(q, caches, d, rows, scale, variant) };
        }
    }
    attend_rows_with(Portable, q, caches, d, rows, scale, variant)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_rows_avx2(
    q: &[f32],
    caches: KvCaches<'_>,
    d: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    variant: &LayerVariant<'_>,
) -> Vec<f32> {
    attend_rows_with(Avx2, q, caches, d, rows, scale, variant)
}

/// [`attend_rows`] for the format of `caches`, with the inner loops of `isa`.
#[inline(always)]
fn attend_rows_with<I: Isa>(
    isa: I,
    q: &[f32],
    caches: KvCaches<'_>,
    d: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    variant: &LayerVariant<'_>,
) -> Vec<f32> {
    match caches {
        KvCaches::F32 { key, value } => {
            attend_rows::<I, _, _>(q, F32Rows(key), F32Rows(value), d, rows, scale, variant)
        }
        KvCaches::Int8 { key, value } => {
            let (k, v) = (
                ScaledRows::<Int8, I>::new(key, isa),
                ScaledRows::<Int8, I>::new(value, isa),
            );
            attend_rows::<I, _, _>(q, k, v, d, rows, scale, variant)
        }
        KvCaches::Fp8E4M3 { key, value } => {
            let (k, v) = (
                ScaledRows::<Fp8<true>, I>::new(key, isa),
                ScaledRows::<Fp8<true>, I>::new(value, isa),
            );
            attend_rows::<I, _, _>(q, k, v, d, rows, scale, variant)
        }
        KvCaches::Fp8E5M2 { key, value } => {
            let (k, v) = (
                ScaledRows::<Fp8<false>, I>::new(key, isa),
                ScaledRows::<Fp8<false>, I>::new(value, isa),
            );
            attend_rows::<I, _, _>(q, k, v, d, rows, scale, variant)
        }
    }
}

/// Positions ahead of the tile being computed whose K (V) rows are prefetched: the blocks of
/// a sequence are scattered, so the hardware prefetcher stalls at every block boundary.
const PREFETCH_AHEAD: usize = 2 * TILE;

/// Attention of `rows` (validated) into a new `[rows, H, D]` buffer.
///
/// Position-major, `TILE` positions at a time: the K (then V) head vectors of a tile are
/// streamed once, in cache order, and serve every query head of their group. A quantized
/// vector is converted (unscaled) into the tile buffer (`TILE` vectors of `D` f32: one per
/// position, L1-resident) right before use; the scales join the scalar factors.
#[inline(always)]
fn attend_rows<I: Isa, K: KvRows, V: KvRows>(
    q: &[f32],
    kc: K,
    vc: V,
    d: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    variant: &LayerVariant<'_>,
) -> Vec<f32> {
    let (h_all, dim) = (d.num_heads, d.head_dim);
    let row_elems = h_all * dim;
    let mut out = vec![0f32; rows.len() * row_elems];
    // scores[h][p] for the row being processed.
    let mut scores: Vec<f32> = Vec::new();
    let mut norms = vec![0f32; h_all];
    // The tile buffer: one converted row per position of a tile (quantized caches only).
    let row_len = d.num_kv_heads * dim;
    let mut tile = vec![0f32; TILE * row_len];
    let zeros = vec![0f32; row_len];
    for (k, r) in rows.iter().enumerate() {
        // Positions first .. seq_len: the row's visible keys; scores[h][p - first].
        let first = variant.first_visible(r.seq_len - 1);
        let span = Span {
            first,
            len: r.seq_len - first,
        };
        scores.clear();
        scores.resize(h_all * span.len, 0.0);
        let qr = &q[r.row * row_elems..(r.row + 1) * row_elems];
        // 1. Scores: stream K tile by tile; the K scale joins the softmax scale.
        for p0 in (first..r.seq_len).step_by(TILE) {
            let n = TILE.min(r.seq_len - p0);
            // A full tile gets its own copy of the body, with `n` a constant.
            if n == TILE {
                score_tile::<I, K>(
                    kc,
                    qr,
                    r,
                    d,
                    span,
                    p0,
                    TILE,
                    scale,
                    &mut scores,
                    &mut tile,
                    &zeros,
                );
            } else {
                score_tile::<I, K>(
                    kc,
                    qr,
                    r,
                    d,
                    span,
                    p0,
                    n,
                    scale,
                    &mut scores,
                    &mut tile,
                    &zeros,
                );
            }
        }
        if let Some(cap) = variant.logits_soft_cap {
            scores.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        // 2. Softmax numerators and normalisers per query head; a sink joins the max and the
        // normaliser (its numerator weighs no value).
        for (h, z) in norms.iter_mut().enumerate() {
            let s = &mut scores[h * span.len..(h + 1) * span.len];
            let sink = variant.sinks.map(|sinks| sinks[h]);
            let m = max_lanes(s).max(sink.unwrap_or(f32::NEG_INFINITY));
            s.iter_mut().for_each(|x| *x = fast_exp(*x - m));
            *z = sum_lanes(s) + sink.map_or(0.0, |x| fast_exp(x - m));
        }
        // 3. Weighted sum: stream V tile by tile; the V scale joins the weight.
        let acc = &mut out[k * row_elems..(k + 1) * row_elems];
        for p0 in (first..r.seq_len).step_by(TILE) {
            let n = TILE.min(r.seq_len - p0);
            if n == TILE {
                value_tile::<I, V>(vc, r, d, span, p0, TILE, &scores, acc, &mut tile, &zeros);
            } else {
                value_tile::<I, V>(vc, r, d, span, p0, n, &scores, acc, &mut tile, &zeros);
            }
        }
        for (h, z) in norms.iter().enumerate() {
            let inv = 1.0 / z;
            acc[h * dim..(h + 1) * dim]
                .iter_mut()
                .for_each(|x| *x *= inv);
        }
    }
    out
}

/// The positions a row attends: `first .. first + len`; its scores are `scores[h * len + p - first]`.
#[derive(Debug, Clone, Copy)]
struct Span {
    first: usize,
    len: usize,
}

/// The cache slots of positions `p0 .. p0 + n` of row `r` (0 past `n`), and a prefetch of the
/// rows `PREFETCH_AHEAD` positions further. In bounds: `validate` checked that the table
/// covers `seq_len` positions and that its ids are below `num_blocks`.
#[inline(always)]
fn tile_slots<R: KvRows>(
    kv: &R,
    r: &DecodeRow<'_>,
    d: AttentionDims,
    p0: usize,
    n: usize,
) -> [usize; TILE] {
    let bs = d.block_size;
    // One division per tile (not per position: a 64-bit division costs tens of cycles).
    let (mut block, mut offset) = (p0 / bs, p0 % bs);
    let mut slots = [0usize; TILE];
    for slot in slots.iter_mut().take(n) {
        *slot = r.table[block] as usize * bs + offset;
        offset += 1;
        if offset == bs {
            (block, offset) = (block + 1, 0);
        }
    }
    let ahead = p0 + PREFETCH_AHEAD;
    let (mut block, mut offset) = (ahead / bs, ahead % bs);
    for _ in ahead..(ahead + n).min(r.seq_len) {
        kv.prefetch(
            r.table[block] as usize * bs + offset,
            d.num_kv_heads,
            d.head_dim,
        );
        offset += 1;
        if offset == bs {
            (block, offset) = (block + 1, 0);
        }
    }
    slots
}

/// `scores[h][p0 + i] = (scale * k_scale) * (q[h] · k_raw[p0 + i])` for the `n <= TILE`
/// positions of one tile and every query head; padding positions (`n..TILE`) are zero
/// vectors whose scores are dropped.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_tile<I: Isa, K: KvRows>(
    kc: K,
    qr: &[f32],
    r: &DecodeRow<'_>,
    d: AttentionDims,
    span: Span,
    p0: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    tile: &mut [f32],
    zeros: &[f32],
) {
    let (hkv, dim, len, at) = (d.num_kv_heads, d.head_dim, span.len, p0 - span.first);
    let groups = d.num_heads / hkv;
    let slots = tile_slots(&kc, r, d, p0, n);
    let rows = kc.rows(&slots, n, hkv * dim, tile, zeros);
    for g in 0..hkv {
        let mut factors = [0f32; TILE];
        for (f, &slot) in factors.iter_mut().zip(&slots).take(n) {
            *f = scale * kc.scale(slot * hkv + g);
        }
        for h in g * groups..(g + 1) * groups {
            let s = I::dot_tile(&qr[h * dim..(h + 1) * dim], &rows, g * dim, dim);
            for ((dst, si), f) in scores[h * len + at..h * len + at + n]
                .iter_mut()
                .zip(s)
                .zip(factors)
            {
                *dst = si * f;
            }
        }
    }
}

/// `acc[h] += Σ_i (e[h][p0 + i] * v_scale) * v_raw[p0 + i]` for the `n <= TILE` positions of
/// one tile and every query head; padding positions have weight 0 and a zero vector (they add
/// exactly 0).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn value_tile<I: Isa, V: KvRows>(
    vc: V,
    r: &DecodeRow<'_>,
    d: AttentionDims,
    span: Span,
    p0: usize,
    n: usize,
    scores: &[f32],
    acc: &mut [f32],
    tile: &mut [f32],
    zeros: &[f32],
) {
    let (hkv, dim, len, at) = (d.num_kv_heads, d.head_dim, span.len, p0 - span.first);
    let groups = d.num_heads / hkv;
    let slots = tile_slots(&vc, r, d, p0, n);
    let rows = vc.rows(&slots, n, hkv * dim, tile, zeros);
    for g in 0..hkv {
        let mut v_scales = [0f32; TILE];
        for (v, &slot) in v_scales.iter_mut().zip(&slots).take(n) {
            *v = vc.scale(slot * hkv + g);
        }
        for h in g * groups..(g + 1) * groups {
            let mut w = [0f32; TILE];
            for ((wi, &e), vs) in w
                .iter_mut()
                .zip(&scores[h * len + at..h * len + at + n])
                .zip(v_scales)
            {
                *wi = e * vs;
            }
            I::axpy_tile(&w, &rows, g * dim, &mut acc[h * dim..(h + 1) * dim], dim);
        }
    }
}

/// Dot product with 8 independent partial sums (lets the compiler use vector registers
/// without reassociating a single float sum).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// The largest value (NaNs ignored; -inf for an empty slice), in 8 independent lanes.
#[inline(always)]
fn max_lanes(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    tail.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// The sum, in 8 independent lanes (a single running float sum is one long dependency chain).
#[inline(always)]
fn sum_lanes(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            lanes[l] += c[l];
        }
    }
    lanes.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// `acc += w * v`.
#[inline(always)]
fn axpy(w: f32, v: &[f32], acc: &mut [f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// `e^x` for `x <= 0` (softmax numerators), relative error below 2e-7: `2^k * p(r)` with
/// `x = k ln2 + r`, `|r| <= ln2 / 2`, and Cephes' degree-7 polynomial for `e^r`. Branch-free,
/// so loops over it vectorise. Inputs below -87 give 0 (the true value underflows f32 anyway).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 0.0);
    let k = (x * LOG2E + 0.5).floor();
    let r = x - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2^k from the bits of k + 127 + 2^23 (its low mantissa bits are the integer k + 127 in
    // 1..=127): no float-to-int conversion, whose saturating `as` does not vectorise. A NaN
    // `x` gives a NaN `e` (and a zero `scale`): NaN out, as before.
    let scale = f32::from_bits(((k + (127.0 + 8_388_608.0)).to_bits() & 0xFF) << 23);
    if underflow {
        0.0
    } else {
        e * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f32;
        for i in 0..=87_000 {
            let x = -(i as f32) / 1000.0;
            let (got, want) = (fast_exp(x), x.exp());
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(fast_exp(-1000.0), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    /// Naive attention over contiguous K/V for one row.
    fn naive(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], scale: f32) -> Vec<f32> {
        naive_variant(q, k, v, scale, None, None)
    }

    #[test]
    fn matches_naive_attention_through_shuffled_blocks() {
        let d = AttentionDims {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
            num_blocks: 10,
        };
        let cache_len = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
        let val =
            |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
        let kc: Vec<f32> = (0..cache_len).map(|i| val(i, 1)).collect();
        let vc: Vec<f32> = (0..cache_len).map(|i| val(i, 2)).collect();
        let q: Vec<f32> = (0..3 * d.num_heads * d.head_dim)
            .map(|i| val(i, 3))
            .collect();
        let tables: [Vec<i32>; 2] = [vec![7, 2, 9], vec![4]];
        let rows = [
            DecodeRow {
                row: 2,
                seq_len: 10,
                table: &tables[0],
            },
            DecodeRow {
                row: 0,
                seq_len: 3,
                table: &tables[1],
            },
        ];
        for threads in [1, 2, 3] {
            let mut out = vec![f32::NAN; q.len()];
            paged_decode_attention(&q, &kc, &vc, d, &rows, 0.3, &mut out, threads).unwrap();
            for r in &rows {
                for h in 0..d.num_heads {
                    let kvh = h / (d.num_heads / d.num_kv_heads);
                    let pick = |c: &[f32], p: usize| {
                        let b = r.table[p / d.block_size] as usize;
                        let base = ((b * d.block_size + p % d.block_size) * d.num_kv_heads + kvh)
                            * d.head_dim;
                        c[base..base + d.head_dim].to_vec()
                    };
                    let ks: Vec<Vec<f32>> = (0..r.seq_len).map(|p| pick(&kc, p)).collect();
                    let vs: Vec<Vec<f32>> = (0..r.seq_len).map(|p| pick(&vc, p)).collect();
                    let qh = &q[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
                    let want = naive(qh, &ks, &vs, 0.3);
                    let got = &out[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() < 1e-5, "{g} vs {w}");
                    }
                }
            }
            // Row 1 was not a decode row: untouched.
            assert!(out[d.num_heads * d.head_dim..2 * d.num_heads * d.head_dim]
                .iter()
                .all(|x| x.is_nan()));
        }
    }

    /// Naive attention of one row under a layer variant: the positions `first .. len` of
    /// contiguous K/V, soft-capped scores, and the head's sink in the softmax.
    fn naive_variant(
        q: &[f32],
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        scale: f32,
        cap: Option<f32>,
        sink: Option<f32>,
    ) -> Vec<f32> {
        let s: Vec<f32> = k
            .iter()
            .map(|kr| q.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale)
            .map(|x| cap.map_or(x, |c| c * (x / c).tanh()))
            .collect();
        let m = s
            .iter()
            .copied()
            .chain(sink)
            .fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum::<f32>() + sink.map_or(0.0, |x| (x - m).exp());
        (0..q.len())
            .map(|j| e.iter().zip(v).map(|(w, vr)| w * vr[j]).sum::<f32>() / z)
            .collect()
    }

    #[test]
    fn layer_variants_match_naive_attention_and_never_read_behind_the_window() {
        let d = AttentionDims {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
            num_blocks: 12,
        };
        let cache_len = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
        let row_len = d.num_kv_heads * d.head_dim;
        let val =
            |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
        let mut kc: Vec<f32> = (0..cache_len).map(|i| val(i, 1)).collect();
        let mut vc: Vec<f32> = (0..cache_len).map(|i| val(i, 2)).collect();
        let q: Vec<f32> = (0..3 * d.num_heads * d.head_dim)
            .map(|i| val(i, 3))
            .collect();
        // Row 0: 21 tokens over 6 blocks; row 2: 9 tokens over 3 blocks.
        let full_tables: [Vec<i32>; 2] = [vec![7, 2, 9, 0, 11, 5], vec![4, 1, 10]];
        let sinks = [0.5f32, -1.0, 2.0, 0.0];
        let variants = [
            LayerVariant {
                sliding_window: Some(6),
                ..LayerVariant::FULL
            },
            LayerVariant {
                sliding_window: Some(4),
                ..LayerVariant::FULL
            },
            LayerVariant {
                sliding_window: Some(1),
                ..LayerVariant::FULL
            },
            LayerVariant {
                chunk_size: Some(8),
                ..LayerVariant::FULL
            },
            LayerVariant {
                logits_soft_cap: Some(0.7),
                ..LayerVariant::FULL
            },
            LayerVariant {
                sinks: Some(&sinks),
                ..LayerVariant::FULL
            },
            LayerVariant {
                sliding_window: Some(7),
                logits_soft_cap: Some(1.5),
                sinks: Some(&sinks),
                chunk_size: None,
            },
        ];
        for variant in variants {
            // The table entries before a row's first visible block are -1 (given back) and the
            // blocks they named hold NaN: reading either is an error or a NaN output.
            let mut tables = full_tables.clone();
            let (pristine_k, pristine_v) = (kc.clone(), vc.clone());
            for (table, len) in tables.iter_mut().zip([21usize, 9]) {
                for entry in table
                    .iter_mut()
                    .take(variant.first_visible(len - 1) / d.block_size)
                {
                    let b = *entry as usize;
                    let block = b * d.block_size * row_len..(b + 1) * d.block_size * row_len;
                    kc[block.clone()].iter_mut().for_each(|x| *x = f32::NAN);
                    vc[block].iter_mut().for_each(|x| *x = f32::NAN);
                    *entry = -1;
                }
            }
            let rows = [
                DecodeRow {
                    row: 0,
                    seq_len: 21,
                    table: &tables[0],
                },
                DecodeRow {
                    row: 2,
                    seq_len: 9,
                    table: &tables[1],
                },
            ];
            for threads in [1, 2] {
                let mut out = vec![0f32; q.len()];
                let caches = KvCaches::F32 {
                    key: &kc,
                    value: &vc,
                };
                paged_decode_attention_layer(&q, caches, d, &rows, 0.4, variant, &mut out, threads)
                    .unwrap();
                for (r, full_table) in rows.iter().zip(&full_tables) {
                    let first = variant.first_visible(r.seq_len - 1);
                    for h in 0..d.num_heads {
                        let kvh = h / (d.num_heads / d.num_kv_heads);
                        let pick = |c: &[f32], p: usize| {
                            let b = full_table[p / d.block_size] as usize;
                            let base = ((b * d.block_size + p % d.block_size) * d.num_kv_heads
                                + kvh)
                                * d.head_dim;
                            c[base..base + d.head_dim].to_vec()
                        };
                        let ks: Vec<Vec<f32>> =
                            (first..r.seq_len).map(|p| pick(&pristine_k, p)).collect();
                        let vs: Vec<Vec<f32>> =
                            (first..r.seq_len).map(|p| pick(&pristine_v, p)).collect();
                        let qh = &q[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
                        let want = naive_variant(
                            qh,
                            &ks,
                            &vs,
                            0.4,
                            variant.logits_soft_cap,
                            variant.sinks.map(|s| s[h]),
                        );
                        let got = &out[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
                        for (g, w) in got.iter().zip(&want) {
                            assert!((g - w).abs() < 1e-5, "{variant:?}: {g} vs {w}");
                        }
                    }
                }
            }
            (kc, vc) = (pristine_k, pristine_v);
        }
    }

    #[test]
    fn bad_layer_variants_are_errors() {
        let d = AttentionDims {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 2,
            num_blocks: 2,
        };
        let cache = vec![0f32; 2 * 2 * 4];
        let (q, mut out) = (vec![0f32; 8], vec![0f32; 8]);
        let table = [0i32, 1];
        let rows = [DecodeRow {
            row: 0,
            seq_len: 3,
            table: &table,
        }];
        let caches = KvCaches::F32 {
            key: &cache,
            value: &cache,
        };
        let three_sinks = [0f32; 3];
        for variant in [
            LayerVariant {
                sliding_window: Some(0),
                ..LayerVariant::FULL
            },
            LayerVariant {
                chunk_size: Some(0),
                ..LayerVariant::FULL
            },
            LayerVariant {
                logits_soft_cap: Some(0.0),
                ..LayerVariant::FULL
            },
            LayerVariant {
                logits_soft_cap: Some(f32::NAN),
                ..LayerVariant::FULL
            },
            LayerVariant {
                sinks: Some(&three_sinks),
                ..LayerVariant::FULL
            },
        ] {
            assert!(
                paged_decode_attention_layer(&q, caches, d, &rows, 1.0, variant, &mut out, 1)
                    .is_err(),
                "{variant:?}"
            );
        }
        // A -1 entry inside the window is still an error; before it, it is never looked at.
        let behind = [-1i32, 1];
        let window = LayerVariant {
            sliding_window: Some(1),
            ..LayerVariant::FULL
        };
        let rows = [DecodeRow {
            row: 0,
            seq_len: 3,
            table: &behind,
        }];
        assert!(
            paged_decode_attention_layer(&q, caches, d, &rows, 1.0, window, &mut out, 1).is_ok()
        );
        assert!(paged_decode_attention_layer(
            &q,
            caches,
            d,
            &rows,
            1.0,
            LayerVariant::FULL,
            &mut out,
            1
        )
        .is_err());
    }

    #[test]
    fn bad_input_is_an_error() {
        let d = AttentionDims {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 2,
            num_blocks: 2,
        };
        let cache = vec![0f32; 2 * 2 * 4];
        let q = vec![0f32; 8];
        let mut out = vec![0f32; 8];
        let table = [0i32, 5];
        let bad_block = [DecodeRow {
            row: 0,
            seq_len: 3,
            table: &table,
        }];
        assert!(
            paged_decode_attention(&q, &cache, &cache, d, &bad_block, 1.0, &mut out, 1).is_err()
        );
        let short = [DecodeRow {
            row: 0,
            seq_len: 5,
            table: &table,
        }];
        assert!(paged_decode_attention(&q, &cache, &cache, d, &short, 1.0, &mut out, 1).is_err());
        let bad_row = [DecodeRow {
            row: 1,
            seq_len: 1,
            table: &table,
        }];
        assert!(paged_decode_attention(&q, &cache, &cache, d, &bad_row, 1.0, &mut out, 1).is_err());
    }

    // ------------------------------------------------------------------ quantized caches

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Fmt {
        Int8,
        E4M3,
        E5M2,
    }

    impl Fmt {
        const ALL: [Fmt; 3] = [Fmt::Int8, Fmt::E4M3, Fmt::E5M2];

        fn qmax(self) -> f64 {
            match self {
                Fmt::Int8 => 127.0,
                Fmt::E4M3 => 448.0,
                Fmt::E5M2 => 57344.0,
            }
        }

        /// A random code the quantizer can write: int8 in -127..=127; fp8 anything but NaN
        /// (and infinity) codes, subnormals included.
        fn code(self, rng: &mut StdRng) -> u8 {
            loop {
                let c: u8 = rng.random();
                let ok = match self {
                    Fmt::Int8 => c != 0x80,
                    Fmt::E4M3 => c & 0x7F != 0x7F,
                    Fmt::E5M2 => c & 0x7C != 0x7C,
                };
                if ok {
                    return c;
                }
            }
        }

        fn value(self, code: u8) -> f64 {
            match self {
                Fmt::Int8 => code as i8 as f64,
                Fmt::E4M3 => fp8_e4m3_to_f32(code) as f64,
                Fmt::E5M2 => fp8_e5m2_to_f32(code) as f64,
            }
        }
    }

    /// Random quantized K/V caches: codes, and bf16 scales of vectors whose absmax is in
    /// 0.25..4 (one slot in 7 with the smallest normal scale, 2^-126: a zero vector's).
    struct QuantCaches {
        fmt: Fmt,
        k: Vec<u8>,
        v: Vec<u8>,
        // The same codes as int8 (used for Fmt::Int8).
        k_i8: Vec<i8>,
        v_i8: Vec<i8>,
        ks: Vec<u16>,
        vs: Vec<u16>,
    }

    impl QuantCaches {
        fn new(fmt: Fmt, d: AttentionDims, rng: &mut StdRng) -> Self {
            let slots = d.num_blocks * d.block_size * d.num_kv_heads;
            let codes = |rng: &mut StdRng| {
                (0..slots * d.head_dim)
                    .map(|_| fmt.code(rng))
                    .collect::<Vec<u8>>()
            };
            let scales = |rng: &mut StdRng| {
                (0..slots)
                    .map(|i| {
                        if i % 7 == 3 {
                            0x0080
                        } else {
                            let absmax: f32 = rng.random_range(0.25..4.0);
                            ((absmax / fmt.qmax() as f32).to_bits() >> 16) as u16
                        }
                    })
                    .collect::<Vec<u16>>()
            };
            let (k, v) = (codes(rng), codes(rng));
            let (ks, vs) = (scales(rng), scales(rng));
            let as_i8 = |c: &[u8]| c.iter().map(|&x| x as i8).collect::<Vec<i8>>();
            let (k_i8, v_i8) = (as_i8(&k), as_i8(&v));
            QuantCaches {
                fmt,
                k,
                v,
                k_i8,
                v_i8,
                ks,
                vs,
            }
        }

        fn caches(&self) -> KvCaches<'_> {
            match self.fmt {
                Fmt::Int8 => KvCaches::Int8 {
                    key: Quantized {
                        data: &self.k_i8,
                        scales: &self.ks,
                    },
                    value: Quantized {
                        data: &self.v_i8,
                        scales: &self.vs,
                    },
                },
                Fmt::E4M3 => KvCaches::Fp8E4M3 {
                    key: Quantized {
                        data: &self.k,
                        scales: &self.ks,
                    },
                    value: Quantized {
                        data: &self.v,
                        scales: &self.vs,
                    },
                },
                Fmt::E5M2 => KvCaches::Fp8E5M2 {
                    key: Quantized {
                        data: &self.k,
                        scales: &self.ks,
                    },
                    value: Quantized {
                        data: &self.v,
                        scales: &self.vs,
                    },
                },
            }
        }

        /// The dequantized head vector `float(code) * float(scale)` in f64.
        fn vector(&self, value: bool, slot: usize, g: usize, d: AttentionDims) -> Vec<f64> {
            let (codes, scales) = if value {
                (&self.v, &self.vs)
            } else {
                (&self.k, &self.ks)
            };
            let scale = bf16_to_f32(scales[slot * d.num_kv_heads + g]) as f64;
            let base = (slot * d.num_kv_heads + g) * d.head_dim;
            codes[base..base + d.head_dim]
                .iter()
                .map(|&c| self.fmt.value(c) * scale)
                .collect()
        }
    }

    /// Dequantize, then attend, in f64: the reference of a quantized decode row.
    fn naive_quantized(
        qc: &QuantCaches,
        q: &[f32],
        d: AttentionDims,
        r: &DecodeRow<'_>,
        scale: f32,
    ) -> Vec<f64> {
        let mut out = vec![0f64; d.num_heads * d.head_dim];
        let groups = d.num_heads / d.num_kv_heads;
        let slot = |p: usize| r.table[p / d.block_size] as usize * d.block_size + p % d.block_size;
        for h in 0..d.num_heads {
            let g = h / groups;
            let qh = &q[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
            let s: Vec<f64> = (0..r.seq_len)
                .map(|p| {
                    qc.vector(false, slot(p), g, d)
                        .iter()
                        .zip(qh)
                        .map(|(k, &x)| k * x as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (p, w) in e.iter().enumerate() {
                for (o, v) in out[h * d.head_dim..(h + 1) * d.head_dim]
                    .iter_mut()
                    .zip(qc.vector(true, slot(p), g, d))
                {
                    *o += w / z * v;
                }
            }
        }
        out
    }

    #[test]
    fn fp8_and_bf16_conversions_are_exact() {
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
        assert_eq!(bf16_to_f32(0xC000), -2.0);
        assert_eq!(bf16_to_f32(0x0080), f32::MIN_POSITIVE);
        let e4m3 = [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
        ];
        for (code, want) in
            e4m3.into_iter()
                .chain([(0x7E, 448.0), (0xFE, -448.0), (0xB8, -1.0), (0x3A, 1.25)])
        {
            assert_eq!(fp8_e4m3_to_f32(code), want, "e4m3 {code:#x}");
        }
        assert!(fp8_e4m3_to_f32(0x80) == 0.0 && fp8_e4m3_to_f32(0x80).is_sign_negative());
        assert!(fp8_e4m3_to_f32(0x7F).is_nan() && fp8_e4m3_to_f32(0xFF).is_nan());
        let e5m2 = [
            (0x00, 0.0),
            (0x01, 2f32.powi(-16)),
            (0x03, 3.0 * 2f32.powi(-16)),
            (0x04, 2f32.powi(-14)),
            (0x3C, 1.0),
        ];
        for (code, want) in
            e5m2.into_iter()
                .chain([(0x7B, 57344.0), (0xFB, -57344.0), (0x3D, 1.25)])
        {
            assert_eq!(fp8_e5m2_to_f32(code), want, "e5m2 {code:#x}");
        }
        assert_eq!(fp8_e5m2_to_f32(0x7C), f32::INFINITY);
        assert_eq!(fp8_e5m2_to_f32(0xFC), f32::NEG_INFINITY);
        assert!(fp8_e5m2_to_f32(0x7D).is_nan() && fp8_e5m2_to_f32(0xFF).is_nan());
        // Every finite fp8 value is a normal f32 (or zero): no subnormal operand downstream.
        for code in 0..=255u8 {
            for v in [fp8_e4m3_to_f32(code), fp8_e5m2_to_f32(code)] {
                assert!(
                    v == 0.0 || !v.is_finite() || v.is_normal(),
                    "{code:#x} -> {v}"
                );
            }
        }
    }

    #[test]
    fn simd_fp8_conversion_matches_the_table_for_every_code() {
        // All 256 codes, shifted so that every code lands in every lane, plus ragged tails.
        let all: Vec<u8> = (0..300).map(|i| (i * 7 + i / 256) as u8).collect();
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for len in [0, 1, 15, 16, 17, 31, 32, 100, 300] {
            for e4m3 in [true, false] {
                let src = &all[..len];
                let table = if e4m3 { &E4M3_TABLE } else { &E5M2_TABLE };
                let mut got = vec![f32::NAN; len];
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: the features were just detected.
                    unsafe {
                        if e4m3 {
                            avx2::fp8_to_f32::<true>(src, &mut got)
                        } else {
                            avx2::fp8_to_f32::<false>(src, &mut got)
                        }
                    }
                    for (&c, &g) in src.iter().zip(&got) {
                        assert!(
                            same(g, table[c as usize]),
                            "e4m3={e4m3} code {c:#x}: {g} vs {}",
                            table[c as usize]
                        );
                    }
                }
                if e4m3 {
                    Portable::fp8_to_f32::<true>(src, &mut got);
                } else {
                    Portable::fp8_to_f32::<false>(src, &mut got);
                }
                for (&c, &g) in src.iter().zip(&got) {
                    let want = if e4m3 {
                        fp8_e4m3_to_f32(c)
                    } else {
                        fp8_e5m2_to_f32(c)
                    };
                    assert!(same(g, want));
                }
            }
        }
    }

    /// Tolerance relative to the largest output magnitude of a row: the kernel and the f64
    /// reference read the same codes and scales, so only f32 rounding differs (observed: below
    /// 1e-6 here).
    const TOL: f64 = 1e-5;

    /// Runs the public kernel on every thread count and the portable build directly, and checks
    /// each against [`naive_quantized`].
    fn check_quantized(fmt: Fmt, d: AttentionDims, tables: &[Vec<i32>], lens: &[usize], seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let qc = QuantCaches::new(fmt, d, &mut rng);
        let caches = qc.caches();
        let num_rows = lens.len() + 1;
        let q: Vec<f32> = (0..num_rows * d.num_heads * d.head_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        // Rows in reverse order, leaving row 0 to no sequence.
        let rows: Vec<DecodeRow<'_>> = lens
            .iter()
            .zip(tables)
            .enumerate()
            .map(|(i, (&seq_len, t))| DecodeRow {
                row: num_rows - 1 - i,
                seq_len,
                table: t,
            })
            .collect();
        let scale = 0.7;
        let row_elems = d.num_heads * d.head_dim;
        let mut results = Vec::new();
        for threads in [1, 2, 3] {
            let mut out = vec![f32::NAN; q.len()];
            paged_decode_attention_kv(&q, caches, d, &rows, scale, &mut out, threads).unwrap();
            assert!(
                out[..row_elems].iter().all(|x| x.is_nan()),
                "row 0 must stay untouched"
            );
            results.push(("dispatch", out));
        }
        let portable = attend_rows_with(Portable, &q, caches, d, &rows, scale, &LayerVariant::FULL);
        let mut out = vec![f32::NAN; q.len()];
        for (k, r) in rows.iter().enumerate() {
            out[r.row * row_elems..(r.row + 1) * row_elems]
                .copy_from_slice(&portable[k * row_elems..(k + 1) * row_elems]);
        }
        results.push(("portable", out));
        for r in &rows {
            let want = naive_quantized(&qc, &q, d, r, scale);
            let vmax = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
            for (label, out) in &results {
                let got = &out[r.row * row_elems..(r.row + 1) * row_elems];
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g as f64 - w).abs() <= TOL * vmax,
                        "{fmt:?} {label} {d:?} row {} seq_len {} value {i}: {g} vs {w}",
                        r.row,
                        r.seq_len
                    );
                }
            }
        }
    }

    #[test]
    fn quantized_rows_match_dequantize_then_attend() {
        // Head dims: a multiple of 16 (whole SIMD steps), of 8 only, and of neither (tails);
        // block sizes that split tiles across blocks; tables with adjacent and scattered blocks.
        for fmt in Fmt::ALL {
            for (heads, kv_heads, head_dim, block_size) in [
                (6, 2, 64, 4),
                (4, 4, 40, 8),
                (3, 1, 20, 16),
                (8, 2, 128, 16),
                (2, 1, 16, 2),
            ] {
                let d = AttentionDims {
                    num_heads: heads,
                    num_kv_heads: kv_heads,
                    head_dim,
                    block_size,
                    num_blocks: 12,
                };
                // [0, 5, 7, 3]: with 2-token blocks, a tile whose first and last slots are 7
                // apart although its middle is elsewhere.
                let tables = vec![
                    vec![3, 4, 5, 9, 0, 1],
                    vec![11],
                    vec![0, 5, 7, 3, 8, 1],
                    vec![5, 6],
                ];
                let lens: Vec<usize> = tables
                    .iter()
                    .zip([23, 1, 41, 9])
                    .map(|(t, n)| n.min(t.len() * block_size))
                    .collect();
                check_quantized(fmt, d, &tables, &lens, head_dim as u64);
            }
        }
    }

    #[test]
    fn quantized_bad_input_is_an_error() {
        let d = AttentionDims {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 16,
            block_size: 2,
            num_blocks: 3,
        };
        let slots = d.num_blocks * d.block_size * d.num_kv_heads;
        let (codes, scales) = (vec![0i8; slots * d.head_dim], vec![0x3F80u16; slots]);
        let bytes = vec![0u8; slots * d.head_dim];
        let q = vec![0f32; 2 * d.head_dim];
        let mut out = vec![0f32; q.len()];
        let table = [0i32, 2];
        let rows = [DecodeRow {
            row: 0,
            seq_len: 3,
            table: &table,
        }];
        let ok = Quantized {
            data: &codes[..],
            scales: &scales[..],
        };
        let run = |caches: KvCaches<'_>, out: &mut [f32]| {
            paged_decode_attention_kv(&q, caches, d, &rows, 1.0, out, 1)
        };
        assert!(run(KvCaches::Int8 { key: ok, value: ok }, &mut out).is_ok());
        let short_scales = Quantized {
            data: &codes[..],
            scales: &scales[1..],
        };
        let err = run(
            KvCaches::Int8 {
                key: ok,
                value: short_scales,
            },
            &mut out,
        )
        .unwrap_err();
        assert!(err.to_string().contains("scale"), "{err}");
        assert!(run(
            KvCaches::Int8 {
                key: short_scales,
                value: ok
            },
            &mut out
        )
        .is_err());
        let short_data = Quantized {
            data: &codes[1..],
            scales: &scales[..],
        };
        assert!(run(
            KvCaches::Int8 {
                key: short_data,
                value: ok
            },
            &mut out
        )
        .is_err());
        let fp8 = Quantized {
            data: &bytes[..],
            scales: &scales[..],
        };
        let fp8_long_scales = Quantized {
            data: &bytes[..],
            scales: &[0u16; 100][..],
        };
        assert!(run(
            KvCaches::Fp8E4M3 {
                key: fp8,
                value: fp8
            },
            &mut out
        )
        .is_ok());
        assert!(run(
            KvCaches::Fp8E5M2 {
                key: fp8,
                value: fp8_long_scales
            },
            &mut out
        )
        .is_err());
        assert!(run(
            KvCaches::Fp8E4M3 {
                key: Quantized {
                    data: &bytes[3..],
                    scales: &scales[..]
                },
                value: fp8
            },
            &mut out
        )
        .is_err());
        let bad_table = [0i32, 3];
        let rows = [DecodeRow {
            row: 0,
            seq_len: 3,
            table: &bad_table,
        }];
        assert!(paged_decode_attention_kv(
            &q,
            KvCaches::Int8 { key: ok, value: ok },
            d,
            &rows,
            1.0,
            &mut out,
            1
        )
        .is_err());
        // Shapes whose product overflows are refused, not wrapped.
        let huge = AttentionDims {
            num_blocks: usize::MAX / 2,
            ..d
        };
        assert!(paged_decode_attention_kv(
            &q,
            KvCaches::Int8 { key: ok, value: ok },
            huge,
            &[],
            1.0,
            &mut out,
            1
        )
        .is_err());
    }

    #[test]
    fn float32_avx2_and_portable_builds_agree() {
        let d = AttentionDims {
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 72,
            block_size: 8,
            num_blocks: 9,
        };
        let mut rng = StdRng::seed_from_u64(5);
        let n = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
        let kc: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        let vc: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        let q: Vec<f32> = (0..d.num_heads * d.head_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let table = [8, 0, 4, 5, 1, 2, 7];
        let rows = [DecodeRow {
            row: 0,
            seq_len: 53,
            table: &table,
        }];
        let caches = KvCaches::F32 {
            key: &kc,
            value: &vc,
        };
        let mut out = vec![0f32; q.len()];
        paged_decode_attention_kv(&q, caches, d, &rows, 0.2, &mut out, 1).unwrap();
        let portable = attend_rows_with(Portable, &q, caches, d, &rows, 0.2, &LayerVariant::FULL);
        for (a, b) in out.iter().zip(&portable) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
