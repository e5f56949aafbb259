"""The running batch's KV cache for the CPU engine: prefill, one decode step, join, leave.

Owns: a left-padded, batched KV cache over a transformers causal LM (one tensor per layer for
keys and values, [rows, kv_heads, time, head_dim]) with its attention mask, and the model calls
that grow it. Rows are requests; the scheduler decides which rows exist. No sampling, no HTTP.

The model is the engine's own Qwen3 (`native_qwen3`) or any transformers causal LM (`_forward`
calls either the same way).

Continuous batching: newcomers are prefilled together (left-padded), then their cache is joined
to the running one by padding the shorter cache on the left; finished rows are dropped by
index; columns that no row uses any more are trimmed. Position ids are per row (count of real
tokens), so padding never shifts RoPE, and masked columns add exactly zero attention weight: a
row's logits equal an unpadded forward pass of the same tokens within float tolerance.

A family whose transformers cache is not keys/values alone (linear-attention states, DSA index keys) says so in its
registry entry: `cpu_engine_cache="batched_states"` hands it to `state_batch` (transformers' own cache, batched),
"per_request" to `row_caches` (one request per forward); `decode_step` and `join` follow the batch's type; a model
that returns such a cache without saying so is refused by name.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hpc_rl.engines.cpu import row_caches, state_batch
from hpc_rl.engines.cpu.state_batch import left_pad
from hpc_rl.engines.cpu.native_qwen3 import NativeQwen3ForCausalLM
from hpc_rl.models.registry import family_for_hf_model_type


@dataclass
class KvBatch:
    """Keys/values per layer and the [rows, time] mask of real (1) vs padding (0) columns."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def select(self, indices: list[int]) -> KvBatch:
        """The rows at `indices` (in that order), with now-unused leading columns trimmed."""
        index = torch.tensor(indices, dtype=torch.long)
        batch = KvBatch(
            keys=[k.index_select(0, index) for k in self.keys],
            values=[v.index_select(0, index) for v in self.values],
            mask=self.mask.index_select(0, index),
        )
        return batch.trimmed()

    def trimmed(self) -> KvBatch:
        start = state_batch.first_used_column(self.mask)
        if start == 0:
            return self
        return KvBatch(
            keys=[k[:, :, start:].contiguous() for k in self.keys],
            values=[v[:, :, start:].contiguous() for v in self.values],
            mask=self.mask[:, start:].contiguous(),
        )


def cache_kind(model: torch.nn.Module) -> str:
    """"batched" (this module's KvBatch), "batched_states" (`state_batch`) or "per_request" (`row_caches`): the
    model's family's `cpu_engine_cache`
    (batched for the engine's own Qwen3 and for a model type no family reads)."""
    if isinstance(model, NativeQwen3ForCausalLM):
        return "batched"
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        return "per_request"  # a vision model's M-RoPE positions and image inputs are per request (row_caches)
    found = family_for_hf_model_type(getattr(getattr(model, "config", None), "model_type", None))
    return found.cpu_engine_cache if found is not None else "batched"


_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose cache `_refuse_non_kv_cache` found to be keys/values only (checked once per model)."""


AnyBatch = KvBatch | row_caches.RowCaches | state_batch.StateBatch
"""The running batch of any cache kind (`cache_kind`)."""


def join(running: AnyBatch | None, newcomers: AnyBatch) -> AnyBatch:
    """One batch with `running`'s rows first, then `newcomers`' rows."""
    if running is None or running.rows == 0:
        return newcomers
    if isinstance(newcomers, state_batch.StateBatch):
        return state_batch.join(running, newcomers)
    if isinstance(newcomers, row_caches.RowCaches):
        return row_caches.join(running, newcomers)
    length = max(running.mask.shape[1], newcomers.mask.shape[1])
    return KvBatch(
        keys=[torch.cat([left_pad(a, length, 2), left_pad(b, length, 2)]) for a, b in
              zip(running.keys, newcomers.keys)],
        values=[torch.cat([left_pad(a, length, 2), left_pad(b, length, 2)]) for a, b in
                zip(running.values, newcomers.values)],
        mask=torch.cat([left_pad(running.mask, length, 1), left_pad(newcomers.mask, length, 1)]),
    )


_KV_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
"""transformers' cache layers that hold keys and values only (a sliding window's are kept whole here)."""


def _refuse_non_kv_cache(model: torch.nn.Module) -> None:
    """A clear error, before the forward, for a model whose transformers cache keeps more than keys and values
    (linear-attention states, indexer keys) when its family did not ask for `row_caches`."""
    from transformers import DynamicCache

    if model in _CHECKED:
        return
    try:
        kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    except Exception:  # noqa: BLE001 - a config transformers' cache cannot read: the forward decides
        return
    odd = sorted(kinds - set(_KV_LAYERS))
    if odd:
        raise RuntimeError(
            f"the CPU engine's key/value batch cannot hold {type(model).__name__}'s cache (its {', '.join(odd)} "
            f"layers keep more than keys and values): set cpu_engine_cache='batched_states' (or 'per_request') in the "
            f"registry entry of "
            f"model_type {getattr(model.config, 'model_type', None)!r} (hpc_rl/models/<family>/__init__.py)")
    _CHECKED.add(model)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             past: KvBatch | None, last_only: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(logits [rows, 1 or length, V], keys, values) of one cached forward call over left-padded rows."""
    past_pairs = None if past is None else list(zip(past.keys, past.values))
    if isinstance(model, NativeQwen3ForCausalLM):
        return model.forward_cached(input_ids, positions, mask, past_pairs, last_only)
    from transformers import DynamicCache

    if past_pairs is None:
        _refuse_non_kv_cache(model)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=DynamicCache() if past_pairs is None else DynamicCache(ddp_cache_data=past_pairs),
                use_cache=True, logits_to_keep=1 if last_only else 0)
    layers = out.past_key_values.layers
    return out.logits, [layer.keys for layer in layers], [layer.values for layer in layers]


