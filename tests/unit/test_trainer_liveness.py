"""Trainer liveness (issue 37): the controller names a trainer rank that stops beating during a command and
fails the command after `controller.trainer_command_timeout`; a rank that beats through a long command is left
alone; the heartbeat thread of a real `ControllerLink` beats a real controller's channel over the protocol."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest

from hpc_rl.config.loading import load_config, write_resolved_config
from hpc_rl.config.validation import ValidationFailed, validate
from hpc_rl.controller.app import Controller
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerUnresponsive
from hpc_rl.protocol import create_secret, secret_path
from hpc_rl.protocol.messages import CommandDone, StopCommand
from tests.unit.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


async def beat(channel: TrainerChannel, rank: int, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        channel.heard_from(rank)
        await asyncio.sleep(every_s)


def test_a_silent_rank_is_named_then_fails_the_command_and_a_beating_one_is_not() -> None:
    async def main() -> tuple[str, list[str], float]:
        # rank 0 beats every 0.05 s: only a 1 s stall of this process (load, a full GC) would have it named
        channel = TrainerChannel(2, heartbeat_interval_s=0.05, silence_warn_s=1.0, silence_timeout_s=1.5)
        stop = asyncio.Event()
        beating = asyncio.create_task(beat(channel, 0, 0.05, stop))  # rank 1 never beats: SIGSTOPped
        seen: list[str] = []

        async def watch_status() -> None:
            while not seen:
                seen.extend(channel.liveness_warnings())
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_status())
        start = time.monotonic()
        with pytest.raises(TrainerUnresponsive) as failed:
            await channel.run(lambda rank, seq: StopCommand(seq=seq, reason="test"))
        took = time.monotonic() - start
        stop.set()
        await asyncio.gather(beating, watcher)
        return str(failed.value), seen, took

    message, seen, took = asyncio.run(main())
    assert message.startswith("trainer rank 1 has not answered for ")
    assert "StopCommand" in message and "controller.trainer_command_timeout" in message
    assert seen and seen[0].startswith("trainer rank 1 has not answered for ")
    assert "stopped or hung?" in seen[0]
    assert not any("rank 0" in line for line in seen)
    assert 1.5 <= took < 15.0


def test_a_long_command_whose_ranks_beat_is_never_failed() -> None:
    async def main() -> list[CommandDone]:
        channel = TrainerChannel(2, heartbeat_interval_s=0.05, silence_warn_s=0.5, silence_timeout_s=1.0)
        stop = asyncio.Event()
        beats = [asyncio.create_task(beat(channel, rank, 0.05, stop)) for rank in (0, 1)]

        async def finish_later() -> None:
            await asyncio.sleep(2.5)  # several timeouts long
            for rank in (0, 1):
                channel.on_done(CommandDone(rank=rank, seq=1))

        finisher = asyncio.create_task(finish_later())
        done = await channel.run(lambda rank, seq: StopCommand(seq=seq, reason="test"))
        assert channel.liveness_warnings() == []
        stop.set()
        await asyncio.gather(finisher, *beats)
        return done

    assert [d.rank for d in asyncio.run(main())] == [0, 1]


def test_a_rank_that_beats_again_is_no_longer_named() -> None:
    channel = TrainerChannel(1, heartbeat_interval_s=0.05, silence_warn_s=0.2, silence_timeout_s=10.0)

    async def main() -> list[str]:
        run = asyncio.create_task(channel.run(lambda rank, seq: StopCommand(seq=seq, reason="test")))
        await asyncio.sleep(0.5)
        named = channel.liveness_warnings()
        channel.heard_from(0)  # SIGCONT
        channel.on_done(CommandDone(rank=0, seq=1))
        await run
        return named

    named = asyncio.run(main())
    assert len(named) == 1 and re.match(r"trainer rank 0 has not answered for \d+\.\d s during StopCommand", named[0])
    assert channel.liveness_warnings() == []


def test_the_bounds_follow_trainer_command_timeout() -> None:
    default = TrainerChannel.with_timeout(4, 600.0)
    assert (default.heartbeat_interval_s, default.silence_warn_s, default.silence_timeout_s) == (5.0, 30.0, 600.0)
    short = TrainerChannel.with_timeout(1, 6.0)
    assert (short.heartbeat_interval_s, short.silence_warn_s) == (1.0, 3.0)


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_trainer_command_timeout_must_be_positive(tmp_path: Path, value: str) -> None:
    os.chdir(REPO_ROOT)
    config = load_config([REPO_ROOT / "configs/tiny_cpu.yaml"],
                         ["--set", f"run_dir={tmp_path}", "--set", f"controller.trainer_command_timeout={value}"])
    with pytest.raises(ValidationFailed, match="controller.trainer_command_timeout"):
        validate(config, check_files=False)


def test_the_heartbeat_thread_of_a_real_link_beats_a_real_controller(tmp_path: Path, monkeypatch) -> None:
    """ControllerLink (the rank's side, blocking, in a thread) -> protocol -> Controller -> TrainerChannel."""
    from hpc_rl.training.controller_link import ControllerLink

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chdir(REPO_ROOT)
    config = load_config([REPO_ROOT / "configs/tiny_cpu.yaml"],
                         ["--set", f"run_dir={run_dir}", "--set", "controller.trainer_command_timeout=0.6"])
    write_resolved_config(config, run_dir)

    async def main() -> tuple[int, int]:
        controller = Controller(config, secret=create_secret(secret_path(run_dir)), router=None, router_url=None)
        await controller.start()
        host, port = controller.address
        link = await asyncio.to_thread(ControllerLink, run_dir, rank=0, world_size=1, info={},
                                       address=f"{host}:{port}")
        try:
            assert link.heartbeat is not None and link.heartbeat.interval_s == pytest.approx(0.1)
            heard: set[float] = set()  # the times the controller's channel heard rank 0, as it records them

            def heard_again() -> bool:
                heard.add(controller.channel._heard.get(0, -1.0))
                return len(heard - {-1.0}) >= 5
            await wait_until(heard_again, what="rank 0 heard 5 times")  # by its beats: the link sends nothing else
            return link.heartbeat.beats, len(heard - {-1.0})
        finally:
            link.close()
            await controller.close()

    beats, heard = asyncio.run(main())
    # heard 5 times: the Hello at most once, then beats, all acknowledged but the one in flight at most
    assert heard >= 5 and beats >= 3


def test_status_prints_the_warnings_a_run_reports() -> None:
    from hpc_rl.status import format_status

    text = format_status({"source": "controller (live)", "state": "running", "rollout_id": 171, "num_rollout": 400,
                          "warnings": ["trainer rank 0 has not answered for 45 s during TrainCommand: stopped or hung?"]})
    assert "run: running" in text
    assert "WARNING: trainer rank 0 has not answered for 45 s during TrainCommand: stopped or hung?" in text
