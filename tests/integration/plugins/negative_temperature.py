"""A custom generate function that sends a sampling value the engine refuses (temperature -3): how a bad
value reaches the engine when it slips past the config's validation (a plug-in, a newer SGLang rule)."""

from __future__ import annotations

from typing import Any

from hpc_rl.data.samples import Sample
from hpc_rl.rollout.generate import generate_turn


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    return await generate_turn(sample, {**sampling_params, "temperature": -3.0})
