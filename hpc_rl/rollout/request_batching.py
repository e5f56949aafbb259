"""Many samples' `/generate` requests as one batched request, and its answer split back per sample.

Owns the pure part of request batching (no I/O): which single requests may share a batched body
(`batchable`), the batched body (`merge_payloads`: SGLang's batched `input_ids`, one `rid` per item,
one shared `sampling_params` / `return_logprob` / `top_logprobs_num` or one per item, one
`return_routed_experts` for the whole batch as SGLang takes it), how the samples queued at one moment are cut
into requests (`plan_batches`: one per engine, whole GRPO groups, at most the engine's concurrency each), and
the answer list mapped back to the samples (`split_answer`).

Why: per-request overhead (HTTP, JSON, the router, the engine's handler) dominated generation at RL
shapes: 128 samples x 4 tokens took 253 ms as 128 requests through the router and 37 ms as one batched
request to the engine (benchmarks/bench_cpu_engine.py). SGLang treats each item of a batch as its own
request (its own rid: abort one, the others run on; its own finish reason and weight versions), so
per-sample semantics survive batching.

Does not own: when a batch is sent, slots and engines (engine_client.py), what a sample does with its
answer or a failure (generate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

BATCHABLE_KEYS = frozenset({"rid", "input_ids", "sampling_params", "return_logprob", "return_routed_experts",
                            "lora_path", "top_logprobs_num"})
"""A single request with only these keys (the rollout's own) can join a batch; anything else (text,
stream, images, a custom function's extras) is sent alone, as it came."""


class BatchAnswerError(ValueError):
    """A 200 answer to a batched request that is not one answer per item (the engine does not batch)."""


def batchable(payload: dict[str, Any]) -> bool:
    """A single `/generate` body of token ids and a string rid, nothing else."""
    ids = payload.get("input_ids")
    return (payload.keys() <= BATCHABLE_KEYS and isinstance(payload.get("rid"), str) and isinstance(ids, list)
            and bool(ids) and not isinstance(ids[0], list))


def _shared_or_each(values: list[Any]) -> Any:
    """One value when every item has the same, else the list (SGLang accepts both)."""
    first = values[0]
    return first if all(value == first for value in values[1:]) else values


def merge_payloads(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The batched body of `batchable` payloads, items in order."""
    body: dict[str, Any] = {"rid": [p["rid"] for p in payloads], "input_ids": [p["input_ids"] for p in payloads],
                            "sampling_params": _shared_or_each([p.get("sampling_params") or {} for p in payloads])}
    present: set[str] = set()
    for p in payloads:
        present.update(p)
    if "return_logprob" in present:
        body["return_logprob"] = _shared_or_each([bool(p.get("return_logprob", False)) for p in payloads])
    if "lora_path" in present:  # the LoRA adapter each item samples from (issue 33)
        body["lora_path"] = _shared_or_each([p.get("lora_path") for p in payloads])
    if "top_logprobs_num" in present:  # score centering: one k, or one per item
        body["top_logprobs_num"] = _shared_or_each([int(p.get("top_logprobs_num") or 0) for p in payloads])
    if "return_routed_experts" in present and any(p.get("return_routed_experts") for p in payloads):
        body["return_routed_experts"] = True  # SGLang takes one value for a whole batch
    return body


def split_answer(body: Any, rids: Sequence[str]) -> list[dict[str, Any]]:
    """One answer per rid, in `rids` order: by `meta_info.id` when the answers carry exactly these rids,
    else by position (SGLang answers in order). BatchAnswerError when it is not a list of len(rids) dicts."""
    if not isinstance(body, list) or len(body) != len(rids) or not all(isinstance(item, dict) for item in body):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise BatchAnswerError(f"a batch of {len(rids)} requests was answered with {got}, not one answer per "
                               "request: the engine does not take batched input_ids")
    by_id = {(item.get("meta_info") or {}).get("id"): item for item in body}
    if set(by_id) == set(rids):
        return [by_id[rid] for rid in rids]
    return list(body)


def plan_batches(items: Sequence[T], groups: Sequence[int | None], *, engines: int, max_batch: int) -> list[list[T]]:
    """Cut the items queued together into requests: about one per engine (so the engines share them),
    whole groups where it can (a GRPO group's samples share a prompt: one engine, one prefix), none over
    `max_batch` (the engine's concurrency). `groups[i]` is item i's group (None: a group of its own);
    items keep their order within a group and groups the order of their first item."""
    if not items:
        return []
    order: dict[object, list[T]] = {}
    for index, (item, group) in enumerate(zip(items, groups, strict=True)):
        order.setdefault(("group", group) if group is not None else ("item", index), []).append(item)
    max_batch = max(1, max_batch)
    target = min(max_batch, -(-len(items) // max(1, engines)))
    batches: list[list[T]] = []
    current: list[T] = []
    for members in order.values():
        if current and len(current) + len(members) > target:
            batches.append(current)
            current = []
        for start in range(0, len(members), max_batch):  # a group larger than one request allows
            piece = members[start:start + max_batch]
            if current and len(current) + len(piece) > max_batch:
                batches.append(current)
                current = []
            current.extend(piece)
    if current:
        batches.append(current)
    return batches
