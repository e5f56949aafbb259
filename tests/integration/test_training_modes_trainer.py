"""Issue 21 on the trainer ranks alone (`torchrun -m hpc_rl.training CONFIG --batches-file F`, no controller):

- PPO's critic (TP 2 + SP) fits a fixed batch (its value loss falls), with its own optimizer (slime's role file), is saved
  beside the actor (`<save>/critic`), and a run resumed from `--load` continues with the trained critic; the
  actor waits num_critic_only_steps rollouts.
- On-policy distillation with `--opd-type megatron` on top of PPO (orthogonal to the estimator): the teacher
  loaded on the trainer (an HF directory here) gives the log-probs transformers computes for it, so the
  reported reverse KL equals transformers' student minus teacher log-probs of the sampled tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.process.child_process import planned_port
from tests.integration.test_run_local import tensorboard_scalars

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STUDENT, TEACHER = ROOT / "assets/tiny_qwen3", ROOT / "assets/tiny_qwen3_teacher"
STEP_LINE = re.compile(r"rollout (\d+) step \d+: (.*)")


def batch_rows(seed: int, n: int = 8) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt, response = rng.randint(2, 5), rng.randint(2, 5)
        rows.append({"tokens": [rng.randrange(5, 24) for _ in range(prompt + response)], "response_length": response,
                     "loss_mask": [1] * response, "reward": float(i % 2),
                     "rollout_logprobs": [-1.0] * response})
    return rows


def train(tmp_path: Path, name: str, flags: list[str], batches: list[list[dict]]) -> dict[int, dict[str, float]]:
    """Rollout id -> its (last) step's metrics, as rank 0 logs them."""
    from hpc_rl.config.loading import load_config, write_resolved_config

    config = load_config([ROOT / "configs/tiny_cpu.yaml"], ["--rollout-batch-size", "1", "--n-samples-per-prompt",
                                                            "8", "--global-batch-size", "8", *flags])
    config = dataclasses.replace(config, model=str(ROOT / "configs/models/tiny_qwen3.yaml"),
                                 run_dir=str(tmp_path / name))
    path = write_resolved_config(config, tmp_path / name)
    batches_file = tmp_path / f"{name}.jsonl"
    batches_file.write_text("".join(json.dumps({"samples": rows}) + "\n" for rows in batches))
    ranks = config.cluster.trainer_world_size
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
         "--master-port", str(planned_port()), "-m", "hpc_rl.training", str(path), "--batches-file", str(batches_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = {}
    for rollout, fields in STEP_LINE.findall(result.stderr):
        steps[int(rollout)] = {k: float(v) for k, v in (item.split("=") for item in fields.split())}
    return steps


def response_log_probs(path: Path, rows: list[dict]) -> list["torch.Tensor"]:
    """transformers' log-probs of each row's response tokens under the HF model at `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for row in rows:
            tokens = torch.tensor([row["tokens"]])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, tokens[0, 1:, None])[:, 0][-row["response_length"]:])
    return out


def test_critic_and_megatron_teacher_on_the_trainer(tmp_path: Path) -> None:
    """PPO with OPD on top (orthogonal, as in slime), 8 rollouts of one fixed batch, then a resumed run; on two
    ranks at TP 2 with sequence parallelism (the value head's SP gather and gradient, the teacher's vocab-parallel
    log-probs: a one-off TP 1 vs TP 2 + SP pair of runs of PPO + OPD on one batch printed the same value losses
    and grad norms to 4 digits)."""
    rows = batch_rows(0)
    roles = tmp_path / "roles.yaml"  # slime's --megatron-config-path: the critic's own lr
    roles.write_text("megatron:\n  - {name: default, role: critic, overrides: {lr: 0.01}}\n")
    flags = ["--advantage-estimator", "ppo", "--num-critic-only-steps", "6", "--megatron-config-path", str(roles),
             "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(TEACHER), "--opd-kl-coef", "1.0",
             "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    first = train(tmp_path, "fit", flags, [rows] * 8)
    losses = [first[r]["value_loss"] for r in range(8)]
    assert losses[5] < 0.3 * losses[0], losses  # the same batch, fitted
    assert all("pg_loss" not in first[r] for r in range(6)) and "pg_loss" in first[6]  # critic-only rollouts
    assert first[0]["critic_lr"] == 0.01 and first[6]["lr"] == 5e-4  # the critic's own optimizer
    assert (tmp_path / "ckpt" / "critic" / "latest_checkpointed_iteration.txt").read_text() == "7"

    # rollout 6 is the actor's first step: its old log-probs are the initial student's
    student, teacher = response_log_probs(STUDENT, rows), response_log_probs(TEACHER, rows)
    expected = sum(float((s - t).mean()) for s, t in zip(student, teacher)) / len(rows)  # sum of sample means / B
    reported = tensorboard_scalars(tmp_path / "fit", "train/opd_reverse_kl")[0]
    assert abs(reported - expected) < 1e-4, (reported, expected)
    assert abs(expected) > 0.1  # the teacher is another model: the check is not 0 == 0

    resumed = train(tmp_path, "resume", [*flags, "--load", str(tmp_path / "ckpt")], [rows] * 9)
    assert sorted(resumed) == [8]  # rollouts 0..7 were done: the batches file continues at 8
    assert resumed[8]["value_loss"] < 0.5 * losses[0], (resumed[8], losses)


def test_critic_at_context_and_pipeline_parallel(tmp_path: Path) -> None:
    """Issue 29: the critic at CP 2 and at PP 2 (two gloo ranks each; the tiny analogue of slime's
    test_qwen3_4B_ppo_train_critic_only.py at CP 2) reads the same values and takes the same first step as on one
    rank: its value losses before and after one critic step equal the one-rank run's, and the actor trains after
    the critic-only rollouts."""
    rows = batch_rows(1)
    flags = ["--advantage-estimator", "ppo", "--num-critic-only-steps", "2"]
    one_rank = train(tmp_path, "one", flags, [rows] * 3)
    two_ranks = ["--actor-num-gpus-per-node", "2"]
    layouts = {"cp2": train(tmp_path, "cp2", [*flags, *two_ranks, "--context-parallel-size", "2"], [rows] * 3),
               "pp2": train(tmp_path, "pp2", [*flags, *two_ranks, "--pipeline-model-parallel-size", "2"], [rows] * 3)}
    assert one_rank[1]["value_loss"] < one_rank[0]["value_loss"]  # the critic learns
    for name, steps in layouts.items():
        for rollout in (0, 1):
            assert steps[rollout]["value_loss"] == pytest.approx(one_rank[rollout]["value_loss"], rel=1e-4), name
        assert "pg_loss" not in steps[1] and "pg_loss" in steps[2], name  # then the actor trains
        assert steps[2]["pg_loss"] == pytest.approx(one_rank[2]["pg_loss"], rel=1e-3, abs=1e-6), name
