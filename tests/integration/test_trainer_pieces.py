"""Pure pieces of the trainer (no ranks, fast; here because tests/unit is other engineers' area):
lr schedule, TrainBatch wire formats (incl. the controller's pack_samples), log-prob slicing and
padded-vocab masking, and the batches-file command sequence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hpc_rl.config.sections.training import OptimizerConfig
from hpc_rl.training.logprobs import vocab_parallel_logprobs
from hpc_rl.training.micro_batches import build_microbatch
from hpc_rl.training.lr_schedule import learning_rate
from hpc_rl.training.train_batch import TrainBatch, read_batches_file


def test_learning_rate_schedule_follows_megatron() -> None:
    warm = OptimizerConfig(lr=1.0, lr_warmup_iters=4, lr_decay_style="constant")
    assert [learning_rate(warm, s) for s in (0, 2, 4, 10)] == [0.0, 0.5, 1.0, 1.0]
    cosine = OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_decay_iters=10)
    assert learning_rate(cosine, 0) == 1.0 and math.isclose(learning_rate(cosine, 5), 0.55)
    assert learning_rate(cosine, 10) == pytest.approx(0.1) and learning_rate(cosine, 50) == pytest.approx(0.1)
    linear = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_decay_iters=4)
    assert learning_rate(linear, 1) == 0.75
    with pytest.raises(ValueError, match="lr_decay_style"):
        learning_rate(OptimizerConfig(lr_decay_style="wsd", lr_decay_iters=3), 1)


def small_batch() -> TrainBatch:
    return TrainBatch(tokens=[[1, 2, 3, 4], [5, 6, 7]], response_lengths=[2, 1], loss_masks=[[1, 0], [1]],
                      rewards=[0.5, -0.5], rollout_logprobs=[[-0.1, -0.2], [-0.3]])


def test_train_batch_arrays_round_trip_and_match_the_controller_packing() -> None:
    from hpc_rl.controller.train_batches import pack_samples
    from hpc_rl.data.samples import Sample

    batch = small_batch()
    back = TrainBatch.from_arrays(batch.to_arrays())
    assert back.tokens == batch.tokens and back.loss_masks == batch.loss_masks
    assert [x for lp in back.rollout_logprobs for x in lp] == pytest.approx([-0.1, -0.2, -0.3])
    samples = [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=t[: len(t) - r],
                      response_token_ids=t[len(t) - r:], response_logprobs=lp, loss_mask=m)
               for i, (t, r, m, lp) in enumerate(zip(batch.tokens, batch.response_lengths, batch.loss_masks,
                                                     batch.rollout_logprobs))]
    from_controller = TrainBatch.from_arrays(pack_samples(samples, batch.rewards))
    assert from_controller.tokens == batch.tokens and from_controller.response_lengths == [2, 1]
    assert from_controller.loss_masks == batch.loss_masks and from_controller.rewards == batch.rewards


def test_train_batch_validation_says_which_sample() -> None:
    with pytest.raises(ValueError, match="sample 1"):
        TrainBatch(tokens=[[1, 2], [3]], response_lengths=[1, 1], loss_masks=[[1], [1]], rewards=[0, 0])
    with pytest.raises(ValueError, match="rewards"):
        TrainBatch(tokens=[[1, 2]], response_lengths=[1], loss_masks=[[1]], rewards=[])


def test_batches_file_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    good = {"samples": [{"tokens": [1, 2, 3], "response_length": 1, "reward": 1.0}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"samples": [{"tokens": [1]}]}) + "\n")
    batches = read_batches_file(path)
    assert next(batches).loss_masks == [[1]]
    with pytest.raises(ValueError, match=r"b.jsonl:2"):
        next(batches)


def test_response_positions_and_padded_vocab() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 8)
    logits[..., 6:] = 50.0  # padded vocab rows must not count, however large
    micro = build_microbatch([[1, 2, 3, 4, 5], [0, 1, 2]], [2, 1], [0, 1], qkv_format="bshd")
    assert micro.tokens.tolist() == [[1, 2, 3, 4, 5], [0, 1, 2, 0, 0]]
    per_sample, entropy = micro.response_logprobs(logits, vocab_size=6, with_entropy=True)
    reference = torch.log_softmax(logits[..., :6], -1)
    assert torch.allclose(per_sample[0], reference[0, [2, 3], [4, 5]])
    assert torch.allclose(per_sample[1], reference[1, [1], [2]])
    ref_entropy = -(reference.exp() * reference).sum(-1)
    assert torch.allclose(entropy[0], ref_entropy[0, 2:4])
    lp, _ = vocab_parallel_logprobs(logits, micro.tokens, vocab_size=8)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, micro.tokens[..., None]).squeeze(-1))


def test_packed_microbatch_layout_and_response_positions() -> None:
    micro = build_microbatch([[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1], [4, 9], qkv_format="thd", pad_multiple=3)
    assert micro.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 0]]  # 8 tokens padded to 9
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0]]  # the pad is its own sequence
    assert micro.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 8, 9] and micro.attention_mask is None
    assert micro.starts == [0, 5] and micro.indices == [4, 9]
    torch.manual_seed(0)
    logits = torch.randn(1, 9, 10)
    per_sample, _ = micro.response_logprobs(logits, vocab_size=10)
    reference = torch.log_softmax(logits[0], -1)
    assert torch.allclose(per_sample[0], reference[[2, 3], [4, 5]])  # tokens 4, 5 scored at 2, 3
    assert torch.allclose(per_sample[1], reference[[6], [8]])  # token 8 (last of sample 2) scored at 6
    with pytest.raises(ValueError, match="qkv_format"):
        build_microbatch([[1, 2]], [1], [0], qkv_format="sbhd")


def test_batch_file_commands_train_save_stop() -> None:
    from hpc_rl.protocol.messages import SaveCommand, StopCommand, TrainCommand
    from hpc_rl.training.commands import BatchFileCommands

    class TwoRollouts:
        def next_batch(self, rollout_id: int) -> TrainBatch | None:
            return small_batch() if rollout_id < 2 else None

    commands = BatchFileCommands(TwoRollouts(), start_rollout=0, num_rollouts=None, save_dir="ckpt", save_interval=2)
    kinds = []
    while True:
        command = commands.next_command()
        kinds.append((type(command).__name__, getattr(command, "rollout_id", None)))
        if isinstance(command, StopCommand):
            break
    assert kinds == [(TrainCommand.__name__, 0), (TrainCommand.__name__, 1), (SaveCommand.__name__, 1),
                     (StopCommand.__name__, None)]
