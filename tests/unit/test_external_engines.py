"""slime's --rollout-external-engine-addrs (issue 26): engines another job serves, checked at submit (a malformed
address named with its position and what to write; not with --colocate) and planned as no engine step."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.sglang_options import external_engine_url
from hpc_rl.config.validation import collect_problems
from hpc_rl.launch.topology import plan_run_topology

REPO = Path(__file__).resolve().parents[2]


def problems(*flags: str) -> list[str]:
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"], list(flags))
    return [str(p) for p in collect_problems(config, check_files=False)]


@pytest.mark.parametrize("address,url", [("10.0.0.5:30000", "http://10.0.0.5:30000"),
                                         ("http://node7:30000/", "http://node7:30000"),
                                         ("[::1]:30000", "http://[::1]:30000")])
def test_slimes_address_forms(address: str, url: str) -> None:
    assert external_engine_url(address) == url


def test_a_malformed_address_is_named_at_submit() -> None:
    found = problems("--rollout-external-engine-addrs", "10.0.0.5:30000", "node7", "https://n:1", "n:port", "n:1/x")
    assert [p.split(":", 1)[0] for p in found] == [f"rollout.rollout_external_engine_addrs[{i}]" for i in (1, 2, 3, 4)]
    assert "'node7' is not host:port or http://host:port" in found[0]


def test_external_engines_are_not_colocated_and_the_job_starts_none() -> None:
    assert any("cannot be colocated with the trainer" in p
               for p in problems("--colocate", "--rollout-external-engine-addrs", "h:1"))
    config = load_config([REPO / "configs" / "tiny_cpu.yaml"],
                         ["--rollout-external-engine-addrs", "h:1", "h:2", "--rollout-num-gpus", "0"])
    assert collect_problems(config, check_files=False) == []
    assert config.rollout.rollout_external_engine_addrs == ["h:1", "h:2"]
    topology = plan_run_topology(config)
    assert topology.engines == () and [g.role for g in topology.groups] == ["trainer"]
    assert "(external: rollout.rollout_external_engine_addrs)" in topology.describe()
