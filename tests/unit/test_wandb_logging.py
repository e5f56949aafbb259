"""slime's --use-wandb flags: parsed to logging.*, checked at submit time, and a real offline W&B run.

The last test needs the wandb package (`pip install -e '.[wandb]'`) and is skipped without it; the CI
install (`.[test]`) does not include it.
"""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import pytest

from hpc_rl.config.loading import ConfigError, load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.telemetry import wandb_scalars
from hpc_rl.telemetry.scalars import ScalarLog
from tests.unit.config_problems import codes, config_problems

SLIME_WANDB_ARGS = ["--use-wandb", "--wandb-project", "slime-dev", "--wandb-group", "qwen3-4B-test",
                    "--wandb-team", "rl-team", "--wandb-key", "k" * 40, "--wandb-host", "https://wandb.example.org",
                    "--wandb-mode", "offline"]


def problems_of(*flags: str) -> list[str]:
    return [str(p) for p in collect_problems(load_config(["configs/tiny_cpu.yaml"], list(flags)), check_files=False)]


def test_slime_wandb_flags_become_logging_fields() -> None:
    logging_config = load_config([], SLIME_WANDB_ARGS + ["--disable-wandb-random-suffix"]).logging
    assert logging_config.use_wandb is True
    assert (logging_config.wandb_project, logging_config.wandb_group, logging_config.wandb_team) == (
        "slime-dev", "qwen3-4B-test", "rl-team")
    assert logging_config.wandb_host == "https://wandb.example.org" and logging_config.wandb_mode == "offline"
    assert logging_config.wandb_key == "k" * 40


def test_wandb_mode_outside_slimes_choices_is_refused() -> None:
    with pytest.raises(ConfigError, match="wandb_mode: 'cloud' is not one of online, offline, disabled") as refused:
        load_config([], ["--use-wandb", "--wandb-mode", "cloud"])
    assert [(p.field, p.code, p.location) for p in refused.value.problems] == [
        ("logging.wandb_mode", "not_one_of", "command line --wandb-mode")]


def test_use_wandb_without_the_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    original = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else original(name, *a))
    assert ("logging.use_wandb", "needs") in codes(config_problems(["configs/tiny_cpu.yaml"], ["--use-wandb"]))
    problems = problems_of("--use-wandb")
    assert any(p.startswith("logging.use_wandb: needs the wandb package") and "pip install 'hpc_rl[wandb]'" in p
               for p in problems), problems


def test_wandb_settings_without_use_wandb_are_not_ignored() -> None:
    flags = ["--wandb-project", "p", "--wandb-mode", "offline"]
    assert codes(config_problems(["configs/tiny_cpu.yaml"], flags)) == {("logging.wandb_project", "unused"),
                                                                        ("logging.wandb_mode", "unused")}
    problems = problems_of(*flags)
    assert "logging.wandb_project: is read only with use_wandb: add --use-wandb or drop it" in problems
    assert "logging.wandb_mode: is read only with use_wandb: add --use-wandb or drop it" in problems


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed once the with-block ends: connecting is refused


def test_mode_defaults_to_offline_when_the_host_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    mode, why = wandb_scalars.choose_mode(None, f"http://127.0.0.1:{closed_port()}")
    assert mode == "offline" and "not reachable" in why
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert wandb_scalars.choose_mode(None, f"http://127.0.0.1:{server.getsockname()[1]}")[0] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_scalars.choose_mode(None, "http://127.0.0.1:1") == ("disabled", "$WANDB_MODE")
    assert wandb_scalars.choose_mode("offline", "http://127.0.0.1:1") == ("offline", "logging.wandb_mode")


def test_run_id_follows_the_run_dir(tmp_path: Path) -> None:
    first = wandb_scalars.run_id_for(tmp_path / "run")
    assert first == wandb_scalars.run_id_for(str(tmp_path / "run" / ".." / "run"))  # a requeue: same W&B run
    assert first != wandb_scalars.run_id_for(tmp_path / "other")


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (`run-<id>.wandb`: LevelDB's log format behind a 7-byte header)."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        payload = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += payload
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    return records


def wandb_history(path: Path) -> tuple[list[dict[str, object]], dict[str, str]]:
    """(one dict per logged row, the run's config by top-level key as JSON) of an offline run's `run-<id>.wandb`."""
    from wandb.proto import wandb_internal_pb2

    history, config_values = [], {}
    for raw in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.HasField("history"):  # wandb-core writes a key either as `key` or as a one-part `nested_key`
            history.append({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        if record.HasField("run"):
            config_values.update({item.key: item.value_json for item in record.run.config.update})
    return history, config_values


def test_offline_run_holds_the_controllers_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="pip install -e '.[wandb]' to run the real W&B test")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    # No wandb_mode: an unreachable host (a node without network) makes the run offline by itself.
    config = load_config(["configs/tiny_cpu.yaml"], ["--use-wandb", "--wandb-project", "hpc-rl-test",
                                                      "--wandb-host", f"http://127.0.0.1:{closed_port()}",
                                                      "--wandb-key", "secret-key-not-logged",
                                                      "--run-dir", str(run_dir)])
    scalars = ScalarLog.for_controller(run_dir / "tensorboard", config, run_dir=run_dir)
    assert scalars._wandb is not None and scalars._wandb.mode == "offline"
    for rollout in range(1, 4):
        scalars.log({"rollout/reward_mean": 0.25 * rollout, "train/pg_loss": -0.1 * rollout, "note": "skipped",
                     "eval/nan": float("nan")}, rollout)
    scalars.close()

    run_files = list((run_dir / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, list(run_dir.rglob("*"))
    assert run_files[0].name == f"run-{wandb_scalars.run_id_for(run_dir)}.wandb"
    history, config_values = wandb_history(run_files[0])
    rows = [(row["rollout/step"], row["rollout/reward_mean"], row["train/pg_loss"]) for row in history]
    assert rows == [(1, 0.25, pytest.approx(-0.1)), (2, 0.5, pytest.approx(-0.2)), (3, 0.75, pytest.approx(-0.3))]
    assert all("note" not in row and "eval/nan" not in row for row in history)
    assert "secret-key-not-logged" not in run_files[0].read_bytes().decode("latin-1")
    assert json.loads(config_values["logging"])["wandb_project"] == "hpc-rl-test"  # the config, without the key
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard stays


def test_seed_line_with_slimes_wandb_args_dry_runs(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """run-qwen3-4B.sh's WANDB_ARGS switched on: the line moves over (or, without wandb, says which extra)."""
    import importlib.util

    from hpc_rl.submit import main
    from tests.unit.slime_lines import seed_argv

    wandb_args = ["--use-wandb", "--wandb-project", "slime-dev", "--wandb-group", "qwen3-4B-test", "--wandb-key", "k"]
    code = main([*seed_argv("qwen3_4b_colocated_8"), *wandb_args, "--dry-run", "--no-check-files", "--executor",
                 "local"])
    out, err = capsys.readouterr()
    if importlib.util.find_spec("wandb") is None:
        assert code == 2 and "pip install 'hpc_rl[wandb]'" in err
        return
    assert code == 0, err
    assert "use_wandb: true" in out and "wandb_project: slime-dev" in out and "wandb_group: qwen3-4B-test" in out
