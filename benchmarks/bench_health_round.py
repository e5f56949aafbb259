"""The controller's CPU for one /health round over N simulated engines (hpc_rl.sim in a child process), on warm
keep-alive connections: one probe per engine per call (`EngineAdmin.healthy`, 64 at a time: check_health's old
path and the fallback now) against `healthy_all` (one `RequestRound`: what `EngineFleet.check_health` uses).

    python benchmarks/bench_health_round.py [--engines 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_admin_fanout import KEY, start_engines  # noqa: E402
from hpc_rl.controller.engine_admin import EngineAdmin, healthy_all  # noqa: E402
from hpc_rl.protocol.http_client import EngineConnections  # noqa: E402


async def per_call(admins: list[EngineAdmin], timeout_s: float) -> list[bool]:
    limit = asyncio.Semaphore(64)

    async def probe(admin: EngineAdmin) -> bool:
        async with limit:
            return await admin.healthy(timeout_s)

    return await asyncio.gather(*(probe(admin) for admin in admins))


async def measure(urls: list[str], rounds: int) -> None:
    pool = EngineConnections(api_key=KEY)
    admins = [EngineAdmin(url, pool) for url in urls]
    await per_call(admins, 10.0)  # connections open before timing
    for name, probe in (("per call", per_call), ("one round", healthy_all)) * 2:
        cpu = time.thread_time()
        for _ in range(rounds):
            assert all(await probe(admins, 10.0))
        spent = (time.thread_time() - cpu) / rounds
        print(f"N={len(urls)} {name:9s} {1e3 * spent:6.1f} ms of controller CPU per round ({1e6 * spent / len(urls):5.1f} "
              f"us per engine); load {os.getloadavg()[0]:.1f}", flush=True)
    await pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    process, urls = start_engines(args.engines, Path(tempfile.mkdtemp(prefix="bench_health_round-")))
    try:
        asyncio.run(measure(urls, args.rounds))
    finally:
        process.terminate()
        process.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
