"""SFT's "rollouts": the next chats of the data as samples, with no engine (slime's sft_rollout.generate_rollout).

Owns `SftRollouts`, what the loop's `Rollouts` drives in a trainer-only job in place of the
`RolloutScheduler` (the same calls: `run`, `state_dict`/`load_state_dict`, `buffer`, `set_weight_version`):
rollout k is the next `rollout_batch_size` chats of the prompt source, epoch after epoch (shuffled per epoch
with `rollout_shuffle`; the cursor is in every checkpoint, so a resumed run continues with the chat it
stopped at), each one sample of one group. A chat becomes a sample as slime's makes it: its tokens and loss
mask from the chat template (`data.chat_loss_masks`), the response = everything from the first trained token
on (its mask is the loss mask), reward 0. Also `sft_eval_samples`: a held-out file's chats, for the
trainer's eval loss.

Not here: the masks (`data.chat_loss_masks`), the loss (`training.losses.sft_loss`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpc_rl.data.chat_loss_masks import ChatLossMasks
from hpc_rl.data.prompts import DataError, DataKeys, PromptDataset, PromptRecord, PromptSource
from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.rollout.scheduler import RolloutResult


def checkpoint_stop_token_ids(hf_checkpoint: str | Path) -> list[int]:
    """The ids a model stops at besides its tokenizer's EOS: config.json's and generation_config.json's
    eos_token_id (one id or a list; GLM lists its role tokens there)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(hf_checkpoint) / name
        try:
            value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        except (OSError, ValueError):
            value = None
        ids += [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
    return ids


def chat_sample(record: PromptRecord, masks: ChatLossMasks, *, index: int, where: str) -> Sample:
    """One chat as a sample: prompt = the tokens before the first trained one, response = the rest."""
    if not isinstance(record.prompt, list):
        raise DataError(f"{where}: SFT needs a list of chat messages, got a string; set rollout.input_key to the "
                        f"messages field")
    chat = masks.masked(record.prompt, record.metadata.get("tools"))
    response = chat.response_length
    if response == len(chat.token_ids):  # nothing before the first trained token: the trainer needs a prompt
        raise DataError(f"{where}: the chat's first token is already trained (an assistant message first?)")
    cut = len(chat.token_ids) - response
    return Sample(index=index, group_index=index, prompt=record.prompt, prompt_token_ids=chat.token_ids[:cut],
                  response_token_ids=chat.token_ids[cut:], loss_mask=chat.loss_mask[cut:], reward=0.0,
                  response_logprobs=[0.0] * response, status=SampleStatus.COMPLETED,
                  metadata={**record.metadata, "data_row": record.row})


class SftRollouts:
    """Rollout k = the next rollout_batch_size chats of the data (see the module docstring)."""

    def __init__(self, source: PromptSource, masks: ChatLossMasks, *, rollout_batch_size: int) -> None:
        self.source, self.masks, self.rollout_batch_size = source, masks, rollout_batch_size
        self.next_sample_index = 0
        self.buffer: tuple[()] = ()
        """No partial buffer: nothing is generated."""

    def set_weight_version(self, version: int) -> None:
        """No engine serves the weights of a trainer-only job."""

    async def run(self, rollout_id: int, weight_version: int) -> RolloutResult:
        records = self.source.next_records(self.rollout_batch_size)
        first, epoch = self.next_sample_index, self.source.epoch  # the epoch of the rollout's last chat
        self.next_sample_index += len(records)
        samples = await asyncio.to_thread(self._samples, records, first)  # chat templates: ~ms per chat
        trained = [sum(s.loss_mask or ()) for s in samples]
        metrics = {"rollout/epoch": float(epoch), "rollout/samples": float(len(samples)),
                   "rollout/tokens_mean": sum(s.total_length for s in samples) / max(len(samples), 1),
                   "rollout/trained_tokens_mean": sum(trained) / max(len(samples), 1),
                   "rollout/samples_without_trained_tokens": float(sum(1 for t in trained if not t))}
        return RolloutResult(groups=[[s] for s in samples], metrics=metrics)

    def _samples(self, records: list[PromptRecord], first: int) -> list[Sample]:
        where = self.source.dataset.path
        return [chat_sample(r, self.masks, index=first + k, where=f"{where}: row {r.row}")
                for k, r in enumerate(records)]

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "next_sample_index": self.next_sample_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.next_sample_index = int(state["next_sample_index"])


def sft_eval_samples(paths: Iterable[tuple[str, str]], keys: DataKeys, masks: ChatLossMasks) -> dict[str, list[Sample]]:
    """name -> every chat of that held-out file as a sample (built once, at start)."""
    out: dict[str, list[Sample]] = {}
    for name, path in paths:
        dataset = PromptDataset.load(path, keys)
        out[name] = [chat_sample(r, masks, index=r.row, where=f"{path}: row {r.row}") for r in dataset.records]
    return out
