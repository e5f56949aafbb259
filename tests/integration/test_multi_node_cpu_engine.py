"""The CPU engine as a two-node engine (SGLang's --nnodes 2), two real processes standing for node9 and node10:
node-rank 0 serves the API after node-rank 1 joined, node-rank 1 only SGLang's health endpoints; a colocated
update whose shares come from each node's own GPU loads on both nodes (their weights compared), discarded
weights come back on both, a follower handed other weights than node-rank 0 fails the update, and a share sent
to the wrong node kills the engine (SGLang's `Invalid device_uuid`), both processes."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hpc_rl.process.child_process import http_ok, planned_port
from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.protocol.http_client import EngineHTTPTransportError, request_blocking
from hpc_rl.weights.colocated import update_weights_from_tensor_body, write_shared_memory_bucket

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "tiny_qwen3"


def node_env(node: str, rank: int) -> dict[str, str]:
    return {**os.environ, "SLURMD_NODENAME": node, "SLURM_STEP_GPUS": "0", "HPC_RL_DEVICE_ID": f"{node}/gpu0",
            "PYTHONPATH": str(REPO)}


def distinct_ports(count: int) -> list[int]:
    """`count` different ports, each free now in the planned range (no outgoing connection takes one before the
    engines bind it, seconds later: `planned_port`)."""
    ports: list[int] = []
    while len(ports) < count:
        port = planned_port()
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture()
def two_node_engine(tmp_path: Path) -> Iterator[tuple[CpuEngineProcess, CpuEngineProcess]]:
    ports, dist_init = distinct_ports(2), planned_port()
    while dist_init in ports:
        dist_init = planned_port()
    processes = [CpuEngineProcess(MODEL, log_path=tmp_path / f"node{rank}.log", port=ports[rank], env=node_env(node, rank),
                                  extra_args=["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
                                              f"127.0.0.1:{dist_init}", "--enable-memory-saver"])
                 for rank, node in enumerate(["node9", "node10"])]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.wait_healthy(120)
        yield processes[0], processes[1]
    finally:
        for process in processes:
            process.stop()


def post(url: str, path: str, body: dict) -> tuple[int, str]:
    status, answer = request_blocking("POST", f"{url}{path}", json.dumps(body).encode(), timeout_s=60)
    return status, answer.decode(errors="replace")


def update(url: str, shares: list[str], version: str) -> tuple[int, str]:
    assert post(url, "/begin_weight_update", {})[0] == 200
    try:
        return post(url, "/update_weights_from_tensor", update_weights_from_tensor_body(shares, weight_version=version))
    finally:
        post(url, "/end_weight_update", {})


def test_a_two_node_cpu_engine_loads_each_nodes_shares_and_dies_of_a_share_from_another_node(
        two_node_engine: tuple[CpuEngineProcess, CpuEngineProcess]) -> None:
    leader, follower = two_node_engine
    assert http_ok(f"{follower.url}/health_generate") and not http_ok(f"{follower.url}/model_info")
    weights = sorted(load_file(str(MODEL / "model.safetensors")).items())
    new = [(name, tensor * 0.5) for name, tensor in weights]
    buckets = [write_shared_memory_bucket(new, device=device) for device in ("node9/gpu0", "node10/gpu0")]
    other = write_shared_memory_bucket([(n, t * 0.25) for n, t in weights], device="node10/gpu0")
    stray = write_shared_memory_bucket(new, device="node9/gpu0")
    try:
        # released weights are discarded on both nodes; the update refills both, and their weights agree
        assert post(leader.url, "/pause_generation", {"mode": "retract"})[0] == 200
        assert post(leader.url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})[0] == 200
        assert post(leader.url, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})[0] == 200
        status, answer = update(leader.url, [b.descriptor for b in buckets], "1")
        assert status == 200, answer
        assert json.loads(request_blocking("GET", f"{leader.url}/model_info", None, timeout_s=10)[1])[
            "weight_version"] == "1"
        # node-rank 1's TP rank was handed another model than node-rank 0's: the update fails, the engine lives
        status, answer = update(leader.url, [buckets[0].descriptor, other.descriptor], "2")
        assert status == 400 and "node-rank 1 holds other weights than node-rank 0" in answer
        assert leader.process.alive() and follower.process.alive() and http_ok(f"{leader.url}/health")
        # a share from node9's GPU sent to node10's TP rank: that scheduler dies, and the engine with it
        assert post(leader.url, "/begin_weight_update", {})[0] == 200
        try:  # it may answer before it exits, or not at all
            post(leader.url, "/update_weights_from_tensor",
                 update_weights_from_tensor_body([buckets[0].descriptor, stray.descriptor], weight_version="3"))
        except EngineHTTPTransportError:
            pass
        deadline = time.monotonic() + 60
        while (leader.process.alive() or follower.process.alive()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not leader.process.alive() and not follower.process.alive(), "a node-rank outlived the fatal share"
        assert "Invalid device_uuid=node9/gpu0" in Path(follower.process.log_path).read_text()
    finally:
        for bucket in [*buckets, other, stray]:
            bucket.close()
