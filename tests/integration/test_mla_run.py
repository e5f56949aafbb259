"""The tiny DeepSeek-V3-style run on this machine: `python -m hpc_rl.submit configs/tiny_mla_cpu.yaml`.

Real processes: controller, sglang-router, a CPU engine serving transformers' DeepseekV3ForCausalLM (YaRN,
multi-latent attention, group-limited routing; it keeps the MTP layer where SGLang's NextN draft does), and
two torchrun trainer ranks at expert parallelism 2 training the policy and, with --enable-mtp-training, the
MTP layer. Over a few rollouts the engine's log-probs must equal the trainer's at the first step and after
every sync (float32 on both sides: any tensor, YaRN term or expert that missed its sync would show), every
rollout must report the MTP loss, and every sync must land: the engine refuses an update with an MTP name or
shape its draft layer does not have, which would fail the run.

That GRPO learns is shown once, by the dense default's 100-rollout run (test_run_local.py::
test_tiny_default_run_learns). That the MTP layer gets gradients, and that every tensor (the MTP layer's too)
reaches an engine, is test_mla_models.py's, exactly, on the trainer's own ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.run_helpers import SHORT_RUN_ROLLOUTS, processes_mentioning, run_tiny_recipe_in_sync

pytestmark = pytest.mark.slow


def test_tiny_mla_run_with_mtp_engine_logprobs_equal_the_trainers_after_every_sync(tmp_path: Path) -> None:
    """Three rollouts (learning: test_run_local.py::test_tiny_default_run_learns)."""
    run_dir = tmp_path / "mla"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_mla_cpu.yaml", "--eval-interval", str(SHORT_RUN_ROLLOUTS))
    mtp = [r["metrics"]["train/mtp_1_loss"] for r in rows]
    assert all(r["metrics"]["train/mtp_loss"] == r["metrics"]["train/mtp_1_loss"] for r in rows)
    assert all(math.isfinite(loss) and loss > 0 for loss in mtp), mtp
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
    assert processes_mentioning(str(run_dir)) == []
