"""Controller CPU per sample of a rule-based reward on the event loop and in `rollout.reward_workers`
worker processes (hpc_rl/rewards/pool.py), for an integer answer and one that takes deepscaler's
sympy path. The controller's CPU includes the pool's own threads (pickling, result handling).

    python benchmarks/bench_reward_pool.py [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_rl.data.samples import Sample  # noqa: E402
from hpc_rl.rewards.group import RewardSpec, reward_group  # noqa: E402
from hpc_rl.rewards.pool import RewardPool  # noqa: E402

CASES = (("integer", "</think> \\boxed{12}", "12", 300),
         ("fraction (sympy)", "</think> The answer is \\boxed{\\frac{3}{4}}", "0.75", 30))


def group(text: str, label: str) -> list[Sample]:
    return [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], label=label, response_text=text)
            for i in range(8)]


async def main(workers: int) -> None:
    pool = RewardPool(workers)
    await pool.start()
    try:
        for name, text, label, groups in CASES:
            samples = group(text, label)
            for where, spec in (("on the loop", RewardSpec(rm_type="deepscaler")),
                                (f"{workers} workers", RewardSpec(rm_type="deepscaler", pool=pool))):
                await reward_group(spec, samples)  # sympy's first use of an expression is not what we time
                cpu, wall = time.process_time(), time.perf_counter()
                await asyncio.gather(*(reward_group(spec, samples) for _ in range(groups)))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                per = 8 * groups
                print(f"{name:>17} {where:>12}: controller CPU {1e6 * cpu / per:7.0f} us/sample, "
                      f"wall {1e6 * wall / per:7.0f} us/sample")
    finally:
        pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    asyncio.run(main(parser.parse_args().workers))
