"""The coordinating process's CPU per sample for generation + a rule reward, with `rollout.answer_parse_workers`:
the reward scored on the controller's loop (as before) or in the answer workers (rollout/worker_rewards.py).

A real EngineClient, AnswerPool and GenerationSession (the built-in single-turn generate, batched requests) against
a small aiohttp stand-in engine that answers every request at once with the answer text of a case (deepscaler:
an integer, and a fraction that takes the sympy path), then `reward_group` per group of 8 as the scheduler calls
it. Measured: the loop thread's CPU (time.thread_time) over generation and rewards, and the workers' CPU.

    python benchmarks/bench_worker_rewards.py [--workers 2] [--samples 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402
from aiohttp import web  # noqa: E402

from hpc_rl.data.samples import Sample  # noqa: E402
from hpc_rl.rewards.group import RewardSpec, reward_group  # noqa: E402
from hpc_rl.rewards.worker_scored import WorkerRewards  # noqa: E402
from hpc_rl.rollout.answer_pool import AnswerPool  # noqa: E402
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory  # noqa: E402
from hpc_rl.rollout.generate import GenerationSession, default_generate, run_generate  # noqa: E402

CASES = (("integer", "Let me see. </think> The answer is \\boxed{12}", "12"),
         ("fraction (sympy)", "Let me see. </think> The answer is \\boxed{\\frac{3}{4}}", "0.75"))
TOKENS = 64
"""Tokens per answer (the parse is the same either way: what differs is the reward)."""


async def stand_in_engine(text: str) -> tuple[web.AppRunner, str]:
    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        answers = [{"text": text, "output_ids": [7] * TOKENS,
                    "meta_info": {"id": rid, "finish_reason": {"type": "stop"}, "weight_version": "0",
                                  "output_token_logprobs": [[-0.5, 7, None]] * TOKENS}} for rid in rids]
        return web.Response(body=orjson.dumps(answers if isinstance(body["rid"], list) else answers[0]),
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def worker_cpu_s(pool: AnswerPool) -> float:
    total = 0.0
    for pid in pool.pids():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks
    return total


async def one(text: str, label: str, samples: int, workers: int, in_workers: bool) -> tuple[float, float]:
    runner, url = await stand_in_engine(text)
    pool = AnswerPool(workers)
    client = EngineClient(StaticEngineDirectory([url]), router_url=None, answer_pool=pool)
    rewards = WorkerRewards("deepscaler") if in_workers else None
    client.worker_rewards = rewards
    spec = RewardSpec(rm_type="deepscaler", worker_rewards=rewards)
    try:
        async with client:
            session = GenerationSession(client, batch_across_groups=True)

            async def group(index: int) -> None:
                members = [Sample(index=8 * index + i, group_index=index, prompt="p", prompt_token_ids=[1, 2, 3],
                                  label=label) for i in range(8)]
                await asyncio.gather(*(run_generate(default_generate, None, s, {"max_new_tokens": TOKENS}, session)
                                       for s in members))
                await reward_group(spec, members)

            await asyncio.gather(*(group(i) for i in range(8)))  # warm: connections, sympy's first expressions
            loop_cpu, workers_cpu = time.thread_time(), worker_cpu_s(pool)
            await asyncio.gather(*(group(i) for i in range(samples // 8)))
            return time.thread_time() - loop_cpu, worker_cpu_s(pool) - workers_cpu
    finally:
        await runner.cleanup()


async def main(workers: int, samples: int) -> None:
    for name, text, label in CASES:
        for in_workers in (False, True):
            loop_s, workers_s = await one(text, label, samples, workers, in_workers)
            where = "in the answer workers" if in_workers else "on the loop"
            print(f"{name:>17}, reward {where:>21}: loop thread {1e6 * loop_s / samples:6.0f} us/sample, "
                  f"workers {1e6 * workers_s / samples:6.0f} us/sample")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.workers, arguments.samples))
