r"""Rule-based rewards in worker processes, off the controller's event loop (`rollout.reward_workers`).

Owns `RewardPool`: a pool of `reward_workers` processes (spawned, so nothing of the controller's event
loop or sockets is inherited) that score a group's samples with `scoring.score` (deepscaler, dapo,
math, f1, tiny_task and their boxed_ forms). The controller sends each group's (rm type, response,
label, metadata) once and gets back, per sample, a reward or the grader's error message, so a failure
still names its sample (group.py raises the `RewardError`). These are local pipes between processes of
one job, not the network.

Why: a reward runs on the controller's one event loop otherwise, and an answer that falls through to
sympy costs 1.5-2.8 ms per sample there (deepscaler: `\frac{3}{4}` against `0.75`, `2\sqrt{2}` against
`\sqrt{8}`; tens of ms for an expression sympy meets the first time): every other request waits.
Measured by benchmarks/bench_reward_pool.py per sample of a group of 8, controller CPU (its
pool threads included), 2 workers, idle 2-core machine:

    answer                  on the loop   in the pool
    integer (\boxed{12})         19 us         45 us
    fraction (sympy path)     1,673 us        153 us

So the pool pays for datasets with symbolic answers and costs ~25 us per sample for integer-only ones
(bench_scale at 256 engines, integer answers: 0.35-0.43 vs 0.42-0.44 controller CPU s per 1,000).

A worker that dies (killed, out of memory) breaks the pool: it is started again and the group is
scored once more; a second break is the group's error.

Does not own: which samples go here (group.py: no custom function, no remote_rm), the graders.
"""

from __future__ import annotations

import logging
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from hpc_rl.process.spawned_pool import SpawnedWorkers

log = logging.getLogger(__name__)

ScoreItem = tuple[str | None, str, Any, dict[str, Any] | None]
"""(rm type, response text, label, metadata: at most the sample's rm_type override) of one sample."""
ScoreResult = tuple[bool, float | str, list[str]]
"""(True, reward, give-ups) or (False, "ErrorType: message", give-ups): give-ups are the symbolic comparisons
the grader gave up on (`sympy_bound.take_give_ups`), for the caller to name the sample."""


def score_items(items: list[ScoreItem]) -> list[ScoreResult]:
    """Run in a worker: each item's reward, or its error as text (exceptions may not pickle)."""
    from hpc_rl.rewards.scoring import score
    from hpc_rl.rewards.sympy_bound import take_give_ups

    results: list[ScoreResult] = []
    for rm_type, response, label, metadata in items:
        try:
            reward = score(rm_type, response, label, metadata)
            results.append((True, reward, take_give_ups()))
        except Exception as error:  # noqa: BLE001 - reported per sample by the caller
            results.append((False, f"{type(error).__name__}: {error}", take_give_ups()))
    return results


def _warm_up() -> None:
    """Import the graders before the first rollout needs them (sympy itself is imported by a worker's
    first symbolic answer, as on the loop: seconds, once per worker, off the controller's loop)."""
    import hpc_rl.rewards.math_equivalence  # noqa: F401
    import hpc_rl.rewards.scoring  # noqa: F401


class RewardPool:
    """`workers` processes scoring rule-based rewards; `await score(items)` per group."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.workers = workers
        self._workers = SpawnedWorkers(workers, warm_up=_warm_up)

    async def start(self) -> None:
        """Start every worker and load the graders (a few seconds of imports, once)."""
        await self._workers.start()

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        try:
            return await self._workers.run(score_items, items)
        except BrokenProcessPool as error:
            log.warning("a reward worker died (%s); starting the pool again and scoring the group once more", error)
            self.close()
            return await self._workers.run(score_items, items)

    def close(self) -> None:
        """Stop the workers now (a group being scored is abandoned; a grader stuck in sympy is killed)."""
        self._workers.close()