def distinct_sequences(sequences: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct sequences in order of first appearance, and the position of each sequence among them."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(seq), len(first)) for seq in sequences]
    return [list(seq) for seq in first], rows


@torch.inference_mode()
def prefill(
    model: torch.nn.Module, sequences: list[list[int]], full_logits: bool = False, vision: list | None = None,
    share_repeats: bool = False,
) -> tuple[KvBatch, torch.Tensor, list[torch.Tensor] | None]:
    """Run the sequences (left-padded together); return their cache, last-position logits [B, V]
    and, with `full_logits`, each sequence's logits at every one of its positions [len, V]. A family with
    `cpu_engine_cache="batched_states"` runs in `state_batch`, "per_request" in `row_caches` (the same return); a
    vision model (`vision`: each row's images or None) is a "per_request" family.

    `share_repeats` (a key/value batch only): a sequence that occurs more than once (a GRPO group's samples share
    their prompt) is run through the model once and its rows copied, as SGLang's prefix cache serves a group's
    prompt once. Only where every row of a sequence runs the same model (no per-row LoRA adapter) and nothing
    records per-row activations (routed experts): the scheduler decides. 128 samples of 16 prompts x 7 tokens
    (the tiny run): 4.2 ms -> 0.8 ms."""
    kind = cache_kind(model)
    if kind == "per_request":
        return row_caches.prefill(model, sequences, full_logits, vision=vision)
    if vision is not None and any(v is not None for v in vision):
        raise ValueError(f"{type(model).__name__} has no vision tower: it cannot take images")
    if kind == "batched_states":
        return state_batch.prefill(model, sequences, full_logits)
    distinct, rows = distinct_sequences(sequences) if share_repeats else (sequences, [])
    if len(distinct) < len(sequences):  # a GRPO group's samples share their prompt: each one is run once
        batch, last, per_distinct = prefill(model, distinct, full_logits)
        index = torch.tensor(rows, dtype=torch.long)
        expanded = KvBatch(keys=[k.index_select(0, index) for k in batch.keys],
                           values=[v.index_select(0, index) for v in batch.values], mask=batch.mask.index_select(0, index))
        return expanded, last.index_select(0, index), None if per_distinct is None else [per_distinct[r] for r in rows]
    length = max(len(seq) for seq in sequences)
    pad_id = 0
    input_ids = torch.tensor([[pad_id] * (length - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits, keys, values = _forward(model, input_ids, mask, positions, None, last_only=not full_logits)
    logits = logits.float()
    per_sequence = None
    if full_logits:
        per_sequence = [logits[row, length - len(seq):] for row, seq in enumerate(sequences)]
    return KvBatch(keys=keys, values=values, mask=mask), logits[:, -1], per_sequence


@torch.inference_mode()
def decode_step(model: torch.nn.Module, batch: AnyBatch, tokens: torch.Tensor) -> tuple[AnyBatch, torch.Tensor]:
    """Feed one token per row ([B]); return the grown batch and next-token logits [B, V]."""
    if isinstance(batch, state_batch.StateBatch):
        return state_batch.decode_step(model, batch, tokens)
    if isinstance(batch, row_caches.RowCaches):
        return row_caches.decode_step(model, batch, tokens)
    positions = batch.mask.sum(dim=1, keepdim=True)
    mask = torch.cat([batch.mask, torch.ones(batch.rows, 1, dtype=batch.mask.dtype)], dim=1)
    logits, keys, values = _forward(model, tokens.view(-1, 1), mask, positions, batch, last_only=True)
    return KvBatch(keys=keys, values=values, mask=mask), logits[:, -1].float()
