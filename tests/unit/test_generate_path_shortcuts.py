"""The /generate path's shortcuts for the common case give what the general rules give (rollout/engine_client.py's
inline context fit, request_fields.weight_version_column without spans or with spans of one version,
WorkerRewards.request's remembered verdicts, request_batching.merge_payloads)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.data.uniform_column import UniformColumn
from hpc_rl.rewards.worker_scored import WorkerRewards, scoring_request
from hpc_rl.rollout.context_length import clip_to_context, context_full_answer
from hpc_rl.rollout.engine_client import EngineClient, GenerateAnswer, StaticEngineDirectory
from hpc_rl.rollout.request_batching import merge_payloads
from hpc_rl.rollout.request_fields import version_to_int, weight_version_column


def reference_versions(meta: dict[str, Any], n_tokens: int, fallback: int) -> list[int]:
    """The rule, token by token: a span's version over its tokens, the single version elsewhere."""
    versions = [version_to_int(meta.get("weight_version"), fallback)] * n_tokens
    for span in meta.get("weight_versions") or []:
        try:
            start, end = int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            continue
        for position in range(max(0, start), min(n_tokens, end)):
            versions[position] = version_to_int(span.get("version"), fallback)
    return versions


@pytest.mark.parametrize("meta", [
    {"weight_version": "3"},
    {"weight_version": "default"},
    {"weight_version": "3", "weight_versions": []},
    {"weight_version": "3", "weight_versions": [{"version": "3", "start": 0, "end": 10}]},
    {"weight_version": "3", "weight_versions": [{"version": "2", "start": -4, "end": 3},
                                                {"version": "3", "start": 3, "end": 99}]},
    {"weight_version": "3", "weight_versions": [{"version": "2", "start": 0, "end": 10}]},
    {"weight_version": "3", "weight_versions": [{"version": "2", "start": 12, "end": 20}, {"start": "x"}, None]},
    {"weight_version": "3", "weight_versions": [{"version": "x", "start": 2, "end": 4}]},
])
def test_weight_version_column_is_the_token_by_token_rule(meta: dict[str, Any]) -> None:
    column = weight_version_column(meta, 10, 7)
    assert list(column) == reference_versions(meta, 10, 7)
    assert isinstance(column, UniformColumn) == (len(set(reference_versions(meta, 10, 7))) == 1)


def sample(index: int, label: Any, rm_type: Any = None, text: str = "") -> Sample:
    made = Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1], label=label, response_text=text)
    if rm_type is not None:
        made.metadata["rm_type"] = rm_type
    return made


@pytest.mark.parametrize("run_type", ["deepscaler", "boxed_f1", "remote_rm", "nonsense", None, " math "])
def test_worker_rewards_request_equals_scoring_request(run_type: str | None) -> None:
    rewards = WorkerRewards(run_type)
    shared = "12"
    cases = [sample(0, shared), sample(1, shared), sample(2, 3.5), sample(3, float("nan")), sample(4, [1]),
             sample(5, shared, "f1"), sample(6, shared, "remote_rm"), sample(7, "\ud800"), sample(8, 1 << 70),
             sample(9, shared, ""), sample(10, None, "unknown_type"), sample(11, shared)]
    for case in cases * 2:  # the second time from what was remembered
        assert rewards.request(case) == scoring_request(run_type, case), (run_type, case.label, case.metadata)


def test_merge_payloads_keeps_its_fields() -> None:
    plain = [{"rid": f"r{i}", "input_ids": [1, i], "sampling_params": {"max_new_tokens": 4}} for i in range(3)]
    assert merge_payloads(plain) == {"rid": ["r0", "r1", "r2"], "input_ids": [[1, 0], [1, 1], [1, 2]],
                                     "sampling_params": {"max_new_tokens": 4}}
    mixed = [{**plain[0], "return_logprob": True, "lora_path": "a"}, {**plain[1], "top_logprobs_num": 2},
             {**plain[2], "return_routed_experts": False}]
    assert merge_payloads(mixed) == {**merge_payloads(plain), "return_logprob": [True, False, False],
                                     "lora_path": ["a", None, None], "top_logprobs_num": [0, 2, 0]}
    assert merge_payloads([{**p, "return_routed_experts": i == 1} for i, p in enumerate(plain)])[
        "return_routed_experts"] is True


def test_generate_many_fits_payloads_to_the_context_as_the_general_rules_do(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict[str, Any]] = []

    async def send(self: EngineClient, payloads: list[dict[str, Any]], stopped: Any, *, direct: bool,
                   reward_requests: Any = None) -> list[GenerateAnswer]:
        sent.extend(payloads)
        return [GenerateAnswer(body={"rid": payload["rid"]}, engine_url="u") for payload in payloads]

    monkeypatch.setattr(EngineClient, "_send", send)
    context = 64
    payloads = [
        {"rid": "fits", "input_ids": [1] * 50, "sampling_params": {"max_new_tokens": 14}},
        {"rid": "edge", "input_ids": [1] * 57, "sampling_params": {"max_new_tokens": 7}},
        {"rid": "clipped", "input_ids": [1] * 50, "sampling_params": {"max_new_tokens": 15}},
        {"rid": "default", "input_ids": [1] * 50, "sampling_params": {}},
        {"rid": "float", "input_ids": [1] * 50, "sampling_params": {"max_new_tokens": 20.0}},
        {"rid": "full", "input_ids": [1] * 58, "sampling_params": {"max_new_tokens": 1}},
        {"rid": "tuple", "input_ids": (1, 2), "sampling_params": {"max_new_tokens": 99}},
    ]
    expected = []
    for payload in payloads:
        clipped = clip_to_context(payload, context)
        expected.append(context_full_answer(clipped, context) or clipped)

    async def body() -> list[Any]:
        async with EngineClient(StaticEngineDirectory(["http://e"]), context_length=context) as client:
            return await client.generate_many(payloads, group=0)

    outcomes = asyncio.run(body())
    assert [answer.engine_url for answer in outcomes] == ["u"] * 5 + [None, "u"]
    assert outcomes[5].body == expected[5]
    by_rid = {payload["rid"]: payload for payload in sent}
    assert [by_rid.get(payload["rid"]) for payload in payloads] == expected[:5] + [None] + expected[6:]
    assert by_rid["fits"] is payloads[0] and by_rid["edge"] is payloads[1]  # a payload that fits goes as it came
