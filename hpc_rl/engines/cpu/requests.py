"""One generation request inside the CPU engine, and the SGLang response it turns into.

Owns: `GenerationRequest` (a parsed `/generate` request plus the tokens, logprobs and weight-version
spans produced so far), parsing a `/generate` body (single or batched, as SGLang 0.5.23 normalizes it)
and rendering a request as SGLang's response (`text`, `output_ids`, `meta_info`). No model calls, no
HTTP.

SGLang behaviour reproduced here (srt/managers/io_struct.py, tokenizer_manager.py, detokenizer_manager.py):
- batch: `input_ids` a list of lists or `text` a list -> one request per item, answered as a list;
  `rid` a list (same length, no duplicates: 400) or a string (`"<rid>_<i>"`) or absent; each item is
  its own request (abort one rid, the others run on; its answer says `abort`); `sampling_params`,
  `return_logprob`, `logprob_start_len` a single value or one per item. `input_ids` win over `text`.
- `len(prompt) >= context` -> 400 "The input ... is longer than the model's context length";
  `len(prompt) + max_new_tokens > context` -> 400 "Requested token count exceeds the model's maximum
  context length ..."; `len(prompt) >= context - 6` -> 400 "Input length ... exceeds the maximum allowed
  length" (the scheduler's check); then max_new_tokens is capped to `context - 2 - len(prompt)`.
- `text` is decoded in the context of the prompt's last 5 tokens (SGLang's incremental detokenizer
  starts at `read_offset - 5`), so a leading space survives; a matched stop token is trimmed from the
  text (kept in `output_ids`), a matched stop string cut off (both unless `no_stop_trim`).
- `weight_versions` spans; with no output token `[{"version": v, "start": 0, "end": 0}]`.
- `cached_tokens` is always 0: the CPU engine has no prefix (radix) cache, every prompt is prefilled.
- `meta_info` carries SGLang's other fields (`num_retractions` counted, `reasoning_tokens` 0, `dp_rank` and
  `cached_tokens_details` null, `output_token_logprobs_length`, `response_sent_to_client_ts`); the first
  `input_token_logprobs` entry is `null` at any `logprob_start_len`, as SGLang's.
- `sampling_params.n` > 1: each prompt n times in a row, each item a fresh random rid (SGLang ignores the
  body's rid then); a different `n` per item is a 400. Sampling-param errors are SGLang's bodies and texts.
- `return_routed_experts` (one value for a batch) and `routed_experts_start_len`: see routed_experts.py.
- `top_logprobs_num` (one value or one per item) with `return_logprob`: `meta_info.output_top_logprobs`, per
  output token its k most likely `[logprob, token id, null]` (the reported distribution's, as
  `output_token_logprobs`); `input_top_logprobs` is not produced.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hpc_rl.engines.http_api import RequestError, per_item, request_ids
from hpc_rl.engines.cpu.routed_experts import encode_routed_experts
from hpc_rl.engines.cpu.sampling import (SamplingParams, UnknownSamplingKey, UnsupportedSamplingValue, make_generator,
                                         parse_sampling_params)

DETOKENIZE_CONTEXT_TOKENS = 5
"""SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded before the output."""
ABORT_MESSAGE = "Aborted"


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
    on_progress: Callable[[GenerationRequest], None] | None = None
    """Called on the scheduler thread after each token of an unfinished request (streaming)."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    weight_versions: list[dict] = field(default_factory=list)
    finish_reason: dict | None = None
    num_retractions: int = 0
    """Times a pause (retract) sent it back to the queue (SGLang's meta_info field)."""
    top_logprobs_num: int = 0
    """SGLang's top_logprobs_num: with return_logprob, each output token's k most likely tokens."""
    output_top_logprobs: list[list[list]] | None = None
    """Per output token, `[logprob, token id, None]` of its top_logprobs_num candidates (None unless asked)."""
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora_path: str | None = None
    """The LoRA adapter this request samples from, by its loaded name (None: the base model)."""
    vision: Any = None
    """The prompt's processed images (`vision.VisionInputs`) when the request had `image_data`, else None; kept
    through aborts, retractions and re-prefills."""
    routed_experts: list[torch.Tensor] | None = None
    """[tokens, num_layers, topk] int32 chunks, one row per token run through the model so far
    (`routed_experts.RoutedExpertsCapture`; None unless the engine captures and the request asked)."""

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


