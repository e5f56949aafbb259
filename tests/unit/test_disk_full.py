"""A full disk names itself: checkpoint saves (a fake full disk under a real torch_dist save in a
one-rank gloo world), status.json (a real tmpfs), and the run's log file (/dev/full)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_rl.telemetry.run_files import RunLogFileHandler, describe_write_error, write_text_atomically
from hpc_rl.training.checkpoint import (TRACKER, CheckpointSaveFailed, _save_atomically, iteration_dir,
                                        latest_iteration)


@pytest.fixture
def one_rank_world(tmp_path: Path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from hpc_rl.training.cpu_switch import apply_cpu_switches

    apply_cpu_switches()  # what every trainer rank does on a CPU build (dist_checkpointing syncs "cuda")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_weights(value: float) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), value))}


def fake_full_disk(directory: Path) -> None:
    """Stands in for the file system filling up halfway through the save: a partial file, then ENOSPC."""
    (directory / "partial.bin").write_bytes(b"\0" * 100)
    raise OSError(errno.ENOSPC, "No space left on device", str(directory / "hpc_rl_state.json"))


def fake_checkpoint_exception(directory: Path) -> None:
    """Stands in for torch's report of a failed write (a BaseException, with torch's odd wording)."""
    from torch.distributed.checkpoint.api import CheckpointException

    worker_failure = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    raise CheckpointException("write", {0: (worker_failure, [])})


def test_a_full_disk_while_checkpointing_is_named_cleaned_up_and_the_previous_one_kept(
        tmp_path: Path, one_rank_world) -> None:
    from megatron.core import dist_checkpointing

    root = tmp_path / "checkpoints"
    _save_atomically(root, 0, sharded_weights(1.0))
    with pytest.raises(CheckpointSaveFailed) as failure:
        _save_atomically(root, 1, sharded_weights(2.0), fake_full_disk)
    message = str(failure.value)
    assert message.startswith(f"no space left on {root} (")
    assert f"the previous checkpoint {iteration_dir(root, 0)} is kept and loadable" in message
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000000", TRACKER]  # no iter_0000001.tmp
    assert latest_iteration(root) == 0
    loaded = dist_checkpointing.load(sharded_weights(0.0), str(iteration_dir(root, 0)))
    assert torch.equal(loaded["w"], torch.full((4,), 1.0))


def test_torchs_checkpoint_exception_becomes_an_exception_the_trainer_reports(tmp_path: Path, one_rank_world) -> None:
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointSaveFailed, match=r"saving checkpoint iter_0000003 .* failed \(CheckpointException") as failure:
        _save_atomically(root, 3, sharded_weights(1.0), fake_checkpoint_exception)
    assert isinstance(failure.value, Exception)  # torch's own is a BaseException: `except Exception` missed it
    assert "there is no earlier checkpoint" in str(failure.value)
    assert not any(root.iterdir())


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "filler").write_bytes(b"\0" * (64 << 10))
    except OSError:
        pass  # full now
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=False)  # lazy: a closed controller may still hold a log file there


def test_status_file_on_a_full_disk_leaves_no_temporary_file(full_tmpfs: Path) -> None:
    path = full_tmpfs / "status.json"
    with pytest.raises(OSError) as failure:
        write_text_atomically(path, json.dumps({"rollout_id": 1}) * 2000)
    assert describe_write_error(failure.value, path) == f"no space left on {full_tmpfs} (writing status.json)"
    assert sorted(p.name for p in full_tmpfs.iterdir()) == ["filler"]  # the old code left an empty status.tmp


def test_controller_warns_once_about_status_json_on_a_full_disk(full_tmpfs: Path, monkeypatch, caplog) -> None:
    from tests.unit.test_status import REPO_ROOT, tiny_run_dir
    from hpc_rl.controller.app import Controller
    from hpc_rl.protocol import create_secret, secret_path

    monkeypatch.chdir(REPO_ROOT)
    (full_tmpfs / "filler").unlink()
    run_dir, config = tiny_run_dir(full_tmpfs)

    async def main() -> None:
        controller = Controller(config, secret=create_secret(secret_path(run_dir)), router=None, router_url=None)
        await controller.start()
        try:
            (full_tmpfs / "filler").write_bytes(b"\0" * (64 << 10))
        except OSError:
            pass
        try:
            for _ in range(5):
                controller.write_status()
        finally:
            controller.stopping = True
            await controller.close()

    with caplog.at_level(logging.WARNING, logger="hpc_rl.controller.app"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "status.json" in r.getMessage()]
    assert warnings == [f"status.json not updated: no space left on {run_dir} (writing status.json) "
                        "(retrying every 2 s; said once)"]
    assert not list(run_dir.glob("*.tmp"))


def test_log_file_on_a_full_device_says_so_once(tmp_path: Path) -> None:
    console = (tmp_path / "console.txt").open("w")
    handler = RunLogFileHandler("/dev/full", console=console)  # every write: ENOSPC
    logger = logging.getLogger("test_log_file_full")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for index in range(50):
            logger.warning("line %d", index)
    finally:
        logger.removeHandler(handler)
        console.close()
    lines = (tmp_path / "console.txt").read_text().splitlines()
    assert lines == ["hpc_rl: log file /dev/full: no space left on /dev (writing full); its lines are lost until "
                     "it can be written again"]  # logging's own: 50 x "--- Logging error ---" + traceback
    assert handler.dropped == 50


def test_rollouts_jsonl_on_a_full_disk_is_named_and_never_left_with_half_a_line(full_tmpfs: Path) -> None:
    from hpc_rl.telemetry.run_files import append_rollout_record

    (full_tmpfs / "filler").unlink()
    (full_tmpfs / "filler").write_bytes(b"\0" * (60 << 10))  # ~4 KiB left: a few records fit, then not
    records = full_tmpfs / "rollouts.jsonl"
    metrics = {f"rollout/metric_{i}": float(i) for i in range(40)}
    with pytest.raises(OSError) as failure:
        for rollout_id in range(1000):
            append_rollout_record(records, rollout_id, metrics, [])
    assert f"no space left on {full_tmpfs} (writing rollouts.jsonl)" in str(failure.value)
    lines = records.read_text().splitlines(keepends=True)
    assert lines and all(line.endswith("\n") and json.loads(line)["rollout_id"] == i for i, line in enumerate(lines))
