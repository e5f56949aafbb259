"""Dynamic batch size: pack samples into micro-batches by tokens and balance them over DP ranks.

Owns (pure functions on sample lengths, no torch):
  * :func:`pack_microbatches` - first-fit packing in the given order, cap ``max_tokens_per_gpu * cp``;
    an over-long sample gets a bin of its own and is never truncated.
  * :func:`equalize_microbatch_count` - split the largest multi-sample bins until there are
    ``target`` bins (every DP rank must run the same number of micro-batches).
  * :func:`balanced_partitions` - Karmarkar-Karp (largest differencing method) k-way partition,
    optionally with equal item counts (slime's ``get_seqlen_balanced_partitions``).
  * :func:`flops_balanced_microbatches` - slime's --balance-by-flops: as many bins as the token cap
    needs, filled by Karmarkar-Karp on each sample's forward cost ``c * L + L^2`` (attention's quadratic
    term), so long and short samples share the work evenly; the cap is not enforced (slime's warning).
  * :func:`schedule_microbatches` - the three together: pack a step's samples, round the bin count
    up to a multiple of ``dp_size``, assign bins to ranks (KK with ``balance_data``, else round robin).

Does not own: moving the data, CP slicing, or the loss scale (``losses.step_loss_scale``: the
micro-batching never changes the loss).

slime's order of operations (pack-first, distribute-second) is followed: first-fit runs on the
samples in their given order (not sorted: "first-fit", not "first-fit decreasing"), which is what
``first_fit_pack`` in slime's seqlen_balancing does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = [
    "balanced_partitions",
    "flops_balanced_microbatches",
    "flops_linear_coefficient",
    "equalize_microbatch_count",
    "microbatch_target_count",
    "pack_microbatches",
    "schedule_microbatches",
]


def pack_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit: each sample (in order) goes to the first bin whose token sum stays <= max_tokens,
    else opens a new bin. Returns bins of sample indices (each bin in increasing index order).

    A sample longer than ``max_tokens`` opens a bin alone and nothing else joins it (never
    truncated). Pass ``max_tokens = max_tokens_per_gpu * cp_size``.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    bins: list[list[int]] = []
    sums: list[int] = []
    for idx, n in enumerate(lengths):
        for b, s in enumerate(sums):
            if s + n <= max_tokens:
                bins[b].append(idx)
                sums[b] = s + n
                break
        else:
            bins.append([idx])
            sums.append(n)
    return bins


def _halve_by_tokens(bin_: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split one bin in two with near-equal token sums: longest first, each to the lighter half."""
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]
    for idx in sorted(bin_, key=lambda i: -lengths[i]):
        h = 0 if sums[0] <= sums[1] else 1
        halves[h].append(idx)
        sums[h] += lengths[idx]
    return sorted(halves[0]), sorted(halves[1])


def equalize_microbatch_count(
    bins: Sequence[Sequence[int]], target: int, lengths: Sequence[int]
) -> list[list[int]]:
    """Grow ``bins`` to exactly ``target`` by repeatedly halving the bin with the most tokens that
    holds >= 2 samples (ties: the later bin, as slime). Halves never exceed the original bin, so the
    token cap still holds. Returns a new list; raises ValueError if there are fewer samples than
    ``target`` (slime asserts the same) or ``target`` < len(bins).
    """
    out = [list(b) for b in bins]
    if target < len(out):
        raise ValueError(f"cannot shrink {len(out)} micro-batches to {target}")
    while len(out) < target:
        best, best_tokens = -1, -1
        for i, b in enumerate(out):
            if len(b) > 1:
                tokens = sum(lengths[j] for j in b)
                if tokens >= best_tokens:
                    best, best_tokens = i, tokens
        if best < 0:
            raise ValueError(
                f"need {target} micro-batches but only {sum(len(b) for b in out)} samples: every DP rank "
                "needs at least one sample; lower the DP size or raise the batch size"
            )
        left, right = _halve_by_tokens(out[best], lengths)
        out[best] = left
        out.append(right)
    return out


