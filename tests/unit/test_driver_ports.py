"""The Slurm port plan: per-job slots, and ports in use on the driver's node replaced before anything binds."""

from __future__ import annotations

import socket

import pytest

from hpc_rl.config.sections.cluster import ClusterConfig
from hpc_rl.launch.ports import JOB_PORT_SLOTS, PortPlan, bind_failed, port_in_use
from hpc_rl.launch.topology import plan_topology


def slurm_plan(monkeypatch: pytest.MonkeyPatch, job_id: int) -> PortPlan:
    monkeypatch.setenv("SLURM_JOB_ID", str(job_id))
    return PortPlan.for_job(plan_topology(ClusterConfig(actor_num_nodes=2, rollout_num_gpus=2)), local=False)


def ports(plan: PortPlan) -> set[int]:
    return {plan.controller, plan.router, plan.router_metrics, plan.rendezvous, *plan.engines}


def free_slurm_plan(monkeypatch: pytest.MonkeyPatch) -> PortPlan:
    """The plan of the first job slot none of whose ports is in use here now: the test squats one of them itself, and
    another process on this machine (a test run, a Slurm job) may hold a port of any fixed slot (CI once found job
    7's controller port taken)."""
    for job_id in range(1, JOB_PORT_SLOTS + 1):
        plan = slurm_plan(monkeypatch, job_id)
        if not any(port_in_use("127.0.0.1", port) for port in ports(plan)):
            return plan
    raise AssertionError("every job slot has a port in use on this machine")


def test_neighbouring_jobs_share_no_port_and_stay_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = [slurm_plan(monkeypatch, job_id) for job_id in range(1, JOB_PORT_SLOTS + 1)]
    for a, b in zip(plans, plans[1:]):
        assert not ports(a) & ports(b)
    assert max(max(ports(p)) for p in plans) < 32768


def test_a_squatted_port_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = free_slurm_plan(monkeypatch)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no user
        squatter.bind(("127.0.0.1", plan.controller))
        squatter.listen()
        assert port_in_use("127.0.0.1", plan.controller)
        moved = plan.avoiding_busy("127.0.0.1", ["127.0.0.1"] * len(plan.engines))
    assert moved.controller != plan.controller
    assert (moved.router, moved.rendezvous, moved.engines) == (plan.router, plan.rendezvous, plan.engines)


def test_remote_engine_ports_are_left_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = free_slurm_plan(monkeypatch)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no user
        squatter.bind(("127.0.0.1", plan.engines[0]))
        squatter.listen()
        assert plan.avoiding_busy("127.0.0.1", ["10.0.0.2"] * len(plan.engines)).engines == plan.engines
        assert plan.avoiding_busy("127.0.0.1", ["127.0.0.1"] * len(plan.engines)).engines[0] != plan.engines[0]


def test_bind_failure_wordings() -> None:
    assert bind_failed("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 15010): "
                       "address already in use")
    assert bind_failed("Error: Os { code: 98, kind: AddrInUse, message: \"Address already in use\" }")
    assert not bind_failed("RuntimeError: CUDA out of memory")
