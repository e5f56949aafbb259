"""The running batch of the CPU engine for families whose cache is not keys/values alone: one native cache per row.

Owns: `RowCaches` (each request's own transformers cache object, as the model's forward builds it, and its token
count) and the model calls that grow it: `prefill` and `decode_step`, with `kv_batch`'s signatures. A row runs alone
(batch of one, no padding), so its logits are exactly those of a plain forward pass over its tokens, whatever the
cache holds: Gated DeltaNet's conv and recurrent states beside the full-attention keys/values (Qwen3-Next,
Qwen3.5), DeepSeek-V3.2's indexer keys beside the latent cache. `kv_batch` hands a model here when its family's
`cpu_engine_cache` (hpc_rl.models.registry) is "per_request"; the scheduler sees the same batch interface (`rows`,
`select`, `kv_batch.join`).

A vision model (Qwen3-VL, `vision.sees_images`) runs here too: a row's prefill passes its images (pixel values, patch
grids, `mm_token_type_ids`) and its multimodal rotary positions ([3, 1, len], the model's own `get_rope_index`), and
keeps the row's position offset (`rope_deltas`: image tokens advance the positions by less than their count) for
its decode steps, so interleaved requests never share the model's one cached `rope_deltas`.

Cost: one forward call per running request per step instead of one for the batch (the tiny models of tests and
CPU runs do not notice; a GPU engine is SGLang's, which batches these caches itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RowCaches:
    """Each row's (request's) own transformers cache, mutated in place by its forward calls, and token count."""

    caches: list[Any]
    lengths: list[int]
    rope_deltas: list[int] | None = None
    """Vision models: each row's M-RoPE offset (decode position = length + delta, on all three axes); else None."""

    @property
    def rows(self) -> int:
        return len(self.caches)

    def select(self, indices: list[int]) -> RowCaches:
        """The rows at `indices` (in that order)."""
        deltas = None if self.rope_deltas is None else [self.rope_deltas[i] for i in indices]
        return RowCaches(caches=[self.caches[i] for i in indices], lengths=[self.lengths[i] for i in indices],
                         rope_deltas=deltas)

    def trimmed(self) -> RowCaches:
        return self


def join(running: RowCaches | None, newcomers: RowCaches) -> RowCaches:
    """One batch with `running`'s rows first, then `newcomers`' rows."""
    if running is None or running.rows == 0:
        return newcomers
    if not isinstance(running, RowCaches) or not isinstance(newcomers, RowCaches):
        raise TypeError("kv_batch.join: a per-request batch (RowCaches) joins only another one")
    deltas = None
    if running.rope_deltas is not None or newcomers.rope_deltas is not None:
        deltas = (running.rope_deltas or [0] * running.rows) + (newcomers.rope_deltas or [0] * newcomers.rows)
    return RowCaches(caches=running.caches + newcomers.caches, lengths=running.lengths + newcomers.lengths,
                     rope_deltas=deltas)


def _forward(model: torch.nn.Module, input_ids: list[int], start: int, cache: Any, last_only: bool,
             positions: torch.Tensor | None = None, images: dict[str, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, Any]:
    """(logits [1 or len, V] in fp32, the cache) of `input_ids` at positions start.. on one row's cache (or at
    `positions`, a vision model's [3, 1, len]; `images`: its prefill's image inputs)."""
    if positions is None:
        positions = torch.arange(start, start + len(input_ids), dtype=torch.long).unsqueeze(0)
    out = model(input_ids=torch.tensor([input_ids], dtype=torch.long), position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0, **(images or {}))
    if out.past_key_values is None:
        raise RuntimeError(f"{type(model).__name__} returned no cache (use_cache=True): the CPU engine cannot "
                           "decode with it")
    return out.logits[0].float(), out.past_key_values


def vision_positions(model: torch.nn.Module, sequence: list[int], vision: Any
                     ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """A vision model's prefill of one row: its M-RoPE positions [3, 1, len], the row's rope delta and the image
    inputs its forward takes (none for a row without images)."""
    ids = torch.tensor([sequence], dtype=torch.long)
    image_token = int(model.config.image_token_id)
    token_types = (ids == image_token).to(torch.int) if vision is not None else torch.zeros_like(ids, dtype=torch.int)
    grid = vision.image_grid_thw if vision is not None else None
    positions, deltas = model.model.get_rope_index(ids, token_types, image_grid_thw=grid)
    images = {} if vision is None else {"pixel_values": vision.pixel_values, "image_grid_thw": grid,
                                        "mm_token_type_ids": token_types}
    return positions, int(deltas.view(-1)[0]), images


@torch.inference_mode()
def prefill(model: torch.nn.Module, sequences: list[list[int]], full_logits: bool = False,
            vision: list | None = None) -> tuple[RowCaches, torch.Tensor, list[torch.Tensor] | None]:
    """Run each sequence alone (on a fresh cache of the model's layer types); return their caches, last-position
    logits [B, V] and, with `full_logits`, each sequence's logits at every one of its positions [len, V].
    `vision`: each row's `vision.VisionInputs` or None (a vision model's rows take M-RoPE positions either way)."""
    from transformers import DynamicCache

    from hpc_rl.engines.cpu.vision import sees_images

    multimodal = sees_images(model)
    if not multimodal and vision is not None and any(v is not None for v in vision):
        raise ValueError(f"{type(model).__name__} has no vision tower: it cannot take images")
    caches, last, per_sequence, deltas = [], [], [], []
    for row, sequence in enumerate(sequences):
        positions, images = None, None
        if multimodal:
            positions, delta, images = vision_positions(model, list(sequence), vision[row] if vision else None)
            deltas.append(delta)
        logits, cache = _forward(model, list(sequence), 0, DynamicCache(config=model.config),
                                 last_only=not full_logits, positions=positions, images=images)
        caches.append(cache)
        last.append(logits[-1])
        per_sequence.append(logits)
    batch = RowCaches(caches=caches, lengths=[len(s) for s in sequences], rope_deltas=deltas if multimodal else None)
    return batch, torch.stack(last), per_sequence if full_logits else None


@torch.inference_mode()
def decode_step(model: torch.nn.Module, batch: RowCaches, tokens: torch.Tensor
                ) -> tuple[RowCaches, torch.Tensor]:
    """Feed one token per row ([B]), each row on its own cache; return the grown batch and next-token logits
    [B, V]."""
    logits, caches = [], []
    deltas = batch.rope_deltas
    for row, (token, cache, length) in enumerate(zip(tokens.tolist(), batch.caches, batch.lengths)):
        positions = None
        if deltas is not None:
            positions = torch.full((3, 1, 1), length + deltas[row], dtype=torch.long)
        row_logits, cache = _forward(model, [int(token)], length, cache, last_only=True, positions=positions)
        logits.append(row_logits[-1])
        caches.append(cache)
    return (RowCaches(caches=caches, lengths=[n + 1 for n in batch.lengths], rope_deltas=deltas),
            torch.stack(logits))
