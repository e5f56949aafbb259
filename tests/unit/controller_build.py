"""The controller's run loop as `Controller.ready()` builds it from a config (no engines, no trainer), for tests of
what the flags make of the loop's parts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hpc_rl.config.schema import RunConfig
from hpc_rl.controller.app import Controller
from hpc_rl.controller.run_loop import RunLoop
from hpc_rl.protocol.secret import create_secret


def built_loop(config: RunConfig, tmp_path: Path) -> RunLoop:
    """Start a controller on `config`, wait for its rollout stack, close it; its loop (built, never run)."""

    async def scenario() -> RunLoop:
        controller = Controller(config, secret=create_secret(tmp_path / "secret"), router=None, router_url=None)
        try:
            await controller.start()
            await controller.ready()
            assert controller.loop is not None
            return controller.loop
        finally:
            await controller.close()

    return asyncio.run(scenario())
