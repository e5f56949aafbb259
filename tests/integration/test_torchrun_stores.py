"""A local run's torchrun (as the driver starts it) hosts its rendezvous store and the store it shares with
its ranks on loopback only; the ranks still meet (a real torchrun with two gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config.loading import load_config
from hpc_rl.launch.bound_torchrun import STORE_ADDRESS_ENV
from hpc_rl.launch.step_plan import trainer_command
from hpc_rl.process.child_process import planned_port

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from tests.listeners import listening_addresses
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({{"sum": total.item(), "rdzv": sorted(listening_addresses({rdzv_port})),
          "shared": sorted(listening_addresses(int(os.environ["MASTER_PORT"])))}}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_local_trainer_stores_listen_on_loopback_only(tmp_path: Path) -> None:
    rdzv_port = planned_port()  # outside the ephemeral range: no outgoing connection takes it before torchrun binds
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT.format(repo=str(REPO_ROOT), rdzv_port=rdzv_port))
    config = load_config([REPO_ROOT / "configs/tiny_cpu.yaml"], ["--set", "cluster.actor_num_gpus_per_node=2"])
    argv = trainer_command(config, tmp_path, f"127.0.0.1:{rdzv_port}", local=True)
    module = argv.index("-m", 3)  # the driver's "-m hpc_rl.training RUN_DIR" -> our script
    argv = argv[:module] + [str(script)]
    env = {**os.environ, STORE_ADDRESS_ENV: "127.0.0.1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["sum"] == 2.0
    assert result["rdzv"] == ["127.0.0.1"]  # plain torchrun: ["::"] (every interface)
    assert result["shared"] == ["127.0.0.1"]
