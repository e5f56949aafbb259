"""What `cluster.device` and the launcher's environment decide for a trainer rank: the weight-sync
address trainer rank 0 advertises, NCCL's environment on GPU, the GPU/CPU check, and the layer spec
(Transformer Engine on cuda, required there)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from hpc_rl.training.parallel import TRAINER_NCCL_ENV, apply_trainer_nccl_env, trainer_runs_on_cpu
from hpc_rl.training.sync_address import (
    SYNC_ADDRESS_ENV,
    TRAINER_NODE_ADDRESSES_ENV,
    binds_here,
    weight_sync_address,
)

NOT_HERE = "192.0.2.1"  # TEST-NET-1: never an address of this host


def test_binds_here_tells_own_addresses_from_others() -> None:
    assert binds_here("127.0.0.1")
    assert not binds_here(NOT_HERE)
    assert not binds_here("no-such-host.invalid")


def test_sync_address_is_this_nodes_entry_of_the_drivers_list() -> None:
    environ = {TRAINER_NODE_ADDRESSES_ENV: f"{NOT_HERE}, 127.0.0.1"}
    assert weight_sync_address(environ) == "127.0.0.1"  # real bind check: rank 0 need not be node 0
    picked = weight_sync_address({TRAINER_NODE_ADDRESSES_ENV: "10.0.0.7,10.0.0.8"}, is_local=lambda a: a == "10.0.0.8")
    assert picked == "10.0.0.8"
    assert weight_sync_address({**environ, SYNC_ADDRESS_ENV: "10.1.2.3"}) == "10.1.2.3"  # explicit override


def test_sync_address_never_falls_back_to_the_host_name() -> None:
    with pytest.raises(RuntimeError, match=TRAINER_NODE_ADDRESSES_ENV) as missing:
        weight_sync_address({})
    assert SYNC_ADDRESS_ENV in str(missing.value)
    with pytest.raises(RuntimeError, match="belongs to this host"):
        weight_sync_address({TRAINER_NODE_ADDRESSES_ENV: NOT_HERE})


def test_gpu_trainer_sets_nccl_cumem_off_like_the_engines() -> None:
    from hpc_rl.engines.sglang_launch import ENGINE_ENV

    assert TRAINER_NCCL_ENV["NCCL_CUMEM_ENABLE"] == ENGINE_ENV["NCCL_CUMEM_ENABLE"] == "0"
    environ = {"NCCL_CUMEM_ENABLE": "1", "PATH": "/bin"}
    assert apply_trainer_nccl_env(environ) == {"NCCL_CUMEM_ENABLE": "0"}
    assert environ == {"NCCL_CUMEM_ENABLE": "0", "PATH": "/bin"}
    assert apply_trainer_nccl_env(environ) == {}


def test_device_is_cluster_device_not_what_torch_finds() -> None:
    assert trainer_runs_on_cpu("cpu")
    with pytest.raises(ValueError, match="cpu or cuda"):
        trainer_runs_on_cpu("gpu")
    if torch.cuda.is_available():
        assert not trainer_runs_on_cpu("cuda")
    else:
        with pytest.raises(RuntimeError, match="sees no GPU"):
            trainer_runs_on_cpu("cuda")


def test_layer_spec_follows_cluster_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_rl.training.layer_specs import use_transformer_engine

    assert use_transformer_engine("cpu") is False
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # TE not installed: the import fails
    with pytest.raises(RuntimeError, match="import transformer_engine.*cluster.device: cpu"):
        use_transformer_engine("cuda")
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert use_transformer_engine("cuda") is True  # importable is enough: no torch.cuda probe decides it
