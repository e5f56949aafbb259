"""The `sglang.launch_server` command line and environment for one engine (GPU nodes). Pure.

Owns: rendering an engine's command from the rollout config (`hf_checkpoint`,
`rollout_num_gpus_per_engine` -> `--tp-size`, host/port, every `sglang_*` option passed through),
the environment SGLang needs under hpc_rl, and the 0600 file that carries the api key. Starting the
process is `engine_process`'s job.

The api key: SGLang 0.5.23 reads `--api-key` from its command line only (no environment variable), and
argv is world-readable (`ps`). So the key goes in a 0600 YAML file passed as `--config FILE` (SGLang's
own "read CLI options from a config file"). SGLang still logs its server args, key included, at info
level at start (engine.py `_server_args_for_logging` redacts watermark keys only): the driver creates
engine logs 0600.

Option rendering (keys may carry the `sglang_` prefix of the config; it is dropped):
    {"mem_fraction_static": 0.7}  -> --mem-fraction-static 0.7
    {"cuda_graph_bs": [1, 2, 4]}  -> --cuda-graph-bs 1 2 4
    {"enable_memory_saver": True} -> --enable-memory-saver        (False / None: omitted)
    {"json_model_override_args": {...}} -> --json-model-override-args '<json>'
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.config.sglang_options import renamed_options

# Flags hpc_rl sets itself: a pass-through option may not override them.
RESERVED_OPTIONS = frozenset(
    {"model_path", "tp_size", "tensor_parallel_size", "host", "port", "api_key", "config", "base_gpu_id", "nnodes",
     "node_rank", "dist_init_addr", "nccl_init_addr"}
)

SGLANG_ON_CPU_OPTIONS: dict[str, Any] = {
    # Real SGLang 0.5.23 on a CPU node (measured: tools/install_sglang_cpu.sh, tests -m sglang_cpu).
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
}
SGLANG_ON_CPU_ENV = {"SGLANG_DISABLE_TELEMETRY": "1"}
SGLANG_PYTHON_ENV = "HPC_RL_SGLANG_PYTHON"
"""Interpreter that has `sglang` when it is not this one (e.g. the venv of tools/install_sglang_cpu.sh)."""

ENGINE_ENV = {
    # The router health-checks /health; with generation enabled a paused engine fails it (-> 503).
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
    # NCCL's cuMem allocator breaks weight-update groups across processes.
    "NCCL_CUMEM_ENABLE": "0",
    # A local checkpoint path must never turn into a hub lookup.
    "HF_HUB_OFFLINE": "1",
}


@dataclass(kw_only=True)
class SglangLaunchSpec:
    """One SGLang engine: model, parallelism, address and pass-through options."""

    hf_checkpoint: str
    """Local HF checkpoint directory served by the engine (also its tokenizer)."""
    host: str
    """Address the engine's HTTP server binds (the node's address, reachable by the router)."""
    port: int
    """HTTP port of the engine."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per engine: SGLang's tensor-parallel size."""
    api_key: str | None = None
    """Bearer key for the engine's endpoints (SGLang `--api-key`, on the command line: tests only)."""
    api_key_file: str | None = None
    """0600 YAML file holding the key (`write_api_key_file`), passed as `--config`: keeps it off argv."""
    sglang_options: dict[str, Any] = field(default_factory=dict)
    """Every other SGLang server flag, by its python name (see the module docstring)."""
    python: str = sys.executable
    """Interpreter that has the `sglang` package."""
    colocated: bool = False
    """Engine on the trainer's GPUs: `--enable-memory-saver`, so releasing memory really frees it."""
    base_gpu_id: int | None = None
    """Position of the engine's first GPU in its step's GPU list (`--base-gpu-id`; launch.step_plan)."""

    def __post_init__(self) -> None:
        if self.rollout_num_gpus_per_engine < 1:
            raise ValueError(f"rollout_num_gpus_per_engine must be >= 1, got {self.rollout_num_gpus_per_engine}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        clashes = sorted(_option_name(key) for key in self.sglang_options if _option_name(key) in RESERVED_OPTIONS)
        if clashes:
            raise ValueError(
                f"sglang options {clashes} are set by hpc_rl (hf_checkpoint, rollout_num_gpus_per_engine, "
                "host, port, api_key, config, base_gpu_id, nnodes, node_rank, dist_init_addr: Slurm's placement): "
                "remove them from the sglang_* options"
            )


def _option_name(key: str) -> str:
    return key.removeprefix("sglang_")


def sglang_device_options(device: str, sglang_options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of one SGLang engine: slime names mapped to the pinned SGLang's, and on a CPU node the
    backends that run there (`SGLANG_ON_CPU_OPTIONS`) unless the config sets them."""
    options = renamed_options(sglang_options)
    return {**SGLANG_ON_CPU_OPTIONS, **options} if device == "cpu" else options


def render_option(key: str, value: Any) -> list[str]:
    """Command-line words for one pass-through option (see the module docstring)."""
    flag = "--" + _option_name(key).replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag, *(str(item) for item in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def build_sglang_command(spec: SglangLaunchSpec) -> list[str]:
    """The full `python -m sglang.launch_server ...` argv for `spec`."""
    command = [
        spec.python, "-m", "sglang.launch_server",
        "--model-path", spec.hf_checkpoint,
        "--tp-size", str(spec.rollout_num_gpus_per_engine),
        "--host", spec.host,
        "--port", str(spec.port),
    ]
    if spec.api_key:
        command += ["--api-key", spec.api_key]
    if spec.api_key_file:
        command += ["--config", spec.api_key_file]
    if spec.base_gpu_id is not None:
        command += ["--base-gpu-id", str(spec.base_gpu_id)]
    for key in sorted(spec.sglang_options):
        command += render_option(key, spec.sglang_options[key])
    if spec.colocated and "--enable-memory-saver" not in command:
        command.append("--enable-memory-saver")
    return command


def build_sglang_env(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (usually os.environ) plus hpc_rl's engine variables, then `extra` on top."""
    env = dict(base)
    env.update(ENGINE_ENV)
    env.update(extra or {})
    return env


def write_api_key_file(path: str | os.PathLike[str], api_key: str) -> None:
    """Write `api-key: <key>` for SGLang's `--config`, readable by the owner only (mode 0600 from the
    start: the file is created that way, never widened; an existing file is rewritten in place)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"api-key: {json.dumps(api_key)}\n".encode())  # SGLang passes keys on as `--<key>`
    finally:
        os.close(fd)
