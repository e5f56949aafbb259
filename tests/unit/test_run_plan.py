"""The topology planned once at submit and read back from the run dir (`launch/run_plan.py`): what is read is
what was planned, a damaged or stale topology.json is refused naming the file and the field, and a run dir of
an older hpc_rl (no topology.json) is planned once and said so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.launch.run_plan import (TOPOLOGY_FILE_NAME, TopologyFileError, load_run_plan, read_topology,
                                    write_topology)
from hpc_rl.launch.topology import plan_run_topology

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "decoupled": ["configs/tiny_cpu.yaml"],
    "multi-node engines": ["configs/glm_z1_9b_grpo.yaml"],
    "colocated": ["configs/tiny_cpu.yaml", "--colocate"],
    "teacher": ["configs/tiny_cpu.yaml", "--opd-teacher-num-gpus", "1"],
    "external engines": ["configs/tiny_cpu.yaml", "--rollout-external-engine-addrs", "127.0.0.1:30000"],
    "trainer only": ["configs/tiny_cpu.yaml", "--debug-train-only"],
}


def written_run_dir(tmp_path: Path, args: list[str]) -> Path:
    config = load_config([REPO / args[0]], args[1:])
    write_resolved_config(config, tmp_path)
    write_topology(tmp_path, config, plan_run_topology(config))
    return tmp_path


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_topology_read_back_is_the_one_planned(tmp_path: Path, shape: str) -> None:
    config = load_config([REPO / SHAPES[shape][0]], SHAPES[shape][1:])
    planned = plan_run_topology(config)
    write_resolved_config(config, tmp_path)
    write_topology(tmp_path, config, planned)
    plan = load_run_plan(tmp_path)
    assert plan.topology == planned and plan.notes == ()
    assert plan.config.cluster == config.cluster


def damage(run_dir: Path, change) -> None:
    path = run_dir / TOPOLOGY_FILE_NAME
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("change, words", [
    (lambda d: d["topology"]["engines"][0].update(port="15010"), "topology.engines[0].port must be an integer"),
    (lambda d: d["topology"].pop("router_port"), "topology lacks ['router_port']"),
    (lambda d: d["topology"]["groups"][0].update(racks=2), "topology.groups[0] has unknown field(s) ['racks']"),
    (lambda d: d["topology"].update(colocate=1), "topology.colocate must be true or false"),
    (lambda d: d.update(format=99), "format 99, this hpc_rl reads format 1"),
])
def test_a_damaged_topology_file_is_refused_naming_the_file_and_field(tmp_path: Path, change, words: str) -> None:
    run_dir = written_run_dir(tmp_path, SHAPES["decoupled"])
    damage(run_dir, change)
    with pytest.raises(TopologyFileError) as refused:
        load_run_plan(run_dir)
    assert str(refused.value).startswith(f"{run_dir / TOPOLOGY_FILE_NAME}: ") and words in str(refused.value)


def test_a_topology_planned_from_other_cluster_settings_is_refused(tmp_path: Path) -> None:
    run_dir = written_run_dir(tmp_path, SHAPES["decoupled"])
    edited = load_config([REPO / "configs/tiny_cpu.yaml"], ["--rollout-num-gpus", "2"])
    write_resolved_config(edited, run_dir)  # config.resolved.yaml edited after submit
    with pytest.raises(TopologyFileError, match="was planned from other `cluster` settings") as refused:
        read_topology(run_dir, edited)
    assert str(run_dir / TOPOLOGY_FILE_NAME) in str(refused.value) and "submit again" in str(refused.value)


def test_a_run_dir_of_an_older_hpc_rl_is_planned_once_and_said_so(tmp_path: Path) -> None:
    config = load_config([REPO / "configs/tiny_cpu.yaml"])
    write_resolved_config(config, tmp_path)  # no topology.json: an hpc_rl from before it wrote one
    first = load_run_plan(tmp_path)
    assert first.topology == plan_run_topology(config)
    assert len(first.notes) == 1 and "was missing" in first.notes[0] and TOPOLOGY_FILE_NAME in first.notes[0]
    assert (tmp_path / TOPOLOGY_FILE_NAME).exists()
    again = load_run_plan(tmp_path)  # the next attempt (a requeue) reads what was written
    assert again.topology == first.topology and again.notes == ()


def test_the_driver_refuses_a_damaged_topology_file_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_rl.launch.driver import _run_attempts
    from hpc_rl.launch.steps import LocalStepLauncher
    from hpc_rl.launch.submit_args import EXIT_INVALID

    run_dir = written_run_dir(tmp_path, SHAPES["decoupled"])
    damage(run_dir, lambda d: d["topology"].update(engines="all"))
    assert _run_attempts(run_dir, LocalStepLauncher(), local=True, plan=None) == EXIT_INVALID
    assert f"{run_dir / TOPOLOGY_FILE_NAME}: topology.engines must be a list" in capsys.readouterr().err
    assert not (run_dir / "logs").exists(), "nothing was started"


def test_prepare_run_writes_the_topology_with_the_resolved_config(tmp_path: Path, monkeypatch) -> None:
    from hpc_rl.launch.prepare_run import prepare_run

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run_dir = prepare_run(["configs/tiny_cpu.yaml", "--run-dir", str(tmp_path / "run")])
    plan = load_run_plan(run_dir)
    assert plan.notes == () and plan.topology == plan_run_topology(plan.config)


def test_submit_writes_the_topology_it_planned_and_the_local_executor_reads_it(tmp_path: Path, monkeypatch) -> None:
    from hpc_rl import submit
    from hpc_rl.launch import local

    seen = {}

    def fake_run_local(config) -> int:  # a fake executor: what it would find in the run dir
        seen["plan"] = load_run_plan(config.run_dir)
        return 0

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(local, "run_local", fake_run_local)
    assert submit.main(["configs/tiny_cpu.yaml", "--executor", "local", "--run-dir", str(tmp_path / "run")]) == 0
    assert seen["plan"].notes == (), "submit wrote topology.json: nothing planned after it"
    assert seen["plan"].topology == plan_run_topology(seen["plan"].config)
