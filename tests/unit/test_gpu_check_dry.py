"""tools/gpu_check.py's CPU dry mode (`--device cpu`: gloo, bf16/fp32 on the CPU): every check of the one-GPU check
runs here, through the same hpc_rl code it calls on the GPU, so it cannot rot between GPU visits.

The dry run hides the packages the one-GPU machine lacks (notes/one-gpu-h200.md: hpc_rl's controller-side
requirements; SGLang and Transformer Engine are absent here too), so it also proves the check needs none of them.
A second run fakes each optimizer fault the review found (`--fake-fault`) and a missing transformers: each
optimizer check must fail for its own reason, and the logits checks must say "skipped: transformers ...".

No check is xfail: on today's code the CPU trainer's optimizer (hpc_rl's AdamW over fp32 parameters) has none of
the GPU faults, so every check passes in dry mode. Once the CPU path runs Megatron's optimizer (branch
gpu-optimizer), these same checks are what would catch faults 1, 2 and 5 on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "gpu_check.py"
NOT_ON_THE_GPU_MACHINE = ("submitit", "sglang_router", "aiohttp", "orjson", "pyarrow", "pylatexenc", "pybase64",
                          "hypothesis", "pytest_timeout")
"""Importable here, absent on the one-GPU machine (hpc_rl's controller side and test extras)."""


def _tool_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


CHECK_NAMES = [name for name, _ in _tool_module().CHECKS]


def _hide(directory: Path, names: tuple[str, ...]) -> Path:
    """Packages shadowing `names`: importing one raises ImportError, as on a machine without it."""
    for name in names:
        (directory / name).mkdir(parents=True, exist_ok=True)
        (directory / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden by {__name__}')\n")
    return directory


def _dry_run(tmp: Path, hidden: tuple[str, ...], *args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(_hide(tmp / "hidden", hidden)), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    report = tmp / "report.json"
    result = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--report", str(report), *args],
                            cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert report.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text()), result


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report, result = _dry_run(tmp_path_factory.mktemp("gpu_check_dry"), NOT_ON_THE_GPU_MACHINE)
    report["returncode"] = result.returncode
    report["output"] = result.stdout[-4000:] + result.stderr[-4000:]
    return report


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_the_check_passes_in_dry_mode(dry_report: dict[str, Any], name: str) -> None:
    outcome = dry_report["checks"].get(name)
    assert outcome is not None, f"{name} missing from the report: {dry_report['output']}"
    assert outcome["status"] == "passed", f"{name}: {outcome.get('why')}\n{outcome.get('traceback', '')}"


def test_the_report_names_every_check_the_environment_and_the_exit_status(dry_report: dict[str, Any]) -> None:
    assert list(dry_report["checks"]) == CHECK_NAMES
    assert dry_report["summary"]["passed"] == sorted(CHECK_NAMES) and dry_report["returncode"] == 0
    packages = dry_report["environment"]["packages"]
    assert packages["megatron.core"].startswith("0.") and packages["transformer_engine"].startswith("missing")
    assert Path(dry_report["environment"]["hpc_rl"]).is_relative_to(REPO)  # this checkout's, not another copy
    assert dry_report["checks"]["nccl_init"]["figures"] == {"backend": "gloo", "world_size": 1}
    assert dry_report["checks"]["colocated_ipc"]["figures"]["receiver_devices"] == ["cpu"]


def test_each_optimizer_check_fails_on_its_fault_and_a_missing_package_is_skipped(tmp_path: Path) -> None:
    report, result = _dry_run(tmp_path, ("transformers",), "--only", "logits_tiny", "optimizer_keeps_loaded_weights",
                              "optimizer_nan_step", "optimizer_lr_warmup", "--fake-fault", "loses_loaded_weights",
                              "applies_nan_steps", "stale_first_lr")
    checks = report["checks"]
    assert result.returncode == 1, result.stdout[-2000:]
    assert checks["logits_tiny"]["status"] == "skipped"
    assert checks["logits_tiny"]["why"].startswith("skipped: transformers not importable")
    assert "did not start from the loaded weights" in checks["optimizer_keeps_loaded_weights"]["why"]
    assert "NaN gradient's step was reported applied" in checks["optimizer_nan_step"]["why"]
    assert "a stale lr was applied" in checks["optimizer_lr_warmup"]["why"]
    assert set(checks) == {"nccl_init", "logits_tiny", "optimizer_keeps_loaded_weights", "optimizer_nan_step",
                           "optimizer_lr_warmup"}


def test_without_cuda_the_gpu_mode_says_so_and_fails(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu runs the real check")
    report_path = tmp_path / "runs" / "report.json"  # its folder made, as run_tests.sh gpu needs
    result = subprocess.run([sys.executable, str(TOOL), "--report", str(report_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "no CUDA device" in result.stderr
    assert "--device cpu" in json.loads(report_path.read_text())["error"]
