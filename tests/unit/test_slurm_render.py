"""Golden files of what Slurm is asked for, per reference recipe (pure: no Slurm needed).

tests/unit/golden/<recipe>.sbatch is the batch script submitit submits for the recipe;
slurm/<recipe>.sbatch is the standalone script for `sbatch` users. After an intended change:
HPC_RL_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_render.py  (then review the diff).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.launch.sbatch_render import (
    component_options,
    parse_extra_sbatch,
    render_batch_script,
    render_standalone_script,
    submitit_parameters,
    time_to_minutes,
)
from hpc_rl.launch.slurm_status import job_state, parse_sacct, parse_squeue
from hpc_rl.launch.srun_launcher import reachable_address, srun_argv
from hpc_rl.launch.steps import StepSpec
from hpc_rl.launch.submitit_het import HetSlurmInfoWatcher
from hpc_rl.launch.topology import plan_topology

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
RECIPES = ["qwen3_4b_grpo", "glm_z1_9b_grpo", "qwen3_4b_grpo_4nodes", "qwen3_4b_grpo_4nodes_decoupled"]
UPDATE = os.environ.get("HPC_RL_UPDATE_GOLDEN") == "1"


def _check(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with HPC_RL_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs from the rendering (HPC_RL_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("recipe", RECIPES)
def test_submitit_batch_script_golden(recipe: str) -> None:
    config = load_config([REPO / "configs" / f"{recipe}.yaml"])
    text = render_batch_script(config, plan_topology(config.cluster), folder="/RUN_DIR/submitit",
                               python="exec /usr/bin/python3")
    _check(GOLDEN / f"{recipe}.sbatch", text)


@pytest.mark.parametrize("recipe", RECIPES)
def test_standalone_script_golden(recipe: str) -> None:
    config = load_config([REPO / "configs" / f"{recipe}.yaml"])
    text = render_standalone_script(config, plan_topology(config.cluster), config_path=f"configs/{recipe}.yaml",
                                    script_path=f"slurm/{recipe}.sbatch")
    _check(REPO / "slurm" / f"{recipe}.sbatch", text)


def test_het_components_and_submitit_fixes() -> None:
    config = load_config([REPO / "configs" / "qwen3_4b_grpo_4nodes_decoupled.yaml"],
                         ["--set", "slurm.rollout_partition=infer", "--set", "slurm.account=rl",
                          "--set", "slurm.requeue_signal_seconds=300", "--set", "slurm.mem=0"])
    topology = plan_topology(config.cluster)
    trainer, rollout = component_options(config, topology)
    assert trainer.options["partition"] == "gpu" and rollout.options["partition"] == "infer"
    assert trainer.options["nodes"] == 2 and rollout.options["nodes"] == 2
    assert trainer.options["gpus-per-node"] == 8 and rollout.options["ntasks-per-node"] == 4
    assert rollout.options["account"] == "rl" and rollout.options["mem"] == "0"
    params = submitit_parameters(config, topology)
    assert params["nodes"] == 1  # fix 1: submitit counts one task; the real count is below
    assert params["additional_parameters"]["nodes"] == 2
    assert params["additional_parameters"]["signal"] == "B:USR2@300"  # fix 3
    assert params["use_srun"] is False
    assert params["setup"][0] == "#SBATCH hetjob"


def test_colocated_is_a_plain_job() -> None:
    config = load_config([REPO / "configs" / "qwen3_4b_grpo.yaml"])
    params = submitit_parameters(config, plan_topology(config.cluster))
    assert not any(line == "#SBATCH hetjob" for line in params["setup"])


def test_cpu_runs_ask_for_no_gpus_and_extra_lines() -> None:
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"],
                         ["--set", "slurm.extra_sbatch=['--exclusive', '--reservation=rl']",
                          "--set", "slurm.setup=['module load foo']"])
    for component in component_options(config, plan_topology(config.cluster)):
        assert "gpus-per-node" not in component.options
        assert component.options["exclusive"] is True and component.options["reservation"] == "rl"
    text = render_batch_script(config, plan_topology(config.cluster), folder="/R/submitit", python="exec python")
    assert "#SBATCH --exclusive\n" in text and "module load foo\n" in text
    assert text.index("#SBATCH hetjob") < text.index("module load foo")


@pytest.mark.parametrize("value,minutes", [("30", 30), ("04:00:00", 240), ("1-12:00:00", 2160), ("90:30", 91),
                                           ("2-0", 2880), ("00:00:20", 1)])
def test_time_to_minutes(value: str, minutes: int) -> None:
    assert time_to_minutes(value) == minutes


def test_bad_time_and_extra_lines_say_where() -> None:
    with pytest.raises(ValueError, match="slurm.time"):
        time_to_minutes("4h")
    with pytest.raises(ValueError, match="slurm.extra_sbatch"):
        parse_extra_sbatch(["exclusive"])


def test_srun_argv_pins_engines_and_states_task_counts() -> None:
    engine = StepSpec(name="engine-1", argv=["serve"], het_group=1, node_index=0, gpus_per_node=2)
    assert srun_argv(engine, het_job=True, nodelist=["node3"], cpus_per_task=8) == [
        "srun", "--het-group=1", "--job-name=engine-1", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
        "--nodelist=node3", "--gpus-per-node=2", "--exact", "--cpus-per-task=8", "--kill-on-bad-exit=1",
        "--unbuffered", "--", "serve"]
    trainer = StepSpec(name="trainer", argv=["torchrun"], num_nodes=2)
    argv = srun_argv(trainer, het_job=False)
    assert "--het-group=0" not in argv and "--ntasks=2" in argv and "--label" in argv and "--exact" not in argv
    colocated = StepSpec(name="engine-0", argv=["serve"], node_index=0, gpus_per_node=8, overlap=True)
    argv = srun_argv(colocated, het_job=False, nodelist=["node1"])
    # asks for its node's GPUs too: a step that asks for none may see none (ConstrainDevices)
    assert "--overlap" in argv and "--gpus-per-node=8" in argv and "--exact" not in argv


SACCT = """JobID|State|NodeList
12+0|RUNNING|node[1-2]
12+0.batch|RUNNING|node1
12+1|RUNNING|node3
13|CANCELLED by 0|node1
"""


def test_watcher_maps_het_leader_component() -> None:
    info = HetSlurmInfoWatcher().read_info(SACCT)
    assert info["12"]["State"] == "RUNNING" and info["12+1"]["NodeList"] == "node3"
    assert info["13"]["State"].startswith("CANCELLED")


def test_status_parsing() -> None:
    states = parse_sacct(SACCT.replace("NodeList", "NodeList|Elapsed|ExitCode").replace("node[1-2]", "node[1-2]|00:01|0:0"))
    assert [s.job_id for s in states] == ["12+0", "12+1", "13"] and job_state(states) == "RUNNING"
    assert job_state(parse_squeue("7+1|PENDING||0:00\n7+0|PENDING||0:00\n")) == "PENDING"
    assert job_state([]) == "UNKNOWN"


def test_cpus_per_task_per_component_by_default_and_overridable() -> None:
    config = load_config([REPO / "configs" / "glm_z1_9b_grpo.yaml"])
    trainer, rollout = component_options(config, plan_topology(config.cluster))
    assert trainer.options["cpus-per-task"] == 8 and rollout.options["cpus-per-task"] == 16  # engines: TP2
    config = load_config([REPO / "configs" / "glm_z1_9b_grpo.yaml"], ["--set", "slurm.cpus_per_gpu=4"])
    trainer, rollout = component_options(config, plan_topology(config.cluster))
    assert (trainer.options["cpus-per-task"], rollout.options["cpus-per-task"]) == (4, 8)
    config = load_config([REPO / "configs" / "glm_z1_9b_grpo.yaml"], ["--set", "slurm.cpus_per_task=6"])
    assert {c.options["cpus-per-task"] for c in component_options(config, plan_topology(config.cluster))} == {6}
    tiny = load_config([REPO / "configs" / "tiny_cpu.yaml"])
    assert all("cpus-per-task" not in c.options for c in component_options(tiny, plan_topology(tiny.cluster)))


def test_engine_steps_get_their_components_cpus_in_the_dry_run(in_repo: Path) -> None:
    from hpc_rl.launch.slurm_submit import render_slurm_dry_run

    config = load_config([REPO / "configs" / "glm_z1_9b_grpo.yaml"], ["--run-dir", "/RUN"])
    engine_lines = [line for line in render_slurm_dry_run(config).splitlines() if "--job-name=engine-" in line]
    assert len(engine_lines) == 2 and all("--cpus-per-task=16" in line for line in engine_lines)


def test_standalone_driver_passes_the_engine_cpus_to_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m hpc_rl.launch.driver --launcher srun` (the sbatch path) used to drop cpus_per_task."""
    from hpc_rl.config import write_resolved_config
    from hpc_rl.launch import driver

    config = load_config([REPO / "configs" / "glm_z1_9b_grpo.yaml"])
    write_resolved_config(config, tmp_path)
    seen = {}

    def fake_run_driver(run_dir: str, launcher: object, *, local: bool, plan: object = None) -> int:
        seen["cpus"] = getattr(launcher, "cpus_per_task")
        return 0

    monkeypatch.setattr(driver, "run_driver", fake_run_driver)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    assert driver.main(["--run-dir", str(tmp_path), "--launcher", "srun"]) == 0
    assert seen["cpus"] == 16


