"""The controller's side of a weight sync alone: pause, the pipelined weight update, continue, against N
simulated engines (hpc_rl.sim in a child process), with no rollout, trainer or router around it.

Prints, per round, the controller's CPU seconds for each step (what a dedicated controller core
would spend: the goal is < 1 s at 1,024 engines for the whole sync) and the wall time (on one
machine it includes the simulated engines' own HTTP handling, which a cluster spreads over N hosts).

    python benchmarks/bench_admin_fanout.py --engines 256 1024 [--buckets 16] [--rounds 3] [--answer-workers 2]

With `--answer-workers K` the calls go through K answer workers (rollout.answer_parse_workers; the controller
reads their batched outcomes: transports.fanout_workers), and their CPU seconds in each round are printed beside
the controller's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdmin  # noqa: E402
from hpc_rl.controller.transports.fanout import update_every_engine  # noqa: E402
from hpc_rl.controller.transports.fanout_workers import call_every_engine  # noqa: E402
from hpc_rl.engines import API_KEY_ENV  # noqa: E402
from hpc_rl.protocol.http_client import EngineConnections  # noqa: E402
from hpc_rl.rollout.answer_pool import AnswerPool  # noqa: E402
from bench_scale import process_cpu_s  # noqa: E402  (benchmarks/ is on sys.path: this script's folder)

SIM_PARAMS = REPO / "configs" / "sim" / "qwen3_4b_h100_tp2.yaml"
KEY = "bench-admin-fanout-key"


def start_engines(count: int, work: Path) -> tuple[subprocess.Popen, list[str]]:
    urls_file = work / f"urls-{count}.txt"
    process = subprocess.Popen(
        [sys.executable, "-m", "hpc_rl.sim", "--params", str(SIM_PARAMS), "--count", str(count),
         "--urls-file", str(urls_file), "--set", "time_scale_ms=1"],
        env={**os.environ, API_KEY_ENV: KEY, "PYTHONPATH": str(REPO)}, start_new_session=True)
    deadline = time.monotonic() + 120
    while not urls_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the simulated engines did not start")
        time.sleep(0.1)
    return process, urls_file.read_text().split()


def qwen3_4b_like_buckets(count: int) -> list[BucketUpdate]:
    """`count` buckets of 25 tensors each (Qwen3-4B: 398 tensors in 16 buckets of 512 MB)."""
    return [BucketUpdate.of(names=[f"model.layers.{i}.t{j}.weight" for j in range(25)], dtypes=["bfloat16"] * 25,
                            shapes=[[2560, 9728]] * 25, group_name="weight_update_group_1",
                            weight_version="1" if i == count - 1 else None, load_format=None)
            for i in range(count)]


async def rounds(urls: list[str], buckets: list[BucketUpdate], count: int, answer_workers: int) -> None:
    pool = EngineConnections(api_key=KEY)
    admins = [EngineAdmin(url, pool) for url in urls]
    await asyncio.gather(*(admin.healthy() for admin in admins))  # connections open before timing
    workers = AnswerPool(answer_workers, api_key=KEY) if answer_workers else None
    if workers is not None:
        await workers.start()
    for index in range(count):
        cpu, wall = time.process_time(), time.perf_counter()
        before = sum(process_cpu_s(pid) for pid in workers.pids()) if workers is not None else 0.0
        await call_every_engine(workers, admins, "pause", "retract")  # (WeightUpdates.engines_call's way)
        paused = time.process_time()
        await update_every_engine(admins, buckets, pool=workers)  # the controller's fan-out (transports.fanout)
        updated = time.process_time()
        await call_every_engine(workers, admins, "resume_generation")
        done = time.process_time()
        in_workers = sum(process_cpu_s(pid) for pid in workers.pids()) - before if workers is not None else 0.0
        print(f"{len(urls):>6} {index:>5} {paused - cpu:>8.3f} {updated - paused:>8.3f} {done - updated:>8.3f} "
              f"{done - cpu:>8.3f} {in_workers:>8.3f} {time.perf_counter() - wall:>7.2f} {os.getloadavg()[0]:>5.1f}",
              flush=True)
    await pool.close()
    if workers is not None:
        workers.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--answer-workers", type=int, default=0,
                        help="answer workers that make the update's exchanges (0: the controller's loop)")
    args = parser.parse_args(argv)
    print(f"{'N':>6} {'round':>5} {'pause':>8} {'update':>8} {'continue':>8} {'ctrl CPU':>8} {'wk CPU':>8} "
          f"{'wall s':>7} {'load':>5}   (CPU s; update = begin + {args.buckets} buckets + end, pipelined per engine; "
          f"wk CPU: the {args.answer_workers} answer workers' CPU in the round)")
    with tempfile.TemporaryDirectory(prefix="bench_admin_fanout-") as tmp:
        for count in args.engines:
            process, urls = start_engines(count, Path(tmp))
            try:
                asyncio.run(rounds(urls, qwen3_4b_like_buckets(args.buckets), args.rounds, args.answer_workers))
            finally:
                process.terminate()
                process.wait(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
