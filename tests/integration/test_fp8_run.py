"""FP8 rollouts, float32 training: the tiny run with a block-FP8 engine checkpoint (slime's
scripts/low_precision/run-qwen3-4b-fp8.sh on this machine).

Real processes: controller, router, a CPU engine serving the FP8 checkpoint dequantized, one torchrun trainer
rank that reads it dequantized and trains in float32. Each sync quantizes the trainer's weights into the
checkpoint's blocks (e4m3 + weight_scale_inv) and the engine dequantizes them. So the engines' log-probs equal
the trainer's on rollout 0 (generated before any sync: both hold the checkpoint's weights, dequantized by the
engine's loader and the trainer's reader alike), and differ by FP8's rounding of the trained weights after each
sync: the measured mismatch (`train_rollout_logprob_abs_diff`), which TIS corrects. The tiny checkpoint uses 48 x 48 blocks (its config.json
says so), smaller than the releases' 128 x 128, so every matrix holds several blocks, partial ones included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hpc_rl.config.fp8_scheme import Fp8Blocks
from hpc_rl.weights.fp8_blocks import FP8_DTYPE
from hpc_rl.weights.fp8_checkpoint import write_fp8_checkpoint
from tests.integration.run_helpers import REPO_ROOT, processes_mentioning, run_tiny_recipe_in_sync

pytestmark = pytest.mark.slow

GAP = "train/train_rollout_logprob_abs_diff"


@pytest.mark.parametrize("variant", ["plain", "colocated-tis-ue8m0", "disk"])
def test_tiny_run_with_an_fp8_engine_checkpoint_shows_fp8s_mismatch_after_each_sync(tmp_path: Path,
                                                                                     variant: str) -> None:
    """plain: the broadcast sync; colocated-tis-ue8m0: colocated (/update_weights_from_tensor), with TIS and
    power-of-two scales; disk: slime's disk transport, whose HF directories hold the FP8 blocks and keep the
    checkpoint's quantization_config."""
    checkpoint = write_fp8_checkpoint(REPO_ROOT / "assets" / "tiny_qwen3", tmp_path / "tiny_fp8",
                                      Fp8Blocks(block=(48, 48)))
    disk = tmp_path / "disk"
    flags = {"plain": (), "colocated-tis-ue8m0": ("--colocate", "--use-tis", "--force-fp8-ue8m0-scale"),
             "disk": ("--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk),
                      "--update-weight-disk-keep-files")}[variant]
    run_dir = tmp_path / "fp8"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_cpu.yaml", "--hf-checkpoint", str(checkpoint),
                                   "--eval-interval", "3", *flags, max_logprob_abs_diff=0.1)
    gaps = [row["metrics"][GAP] for row in rows]
    print(f"FP8 engines, {variant}: {GAP} per rollout {gaps}")
    if variant.startswith("colocated"):
        # colocated engines are filled by a sync before rollout 0: its power-of-two scales re-round the checkpoint's
        # blocks (plain scales would give them back exactly), so FP8's gap shows from rollout 0 on
        assert 1e-3 < gaps[0] < 0.1, gaps
    else:
        assert gaps[0] < 1e-5, gaps  # rollout 0, before any sync: both sides hold the checkpoint's weights
    # after a step, FP8's rounding shows (a sync that sent the float32 weights would give ~1e-7 here)
    assert all(1e-3 < gap < 0.1 for gap in gaps[1:]), gaps
    if variant == "disk":
        last = sorted(disk.glob("weights_v*"))[-1]
        assert json.loads((last / "config.json").read_text())["quantization_config"]["weight_block_size"] == [48, 48]
        stored = load_file(str(last / "model.safetensors"))
        assert stored["model.layers.1.mlp.down_proj.weight"].dtype == FP8_DTYPE
        assert stored["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    if "--use-tis" in flags:
        assert all(row["metrics"]["train/tis_abs"] > 0 for row in rows[1:])
    for log in (run_dir / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log
    assert processes_mentioning(str(run_dir)) == []
