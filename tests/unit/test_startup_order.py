"""Start-up sequencing of the driver and the trainer's light Megatron import (issue 11)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.launch.driver import Driver
from hpc_rl.launch.steps import LocalStepLauncher
from hpc_rl.launch.submit_args import assign_run_dir
from hpc_rl.protocol.secret import create_secret, secret_path
from hpc_rl.training.cpu_switch import deferred_compile, light_megatron_import

REPO = Path(__file__).resolve().parents[2]


def make_driver(tmp_path: Path) -> Driver:
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"], ["--run-dir", str(tmp_path / "run")])
    config = assign_run_dir(config)
    write_resolved_config(config, config.run_dir)
    create_secret(secret_path(config.run_dir), overwrite=True)
    return Driver(config.run_dir, LocalStepLauncher(), local=True)


def test_engines_load_while_the_control_plane_starts_and_are_cancelled_when_it_fails(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    events: list[str] = []

    async def start_engine(index: int) -> str:
        events.append(f"engine {index} spawned")
        try:
            await asyncio.Event().wait()  # loading until cancelled
        finally:
            events.append(f"engine {index} start cancelled")
        return "never"

    async def start_control_plane(secret: object) -> None:
        events.append("control plane starting")
        await asyncio.sleep(0)  # the router's wait: the engine starts run now
        events.append("control plane waited")
        raise RuntimeError("the router did not listen")

    driver.start_engine = start_engine  # type: ignore[method-assign]
    driver._start_control_plane = start_control_plane  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="router did not listen"):
        asyncio.run(driver.run())
    assert events == ["control plane starting", "engine 0 spawned", "control plane waited",
                      "engine 0 start cancelled"]


def test_a_failing_engine_start_fails_the_run_after_the_control_plane_is_up(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)

    async def start_engine(index: int) -> str:
        raise RuntimeError(f"engine {index} exited before it was healthy")

    async def start_control_plane(secret: object) -> None:
        await asyncio.sleep(0.01)

    driver.start_engine = start_engine  # type: ignore[method-assign]
    driver._start_control_plane = start_control_plane  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="engine 0 exited before it was healthy"):
        asyncio.run(driver.run())


def test_deferred_compile_compiles_once_at_the_first_call() -> None:
    compiled: list[tuple[object, dict[str, object]]] = []

    def compile_fn(model: object, **options: object) -> object:
        compiled.append((model, options))
        return lambda *args: ("compiled", model(*args))  # type: ignore[operator]

    compile_later = deferred_compile(compile_fn)

    @compile_later
    def double(x: int) -> int:
        return 2 * x

    @compile_later(dynamic=True)
    def triple(x: int) -> int:
        return 3 * x

    assert compiled == [] and double.__name__ == "double"
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert triple(1) == ("compiled", 3)
    assert [(getattr(m, "__name__"), o) for m, o in compiled] == [("double", {}), ("triple", {"dynamic": True})]
    module = torch.nn.Linear(1, 1)
    compile_later(module)  # not a function: compiled at once, as torch.compile would
    assert compiled[-1] == (module, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the switch is for CPU-only processes")
def test_light_megatron_import_is_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    original = torch.compile
    with light_megatron_import():
        assert torch.compile is not original
        with pytest.raises(ImportError):
            import wandb  # noqa: F401
        with pytest.raises(ImportError):  # Megatron's timers import it only to write to a writer never given
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    assert torch.compile is original
    assert "wandb" not in sys.modules and "torch.utils.tensorboard" not in sys.modules  # importable again after


def test_the_local_driver_imports_no_aiohttp_before_it_starts_the_steps() -> None:
    """What `python -m hpc_rl.submit --executor local` imports before its first step starts is start-up on
    the trainer's critical path: aiohttp is only for remote rewards (rewards.remote opens it per session)."""
    import subprocess

    probe = "import sys, hpc_rl.submit, hpc_rl.launch.local; print('aiohttp' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == "False"
