"""Rule rewards scored by the answer workers (where the answer text already is), and when one may be used.

Owns:
- `scoring_request(rm_type, sample)`: what a worker needs to score a sample's answer, `{"rm_type": the type that
  applies to this sample, "label": its label}`, or None when the answer cannot be scored there to the same value:
  the type is not a rule grader (`remote_rm`, none given, unknown), or the label is not a JSON scalar that comes
  back from JSON unchanged (str, int of at most 64 bits, finite float, bool, None).
- `score_answer(request, text)`: run in the worker; `{"reward": x, "give_ups": [...]}`, or `{"error": ...}` when the
  grader raised or the reward is not a finite number (the controller then scores the sample itself, so the
  `RewardError`, its cause and the non-finite check are exactly those of today).
- `WorkerRewards`: the run's rm type and each sample's `WorkerReward` (`keep`/`forget`), and `precomputed(sample,
  rm_type)`: the worker's reward only when it provably is what `scoring.score` would give now: the same rm type
  resolves for the sample (its `metadata["rm_type"]` included), its label is the very object whose value was
  sent, and its `response_text` is the very string the worker's text became on the controller (identity, not
  equality: a later turn, a resumed continuation, a hook or custom function that set another text all make another
  object). The graders read only (rm type, text, label): `score` reads `metadata` only for the rm type override,
  and sets nothing on the sample, so a worker's reward has no side effect to repeat here; the give-up notes of
  bounded sympy travel with it and are logged by the caller as for a reward scored here (`group.name_give_ups`).

Why: with `rollout.answer_parse_workers` the answer's text reaches a worker anyway; scoring it there takes the
rule graders out of the coordinating process (deepscaler's math equivalence: the largest item of the loop's profile
at bench_scale 256; 1.5-2.8 ms of sympy per symbolic answer, pool.py). Measured at bench_scale 256, token scale 1,
2 answer workers (answers `\boxed{0|1}`, 3-15 us to score): the loop thread 1.52 -> 1.40 CPU s, workers no worse.

Does not own: which exchanges ask for it and how the request and the record travel (rollout/worker_rewards.py),
the graders (scoring.py), what a reward failure raises (group.py).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import orjson

from hpc_rl.data.samples import Sample
from hpc_rl.rewards.scoring import REMOTE_RM, UnknownRewardType, check_rm_type, resolve_rm_type, score, \
    split_boxed_prefix
from hpc_rl.rewards.sympy_bound import take_give_ups

_INT64 = 1 << 63
_UNSEEN: Any = object()


@dataclass(frozen=True, slots=True)
class WorkerReward:
    """A worker's reward of one answer and what it was computed from (the controller's own objects)."""

    rm_type: str
    label: Any
    text: str
    reward: float
    give_ups: tuple[str, ...] = ()


def _label_travels(label: Any) -> bool:
    """Whether `label` comes back from JSON as an equal value of the same type (a grader sees the same thing)."""
    kind = type(label)
    if label is None or kind is bool:
        return True
    if kind is int:
        return -_INT64 <= label < _INT64
    if kind is float:
        return math.isfinite(label)
    if kind is str:
        try:
            orjson.dumps(label)  # a lone surrogate cannot be written
        except orjson.JSONEncodeError:
            return False
        return True
    return False


def scoring_request(rm_type: str | None, sample: Sample) -> dict[str, Any] | None:
    """What a worker needs to score `sample`'s answer under the run's `rm_type`, or None (see the module doc)."""
    chosen = _rule_grader(rm_type, sample.metadata)
    if chosen is None or not _label_travels(sample.label):
        return None
    return {"rm_type": chosen, "label": sample.label}


def _rule_grader(rm_type: str | None, metadata: Any) -> str | None:
    """The rm type that applies to a sample of this `metadata` when it is a rule grader a worker can run, else None."""
    try:
        chosen = resolve_rm_type(rm_type, metadata)
        check_rm_type(chosen)
    except UnknownRewardType:
        return None
    return None if split_boxed_prefix(chosen)[1] == REMOTE_RM else chosen


_GRADERS_KEPT = 64
"""`WorkerRewards.request` remembers the verdict of this many rm type names at most (a run has a few)."""


def score_answer(request: dict[str, Any], text: str) -> dict[str, Any]:
    """Run in a worker: the reward of `text` as `score` gives it on the controller, with the give-up notes."""
    take_give_ups()  # not this answer's
    try:
        reward = score(request["rm_type"], text, request["label"], None)
    except Exception as error:  # noqa: BLE001 - the controller scores it again and raises its own error
        take_give_ups()
        return {"error": f"{type(error).__name__}: {error}"}
    give_ups = take_give_ups()
    if not math.isfinite(reward):  # JSON would not carry it; the controller's check names the sample
        return {"error": f"the reward is {reward}"}
    return {"reward": reward, "give_ups": give_ups} if give_ups else {"reward": reward}


class _Kept(weakref.ref):  # type: ignore[type-arg]
    """A sample's `WorkerReward` on a weak reference to the sample (one object per sample beside the record)."""

    __slots__ = ("key", "reward")

    def __new__(cls, sample: Sample, callback: Any, key: int, reward: WorkerReward) -> "_Kept":
        return super().__new__(cls, sample, callback)

    def __init__(self, sample: Sample, callback: Any, key: int, reward: WorkerReward) -> None:
        super().__init__(sample, callback)
        self.key = key
        self.reward = reward


