"""custom_rm_path loading and reward_group dispatch (per sample, group mode, errors)."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.rewards import PluginError, RewardError, RewardSpec, load_reward_function, reward_group

PLUGIN_SOURCE = textwrap.dedent(
    """
    import asyncio

    async def length_reward(args, sample):
        await asyncio.sleep(0)
        return float(len(sample.response_text)) * args["scale"]

    async def group_rank(args, samples):
        return [float(i) for i, _ in enumerate(samples)]

    async def group_wrong_length(args, samples):
        return [1.0]

    async def explode(args, sample):
        raise RuntimeError("judge crashed")

    async def dict_reward(args, sample):
        return {"score": 0.25, "acc": False}

    async def not_a_number(args, sample):
        return "high"

    def sync_reward(args, sample):
        return 1.0

    async def one_arg(sample):
        return 1.0

    async def with_kwargs(args, sample, **kwargs):
        return 2.0

    class Judge:
        async def __call__(self, args, sample):
            return 3.0

    judge = Judge()
    NOT_CALLABLE = 42
    """
)


@pytest.fixture()
def plugin_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(PLUGIN_SOURCE)
    return path


T = TypeVar("T")


def make_samples(*responses: str) -> list[Sample]:
    return [
        Sample(index=100 + i, group_index=7, prompt="q", prompt_token_ids=[1], label="x", response_text=r)
        for i, r in enumerate(responses)
    ]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# --- loading ------------------------------------------------------------------------------------


def test_load_from_file_and_from_module(plugin_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = load_reward_function(f"{plugin_file}:length_reward")
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    from_module = load_reward_function("my_reward.length_reward")
    sample = make_samples("abcd")[0]
    assert run(from_file({"scale": 1.0}, sample)) == 4.0
    assert run(from_module({"scale": 2.0}, sample)) == 8.0


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        (":sync_reward", "must be an 'async def' function"),
        (":one_arg", r"2 positional argument\(s\) \(args, sample\)"),
        (":NOT_CALLABLE", "not a callable"),
        (":missing", "has no attribute 'missing'"),
    ],
)
def test_bad_functions_are_named(plugin_file: Path, suffix: str, message: str) -> None:
    path = f"{plugin_file}{suffix}"
    with pytest.raises(PluginError, match=message) as caught:
        load_reward_function(path)
    assert path in str(caught.value)


def test_group_mode_expects_samples(plugin_file: Path) -> None:
    with pytest.raises(PluginError, match=r"\(args, samples\)"):
        load_reward_function(f"{plugin_file}:one_arg", group=True)


def test_kwargs_and_async_callable_objects_are_accepted(plugin_file: Path) -> None:
    assert run(load_reward_function(f"{plugin_file}:with_kwargs")(None, make_samples("a")[0])) == 2.0
    assert run(load_reward_function(f"{plugin_file}:judge")(None, make_samples("a")[0])) == 3.0


def test_missing_module_and_file(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="module 'no_such_pkg.mod' not found"):
        load_reward_function("no_such_pkg.mod.fn")
    with pytest.raises(PluginError, match="does not exist"):
        load_reward_function(f"{tmp_path}/nope.py:fn")
    with pytest.raises(PluginError, match="expected a dotted path"):
        load_reward_function("justaname")


def test_file_that_fails_to_execute(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(PluginError, match="broken.py imports 'no_such_dependency_xyz', which is not installed"):
        load_reward_function(f"{broken}:fn")


def test_spec_validate_fails_early(plugin_file: Path) -> None:
    spec = RewardSpec(custom_rm_path=f"{plugin_file}:sync_reward")
    with pytest.raises(PluginError, match="async def"):
        spec.validate()


# --- reward_group -------------------------------------------------------------------------------


def test_rule_rewards_per_sample() -> None:
    samples = make_samples("</think>\\boxed{\\frac{1}{2}}", "</think>\\boxed{3}", "no answer")
    for s in samples:
        s.label = "0.5"
    assert run(reward_group(RewardSpec(rm_type="deepscaler"), samples)) == [1.0, 0.0, 0.0]
    assert run(reward_group(RewardSpec(rm_type="deepscaler"), [])) == []


def test_metadata_rm_type_per_sample() -> None:
    samples = make_samples("Answer: 34", "\\boxed{34}")
    for s in samples:
        s.label = "34"
    samples[0].metadata["rm_type"] = "dapo"
    assert run(reward_group(RewardSpec(rm_type="math"), samples)) == [1.0, 1.0]


def test_custom_per_sample_and_group(plugin_file: Path) -> None:
    samples = make_samples("ab", "abc")
    per_sample = RewardSpec(custom_rm_path=f"{plugin_file}:length_reward", args={"scale": 0.5})
    assert run(reward_group(per_sample, samples)) == [1.0, 1.5]
    grouped = RewardSpec(custom_rm_path=f"{plugin_file}:group_rank", group_rm=True)
    assert run(reward_group(grouped, samples)) == [0.0, 1.0]


def test_custom_dict_result_needs_reward_key(plugin_file: Path) -> None:
    samples = make_samples("a")
    keyed = RewardSpec(custom_rm_path=f"{plugin_file}:dict_reward", reward_key="score")
    assert run(reward_group(keyed, samples)) == [0.25]
    with pytest.raises(RewardError, match="set reward_key"):
        run(reward_group(RewardSpec(custom_rm_path=f"{plugin_file}:dict_reward"), samples))


def test_errors_name_the_sample_and_rm(plugin_file: Path) -> None:
    path = f"{plugin_file}:explode"
    with pytest.raises(RewardError) as caught:
        run(reward_group(RewardSpec(custom_rm_path=path), make_samples("a", "b")))
    message = str(caught.value)
    assert "sample index 100" in message and path in message and "judge crashed" in message
    assert "1 more sample(s) failed" in message
    assert caught.value.indices == [100, 101]
    assert isinstance(caught.value.__cause__, RuntimeError)

    with pytest.raises(RewardError, match="sample index 100 .*not a number"):
        run(reward_group(RewardSpec(custom_rm_path=f"{plugin_file}:not_a_number"), make_samples("a")))

    with pytest.raises(RewardError, match=r"samples with index \[100, 101\].*expected a list of 2 rewards"):
        grouped = RewardSpec(custom_rm_path=f"{plugin_file}:group_wrong_length", group_rm=True)
        run(reward_group(grouped, make_samples("a", "b")))


def test_rule_grader_error_is_not_swallowed() -> None:
    sample = make_samples("Answer: 1")[0]
    sample.label = "one half"
    with pytest.raises(RewardError, match=r"sample index 100 \(rm_type 'dapo'\): ValueError: dapo compares"):
        run(reward_group(RewardSpec(rm_type="dapo"), [sample]))


def test_spec_checks() -> None:
    with pytest.raises(ValueError, match="unknown rm_type 'deepscalr'"):
        RewardSpec(rm_type="deepscalr")
    with pytest.raises(ValueError, match="needs rm_url"):
        RewardSpec(rm_type="remote_rm")
    with pytest.raises(ValueError, match="group_rm needs custom_rm_path"):
        RewardSpec(rm_type="math", group_rm=True)
    with pytest.raises(ValueError, match="set rm_type or custom_rm_path"):
        RewardSpec()
