"""slime's --rollout-external-engine-addrs (issue 26), real processes: a CPU engine started outside the run (as an
inference job on another partition would serve) is attached as the run's engine; over a few rollouts its weights
follow the trainer's after every sync (over the weight-update group), and it outlives the run. An address nothing
answers at fails the run at start, naming it. That GRPO learns is shown once, by test_run_local.py::
test_tiny_default_run_learns: who started the engine changes nothing there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.process.child_process import planned_port
from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.protocol.http_client import request_blocking
from tests.integration.run_helpers import SHORT_RUN_ROLLOUTS, records, run_to_end

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_a_run_attaches_to_an_engine_it_did_not_start_and_its_weights_follow(tmp_path: Path) -> None:
    """A few rollouts (learning: test_run_local.py::test_tiny_default_run_learns)."""
    with CpuEngineProcess(REPO / "assets" / "tiny_qwen3", log_path=tmp_path / "external.log",
                          max_running_requests=256) as engine:
        engine.wait_healthy(120)
        run_dir = tmp_path / "run"
        result = run_to_end(run_dir, "--rollout-external-engine-addrs", f"127.0.0.1:{engine.port}",
                            "--rollout-num-gpus", "0", "--num-rollout", str(SHORT_RUN_ROLLOUTS),
                            "--eval-interval", str(SHORT_RUN_ROLLOUTS), timeout_s=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        rows = records(run_dir)
        assert [r["rollout_id"] for r in rows] == list(range(SHORT_RUN_ROLLOUTS))
        for row in rows:  # after each sync the external engine serves the trainer's weights
            assert row["metrics"]["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, row["metrics"]
        assert engine.process.alive()  # not the run's to stop
        status, info = request_blocking("GET", f"{engine.url}/model_info", None, timeout_s=10)
        assert status == 200 and json.loads(info)["weight_version"] == str(SHORT_RUN_ROLLOUTS)
        assert f"attached 1 external engine(s): {engine.url}" in (run_dir / "logs" / "controller.log").read_text()


def test_an_unreachable_external_engine_is_named_at_start(tmp_path: Path) -> None:
    port = planned_port()  # nothing listens there
    result = run_to_end(tmp_path / "run", "--rollout-external-engine-addrs", f"127.0.0.1:{port}", "--rollout-num-gpus",
                        "0", timeout_s=300)
    assert result.returncode == 1
    assert (f"external engine 0 at http://127.0.0.1:{port} (rollout.rollout_external_engine_addrs: 127.0.0.1:{port}) "
            "is unreachable") in result.stderr
