"""The one-GPU check: hpc_rl's GPU path on ONE bare GPU machine, in one process, in a few minutes; a JSON report.

    python3 tools/gpu_check.py --report gpu_check.json              # on the GPU machine (tools/gpu_check_bundle.sh)
    python3 tools/gpu_check.py --device cpu --report /tmp/dry.json  # CPU dry mode (tests/unit/test_gpu_check_dry.py)

What it needs there: torch with CUDA, transformers, safetensors, numpy, megatron-core (carried as a wheel); no
SGLang, no Transformer Engine, no network (notes/one-gpu-h200.md). It calls hpc_rl's real code, in order:

    nccl_init                 init_parallel: a one-rank NCCL world (gloo in dry mode) and Megatron's groups
    logits_tiny               build_gpt_model, Megatron's local spec in bf16 on the device, the tiny Qwen3
                              checkpoint loaded: log-probs against transformers' on the same device and dtype
    logits_random_shape       the same on a random Qwen3 of ~0.44B parameters (dry mode: a small random shape)
    params_on_device          every parameter of the bf16 model on the device and in bf16
    optimizer_keeps_loaded_weights   build_trainer (Megatron's optimizer on GPU): the model holds the loaded
                              weights, and still after step 1 (within an Adam step of them)
    optimizer_step            a step reports a finite grad norm and its lr and moves the weights
    optimizer_nan_step        a NaN gradient: the step reports skipped AND leaves the weights unchanged
    optimizer_lr_warmup       a warm-up fraction over set_run_length(4): step 1 applies lr 0 (weights unchanged)
    optimizer_save_restore    sharded save_checkpoint, build_trainer from it: same weights and steps, and the
                              next step equal in both (optimizer state restored)
    rollout_step_dense_kl     RolloutTrainer.train_rollout: packed (thd) micro-batches, the reference KL (0 at step 1)
    rollout_step_moe_replay   the same on a tiny MoE with routing replay
    colocated_ipc             ColocatedWeightSender.sync to a fake engine whose second process rebuilds the shares
                              (CUDA IPC handles as SGLang's update_weights_from_tensor does; dry: /dev/shm)
    offload_onload            TrainerOffload: weights, grads, optimizer off the device and back, bit-exact
    weight_stream             WeightSender.connect/send_all on a one-rank NCCL weight-update group

Every check is "passed", "failed: <why>" or "skipped: <why>" (a missing package, no CUDA); a check that raises is
failed with its error, never dropped. Exit status: 0 none failed, 1 some failed, 2 no CUDA (`--device cuda`, the
default: the report says so and nothing ran). Where TE is absent the trainer's
`build_gpt_model(device="cuda")` would refuse (it builds TE layers on GPU): the check then builds Megatron's local
spec on CUDA (the report says `layer_spec: local`), the spec the CPU twin runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is started
from gpu_check_base import FAKE_FAULTS, REPO, Context, Skip, local_spec_on_cuda  # noqa: E402
from gpu_check_trainer import (  # noqa: E402
    RANDOM_SHAPES, check_logits_random_shape, check_logits_tiny, check_nccl_init, check_optimizer_keeps_loaded_weights,
    check_optimizer_lr_warmup, check_optimizer_nan_step, check_optimizer_save_restore, check_optimizer_step,
    check_params_on_device, check_rollout_step_dense_kl, check_rollout_step_moe_replay,
)
from gpu_check_weights import check_colocated_ipc, check_offload_onload, check_weight_stream  # noqa: E402

CHECKS: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
    ("nccl_init", check_nccl_init),
    ("logits_tiny", check_logits_tiny),
    ("logits_random_shape", check_logits_random_shape),
    ("params_on_device", check_params_on_device),
    ("optimizer_keeps_loaded_weights", check_optimizer_keeps_loaded_weights),
    ("optimizer_step", check_optimizer_step),
    ("optimizer_nan_step", check_optimizer_nan_step),
    ("optimizer_lr_warmup", check_optimizer_lr_warmup),
    ("optimizer_save_restore", check_optimizer_save_restore),
    ("rollout_step_dense_kl", check_rollout_step_dense_kl),
    ("rollout_step_moe_replay", check_rollout_step_moe_replay),
    ("colocated_ipc", check_colocated_ipc),
    ("offload_onload", check_offload_onload),
    ("weight_stream", check_weight_stream),
]


def run_check(name: str, check: Callable[[Context], dict[str, Any]], ctx: Context) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        figures = check(ctx)
        outcome = {"status": "passed", "figures": figures}
    except Skip as why:
        outcome = {"status": "skipped", "why": f"skipped: {why}"}
    except Exception as error:  # noqa: BLE001 - every failure is reported, the next check still runs
        outcome = {"status": "failed", "why": f"failed: {type(error).__name__}: {str(error)[:600]}",
                   "traceback": traceback.format_exc()[-2500:]}
    outcome["seconds"] = round(time.perf_counter() - start, 3)
    return outcome


def environment(device: str) -> dict[str, Any]:
    versions = {}
    for package in ("torch", "megatron.core", "transformers", "safetensors", "numpy", "transformer_engine",
                    "sglang"):
        try:
            module = importlib.import_module(package)
            versions[package] = str(getattr(module, "__version__", "present"))
        except Exception as error:  # noqa: BLE001
            versions[package] = f"missing ({type(error).__name__})"
    import torch

    import hpc_rl

    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    return {"python": platform.python_version(), "hpc_rl": hpc_rl.__file__, "packages": versions, "gpu": gpu,
            "cuda": getattr(torch.version, "cuda", None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry mode (gloo)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the logits checks' dtype (the trainer runs bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--random-shape", choices=sorted(RANDOM_SHAPES), default=None,
                        help="the random Qwen3 of logits_random_shape (default: 0.5b on cuda, small on cpu)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these checks (nccl_init always runs; one that needs an earlier check's "
                             "trainer says skipped)")
    parser.add_argument("--report", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--fake-fault", nargs="*", choices=sorted(FAKE_FAULTS), default=[],
                        help="tests only: fake these optimizer faults, to see the checks fail")
    args = parser.parse_args(argv)
    args.report.parent.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(REPO))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        report = {"device": "cuda", "error": "no CUDA device (torch.cuda.is_available() is False): run with "
                                             "--device cpu for the dry mode", "checks": {}}
        args.report.write_text(json.dumps(report, indent=1))
        print(report["error"], file=sys.stderr)
        return 2
    started = time.perf_counter()
    report: dict[str, Any] = {"device": args.device, "environment": environment(args.device), "checks": {}}
    with tempfile.TemporaryDirectory(prefix="hpc_rl_gpu_check_") as scratch:
        ctx = Context(device=args.device, dtype=getattr(torch, args.dtype), scratch=Path(scratch),
                      random_shape=args.random_shape or ("small" if args.device == "cpu" else "0.5b"),
                      fake_faults=tuple(args.fake_fault))
        report["fake_faults"] = list(args.fake_fault)
        if args.device == "cuda":
            try:
                report["layer_spec"] = local_spec_on_cuda()
            except Exception as error:  # noqa: BLE001 - megatron.core missing: every check says so
                report["layer_spec"] = f"unknown ({type(error).__name__})"
        for name, check in CHECKS:
            if args.only is not None and name not in args.only and name != "nccl_init":
                continue
            # written before and after every check: a run killed by its time limit (a hung NCCL call) still
            # leaves what ran, and which check was running
            report["checks"][name] = {"status": "running", "why": "running: the process ended inside this check"}
            args.report.write_text(json.dumps(report, indent=1, default=str))
            outcome = run_check(name, check, ctx)
            report["checks"][name] = outcome
            args.report.write_text(json.dumps(report, indent=1, default=str))
            print(f"{name:<32} {outcome['status'].upper():<8} {outcome['seconds']:7.1f} s  "
                  f"{outcome.get('why', json.dumps(outcome.get('figures', {}))[:150])}", flush=True)
        if "info" in ctx.state:
            from hpc_rl.training.parallel import shutdown_parallel

            shutdown_parallel()
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["summary"] = {status: sorted(n for n, o in report["checks"].items() if o["status"] == status)
                         for status in ("passed", "failed", "skipped")}
    args.report.write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {args.report} ({report['seconds']} s; {len(report['summary']['failed'])} failed, "
          f"{len(report['summary']['skipped'])} skipped)")
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
