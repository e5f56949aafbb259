"""Benchmark: CPU-engine decode throughput vs transformers' `generate`, and sglang-router's added latency.

Runs on the tiny Qwen3 (written to a temp dir), one torch thread on both sides:
  1. decode tokens/s at batch 1, 8, 32: B concurrent `/generate` requests to one CPU engine
     (HTTP, continuous batching, `ignore_eos`), the engine's scheduler driven in this process
     (no HTTP), and `model.generate` on a batch of B in this process;
  2. end to end at batch 32 x 64 tokens and at the RL shape (128 samples x 4 tokens), median of
     `--repeats`: one request per sample through the router (today's rollout path) and straight to the
     engine, the whole batch as one batched-`input_ids` request through the router and straight to the
     engine, one batched request per GRPO group of 8, and `model.generate` on the batch (the issue-11 target: engine end to end >= HF generate);
     sglang-router 0.3.2 passes a batched `input_ids` body through (a list of answers comes back);
  3. latency of one-token requests sent sequentially straight to the engine vs through the router:
     p50/p99 of each and the router's added p50/p99.
Bounded runtime (a few minutes on 2 shared cores). Usage: python benchmarks/bench_cpu_engine.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.engines.router import RouterProcess
from hpc_rl.tiny_model import make_tiny_model

PROMPT = [5, 6, 7, 8]
MAX_RUNNING = 256
"""The engine's --max-running-requests, as configs/tiny_cpu.yaml sets it (sglang.server_concurrency)."""


async def engine_throughput(url: str, batch: int, new_tokens: int) -> float:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
            "return_logprob": True}
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            async with session.post(f"{url}/generate", json={**body, "rid": f"b{batch}-{i}"}) as response:
                return len((await response.json())["output_ids"])

        await one(-1)  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(batch))))
        return tokens / (time.perf_counter() - start)


def transformers_throughput(model, batch: int, new_tokens: int) -> float:
    def run(rows: int, tokens: int) -> None:
        input_ids = torch.tensor([PROMPT] * rows)
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=True, pad_token_id=0)

    with torch.no_grad():
        run(1, 4)  # warm-up
        start = time.perf_counter()
        run(batch, new_tokens)
    return batch * new_tokens / (time.perf_counter() - start)


async def latencies(direct_url: str, router_url: str, count: int) -> tuple[list[float], list[float]]:
    """Alternate direct and routed requests, so load drift on the machine hits both alike."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    samples: dict[str, list[float]] = {direct_url: [], router_url: []}
    async with aiohttp.ClientSession() as session:
        for i in range(count + 10):
            for url in (direct_url, router_url):
                start = time.perf_counter()
                async with session.post(f"{url}/generate", json={**body, "rid": f"l{i}"}) as response:
                    await response.read()
                if i >= 10:  # warm-up
                    samples[url].append((time.perf_counter() - start) * 1e3)
    return samples[direct_url], samples[router_url]


def in_process_throughput(model, tokenizer, batch: int, new_tokens: int) -> float:
    """The engine's scheduler driven on this thread: its decode loop without HTTP."""
    from hpc_rl.engines.cpu.requests import GenerationRequest
    from hpc_rl.engines.cpu.sampling import parse_sampling_params
    from hpc_rl.engines.cpu.scheduler import Scheduler

    scheduler = Scheduler(model, tokenizer, max_running_requests=MAX_RUNNING, context_length=512, weight_version="b")
    params = {"max_new_tokens": new_tokens, "ignore_eos": True}
    futures = [scheduler.submit(GenerationRequest(rid=str(i), input_ids=list(PROMPT), return_logprob=True,
                                                  params=parse_sampling_params(params))) for i in range(batch)]
    start = time.perf_counter()
    while not all(future.done() for future in futures):
        scheduler.run_iteration()
    return batch * new_tokens / (time.perf_counter() - start)


