"""Rewards for the controller: `await reward_group(spec, samples)` -> one float per sample.

Owns: `RewardSpec` (what to score with: rm type, custom function path, reward server URL, group
mode, the opaque `args` handed to custom functions), the dispatch per sample (custom function >
per-sample `metadata["rm_type"]` > `spec.rm_type`), the group-mode call of a custom function, when
a batch opens `remote_rm`'s HTTP session (remote.py's), and `RewardError`: any failure is raised with
the sample's `index` and the rm type in its message, never turned into a silent 0. A reward that is NaN
or infinite is such a failure too, and every call is bounded by `timeout_s` (`rollout.reward_timeout`):
custom functions run on `RewardThread`, off the caller's event loop.

    reward_group(spec, samples)
      custom_rm_path and group_rm -> await fn(args, samples)          one call, len checked (reward thread)
      otherwise, concurrently for each sample:
        custom_rm_path            -> await fn(args, sample)           (reward thread)
        remote_rm                 -> POST {prompt, response, label} with retries (remote.py)
        deepscaler|dapo|math|f1   -> the answer worker's reward when it provably applies (worker_scored.py:
                                     `rollout.answer_parse_workers`), else score(...) directly (sync,
                                     cheap; scoring.py), or, with `spec.pool`, in a worker process (pool.py)

It does not write `sample.reward`; the caller does, so a failed group leaves samples untouched. With
`category_key` (slime's --log-reward-category) the reward object's value under that key is kept in
`sample.metadata[REWARD_CATEGORY]` for the rollout metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_rl.data.samples import Sample
from hpc_rl.rewards.plugins import RewardFunction, load_reward_function
from hpc_rl.rewards.pool import RewardPool
from hpc_rl.rewards.reward_thread import RewardThread, RewardTimeout, bounded
from hpc_rl.retry_policy import RetryPolicy
from hpc_rl.rewards.remote import REMOTE_RM_RETRY, post_for_reward, reward_payload, reward_session
from hpc_rl.rewards.scoring import REMOTE_RM, check_rm_type, resolve_rm_type, score, split_boxed_prefix
from hpc_rl.rewards.sympy_bound import take_give_ups
from hpc_rl.rewards.worker_scored import WorkerReward, WorkerRewards

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from hpc_rl.rewards.remote import RewardSession


REWARD_CATEGORY = "reward_category"
"""`sample.metadata` key of the reward object's category (`RewardSpec.category_key`)."""


class RewardError(RuntimeError):
    """A reward could not be computed; names the sample(s) and the rm type."""

    def __init__(self, message: str, *, indices: Sequence[int], rm_type: str) -> None:
        super().__init__(message)
        self.indices = list(indices)
        self.rm_type = rm_type


