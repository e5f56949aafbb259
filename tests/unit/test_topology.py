"""Job topology: het groups, engine placement, weight-group ranks, on many shapes."""

from __future__ import annotations

import pytest

from hpc_rl.config.sections.cluster import ClusterConfig
from hpc_rl.launch.topology import plan_topology


@pytest.mark.parametrize(
    "nodes,per_node,rollout_gpus,engine_tp,colocate,expected_engines,rollout_nodes",
    [
        (1, 8, 8, 2, True, 4, None),
        (1, 4, 4, 2, False, 2, 1),
        (2, 8, 16, 2, False, 8, 2),
        (1, 1, 1, 1, False, 1, 1),
        (4, 8, 24, 8, False, 3, 3),
        (2, 8, 16, 4, True, 4, None),
    ],
)
def test_shapes(nodes: int, per_node: int, rollout_gpus: int, engine_tp: int, colocate: bool,
                expected_engines: int, rollout_nodes: int | None) -> None:
    cluster = ClusterConfig(actor_num_nodes=nodes, actor_num_gpus_per_node=per_node, rollout_num_gpus=rollout_gpus,
                            rollout_num_gpus_per_engine=engine_tp, colocate=colocate)
    topology = plan_topology(cluster)
    assert len(topology.engines) == expected_engines
    assert topology.weight_update_world_size == 1 + rollout_gpus
    assert [e.weight_group_rank_offset for e in topology.engines] == [1 + i * engine_tp for i in range(expected_engines)]
    assert len({e.port for e in topology.engines}) == expected_engines  # one port each (shared network stack)
    for engine in topology.engines:
        assert len(engine.gpu_ids) == engine_tp and max(engine.gpu_ids) < cluster.num_gpus_per_node
    if colocate:
        assert len(topology.groups) == 1 and all(e.het_group == 0 for e in topology.engines)
        assert max(e.node_index for e in topology.engines) < nodes
    else:
        assert [g.role for g in topology.groups] == ["trainer", "rollout"]
        assert topology.groups[1].num_nodes == rollout_nodes
        # no two engines on one node share a GPU
        seen = set()
        for engine in topology.engines:
            for gpu in engine.gpu_ids:
                assert (engine.node_index, gpu) not in seen
                seen.add((engine.node_index, gpu))


def test_unplaceable_engine() -> None:
    """Larger than a node, an engine takes whole nodes (tests/unit/test_multi_node_engines.py); a part-node is refused."""
    with pytest.raises(ValueError, match="must take whole nodes"):
        plan_topology(ClusterConfig(rollout_num_gpus=24, rollout_num_gpus_per_engine=12, num_gpus_per_node=8))
