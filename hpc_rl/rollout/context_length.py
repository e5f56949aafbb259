"""The engines' context length and what the client does at it: the length as the engines derive it (SGLang's
option, else the checkpoint's config.json), `max_new_tokens` clipped so a request fits, and the answer given
without a request to a prompt the engines would refuse for its length (SGLang 0.5.23's rule).

Used by engine_client.py (which re-exports these names), the rollout scheduler and the run's builder.
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
