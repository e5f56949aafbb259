"""The GPU-cluster rules of a run (issue 22): placement, precision and containers.

Owns: colocation vs async rollouts, the engines' dtype vs the trainer's, the log-prob mismatch bound, the container
runtime, mounts and image. Called by `hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

from hpc_rl.config.precision import TRAINER_DTYPES, trainer_dtype_name
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig



def gpu_cluster_problems(config: RunConfig) -> list[Problem]:
    cluster, slurm = config.cluster, config.slurm
    problems = []
    if cluster.colocate and config.rollout.async_rollout:
        problems.append(Problem("rollout.async_rollout", "conflict",
                                "colocated engines cannot generate while the trainer trains "
                                "on the same GPUs (slime's train_async.py refuses --colocate too): drop --train-async, "
                                "or give the engines their own GPUs (no --colocate, --rollout-num-gpus N)"))
    trainer_dtype = trainer_dtype_name(cluster.device) if cluster.device in TRAINER_DTYPES else None
    engine_dtype = sglang_name_of_dtype(config.sglang.server_options().get("dtype"))
    if trainer_dtype and engine_dtype not in (None, trainer_dtype):
        problems.append(Problem("sglang.dtype", "mismatch",
                                f"{config.sglang.server_options()['dtype']!r}: the engines must serve "
                                f"the dtype the trainer exports ({trainer_dtype} on {cluster.device}), else their "
                                "log-probs differ from the trainer's; remove the option (hpc_rl passes it)"))
    mismatch = config.controller.max_logprob_mismatch
    if mismatch is not None and mismatch < 0:
        problems.append(Problem("controller.max_logprob_mismatch", "out_of_range",
                                f"{mismatch} must be >= 0 (0: never fail)"))
    for index, mount in enumerate(slurm.container_mounts):
        parts = mount.split(":")
        if not 2 <= len(parts) <= 3 or not all(parts[:2]) or not parts[1].startswith("/"):
            problems.append(Problem(f"slurm.container_mounts[{index}]", "unsupported",
                                    f"{mount!r} must be SRC:DST or "
                                    "SRC:DST:FLAGS with an absolute DST (e.g. /data:/data:ro)"))
    if (slurm.container_mounts or slurm.container_runtime != "pyxis") and not slurm.container_image:
        problems.append(Problem("slurm.container_image", "unsupported",
                                "container_runtime/container_mounts are set but no "
                                "container_image: set the image (or drop the container settings)"))
    return problems


def sglang_name_of_dtype(value: object) -> str | None:
    """SGLang's --dtype spellings as the trainer's names (auto/None: not set)."""
    if value in (None, "auto"):
        return None
    return {"float": "float32", "half": "float16"}.get(str(value), str(value))
