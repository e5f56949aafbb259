"""One generation request inside the CPU engine, and the SGLang response it turns into.

Owns: `GenerationRequest` (parsed `/generate` body plus the tokens, logprobs and weight-version
spans produced so far) and rendering it as SGLang's response (`text`, `output_ids`, `meta_info`).
No model calls, no HTTP.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from dataclasses import dataclass, field

import torch

from hpc_rl.engines.cpu.sampling import SamplingParams, make_generator, parse_sampling_params


class RequestError(ValueError):
    """A request SGLang would reject with 400; `semantic` selects `{"error": {"message": ...}}`."""

    def __init__(self, message: str, *, semantic: bool = False) -> None:
        super().__init__(message)
        self.semantic = semantic


@dataclass(kw_only=True)
class GenerationRequest:
    """A `/generate` request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    created: float = field(default_factory=time.perf_counter)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    weight_versions: list[dict] = field(default_factory=list)
    finish_reason: dict | None = None
    text_end: int | None = None  # where a matched stop string starts in the decoded text

    def append(self, token: int, logprob: float, weight_version: str) -> None:
        """Record one generated token and the weight version that produced it."""
        position = len(self.output_ids)
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if self.weight_versions and self.weight_versions[-1]["version"] == weight_version:
            self.weight_versions[-1]["end"] = position + 1
        else:
            self.weight_versions.append({"version": weight_version, "start": position, "end": position + 1})

    @property
    def context(self) -> list[int]:
        return self.input_ids + self.output_ids


def parse_generate_body(body: dict, *, tokenizer, context_length: int) -> GenerationRequest:
    """Validate a `/generate` body (single request) as SGLang does; RequestError on misuse."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("exactly one of `text` or `input_ids` must be given")
    for key in ("text", "input_ids", "rid", "sampling_params"):
        value = body.get(key)
        if key == "input_ids" and isinstance(value, list) and value and isinstance(value[0], list):
            raise RequestError("batched input_ids are not supported by the CPU engine: one request per sample")
        if key != "input_ids" and isinstance(value, list):
            raise RequestError(f"a list for `{key}` (batch request) is not supported: one request per sample")
    if "text" in body:
        input_ids = list(tokenizer.encode(body["text"], add_special_tokens=False))
    else:
        input_ids = [int(token) for token in body["input_ids"]]
    if not input_ids:
        raise RequestError("the prompt is empty", semantic=True)
    try:
        params = parse_sampling_params(body.get("sampling_params"))
    except ValueError as error:
        raise RequestError(str(error)) from None
    if len(input_ids) >= context_length:
        raise RequestError(
            f"The input ({len(input_ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens).",
            semantic=True,
        )
    return GenerationRequest(
        rid=str(body.get("rid") or uuid.uuid4().hex),
        input_ids=input_ids,
        params=params,
        return_logprob=bool(body.get("return_logprob", False)),
        logprob_start_len=int(body.get("logprob_start_len", -1) if body.get("logprob_start_len") is not None
                              else -1),
        generator=make_generator(params),
    )


def render_response(request: GenerationRequest, *, tokenizer, weight_version: str) -> dict:
    """SGLang's single-request `/generate` response for a finished request."""
    text = tokenizer.decode(request.output_ids, skip_special_tokens=request.params.skip_special_tokens)
    if request.text_end is not None and not request.params.no_stop_trim:
        text = text[: request.text_end]
    meta: dict = {
        "id": request.rid,
        "finish_reason": request.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(request.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "weight_versions": [dict(span) for span in request.weight_versions],
        "e2e_latency": time.perf_counter() - request.created,
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [
            [logprob, token, None] for logprob, token in zip(request.output_logprobs, request.output_ids)
        ]
        start = max(request.logprob_start_len, 0)
        if request.logprob_start_len >= 0 and request.input_logprobs is not None:
            meta["input_token_logprobs"] = [
                [request.input_logprobs[i], request.input_ids[i], None]
                for i in range(start, len(request.input_ids))
            ]
        else:
            meta["input_token_logprobs"] = []
    return {"text": text, "output_ids": list(request.output_ids), "meta_info": meta}
