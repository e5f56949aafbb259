"""The tiny run with score centering (slime's --use-score-centering): real controller, CPU engine and trainer.

The rollout asks the engine for each generated token's top-k log-probs (SGLang's top_logprobs_num), the samples
carry them to the trainer, and REINFORCE's loss subtracts the head estimate of the sampler's expected score. Over
three rollouts the engine's log-probs must equal the trainer's after every sync (the helper's check), and the
head the trainer scores must be the engine's: the trainer's mass on the engine's top-k ids (P) stays near the
engine's own (Q) (equal at a rollout's first step, within 0.02 after one update; measured ~0.003), and the
correction is nonzero once the policy moved (a second step per rollout). The hand-checked values are
tests/unit/test_score_centering.py's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.run_helpers import run_tiny_recipe_in_sync

pytestmark = pytest.mark.slow


def test_tiny_run_with_score_centering_trains(tmp_path: Path) -> None:
    # Two steps per rollout: the second step's policy differs from the sampler's, so the term is not zero.
    rows = run_tiny_recipe_in_sync(tmp_path / "sc", "configs/tiny_cpu.yaml", "--use-score-centering",
                                   "--score-centering-top-k", "4", "--num-steps-per-rollout", "2",
                                   "--global-batch-size", "64")
    for row in rows:
        metrics = row["metrics"]
        q, p = metrics["train/score_centering_head_mass_q"], metrics["train/score_centering_head_mass_p"]
        assert 0.0 < q <= 1.0 + 1e-5 and abs(q - p) < 0.02, (row["rollout_id"], q, p)
        assert 0.0 < metrics["train/score_centering_abs"] < 1.0 and math.isfinite(metrics["train/pg_loss"])
