"""Resume state rides an authenticated message, not the Hello: a Hello is read before its MAC is checked,
so what a peer can make the controller read then is bounded by a small first-frame limit; trainer rank
0's resume state (any size) follows the handshake as `ResumeState`. A real controller on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.controller.app import Controller
from hpc_rl.protocol import framing
from hpc_rl.protocol.connection import connect
from hpc_rl.protocol.errors import ProtocolError
from hpc_rl.protocol.messages import Ack, Hello, ResumeState
from hpc_rl.protocol.secret import create_secret

BULKY_STATE = {"buffer": ["x" * 1000] * 200}
"""A controller state of ~200 KiB (a partial-rollout buffer saved with a checkpoint grows like this)."""


def make_controller(tmp_path: Path, in_repo: Path) -> Controller:
    config = load_config([in_repo / "configs" / "tiny_cpu.yaml"])
    config.run_dir = str(tmp_path)
    config.eval.eval_prompt_data = []
    config.cluster.actor_num_nodes = 1
    return Controller(config, secret=create_secret(tmp_path / "secret"), router=None, router_url=None)


def trainer_hello(**info: object) -> Hello:
    return Hello(role="trainer", rank=0, world_size=1, host="h", pid=1, info=dict(info))


def test_the_first_frame_limit_leaves_no_room_for_bulky_state() -> None:
    assert framing.HANDSHAKE_MAX_FRAME_BYTES <= 64 << 10  # was 1 MiB, sized for resume state in the Hello


def test_a_hello_carrying_resume_state_is_refused_unread(tmp_path: Path, in_repo: Path) -> None:
    async def scenario() -> None:
        controller = make_controller(tmp_path, in_repo)
        await controller.start()
        try:
            hello = trainer_hello(resume={"rollout_id": 3, "controller_state": BULKY_STATE})
            with pytest.raises(ProtocolError, match="too large|exceeds|limit"):
                await connect("127.0.0.1", controller.address[1], controller.secret, hello)
            assert controller.registry.trainers == {}, "a refused Hello registers nothing"
        finally:
            await controller.close()

    asyncio.run(scenario())


def test_resume_state_follows_the_handshake(tmp_path: Path, in_repo: Path) -> None:
    async def scenario() -> None:
        controller = make_controller(tmp_path, in_repo)
        await controller.start()
        try:
            conn = await connect("127.0.0.1", controller.address[1], controller.secret,
                                 trainer_hello(resume_follows=True))
            waiting = asyncio.create_task(controller._wait_resume_state())
            await asyncio.sleep(0.2)
            assert not waiting.done(), "the controller waits for the announced state"
            state = ResumeState(rank=0, rollout_id=3, controller_state=BULKY_STATE)
            assert await conn.request(state) == Ack()
            assert await waiting == {"rollout_id": 3, "controller_state": BULKY_STATE}
            with pytest.raises(ProtocolError, match="already sent"):
                await conn.request(state)
            await conn.close()
        finally:
            await controller.close()

    asyncio.run(scenario())


def test_only_trainer_rank_0_sends_resume_state(tmp_path: Path, in_repo: Path) -> None:
    async def scenario() -> None:
        controller = make_controller(tmp_path, in_repo)
        await controller.start()
        try:
            conn = await connect("127.0.0.1", controller.address[1], controller.secret, Hello(role="status"))
            with pytest.raises(ProtocolError, match="trainer rank 0 only"):
                await conn.request(ResumeState(rank=0, rollout_id=1))
            assert controller.resume_state is None
        finally:
            await controller.close()

    asyncio.run(scenario())
