"""One training step on the same 8 samples at DP=1, DP=2 and CP=2 (real gloo ranks) gives the same
loss, grad norm and updated weights, with and without `calculate_per_token_loss` (Megatron's DDP
sums gradients over DP x CP with that flag and averages them without it: the loss scale must
follow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.test_trainer_step import _build_parts, _training, make_batch

pytestmark = pytest.mark.slow
LAYOUTS = {"dp1": (1, 1), "dp2": (2, 1), "cp2": (2, 2)}  # name -> (ranks, context_parallel_size)


def one_step_rank(hf_dir: str, cp: int) -> dict:
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.export import export_hf_state_dict

    info = init_parallel(_training(context_parallel_size=cp), device="cpu")
    batch = make_batch(5)
    share = len(batch) // info.dp_size
    batch = batch.select(range(info.dp_rank * share, (info.dp_rank + 1) * share))
    out = {}
    for per_token in (False, True):
        parts = _build_parts(hf_dir, _training(context_parallel_size=cp, calculate_per_token_loss=per_token), info)
        metrics = parts.trainer.train_rollout(batch)[0]
        params = {name: t.clone() for name, t in export_hf_state_dict(parts.actor, parts.trainer.arch, None)}
        out[per_token] = {"metrics": metrics, "params": params}
    shutdown_parallel()
    return out


def test_step_is_the_same_at_dp1_dp2_and_cp2(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf"))
    results = {name: run_ranks(one_step_rank, ranks, hf_dir, cp, timeout=240) for name, (ranks, cp) in LAYOUTS.items()}
    for per_token in (False, True):
        reference = results["dp1"][0][per_token]
        assert reference["metrics"]["grad_norm"] > 0
        for name in ("dp2", "cp2"):
            for rank, out in enumerate(results[name]):
                where = (name, rank, f"calculate_per_token_loss={per_token}")
                mine = out[per_token]
                for metric in ("loss", "pg_loss", "entropy_loss", "kl_loss", "grad_norm"):
                    expected = reference["metrics"][metric]
                    assert abs(mine["metrics"][metric] - expected) < 1e-5 * max(1.0, abs(expected)), (*where, metric)
                for param, value in reference["params"].items():
                    assert (mine["params"][param] - value).abs().max().item() < 1e-5, (*where, param)
    # the two loss normalisations differ, so the flag reached the step
    assert results["dp1"][0][True]["metrics"]["loss"] != results["dp1"][0][False]["metrics"]["loss"]
