"""Rule rewards scored in the answer workers (rollout/worker_rewards.py, rewards/worker_scored.py): the same value,
give-up notes and errors as a reward scored on the controller, used only when it provably applies to the sample's
final response, and the controller scores every other case itself."""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
from typing import Any

import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.rewards import group as reward_groups
from hpc_rl.rewards.group import RewardError, RewardSpec, reward_group
from hpc_rl.rewards.pool import score_items
from hpc_rl.rewards.scoring import score
from hpc_rl.rewards.worker_scored import WorkerRewards, score_answer, scoring_request
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory
from hpc_rl.rollout.generate import GenerationSession, default_generate, generate_turn, run_generate
from hpc_rl.rollout.worker_rewards import REWARD_FIELD, attach_rewards, keep_reward
from tests.unit.test_rollout_fake_engine import FakeSglangEngine

THINK = "Let me think. </think> "
ANSWERS: list[tuple[str, str, Any]] = [
    # (rm type, response text, label): real answers of a math policy, right, wrong, unparseable, symbolic
    ("deepscaler", THINK + r"The answer is \boxed{12}.", "12"),
    ("deepscaler", THINK + r"So $x = \boxed{\frac{3}{4}}$", "0.75"),  # sympy decides it
    ("deepscaler", THINK + r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    ("deepscaler", THINK + r"The answer is \boxed{13}.", "12"),  # wrong
    ("deepscaler", r"I think it is \boxed{12} but I never closed my thoughts", "12"),  # no </think>: 0
    ("deepscaler", THINK + r"The answer is \boxed{12", "12"),  # unparseable box
    ("deepscaler", THINK + r"\boxed{9**9**9}", r"\sqrt{8}"),  # refused by sympy's bound: a give-up note
    ("deepscaler", THINK + r"\boxed{7}", 7),  # an int label
    ("math", r"so \boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
    ("math", r"no box at all: 1/2", r"\frac{1}{2}"),
    ("dapo", "Answer: 42", "42"),
    ("dapo", "Answer: 41", 42),
    ("f1", "the cat sat on the mat", "a cat sat on a mat"),
    ("boxed_f1", r"words \boxed{the cat}", "the cat"),
    ("", "", "12"),  # the empty answer, with the run's type
]


def sample(index: int, text: str, label: Any, rm_type: str = "") -> Sample:
    made = Sample(index=index, group_index=index // 4, prompt="p", prompt_token_ids=[index + 1], label=label,
                  metadata={"rm_type": rm_type} if rm_type else {})
    made.response_text += text
    return made


# -- the pure parts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rm_type,text,label", ANSWERS)
def test_a_worker_scored_reward_equals_the_one_scored_here(rm_type: str, text: str, label: Any) -> None:
    request = scoring_request("deepscaler", sample(0, "", label, rm_type))
    assert request is not None
    record = score_answer(request, text)
    give_ups = score_items([(request["rm_type"], text, label, None)])[0][2]
    expected = score(rm_type or "deepscaler", text, label)
    assert record == ({"reward": expected, "give_ups": give_ups} if give_ups else {"reward": expected})


@pytest.mark.parametrize("label", [["12"], {"a": 1}, (1,), float("nan"), float("inf"), 1 << 70, "\ud800"])
def test_a_label_json_would_not_carry_unchanged_is_scored_here(label: Any) -> None:
    assert scoring_request("deepscaler", sample(0, "", label)) is None


@pytest.mark.parametrize("rm_type,override", [("remote_rm", ""), ("deepscaler", "remote_rm"), (None, ""),
                                              ("deepscaler", "no_such_grader"), ("boxed_remote_rm", "")])
def test_only_rule_types_are_scored_in_workers(rm_type: str | None, override: str) -> None:
    assert scoring_request(rm_type, sample(0, "", "12", override)) is None


def test_a_grader_error_or_a_non_finite_reward_is_sent_back_as_an_error(monkeypatch) -> None:
    assert set(score_answer({"rm_type": "f1", "label": 3}, "text")) == {"error"}  # f1 needs a str label
    from hpc_rl.rewards import scoring

    monkeypatch.setitem(scoring.RULE_GRADERS, "tiny_task", lambda response, label: float("nan"))
    assert score_answer({"rm_type": "tiny_task", "label": "1"}, "1") == {"error": "the reward is nan"}


def test_the_worker_scores_each_item_of_a_batch_by_its_rid_as_the_client_maps_them() -> None:
    rids = ["a", "b", "c"]
    answer = [{"text": THINK + r"\boxed{1}", "meta_info": {"id": "c"}},  # answered out of order
              {"text": THINK + r"\boxed{1}", "meta_info": {"id": "a"}},
              {"text": THINK + r"\boxed{2}", "meta_info": {"id": "b"}}]
    requests = [{"rm_type": "deepscaler", "label": "1"}, None, {"rm_type": "deepscaler", "label": "1"}]
    attach_rewards(answer, {"rids": rids, "requests": requests})
    assert answer[0][REWARD_FIELD] == {"rid": "c", "reward": 1.0}
    assert REWARD_FIELD not in answer[2]  # b asked for nothing
    assert answer[1][REWARD_FIELD] == {"rid": "a", "reward": 1.0}
    not_a_batch = {"text": "x"}
    attach_rewards(not_a_batch, {"rids": rids, "requests": requests})  # the client will call it a failure
    assert REWARD_FIELD not in not_a_batch
    single = {"text": 5}
    attach_rewards(single, {"rids": ["a"], "requests": requests[:1]})  # not a string: scored here
    assert REWARD_FIELD not in single


def test_a_kept_reward_applies_only_to_the_very_text_label_and_rm_type_it_was_scored_for() -> None:
    rewards = WorkerRewards("deepscaler")
    made = sample(0, "", "12")
    request = rewards.request(made)
    text = THINK + r"\boxed{12}"
    made.response_text += text
    rewards.keep(made, request, {"reward": 1.0}, text)
    assert rewards.precomputed(made, "deepscaler").reward == 1.0
    assert rewards.precomputed(made, "math") is None  # another type
    made.metadata["rm_type"] = "dapo"
    assert rewards.precomputed(made, "deepscaler") is None  # an override set after the exchange
    del made.metadata["rm_type"]
    made.label = "".join(["1", "2"])  # an equal label, but not the one sent
    assert rewards.precomputed(made, "deepscaler") is None
    made.label = request["label"]
    made.response_text = "".join([THINK, r"\boxed{12}"])  # an equal text, but set by someone else
    assert rewards.precomputed(made, "deepscaler") is None
    made.response_text = text
    assert rewards.precomputed(made, "deepscaler") is not None
    assert rewards.precomputed(copy.copy(made), "deepscaler") is None  # another sample
    made.response_text += " and a second turn"
    assert rewards.precomputed(made, "deepscaler") is None
    made.response_text = text
    rewards.keep(made, request, {"error": "TypeError: x"}, text)  # no reward: forgotten
    assert rewards.precomputed(made, "deepscaler") is None
    rewards.keep(made, request, {"reward": 1.0}, text)
    keep_reward(rewards, made, request, {REWARD_FIELD: {"rid": "other", "reward": 1.0}}, "mine", text)  # not its rid
    assert rewards.precomputed(made, "deepscaler") is None
    rewards.keep(made, request, {"reward": 1.0}, text)
    keep_reward(rewards, made, None, {REWARD_FIELD: {"rid": "mine", "reward": 1.0}}, "mine", text)  # not asked
    assert rewards.precomputed(made, "deepscaler") is None
    rewards.keep(made, request, {"reward": 1.0}, text)
    rewards.forget(made)
    assert rewards.precomputed(made, "deepscaler") is None


def test_a_kept_reward_goes_with_its_sample_and_is_never_on_it() -> None:
    rewards = WorkerRewards("deepscaler")
    made = sample(0, "x", "1")
    fields_before = dict(made.__dict__)
    rewards.keep(made, {"rm_type": "deepscaler", "label": made.label}, {"reward": 0.0}, made.response_text)
    assert len(rewards) == 1 and made.__dict__ == fields_before  # (a key more on a sample measured +0.2 CPU s)
    del made
    gc.collect()
    assert len(rewards) == 0


# -- through a real client, a real answer pool and a fake engine that answers real texts ---------------------------
class FakeAnsweringEngine(FakeSglangEngine):
    """A fake engine whose answer text is `texts[first prompt token]` (its token ids stay the fake's)."""

    def __init__(self, texts: dict[int, str], **kwargs: Any) -> None:
        super().__init__(natural_length=lambda ids: 3, **kwargs)
        self.texts = texts

    async def _run_one(self, rid: str, input_ids: list[int], max_new: int) -> dict[str, Any]:
        answer = await super()._run_one(rid, input_ids, max_new)
        answer["text"] = self.texts.get(input_ids[0], "")
        return answer


async def generate(samples: list[Sample], *, workers: int, rm_type: str | None = "deepscaler",
                   fn: Any = default_generate) -> tuple[list[Sample], int, WorkerRewards]:
    """Generate `samples` (their prompts' first token picks the text) through a client with answer workers that
    score under `rm_type` (None: they do not, as with a custom reward); (samples, requests, the kept rewards)."""
    texts = {s.prompt_token_ids[0]: s.metadata.pop("answer") for s in samples}
    engine = await FakeAnsweringEngine(texts).start()
    pool = AnswerPool(workers) if workers else None
    client = EngineClient(StaticEngineDirectory([engine.url]), router_url=None, answer_pool=pool)
    kept = WorkerRewards("deepscaler")
    client.worker_rewards = WorkerRewards(rm_type) if rm_type else None
    try:
        async with client:
            session = GenerationSession(client, batch_across_groups=True)
            done = await asyncio.gather(*(run_generate(fn, None, s, {"max_new_tokens": 8}, session) for s in samples))
            return list(done), engine.requests_seen, client.worker_rewards or kept
    finally:
        await engine.stop()


def fresh(index: int, text: str, label: Any, rm_type: str = "") -> Sample:
    made = sample(index, "", label, rm_type)
    made.metadata["answer"] = text
    return made


def count_scores_here(monkeypatch) -> list[str]:
    """The responses the controller scores itself from now on."""
    scored: list[str] = []
    real = reward_groups.score

    def counting(rm_type: str, response: str, label: Any, metadata: Any = None) -> float:
        scored.append(response)
        return real(rm_type, response, label, metadata)

    monkeypatch.setattr(reward_groups, "score", counting)
    return scored


def test_worker_scored_rewards_equal_loop_scored_ones_and_the_loop_scores_none(monkeypatch, caplog) -> None:
    samples = [fresh(i, text, label, rm_type) for i, (rm_type, text, label) in enumerate(ANSWERS)]
    done, requests, rewards = asyncio.run(generate(samples, workers=2))
    assert requests < len(samples)  # batched: several answers per exchange
    assert all(s.response_text == text for s, (_, text, _) in zip(done, ANSWERS))
    assert all(rewards.precomputed(s, "deepscaler") is not None for s in done)
    caplog.set_level(logging.WARNING, logger="hpc_rl.rewards.group")
    expected = asyncio.run(reward_group(RewardSpec(rm_type="deepscaler"), done))  # scored here, as without workers
    loop_notes = [r.getMessage() for r in caplog.records]
    assert len(loop_notes) == 1 and "sample index 6" in loop_notes[0]  # 9**9**9: refused by sympy's bound
    caplog.clear()
    scored_here = count_scores_here(monkeypatch)
    assert asyncio.run(reward_group(RewardSpec(rm_type="deepscaler", worker_rewards=rewards), done)) == expected
    assert scored_here == []
    assert [r.getMessage() for r in caplog.records] == loop_notes  # the give-up named as on the loop
    assert expected[:4] == [1.0, 1.0, 1.0, 0.0]


def test_without_answer_workers_or_with_a_custom_reward_nothing_is_scored_in_workers() -> None:
    for workers, rm_type in ((0, "deepscaler"), (1, None)):  # rm_type None: the stack's custom_rm_path case
        done, _, rewards = asyncio.run(generate([fresh(0, THINK + r"\boxed{1}", "1")], workers=workers,
                                                rm_type=rm_type))
        assert rewards.precomputed(done[0], "deepscaler") is None and len(rewards) == 0


def test_a_custom_generate_function_and_a_resumed_sample_are_scored_here(monkeypatch) -> None:
    async def two_turns(args: Any, s: Sample, params: dict[str, Any]) -> Sample:
        await generate_turn(s, params)
        s.response_text += " then a tool said 3"
        return s

    custom = fresh(0, THINK + r"\boxed{1}", "1")
    resumed = fresh(1, r"\boxed{1}", "1")
    resumed.response_text = THINK  # a partial sample from the buffer: the answer is not its whole response
    resumed.extend_response([5], [-0.1], [0])
    done_custom, _, custom_rewards = asyncio.run(generate([custom], workers=1, fn=two_turns))
    done_resumed, _, resumed_rewards = asyncio.run(generate([resumed], workers=1))
    assert len(custom_rewards) == 0 and len(resumed_rewards) == 0  # never asked of the workers
    scored_here = count_scores_here(monkeypatch)
    for done, rewards in ((done_custom, custom_rewards), (done_resumed, resumed_rewards)):
        assert asyncio.run(reward_group(RewardSpec(rm_type="deepscaler", worker_rewards=rewards), done)) == [1.0]
    assert scored_here == [THINK + r"\boxed{1} then a tool said 3", THINK + r"\boxed{1}"]


def test_a_hook_that_changes_the_text_or_the_label_after_generation_is_scored_here(monkeypatch) -> None:
    samples = [fresh(0, THINK + r"\boxed{1}", "1"), fresh(1, THINK + r"\boxed{1}", "1"),
               fresh(2, THINK + r"\boxed{1}", "1")]
    done, _, rewards = asyncio.run(generate(samples, workers=1))
    done[0].response_text = done[0].response_text.replace("1", "2")
    done[1].label = "2"
    scored_here = count_scores_here(monkeypatch)
    assert asyncio.run(reward_group(RewardSpec(rm_type="deepscaler", worker_rewards=rewards), done)) == [0.0, 0.0, 1.0]
    assert len(scored_here) == 2


def test_a_grader_error_ends_as_the_same_reward_error_naming_the_sample() -> None:
    samples = [fresh(0, "the cat", "the cat", "f1"), fresh(1, "the cat", 7, "f1")]  # f1 refuses an int label
    done, _, rewards = asyncio.run(generate(samples, workers=1))
    assert rewards.precomputed(done[0], "deepscaler") is not None
    assert rewards.precomputed(done[1], "deepscaler") is None  # the worker's error: scored here again
    with pytest.raises(RewardError) as on_loop:
        asyncio.run(reward_group(RewardSpec(rm_type="deepscaler"), done))
    with pytest.raises(RewardError) as with_workers:
        asyncio.run(reward_group(RewardSpec(rm_type="deepscaler", worker_rewards=rewards), done))
    assert str(with_workers.value) == str(on_loop.value)
    assert "sample index 1 (rm_type 'f1'): TypeError" in str(with_workers.value)
    assert with_workers.value.indices == [1] and type(with_workers.value.__cause__) is TypeError


class FakeInlineRewardPool:
    """A fake of `RewardPool` that scores in this process (the pool's own tests start real workers)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    async def score(self, items: list[Any]) -> list[Any]:
        self.items.extend(items)
        return score_items(items)


def test_with_reward_workers_too_only_the_samples_the_answer_workers_did_not_score_go_to_them() -> None:
    samples = [fresh(0, THINK + r"\boxed{1}", "1"), fresh(1, THINK + r"\boxed{2}", "1"),
               fresh(2, THINK + r"\boxed{1}", "1")]
    done, _, rewards = asyncio.run(generate(samples, workers=1))
    done[1].response_text = THINK + r"\boxed{1}"  # changed after generation: scored by the reward workers
    pool = FakeInlineRewardPool()
    spec = RewardSpec(rm_type="deepscaler", pool=pool, worker_rewards=rewards)  # type: ignore[arg-type]
    assert asyncio.run(reward_group(spec, done)) == [1.0, 1.0, 1.0]
    assert [item[1] for item in pool.items] == [THINK + r"\boxed{1}"]
    assert asyncio.run(reward_group(spec, [done[0], done[2]])) == [1.0, 1.0] and len(pool.items) == 1
