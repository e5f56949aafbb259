"""The smaller faults of issue 37 (case 8), each checked against what it got wrong: the W&B key readable by others
in config.resolved.yaml, a reward timeout naming the samples queued behind the call that blocked instead of that
call, the router's exit unnoticed (a zombie), "scancel None" suggested for a local run, a full disk on the
TensorBoard event file naming no file, a bool reward taken as 1.0 without a word."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import Registry
from hpc_rl.data.samples import Sample
from hpc_rl.process.child_process import ChildProcess
from hpc_rl.engines.router import RouterProcess
from hpc_rl.launch.run_attempts import config_changes, keep_previous_config
from hpc_rl.launch.run_lock import RunDirLocked, acquire
from hpc_rl.rewards import RewardError, RewardSpec, reward_group
from hpc_rl.rewards.reward_thread import RewardThread
from hpc_rl.telemetry.event_file import ScalarEventFile
from tests.unit.test_run_lock import live_process, no_slurm, write_lock  # noqa: F401 (a fixture)
from tests.unit.waiting import wait_until

TINY = "configs/tiny_cpu.yaml"
KEY = "k" * 36 + "1234"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_wandb_key_is_never_readable_by_others(tmp_path: Path, in_repo: Path, capsys) -> None:
    keyed = load_config([TINY], ["--set", f"run_dir={tmp_path / 'keyed'}", "--use-wandb", "--wandb-key", KEY])
    path = write_resolved_config(keyed, keyed.run_dir)
    assert KEY in path.read_text() and mode_of(path) == 0o600  # old: 0644, the key readable by every user
    plain = load_config([TINY], ["--set", f"run_dir={tmp_path / 'plain'}"])
    assert mode_of(write_resolved_config(plain, plain.run_dir)) == 0o644
    changed = load_config([TINY], ["--set", f"run_dir={tmp_path / 'keyed'}", "--use-wandb", "--wandb-key", "x" * 40])
    said = keep_previous_config(keyed.run_dir, changed)
    assert said is not None and KEY not in said and "logging.wandb_key: <a key, not shown>" in said
    kept = Path(keyed.run_dir) / "config_history" / "attempt-1.yaml"
    assert KEY in kept.read_text() and mode_of(kept) == 0o600
    assert config_changes({"logging": {"wandb_key": None}}, {"logging": {"wandb_key": KEY}}) == [
        "logging.wandb_key: None -> <a key, not shown>"]


BLOCKS_ON_19 = textwrap.dedent(
    """
    import pathlib, time

    async def reward(args, sample):
        if sample.index == 19:
            pathlib.Path(__file__).with_suffix(".started").touch()  # the test waits for it
            time.sleep(2.5)     # blocking, in an async def: it holds the reward thread
        return 1.0
    """
)


def test_a_reward_timeout_names_the_call_that_blocks_not_the_samples_queued_behind_it(tmp_path: Path) -> None:
    plugin = tmp_path / "blocks_on_19.py"
    plugin.write_text(BLOCKS_ON_19)
    thread = RewardThread()
    spec = RewardSpec(custom_rm_path=f"{plugin}:reward", timeout_s=1.0, thread=thread)

    def group(first: int) -> list[Sample]:
        return [Sample(index=i, group_index=first // 8, prompt="p", prompt_token_ids=[1], label="1",
                       response_text="1") for i in range(first, first + 8)]

    async def scenario() -> str:
        blocked = asyncio.create_task(reward_group(spec, group(16)))  # sample 19 starts and blocks the thread
        await wait_until(plugin.with_suffix(".started").exists, what="sample 19's reward started")
        with pytest.raises(RewardError) as failed:
            await reward_group(spec, group(0))  # queued behind it: times out without having started
        await asyncio.gather(blocked, return_exceptions=True)
        return str(failed.value)

    try:
        message = asyncio.run(scenario())
    finally:
        thread.close()
    assert message.startswith("reward failed for sample index 0 ")
    assert "this call never started: the reward thread is held by the call for sample index 19" in message


def test_the_router_s_exit_is_reaped_reported_and_the_engines_reached_directly(tmp_path: Path) -> None:
    router = RouterProcess(log_path=tmp_path / "router.log")
    router.process = ChildProcess([sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "router.log",
                                  name="sglang-router")  # a real process that exits as a crashed router would
    router.process.start()
    pid = router.process.pid
    while open(f"/proc/{pid}/stat").read().split()[2] != "Z":  # exited, not reaped: a zombie
        time.sleep(0.01)
    lost: list[bool] = []
    fleet = EngineFleet(Registry(trainer_world_size=1, num_engines=1), router, api_key=None, restart=None,
                        max_restarts=0, health_interval_s=3600)
    fleet.on_router_lost = lambda: lost.append(True)
    fleet.check_router()
    assert not os.path.exists(f"/proc/{pid}")  # reaped
    assert fleet.router is None and lost == [True]
    assert fleet.events[-1]["event"] == "router exited"
    assert "sglang-router exited with code 3" in fleet.events[-1]["detail"]
    fleet.check_router()  # said once
    assert len(fleet.events) == 1


def test_a_local_run_s_lock_says_kill_not_scancel_none(tmp_path: Path, live_process) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    write_lock(run_dir, pid=live_process.pid)
    with pytest.raises(RunDirLocked) as refused:
        acquire(run_dir, role="submit", slurm_state=no_slurm)
    assert f"(kill {live_process.pid})" in str(refused.value)
    assert "scancel" not in str(refused.value)
    write_lock(tmp_path / "slurm", pid=live_process.pid, job_id="41")
    with pytest.raises(RunDirLocked) as slurm:
        acquire(tmp_path / "slurm", role="submit", slurm_state=lambda job: "RUNNING")
    assert "(scancel 41)" in str(slurm.value)


def test_a_full_disk_names_the_tensorboard_event_file(tmp_path: Path, monkeypatch) -> None:
    events = ScalarEventFile(tmp_path / "tb")

    class FullDiskFake:
        """A fake file object: every write fails as on a full disk."""

        closed = False

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = close = lambda self: None

    monkeypatch.setattr(events, "_file", FullDiskFake())
    with pytest.raises(OSError) as full:
        events.add_scalar("rollout/reward_mean", 0.5, 1)
    assert full.value.errno == errno.ENOSPC
    assert f"no space left on {tmp_path / 'tb'} (writing {events.path.name})" in str(full.value)
    assert "TensorBoard event file" in str(full.value)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_on_a_real_device_names_the_event_file(tmp_path: Path) -> None:
    events = ScalarEventFile(tmp_path / "tb")
    events._file.close()
    events._file = open("/dev/full", "ab")  # every write: ENOSPC, from the kernel
    events.add_scalar("x", 1.0, 1)  # buffered
    with pytest.raises(OSError, match=r"TensorBoard event file: no space left on .*events\.out\.tfevents"):
        events.flush()


def test_a_bool_reward_is_taken_as_1_or_0_and_said_once(tmp_path: Path, caplog) -> None:
    plugin = tmp_path / "bool_rm.py"
    plugin.write_text("async def reward(args, sample):\n    return sample.index == 0\n")
    spec = RewardSpec(custom_rm_path=f"{plugin}:reward")
    samples = [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], label="1", response_text="1")
               for i in range(3)]
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(reward_group(spec, samples)) == [1.0, 0.0, 0.0]
        asyncio.run(reward_group(spec, samples))
    said = [r.getMessage() for r in caplog.records if "returned a bool" in r.getMessage()]
    assert len(said) == 1 and f"{plugin}:reward" in said[0] and "taken as" in said[0]
