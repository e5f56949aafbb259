"""The tiny visual run end to end (issue 32): `configs/tiny_vl_cpu.yaml` (tiny Qwen3-VL, 16x16 coloured shapes) on a
CPU engine serving transformers' Qwen3-VL: the controller sends each prompt's images to the engine (`image_data`)
and their references to the trainer (`image_refs`), the trainer trains the Megatron Qwen3-VL on the processed
pixels, and the weight sync (vision tower included) makes the engine's log-probs equal the trainer's after every
sync.

Images were used on both sides: every trained sample's prompt ids hold an image pad run and its image reference.
Were the engine to drop them, its log-probs (the pad token's embedding in place of the image's features, text
positions) would differ from the trainer's far beyond the bound; were the trainer to drop them, its model refuses
image pads without images; were both to drop them, the trainer refuses too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.run_helpers import REPO_ROOT, SHORT_RUN_ROLLOUTS, run_tiny_recipe_in_sync

pytestmark = pytest.mark.slow


def test_tiny_visual_run_engine_logprobs_equal_the_trainers_after_every_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny_vl"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_vl_cpu.yaml", "--eval-interval", str(SHORT_RUN_ROLLOUTS),
                                   "--save-debug-rollout-data", str(run_dir / "dump" / "{rollout_id}.jsonl"))
    config = json.loads((REPO_ROOT / "assets" / "tiny_qwen3_vl" / "config.json").read_text())
    pad, start = config["image_token_id"], config["vision_start_token_id"]
    for rollout_id in range(SHORT_RUN_ROLLOUTS):
        lines = (run_dir / "dump" / f"{rollout_id}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines if line.strip()]
        assert samples, f"rollout {rollout_id}: no samples dumped"
        for sample in samples:
            prompt = sample["prompt_token_ids"]
            assert len(sample["images"]) == 1, sample["images"]
            assert prompt.count(pad) >= 1 and prompt[prompt.index(pad) - 1] == start, prompt
    assert all(row["metrics"]["perf/weight_sync_bytes"] > 0 for row in rows)
    assert "eval/tiny_vl/reward_mean" in rows[-1]["metrics"]  # the greedy eval ran with images too
    assert "Traceback" not in (run_dir / "logs" / "trainer.log").read_text()


def test_tiny_moe_visual_run_engine_logprobs_equal_the_trainers(tmp_path: Path) -> None:
    """The same with the tiny Qwen3-VL-MoE (qwen3_vl_moe maker, experts fused as released): the sync's per-expert
    names reach transformers' fused experts on the engine; 2 rollouts."""
    from hpc_rl.models.qwen3_vl.tiny import make_tiny_qwen3_vl_moe

    hf_dir = make_tiny_qwen3_vl_moe(tmp_path / "tiny_qwen3_vl_moe")
    rows = run_tiny_recipe_in_sync(tmp_path / "run", "configs/tiny_vl_cpu.yaml", "--model",
                                   str(REPO_ROOT / "configs" / "models" / "tiny_qwen3_vl_moe.yaml"),
                                   "--hf-checkpoint", str(hf_dir), "--eval-interval", "2", num_rollout=2)
    assert all(row["metrics"]["perf/weight_sync_bytes"] > 0 for row in rows)
