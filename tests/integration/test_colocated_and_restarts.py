"""Colocated mode end to end on the CPU twin, and restarted engines rejoining the weight-update group.

Real processes (controller, sglang-router, CPU engines started with --enable-memory-saver, a torchrun
trainer rank): the colocated tiny run learns with weights handed over through shared memory and
`/update_weights_from_tensor`, with no weight-update group (the engine and trainer rank 0 share a device,
which the group join refuses); released engine weights are discarded, so an interval > 1 only works if
the loop never releases weights without reloading them; an engine restarted twice with no sync due in
between (update_weights_interval larger than the run) still gets the weights through a new group.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path

import pytest

from tests.integration.run_helpers import interrupt, processes_mentioning, records, run_to_end, start_run, wait_for

pytestmark = pytest.mark.slow


def test_colocated_tiny_run_learns_and_serves_the_trainers_weights(tmp_path: Path) -> None:
    run_dir = tmp_path / "colocated"
    result = run_to_end(run_dir, "--colocate", "--eval-interval", "50", timeout_s=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert len(rows) == 100
    rewards = [r["metrics"]["rollout/reward_mean"] for r in rows]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last - first >= 0.3, f"reward went {first:.3f} -> {last:.3f}"
    for row in rows:  # after each update the engine's logprobs are the trainer's (same weights, float32)
        metrics = row["metrics"]
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5, (row["rollout_id"], metrics)
        assert metrics["weight_sync/new_group"] == 0.0 and metrics["weight_sync/buckets"] >= 1
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert controller_log.count("colocated engine(s) through /update_weights_from_tensor") == 100
    assert "(new group)" not in controller_log
    assert processes_mentioning(str(run_dir)) == []
    assert not list(Path("/dev/shm").glob("hpc_rl-weights-*")), "a shared-memory bucket was left behind"


def test_colocated_with_an_update_interval_keeps_serving_valid_weights(tmp_path: Path) -> None:
    """Interval 3: the engines keep version k for three rollouts (their weights are not released then)."""
    run_dir = tmp_path / "interval"
    result = run_to_end(run_dir, "--colocate", "--num-rollout", "6", "--update-weights-interval", "3",
                        "--eval-interval", "100", timeout_s=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    synced = [r["rollout_id"] for r in rows if "weight_sync/seconds" in r["metrics"]]
    assert synced == [2, 5]
    lags = [max(r["rollout_id"] - v for v in r["weight_versions_first_token"]) for r in rows]
    assert lags == [0, 1, 2, 0, 1, 2]  # served by the last synced version, never by discarded memory
    assert rows[3]["metrics"]["train/train_rollout_logprob_abs_diff"] < 1e-5  # right after a sync: equal
    assert rows[4]["metrics"]["train/train_rollout_logprob_abs_diff"] > 1e-4  # an older policy, as intended


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _engine0_events(run_dir: Path) -> list[str]:
    return [e["event"] for e in _status(run_dir).get("engine_events", []) if e["engine"] == 0]


def _engine0_pid(run_dir: Path) -> int:
    port = int(_status(run_dir)["components"]["engines"]["0"]["url"].rsplit(":", 1)[1])
    for line in processes_mentioning("hpc_rl.engines.cpu"):
        pid, command = line.split(":", 1)
        if f"--port {port} " in command + " ":
            return int(pid)
    raise AssertionError(f"no CPU engine on port {port}")


def test_engine_restarted_twice_without_a_sync_in_between_rejoins(tmp_path: Path) -> None:
    """No sync is ever due (interval > run): the only syncs are the pushes to restarted engines. The second
    restart comes back at the same URL as the first, with the group unchanged since: it must be rebuilt."""
    run_dir = tmp_path / "restarts"
    process = start_run(run_dir, "--num-rollout", "400", "--rollout-num-gpus", "2", "--update-weights-interval",
                        "100000", "--rollout-max-response-len", "16", "--eval-interval", "100000",
                        "--set", "controller.engine_health_interval=1")
    try:
        wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first rollout")
        for kill in (1, 2):
            os.kill(_engine0_pid(run_dir), signal.SIGKILL)
            wait_for(lambda: _engine0_events(run_dir).count("serving") == kill, 300, f"engine 0 serving again ({kill})")
        served_after = len(records(run_dir))
        wait_for(lambda: len(records(run_dir)) >= served_after + 3, 300, "three rollouts after the second restart")
        status = _status(run_dir)
        assert process.poll() is None, (run_dir.parent / "restarts.out").read_text()[-3000:]
    finally:
        if process.poll() is None:
            interrupt(process)
    assert _engine0_events(run_dir)[:8] == ["failed", "restarting", "restarted", "serving"] * 2
    engines = status["components"]["engines"]
    assert engines["0"]["restarts"] == 2 and engines["0"]["state"] == "serving" and engines["1"]["state"] == "serving"
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert controller_log.count("(new group)") == 2, "each restart must build a new weight-update group"
    assert processes_mentioning(str(run_dir)) == []
