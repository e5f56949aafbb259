"""Reading the routed experts an engine returns with a `/generate` answer (rollout routing replay).

Owns `RoutingShape` (what the rollout asks for: the model's layer count and top-k) and
`routed_experts_from_answer`, which turns `meta_info["routed_experts"]` into the array a `Sample`
keeps (`hpc_rl.data.routed_experts`). Does not own when a request asks for them (generate.py).

SGLang 0.5.23's contract (engines launched with `--enable-return-routed-experts`; a request sets
`"return_routed_experts": true`, one value for a whole batched request, and may set
`routed_experts_start_len`, 0 by default, which hpc_rl keeps): `meta_info["routed_experts"]` is the
base64 of little-endian int32 ids of shape [seqlen - 1 - start_len, num_hidden_layers, topk], seqlen =
prompt tokens + output tokens of this request (detokenizer_manager `_b64_encode_per_request`,
batch_result_processor `_maybe_collect_routed_experts`). Every layer has a slot; a dense layer's
row is zeros (it routes nothing). Ids are the model's logical experts, before any expert-location
remapping. An engine launched without the flag answers without the field. An aborted running
request still carries the rows of the tokens it ran; one aborted while queued has no output and no
field. Decoded with pybase64 (as SGLang encodes): the field is MiBs per long sample, and the
standard library's decoder took 30x the controller CPU (benchmarks/bench_routed_experts.py).
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from hpc_rl.data.routed_experts import compact_expert_ids

REQUEST_FIELD = "return_routed_experts"
ANSWER_FIELD = "routed_experts"


class RoutedExpertsError(ValueError):
    """An answer whose routed experts do not fit its tokens (an engine or transport bug)."""


@dataclass(frozen=True)
class RoutingShape:
    """What each routed-experts row holds: one top-k per layer of the model."""

    num_layers: int
    topk: int


def routed_experts_from_answer(meta_info: dict[str, Any], *, shape: RoutingShape,
                               sequence_length: int) -> np.ndarray | None:
    """The [sequence_length - 1, num_layers, topk] ids of an answer (None when it carries none).

    `sequence_length` is the request's prompt tokens plus the tokens it generated.
    """
    value = meta_info.get(ANSWER_FIELD)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            ids = np.frombuffer(pybase64.b64decode(value, validate=True), dtype="<i4")
        except (binascii.Error, ValueError) as error:
            raise RoutedExpertsError(f"meta_info.routed_experts is not base64 of int32 ids: {error}") from None
    else:  # a JSON list (another engine's spelling): the same ids
        ids = np.asarray(value, dtype=np.int64).reshape(-1)
    rows = max(0, sequence_length - 1)
    expected = rows * shape.num_layers * shape.topk
    if ids.size != expected:
        raise RoutedExpertsError(
            f"meta_info.routed_experts has {ids.size} ids, expected {expected} = ({sequence_length} tokens - 1) x "
            f"{shape.num_layers} layers x top-{shape.topk}: the engine serves another model than the "
            "config's (num_layers, moe_router_topk), or it returned a part of the sequence")
    return compact_expert_ids(ids.reshape(rows, shape.num_layers, shape.topk))