@dataclass(kw_only=True)
class ParsedGenerate:
    """A `/generate` body as requests: one (`batched` False) or a list answered by a list."""

    requests: list[GenerationRequest]
    batched: bool
    stream: bool


def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    if body.get("input_ids") is not None:  # ids win over text, as in SGLang
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids cannot be empty.", semantic=True)
        batched = isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        try:
            return [[int(token) for token in prompt] for prompt in prompts], batched
        except (TypeError, ValueError):
            raise RequestError("input_ids must be a list of integers or a list of lists of integers") from None
    text = body.get("text")
    if text is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.", semantic=True)
    batched = isinstance(text, list)
    texts = text if batched else [text]
    return [list(tokenizer.encode(str(item), add_special_tokens=False)) for item in texts], batched


def max_request_len(context_length: int) -> int:
    """SGLang's `max_req_len` (tp_worker): context - 1 (its KV pool bound does not apply here)."""
    return context_length - 1


def check_context(input_ids: list[int], max_new_tokens: int | None, context_length: int) -> None:
    """SGLang's length validation without auto-truncation: the tokenizer manager's
    (`_validate_one_request`), then the scheduler's (`validate_input_length`, prompt < max_req_len - 5)."""
    if len(input_ids) >= context_length:
        raise RequestError(
            f"The input ({len(input_ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens).", semantic=True)
    if max_new_tokens is not None and max_new_tokens + len(input_ids) > context_length:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {max_new_tokens + len(input_ids)} tokens: {len(input_ids)} tokens from "
            f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit.", semantic=True)
    max_input = max_request_len(context_length) - 5
    if len(input_ids) >= max_input:
        raise RequestError(
            f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length ({max_input} tokens). "
            "Use a shorter input or enable --allow-auto-truncate.", semantic=True)


def capped_max_new_tokens(input_len: int, max_new_tokens: int, context_length: int) -> int:
    """SGLang's scheduler silently caps max_new_tokens to `max_req_len - input - 1` (init_req_max_new_tokens)."""
    return max(0, min(max_new_tokens, max_request_len(context_length) - input_len - 1))


def _parsed_sampling_params(raw: Any) -> SamplingParams:
    """One item's sampling params; SGLang's 400 bodies: its schema error for an unknown key, its ValueError
    (`{"error": {"message"}}`) for a bad value."""
    if not isinstance(raw, dict):
        raise RequestError("sampling_params must be an object (or a list of objects for a batch)")
    try:
        return parse_sampling_params(raw)
    except (UnknownSamplingKey, UnsupportedSamplingValue) as error:
        raise RequestError(str(error)) from None
    except ValueError as error:
        raise RequestError(str(error), semantic=True) from None


def parallel_samples(raw_params: list[Any]) -> int:
    """SGLang's parallel_sample_num: sampling_params `n`, the same for every item of a batch."""
    counts = {int(raw.get("n") or 1) if isinstance(raw, dict) else 1 for raw in raw_params}
    if len(counts) > 1:
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.",
                           semantic=True)
    return max(1, counts.pop())


def _image_items(body: dict, count: int, batched: bool, images: Any) -> list[list[Any] | None]:
    """Each prompt's `image_data` items (SGLang: one item or a list for one request; one entry per request for a
    batch), None where a prompt has none."""
    from hpc_rl.engines.cpu.vision import request_items

    raw = body.get("image_data")
    if raw is None or raw == []:
        return [None] * count
    if images is None:
        raise RequestError("image_data was given, but the served model has no vision tower")
    if not batched:
        return [request_items(raw)]
    if not isinstance(raw, list) or len(raw) != count:
        raise RequestError("The length of image_data should be equal to the batch size.")
    return [request_items(item) for item in raw]


