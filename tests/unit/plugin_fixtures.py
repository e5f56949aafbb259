"""Plug-ins with slime's signatures, one per plug-in point, for tests that need a path that loads
(`tests.unit.plugin_fixtures.<name>`). Each returns something of the right shape and records nothing."""

from __future__ import annotations

from typing import Any


async def reward(args: Any, sample: Any) -> float:
    return 1.0


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    return sample


def custom_loss(args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any) -> tuple[Any, dict[str, Any]]:
    return logits.sum() * 0.0, {}


def custom_advantages(args: Any, rollout_data: dict[str, Any]) -> None:
    rollout_data["advantages"] = rollout_data["returns"] = rollout_data["rewards"]
