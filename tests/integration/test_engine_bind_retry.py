"""An engine whose port is taken: the driver starts it again on a free port, and gives up clearly after
its limit. Real CPU engines started by the driver's own `start_engine` (the local launcher)."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.loading import write_resolved_config
from hpc_rl.process.child_process import free_port
from hpc_rl.launch import servers as servers_module
from hpc_rl.launch.driver import Driver
from hpc_rl.launch.steps import LocalStepLauncher

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@contextmanager
def squatting(*ports: int) -> Iterator[None]:
    """Another program listens on each of `ports` (loopback, where the local engine binds)."""
    sockets = []
    try:
        for port in ports:
            squatter = socket.socket()
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            sockets.append(squatter)
        yield
    finally:
        for squatter in sockets:
            squatter.close()


def local_driver(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Driver:
    monkeypatch.chdir(REPO)  # the config names assets/ relative to the repository
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"], ["--run-dir", str(run_dir)])
    write_resolved_config(config, run_dir)
    driver = Driver(run_dir, LocalStepLauncher(), local=True)
    driver.servers.engine_key = "test-engine-key"
    return driver


def stop_engines(driver: Driver) -> None:
    for step in driver.servers.engine_steps.values():
        step.stop(5.0)


def test_an_engine_whose_port_is_taken_starts_on_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    driver = local_driver(tmp_path / "run", monkeypatch)
    taken = driver.servers.ports.engines[0]
    try:
        with squatting(taken), caplog.at_level("WARNING", logger="hpc_rl.driver"):
            url = asyncio.run(driver.start_engine(0))
        port = int(url.rsplit(":", 1)[1])
        assert port != taken and port == driver.servers.ports.engines[0]
        assert f"engine 0 could not bind port {taken} on 127.0.0.1; retrying on port {port}" in caplog.text
        assert driver.servers.engine_steps[0].poll() is None, "the engine of the second attempt serves"
        assert "address already in use" in (tmp_path / "run" / "logs" / "engine-0.log").read_text().lower()
    finally:
        stop_engines(driver)


def test_an_engine_gives_up_after_its_bind_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = local_driver(tmp_path / "run", monkeypatch)
    planned, replacement = driver.servers.ports.engines[0], free_port()
    monkeypatch.setattr(servers_module, "free_port", lambda host="127.0.0.1": replacement)  # also taken
    try:
        with squatting(planned, replacement), pytest.raises(RuntimeError) as raised:
            asyncio.run(driver.servers.start_engine(0, retry_on_bind_failure=1))
    finally:
        stop_engines(driver)
    message = str(raised.value)
    assert re.search(rf"engine 0 could not bind a port on 127\.0\.0\.1: tried {planned}, {replacement}, each in use "
                     r"by another program; giving up after 2 attempt\(s\)", message), message
    assert "address already in use" in message.lower(), "the engine's own words are shown"
    assert all(step.poll() is not None for step in driver.servers.engine_steps.values()), "no engine left running"


def test_a_router_whose_ports_are_taken_starts_on_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Two local runs once collided on a planned port: the router is started again on free ports, and a
    local run's controller and torchrun rendezvous store bind port 0 (the OS picks as they bind)."""
    driver = local_driver(tmp_path / "run", monkeypatch)
    assert driver.servers.ports.controller == 0 and driver.servers.ports.rendezvous == 0
    taken = driver.servers.ports.router
    router = None
    try:
        with squatting(taken), caplog.at_level("WARNING", logger="hpc_rl.driver"):
            router = asyncio.run(driver.servers.start_router())
        assert router.port != taken and router.process.alive()
        assert f"sglang-router could not bind port {taken}" in caplog.text
        assert router.worker_urls() == []  # ours: it answers with the job's key
    finally:
        if router is not None:
            router.stop()
