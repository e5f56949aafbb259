"""The running batch of the CPU engine for families whose cache keeps more than keys/values: one batched cache.

Owns: `StateBatch` (transformers' own cache object for the whole running batch, with the [rows, time] mask of real
(1) vs left-padding (0) columns) and the model calls that grow it, `prefill` and `decode_step` with `kv_batch`'s
signatures, plus `select` (rows leave) and `join` (newcomers join). `kv_batch` hands a model here when its family's
`cpu_engine_cache` (hpc_rl.models.registry) is "batched_states".

What a cache layer holds, and how rows move (the layer kinds of transformers 5.x's `DynamicCache`):
- along time (grow by one column per step; left-padded on join, leading all-padding columns trimmed on select):
  attention `keys`/`values` [rows, heads, time, dim], DSA's `indexer_keys` [rows, time, dim] (DeepSeek-V3.2's
  lightning indexer scores its keys against them; the padding columns are masked out of its top-k by the mask);
- fixed size per request (a row each; joined by concatenation, never padded): Gated DeltaNet's `conv_states`
  [rows, channels, kernel] and `recurrent_states` [rows, heads, k_dim, v_dim] (Qwen3-Next, Qwen3.5).
SGLang keeps the fixed-size states the same way in spirit (`mem_cache/memory_pool.MambaPool`: per layer one tensor
with a slot per request, `size + 1` slots, allocated at admission and freed at finish, gathered by slot index for a
decode batch); here a request's slot is its row, moved by `index_select`/`cat` as rows leave and join.

Left padding is exact for these layers: transformers zeroes a padding position's hidden state before a linear
layer (`apply_mask_to_padding_states`), so its projections are zero, the convolution sees the zeros a fresh state
holds, and the delta rule adds nothing to a zero state (its key and value are zero); the attention layers mask the
padding columns. A row's logits equal a plain forward pass over its tokens within float tolerance
(tests/unit/test_engine_hybrid_caches.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

_TIME_ATTRS = (("keys", -2), ("values", -2), ("indexer_keys", 1))
"""Cache-layer tensors along time, with their time dimension."""
_STATE_DICTS = ("conv_states", "recurrent_states")
"""Cache-layer dicts (state index -> tensor or None) of fixed-size per-request states."""


@dataclass
class StateBatch:
    """transformers' cache for the running rows and the [rows, time] mask of real vs padding columns."""

    cache: Any
    mask: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def select(self, indices: list[int]) -> StateBatch:
        """The rows at `indices` (in that order), with now-unused leading columns trimmed."""
        index = torch.tensor(indices, dtype=torch.long)
        mask = self.mask.index_select(0, index)
        start = first_used_column(mask)
        return StateBatch(cache=_map_cache(self.cache, lambda t, dim: _trim(t.index_select(0, index), dim, start),
                                           lambda t: t.index_select(0, index)),
                          mask=mask[:, start:].contiguous())

    def trimmed(self) -> StateBatch:
        return self.select(list(range(self.rows)))


def _trim(tensor: torch.Tensor, dim: int, start: int) -> torch.Tensor:
    return tensor.narrow(dim, start, tensor.shape[dim] - start).contiguous() if start else tensor


def first_used_column(mask: torch.Tensor) -> int:
    """The first column of a [rows, time] mask some row still uses (its width when none does): the leading columns
    before it are padding every row has left (also `kv_batch`'s)."""
    used = mask.any(dim=0).nonzero()
    return int(used[0]) if used.numel() else mask.shape[1]


def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`tensor` with zeros in front along `dim` up to `length` (also `kv_batch`'s)."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _check_layer(layer: Any) -> None:
    if getattr(layer, "indexer_position_ids", None) is not None:
        raise RuntimeError(f"the CPU engine's state batch does not move {type(layer).__name__}.indexer_position_ids "
                           "(a model whose indexer caches positions): serve it with cpu_engine_cache='per_request'")


def _map_cache(cache: Any, along_time, per_row, other: Any | None = None) -> Any:
    """A shallow copy of `cache` whose layers' tensors are `along_time(tensor, time_dim)` / `per_row(tensor)`, or,
    with `other`, `along_time(tensor, other_tensor, time_dim)` / `per_row(tensor, other_tensor)` pairwise."""
    result = copy.copy(cache)
    result.layers = []
    for number, layer in enumerate(cache.layers):
        _check_layer(layer)
        twin = None if other is None else other.layers[number]
        new = copy.copy(layer)
        for name, dim in _TIME_ATTRS:
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                setattr(new, name, along_time(tensor, dim) if twin is None
                        else along_time(tensor, getattr(twin, name), dim))
        for name in _STATE_DICTS:
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                setattr(new, name, {key: None if value is None else
                                    (per_row(value) if twin is None else per_row(value, getattr(twin, name)[key]))
                                    for key, value in states.items()})
        result.layers.append(new)
    return result


def join(running: StateBatch | None, newcomers: StateBatch) -> StateBatch:
    """One batch with `running`'s rows first, then `newcomers`' rows (time tensors left-padded to one length)."""
    if running is None or running.rows == 0:
        return newcomers
    if not isinstance(running, StateBatch) or not isinstance(newcomers, StateBatch):
        raise TypeError("kv_batch.join: a state batch (StateBatch) joins only another one")
    length = max(running.mask.shape[1], newcomers.mask.shape[1])
    cache = _map_cache(running.cache,
                       lambda a, b, dim: torch.cat([left_pad(a, length, dim), left_pad(b, length, dim)]),
                       lambda a, b: torch.cat([a, b]), other=newcomers.cache)
    return StateBatch(cache=cache, mask=torch.cat([left_pad(running.mask, length, 1),
                                                   left_pad(newcomers.mask, length, 1)]))


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             cache: Any, last_only: bool) -> torch.Tensor:
    """Logits [rows, 1 or length, V] in fp32 of one cached forward call over left-padded rows; grows `cache`."""
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1 if last_only else 0)
    if out.past_key_values is not cache:
        raise RuntimeError(f"{type(model).__name__} did not grow the cache it was given: the CPU engine's state "
                           "batch cannot decode with it (serve it with cpu_engine_cache='per_request')")
    return out.logits.float()


@torch.inference_mode()
def prefill(model: torch.nn.Module, sequences: list[list[int]], full_logits: bool = False
            ) -> tuple[StateBatch, torch.Tensor, list[torch.Tensor] | None]:
    """Run the sequences together (left-padded) on a fresh cache of the model's layer types; return the batch,
    last-position logits [B, V] and, with `full_logits`, each sequence's logits at every one of its positions."""
    from transformers import DynamicCache

    length = max(len(sequence) for sequence in sequences)
    input_ids = torch.tensor([[0] * (length - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = _forward(model, input_ids, mask, positions, cache, last_only=not full_logits)
    per_sequence = None
    if full_logits:
        per_sequence = [logits[row, length - len(s):] for row, s in enumerate(sequences)]
    return StateBatch(cache=cache, mask=mask), logits[:, -1], per_sequence


@torch.inference_mode()
def decode_step(model: torch.nn.Module, batch: StateBatch, tokens: torch.Tensor) -> tuple[StateBatch, torch.Tensor]:
    """Feed one token per row ([B]) in one forward call; return the grown batch and next-token logits [B, V]."""
    positions = batch.mask.sum(dim=1, keepdim=True)
    mask = torch.cat([batch.mask, torch.ones(batch.rows, 1, dtype=batch.mask.dtype)], dim=1)
    logits = _forward(model, tokens.view(-1, 1), mask, positions, batch.cache, last_only=True)
    return StateBatch(cache=batch.cache, mask=mask), logits[:, -1]