@dataclass(kw_only=True)
class RewardSpec:
    """How samples are scored (slime's `--rm-type`, `--custom-rm-path`, `--rm-url`, `--group-rm`)."""

    rm_type: str | None = None
    """deepscaler | dapo | math | f1 | remote_rm (rule types also as boxed_<type>)."""
    custom_rm_path: str | None = None
    """`pkg.module.fn` or `path/to/file.py:fn`; when set it replaces `rm_type`."""
    rm_url: str | None = None
    """Reward server URL for remote_rm."""
    group_rm: bool = False
    """Call the custom function once per group with the list of samples."""
    reward_key: str | None = None
    """When a custom function or the server returns an object, the key holding the reward."""
    category_key: str | None = None
    """When it returns an object, the key whose value is kept as the sample's reward category."""
    proxy: str | None = None
    """HTTP proxy for the reward server's calls (slime's --http-proxy)."""
    retry: RetryPolicy = REMOTE_RM_RETRY
    """remote_rm retry policy."""
    remote_timeout_s: float = 120.0
    """Total timeout of one remote_rm request."""
    args: Any = None
    """Passed as-is as the first argument of custom functions (slime passes its args namespace)."""
    pool: RewardPool | None = None
    """Worker processes for rule-based rewards (`rollout.reward_workers`); None: scored on the event loop."""
    timeout_s: float = 300.0
    """Bound of one reward call (a sample's; a group's with group_rm): `rollout.reward_timeout`."""
    thread: RewardThread | None = None
    """Where custom functions run (off the caller's event loop); None: on the caller's loop, still bounded."""
    worker_rewards: WorkerRewards | None = None
    """Rule rewards the answer workers computed (`rollout.answer_parse_workers`), each used only where it provably
    is the reward `score` would give (worker_scored.py); None: every rule reward is scored here."""

    def __post_init__(self) -> None:
        if self.custom_rm_path is None:
            if self.group_rm:
                raise ValueError("group_rm needs custom_rm_path (rule and remote rewards are per sample)")
            if self.rm_type is None:
                raise ValueError("set rm_type or custom_rm_path")
            check_rm_type(self.rm_type)
            if split_boxed_prefix(self.rm_type)[1] == REMOTE_RM and not self.rm_url:
                raise ValueError("rm_type remote_rm needs rm_url")

    @property
    def label(self) -> str:
        """How this spec names itself in error messages."""
        if self.custom_rm_path is not None:
            mode = "group" if self.group_rm else "per sample"
            return f"custom_rm_path {self.custom_rm_path!r} ({mode})"
        return f"rm_type {self.rm_type!r}"

    def validate(self) -> None:
        """Import and check the custom function now (submit time) rather than mid-run."""
        if self.custom_rm_path is not None:
            load_reward_function(self.custom_rm_path, group=self.group_rm)


def _as_reward(value: Any, reward_key: str | None, source: str) -> float:
    if isinstance(value, dict):
        if reward_key is None:
            raise TypeError(
                f"{source} returned an object with keys {sorted(value)}; set reward_key to pick one"
            )
        if reward_key not in value:
            raise KeyError(f"{source} returned an object without {reward_key!r} (keys {sorted(value)})")
        value = value[reward_key]
    if isinstance(value, bool):  # (a bool is an int): slime takes it as 1/0, so it is, but said once per source
        if source not in _BOOL_SOURCES_WARNED:
            _BOOL_SOURCES_WARNED.add(source)
            log.warning("%s returned a bool (%r) as a reward: taken as %.1f (True 1.0, False 0.0); return a float "
                        "to say so explicitly (said once per reward source)", source, value, float(value))
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"{source} returned {value!r} ({type(value).__name__}), not a number")


_BOOL_SOURCES_WARNED: set[str] = set()
"""Reward sources (plug-in path, reward URL) already warned about returning bools (`_as_reward`)."""


def _keep_category(spec: RewardSpec, sample: Sample, value: Any) -> Any:
    if spec.category_key is not None and isinstance(value, dict):
        sample.metadata[REWARD_CATEGORY] = value.get(spec.category_key)
    return value


async def _call_custom(spec: RewardSpec, make: Callable[[], Awaitable[Any]], what: str = "") -> Any:
    """A custom function's call: on the reward thread when there is one, bounded by the timeout either way.
    `what` ("sample index 19") names it when a call queued behind it times out."""
    if spec.thread is not None:
        return await spec.thread.call(make, spec.timeout_s, what=what)
    return await bounded(make(), spec.timeout_s)


async def _reward_one(spec: RewardSpec, sample: Sample, session: RewardSession | None) -> float:
    if spec.custom_rm_path is not None:
        function: RewardFunction = load_reward_function(spec.custom_rm_path, group=False)
        value = await _call_custom(spec, lambda: function(spec.args, sample), f"sample index {sample.index}")
        return _as_reward(_keep_category(spec, sample, value), spec.reward_key, spec.custom_rm_path)
    rm_type = resolve_rm_type(spec.rm_type, sample.metadata)
    if split_boxed_prefix(rm_type)[1] == REMOTE_RM:
        if session is None or not spec.rm_url:
            raise ValueError("remote_rm needs rm_url")
        payload = reward_payload(sample.prompt, sample.response_text, sample.label)
        answer = await bounded(post_for_reward(session, spec.rm_url, payload, spec.retry), spec.timeout_s)
        return _as_reward(_keep_category(spec, sample, answer), spec.reward_key, spec.rm_url)
    known = _precomputed(spec, sample, rm_type)  # scored by the answer worker, for this very text and label
    if known is not None:
        return _taken(sample, known)
    take_give_ups()  # a custom function's graders on this thread are not this sample's
    reward = score(rm_type, sample.response_text, sample.label, sample.metadata)
    name_give_ups(sample, rm_type, take_give_ups())
    return reward


