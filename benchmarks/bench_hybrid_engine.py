"""Benchmark: the CPU engine on families whose cache keeps more than keys/values, batched vs one request at a time.

For each family's tiny random checkpoint (written to a temp dir; one torch thread), the engine's scheduler is
driven in this process (no HTTP) over the RL shape (`--requests` prompts of 6-13 tokens x `--new-tokens` sampled
tokens, all submitted at once, `--max-running` rows) with the family's cache held two ways (registry
`cpu_engine_cache`): "batched_states" (`engines/cpu/state_batch`: one forward for the running batch) and
"per_request" (`engines/cpu/row_caches`: one forward per request). Prints generated tokens/s of each (median of
`--repeats`), the speed-up, and the machine's load average at the start and end (a shared machine: compare within a
row). Usage: python benchmarks/bench_hybrid_engine.py [--families qwen3_next deepseek_v32 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hpc_rl.engines.cpu import kv_batch
from hpc_rl.engines.cpu.__main__ import load_model
from hpc_rl.engines.cpu.requests import parse_generate_body
from hpc_rl.engines.cpu.scheduler import Scheduler
from hpc_rl.models.registry import family
from hpc_rl.tiny_model import build_tokenizer

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa")


def run_once(model: torch.nn.Module, kind: str, requests: int, new_tokens: int, max_running: int) -> float:
    """Generated tokens per second of one wave of `requests` on the cache `kind`."""
    original = kv_batch.cache_kind
    kv_batch.cache_kind = lambda _model: kind
    try:
        tokenizer = build_tokenizer()
        scheduler = Scheduler(model, tokenizer, max_running_requests=max_running, context_length=256,
                              weight_version="v0")
        prompts = [[5 + (i + j) % 18 for j in range(6 + i % 8)] for i in range(requests)]
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0,
                                                          "ignore_eos": True}}
        parsed = parse_generate_body(body, tokenizer=tokenizer, context_length=256)
        start = time.perf_counter()
        scheduler.submit_all(parsed.requests)
        while scheduler.run_iteration():
            pass
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.future.result()["output_ids"]) for r in parsed.requests)
        assert tokens == requests * new_tokens, tokens
        return tokens / elapsed
    finally:
        kv_batch.cache_kind = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {args.requests} requests x {args.new_tokens} tokens, "
          f"max running {args.max_running}, median of {args.repeats}")
    print("| family | batched_states tok/s | per_request tok/s | speed-up |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            torch.manual_seed(0)
            model = load_model(str(family(name).make_tiny(Path(tmp) / name)), "auto", "eager")
            run_once(model, "batched_states", 8, 2, args.max_running)  # warm-up
            rates = {kind: statistics.median(run_once(model, kind, args.requests, args.new_tokens, args.max_running)
                                             for _ in range(args.repeats))
                     for kind in ("batched_states", "per_request")}
            print(f"| {name} | {rates['batched_states']:.0f} | {rates['per_request']:.0f} | "
                  f"{rates['batched_states'] / rates['per_request']:.1f}x |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
