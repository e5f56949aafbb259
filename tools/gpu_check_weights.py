"""The weight-path checks of tools/gpu_check.py: the colocated sender's shares rebuilt by a second process
(tools/gpu_check_receiver.py) behind a fake engine's /update_weights_from_tensor, trainer offload and onload, and
the weight stream on a one-rank weight-update group."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from gpu_check_base import (
    REPO, TOOLS, Context, Skip, expect, tiny_arch, weights_of, largest_change, rollout_batch,
    non_finite_metrics,
)


def _fake_engine(answers: list[dict[str, Any]]) -> tuple[Any, str, Any]:
    """An HTTP server that hands each share to the receiver process and keeps its answers."""
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    receiver = subprocess.Popen([sys.executable, str(TOOLS / "gpu_check_receiver.py")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status = 200
            for share in body["serialized_named_tensors"]:
                receiver.stdin.write(json.dumps({"share": share}) + "\n")
                receiver.stdin.flush()
                answer = json.loads(receiver.stdout.readline())
                answers.append(answer)
                status = 400 if "error" in answer else status
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", receiver


def check_colocated_ipc(ctx: Context) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state

    from hpc_rl.weights.colocated_sender import ColocatedWeightSender
    from hpc_rl.weights.export import export_hf_state_dict

    if "parts" not in ctx.state:
        raise Skip("optimizer_keeps_loaded_weights did not build the trainer")
    actor, arch = ctx.state["parts"].actor, tiny_arch()
    sender = ColocatedWeightSender(actor, arch, tp_group=parallel_state.get_tensor_model_parallel_group(), tp_size=1,
                                   rank=0, world_size=1, bucket_bytes=1 << 14, dtype=torch.bfloat16)
    answers: list[dict[str, Any]] = []
    server, url, receiver = _fake_engine(answers)
    try:
        report = sender.sync(version=1, engine_url=url, bucket_bytes=1 << 14, rank_engines=[[0, 0]], timeout_s=120)
    finally:
        server.shutdown()
        receiver.stdin.close()
        receiver.wait(timeout=60)
    errors = [a["error"] for a in answers if "error" in a]
    expect(not errors, f"the second process could not rebuild a share: {errors[:2]}")
    received = {name: entry for a in answers for name, entry in a["tensors"].items()}
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in export_hf_state_dict(actor, arch)}
    expect(set(received) == set(expected), f"names differ: {sorted(set(received) ^ set(expected))[:6]}")
    wrong = []
    for name, (shape, dtype, total, squares, device) in received.items():
        mine = expected[name].double()
        if (shape != list(mine.shape) or dtype != "torch.bfloat16" or device != torch.device(ctx.device).type
                or abs(total - mine.sum().item()) > 1e-6 * (1 + abs(total))
                or abs(squares - (mine * mine).sum().item()) > 1e-6 * (1 + squares)):
            wrong.append(name)
    expect(not wrong, f"{len(wrong)} tensor(s) rebuilt with other values/shapes/devices: {wrong[:4]}")
    return {"buckets": report["buckets"], "bytes": report["bytes"], "tensors": len(received),
            "receiver_devices": sorted({entry[4] for entry in received.values()})}


def check_offload_onload(ctx: Context) -> dict[str, Any]:
    import torch

    from hpc_rl.training.offload import TrainerOffload

    if "kl_parts" not in ctx.state:
        raise Skip("rollout_step_dense_kl did not build the trainer")
    parts = ctx.state["kl_parts"]
    offload = TrainerOffload(models=[parts.actor, parts.ref_model], optimizer=parts.optimizer)
    before = weights_of(parts.actor)
    allocated = torch.cuda.memory_allocated() if not ctx.on_cpu else 0
    moved = offload.offload(["weights", "grads", "optimizer"])
    freed = allocated - (torch.cuda.memory_allocated() if not ctx.on_cpu else 0)
    sizes = [p.untyped_storage().nbytes() for p in parts.actor.parameters()]
    expect(all(size == 0 for size in sizes), "a weight's storage was not freed by the offload")
    back = offload.onload()
    difference = largest_change(before, weights_of(parts.actor))
    expect(difference == 0.0, f"the weights came back different (max |diff| {difference})")
    metrics = parts.trainer.train_rollout(rollout_batch(24, seed=1))[0]
    expect(not non_finite_metrics(metrics), "the step after the onload is not finite")
    figures = {"offload_bytes": moved["offload/bytes"], "onload_bytes": back["onload/bytes"],
               "offload_s": moved["offload/seconds"], "onload_s": back["onload/seconds"]}
    if not ctx.on_cpu:
        figures["device_bytes_freed"] = freed
        expect(freed >= 0.9 * moved["offload/bytes"], f"only {freed} of {moved['offload/bytes']} bytes left the GPU")
    return figures


def check_weight_stream(ctx: Context) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state

    from hpc_rl.process.child_process import free_port
    from hpc_rl.weights.sender import WeightSender

    if "parts" not in ctx.state:
        raise Skip("optimizer_keeps_loaded_weights did not build the trainer")
    sender = WeightSender(ctx.state["parts"].actor, tiny_arch(), tp_size=1, dp_rank=0, rank=0,
                          tp_group=parallel_state.get_tensor_model_parallel_group(), bucket_bytes=1 << 14,
                          dtype=torch.bfloat16)
    backend = "gloo" if ctx.on_cpu else "nccl"
    start = time.perf_counter()
    sender.connect("127.0.0.1", free_port(), 1, group_name="gpu_check", backend=backend, timeout_s=120)
    plan = sender.send_all()
    sender.synchronize()
    if not ctx.on_cpu:
        torch.cuda.synchronize()
    sender.close()
    expect(len(plan) > 1, f"{len(plan)} bucket(s): the plan should split the model at 16 KiB")
    return {"backend": backend, "buckets": len(plan), "bytes": sum(b.num_bytes for b in plan),
            "seconds": time.perf_counter() - start}
