"""The math graders' sympy path is bounded (rule rewards scored on the controller's loop cannot be cut by
rollout.reward_timeout): answers that made sympy take minutes are refused by a cap or cut by the time limit,
count as "not equal", and the sample is named; ordinary answers are decided as before."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.rewards import sympy_bound
from hpc_rl.rewards.group import RewardSpec, reward_group
from hpc_rl.rewards.math_equivalence import answers_match, sympy_difference_is_zero
from hpc_rl.rewards.pool import RewardPool, score_items
from hpc_rl.rewards.sympy_bound import run_bounded, take_give_ups, within_bounds

SLOW_FOR_SYMPY = "((x+1)^9+1)^9"
"""More than 20 s of sympy.simplify against sqrt(8) on this machine before the bound."""


@pytest.fixture(autouse=True)
def _sympy_imported() -> None:
    """sympy's import (seconds) is not what these tests time."""
    sympy_difference_is_zero("1/2", "0.5")
    take_give_ups()


@pytest.mark.parametrize("answer", ["9**9**9", "10**10**8", "(9!)!", "((9!)!)!", "9!!", "10000!", "1" * 500])
def test_answers_that_blow_sympy_up_are_refused_at_once_and_noted(answer: str) -> None:
    started = time.monotonic()
    assert not answers_match(answer, r"\sqrt{8}")  # old: 9**9**9 and 10**10**8 ran for minutes, (9!)! 9.6 s
    assert time.monotonic() - started < 5.0  # refused before sympy: old, (9!)! took 9.6 s and 9**9**9 minutes
    notes = take_give_ups()
    assert len(notes) == 1 and notes[0].startswith("sympy not asked about"), notes


@pytest.mark.timeout(60)
def test_a_slow_simplify_is_cut_at_the_time_limit(monkeypatch) -> None:
    monkeypatch.setattr(sympy_bound, "SYMPY_TIME_LIMIT_S", 1.0)
    started = time.monotonic()
    assert not answers_match(SLOW_FOR_SYMPY, r"\sqrt{8}")
    elapsed = time.monotonic() - started
    assert elapsed < 10.0, f"took {elapsed:.1f} s"  # cut after 1 s: uncut, more than 20 s
    assert take_give_ups() == [f"sympy gave up on '(sqrt(8))-({SLOW_FOR_SYMPY})' after 1 s"]


def test_ordinary_answers_are_decided_as_before() -> None:
    assert answers_match(r"2\sqrt{2}", r"\sqrt{8}") and answers_match(r"\frac{3}{4}", "0.75")
    assert answers_match("x^2+2x+1", "(x+1)^2") and not answers_match("x^2+1", "(x+1)^2")
    assert answers_match("5!", "120") is False  # an integer answer needs an integer (slime's rule)
    assert sympy_difference_is_zero("120", "5!")
    assert take_give_ups() == []
    assert within_bounds("(x+1)^2-(x^2+2x+1)") and within_bounds("(999!)-(1)")


def test_another_timer_of_the_process_is_put_back() -> None:
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert run_bounded(lambda: 7, "7", limit_s=1.0) == 7
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0  # pytest-timeout's alarm, say: still armed, with what was left of it
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_only_the_caps_hold() -> None:
    async def scenario() -> tuple[bool, list[str]]:
        return await asyncio.to_thread(lambda: (answers_match("9**9**9", "x"), take_give_ups()))

    matched, notes = asyncio.run(scenario())
    assert not matched and notes and "power tower" in notes[0]


def _sample(index: int, response: str) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1], response_text=response, label=r"\sqrt{8}")


@pytest.mark.timeout(120)
def test_the_sample_is_named_on_the_loop_and_in_the_reward_workers(caplog, monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger="hpc_rl.rewards.group")
    monkeypatch.setattr(sympy_bound, "SYMPY_TIME_LIMIT_S", 1.0)
    samples = [_sample(41, r"\boxed{2\sqrt{2}}"), _sample(42, r"\boxed{9**9**9}"), _sample(43, r"\boxed{(9!)!}")]
    on_loop = asyncio.run(reward_group(RewardSpec(rm_type="math"), samples))
    assert on_loop == [1.0, 0.0, 0.0]
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2 and named[0].startswith("reward of sample index 42 (rm_type 'math'): sympy not asked")
    assert "that comparison counts as not equal" in named[0] and "sample index 43" in named[1]

    caplog.clear()

    async def in_pool() -> list[float]:
        pool = RewardPool(1)
        try:
            return await reward_group(RewardSpec(rm_type="math", pool=pool), samples)
        finally:
            pool.close()

    assert asyncio.run(in_pool()) == [1.0, 0.0, 0.0]
    assert [r.getMessage() for r in caplog.records] == named


def test_a_worker_reports_its_give_ups_with_each_result() -> None:
    results = score_items([("math", r"\boxed{9**9**9}", r"\sqrt{8}", None), ("math", r"\boxed{2\sqrt{2}}",
                                                                             r"\sqrt{8}", None)])
    assert results[0][:2] == (True, 0.0) and "power tower" in results[0][2][0]
    assert results[1] == (True, 1.0, [])