def _precomputed(spec: RewardSpec, sample: Sample, rm_type: str | None) -> WorkerReward | None:
    return spec.worker_rewards.precomputed(sample, rm_type) if spec.worker_rewards is not None else None


def _taken(sample: Sample, known: WorkerReward) -> float:
    """An answer worker's reward of `sample`, its grader's give-ups named as if scored here."""
    name_give_ups(sample, known.rm_type, list(known.give_ups))
    return known.reward


def name_give_ups(sample: Sample, rm_type: str, give_ups: list[str]) -> None:
    """Say which sample a grader's bounded sympy gave up on (its comparison counted as "not equal")."""
    for note in give_ups:
        log.warning("reward of sample index %d (rm_type %r): %s; that comparison counts as not equal",
                    sample.index, rm_type, note)


def _sample_rm_type(spec: RewardSpec, sample: Sample) -> str:
    if spec.custom_rm_path is not None:
        return spec.label
    override = sample.metadata.get("rm_type") if sample.metadata else None
    return f"rm_type {(override or spec.rm_type)!r}"


def _sample_failure(spec: RewardSpec, sample: Sample, description: str) -> RewardError:
    """The error of one sample's reward; `description` is "ErrorType: message"."""
    what = _sample_rm_type(spec, sample)
    return RewardError(f"reward failed for sample index {sample.index} ({what}): {description}",
                       indices=[sample.index], rm_type=what)


def _raise_failures(failures: list[BaseException]) -> None:
    """Raise the first failure, naming every failed sample when there are several."""
    first = failures[0]
    if len(failures) == 1 or not isinstance(first, RewardError):
        raise first
    indices = [i for f in failures if isinstance(f, RewardError) for i in f.indices]
    raise RewardError(
        f"{first} (and {len(failures) - 1} more sample(s) failed; indices {indices})",
        indices=indices,
        rm_type=first.rm_type,
    ) from first.__cause__


async def _guarded(spec: RewardSpec, sample: Sample, session: RewardSession | None) -> float:
    try:
        return await _reward_one(spec, sample, session)
    except Exception as error:
        raise _sample_failure(spec, sample, f"{type(error).__name__}: {error}") from error


def _needs_session(spec: RewardSpec, samples: Sequence[Sample]) -> bool:
    if spec.custom_rm_path is not None:
        return False
    for sample in samples:
        override = sample.metadata.get("rm_type") if sample.metadata else None
        chosen = override or spec.rm_type
        if isinstance(chosen, str) and split_boxed_prefix(chosen.strip())[1] == REMOTE_RM:
            return True
    return False


async def _reward_custom_group(spec: RewardSpec, samples: list[Sample]) -> list[float]:
    assert spec.custom_rm_path is not None
    indices = [s.index for s in samples]
    try:
        function = load_reward_function(spec.custom_rm_path, group=True)
        rewards = await _call_custom(spec, lambda: function(spec.args, samples), f"samples with index {indices}")
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else repr(rewards)
            raise ValueError(f"expected a list of {len(samples)} rewards (one per sample), got {got}")
        return [_as_reward(_keep_category(spec, sample, value), spec.reward_key, spec.custom_rm_path)
                for sample, value in zip(samples, rewards)]
    except Exception as error:
        raise RewardError(
            f"reward failed for samples with index {indices} ({spec.label}): {type(error).__name__}: {error}",
            indices=indices,
            rm_type=spec.label,
        ) from error


