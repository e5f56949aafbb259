"""An engine dying mid-sync must not hang the trainer (issue 22 item 3).

On NCCL, rank 0's `wait()` returns at once and a broadcast to a dead engine never completes: the next GPU work
hangs until NCCL's watchdog (600 s). The gloo twin (`weights.collective_stream`) behaves alike: the first test
sees the hang (bounded here by a 3 s group timeout) and that an abort of the group ends it at once. The second
runs the whole system: an engine exits when asked for a bucket; the controller sees its update fail, has rank 0
abort the group, fails (restarts) the engine, pushes the weights again over a new group, and the run goes on.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from tests.integration.run_helpers import processes_mentioning, records, run_to_end

pytestmark = pytest.mark.slow

BUCKET_BYTES = 32 * 1024 * 1024
"""More than loopback's socket buffers: rank 0's send to a dead peer fails instead of landing in a buffer."""


def _peer(port: int, group_name: str, joined) -> None:
    """An engine that joins the weight-update group and dies before receiving anything."""
    import os

    from hpc_rl.weights.process_group import init_weight_update_group

    init_weight_update_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                             group_name=group_name, backend="gloo", timeout_seconds=60, device_id="peer/gpu0")
    joined.wait(60)
    os._exit(1)


def broadcast_to_a_dead_peer(*, abort: bool) -> tuple[float, float, str]:
    """This process is rank 0; its peer joins and dies. (seconds in wait(), seconds in all, the outcome)."""
    import torch
    import torch.distributed as dist

    from hpc_rl.process.child_process import planned_port
    from hpc_rl.weights.collective_stream import CollectiveStream, CollectiveTimeout
    from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group

    context = multiprocessing.get_context("fork")  # this process has torch loaded: the peer starts in ms
    joined, port, name = context.Event(), planned_port(), f"fault_test_{abort}"
    peer = context.Process(target=_peer, args=(port, name, joined))
    peer.start()
    group = init_weight_update_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                     group_name=name, backend="gloo", timeout_seconds=60, device_id="r0/gpu0")
    joined.set()
    peer.join(60)  # the peer is gone
    stream = CollectiveStream("gloo", timeout_s=3.0)
    start = time.monotonic()
    work = dist.broadcast(torch.ones(BUCKET_BYTES, dtype=torch.uint8), src=0, group=group, async_op=True)
    stream.issued(work, "broadcast")
    stream.wait(work)
    waited, outcome = time.monotonic() - start, "no error"
    try:
        if abort:
            stream.abort(group)
        stream.synchronize()
    except CollectiveTimeout as error:
        outcome = f"timeout: {error}"
        destroy_weight_update_group(group)
    return waited, time.monotonic() - start, outcome


def test_the_gloo_twin_hangs_on_a_dead_peer_as_nccl_does_until_the_group_is_aborted() -> None:
    waited, total, outcome = broadcast_to_a_dead_peer(abort=False)
    assert waited < 1.0  # NCCL's wait(): the CPU moves on
    assert outcome.startswith("timeout: weight-update broadcast did not complete within 3 s") and total >= 3.0
    waited, total, outcome = broadcast_to_a_dead_peer(abort=True)
    assert waited < 1.0 and outcome == "no error" and total < 2.0  # the abort drops it: nothing waits


@pytest.mark.parametrize("answer_workers", [0, 1])  # 1: the update's exchanges are the answer worker's
def test_an_engine_dying_mid_sync_is_restarted_and_the_run_goes_on(tmp_path: Path, monkeypatch,
                                                                   answer_workers: int) -> None:
    run_dir = tmp_path / "engine-dies-mid-sync"
    marker = tmp_path / "engine-died"
    monkeypatch.setenv("HPC_RL_FAULT_EXIT_IN_WEIGHT_SYNC", str(marker))
    started = time.monotonic()
    result = run_to_end(run_dir, "--num-rollout", "4", "--rollout-num-gpus", "2", "--eval-interval", "1000",
                        "--update-weight-buffer-size", str(BUCKET_BYTES), "--answer-parse-workers", str(answer_workers),
                        timeout_s=300)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert marker.exists()  # an engine did die mid-sync
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    recovered = [r for r in rows if "weight_sync/recovery_seconds" in r["metrics"]]
    assert len(recovered) == 1 and recovered[0]["metrics"]["weight_sync/recovery_seconds"] < 60
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "aborting the weight-update group" in controller_log and "failed mid-update" in controller_log
    assert ("answer worker(s))" in controller_log) == bool(answer_workers)
    assert "restarting from the last checkpoint" not in result.stderr  # the trainer never failed
    for row in rows[recovered[0]["rollout_id"] + 1:]:  # the engines serve the trainer's weights again
        assert row["metrics"]["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, row["metrics"]
    assert elapsed < 240
    assert processes_mentioning(str(run_dir)) == []
