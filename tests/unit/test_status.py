"""`python -m hpc_rl.status` against a real controller (in this process, on loopback) and against the
files a run leaves: a live run with a trainer rank registered, a controller that refuses, a corrupt
status.json or controller.address, and a run that ended (nothing shown as serving)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from hpc_rl import status as status_cli
from hpc_rl.config.loading import load_config, write_resolved_config
from hpc_rl.controller.app import CONTROLLER_ADDRESS_FILE, Controller
from hpc_rl.protocol import BlockingClient, Hello, create_secret, secret_path

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny_run_dir(tmp_path: Path) -> tuple[Path, object]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chdir(REPO_ROOT)  # the tiny config names repo-relative files
    config = load_config([REPO_ROOT / "configs/tiny_cpu.yaml"], ["--set", f"run_dir={run_dir}"])
    write_resolved_config(config, run_dir)
    return run_dir, config


async def with_controller(run_dir: Path, config, body) -> Controller:
    """Start a real controller, register trainer rank 0 over the protocol, run `body` in a thread."""
    secret = create_secret(secret_path(run_dir))
    controller = Controller(config, secret=secret, router=None, router_url=None)
    await controller.start()
    trainer_hello = Hello(role="trainer", rank=0, world_size=config.cluster.trainer_world_size, host="h", pid=7)
    host, port = controller.address
    trainer = await asyncio.to_thread(BlockingClient, host, port, secret, hello=trainer_hello)
    try:
        await controller.register_engine(0, "http://127.0.0.1:9")
        await asyncio.to_thread(body)
    finally:
        controller.stopping = True
        trainer.close()
        await controller.close()
    return controller


def test_status_of_a_live_run_then_of_the_ended_run(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO_ROOT)
    run_dir, config = tiny_run_dir(tmp_path)
    seen: dict[str, object] = {}

    def ask() -> None:
        seen["code"] = status_cli.main([str(run_dir)])
        seen["live"] = status_cli.collect_status(run_dir)

    asyncio.run(with_controller(run_dir, config, ask))
    live = seen["live"]
    assert seen["code"] == 0
    assert live["source"] == "controller (live)"  # the old code crashed here (int dict keys)
    assert live["components"]["trainers"]["0"]["pid"] == 7
    assert live["components"]["engines"]["0"]["state"] == "serving"
    printed = capsys.readouterr().out
    assert "trainer rank 0: pid 7 on h" in printed and "engine 0: serving" in printed

    assert not (run_dir / CONTROLLER_ADDRESS_FILE).exists()
    ended = status_cli.collect_status(run_dir)
    assert ended["source"] == "status.json (run ended)"
    assert ended["state"] == "stopped"
    assert ended["components"]["engines"]["0"]["state"] == "stopped"  # not "serving" after the end
    assert "serving" not in status_cli.format_status(ended)


def test_a_controller_that_does_not_answer_falls_back_to_status_json(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    run_dir, config = tiny_run_dir(tmp_path)

    def ask_with_a_wrong_secret() -> None:
        (run_dir / "secret").unlink()
        create_secret(secret_path(run_dir))  # another key: the controller refuses us (a RemoteError)
        (run_dir / "status.json").write_text(json.dumps({"run_dir": str(run_dir), "rollout_id": 3}))
        got = status_cli.collect_status(run_dir)
        assert got["rollout_id"] == 3
        assert got["source"].startswith("status.json (controller not running); controller at ")

    async def main() -> None:
        controller = await with_controller(run_dir, config, ask_with_a_wrong_secret)
        assert controller.outcome == "stopped"

    asyncio.run(main())


@pytest.mark.parametrize("address", ["garbage", "host:notaport", "\xff\xfe"])
def test_corrupt_files_give_a_message_not_a_traceback(tmp_path: Path, address: str, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.resolved.yaml").write_text("{}\n")
    (run_dir / CONTROLLER_ADDRESS_FILE).write_text(address, encoding="latin-1")
    (run_dir / "status.json").write_text('{"rollout_id": 3, ')  # cut off mid-write
    assert status_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "status.json is unreadable (JSONDecodeError" in out
    assert "controller.address" in out


def test_a_stale_address_is_reported_and_the_saved_status_shown(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    create_secret(secret_path(run_dir))
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (run_dir / CONTROLLER_ADDRESS_FILE).write_text(f"127.0.0.1:{port}\n")
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "rollout_id": 5}))
    got = status_cli.collect_status(run_dir)
    assert got["rollout_id"] == 5
    assert f"controller at 127.0.0.1:{port} did not answer (ConnectionRefusedError" in got["source"]
    assert got["state"] == "dead"  # no process holds the run dir: its "running" is not the truth
