"""SFT's held-out evaluation on the trainer ranks: loss and greedy accuracy of the assistant tokens.

Owns `evaluate_loss(trainer, batch)`: a forward pass (no update) over this DP rank's share of a held-out
chat set, in the trainer's own micro-batching, summed over the DP ranks:

    loss            mean -log p over the trained (assistant) tokens (what sft_loss trains, per token)
    token_accuracy  share of those tokens that are their position's argmax
    exact_match     share of chats whose every trained token is the argmax: greedy decoding from each
                    turn's prompt writes that turn exactly (what a greedy eval rollout would score)

The trainer is a trainer-only job's: no engine to sample from, so greedy accuracy comes from the logits
(teacher forcing decides it exactly for greedy decoding). Not here: which chats (`rollout.sft`), the
command that asks for it (`commands`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.training.train_batch import TrainBatch
from hpc_rl.weights.json_collectives import broadcast_json


@torch.no_grad()
def evaluate_loss(trainer: Any, batch: TrainBatch) -> dict[str, float]:
    """Every rank calls it with its share (any size, empty too: only the final sums cross DP ranks)."""
    device = trainer.info.device
    masks = [torch.as_tensor(m, dtype=torch.float32, device=device) for m in batch.loss_masks]
    micros = trainer._step_microbatches(batch, range(len(batch)), same_count_on_every_dp_rank=False) if len(batch) \
        else []
    vocab_size, tp_group = trainer.arch.vocab_size, trainer.tp_group

    def sums(micro: Any, logits: torch.Tensor) -> torch.Tensor:
        log_probs, _ = micro.response_logprobs(logits, vocab_size=vocab_size, tp_group=tp_group)
        hits = micro.response_greedy_hits(logits, vocab_size=vocab_size, tp_group=tp_group)
        rows = []
        for lp, hit, index in zip(log_probs, hits, micro.indices):
            mask = masks[index]
            trained, correct = mask.sum(), (hit * mask).sum()
            rows.append(torch.stack([-(lp * mask).sum(), trained, correct,
                                     ((correct == trained) & (trained > 0)).float(), (trained > 0).float()]))
        return torch.stack(rows).sum(dim=0)

    trainer.actor.eval()
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    for part in trainer.pipeline.forward_only(trainer.actor, micros, sums):
        totals += part.double()
    if trainer.info.is_last_stage and trainer.info.dp_size > 1:
        dist.all_reduce(totals, group=trainer.dp_group)
    nll, tokens, correct, exact, chats = (float(x) for x in totals)
    out = {"loss": nll / max(tokens, 1.0), "token_accuracy": correct / max(tokens, 1.0),
           "exact_match": exact / max(chats, 1.0), "samples": chats, "tokens": tokens}
    if trainer.pp_group is not None:
        out = dict(broadcast_json(out, src=dist.get_global_rank(trainer.pp_group, trainer.info.pp_size - 1),
                                  group=trainer.pp_group, device=device))
    return out