def parse_generate_body(body: Any, *, tokenizer, context_length: int, images: Any = None) -> ParsedGenerate:
    """Validate a `/generate` body (single or batched) as SGLang does; RequestError on misuse. `images`: the
    engine's `vision.EngineImages` when the model sees images (then `image_data` is read), else None."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    prompts, batched = _prompts(body, tokenizer)
    count = len(prompts)
    image_items = _image_items(body, count, batched, images)
    rids = request_ids(body.get("rid"), count, batched)
    raw_params = per_item(body, "sampling_params", count, {})
    return_logprob = per_item(body, "return_logprob", count, False)
    start_lens = per_item(body, "logprob_start_len", count, -1)
    lora_paths = per_item(body, "lora_path", count, None)
    top_nums = per_item(body, "top_logprobs_num", count, 0)
    for top in top_nums:
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise RequestError(f"top_logprobs_num must be a non-negative integer, got {top!r}")
    samples = parallel_samples(raw_params)
    if samples > 1:  # SGLang: each prompt n times in a row, every item a fresh rid (the body's rid is not used)
        prompts, raw_params, return_logprob, start_lens, lora_paths, top_nums, image_items = (
            [item for item in items for _ in range(samples)]
            for items in (prompts, raw_params, return_logprob, start_lens, lora_paths, top_nums, image_items))
        rids, batched = [uuid.uuid4().hex for _ in prompts], True
    return_routed_experts = bool(body.get("return_routed_experts", False))  # one value for a batch, as SGLang
    routed_start = body.get("routed_experts_start_len", 0)
    if isinstance(routed_start, bool) or not isinstance(routed_start, int):
        raise RequestError("routed_experts_start_len must be an integer")
    requests = []
    parsed: dict[int, SamplingParams] = {}  # a batch usually shares one sampling_params object: parse it once
    for index, prompt in enumerate(prompts):
        raw = raw_params[index]
        if id(raw) not in parsed:
            parsed[id(raw)] = _parsed_sampling_params(raw)
        vision = None
        if image_items[index] is not None:
            prompt, vision = images.prepare(prompt, image_items[index])
        check_context(prompt, raw.get("max_new_tokens"), context_length)
        if return_routed_experts:
            check_routed_experts_start(routed_start, len(prompt))
        params = copy.copy(parsed[id(raw)])  # (dataclasses.replace re-runs __init__: 4x slower per request)
        params.max_new_tokens = capped_max_new_tokens(len(prompt), params.max_new_tokens, context_length)
        requests.append(GenerationRequest(
            rid=rids[index], input_ids=prompt, params=params, return_logprob=bool(return_logprob[index]),
            logprob_start_len=int(start_lens[index]), generator=make_generator(params),
            top_logprobs_num=int(top_nums[index] or 0),
            output_top_logprobs=[] if return_logprob[index] and top_nums[index] else None,
            return_routed_experts=return_routed_experts, routed_experts_start_len=routed_start,
            lora_path=lora_paths[index], vision=vision))
    return ParsedGenerate(requests=requests, batched=batched, stream=bool(body.get("stream", False)))


def check_routed_experts_start(start: int, prompt_tokens: int) -> None:
    """SGLang's check (scheduler `handle_generate_request`): 0 <= routed_experts_start_len <= prompt tokens."""
    if start < 0:
        raise RequestError(f"routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                           "routed_experts_start_len.")
    if start > prompt_tokens:
        raise RequestError(f"routed_experts_start_len={start} is higher than the number of input tokens "
                           f"({prompt_tokens}). Please use a smaller routed_experts_start_len.")


def decode_in_context(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool) -> str:
    """The output's text as SGLang's detokenizer gives it: decoded after the prompt's last tokens and
    with their text removed, so word-initial spaces ("▁answer" -> " answer") are kept."""
    context = prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:]
    if not context:
        return tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(context + output_ids, skip_special_tokens=skip_special_tokens)
    return full[len(prefix):] if full.startswith(prefix) else full


