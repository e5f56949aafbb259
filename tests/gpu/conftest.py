"""`bash tools/run_tests.sh gpu`: everything of hpc_rl that only runs on CUDA, on this node's GPUs.

Every test here is marked `gpu` and skips, with its reason, where what it needs is missing (CUDA, a second
GPU, Transformer Engine, SGLang); at the end a table says what ran and what was skipped, so the first person
with a GPU node learns in minutes what works. Each check runs in fresh processes (`run_ranks`, or a whole
local run), so one failure (a CUDA error, an NCCL hang up to its timeout) does not poison the next.
"""

from __future__ import annotations

import importlib.util

import pytest

_OUTCOMES: dict[str, tuple[str, float, str]] = {}


def cuda_gpus() -> int:
    """GPUs torch sees here (0 without CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def need(*, gpus: int = 1, modules: tuple[str, ...] = ()) -> None:
    """Skip the calling test unless this node has `gpus` GPUs and the `modules`."""
    if cuda_gpus() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s); this node has {cuda_gpus()}")
    for module in modules:
        if not has_module(module):
            pytest.skip(f"needs `{module}` (the GPU environment: pip install -c requirements/gpu.txt -r requirements/gpu.in)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.gpu)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "tests/gpu/" not in report.nodeid:
        return
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            reason = str(getattr(report.longrepr, "reprcrash", "") or "").split("\n")[0][:100]
        _OUTCOMES[report.nodeid] = (report.outcome, report.duration, reason)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _OUTCOMES:
        return
    terminalreporter.section("GPU checks: what ran on this node")
    width = max(len(nodeid.split("::")[-1]) for nodeid in _OUTCOMES)
    for nodeid, (outcome, seconds, reason) in _OUTCOMES.items():
        name = nodeid.split("::")[-1]
        terminalreporter.write_line(f"{name:<{width}}  {outcome.upper():<7}  {seconds:7.1f} s  {reason}")
