"""The simulated GPU engine's timing and content model: pure functions of its parameters.

Owns `EngineModel` (the parameters, read from a YAML file such as configs/sim/qwen3_4b_h100_tp2.yaml,
errors naming the file and the field), and the pure rules every simulated engine follows:

- time: `prefill_seconds(tokens)`, `decode_step_seconds(batch)` (continuous batching: one token per
  running request per step, the step slower as the batch grows, up to `max_running_requests`);
- length: `target_response_tokens(sample_key)`, a log-normal (long-tailed) draw per sample, capped at
  `max_response_len` (beyond the cap a sample is truncated, finish "length");
- reward: `sample_reward(sample_index)`, drawn per group so `zero_variance_share` of the groups have
  all-equal rewards (what dynamic sampling filters) and the others have both 0 and 1;
- time scale: one simulated second lasts `time_scale_ms` real milliseconds;
- token scale: one token on the wire stands for `token_scale` simulated tokens (so JSON bodies of
  8k-token responses do not swamp two CPU cores); the timing counts simulated tokens.

Draws are deterministic functions of (seed, sample index): an aborted sample resumed on another
engine (partial rollout) keeps its length and its reward.
"""

from __future__ import annotations

import hashlib
import math
import struct
from statistics import NormalDist
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

_STANDARD_NORMAL = NormalDist()


class SimConfigError(ValueError):
    """A simulated-engine parameter file is wrong; the message names the file and the field."""


@dataclass(kw_only=True)
class EngineModel:
    """Parameters of one simulated engine (SGLang on GPUs). Times are simulated seconds."""

    prefill_s_per_token: float = 1.0e-5
    """Prefill time per input token (a prefill stalls the running batch's decode)."""
    decode_step_base_s: float = 0.007
    """Decode step time with one running request (weights read once per step: memory-bound)."""
    decode_step_per_request_s: float = 2.5e-5
    """Extra decode step time per running request (KV reads, sampling)."""
    max_running_requests: int = 256
    """Batch limit: more requests wait in the queue (SGLang's --max-running-requests)."""
    response_len_median: float = 2500.0
    """Median response length in simulated tokens (log-normal)."""
    response_len_sigma: float = 0.8
    """Log-normal sigma of the response length (long tail)."""
    max_response_len: int = 8192
    """Cap in simulated tokens (the recipe's rollout_max_response_len); longer samples are truncated."""
    token_scale: int = 1
    """Simulated tokens per token on the wire (1: every token is sent)."""
    zero_variance_share: float = 0.4
    """Share of groups whose samples all get the same reward (dropped by dynamic sampling)."""
    correct_probability: float = 0.5
    """Chance a sample of a mixed group is correct (reward 1)."""
    n_samples_per_prompt: int = 8
    """Group size: samples s*n .. s*n+n-1 form one group (hpc_rl numbers samples so)."""
    abort_s: float = 0.002
    """An /abort_request call."""
    pause_s: float = 0.005
    """/pause_generation (and /continue_generation)."""
    init_group_s: float = 0.5
    """/init_weights_update_group (an NCCL group of the trainer and every engine's GPUs)."""
    weight_call_s: float = 0.002
    """Fixed cost of each weight-update call (begin, end, one bucket's bookkeeping)."""
    broadcast_gbytes_per_s: float = 0.0
    """Simulated broadcast bandwidth per bucket; 0: the broadcast is not simulated (orchestration only)."""
    time_scale_ms: float = 20.0
    """Real milliseconds per simulated second."""
    seed: int = 0

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineModel:
        """Read a parameter file (unknown keys and bad values fail naming the file and the field)."""
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise SimConfigError(f"{path}: cannot read: {error}") from None
        if not isinstance(raw, dict):
            raise SimConfigError(f"{path}: expected a mapping of parameters, got {type(raw).__name__}")
        return cls.from_mapping({**raw, **overrides}, where=str(path))

    @classmethod
    def from_mapping(cls, values: dict[str, Any], *, where: str = "<parameters>") -> EngineModel:
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise SimConfigError(f"{where}: unknown field {key!r} (known: {', '.join(sorted(known))})")
            kind = int if known[key].type in ("int", int) else float
            try:
                kwargs[key] = kind(value)
            except (TypeError, ValueError):
                raise SimConfigError(f"{where}: field {key!r} must be a number, got {value!r}") from None
        model = cls(**kwargs)
        model.check(where)
        return model

    def check(self, where: str = "<parameters>") -> None:
        positive = ["decode_step_base_s", "response_len_median", "time_scale_ms"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise SimConfigError(f"{where}: field {name!r} must be > 0, got {getattr(self, name)}")
        for name in ["max_running_requests", "max_response_len", "token_scale", "n_samples_per_prompt"]:
            if getattr(self, name) < 1:
                raise SimConfigError(f"{where}: field {name!r} must be >= 1, got {getattr(self, name)}")
        for name in ["zero_variance_share", "correct_probability"]:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SimConfigError(f"{where}: field {name!r} must be in [0, 1], got {getattr(self, name)}")

    # -- time ------------------------------------------------------------------------------------
    def prefill_seconds(self, wire_tokens: int) -> float:
        return self.prefill_s_per_token * wire_tokens * self.token_scale

    def decode_step_seconds(self, batch: int) -> float:
        """One decode step of `batch` running requests (batch is capped at the batch limit)."""
        batch = max(1, min(batch, self.max_running_requests))
        return self.decode_step_base_s + self.decode_step_per_request_s * batch

    def wire_tokens_per_second(self, batch: int) -> float:
        """Tokens on the wire each running request gains per simulated second."""
        return 1.0 / (self.decode_step_seconds(batch) * self.token_scale)

    def engine_tokens_per_second(self, batch: int) -> float:
        """Simulated tokens the whole engine generates per simulated second at `batch`."""
        batch = max(1, min(batch, self.max_running_requests))
        return batch / self.decode_step_seconds(batch)

    def real_seconds(self, simulated_s: float) -> float:
        return simulated_s * self.time_scale_ms / 1000.0

    def simulated_seconds(self, real_s: float) -> float:
        return real_s * 1000.0 / self.time_scale_ms

    @property
    def max_wire_response_len(self) -> int:
        """The cap in wire tokens (what the controller's rollout_max_response_len must be)."""
        return max(1, self.max_response_len // self.token_scale)

    # -- content ---------------------------------------------------------------------------------
    def _uniform(self, *key: object) -> float:
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        return (struct.unpack("<Q", digest)[0] >> 11) / float(1 << 53)

    def target_response_tokens(self, sample_key: int | str) -> int:
        """The sample's full response length in wire tokens (> cap means it will be truncated)."""
        u = min(max(self._uniform("length", sample_key), 1e-12), 1 - 1e-12)
        z = _STANDARD_NORMAL.inv_cdf(u)
        simulated = self.response_len_median * math.exp(self.response_len_sigma * z)
        return max(1, math.ceil(simulated / self.token_scale))

    def group_has_zero_variance(self, group_index: int) -> bool:
        return self._uniform("zero-variance", group_index) < self.zero_variance_share

    def sample_reward(self, sample_index: int) -> int:
        """0 or 1: all-equal within a zero-variance group; both values within any other group."""
        group, position = divmod(sample_index, self.n_samples_per_prompt)
        if self.group_has_zero_variance(group):
            return int(self._uniform("group-reward", group) < self.correct_probability)
        if self.n_samples_per_prompt > 1 and position < 2:
            return 1 - position  # one right and one wrong: the group has variance whatever the rest draw
        return int(self._uniform("reward", sample_index) < self.correct_probability)

