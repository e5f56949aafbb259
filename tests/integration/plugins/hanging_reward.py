"""A custom reward that hangs (a blocking `time.sleep` inside an async def) from its 3rd rollout on: how a
reward calling a judge that never answers, or stuck on a lock, behaves in a run. It scores the tiny task
before that, and writes the time it started hanging to $HPC_RL_TEST_HANG_FILE (the test measures from it)."""

from __future__ import annotations

import os
import time
from typing import Any

from hpc_rl.data.samples import Sample
from hpc_rl.data.tiny_task import tiny_task_reward

SAMPLES_BEFORE_HANGING = 2 * 16 * 8  # two rollouts of the tiny config (16 prompts x 8 samples)
calls = 0


async def reward(args: Any, sample: Sample) -> float:
    global calls
    calls += 1
    if calls > SAMPLES_BEFORE_HANGING:
        marker = os.environ.get("HPC_RL_TEST_HANG_FILE")
        if marker and not os.path.exists(marker):
            with open(marker, "w") as handle:
                handle.write(f"{time.time()}\n")
        time.sleep(3600)
    return tiny_task_reward(sample.response_text, sample.label)
