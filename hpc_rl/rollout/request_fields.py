"""What a generation request asks and what its answer says, as plain functions: the SGLang sampling params of a
rollout or an eval (from the config), and the per-token columns read from an engine's answer (log-probs from
SGLang's `[logprob, token id, text]` entries, the weight version of each token from `meta_info`).

Used by generate.py (which re-exports these names) and eval.py; no I/O, no session state.
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Any

from hpc_rl.data.uniform_column import UniformColumn

SamplingParams = dict[str, Any]


def rollout_sampling_params(rollout: Any) -> SamplingParams:
    """SGLang sampling params from a `RolloutConfig` (only fields the router forwards; None left out)."""
    params: SamplingParams = {
        "max_new_tokens": rollout.rollout_max_response_len,
        "temperature": rollout.rollout_temperature,
        "top_p": rollout.rollout_top_p,
        "top_k": rollout.rollout_top_k,
    }
    if rollout.rollout_stop:
        params["stop"] = list(rollout.rollout_stop)
    if rollout.rollout_stop_token_ids:
        params["stop_token_ids"] = list(rollout.rollout_stop_token_ids)
    return params


def eval_sampling_params(rollout: Any, evaluation: Any) -> SamplingParams:
    """Rollout params with the `EvalConfig` overrides (eval_max_response_len, eval_temperature, ...,
    eval_min_new_tokens)."""
    params = rollout_sampling_params(rollout)
    overrides = {"max_new_tokens": evaluation.eval_max_response_len, "temperature": evaluation.eval_temperature,
                 "top_p": evaluation.eval_top_p, "top_k": evaluation.eval_top_k,
                 "min_new_tokens": evaluation.eval_min_new_tokens}
    params.update({k: v for k, v in overrides.items() if v is not None})
    return params


def version_to_int(value: Any, fallback: int) -> int:
    """SGLang reports versions as strings ("default" before any update, then what the trainer sent)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


def output_logprobs(entries: list[Any] | array) -> list[float] | array:
    """The logprob of each output token from SGLang's `[logprob, token id, text]` entries (None or a
    malformed entry: 0.0). The common case is walked in C: this is per token, for every sample. Entries
    already reduced to an array of log-probs (answer_pool.compact_answers) are returned as they are."""
    if isinstance(entries, array):
        return entries
    try:
        logprobs = list(map(itemgetter(0), entries))
    except (IndexError, TypeError, KeyError):
        return [float(x[0]) if x and x[0] is not None else 0.0 for x in entries]
    if None in logprobs:  # an int (a JSON 0) is left as is: every reader takes numbers
        return [float(x) if x is not None else 0.0 for x in logprobs]
    return logprobs


def parse_weight_versions(meta_info: dict[str, Any], n_tokens: int, fallback: int) -> list[int]:
    """Per output token, the weight version that produced it (`weight_version_column` as a list)."""
    return weight_version_column(meta_info, n_tokens, fallback).tolist()


def weight_version_column(meta_info: dict[str, Any], n_tokens: int, fallback: int) -> array | UniformColumn:
    """Per output token, the weight version that produced it: a `UniformColumn` when it is one version throughout
    (the common case: no per-token array is made; data/uniform_column.py), else an `array('q')`.

    `meta_info.weight_versions` = spans `[{"version", "start", "end"}]` over this request's output tokens
    (end exclusive); else the single `meta_info.weight_version`; tokens no span covers, and versions
    that are not integers ("default"), get `fallback` (the version the controller believes is loaded).
    """
    single = version_to_int(meta_info.get("weight_version"), fallback)
    given = meta_info.get("weight_versions")
    if not given:  # SGLang's answers: one version, no spans
        return UniformColumn(single, n_tokens)
    spans = []
    uniform = True
    for span in given:
        try:
            start, end = int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            continue
        if start < 0:
            start = 0
        if end > n_tokens:
            end = n_tokens
        if start < end:
            version = version_to_int(span.get("version"), fallback)
            spans.append((start, end, version))
            uniform = uniform and version == single
    if uniform:
        return UniformColumn(single, n_tokens)
    versions = array("q", (single,)) * n_tokens
    for start, end, version in spans:  # a slice, not a loop per token (~40 us per 1,000 tokens)
        versions[start:end] = array("q", (version,)) * (end - start)
    if versions.count(versions[0]) == n_tokens:  # spans of one other version covering every token
        return UniformColumn(versions[0], n_tokens)
    return versions
