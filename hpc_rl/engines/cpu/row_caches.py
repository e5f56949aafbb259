"""The running batch of the CPU engine for families whose cache is not keys/values alone: one native cache per row.

Owns: `RowCaches` (each request's own transformers cache object, as the model's forward builds it, and its token
count) and the model calls that grow it: `prefill` and `decode_step`, with `kv_batch`'s signatures. A row runs alone
(batch of one, no padding), so its logits are exactly those of a plain forward pass over its tokens, whatever the
cache holds: Gated DeltaNet's conv and recurrent states beside the full-attention keys/values (Qwen3-Next,
Qwen3.5), DeepSeek-V3.2's indexer keys beside the latent cache. `kv_batch` hands a model here when its family's
`cpu_engine_cache` (hpc_rl.models.registry) is "per_request"; the scheduler sees the same batch interface (`rows`,
`select`, `kv_batch.join`).

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

    @property
    def rows(self) -> int:
        return len(self.caches)

    def select(self, indices: list[int]) -> RowCaches:
        """The rows at `indices` (in that order)."""
        return RowCaches(caches=[self.caches[i] for i in indices], lengths=[self.lengths[i] for i in indices])

    def trimmed(self) -> RowCaches:
        return self


def join(running: RowCaches | None, newcomers: RowCaches) -> RowCaches:
    """One batch with `running`'s rows first, then `newcomers`' rows."""
    if running is None or running.rows == 0:
        return newcomers
    if not isinstance(running, RowCaches) or not isinstance(newcomers, RowCaches):
        raise TypeError("kv_batch.join: a per-request batch (RowCaches) joins only another one")
    return RowCaches(caches=running.caches + newcomers.caches, lengths=running.lengths + newcomers.lengths)


def _forward(model: torch.nn.Module, input_ids: list[int], start: int, cache: Any,
             last_only: bool) -> tuple[torch.Tensor, Any]:
    """(logits [1 or len, V] in fp32, the cache) of `input_ids` at positions start.. on one row's cache."""
    positions = torch.arange(start, start + len(input_ids), dtype=torch.long).unsqueeze(0)
    out = model(input_ids=torch.tensor([input_ids], dtype=torch.long), position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
    if out.past_key_values is None:
        raise RuntimeError(f"{type(model).__name__} returned no cache (use_cache=True): the CPU engine cannot "
                           "decode with it")
    return out.logits[0].float(), out.past_key_values


@torch.inference_mode()
def prefill(model: torch.nn.Module, sequences: list[list[int]], full_logits: bool = False
            ) -> tuple[RowCaches, torch.Tensor, list[torch.Tensor] | None]:
    """Run each sequence alone (on a fresh cache of the model's layer types); return their caches, last-position
    logits [B, V] and, with `full_logits`, each sequence's logits at every one of its positions [len, V]."""
    from transformers import DynamicCache

    caches, last, per_sequence = [], [], []
    for sequence in sequences:
        logits, cache = _forward(model, list(sequence), 0, DynamicCache(config=model.config),
                                 last_only=not full_logits)
        caches.append(cache)
        last.append(logits[-1])
        per_sequence.append(logits)
    batch = RowCaches(caches=caches, lengths=[len(s) for s in sequences])
    return batch, torch.stack(last), per_sequence if full_logits else None


@torch.inference_mode()
def decode_step(model: torch.nn.Module, batch: RowCaches, tokens: torch.Tensor
                ) -> tuple[RowCaches, torch.Tensor]:
    """Feed one token per row ([B]), each row on its own cache; return the grown batch and next-token logits
    [B, V]."""
    logits, caches = [], []
    for token, cache, length in zip(tokens.tolist(), batch.caches, batch.lengths):
        row_logits, cache = _forward(model, [int(token)], length, cache, last_only=True)
        logits.append(row_logits[-1])
        caches.append(cache)
    return RowCaches(caches=caches, lengths=[n + 1 for n in batch.lengths]), torch.stack(logits)