class _Part:
    """One partition under construction: token sum and (length, index) items."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.total = 0
        self.items: list[tuple[int, int]] = []  # (index, length)

    def key(self) -> tuple[int, int, list[tuple[int, int]]]:
        return (self.total, len(self.items), self.items)


class _State:
    """k partitions kept heaviest-first; the heap pops the state with the largest spread first."""

    __slots__ = ("parts", "spread")

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = sorted(parts, key=_Part.key, reverse=True)
        self.spread = self.parts[0].total - self.parts[-1].total
        """Heaviest minus lightest sum, kept (the heap compares it ~25 times per item)."""

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0].key() > other.parts[0].key()

    def absorb(self, other: _State) -> None:
        """Differencing step: heaviest of one with lightest of the other, and so on."""
        k = len(self.parts)
        for i in range(k):
            mine, theirs = self.parts[i], other.parts[k - 1 - i]
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self.parts.sort(key=_Part.key, reverse=True)
        self.spread = self.parts[0].total - self.parts[-1].total


def balanced_partitions(lengths: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Karmarkar-Karp (largest differencing method) k-way partition of ``lengths`` by sum.

    Items are sorted ascending by (length, index). Without ``equal_size`` every item starts as a
    state with one non-empty partition; with it, each consecutive run of k sorted items becomes one
    state with one item per partition (so every partition ends with len/k items; needs
    len % k == 0). Repeatedly the two states with the largest spread (max - min sum) are merged,
    pairing the heaviest partition of one with the lightest of the other. Returns k lists of
    indices, each sorted, partitions ordered heaviest first; every index appears exactly once.
    Matches slime's ``get_seqlen_balanced_partitions`` (which it took from verl).
    """
    n = len(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} items into {k} non-empty partitions")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(lengths) divisible by k: {n} % {k} != 0")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    heap: list[_State] = []
    groups = [order[s : s + k] for s in range(0, n, k)] if equal_size else [[i] for i in order]
    for group in groups:
        parts = [_Part() for _ in range(k)]
        for part, idx in zip(parts, group, strict=False):
            part.items.append((idx, lengths[idx]))
            part.total += lengths[idx]
        heapq.heappush(heap, _State(parts))
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    result = [sorted(idx for idx, _ in part.items) for part in heap[0].parts]
    if any(not p for p in result):
        raise AssertionError("Karmarkar-Karp produced an empty partition")  # impossible for n >= k
    return result


def flops_linear_coefficient(*, hidden_size: int, num_attention_heads: int, num_query_groups: int,
                             kv_channels: int, ffn_hidden_size: int, swiglu: bool = True) -> float:
    """c of a sample's forward cost c * L + L^2 (per layer, up to a constant factor): the per-token FLOPs of
    the linear layers (QKV, output projection, MLP) over the per-token-pair FLOPs of attention (QK^T and AV)."""
    q, kv = num_attention_heads * kv_channels, num_query_groups * kv_channels
    linear = 2 * (hidden_size * (q + 2 * kv) + q * hidden_size + (3 if swiglu else 2) * hidden_size * ffn_hidden_size)
    quadratic = 4 * q
    return linear / quadratic


def flops_balanced_microbatches(lengths: Sequence[int], max_tokens: int, linear_coefficient: float) -> list[list[int]]:
    """ceil(total tokens / max_tokens) micro-batches (one per sample when that is more), balanced by
    Karmarkar-Karp on c * L + L^2; each bin's indices sorted."""
    count = max(1, math.ceil(sum(lengths) / max_tokens))
    if count >= len(lengths):
        return [[i] for i in range(len(lengths))]
    workloads = [linear_coefficient * length + length * length for length in lengths]
    return [sorted(part) for part in balanced_partitions(workloads, count, equal_size=False)]


def microbatch_target_count(num_bins: int, dp_size: int) -> int:
    """Bins needed so every DP rank runs the same count: num_bins rounded up to a multiple of
    dp_size, at least dp_size."""
    return max(math.ceil(num_bins / dp_size), 1) * dp_size


def schedule_microbatches(
    lengths: Sequence[int], max_tokens: int, dp_size: int, *, balance_data: bool = True
) -> list[list[list[int]]]:
    """One training step's dynamic-batch schedule: ``result[rank]`` = that rank's micro-batches
    (lists of indices into ``lengths``), the same count on every rank.

    pack_microbatches -> equalize_microbatch_count to a multiple of dp_size -> assign bins to ranks:
    with ``balance_data`` by Karmarkar-Karp on bin token sums with equal counts, else bin j goes to
    rank j % dp_size. Each rank's micro-batches are ordered by their smallest sample index.
    """
    bins = pack_microbatches(lengths, max_tokens)
    bins = equalize_microbatch_count(bins, microbatch_target_count(len(bins), dp_size), lengths)
    if balance_data:
        ranks = balanced_partitions([sum(lengths[i] for i in b) for b in bins], dp_size, equal_size=True)
    else:
        ranks = [list(range(r, len(bins), dp_size)) for r in range(dp_size)]
    return [sorted((bins[j] for j in rank), key=lambda b: b[0]) for rank in ranks]
