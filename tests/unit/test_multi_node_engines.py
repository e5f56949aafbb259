"""Engines that span nodes (issue 19, slime's 32-GPU GLM-4.5 engines): SGLang's multi-node serving rendered as
one srun step per engine with one task per node (`--nnodes`, `--dist-init-addr`; each task's `--node-rank`,
`--host`, `--port` from its task rank), each node-rank's placement report, the engine's devices over all its
nodes in TP-rank order, colocated trainer ranks paired with the engine TP rank on their GPU on every node, and
what submit accepts and refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.sections.cluster import ClusterConfig
from hpc_rl.config.validation import collect_problems
from hpc_rl.engines.gpu_step import reported_devices, with_node_rank
from hpc_rl.launch.srun_launcher import srun_argv
from hpc_rl.launch.step_plan import engine_step
from hpc_rl.launch.topology import plan_topology
from hpc_rl.weights.device_identity import pair_ranks_with_engines
from tests.unit.test_slime_moe_lines import GLM45_LINE

REPO = Path(__file__).resolve().parents[2]


def test_an_engine_larger_than_a_node_takes_whole_consecutive_nodes() -> None:
    colocated = plan_topology(ClusterConfig(actor_num_nodes=8, actor_num_gpus_per_node=8, rollout_num_gpus=64,
                                            rollout_num_gpus_per_engine=32, colocate=True))
    assert [(e.node_index, e.num_nodes, e.gpu_ids, e.tp_size) for e in colocated.engines] == [
        (0, 4, tuple(range(8)), 32), (4, 4, tuple(range(8)), 32)]
    assert [e.weight_group_rank_offset for e in colocated.engines] == [1, 33]
    ports = [port for e in colocated.engines for port in [*e.node_ports(), e.dist_init_port]]
    assert len(set(ports)) == len(ports)  # virtual nodes share one network stack: every node-rank its own port
    decoupled = plan_topology(ClusterConfig(rollout_num_gpus=32, rollout_num_gpus_per_engine=16, num_gpus_per_node=8))
    assert [(e.het_group, e.node_index, e.num_nodes) for e in decoupled.engines] == [(1, 0, 2), (1, 2, 2)]
    assert decoupled.groups[1].num_nodes == 4 and decoupled.groups[1].tasks_per_node == 1
    assert "nodes 0-1 (SGLang --nnodes 2; node-rank 0 serves HTTP)" in decoupled.describe()
    with pytest.raises(ValueError, match="must take whole nodes: make rollout_num_gpus_per_engine a multiple of 8"):
        plan_topology(ClusterConfig(rollout_num_gpus=12, rollout_num_gpus_per_engine=12, num_gpus_per_node=8))


def spanning_config(*flags: str):
    return load_config([REPO / "configs" / "tiny_cpu.yaml"], [
        "--set", "slurm.gpus_for_cpu_runs=true", "--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node",
        "1", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2", *flags])


def test_a_multi_node_engine_is_one_step_with_a_task_per_node_and_sglangs_multi_node_flags(tmp_path: Path) -> None:
    config = spanning_config()
    topology = plan_topology(config.cluster)
    step = engine_step(config, topology, 0, host="10.0.0.1", port=15010, run_dir=tmp_path, env={}, local=False,
                       node_hosts=["10.0.0.1", "10.0.0.2"], node_ports=[15010, 15014], dist_init_port=15011)
    assert (step.num_nodes, step.tasks_per_node, step.node_index, step.gpus_per_node, step.overlap) == (2, 1, 0, 1, True)
    argv = step.argv
    check, engine = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert check[check.index("--nnodes") + 1] == "2" and check[check.index("--tp-size") + 1] == "1"
    assert check[check.index("--node-hosts") + 1] == "10.0.0.1,10.0.0.2"
    assert check[check.index("--node-ports") + 1] == "15010,15014"
    assert engine[engine.index("--nnodes") + 1] == "2" and engine[engine.index("--dist-init-addr") + 1] == "10.0.0.1:15011"
    assert "--node-rank" not in engine  # each task's own, from its task rank
    srun = srun_argv(step, het_job=False, nodelist=["node1", "node2"])
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=node1,node2", "--gpus-per-node=1",
            "--overlap"} <= set(srun)


def test_sglang_gets_the_total_tp_size_and_the_multi_node_flags(tmp_path: Path) -> None:
    config = load_config([], GLM45_LINE)  # slime's GLM-4.7-355B line: 32-GPU engines on 8-GPU nodes
    topology = plan_topology(config.cluster)
    step = engine_step(config, topology, 1, host="n4", port=15026, run_dir=tmp_path, env={}, local=False,
                       node_hosts=["n4", "n5", "n6", "n7"], node_ports=[15026, 15030, 15034, 15038],
                       dist_init_port=15027)
    engine = step.argv[step.argv.index("--") + 1:]
    assert engine[2] == "sglang.launch_server" and engine[engine.index("--tp-size") + 1] == "32"
    assert engine[engine.index("--base-gpu-id") + 1] == "0" and engine[engine.index("--nnodes") + 1] == "4"
    assert engine[engine.index("--dist-init-addr") + 1] == "n4:15027" and "--enable-memory-saver" in engine


def test_each_task_gets_its_node_rank_host_and_port() -> None:
    engine = ["python", "-m", "sglang.launch_server", "--host", "n4", "--port", "15026", "--nnodes", "4"]
    assert with_node_rank(engine, 2, "n6", 15034) == [
        "python", "-m", "sglang.launch_server", "--host", "n6", "--port", "15034", "--nnodes", "4", "--node-rank", "2"]


def run_node_rank(tmp_path: Path, node: str, rank: int) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "hpc_rl.engines.gpu_step", "--base-gpu-id", "0", "--tp-size", "2", "--report",
               str(tmp_path / "placement" / "engine-0.json"), "--nnodes", "2", "--node-hosts", "a,b",
               "--node-ports", "1,5", "--", sys.executable, "-c",
               "import os, sys; print(os.environ['HPC_RL_DEVICE_ID'], *sys.argv[1:])", "--host", "a", "--port", "1"]
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "SLURMD_NODENAME": node, "SLURM_PROCID": str(rank),
               "SLURM_STEP_GPUS": "0,1"}
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60)


def test_every_node_rank_reports_its_gpus_and_the_engine_is_registered_with_all_of_them(tmp_path: Path) -> None:
    first = run_node_rank(tmp_path, "node9", 0)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["node9/gpu0", "--host", "a", "--port", "1", "--node-rank", "0"]
    with pytest.raises(ValueError, match="node-rank 1 wrote no placement report"):
        reported_devices(tmp_path, 0)
    second = run_node_rank(tmp_path, "node10", 1)
    assert second.stdout.split() == ["node10/gpu0", "--host", "b", "--port", "5", "--node-rank", "1"]
    assert json.loads((tmp_path / "placement" / "engine-0.node1.json").read_text())["node_rank"] == 1
    # TP ranks 0-1 on node-rank 0's node, 2-3 on node-rank 1's
    assert reported_devices(tmp_path, 0) == ["node9/gpu0", "node9/gpu1", "node10/gpu0", "node10/gpu1"]
    outside = run_node_rank(tmp_path, "node11", 2)
    assert outside.returncode == 2 and "node-rank 2 of 2" in outside.stderr


def test_colocated_ranks_pair_with_the_engine_tp_rank_on_their_gpu_on_every_node() -> None:
    """One engine over node9 and node10; torchrun numbered node10's ranks first."""
    ranks = {0: "node10/gpu0", 1: "node10/gpu1", 2: "node9/gpu0", 3: "node9/gpu1"}
    engine = {0: ["node9/gpu0", "node9/gpu1", "node10/gpu0", "node10/gpu1"]}
    assert pair_ranks_with_engines(ranks, engine) == {0: (0, 2), 1: (0, 3), 2: (0, 0), 3: (0, 1)}


