"""The experts an engine routed each token to, as a `Sample` carries them (rollout routing replay).

Owns: the in-memory form (a numpy array [positions, num_layers, topk] of expert ids, one row per
token the engine ran through the model: the prompt and every response token but the last, which it
sampled and never fed back), its compact dtype, and its JSON-safe form for checkpoints of the
partial-rollout buffer. Does not own reading SGLang's answer (`hpc_rl.rollout.routed_experts`) nor
replaying it (`hpc_rl.training.routing_replay`).

SGLang sends int32 ids. Every MoE recipe hpc_rl runs has at most 256 routed experts (Qwen3-MoE 128,
GLM-4.5 160, DeepSeek-V3 256), so the ids are kept as uint8 there (int16 up to 32,768 experts,
int32 beyond): a quarter of the controller's memory and of the bytes sent to the trainer, for
arrays of prompt+response x layers x topk ids per sample (Qwen3-30B-A3B: 384 ids per token).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

JSON_TAG = "routed_experts"


def compact_expert_ids(ids: np.ndarray) -> np.ndarray:
    """`ids` in the smallest wire dtype (uint8, int16, int32) that holds them; negative ids are refused."""
    if ids.size == 0:
        return ids.astype(np.uint8)
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(f"routed expert ids must be >= 0, got {low}")
    for dtype in (np.uint8, np.int16, np.int32):
        if high <= np.iinfo(dtype).max:
            return ids.astype(dtype, copy=False)
    raise ValueError(f"routed expert id {high} does not fit in int32")


def routing_to_json(routing: np.ndarray) -> dict[str, Any]:
    """A JSON-safe form of a routing array (base64 bytes, dtype and shape)."""
    array = np.ascontiguousarray(routing)
    return {JSON_TAG: base64.b64encode(array.tobytes()).decode("ascii"), "dtype": array.dtype.str,
            "shape": list(array.shape)}


def routing_from_json(data: dict[str, Any]) -> np.ndarray:
    """The array `routing_to_json` wrote."""
    raw = base64.b64decode(data[JSON_TAG])
    return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()