async def _reward_in_pool(spec: RewardSpec, pool: RewardPool, samples: list[Sample]) -> list[float]:
    """Rule-based rewards of `samples`: the answer workers' where they provably apply, the others' in the reward
    workers; failures as `reward_group` raises them."""
    known = [_precomputed(spec, s, spec.rm_type) for s in samples]
    rest = [s for s, k in zip(samples, known) if k is None]
    scored = iter(await _score_in_pool(spec, pool, rest) if rest else [])
    return [_taken(sample, k) if k is not None else next(scored) for sample, k in zip(samples, known)]


async def _score_in_pool(spec: RewardSpec, pool: RewardPool, samples: list[Sample]) -> list[float]:
    """Rule-based rewards of `samples` in the worker processes; failures as `reward_group` raises them."""
    # The graders read a sample's metadata only for its rm_type override: that is all that is sent.
    items = [(spec.rm_type, s.response_text, s.label,
              {"rm_type": s.metadata["rm_type"]} if s.metadata and "rm_type" in s.metadata else None)
             for s in samples]
    try:
        results = await bounded(pool.score(items), spec.timeout_s)
    except RewardTimeout as error:
        pool.close()  # a grader stuck in sympy: its worker is killed, the pool starts again when next used
        indices = [s.index for s in samples]
        raise RewardError(f"reward failed for samples {indices} ({spec.label}): RewardTimeout: {error}",
                          indices=indices, rm_type=spec.label) from error
    except Exception as error:  # the pool broke twice, or a label would not pickle
        raise RewardError(f"reward workers failed for samples {[s.index for s in samples]} "
                          f"({spec.label}): {type(error).__name__}: {error}",
                          indices=[s.index for s in samples], rm_type=spec.label) from error
    for sample, (_, _, give_ups) in zip(samples, results):
        name_give_ups(sample, resolve_rm_type(spec.rm_type, sample.metadata), give_ups)
    failures: list[BaseException] = [_sample_failure(spec, sample, str(message))
                                     for sample, (ok, message, _) in zip(samples, results) if not ok]
    if failures:
        _raise_failures(failures)
    return [float(value) for _, value, _ in results]


async def reward_group(spec: RewardSpec, samples: Sequence[Sample]) -> list[float]:
    """One reward per sample, in order. If any fails, or is NaN or infinite: RewardError naming every failed
    sample."""
    samples = list(samples)
    if not samples:
        return []
    rewards = await _rewards(spec, samples)
    nonfinite = [_sample_failure(spec, sample, f"ValueError: the reward is {value}, not a finite number (a NaN "
                                 "would silently skip the whole optimizer step)")
                 for sample, value in zip(samples, rewards) if not math.isfinite(value)]
    if nonfinite:
        _raise_failures(nonfinite)
    return rewards


def _all_worker_scored(spec: RewardSpec, samples: list[Sample]) -> list[float] | None:
    """The answer workers' rewards of `samples` when every one provably applies (their give-ups named), else None."""
    if spec.worker_rewards is None:
        return None
    known = [_precomputed(spec, s, spec.rm_type) for s in samples]
    if any(k is None for k in known):
        return None
    return [_taken(sample, k) for sample, k in zip(samples, known) if k is not None]


async def _rewards(spec: RewardSpec, samples: list[Sample]) -> list[float]:
    if spec.custom_rm_path is not None and spec.group_rm:
        return await _reward_custom_group(spec, samples)
    if spec.custom_rm_path is None and (known := _all_worker_scored(spec, samples)) is not None:
        return known  # the common case with answer workers: no task per sample
    if spec.pool is not None and spec.custom_rm_path is None and not _needs_session(spec, samples):
        return await _reward_in_pool(spec, spec.pool, samples)
    if _needs_session(spec, samples):
        async with reward_session(spec.remote_timeout_s, spec.proxy) as session:
            results = await asyncio.gather(
                *(_guarded(spec, s, session) for s in samples), return_exceptions=True
            )
    else:
        results = await asyncio.gather(*(_guarded(spec, s, None) for s in samples), return_exceptions=True)
    # gather(return_exceptions=True) let every task finish, so nothing is left running on failure.
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        _raise_failures(failures)
    return [r for r in results if not isinstance(r, BaseException)]
