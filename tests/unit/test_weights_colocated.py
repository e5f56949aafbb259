"""The /update_weights_from_tensor payload (colocated mode), with CPU tensors standing in for CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_rl.weights.colocated import deserialize_named_tensors, update_weights_from_tensor_body


def test_body_has_one_serialized_list_per_engine_rank_and_round_trips() -> None:
    named = [("model.embed_tokens.weight", torch.randn(24, 8)), ("model.norm.weight", torch.ones(8))]
    body = update_weights_from_tensor_body([named, named], weight_version="3")
    assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache", "weight_version"}
    assert len(body["serialized_named_tensors"]) == 2 and body["weight_version"] == "3"
    json.dumps(body)  # the body is JSON (strings only)
    back = deserialize_named_tensors(body["serialized_named_tensors"][1])
    assert [name for name, _ in back] == [name for name, _ in named]
    for (_, got), (_, want) in zip(back, named):
        assert torch.equal(got, want)


def test_body_refuses_mismatched_ranks() -> None:
    with pytest.raises(ValueError):
        update_weights_from_tensor_body([[("a", torch.ones(1))], [("b", torch.ones(1))]])
    with pytest.raises(ValueError):
        update_weights_from_tensor_body([])
