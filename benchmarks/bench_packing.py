"""Packing efficiency and DP balance of hpc_rl.training.batching on realistic length distributions.

Prints, per scenario: micro-batches produced by first-fit vs the lower bound
ceil(total_tokens / max_tokens), after equalising to a multiple of the DP size, and the imbalance
of the Karmarkar-Karp assignment of micro-batches to DP ranks (max rank load / mean rank load - 1),
against round-robin assignment, and how many token slots the same micro-batches would compute if
right-padded (bshd: rows x longest) instead of packed (thd: exactly the real tokens). Pure Python, no torch; runs in a few seconds.

    python benchmarks/bench_packing.py
"""

from __future__ import annotations

import math
import random
import statistics
import time

from hpc_rl.training.batching import (
    balanced_partitions,
    equalize_microbatch_count,
    microbatch_target_count,
    pack_microbatches,
)


def lognormal_lengths(
    rng: random.Random, n: int, median: int, sigma: float, prompt: int, cap: int
) -> list[int]:
    """prompt (+-25%) + lognormal response truncated at ``cap`` (generation max_new_tokens)."""
    out = []
    for _ in range(n):
        response = min(cap, max(1, int(rng.lognormvariate(math.log(median), sigma))))
        out.append(int(prompt * rng.uniform(0.75, 1.25)) + response)
    return out


def imbalance(loads: list[int]) -> float:
    return max(loads) / statistics.fmean(loads) - 1.0


def run(name: str, lengths: list[int], max_tokens: int, dp: int) -> None:
    t0 = time.perf_counter()
    bins = pack_microbatches(lengths, max_tokens)
    bound = math.ceil(sum(lengths) / max_tokens)
    bins_eq = equalize_microbatch_count(bins, microbatch_target_count(len(bins), dp), lengths)
    tokens = [sum(lengths[i] for i in b) for b in bins_eq]
    kk = balanced_partitions(tokens, dp, equal_size=True)
    rr = [list(range(r, len(bins_eq), dp)) for r in range(dp)]
    dt = time.perf_counter() - t0
    kk_loads = [sum(tokens[j] for j in p) for p in kk]
    rr_loads = [sum(tokens[j] for j in p) for p in rr]
    fill = sum(lengths) / (len(bins) * max_tokens)
    padded_slots = sum(len(b) * max(lengths[i] for i in b) for b in bins)
    print(
        f"{name:<34} n={len(lengths):>5} tok={sum(lengths):>9} | mb={len(bins):>4} bound={bound:>4} "
        f"({len(bins) - bound:+d}, fill {fill:5.1%}) eq->{len(bins_eq):>4} | dp={dp} imbalance "
        f"KK {imbalance(kk_loads):6.2%} RR {imbalance(rr_loads):6.2%} | bshd/thd slots "
        f"{padded_slots / sum(lengths):4.2f}x | {dt * 1e3:7.1f} ms"
    )


def main() -> None:
    rng = random.Random(0)
    print("first-fit packing (given order) vs ceil(total/max_tokens); KK vs round-robin DP assignment")
    for n, median, sigma, dp in [
        (256, 1500, 0.9, 8),
        (512, 2500, 0.8, 8),
        (1024, 3000, 1.0, 16),
        (2048, 800, 1.2, 32),
    ]:
        lengths = lognormal_lengths(rng, n, median, sigma, prompt=300, cap=8192)
        run(f"lognormal med={median} s={sigma}", lengths, 9216, dp)
    lengths = [rng.choice([8192 + 300, 400]) for _ in range(512)]
    run("bimodal truncated/short", lengths, 9216, 8)
    lengths = [
        rng.randint(9300, 12000) if rng.random() < 0.05 else rng.randint(200, 4000) for _ in range(512)
    ]
    run("5% over-long (> cap)", lengths, 9216, 8)
    # KK alone, the balance_data use: 256 samples onto 8 ranks with equal counts
    seqs = lognormal_lengths(rng, 256, 2000, 1.0, 300, 8192)
    kk = balanced_partitions(seqs, 8, equal_size=True)
    rr = [list(range(r, 256, 8)) for r in range(8)]
    print(
        f"samples->ranks (256 on 8, equal counts): KK imbalance {imbalance([sum(seqs[i] for i in p) for p in kk]):.3%}"
        f", round-robin {imbalance([sum(seqs[i] for i in p) for p in rr]):.3%}"
    )


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.2f} s")
