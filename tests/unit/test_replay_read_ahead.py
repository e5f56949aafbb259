"""Routing replay's read-ahead (slime's --routing-replay-prefetch-microbatches): what is built when, and the
memory bound (at most depth + 1 micro-batches' targets held). The replay itself on a real MoE actor with the
default read-ahead of 1 is tests/integration/test_routing_replay.py's."""

from __future__ import annotations

import pytest

from hpc_rl.config.help_text import slime_flag_status
from hpc_rl.training.replay_read_ahead import ReplayReadAhead


class Micro:
    def __init__(self, name: str) -> None:
        self.name = name


def run(depth: int, micros: list[Micro] | None,
        order: list[Micro]) -> tuple[list[str], list[tuple[str, list[str]]], int]:
    built: list[str] = []
    read_ahead = ReplayReadAhead(lambda micro: built.append(micro.name) or f"targets of {micro.name}", micros, depth)
    trace = []
    for micro in order:
        assert read_ahead.take(micro) == f"targets of {micro.name}"
        trace.append((micro.name, list(built)))
    return built, trace, read_ahead.most_held


def test_read_ahead_builds_the_next_depth_micro_batches_once_each() -> None:
    micros = [Micro(n) for n in "abcd"]
    built, trace, held = run(2, micros, micros)
    assert built == ["a", "b", "c", "d"]  # each once, in order
    assert trace[0] == ("a", ["a", "b", "c"])  # a's forward: b and c read ahead
    assert trace[1] == ("b", ["a", "b", "c", "d"])
    assert held == 3  # the bound: depth + 1


def test_depth_zero_or_no_order_builds_at_each_forward() -> None:
    micros = [Micro(n) for n in "abc"]
    for depth, order in ((0, micros), (3, None)):
        _, trace, held = run(depth, order, micros)
        assert [names for _, names in trace] == [["a"], ["a", "b"], ["a", "b", "c"]]
        assert held == 1
    with pytest.raises(ValueError, match=">= 0"):
        ReplayReadAhead(lambda micro: None, micros, -1)


def test_a_micro_batch_outside_the_order_is_built_at_its_forward() -> None:
    micros = [Micro(n) for n in "ab"]
    stranger = Micro("x")
    built, _, _ = run(1, micros, [micros[0], stranger, micros[1]])
    assert built == ["a", "b", "x"]  # b read ahead at a's forward, taken later without a rebuild


def test_the_flag_is_a_checked_training_field() -> None:
    from hpc_rl.config.loading import build_config, parse_cli_settings
    from tests.unit.test_slime_flag_walk import tiny_settings

    config = build_config([*tiny_settings(), *parse_cli_settings(["--routing-replay-prefetch-microbatches", "3"])])
    assert config.training.routing_replay_prefetch_microbatches == 3
    assert build_config(list(tiny_settings())).training.routing_replay_prefetch_microbatches == 1  # slime's default
    with pytest.raises(Exception, match="routing_replay_prefetch_microbatches"):
        build_config([*tiny_settings(), *parse_cli_settings(["--routing-replay-prefetch-microbatches", "-1"])])
    assert "training.routing_replay_prefetch_microbatches" in slime_flag_status("routing_replay_prefetch_microbatches")
