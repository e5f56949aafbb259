"""Prompts that leave no room for a response (slime's --rollout-max-prompt-len, issue 24): dropped when drawn,
counted in rollout/prompts_too_long, the first named once with its data row; by default the limit is
rollout_max_context_len - 1, else what the engines' context leaves; a file of only such prompts is an error."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_rl.data.prompts import DataError
from hpc_rl.rollout.metrics import RolloutMetrics
from hpc_rl.rollout.scheduler import prompt_length_limit
from tests.unit.test_rollout_scheduler import Harness, make_source, run_with


def long_every_fourth(prompt: Any, metadata: dict[str, Any]) -> list[int]:
    row = int(str(prompt)[1:])
    return [10, row] + ([7] * 2000 if row % 4 == 0 else [])  # rows 0, 4, 8...: 2,002 tokens


def test_long_prompts_are_dropped_counted_and_named_once(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hpc_rl.rollout.scheduler")

    async def body(harness: Harness) -> None:
        scheduler = harness.scheduler(group_filter=None, max_prompt_len=511, max_prompt_len_why="rollout_max_prompt_len")
        scheduler.encoder = long_every_fourth
        first = await scheduler.run(0)
        second = await scheduler.run(1)
        rows = [int(g[0].metadata["data_row"]) for result in (first, second) for g in result.groups]
        assert rows and all(row % 4 for row in rows)
        assert first.metrics["rollout/prompts_too_long"] >= 1
        assert all(len(g[0].prompt_token_ids) <= 511 for result in (first, second) for g in result.groups)

    run_with(body)
    said = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert said == ["memory: data row 0 has 2002 prompt tokens, more than 511 (rollout_max_prompt_len): such "
                    "prompts are dropped when drawn, counted in rollout/prompts_too_long (said once)"]


def test_a_file_of_only_long_prompts_is_an_error() -> None:
    async def body(harness: Harness) -> None:
        scheduler = harness.scheduler(group_filter=None, max_prompt_len=1)
        scheduler.source = make_source(rows=8)
        with pytest.raises(DataError, match="every prompt drawn in a whole pass is longer than 1 tokens"):
            scheduler._next_groups(0, 2, RolloutMetrics())

    run_with(body)


def test_the_default_limit_leaves_room_for_a_response() -> None:
    def rollout(prompt: int | None = None, context: int | None = None) -> SimpleNamespace:
        return SimpleNamespace(rollout_max_prompt_len=prompt, rollout_max_context_len=context)

    assert prompt_length_limit(rollout(prompt=100, context=512), 4096)[0] == 100
    assert prompt_length_limit(rollout(context=512), 4096)[0] == 511  # slime: max_context_len - 1
    assert prompt_length_limit(rollout(), 512)[0] == 505  # SGLang refuses context - 6 tokens or more
    assert prompt_length_limit(rollout(), None) == (None, "")
