"""The GPU run's environment and checks (issue 22 items 4-6): the train/rollout log-prob guard, the validation
rules of GPU clusters (async + colocated, engine dtype, containers), the pinned GPU environment's offline check
(and that it fails on an inconsistent lock), and every Slurm step in a container, rendered for Pyxis and
Apptainer (golden files)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.problems import Problem
from hpc_rl.controller.logprob_guard import FIRST_STEP_GAP, LogprobGuard, LogprobMismatch, threshold_for
from hpc_rl.data.samples import Sample
from hpc_rl.launch.slurm_submit import render_slurm_dry_run
from tests.unit.config_problems import codes, config_problems, message_of

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"


def group_of(*versions: list[int]) -> list[Sample]:
    return [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], response_token_ids=[2] * len(v),
                   weight_versions=list(v)) for i, v in enumerate(versions)]


def test_the_guard_fails_a_run_whose_engines_do_not_serve_the_synced_weights() -> None:
    guard = LogprobGuard(threshold_for("cpu", None))
    metrics = {FIRST_STEP_GAP: 2.8e-4}  # SGLang's `auto` dtype: a float32 checkpoint served in float16
    guard.check(0, [group_of([0, 0])], 0, metrics)  # no sync yet: the engines serve what they loaded
    guard.note_served(3)
    guard.check(5, [group_of([2, 3])], 3, metrics)  # tokens of an older policy (async, partial): measured only
    guard.check(5, [group_of([3, 3])], 3, {FIRST_STEP_GAP: 1e-7})
    with pytest.raises(LogprobMismatch, match=r"rollout 5: .* by 0.00028 per token .* after weight sync v3"):
        guard.check(5, [group_of([3, 3], [3])], 3, metrics)
    guard.note_served(4, cache_flushed=False)  # in place: SGLang's prefix cache may hold v3's KV, measured only
    guard.check(6, [group_of([4, 4])], 4, {FIRST_STEP_GAP: 0.057})
    guard.note_served(5)  # the next sync flushed: checked again
    with pytest.raises(LogprobMismatch, match=r"rollout 7: .* after weight sync v5"):
        guard.check(7, [group_of([5, 5])], 5, {FIRST_STEP_GAP: 0.057})
    assert threshold_for("cuda", None) == 0.1 and threshold_for("cpu", 0) is None and threshold_for("cpu", 0.5) == 0.5


def problems_for(*flags: str) -> list[Problem]:
    return config_problems([REPO / "configs" / "tiny_cpu.yaml"], list(flags))


@pytest.mark.parametrize(("flags", "field", "code", "words"), [
    (["--colocate", "--train-async"], "rollout.async_rollout", "conflict",
     "colocated engines cannot generate while the trainer trains"),
    (["--sglang-dtype", "bfloat16"], "sglang.dtype", "mismatch",
     "'bfloat16': the engines must serve the dtype the trainer exports (float32 on cpu)"),
    (["--set", "slurm.container_image=img.sif", "--set", "slurm.container_runtime=docker"], "slurm.container_runtime",
     "not_one_of", "'docker' is not one of pyxis, apptainer"),
    (["--set", "slurm.container_image=img.sif", "--set", "slurm.container_mounts=[data]"], "slurm.container_mounts[0]",
     "unsupported", "'data' must be SRC:DST"),
    (["--set", "slurm.container_mounts=[/d:/d]"], "slurm.container_image", "unsupported",
     "container_runtime/container_mounts are set but no container_image"),
    (["--set", "controller.max_logprob_mismatch=-1"], "controller.max_logprob_mismatch", "out_of_range",
     "-1.0 must be >= 0"),
])
def test_gpu_cluster_rules_name_the_field_and_the_fix(in_repo: Path, flags: list[str], field: str, code: str,
                                                      words: str) -> None:
    found = problems_for(*flags)
    assert (field, code) in codes(found), found
    assert words in message_of(found, field)


def test_sglangs_spelling_of_float32_is_the_trainers_dtype(in_repo: Path) -> None:
    assert problems_for("--sglang-dtype", "float") == []


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_every_slurm_step_runs_in_the_container_golden(runtime: str, in_repo: Path) -> None:
    image = {"pyxis": "nvcr.io#nvidia/pytorch:25.01-py3", "apptainer": "/images/hpc_rl-gpu.sif"}[runtime]
    config = load_config([REPO / "configs" / "qwen3_4b_grpo.yaml"],
                         ["--run-dir", "/RUN", "--set", f"slurm.container_image={image}",
                          "--set", f"slurm.container_runtime={runtime}",
                          "--set", "slurm.container_mounts=[/data:/data:ro]"])
    steps = "\n".join(line for line in render_slurm_dry_run(config).splitlines()
                      if line.startswith("srun ")).replace(str(REPO), "<repo>")
    golden = GOLDEN / f"container_steps_{runtime}.txt"  # checked in; HPC_RL_UPDATE_GOLDEN=1 rewrites it to review
    if os.environ.get("HPC_RL_UPDATE_GOLDEN") == "1":
        golden.write_text(steps + "\n")
    assert golden.is_file(), f"missing golden file {golden}; run with HPC_RL_UPDATE_GOLDEN=1 and review it"
    assert steps + "\n" == golden.read_text(), f"{golden} differs from the rendering (HPC_RL_UPDATE_GOLDEN=1 to accept)"
    assert steps.count("srun ") == 5 and "python3 -m hpc_rl" in steps  # every step, with the image's python


def lock_tool():
    spec = importlib.util.spec_from_file_location("gpu_lock", REPO / "tools" / "gpu_lock.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_the_gpu_lock_is_one_consistent_resolution_and_its_check_catches_a_broken_one() -> None:
    tool = lock_tool()
    assert tool.check() == 0
    lock = json.loads(tool.GPU_LOCK.read_text())
    top, own = tool.read_requirements(tool.GPU_IN), tool.hpc_rl_requirements()
    pins = {name: info["version"] for name, info in lock["packages"].items()}
    assert pins["torch"] == "2.14.1" and pins["sglang"] == "0.5.23" and pins["sglang-router"] == "0.3.2"
    assert pins["megatron-core"] == "0.16.1" and pins["transformer_engine_torch"] == "2.11.0"

    def broken(edit) -> list[str]:
        changed = copy.deepcopy(lock)
        edit(changed["packages"])
        return tool.problems(changed, top, own)

    def older_torch(packages: dict) -> None:
        packages["torch"]["version"] = "2.13.0"

    assert any("sglang==0.5.23 requires torch==2.14.1; the lock pins torch==2.13.0" in p for p in broken(older_torch))
    assert any("which the lock does not pin" in p for p in broken(lambda packages: packages.pop("flashinfer-python")))
    assert any("required by nothing: left-pad" in p
               for p in broken(lambda packages: packages.update({"left-pad": {"version": "1.0", "requires_dist": []}})))
    assert any("hpc_rl (setup.cfg) requires sglang==0.5.23" in p
               for p in broken(lambda packages: packages["sglang"].update(version="0.5.22")))


def test_the_container_image_installs_the_lock_on_its_python() -> None:
    dockerfile = (REPO / "containers" / "gpu.Dockerfile").read_text()
    lock = json.loads((REPO / "requirements" / "gpu.lock.json").read_text())
    python = lock["environment"]["python_version"]
    assert f"python{python} -m venv /opt/venv" in dockerfile  # the interpreter the lock was resolved for
    assert "-c requirements/gpu.txt -r requirements/gpu.in" in dockerfile
    assert "From: hpc_rl-gpu:" in (REPO / "containers" / "hpc_rl-gpu.def").read_text()