class WorkerRewards:
    """The answer workers' rewards of a run's samples: the rm type they score under (the run's; a sample's
    `metadata["rm_type"]` overrides it) and each scored sample's `WorkerReward`, held here beside the sample,
    never on it, and dropped when the sample is. (Held on the sample, as one more key of its `__dict__`, it cost
    the coordinating process +0.2 CPU s and +35 MB peak RSS at bench_scale 256: 25k more page faults, measured.)
    One per run, shared by the engine client (which asks) and the reward spec (which uses)."""

    def __init__(self, rm_type: str | None) -> None:
        self.rm_type = rm_type
        self._kept: dict[int, _Kept] = {}
        self._drop = self._dropped  # one callback for every sample's weak reference
        self._graders: dict[str, str | None] = {}
        """`_rule_grader` per rm type name (the run's, or a sample's `metadata["rm_type"]`): once per name, not per
        request."""
        self._label: Any = _UNSEEN  # the last label asked about (a group's samples share theirs) and its verdict
        self._label_travels = False

    def _dropped(self, kept: _Kept) -> None:
        if self._kept.get(kept.key) is kept:
            del self._kept[kept.key]

    def __len__(self) -> int:
        return len(self._kept)

    def request(self, sample: Sample) -> dict[str, Any] | None:
        """`scoring_request` under the run's rm type (its verdicts on the rm type and on the label remembered)."""
        metadata = sample.metadata
        named = (metadata.get("rm_type") if metadata else None) or self.rm_type
        if type(named) is not str:
            return scoring_request(self.rm_type, sample)
        chosen = self._graders.get(named, _UNSEEN)
        if chosen is _UNSEEN:
            chosen = _rule_grader(named, None)
            if len(self._graders) < _GRADERS_KEPT:
                self._graders[named] = chosen
        if chosen is None:
            return None
        label = sample.label
        if label is not self._label:  # the same object: the same verdict (a label that travels is immutable)
            self._label, self._label_travels = label, _label_travels(label)
        if not self._label_travels:
            return None
        return {"rm_type": chosen, "label": label}

    def keep(self, sample: Sample, request: dict[str, Any], record: Any, text: str) -> None:
        """Keep a worker's `record` for `sample`, whose answer `text` was just appended: usable while the sample's
        text, label and rm type stay those (`precomputed`); a record without a reward is forgotten."""
        reward = record.get("reward") if isinstance(record, dict) else None
        if type(reward) is not float:
            self.forget(sample)
            return
        key = id(sample)
        self._kept[key] = _Kept(sample, self._drop, key, WorkerReward(
            rm_type=request["rm_type"], label=request["label"], text=text, reward=reward,
            give_ups=tuple(record.get("give_ups") or ())))

    def forget(self, sample: Sample) -> None:
        self._kept.pop(id(sample), None)

    def precomputed(self, sample: Sample, rm_type: str | None) -> WorkerReward | None:
        """The worker's reward of `sample` under the spec's `rm_type`, when it provably is `score`'s value now."""
        entry = self._kept.get(id(sample))
        if entry is None or entry() is not sample:
            return None
        kept = entry.reward
        if kept.text is not sample.response_text or kept.label is not sample.label:
            return None
        try:
            if resolve_rm_type(rm_type, sample.metadata) != kept.rm_type:
                return None
        except UnknownRewardType:
            return None
        return kept
