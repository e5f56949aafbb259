"""Sampling for the CPU engine: request sampling params, next-token choice, logprobs, stop rules.

Owns: parsing SGLang's `sampling_params` (unknown keys are a 400, as in SGLang), choosing the next
token for a batch of rows, and the logprob each row reports. No model, no HTTP, no threads.

Logprobs follow SGLang 0.5.23's default: the log-softmax of the logits divided by the temperature
(before top-k/top-p/min-p filtering). With `SGLANG_RETURN_ORIGINAL_LOGPROB=1` in the engine's
environment they are the log-softmax of the raw logits instead, as in SGLang. Greedy
(`temperature` < 1e-5) is SGLang's "temperature 1, top_k 1", so its logprobs are always raw.
At temperature 1 (the RL default) both equal a plain forward pass of the model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

_SAMPLING_EPS = 1e-5

# Keys SGLang accepts in sampling_params; those we do not implement must keep their neutral value.
_NEUTRAL_KEYS: dict[str, object] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stop_regex": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
_IGNORED_KEYS = {"spaces_between_special_tokens", "stream_interval", "skip_special_tokens", "no_stop_trim"}
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
"""SGLang 0.5.23's sampling_params fields, in the order its schema error lists them."""


class UnknownSamplingKey(ValueError):
    """A sampling_params key SGLang does not know: its schema error (`{"error": "..."}`), not a value error."""


class UnsupportedSamplingValue(ValueError):
    """A value SGLang serves and the CPU engine does not (a constraint, a penalty, a watermark)."""


def return_original_logprob() -> bool:
    """SGLang's switch: logprobs of the raw model distribution instead of the tempered one."""
    return os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in {"1", "true", "yes"}


