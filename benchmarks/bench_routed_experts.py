"""What rollout routing replay costs around the engines, at a real MoE's shape (default: Qwen3-30B-A3B,
48 layers, 128 experts, top-8): per sample, the controller's CPU to parse an answer's JSON with the
field, to read SGLang's routed experts (base64 int32 -> compact uint8) and to pack them for the trainer, the bytes a sample adds to the
TrainCommand (compact vs SGLang's int32), and the trainer's CPU to lay one micro-batch's routing out
for every router (`replay_targets`, packed micro-batch).

    python benchmarks/bench_routed_experts.py [--tokens 4096] [--layers 48] [--experts 128] [--topk 8]
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_rl.controller.train_batches import pack_routed_experts  # noqa: E402
from hpc_rl.data.samples import Sample  # noqa: E402
from hpc_rl.rollout.routed_experts import RoutingShape, routed_experts_from_answer  # noqa: E402


def best_of(repeats: int, fn) -> float:
    """Smallest process CPU seconds of `repeats` calls (the machine is shared: the minimum is the cost)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt + response tokens of a sample")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16, help="samples packed together / in one micro-batch")
    args = parser.parse_args()
    shape = RoutingShape(num_layers=args.layers, topk=args.topk)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.experts, (args.tokens - 1, args.layers, args.topk), dtype=np.int32)
    meta = {"routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")}
    print(f"shape [{args.tokens - 1}, {args.layers}, {args.topk}], {args.experts} experts; "
          f"SGLang's field {len(meta['routed_experts']) / 2**20:.1f} MiB of base64 per sample")

    body = orjson.dumps({"text": "", "output_ids": [], "meta_info": meta})
    parse = best_of(5, lambda: orjson.loads(body))
    print(f"controller: parse the answer's JSON     {1e3 * parse:7.2f} ms CPU (orjson, as the engine client)")
    decode = best_of(5, lambda: routed_experts_from_answer(meta, shape=shape, sequence_length=args.tokens))
    routing = routed_experts_from_answer(meta, shape=shape, sequence_length=args.tokens)
    print(f"controller: read one answer's routing  {1e3 * decode:7.2f} ms CPU "
          f"({1e9 * decode / ids.size:.2f} ns per id)")
    samples = [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1] * args.tokens,
                      routed_experts=routing) for i in range(args.samples)]
    pack = best_of(5, lambda: pack_routed_experts(samples))
    print(f"controller: pack {args.samples} samples' routing   {1e3 * pack / args.samples:7.2f} ms CPU per sample")
    print(f"wire: {routing.nbytes / 2**20:.1f} MiB per sample as {routing.dtype} "
          f"(int32: {ids.nbytes / 2**20:.1f} MiB)")

    import torch

    from hpc_rl.training.router_tokens import RouterTokens
    from hpc_rl.training.routing_replay import replay_targets

    per_sample = max(1, args.tokens // args.samples)
    short = [r[:per_sample - 1] for r in [routing] * args.samples]
    total = per_sample * args.samples
    tokens = RouterTokens(sample=torch.arange(total) // per_sample, position=torch.arange(total) % per_sample)
    layers = list(range(args.layers))
    lay_out = best_of(3, lambda: replay_targets(tokens, short, layers, num_experts=args.experts, topk=args.topk))
    print(f"trainer: targets of a {total}-token packed micro-batch for {args.layers} routers "
          f"{1e3 * lay_out:7.2f} ms CPU ({1e9 * lay_out / (total * args.layers * args.topk):.2f} ns per id)")


if __name__ == "__main__":
    main()