def test_private_submitit_renderer_only_on_checked_versions(monkeypatch):
    import submitit

    from hpc_rl.launch.sbatch_render import submitit_sbatch_text

    assert submitit.__version__.startswith("1.5.")  # the installed one renders (the golden tests above)
    monkeypatch.setattr(submitit, "__version__", "2.0.0")
    with pytest.raises(RuntimeError, match=r"submitit 2\.0\.0 is not one hpc_rl renders"):
        submitit_sbatch_text(command="true", folder="/R/submitit", parameters={})


def test_a_node_name_mapped_to_loopback_is_replaced_by_its_address_toward_the_other_nodes() -> None:
    """Debian's /etc/hosts maps a host's own name to 127.0.1.1: a router bound there is unreachable."""
    fake_dns = {"gpu01": "127.0.1.1", "gpu02": "10.0.0.12", "gpu03": "10.0.0.13"}
    asked: list[str] = []

    def fake_route_source(peer: str) -> str:
        asked.append(peer)
        return "10.0.0.11"

    job = ["gpu01", "gpu02", "gpu03"]
    assert reachable_address("gpu01", job, resolver=fake_dns.__getitem__, source_toward=fake_route_source) == "10.0.0.11"
    assert asked == ["10.0.0.12"]
    assert reachable_address("gpu02", job, resolver=fake_dns.__getitem__, source_toward=fake_route_source) == "10.0.0.12"


def test_loopback_stays_when_the_whole_job_is_on_one_machine() -> None:
    one_machine = {"node1": "127.0.0.1", "node2": "127.0.0.1"}
    assert reachable_address("node1", ["node1", "node2"], resolver=one_machine.__getitem__,
                             source_toward=lambda peer: pytest.fail("no route lookup on one machine")) == "127.0.0.1"


def test_the_launcher_never_hands_out_a_loopback_address_in_a_multi_node_job(monkeypatch) -> None:
    import hpc_rl.launch.srun_launcher as srun_launcher

    fake_dns = {"gpu01": "127.0.1.1", "gpu02": "10.0.0.12"}
    monkeypatch.setattr(srun_launcher, "expand_hostnames", lambda nodelist: ["gpu01", "gpu02"])
    monkeypatch.setattr(srun_launcher, "resolve", fake_dns.__getitem__)
    monkeypatch.setattr(srun_launcher, "route_source", lambda peer: "10.0.0.11")
    launcher = srun_launcher.SrunStepLauncher(environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]"})
    assert [launcher.node_address(0, 0), launcher.node_address(0, 1)] == ["10.0.0.11", "10.0.0.12"]
