"""The /update_weights_from_tensor payloads (colocated mode): SGLang's pickle (CPU tensors standing in
for CUDA ones) and the CPU twin's shared-memory descriptor."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
import torch

from hpc_rl.weights.colocated import (
    SHARED_MEMORY_PREFIX,
    PayloadError,
    deserialize_named_tensors,
    read_shared_memory_bucket,
    serialize_named_tensors,
    serialize_share,
    update_weights_from_tensor_body,
    write_shared_memory_bucket,
)

NAMED = [("model.embed_tokens.weight", torch.randn(24, 8)), ("model.norm.weight", torch.ones(8)),
         ("lm_head.weight", torch.randn(24, 8).to(torch.bfloat16))]


def test_sglang_body_has_one_share_per_engine_rank_and_round_trips() -> None:
    shares = [serialize_named_tensors(NAMED[:2]), serialize_named_tensors(NAMED[:2])]
    body = update_weights_from_tensor_body(shares, weight_version="3")
    assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache", "weight_version"}
    assert len(body["serialized_named_tensors"]) == 2 and body["weight_version"] == "3"
    json.dumps(body)  # the body is JSON (strings only)
    back = deserialize_named_tensors(body["serialized_named_tensors"][1])
    assert [name for name, _ in back] == [name for name, _ in NAMED[:2]]
    for (_, got), (_, want) in zip(back, NAMED):
        assert torch.equal(got, want)
    with pytest.raises(ValueError):
        update_weights_from_tensor_body([])


def test_shared_memory_bucket_round_trips_without_pickle() -> None:
    bucket = write_shared_memory_bucket(NAMED)
    try:
        assert bucket.path.name.startswith(SHARED_MEMORY_PREFIX) and str(bucket.path).startswith("/dev/shm/")
        assert oct(bucket.path.stat().st_mode & 0o777) == "0o600"
        described = json.loads(base64.b64decode(bucket.descriptor))
        assert [t["name"] for t in described["tensors"]] == [n for n, _ in NAMED]
        assert described["tensors"][2]["dtype"] == "bfloat16" and described["tensors"][1]["offset"] == 24 * 8 * 4
        back = read_shared_memory_bucket(bucket.descriptor)
        for (name, got), (want_name, want) in zip(back, NAMED):
            assert name == want_name and got.dtype == want.dtype and torch.equal(got, want)
    finally:
        bucket.close()
    assert not bucket.path.exists()
    with pytest.raises(PayloadError, match="missing"):
        read_shared_memory_bucket(bucket.descriptor)


def test_cpu_engine_side_refuses_pickles_and_foreign_paths(tmp_path) -> None:
    with pytest.raises(PayloadError, match="does not unpickle"):
        read_shared_memory_bucket(serialize_named_tensors(NAMED[:1]))
    with pytest.raises(PayloadError, match="does not unpickle"):
        read_shared_memory_bucket(base64.b64encode(pickle.dumps([1])).decode())
    foreign = {"format": "hpc_rl.cpu_shared_memory.v1", "path": "/etc/passwd", "total_bytes": 4,
               "tensors": [{"name": "a", "dtype": "float32", "shape": [1], "offset": 0}]}
    with pytest.raises(PayloadError, match="not an hpc_rl weight bucket"):
        read_shared_memory_bucket(base64.b64encode(json.dumps(foreign).encode()).decode())
    bucket = write_shared_memory_bucket(NAMED[:1])
    try:
        lying = json.loads(base64.b64decode(bucket.descriptor))
        lying["tensors"][0]["offset"] = 4
        with pytest.raises(PayloadError, match="do not match"):
            read_shared_memory_bucket(base64.b64encode(json.dumps(lying).encode()).decode())
    finally:
        bucket.close()


def test_share_follows_the_device() -> None:
    descriptor, bucket = serialize_share(NAMED[:1])
    assert bucket is not None
    try:
        assert json.loads(base64.b64decode(descriptor))["format"] == "hpc_rl.cpu_shared_memory.v1"
    finally:
        bucket.close()