async def end_to_end_seconds(url: str, samples: int, new_tokens: int, per_request: int) -> float:
    """Wall time for `samples` generations of `new_tokens`, sent as requests of `per_request` samples each
    (1: the single-request body; more: batched `input_ids`), all concurrently, keep-alive connections."""
    params = {"max_new_tokens": new_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def send(index: int, count: int) -> int:
            body = ({"input_ids": PROMPT, "sampling_params": params, "return_logprob": True} if per_request == 1
                    else {"input_ids": [PROMPT] * count, "sampling_params": params, "return_logprob": True})
            async with session.post(f"{url}/generate", json={**body, "rid": f"e{index}"}) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {str(answer)[:200]}")
                return sum(len(a["output_ids"]) for a in (answer if isinstance(answer, list) else [answer]))

        await send(-1, min(per_request, samples))  # warm-up (and connections)
        start = time.perf_counter()
        counts = [per_request] * (samples // per_request) + ([samples % per_request] if samples % per_request else [])
        tokens = sum(await asyncio.gather(*(send(i, count) for i, count in enumerate(counts))))
        elapsed = time.perf_counter() - start
    assert tokens == samples * new_tokens, (tokens, samples, new_tokens)
    return elapsed


def hf_generate_seconds(model, samples: int, new_tokens: int) -> float:
    return samples * new_tokens / transformers_throughput(model, samples, new_tokens)


def end_to_end_table(model, engine_url: str, router_url: str, repeats: int) -> None:
    print(f"\nend to end, wall ms (median of {repeats}); HF generate = model.generate on the whole batch")
    columns = ["router 1/req", "direct 1/req", "router batch", "batch 1 req", "batch per 8", "HF generate",
               "best/HF"]
    print(f"{'shape':>10} " + " ".join(f"{c:>13}" for c in columns))
    for samples, new_tokens in ((32, 64), (128, 4)):
        runs = {c: [] for c in columns[:-1]}
        for _ in range(repeats):  # interleaved, so load drift hits every variant alike
            runs["router 1/req"].append(asyncio.run(end_to_end_seconds(router_url, samples, new_tokens, 1)))
            runs["direct 1/req"].append(asyncio.run(end_to_end_seconds(engine_url, samples, new_tokens, 1)))
            runs["router batch"].append(asyncio.run(end_to_end_seconds(router_url, samples, new_tokens, samples)))
            runs["batch 1 req"].append(asyncio.run(end_to_end_seconds(engine_url, samples, new_tokens, samples)))
            runs["batch per 8"].append(asyncio.run(end_to_end_seconds(engine_url, samples, new_tokens, 8)))
            runs["HF generate"].append(hf_generate_seconds(model, samples, new_tokens))
        medians = {c: statistics.median(v) * 1e3 for c, v in runs.items()}
        best = min(v for c, v in medians.items() if c != "HF generate")
        print(f"{f'{samples}x{new_tokens}':>10} " + " ".join(f"{medians[c]:>13.1f}" for c in columns[:-1])
              + f" {best / medians['HF generate']:>13.2f}")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model")
        engine = CpuEngineProcess(model_dir, log_path=Path(tmp) / "engine.log", max_running_requests=MAX_RUNNING)
        router = RouterProcess(log_path=Path(tmp) / "router.log")
        try:
            engine.start()
            router.start()
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            engine.wait_healthy(120)
            router.wait_listening(60)
            router.add_worker(engine.url)
            router.wait_ready(30)

            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            in_process_throughput(model, tokenizer, 2, 8)  # warm-up
            print(f"decode throughput, tiny Qwen3, {args.new_tokens} new tokens per request, 1 thread (tokens/s)")
            print(f"{'batch':>5} {'engine HTTP':>12} {'engine core':>12} {'hf generate':>12} {'HTTP/hf':>8}")
            for batch in (1, 8, 32):
                ours = asyncio.run(engine_throughput(engine.url, batch, args.new_tokens))
                core = in_process_throughput(model, tokenizer, batch, args.new_tokens)
                theirs = transformers_throughput(model, batch, args.new_tokens)
                print(f"{batch:>5} {ours:>12.0f} {core:>12.0f} {theirs:>12.0f} {ours / theirs:>8.2f}")

            end_to_end_table(model, engine.url, router.url, args.repeats)

            direct, routed = asyncio.run(latencies(engine.url, router.url, args.latency_requests))
            print(f"\none-token /generate latency, {args.latency_requests} sequential requests each, alternating (ms)")
            print(f"{'':>8} {'p50':>7} {'p99':>7}")
            print(f"{'direct':>8} {percentile(direct, .5):>7.2f} {percentile(direct, .99):>7.2f}")
            print(f"{'router':>8} {percentile(routed, .5):>7.2f} {percentile(routed, .99):>7.2f}")
            print(f"{'added':>8} {percentile(routed, .5) - percentile(direct, .5):>+7.2f} "
                  f"{percentile(routed, .99) - percentile(direct, .99):>+7.2f}"
                  f"   (mean added {statistics.mean(routed) - statistics.mean(direct):+.2f})")
        finally:
            router.stop()
            engine.stop()
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
