"""The tiny visual run end to end (issue 32): `configs/tiny_vl_cpu.yaml` (tiny Qwen3-VL, 32x32 one-colour canvases)
on a CPU engine serving transformers' Qwen3-VL: the controller sends each prompt's images to the engine (`image_data`)
and their references to the trainer (`image_refs`), the trainer trains the Megatron Qwen3-VL on the processed
pixels, and the weight sync (vision tower included) makes the engine's log-probs equal the trainer's after every
sync.

Images were used on both sides: every trained sample's prompt ids hold an image pad run and its image reference.
Were the engine to drop them, its log-probs (the pad token's embedding in place of the image's features, text
positions) would differ from the trainer's far beyond the bound; were the trainer to drop them, its model refuses
image pads without images; were both to drop them, the trainer refuses too.

The dense run is also the one VL learning test: the greedy eval reward on held-out images must end clearly above
what the best constant answer scores on the same eval rows (the question's text is always the same, so only the
image can tell the colour)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.run_helpers import REPO_ROOT, run_tiny_recipe_in_sync

pytestmark = pytest.mark.slow

LEARN_ROLLOUTS = 20
"""Measured (docs/vision-language.md, "The tiny visual run"): greedy eval 0.75 at rollout 10 and 20, 1.0 from 40."""
MARGIN = 0.25


def best_constant_answer_score(eval_jsonl: Path) -> float:
    """The best reward any one fixed answer gets on these rows: the most frequent label's share."""
    labels = [json.loads(line)["label"] for line in eval_jsonl.read_text().splitlines() if line.strip()]
    return max(labels.count(label) for label in set(labels)) / len(labels)


def test_tiny_visual_run_learns_to_read_the_image_engine_logprobs_equal_the_trainers(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny_vl"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_vl_cpu.yaml", "--eval-interval", "10",
                                   "--save-debug-rollout-data", str(run_dir / "dump" / "{rollout_id}.jsonl"),
                                   num_rollout=LEARN_ROLLOUTS)
    key = "eval/tiny_vl/reward_mean"
    evals = [row["metrics"][key] for row in rows if key in row["metrics"]]
    constant = best_constant_answer_score(REPO_ROOT / "data" / "tiny_vl_colour" / "eval.jsonl")
    print(f"greedy eval reward per eval {evals}; best constant answer {constant}")
    assert len(evals) == 2 and evals[-1] > constant + MARGIN, (evals, constant)
    config = json.loads((REPO_ROOT / "assets" / "tiny_qwen3_vl" / "config.json").read_text())
    pad, start = config["image_token_id"], config["vision_start_token_id"]
    for rollout_id in range(LEARN_ROLLOUTS):
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
