"""How many samples/s the rollout scheduler sustains when engines answer instantly (its own overhead).

Starts `--engines` benchmark-only fake engines (`InstantFakeEngine`: /generate answers at once with
`--response-len` tokens, logprobs and weight-version spans; /abort_request is a no-op) in a child
process, then in this process measures, over the same engines:
  1. raw: `generate_turn` on every sample (HTTP client + response parsing only), no scheduler;
  2. scheduler: `RolloutScheduler.run` steps with dynamic sampling (a filter dropping half the groups),
     rewards, refills and the final abort round.
Reports samples/s and this process's CPU-ms per sample for both; the difference is the scheduler's.

    python benchmarks/bench_rollout_scheduler.py [--steps 4 --rollout-batch-size 64 --n-samples 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from typing import Any

from hpc_rl.data.prompts import PromptDataset, PromptRecord, PromptSource
from hpc_rl.data.samples import Sample
from hpc_rl.rollout import (
    EngineClient,
    GenerationSession,
    RolloutScheduler,
    SchedulerSettings,
    StaticEngineDirectory,
)
from hpc_rl.rollout.generate import generate_turn


def _serve_instant_engines(ports: list[int], response_len: int, ready: Any) -> None:
    """Child process: InstantFakeEngine on each port until killed."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        n = min(response_len, int(body["sampling_params"]["max_new_tokens"]))
        out = [(len(body["input_ids"]) + i) % 50 + 100 for i in range(n)]
        finish = {"type": "length", "length": n} if n < response_len else {"type": "stop", "matched": 2}
        return web.json_response({"text": " x" * n, "output_ids": out, "meta_info": {
            "id": body["rid"], "finish_reason": finish, "weight_version": "0",
            "weight_versions": [{"version": "0", "start": 0, "end": n}],
            "output_token_logprobs": [[-0.5, t, None] for t in out]}})

    async def abort(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"success": True})

    async def main() -> None:
        for port in ports:
            app = web.Application()
            app.router.add_post("/generate", generate)
            app.router.add_post("/abort_request", abort)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


async def _reward(samples: list[Sample]) -> list[float]:
    # Even rows: constant rewards (dropped by the filter); odd rows: varied.
    row = int(samples[0].metadata["data_row"])
    return [0.0 if row % 2 == 0 else float(k % 2) for k in range(len(samples))]


def _drop_even_rows(args: Any, samples: list[Sample], **kwargs: Any) -> bool:
    return int(samples[0].metadata["data_row"]) % 2 == 1


async def _bench(urls: list[str], cli: argparse.Namespace) -> None:
    records = [PromptRecord(row=i, prompt=f"q{i}") for i in range(4096)]
    async with EngineClient(StaticEngineDirectory(urls), per_engine_concurrency=cli.concurrency) as client:
        params = {"max_new_tokens": cli.response_len + 1}
        # 1. raw client
        samples = [Sample(index=i, group_index=i, prompt="q", prompt_token_ids=[10, i % 1000])
                   for i in range(cli.steps * cli.rollout_batch_size * cli.n_samples)]
        session = GenerationSession(client)
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(generate_turn(s, params, session=session) for s in samples))
        raw_wall, raw_cpu = time.perf_counter() - wall, time.process_time() - cpu
        raw_n = len(samples)
        # 2. scheduler
        settings = SchedulerSettings(rollout_batch_size=cli.rollout_batch_size, n_samples_per_prompt=cli.n_samples,
                                     over_sampling_batch_size=cli.rollout_batch_size * 2, partial_rollout=True)
        scheduler = RolloutScheduler(settings=settings, client=client,
                                     source=PromptSource(PromptDataset(path="bench", records=records), shuffle=False,
                                                         seed=0),
                                     encoder=lambda prompt, md: [10, int(str(prompt)[1:]) % 1000], reward_fn=_reward,
                                     sampling_params=params, group_filter=_drop_even_rows)
        generated = 0
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(cli.steps):
            result = await scheduler.run(rollout_id=step)
            generated += int(result.metrics["rollout/requests_sent"])
            assert len(result.groups) == cli.rollout_batch_size
        sched_wall, sched_cpu = time.perf_counter() - wall, time.process_time() - cpu
    kept = cli.steps * cli.rollout_batch_size * cli.n_samples
    print(f"engines={len(urls)} steps={cli.steps} rollout_batch_size={cli.rollout_batch_size} "
          f"n_samples={cli.n_samples} response_len={cli.response_len}")
    print(f"raw generate_turn : {raw_n / raw_wall:8.0f} samples/s  {1e3 * raw_cpu / raw_n:.3f} CPU-ms/sample")
    print(f"scheduler (run)   : {generated / sched_wall:8.0f} requests/s  {kept / sched_wall:8.0f} kept samples/s  "
          f"{1e3 * sched_cpu / generated:.3f} CPU-ms/request  ({generated} requests for {kept} kept samples)")
    print(f"scheduler overhead: {1e3 * (sched_cpu / generated - raw_cpu / raw_n):+.3f} CPU-ms/request over raw")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollout-batch-size", type=int, default=64)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=256, help="per-engine in-flight limit")
    cli = parser.parse_args()
    from hpc_rl.process.child_process import free_port

    ports = [free_port() for _ in range(cli.engines)]
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    server = context.Process(target=_serve_instant_engines, args=(ports, cli.response_len, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the fake engines did not start in 30 s")
        asyncio.run(_bench([f"http://127.0.0.1:{p}" for p in ports], cli))
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
