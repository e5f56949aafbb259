"""GPU placement from Slurm (issue 22 items 1-2): device identities read from each step's own environment,
colocated ranks paired with engines by identity (never rank arithmetic), what each step asks Slurm for,
the engine step's read-back and refusal, the CPU engine's twin of SGLang's `Invalid device_uuid`, and
torchrun's node names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.controller.transports.colocated import colocated_pairs
from hpc_rl.controller.registry import EngineInfo, Registry, TrainerInfo
from hpc_rl.launch.bound_torchrun import with_node_name
from hpc_rl.launch.srun_launcher import srun_argv
from hpc_rl.launch.step_plan import engine_base_gpu_id, engine_step, trainer_step
from hpc_rl.launch.topology import plan_topology
from hpc_rl.weights.device_identity import (
    InvisibleDeviceError,
    PlacementError,
    device_at,
    engine_devices,
    pair_ranks_with_engines,
    refuse_invisible_device,
    step_gpu_ids,
    trainer_rank_device,
)

REPO = Path(__file__).resolve().parents[2]


def test_identity_is_the_node_name_and_slurms_gpu_id_at_the_process_position() -> None:
    # ConstrainDevices: CUDA_VISIBLE_DEVICES restarts at 0 in the step, SLURM_STEP_GPUS keeps the node's ids
    step = {"SLURMD_NODENAME": "node10", "SLURM_STEP_GPUS": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert step_gpu_ids(step) == ["4", "5", "6", "7"]
    assert trainer_rank_device({**step, "LOCAL_RANK": "2"}) == "node10/gpu6"
    assert engine_devices(2, 2, step) == ["node10/gpu6", "node10/gpu7"]
    assert device_at(1, {"SLURMD_NODENAME": "n", "CUDA_VISIBLE_DEVICES": "3,1"}) == "n/gpu1"
    assert device_at(3, {"SLURMD_NODENAME": "n"}) == "n/gpu3"  # no list: every GPU of the node, by position
    with pytest.raises(PlacementError, match="holds only 2 GPU"):
        engine_devices(1, 2, {"SLURMD_NODENAME": "n", "SLURM_STEP_GPUS": "0,1"})


def test_ranks_pair_with_the_engine_on_their_gpu_whatever_their_numbers() -> None:
    """torchrun put rank 0 on node10 (sorted names); Slurm put engine 0 on node9 (its order)."""
    ranks = {0: "node10/gpu0", 1: "node10/gpu1", 2: "node9/gpu0", 3: "node9/gpu1"}
    engines = {0: ["node9/gpu0", "node9/gpu1"], 1: ["node10/gpu0", "node10/gpu1"]}
    assert pair_ranks_with_engines(ranks, engines) == {0: (1, 0), 1: (1, 1), 2: (0, 0), 3: (0, 1)}
    with pytest.raises(PlacementError, match="rank 3 on node9/gpu1"):
        pair_ranks_with_engines(ranks, {1: engines[1], 0: ["node9/gpu0"]})


def test_the_controller_pairs_registered_ranks_and_engines_failed_ones_too() -> None:
    registry = Registry(trainer_world_size=2, num_engines=2)
    for rank, device in enumerate(["node10/gpu0", "node9/gpu0"]):
        registry.add_trainer(TrainerInfo(rank=rank, world_size=2, host="h", pid=rank, info={"device": device}))
    registry.add_engine(EngineInfo(engine_index=0, url="http://a", devices=["node9/gpu0"]))
    registry.add_engine(EngineInfo(engine_index=1, url="http://b", devices=["node10/gpu0"]))
    assert colocated_pairs(registry) == [[1, 0], [0, 0]]
    registry.trainers[1].info.pop("device")
    with pytest.raises(PlacementError, match=r"trainer ranks \[1\] did not report"):
        colocated_pairs(registry)


def test_the_cpu_engine_refuses_a_share_from_a_gpu_it_cannot_see_as_sglang_does() -> None:
    engine = {"SLURMD_NODENAME": "node9", "SLURM_STEP_GPUS": "0,1"}
    refuse_invisible_device("node9/gpu1", engine)
    with pytest.raises(InvisibleDeviceError, match="Invalid device_uuid=node10/gpu0"):
        refuse_invisible_device("node10/gpu0", engine)
    with pytest.raises(InvisibleDeviceError):
        refuse_invisible_device("node9/gpu5", engine)


def config_of(*flags: str):
    return load_config([REPO / "configs" / "tiny_cpu.yaml"], ["--set", "slurm.gpus_for_cpu_runs=true", *flags])


def test_colocated_engines_ask_for_their_nodes_gpus_and_pick_theirs_by_base_gpu_id(tmp_path: Path) -> None:
    config = config_of("--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4")
    topology = plan_topology(config.cluster)
    steps = [engine_step(config, topology, i, host="h", port=1, run_dir=tmp_path, env={}, local=False) for i in range(4)]
    assert [s.gpus_per_node for s in steps] == [2, 2, 2, 2] and all(s.overlap for s in steps)
    assert [s.argv[s.argv.index("--base-gpu-id") + 1] for s in steps] == ["0", "1", "0", "1"]
    assert [s.node_index for s in steps] == [0, 0, 1, 1]
    argv = srun_argv(steps[1], het_job=False, nodelist=["node9"])
    assert "--gpus-per-node=2" in argv and "--overlap" in argv and "CUDA_VISIBLE_DEVICES" not in " ".join(argv)
    trainer = trainer_step(config, tmp_path, "h:1", env={}, local=False)
    assert trainer.gpus_per_node == 2 and trainer.num_nodes == 2


def test_decoupled_engines_get_their_own_gpus_from_slurm_or_the_machines_next_ones_locally(tmp_path: Path) -> None:
    config = config_of("--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2")
    topology = plan_topology(config.cluster)
    placement = topology.engines[1]
    assert engine_base_gpu_id(config, topology, placement, local=False) == 0
    assert engine_base_gpu_id(config, topology, placement, local=True) == 3  # after the trainer's 2 GPUs
    step = engine_step(config, topology, 1, host="h", port=1, run_dir=tmp_path, env={}, local=False)
    argv = srun_argv(step, het_job=True, nodelist=["node3"])
    assert "--gpus-per-node=1" in argv and "--exact" in argv and "--overlap" not in argv
    plain = load_config([REPO / "configs" / "tiny_cpu.yaml"])  # a CPU run asks Slurm for no GPU
    assert engine_step(plain, plan_topology(plain.cluster), 0, host="h", port=1, run_dir=tmp_path, env={},
                       local=False).gpus_per_node == 0


def run_gpu_step(tmp_path: Path, environ: dict[str, str], base: int, tp: int) -> subprocess.CompletedProcess[str]:
    report = tmp_path / "placement" / "engine-0.json"
    command = [sys.executable, "-m", "hpc_rl.engines.gpu_step", "--base-gpu-id", str(base), "--tp-size", str(tp),
               "--report", str(report), "--", sys.executable, "-c", "import os; print(os.environ['HPC_RL_DEVICE_ID'])"]
    return subprocess.run(command, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **environ},
                          capture_output=True, text=True, timeout=60)


def test_the_engine_step_reads_back_its_gpus_reports_them_and_execs_the_engine(tmp_path: Path) -> None:
    done = run_gpu_step(tmp_path, {"SLURMD_NODENAME": "node9", "SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "2,3"},
                        base=1, tp=1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "node9/gpu3"  # the engine sees its identity
    report = json.loads((tmp_path / "placement" / "engine-0.json").read_text())
    assert report["devices"] == ["node9/gpu3"] and report["step_gpus"] == ["2", "3"] and report["base_gpu_id"] == 1


def test_the_engine_step_refuses_gpus_its_step_does_not_hold(tmp_path: Path) -> None:
    done = run_gpu_step(tmp_path, {"SLURMD_NODENAME": "node9", "SLURM_STEP_GPUS": "0"}, base=1, tp=1)
    assert done.returncode == 2 and "holds only 1 GPU(s)" in done.stderr and done.stdout == ""
    assert not (tmp_path / "placement" / "engine-0.json").exists()


def test_torchrun_is_given_the_slurm_node_name_to_order_nodes_by() -> None:
    def resolves(name: str) -> bool:
        return name != "ghost"

    argv = ["--nnodes=2", "-m", "hpc_rl.training"]
    assert with_node_name(argv, {"SLURMD_NODENAME": "node10"}, resolves=resolves) == ["--local-addr=node10", *argv]
    assert with_node_name(argv, {}, resolves=resolves) == argv
    assert with_node_name(argv, {"SLURMD_NODENAME": "ghost"}, resolves=resolves) == argv
    local = ["--local-addr=127.0.0.1", *argv]
    assert with_node_name(local, {"SLURMD_NODENAME": "node10"}, resolves=resolves) == local


def test_real_sglang_on_cpu_gets_no_base_gpu_id_which_it_reads_as_a_numa_node(tmp_path: Path) -> None:
    """SGLang 0.5.23 on device cpu binds OpenMP threads to NUMA node `gpu_id` and exits when it is out of range
    (measured: the local decoupled engine after one trainer rank got --base-gpu-id 1 on a 1-node machine)."""
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"], ["--set", "rollout.engine=sglang"])
    topology = plan_topology(config.cluster)
    step = engine_step(config, topology, 0, host="h", port=1, run_dir=tmp_path, env={}, local=True)
    check, sglang = step.argv[:step.argv.index("--")], step.argv[step.argv.index("--"):]
    assert check[check.index("--base-gpu-id") + 1] == "1"  # hpc_rl's own placement check keeps the position
    assert "sglang.launch_server" in sglang and "--base-gpu-id" not in sglang
    cuda = config_of("--rollout-num-gpus", "2", "--set", "cluster.device=cuda", "--set", "rollout.engine=sglang")
    gpu_step = engine_step(cuda, plan_topology(cuda.cluster), 1, host="h", port=1, run_dir=tmp_path, env={}, local=True)
    gpu_argv = gpu_step.argv[gpu_step.argv.index("--"):]
    assert gpu_argv[gpu_argv.index("--base-gpu-id") + 1] == "2"
