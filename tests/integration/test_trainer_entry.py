"""`torchrun -m hpc_rl.training CONFIG --batches-file F` end to end: 2 ranks (DP=2), 2 rollouts,
a checkpoint after each, TensorBoard scalars from rank 0."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_entry_trains_from_a_batches_file(tmp_path: Path) -> None:
    from hpc_rl.config.loading import load_config, write_resolved_config
    from hpc_rl.tiny_model import make_tiny_model
    from hpc_rl.process.child_process import planned_port

    sys.path.insert(0, str(Path(__file__).parent))
    from test_trainer_step import make_batch

    hf_dir = make_tiny_model(tmp_path / "hf")
    config = load_config([ROOT / "configs/tiny_cpu.yaml"])
    config = dataclasses.replace(
        config, model=str(ROOT / "configs/models/tiny_qwen3.yaml"), run_dir=str(tmp_path / "run"),
        rollout=dataclasses.replace(config.rollout, rollout_batch_size=1, n_samples_per_prompt=8),
        training=dataclasses.replace(config.training, global_batch_size=8, micro_batch_size=2),
        checkpoint=dataclasses.replace(config.checkpoint, hf_checkpoint=str(hf_dir), save=str(tmp_path / "ckpt"),
                                       save_interval=1))
    config_path = write_resolved_config(config, tmp_path / "run")
    batches = tmp_path / "rollouts.jsonl"
    with open(batches, "w") as handle:
        for rollout in range(2):
            batch = make_batch(rollout)
            rows = [{"tokens": t, "response_length": r, "loss_mask": m, "reward": w, "rollout_logprobs": lp}
                    for t, r, m, w, lp in zip(batch.tokens, batch.response_lengths, batch.loss_masks, batch.rewards,
                                              batch.rollout_logprobs)]
            handle.write(json.dumps({"samples": rows}) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(planned_port()),
         "-m", "hpc_rl.training", str(config_path), "--batches-file", str(batches)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rollout 1 step 2" in result.stderr  # train/* steps count optimizer steps done (as rollout/* counts rollouts)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
    state = json.loads((tmp_path / "ckpt" / "iter_0000001" / "hpc_rl_state.json").read_text())
    assert state["rollout_id"] == 1 and state["optimizer_steps"] == 2
    assert state["controller_state"] == {"next_rollout": 2}
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
