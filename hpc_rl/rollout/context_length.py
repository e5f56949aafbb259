"""The engines' context length and what follows from it: the length as the engines derive it (SGLang's
option, else the checkpoint's config.json), `max_new_tokens` clipped so a request fits, the answer given
without a request to a prompt the engines would refuse for its length (SGLang 0.5.23's rule), and the longest
prompt a rollout or an eval uses (`prompt_length_limit`, `length_limit`).

Used by engine_client.py and the rollout scheduler (which re-export these names), eval.py and the run's builder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def engine_context_length(hf_checkpoint: str | Path, sglang_options: Mapping[str, Any] | None = None) -> int | None:
    """The engines' context length, as they derive it: SGLang's `context_length` option if set, else the
    checkpoint's `max_position_embeddings` (config.json; None if neither is known)."""
    options = sglang_options or {}
    explicit = options.get("context_length", options.get("sglang_context_length"))
    if explicit:
        return int(explicit)
    try:
        config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def clip_to_context(payload: dict[str, Any], context_length: int | None) -> dict[str, Any]:
    """`payload` with `max_new_tokens` lowered so prompt + new tokens fit the context (slime's clip with
    `rollout_max_context_len`): SGLang answers 400 "Requested token count exceeds the model's maximum
    context length" instead of generating less. Unchanged without a known context or `input_ids`."""
    input_ids = payload.get("input_ids")
    params = payload.get("sampling_params")
    if not context_length or not isinstance(input_ids, list) or not isinstance(params, dict):
        return payload
    budget = max(0, context_length - len(input_ids))
    if int(params.get("max_new_tokens", 128)) <= budget:
        return payload
    return {**payload, "sampling_params": {**params, "max_new_tokens": budget}}


def longest_served_prompt(context_length: int) -> int:
    """SGLang 0.5.23's scheduler refuses (400) prompts of `max_req_len - 5 = context - 6` tokens or more."""
    return context_length - 7


def context_full_answer(payload: dict[str, Any], context_length: int | None) -> dict[str, Any] | None:
    """The answer for a prompt the engines would refuse for its length (a resumed sample that filled the
    context): no new token, finish_reason length, as slime truncates such a sample without a request.
    None when the request can be served."""
    input_ids = payload.get("input_ids")
    if not context_length or not isinstance(input_ids, list) or len(input_ids) <= longest_served_prompt(context_length):
        return None
    return {"text": "", "output_ids": [], "meta_info": {
        "id": payload.get("rid"), "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(input_ids), "completion_tokens": 0, "cached_tokens": 0}}


def prompt_length_limit(rollout: Any, engine_context_len: int | None) -> tuple[int | None, str]:
    """The longest prompt a rollout uses, and why: `rollout_max_prompt_len`; else, as slime derives it,
    `rollout_max_context_len - 1`; else the longest prompt the engines serve with room for a response
    (SGLang refuses a prompt of context - 6 tokens or more); None when nothing bounds it."""
    return length_limit([("rollout_max_prompt_len", rollout.rollout_max_prompt_len)],
                        [("rollout_max_context_len", rollout.rollout_max_context_len)], engine_context_len)


def length_limit(prompt_lens: list[tuple[str, int | None]], context_lens: list[tuple[str, int | None]],
                 engine_context_len: int | None) -> tuple[int | None, str]:
    """The first prompt length set (field, tokens), else the first context length set minus one, else what the
    engines' context leaves; and why. The rule of `prompt_length_limit`, for rollouts and eval alike."""
    for name, value in prompt_lens:
        if value is not None:
            return value, name
    for name, value in context_lens:
        if value is not None:
            return value - 1, f"{name} - 1: room for one response token"
    if engine_context_len:
        return (longest_served_prompt(engine_context_len),
                f"the engines' context length {engine_context_len} leaves no room for a response beyond it")
    return None, ""