@dataclass(kw_only=True)
class SamplingParams:
    """The sampling params of one request, validated."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    """Parallel samples of the prompt (SGLang's `n`: the request becomes n items, each its own request)."""

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS or self.top_k == 1


def parse_sampling_params(raw: dict | None) -> SamplingParams:
    """Validate a request's `sampling_params` as SGLang 0.5.23 does, with its messages: an unknown key is
    UnknownSamplingKey, a value SGLang refuses a ValueError (-> HTTP 400 either way)."""
    raw = dict(raw or {})
    params = SamplingParams()
    for key, value in raw.items():
        if key not in SGLANG_SAMPLING_KEYS:
            expected = ", ".join(f"`{name}`" for name in SGLANG_SAMPLING_KEYS)
            raise UnknownSamplingKey(f"unknown field `{key}`, expected one of {expected}")
        if value is None and key not in ("stop", "stop_token_ids"):
            continue
        if key in _NEUTRAL_KEYS:
            if value != _NEUTRAL_KEYS[key]:
                raise UnsupportedSamplingValue(f"sampling_params.{key}={value!r} is not supported by the CPU engine")
        elif key == "n":
            params.n = max(1, int(value))  # SGLang expands only n > 1
        elif key in ("max_new_tokens", "min_new_tokens", "top_k"):
            setattr(params, key, int(value))
        elif key in ("temperature", "top_p", "min_p"):
            setattr(params, key, float(value))
        elif key == "stop":
            params.stop = [value] if isinstance(value, str) else list(value or [])
        elif key == "stop_token_ids":
            params.stop_token_ids = [int(token) for token in value or []]
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            setattr(params, key, bool(value))
        elif key == "sampling_seed":
            params.sampling_seed = int(value)
    _check_values(params, raw)
    return params


def _check_values(params: SamplingParams, raw: dict) -> None:
    """SGLang's SamplingParams.verify, in its order and words (`got` shows the value as sent)."""
    def got(key: str) -> object:
        return raw.get(key, getattr(params, key))

    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be a non-negative finite number, got {got('temperature')}.")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {got('top_p')}.")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {got('min_p')}.")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {got('top_k')}.")
    if params.min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {got('min_new_tokens')}.")
    if params.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {got('max_new_tokens')}.")
    if params.min_new_tokens > params.max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({got('max_new_tokens')})], got "
                         f"{got('min_new_tokens')}.")


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned_token_ids: list[list[int]],
    top_logprobs_num: list[int] | None = None,
    top_logprobs: list[list[list]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob for each row of `logits` [B, V] (float32).

    `top_logprobs_num` (one k per row, 0 = none; SGLang's request field): each row's k most likely tokens as
    `[logprob, token id, None]`, most likely first, from the same distribution as the reported logprob, are
    appended to `top_logprobs` (one list per row).

    `banned_token_ids[i]` are masked out before anything else (min_new_tokens holding back stops),
    as SGLang's penalizer does, so they also shape the reported logprobs.
    """
    logits = logits.float()
    if any(banned_token_ids):
        logits = logits.clone()
        for row, banned in enumerate(banned_token_ids):
            if banned:
                logits[row, banned] = float("-inf")
    greedy = [p.greedy for p in params]
    temperatures = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    if all(t == 1.0 for t in temperatures):
        tempered = torch.log_softmax(logits, dim=-1)
    else:
        tempered = torch.log_softmax(logits / torch.tensor(temperatures, dtype=logits.dtype).unsqueeze(1), dim=-1)
    raw = tempered if all(t == 1.0 for t in temperatures) else torch.log_softmax(logits, -1)
    reported = raw if return_original_logprob() else tempered

    sampled = [row for row, g in enumerate(greedy) if not g]
    if len(sampled) == len(params):  # every row samples (the RL default): no argmax, no row selection
        tokens = _sample_rows(tempered, params, generators)
    else:
        tokens = logits.argmax(dim=-1)
        if sampled:
            tokens[sampled] = _sample_rows(tempered[sampled], [params[r] for r in sampled],
                                           [generators[r] for r in sampled])
    logprobs = reported.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if top_logprobs_num is not None and top_logprobs is not None:
        widest = max(top_logprobs_num, default=0)
        if widest > 0:
            values, ids = reported.topk(min(widest, reported.shape[-1]), dim=-1)
            for row, k in enumerate(top_logprobs_num):
                top_logprobs.append([[v, i, None] for v, i in zip(values[row, :k].tolist(), ids[row, :k].tolist())])
        else:
            top_logprobs.extend([] for _ in top_logprobs_num)
    return tokens, logprobs


def _sample_rows(logprobs: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    """Top-k/top-p/min-p filtered sampling for the rows of `logprobs` (vectorized over rows).

    Without any filter (the RL default) rows sample from the full distribution directly: no sort over
    the vocabulary (151k columns for Qwen), one multinomial call for all rows without a seed."""
    filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params)
    if filtered:
        probs, sorted_ids = logprobs.exp().sort(dim=-1, descending=True)
        vocab = probs.shape[1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        rank = torch.arange(vocab).unsqueeze(0)
        keep = (rank < top_k) & ((probs.cumsum(1) - probs) <= top_p)
        keep &= probs >= probs[:, :1] * min_p
        keep[:, 0] = True
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    else:
        probs, sorted_ids = logprobs.exp(), None
    seeded = [row for row, generator in enumerate(generators) if generator is not None]
    if not seeded:
        choice = torch.multinomial(probs, 1).squeeze(1)
    else:
        choice = torch.empty(len(params), dtype=torch.long)
        shared = [row for row, generator in enumerate(generators) if generator is None]
        if shared:
            choice[shared] = torch.multinomial(probs[shared], 1).squeeze(1)
        for row in seeded:
            choice[row] = torch.multinomial(probs[row], 1, generator=generators[row])[0]
    return choice if sorted_ids is None else sorted_ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request RNG when `sampling_seed` is set (reproducible samples), else None (global RNG)."""
    if params.sampling_seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(params.sampling_seed)
    return generator


def find_stop_string(text: str, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string found in `text` and where it starts, or None."""
    best: tuple[str, int] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[1]):
            best = (stop, at)
    return best
