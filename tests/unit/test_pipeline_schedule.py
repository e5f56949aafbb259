"""Pipeline pieces without ranks: the 1F1B / forward-only orders (checked by simulating every stage's
p2p exchanges together: they all complete, nothing deadlocks, each transfer meets its partner),
stage layouts and global parameter names (hpc_rl.weights.stage)."""

from __future__ import annotations

import pytest

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.training.pipeline import Compute, Exchange, Op, forward_only, one_f_one_b, stage_output_shape
from hpc_rl.weights import hf_mapping
from hpc_rl.weights.stage import StageLayout, global_name, stage_name_map
from tests.unit.weight_states import even_stage_layout

_PARTNER = {"send_forward": ("recv_forward", 1), "recv_forward": ("send_forward", -1),
            "send_backward": ("recv_backward", -1), "recv_backward": ("send_backward", 1)}


def compute_order(ops: list[Op]) -> list[str]:
    return [f"{'F' if op.kind == 'forward' else 'B'}{op.micro}" for op in ops if isinstance(op, Compute)]


def simulate(schedules: list[list[Op]]) -> list[list[str]]:
    """Run every stage's ops in lock-step: an Exchange completes once each of its transfers is met by
    the partner's matching transfer in the partner's current Exchange. Returns the compute order
    per stage; raises on deadlock or on a compute whose input has not arrived."""
    stages = len(schedules)
    position = [0] * stages
    pending: list[set] = [set() for _ in range(stages)]  # unmatched transfers of the current Exchange
    arrived: list[set] = [set() for _ in range(stages)]  # ("forward"|"backward", micro) received
    done_compute: list[list[str]] = [[] for _ in range(stages)]
    while any(position[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for stage in range(stages):  # start Exchanges / run computes
            while position[stage] < len(schedules[stage]):
                op = schedules[stage][position[stage]]
                if isinstance(op, Compute):
                    if op.kind == "forward" and stage > 0:
                        assert ("forward", op.micro) in arrived[stage], (stage, op)
                    if op.kind == "backward":
                        assert f"F{op.micro}" in done_compute[stage], (stage, op)
                        if stage < stages - 1:
                            assert ("backward", op.micro) in arrived[stage], (stage, op)
                    done_compute[stage].append(f"{'F' if op.kind == 'forward' else 'B'}{op.micro}")
                    position[stage] += 1
                    progressed = True
                    continue
                if not pending[stage]:
                    pending[stage] = {(t.kind, t.micro) for t in op.transfers}
                break
        for stage in range(stages):  # match transfers between neighbours' current Exchanges
            for kind, micro in list(pending[stage]):
                partner_kind, step = _PARTNER[kind]
                peer = stage + step
                assert 0 <= peer < stages, (stage, kind)
                if (partner_kind, micro) in pending[peer]:
                    pending[stage].discard((kind, micro))
                    pending[peer].discard((partner_kind, micro))
                    for who, what in ((stage, kind), (peer, partner_kind)):
                        if what.startswith("recv"):
                            arrived[who].add(("forward" if what == "recv_forward" else "backward", micro))
                    progressed = True
        for stage in range(stages):  # an Exchange whose transfers all met is complete
            if position[stage] < len(schedules[stage]) and isinstance(schedules[stage][position[stage]], Exchange) \
                    and not pending[stage]:
                position[stage] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock at {position}: {pending}")
    return done_compute


def test_one_f_one_b_order_matches_the_textbook() -> None:
    assert compute_order(one_f_one_b(4, 3, 0)) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert compute_order(one_f_one_b(4, 3, 1)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert compute_order(one_f_one_b(4, 3, 2)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_single_stage_is_the_plain_loop_without_communication() -> None:
    ops = one_f_one_b(3, 1, 0)
    assert all(isinstance(op, Compute) for op in ops)
    assert compute_order(ops) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert compute_order(forward_only(3, 1, 0)) == ["F0", "F1", "F2"]


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micros", [1, 2, 3, 5, 8])
def test_every_stage_completes_without_deadlock(stages: int, micros: int) -> None:
    orders = simulate([one_f_one_b(micros, stages, r) for r in range(stages)])
    for stage, order in enumerate(orders):
        assert sorted(order) == sorted([f"F{i}" for i in range(micros)] + [f"B{i}" for i in range(micros)])
        in_flight = peak = 0
        for item in order:
            in_flight += 1 if item[0] == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= min(stages - stage, micros)  # 1F1B's memory bound: at most P - r activations
    assert simulate([forward_only(micros, stages, r) for r in range(stages)])[-1] == [f"F{i}" for i in range(micros)]


def test_first_and_last_stage_have_no_outward_transfers() -> None:
    def kinds(ops: list[Op]) -> set[str]:
        return {t.kind for op in ops if isinstance(op, Exchange) for t in op.transfers}

    assert kinds(one_f_one_b(4, 2, 0)) == {"send_forward", "recv_backward"}
    assert kinds(one_f_one_b(4, 2, 1)) == {"recv_forward", "send_backward"}
    assert kinds(one_f_one_b(4, 3, 1)) == {"send_forward", "recv_forward", "send_backward", "recv_backward"}


def test_stage_output_shape_is_sequence_first_and_split_under_sequence_parallel() -> None:
    assert stage_output_shape((2, 12), 64, 1) == (12, 2, 64)  # padded [b, s]
    assert stage_output_shape((1, 24), 64, 2) == (12, 1, 64)  # packed [1, T], SP over TP=2
    with pytest.raises(ValueError):
        stage_output_shape((1, 23), 64, 2)


def tiny(**overrides) -> ModelArchitecture:
    fields = {"family": "qwen3", "num_layers": 4, "hidden_size": 8, "ffn_hidden_size": 12, "num_attention_heads": 4,
              "num_query_groups": 2, "kv_channels": 2, "vocab_size": 10, "tie_word_embeddings": True,
              "qk_layernorm": True}
    return ModelArchitecture(**{**fields, **overrides})


def test_even_stage_layout_and_global_names() -> None:
    assert even_stage_layout(4, 2, 0) == StageLayout(layer_offset=0, num_layers=2, first=True, last=False)
    assert even_stage_layout(4, 2, 1) == StageLayout(layer_offset=2, num_layers=2, first=False, last=True)
    assert even_stage_layout(6, 3, 1).layer_offset == 2
    with pytest.raises(ValueError, match="does not divide"):
        even_stage_layout(5, 2, 0)
    assert global_name("decoder.layers.1.mlp.linear_fc1.weight", 2) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert global_name("decoder.final_layernorm.weight", 2) == "decoder.final_layernorm.weight"
    assert global_name("embedding.word_embeddings.weight", 0) == "embedding.word_embeddings.weight"


@pytest.mark.parametrize("tied", [True, False])
def test_stages_partition_the_name_map(tied: bool) -> None:
    a = tiny(tie_word_embeddings=tied)
    stages = [stage_name_map(a, even_stage_layout(4, 2, r)) for r in range(2)]
    assert [n for s in stages for n, _ in s] == [n for n, _ in hf_mapping.name_map(a)]  # disjoint, in order
    assert stages[0][0][0] == "embedding.word_embeddings.weight"
    assert {n for n, _ in stages[1]} >= {"decoder.layers.2.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"}
    loading = stage_name_map(a, even_stage_layout(4, 2, 1), with_tied_output=True)
    if tied:  # the last stage's copy of the embedding loads from the HF embedding; it is never exported
        assert loading[-1] == ("output_layer.weight", ["model.embed_tokens.weight"])
    else:
        assert loading == stages[1] and loading[-1] == ("output_layer.weight", ["lm_head.weight"])
    whole = stage_name_map(a, StageLayout.whole(4), with_tied_output=True)
    assert whole == hf_mapping.name_map(a)  # PP=1: the tied embedding is the output layer itself


def test_the_simulator_catches_a_deadlock() -> None:
    """Neighbours that each wait for the other to receive first (what combined exchanges avoid)."""
    from hpc_rl.training.pipeline import Transfer

    stage0 = [Compute("forward", 0), Exchange((Transfer("send_forward", 0),)), Compute("forward", 1),
              Exchange((Transfer("recv_backward", 0),)), Exchange((Transfer("send_forward", 1),))]
    stage1 = [Exchange((Transfer("recv_forward", 0),)), Compute("forward", 0), Compute("backward", 0),
              Exchange((Transfer("recv_forward", 1),)), Exchange((Transfer("send_backward", 0),))]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate([stage0, stage1])
