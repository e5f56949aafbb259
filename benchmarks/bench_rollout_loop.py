"""The coordinating process's CPU on the rollout path alone: the real `RolloutScheduler`, generate functions and
`EngineClient` batching, with each batched /generate answered in-process at once (no HTTP, no engines, no answer
workers), in the form the answer workers hand back (token ids and log-probs rebuilt from raw bytes, as
`answer_pool.join_arrays` does). What it measures is what bench_scale's loop spends per sample between "a batch's
answer arrived" and "the group is scored" plus sending, without the simulated fleet's noise on shared cores.

    python benchmarks/bench_rollout_loop.py [--engines 256] [--rollouts 4] [--tokens 2500]

Prints CPU seconds per 1,000 samples (and us per sample) of a rollout of 2,048 samples (256 groups of 8).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from array import array
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_rl.data.prompts import PromptDataset, PromptRecord, PromptSource  # noqa: E402
from hpc_rl.data.samples import Sample  # noqa: E402
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory  # noqa: E402
from hpc_rl.rollout.scheduler import RolloutScheduler, SchedulerSettings  # noqa: E402


class CannedAnswersClientForBench(EngineClient):
    """The real client, its HTTP exchange replaced by answers made at once (`tokens` long, finish "stop")."""

    def __init__(self, *args: Any, tokens: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ids = array("q", range(tokens)).tobytes()
        self.logprobs = (array("d", [-0.5]) * tokens).tobytes()
        self.text = "x" * (4 * tokens)
        self.tokens = tokens

    def _column(self, code: str, data: bytes) -> array:
        column = array(code)
        column.frombytes(data)
        return column

    async def _post_generate(self, base: str, body: dict[str, Any], score: dict[str, Any] | None = None) -> Any:
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        answers = [{"text": self.text, "output_ids": self._column("q", self.ids),
                    "meta_info": {"id": rid, "finish_reason": {"type": "stop"}, "weight_version": "0",
                                  "output_token_logprobs": self._column("d", self.logprobs),
                                  "prompt_tokens": 2, "completion_tokens": self.tokens}} for rid in rids]
        await asyncio.sleep(0)
        return answers if isinstance(body["rid"], list) else answers[0]


async def zero_rewards(samples: list[Sample]) -> list[float]:
    return [0.0] * len(samples)


async def measure(engines: int, rollouts: int, tokens: int) -> float:
    client = CannedAnswersClientForBench(StaticEngineDirectory([f"http://127.0.0.1:{20000 + i}" for i in range(engines)]),
                                         per_engine_concurrency=512, tokens=tokens)
    records = [PromptRecord(row=i, prompt=f"q{i}", label=i) for i in range(4096)]
    source = PromptSource(PromptDataset(path="memory", records=records), shuffle=False, seed=0)
    async with client:
        scheduler = RolloutScheduler(settings=SchedulerSettings(rollout_batch_size=256, n_samples_per_prompt=8),
                                     client=client, source=source, encoder=lambda prompt, metadata: [10, 11],
                                     reward_fn=zero_rewards, sampling_params={"max_new_tokens": 8192, "temperature": 1.0})
        await scheduler.run(0)  # warm
        cpu = time.thread_time()
        for rollout in range(1, rollouts + 1):
            assert len((await scheduler.run(rollout)).groups) == 256
        return time.thread_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2500)
    args = parser.parse_args(argv)
    spent = asyncio.run(measure(args.engines, args.rollouts, args.tokens))
    samples = args.rollouts * 2048
    print(f"N={args.engines}: {1000 * spent / samples:.3f} CPU s per 1,000 samples ({1e6 * spent / samples:.1f} us per "
          f"sample), {args.tokens} tokens each; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
