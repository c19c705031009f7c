"""Row-wise building blocks of the sampler: a few passes over ``[R, V]`` rows, never a sort.

Everything here works on *weights* ``e`` (``[R, V]`` float32, ``>= 0``, finite): the
unnormalized probabilities ``exp(logit / T - max)`` of one row per request, 0 on masked tokens.

* :func:`blocked_draw` — the inverse CDF in two small steps: per-chunk sums of a row (one read
  of ``e``), the chunk holding ``u * total``, then a cumulative sum inside that chunk only.
* :func:`mass_and_count_above` — for a drawn token ``t``: the mass and the number of tokens
  strictly more likely than ``t`` (a subtraction, ``relu``, ``sign`` and two sums). This is the
  nucleus / top-k membership test of the rejection step.
* :func:`radix_threshold` — the exact top-p / top-k boundary without sorting: the largest value
  ``θ`` with ``W(e >= θ) >= target`` (``W`` = mass or count), found by a radix select on the
  float bits (``e >= 0``, so its int32 bit pattern orders like the value): three histogram
  passes (11 + 10 + 10 bits), each narrowing to the bin that holds the boundary. Flat rows
  (every token in one bin) are no worse than peaked ones.
* :func:`topk` — ``torch.topk`` for small k from the chunks with the largest maxima (one read
  of the row instead of a selection over all of it).
* :func:`mask_below_` — zero the weights under a per-row threshold (a compare into a float
  buffer and a multiply: on the CPU ``masked_fill_`` / ``where`` with a bool mask cost more).
* :class:`Workspace` — the ``[R, V]`` scratch buffers, kept between steps on the CPU: a fresh
  large tensor costs more in page faults there than the passes that fill it.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = [
    "CHUNK",
    "Workspace",
    "blocked_draw",
    "chunk_sums",
    "mask_below_",
    "mass_and_count_above",
    "radix_threshold",
    "row_sums",
    "topk",
]

# Tokens per chunk of the blocked inverse CDF: small enough that the work on the chosen chunk
# (gather, cumulative sum, search) is negligible, large enough that the per-row chunk table stays
# small.
CHUNK = 256

# Radix select: (shift, width) of the three digits of a non-negative float32's 31 value bits.
_RADIX_LEVELS = ((20, 11), (10, 10), (0, 10))
# Rows per radix block: a block's int64 index buffer stays near 32 MB on the CPU; on a GPU,
# where each block costs a few dozen kernel launches, 256 x 49152 fits in one block (128 MB).
_RADIX_BLOCK_ELEMS = 1 << 22
_RADIX_BLOCK_ELEMS_GPU = 1 << 24


class Workspace:
    """Reusable scratch buffers on the CPU; plain allocations elsewhere (the CUDA caching
    allocator already reuses memory). Not shared between threads: :meth:`acquire` hands a
    caller either this workspace or, while another thread holds it, a throwaway one."""

    def __init__(self, cache: bool = True) -> None:
        self._cache = cache
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._lock = threading.Lock()

    def acquire(self) -> Workspace:
        return self if self._lock.acquire(blocking=False) else Workspace(cache=False)

    def release(self) -> None:
        if self._cache:
            self._lock.release()

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` (contents undefined) that stays valid until the next call for
        the same ``name`` and ``dtype``."""
        if device.type != "cpu" or not self._cache:
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        key = (name, dtype)
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < numel:
            flat = self._buffers[key] = torch.empty(numel, dtype=dtype)
        return flat[:numel].view(shape)

    def zeros(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor that is all zero when handed out; the caller must leave it all zero
        (write sparsely, then reset what it wrote). Fresh on other devices and in throwaway
        workspaces."""
        if device.type != "cpu" or not self._cache:
            return torch.zeros(numel, dtype=dtype, device=device)
        key = ("zeros:" + name, dtype)
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < numel:
            flat = self._buffers[key] = torch.zeros(numel, dtype=dtype)
        return flat[:numel]


def chunk_sums(e: torch.Tensor) -> torch.Tensor:
    """``e`` [R, V] -> [R, ceil(V / CHUNK)] sums of consecutive ``CHUNK``-token slices."""
    rows, vocab = e.shape
    full = vocab // CHUNK
    parts = []
    if full:
        parts.append(e[:, : full * CHUNK].view(rows, full, CHUNK).sum(dim=-1))
    if vocab > full * CHUNK:
        parts.append(e[:, full * CHUNK :].sum(dim=-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def row_sums(e: torch.Tensor) -> torch.Tensor:
    """``e`` [R, V] -> [R] sums, rounded the same way whatever ``R`` is.

    ``e.sum(-1)`` of a lone row is split across threads (so its rounding differs from the same
    row's sum inside a batch); chunk sums then a short sum over the chunks are not. Decisions
    taken on these sums (the rejection test) therefore never depend on the batch.
    """
    return chunk_sums(e).sum(dim=-1)


def _below(total: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(total, torch.zeros_like(total))


def blocked_draw(
    e: torch.Tensor,
    uniform: torch.Tensor,
    sums: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row with probability ``e[r, i] / sum(e[r])``: the first token whose
    cumulative weight exceeds ``uniform[r] * sum(e[r])``.

    ``e`` [N, V] (not modified); ``rows`` [R] the rows of ``e`` to draw for (default: all);
    ``uniform`` [R] in [0, 1); ``sums`` those rows' :func:`chunk_sums` if the caller has them.
    The chunk is found on the per-chunk cumulative sums, the token by a cumulative sum of that
    chunk alone; both searches land on positive weights because a cumulative sum is flat across
    zeros and the targets are clamped below the totals.
    """
    vocab = e.shape[1]
    if sums is None:
        sums = chunk_sums(e if rows is None else e.index_select(0, rows))
    cdf = sums.cumsum(dim=-1)  # [R, C]
    total = cdf[:, -1:]
    target = torch.minimum(uniform.unsqueeze(1) * total, _below(total))
    chunk = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [R, 1]
    # Mass of the chunks before the chosen one: the very cdf entry the search compared with.
    before = torch.cat([torch.zeros_like(total), cdf[:, :-1]], dim=1).gather(1, chunk)
    offsets = torch.arange(CHUNK, device=e.device)
    positions = chunk * CHUNK + offsets  # [R, CHUNK]
    clamped = positions.clamp(max=vocab - 1)
    values = e.gather(1, clamped) if rows is None else e[rows.unsqueeze(1), clamped]
    if vocab % CHUNK:
        values = values.masked_fill(positions >= vocab, 0.0)  # the short last chunk
    local = values.cumsum(dim=-1)
    local_total = local[:, -1:]
    local_target = torch.minimum((target - before).clamp_(min=0.0), _below(local_total))
    index = torch.searchsorted(local, local_target, right=True).clamp_(max=CHUNK - 1)
    return (chunk * CHUNK + index).squeeze(1)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` (values descending, their indices) for small ``k``, about one
    read of ``x`` instead of a selection over every element.

    The per-chunk maxima (32- or 64-token chunks) are one pass; the ``k`` chunks with the largest
    maxima hold every value above the k-th largest (at most ``k - 1`` tokens are above it, so at
    most ``k - 1`` chunks have a larger maximum) and enough values equal to it, so ``torch.topk``
    over those chunks (plus the short tail chunk, whole) returns the same values. Among tokens
    tied at the k-th value, which ones are returned is arbitrary (as with ``torch.topk``).
    """
    rows, vocab = x.shape
    width = 64 if k <= 16 else 32
    full = vocab // width
    if k * width * 4 > vocab or full < k or not x.is_contiguous():
        return x.topk(k, dim=-1)
    maxima = x[:, : full * width].view(rows, full, width).amax(dim=-1)
    chunks = maxima.topk(k, dim=-1).indices  # [R, k]
    positions = (chunks.unsqueeze(-1) * width + torch.arange(width, device=x.device)).view(rows, -1)
    if vocab > full * width:
        tail = torch.arange(full * width, vocab, device=x.device).expand(rows, -1)
        positions = torch.cat([positions, tail], dim=1)
    values, picked = x.gather(1, positions).topk(k, dim=-1)
    return values, positions.gather(1, picked)


def mass_and_count_above(
    e: torch.Tensor, token_weight: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the mass and the number of tokens with weight strictly above ``token_weight``.

    ``e`` [R, V], ``token_weight`` [R, 1], ``scratch`` [R, V] float32 (overwritten; may be
    ``e`` itself when the caller no longer needs it). ``sum((e - w)+) + w * #(e > w)`` is the
    mass above ``w``; ``sign`` of the same ``(e - w)+`` counts those tokens. ``x != y`` implies
    ``x - y != 0`` in IEEE arithmetic, so no token strictly above is lost to rounding.
    """
    diff = torch.sub(e, token_weight, out=scratch).relu_()
    excess = row_sums(diff)
    count = row_sums(diff.sign_())
    return excess + token_weight.squeeze(1) * count, count


def mask_below_(e: torch.Tensor, threshold: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """In place: ``e[r, i] = 0`` where ``e[r, i] < threshold[r]`` (ties kept). ``threshold``
    [R, 1]; ``scratch`` [R, V] float32, overwritten."""
    keep = torch.ge(e, threshold, out=scratch)
    return e.mul_(keep)


def radix_threshold(
    e: torch.Tensor,
    rows: torch.Tensor,
    value: torch.Tensor,
    *,
    by_mass: bool,
    workspace: Workspace,
) -> torch.Tensor:
    """For each row ``r`` of ``rows``: the largest float ``θ`` with ``W(e[r] >= θ) >= target``.

    ``by_mass``: ``W`` is the weight (top-p: ``target = value[j] * sum(e[r])``), otherwise the
    number of tokens (top-k: ``target = value[j]``). Keeping ``e >= θ`` then keeps exactly the
    tokens whose strictly-more-likely mass is below the target (top-p), or whose number of
    strictly larger tokens is below k (top-k), ties with the boundary included.

    ``e`` [N, V] float32 >= 0; ``rows`` [R] int64 indices into ``e``; ``value`` [R] float.
    Returns [R] float32. Works on blocks of rows (each copied once, to float64 when weighing by
    mass: float32 histogram bins summing ~50k weights would be too coarse for the boundary).
    """
    num_rows = rows.numel()
    vocab = e.shape[1]
    device = e.device
    out = torch.empty(num_rows, dtype=torch.float32, device=device)
    elems = _RADIX_BLOCK_ELEMS if device.type == "cpu" else _RADIX_BLOCK_ELEMS_GPU
    block = max(1, min(num_rows, elems // vocab))
    ones = torch.ones((), dtype=torch.float64, device=device)
    for start in range(0, num_rows, block):
        stop = min(num_rows, start + block)
        n = stop - start
        values = torch.index_select(
            e, 0, rows[start:stop], out=workspace.buffer("radix_values", (n, vocab), torch.float32, device)
        )
        keys = values.view(torch.int32)  # >= 0 and ordered like the values
        if by_mass:
            weights = workspace.buffer("radix_weights", (n, vocab), torch.float64, device)
            weights.copy_(values)
        else:
            weights = ones.expand(n, vocab)
        digits = workspace.buffer("radix_digits", (n, vocab), torch.int32, device)
        index = workspace.buffer("radix_index", (n, vocab), torch.int64, device)
        target = value[start:stop].to(torch.float64)
        prefix = torch.zeros(n, dtype=torch.int64, device=device)
        above = torch.zeros(n, dtype=torch.float64, device=device)
        for level, (shift, width) in enumerate(_RADIX_LEVELS):
            bins = 1 << width
            torch.bitwise_right_shift(keys, shift, out=digits)
            if level == 0:
                first, num_bins = 0, bins  # every key is in range: key >> 20 < 2048
            else:
                # Keys of the chosen bin map to 1..bins; keys below it to 0, above it to bins + 1.
                digits.sub_(((prefix << width) - 1).to(torch.int32).unsqueeze(1)).clamp_(0, bins + 1)
                first, num_bins = 1, bins + 2
            index.copy_(digits)
            hist = torch.zeros(n, num_bins, dtype=torch.float64, device=device)
            hist.scatter_add_(1, index, weights)
            hist = hist[:, first : first + bins]
            if level == 0 and by_mass:
                target = target * hist.sum(dim=-1)
            # at_least[d]: weight of the keys >= digit d (plus everything above the bin).
            at_least = hist.flip(-1).cumsum(-1).flip(-1) + above.unsqueeze(1)
            digit = (at_least >= target.unsqueeze(1)).sum(dim=-1) - 1
            # Rounding can leave even the whole bin short of the target: keep all of it.
            lowest = (hist > 0).to(torch.int8).argmax(dim=-1)
            digit = torch.where(digit < 0, lowest, digit)
            above = torch.cat([at_least, above.unsqueeze(1)], dim=1).gather(1, (digit + 1).unsqueeze(1)).squeeze(1)
            prefix = (prefix << width) | digit
        out[start:stop] = prefix.to(torch.int32).view(torch.float32)
    return out
