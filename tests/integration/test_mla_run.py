"""The tiny DeepSeek-V3-style run on this machine: `python -m hpc_rl.submit configs/tiny_mla_cpu.yaml`.

Real processes: controller, sglang-router, a CPU engine serving transformers' DeepseekV3ForCausalLM (YaRN,
multi-latent attention, group-limited routing; it keeps the MTP layer where SGLang's NextN draft does), and
two torchrun trainer ranks at expert parallelism 2 training the policy and, with --enable-mtp-training, the
MTP layer. The run must learn the tiny task, the engine's log-probs must equal the trainer's at the first
step and after every sync (float32 on both sides: any tensor, YaRN term or expert that missed its sync would
show), the MTP loss must fall, and every sync must land: the engine refuses an update with an MTP name or
shape its draft layer does not have, which would fail the run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.integration.run_helpers import processes_mentioning, run_tiny_recipe_to_learning

pytestmark = pytest.mark.slow


def test_tiny_mla_run_learns_with_mtp_and_engine_logprobs_equal_the_trainers(tmp_path: Path) -> None:
    run_dir = tmp_path / "mla"
    rows = run_tiny_recipe_to_learning(run_dir, "configs/tiny_mla_cpu.yaml", "--eval-interval", "50")
    mtp = [r["metrics"]["train/mtp_1_loss"] for r in rows]
    assert all(r["metrics"]["train/mtp_loss"] == r["metrics"]["train/mtp_1_loss"] for r in rows)
    assert statistics.mean(mtp[-10:]) < statistics.mean(mtp[:10]) - 0.05, (mtp[:10], mtp[-10:])
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
    assert processes_mentioning(str(run_dir)) == []
