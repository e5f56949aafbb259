"""Run a function on N local trainer ranks (spawned processes, env:// rendezvous), like torchrun.

Owns: starting the ranks, free-port selection, collecting each rank's return value, and killing every
rank when one fails or the deadline passes. For tests, benchmarks and single-node tools; production
ranks come from torchrun under srun.

Ranks start from a forkserver that has imported torch, Megatron-core and the model provider once per
calling process (measured on this 2-core machine at load 7-13: a 2-rank start by spawn 7-27 s, each
re-importing torch and Megatron; from the preloaded forkserver 0.08-0.1 s after a one-off 2.8-6.6 s;
test_megatron_logits 12.0 -> 4.2 s). The server imports only, runs nothing (no torch thread pool, no CUDA
context, which a fork must not inherit), and each rank gets the caller's environment as it is at the call,
not the server's. HPC_RL_RANKS_START=spawn starts every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from hpc_rl.process.child_process import planned_port


_PRELOAD = ["torch", "megatron.core", "hpc_rl.training.model_provider"]


def _start_context() -> Any:
    """forkserver with the heavy imports preloaded (spawn when HPC_RL_RANKS_START=spawn)."""
    if os.environ.get("HPC_RL_RANKS_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any,
               environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # the caller's environment, not the forkserver's from when it started
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    try:
        import torch

        torch.set_num_threads(1)
        # Plain pickle bytes: tensors sent through an mp queue would share memory by file
        # descriptor, which dies with this process before the parent reads it.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - report every failure, including SystemExit from argparse
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call `fn(*args)` in `world_size` new processes; return their results in rank order.

    `fn` must be importable (module level). Raises RuntimeError with the failing rank's traceback.
    """
    context = _start_context()
    results = context.Queue()
    port = planned_port()  # rank 0 binds it after its imports: seconds later
    environ = dict(os.environ)
    procs = [context.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, environ),
                             daemon=False)
             for r in range(world_size)]  # not daemonic: dist_checkpointing spawns helpers
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish "
                                   f"within {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in collected]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [collected[r] for r in range(world_size)]
