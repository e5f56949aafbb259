"""Every rollout a checkpoint covers has its record (issue 37, case 7): the record of the rollout a checkpoint saves
is written after the save, so a controller killed between the two lost it (rollouts.jsonl [0, 1, 3, 4] after a
requeue). Each checkpoint now carries that record and a resume writes it when rollouts.jsonl lacks it. The real
loop (as the controller assembles it) against the recording fake trainer rank of test_run_loop_order."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from hpc_rl.config import load_config
from hpc_rl.controller.fault_hooks import (HOLD_CONTROLLER_AFTER_RETAIN, KILL_CONTROLLER_AFTER_SAVE,
                                          hold_here_if_asked, kill_here_if_asked)
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry, TrainerInfo
from hpc_rl.controller.rollout_stack import assemble_loop
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.protocol.messages import SaveCommand
from hpc_rl.telemetry.recorder import RunRecorder
from hpc_rl.telemetry.run_files import ROLLOUT_RECORDS
from hpc_rl.telemetry.scalars import ScalarLog
from tests.unit.test_run_loop_order import FakeFleet, FakeScheduler, answer_command


async def saving_trainer_rank(channel: TrainerChannel, saves: list[dict[str, Any]]) -> None:
    """Rank 0: keeps each save's controller state (what hpc_rl_state.json would hold); a sync has one bucket."""
    while True:
        command = await channel.next_command(0)
        if isinstance(command, SaveCommand):
            saves.append(json.loads(json.dumps(command.controller_state)))  # as the JSON file round-trips it
        await answer_command(channel, command)


def run_loop(run_dir: Path, *, num_rollout: int, restore: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    config = load_config(["configs/tiny_cpu.yaml"], ["--set", f"run_dir={run_dir}", "--save-interval", "2"])
    saves: list[dict[str, Any]] = []

    async def main() -> None:
        registry = Registry(trainer_world_size=1, num_engines=1)
        registry.add_trainer(TrainerInfo(rank=0, world_size=1, host="h", pid=1,
                                         info={"dp_rank": 0, "dp_size": 1, "device": "h/gpu0"}))
        registry.add_engine(EngineInfo(engine_index=0, url="http://e0", state=EngineState.SERVING, devices=["h/gpu0"]))
        channel = TrainerChannel(1)
        recorder = RunRecorder(run_dir, ScalarLog(None), num_rollout=num_rollout, print_fn=lambda line: None)
        loop = assemble_loop(config, scheduler=FakeScheduler([]), registry=registry, channel=channel,  # type: ignore[arg-type]
                             fleet=FakeFleet([]), recorder=recorder, evaluate=None,  # type: ignore[arg-type]
                             num_rollout=num_rollout)
        if restore is not None:
            loop.restore(restore)
        trainer = asyncio.create_task(saving_trainer_rank(channel, saves))
        try:
            await loop.run(resumed=restore is not None)
        finally:
            trainer.cancel()

    asyncio.run(main())
    return saves


def recorded(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / ROLLOUT_RECORDS).read_text().splitlines()]


@pytest.fixture(autouse=True)
def _in_repo(in_repo: Path) -> None:
    pass


def test_a_checkpoint_carries_its_rollouts_record_and_a_resume_writes_it_when_lost(tmp_path: Path) -> None:
    saves = run_loop(tmp_path, num_rollout=4)
    assert [s["next_rollout_id"] for s in saves] == [2, 4]  # save_interval 2: after rollouts 1 and 3
    records = recorded(tmp_path)
    assert [r["rollout_id"] for r in records] == [0, 1, 2, 3]
    for save in saves:
        carried = save["rollout_record"]
        written = records[save["next_rollout_id"] - 1]
        assert carried["rollout_id"] == written["rollout_id"]
        assert carried["sample_indices"] == written["sample_indices"] and carried["sample_indices"]

    # the controller died after rollout 3's checkpoint committed, before its record was written (case 7)
    (tmp_path / ROLLOUT_RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    run_loop(tmp_path, num_rollout=6, restore=saves[-1])  # the requeued attempt resumes at rollout 4
    after = recorded(tmp_path)
    assert [r["rollout_id"] for r in after] == [0, 1, 2, 3, 4, 5]
    assert after[3]["recovered_from_checkpoint"] is True
    assert after[3]["sample_indices"] == records[3]["sample_indices"]


def test_a_record_already_written_is_not_written_twice(tmp_path: Path) -> None:
    saves = run_loop(tmp_path, num_rollout=2)
    run_loop(tmp_path, num_rollout=3, restore=saves[-1])
    assert [r["rollout_id"] for r in recorded(tmp_path)] == [0, 1, 2]


def test_the_fault_hook_kills_once_and_only_at_its_rollout(tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    kill_here_if_asked(KILL_CONTROLLER_AFTER_SAVE, 2, environ={})  # unset: nothing
    kill_here_if_asked(KILL_CONTROLLER_AFTER_SAVE, 1, environ={KILL_CONTROLLER_AFTER_SAVE: f"2:{marker}"})
    assert not marker.exists()
    marker.touch()  # already claimed (the requeued attempt): nothing
    kill_here_if_asked(KILL_CONTROLLER_AFTER_SAVE, 2, environ={KILL_CONTROLLER_AFTER_SAVE: f"2:{marker}"})
    marker.unlink()
    pid = os.fork()
    if pid == 0:  # the child reaches the point: it is SIGKILLed
        kill_here_if_asked(KILL_CONTROLLER_AFTER_SAVE, 2, environ={KILL_CONTROLLER_AFTER_SAVE: f"2:{marker}"})
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9 and marker.exists()


def test_the_hold_hook_holds_once_and_only_at_its_rollout(tmp_path: Path) -> None:
    marker = tmp_path / "held"
    environ = {HOLD_CONTROLLER_AFTER_RETAIN: f"2:{marker}"}

    async def run() -> None:
        await hold_here_if_asked(HOLD_CONTROLLER_AFTER_RETAIN, 1, environ=environ)  # another rollout: passes
        assert not marker.exists()
        held = asyncio.create_task(hold_here_if_asked(HOLD_CONTROLLER_AFTER_RETAIN, 2, environ=environ))
        await asyncio.sleep(0.05)
        assert not held.done() and marker.exists()  # held until cancelled (the job's end)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await asyncio.wait_for(hold_here_if_asked(HOLD_CONTROLLER_AFTER_RETAIN, 2, environ=environ), 1)  # once

    asyncio.run(run())


def test_a_new_run_dir_that_loads_another_runs_checkpoint_does_not_get_a_stray_record(tmp_path: Path) -> None:
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    saves = run_loop(tmp_path / "first", num_rollout=4)
    run_loop(tmp_path / "second", num_rollout=6, restore=saves[-1])  # --load the first run's checkpoints
    assert [r["rollout_id"] for r in recorded(tmp_path / "second")] == [4, 5]
