"""The adapter-only sync's requests (issue 33): which transport a LoRA run's flags choose, the names the engines
serve each version under, SGLang's request bodies, and the bytes a sync moves."""

from __future__ import annotations

import torch

from hpc_rl.config.lora import LoraConfig
from hpc_rl.weights.lora_sync import (
    adapter_bytes,
    adapter_directory,
    adapter_transport,
    generate_fields,
    load_request,
    unload_request,
)


def test_flags_choose_the_transport_and_requests_name_the_version() -> None:
    disk = LoraConfig(lora_rank=8, target_modules="all-linear")
    assert adapter_transport(disk) == "disk"
    assert adapter_transport(LoraConfig(lora_rank=8, target_modules="q_proj", lora_sync_from_tensor=True)) == "tensor"
    train_only = LoraConfig(lora_rank=8, target_modules="q_proj", lora_train_only=True)
    assert adapter_transport(train_only) == "none" and generate_fields(train_only, 3) == {}
    directory = adapter_directory("/runs/a", 3)
    assert str(directory) == "/runs/a/adapters/policy-v3"
    assert load_request(3, directory) == {"lora_name": "policy-v3", "lora_path": "/runs/a/adapters/policy-v3"}
    assert unload_request(2) == {"lora_name": "policy-v2"}
    assert generate_fields(disk, 3) == {"lora_path": "policy-v3"} and generate_fields(disk, None) == {}


def test_adapter_bytes_count_what_is_sent() -> None:
    state = {"a": torch.zeros(4, 64, dtype=torch.bfloat16), "b": torch.zeros(128, 4, dtype=torch.float32)}
    assert adapter_bytes(state) == 4 * 64 * 2 + 128 * 4 * 4