def test_submit_accepts_engines_over_whole_nodes_and_says_what_does_not_work() -> None:
    def problems(*flags: str) -> list[str]:
        return [str(p) for p in collect_problems(load_config([REPO / "configs" / "tiny_cpu.yaml"], list(flags)),
                                                 check_files=False)]

    assert problems("--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus",
                    "4", "--rollout-num-gpus-per-engine", "4", "--pipeline-model-parallel-size", "2") == []
    odd = problems("--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4",
                   "--rollout-num-gpus-per-engine", "3")
    assert any("it must divide actor_num_gpus_per_node (2) or, spanning nodes, be a multiple of it" in p for p in odd)
    cpu_group = problems("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4",
                         "--set", "cluster.num_gpus_per_node=2")
    assert cpu_group == ["cluster.rollout_num_gpus_per_engine: the CPU engine spans 2 nodes here, and cannot join a "
                         "weight-update group with the TP ranks of every node (as SGLang does): use colocated mode, "
                         "--update-weight-transport disk, or engines of at most one node"]
    assert problems("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--set",
                    "cluster.num_gpus_per_node=2", "--update-weight-transport", "disk",
                    "--update-weight-disk-dir", "/tmp/w") == []


def test_a_local_run_refuses_an_engine_that_spans_nodes(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local",
                           "--run-dir", str(tmp_path / "run"), *spanning_config_flags()],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "a multi-node engine needs a Slurm allocation (--executor slurm); nothing was started" in done.stderr


def spanning_config_flags() -> list[str]:
    return ["--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
            "--rollout-num-gpus-per-engine", "2"]