def _decoded_output(request: GenerationRequest) -> list[int]:
    """The output ids that make the text: without a matched stop token (unless no_stop_trim)."""
    matched = (request.finish_reason or {}).get("matched")
    if isinstance(matched, int) and request.output_ids and not request.params.no_stop_trim:
        return request.output_ids[:-1]
    return request.output_ids


def response_texts(requests: list[GenerationRequest], tokenizer) -> list[str]:
    """`text` of each response (as `response_text`), decoded in two batch calls when the requests agree
    on skip_special_tokens (every request of an RL rollout does)."""
    skips = {request.params.skip_special_tokens for request in requests}
    if len(requests) < 2 or len(skips) != 1:
        return [response_text(request, tokenizer) for request in requests]
    contexts = [request.input_ids[-DETOKENIZE_CONTEXT_TOKENS:] for request in requests]
    decoded = tokenizer.batch_decode(contexts + [c + _decoded_output(r) for c, r in zip(contexts, requests)],
                                     skip_special_tokens=skips.pop())
    prefixes, fulls = decoded[:len(requests)], decoded[len(requests):]
    return [_trim_stop_string(request, full[len(prefix):] if full.startswith(prefix) else full)
            for request, prefix, full in zip(requests, prefixes, fulls)]


def response_text(request: GenerationRequest, tokenizer) -> str:
    """`text` of the response: in context, with the matched stop token or stop string trimmed."""
    params = request.params
    text = decode_in_context(tokenizer, request.input_ids, _decoded_output(request), params.skip_special_tokens)
    return _trim_stop_string(request, text)


def _trim_stop_string(request: GenerationRequest, text: str) -> str:
    matched = (request.finish_reason or {}).get("matched")
    params = request.params
    if isinstance(matched, str):
        at = text.find(matched)
        if at >= 0:
            text = text[: at + len(matched)] if params.no_stop_trim else text[:at]
    return text


def render_response(request: GenerationRequest, *, tokenizer, weight_version: str, text: str | None = None) -> dict:
    """SGLang's single-request `/generate` response (also each streamed chunk, finish_reason None);
    `text` when it was already decoded (`response_texts`)."""
    spans = [dict(span) for span in request.weight_versions] or [
        {"version": weight_version, "start": 0, "end": 0}]
    meta: dict = {
        "id": request.rid,
        "finish_reason": request.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "weight_version": spans[-1]["version"],
        "num_retractions": request.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": len(request.output_ids),
        "cached_tokens": 0,
        "weight_versions": spans,
        "cached_tokens_details": None,  # SGLang's, with no cached token
        "dp_rank": None,
        "e2e_latency": time.perf_counter() - request.created,
        "response_sent_to_client_ts": time.time(),
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [
            [logprob, token, None] for logprob, token in zip(request.output_logprobs, request.output_ids)
        ]
        meta["output_token_logprobs_length"] = len(request.output_ids)
        if request.output_top_logprobs is not None:
            meta["output_top_logprobs"] = request.output_top_logprobs
        start = max(request.logprob_start_len, 0)
        if request.logprob_start_len >= 0 and request.input_logprobs is not None:
            # SGLang's first entry has no logprob at any logprob_start_len (not only at the prompt's first token)
            meta["input_token_logprobs"] = [
                [None if i == start else request.input_logprobs[i], request.input_ids[i], None]
                for i in range(start, len(request.input_ids))
            ]
        else:
            meta["input_token_logprobs"] = []
    if request.return_routed_experts and request.routed_experts is not None:
        seqlen = len(request.input_ids) + len(request.output_ids)
        rows = torch.cat(request.routed_experts)[request.routed_experts_start_len: seqlen - 1]
        meta["routed_experts"] = encode_routed_experts(rows)
    if text is None:
        text = response_text(request, tokenizer)
    return {"text": text, "output_ids": list(request.output_ids), "meta_info": meta}


def abort_reason(message: str = ABORT_MESSAGE) -> dict:
    """SGLang's FINISH_ABORT.to_json()."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
