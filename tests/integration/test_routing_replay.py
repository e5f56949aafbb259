"""Routing replay on real gloo ranks with Megatron's MoE layer (tiny Qwen3-MoE: a dense layer, then 3 MoE
layers of 8 experts, top-2).

One pair of processes walks the parallel layouts DP2, EP2 (token-packed micro-batches), TP2 with sequence
parallel, CP2 and PP2 (padded micro-batches, 1F1B over 3 of them). In the first, each router's own choice is recorded per micro-batch and laid back
out per sample (the "engine's" routing, [tokens - 1, layers, topk] as SGLang returns it). In every layout
the actor then replays (a) that routing: the log-probs equal the unreplayed ones, so every token's record
reached its own token; (b) the same routing with every expert id shifted by one: the log-probs change,
and equal the DP2 layout's under the same shifted routing, so the layouts agree token by token.
Then, at EP2, training steps: with rollout routing replay the reference model keeps its own routing (the
KL to it is > 0 under the shifted routing, 0 under the natural one), the step's router metrics say the
replayed routing was used for every token and how often the trainer would have chosen it itself; with
`use_routing_replay` and two steps per rollout, the old-log-prob pass's record is what both steps use (with
the engines' log-probs as the old ones, a pass that only records);
with a capacity factor and an aux loss (no replay), the dropped fraction and the aux loss per layer.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
NUM_EXPERTS, TOPK, NUM_LAYERS = 8, 2, 4
TINY_QWEN3 = Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml"
LAYOUTS = {"dp2": {}, "ep2": {"expert_model_parallel_size": 2, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 20},
           "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "cp2": {"context_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2, "qkv_format": "bshd"}}
"""Packed micro-batches of 2 samples unless said: EP2 packs by tokens (dynamic batch size), PP2 pads (bshd)."""


def moe_arch():
    """The architecture of `make_tiny_moe_model(TinyMoeSpec(num_hidden_layers=4, dense_layers=1, num_experts=8))`."""
    from hpc_rl.config.model import ModelArchitecture

    return dataclasses.replace(ModelArchitecture.from_yaml(TINY_QWEN3), family="qwen3_moe", num_layers=NUM_LAYERS,
                               num_moe_experts=NUM_EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=TOPK,
                               moe_layer_freq=[0, 1, 1, 1], tie_word_embeddings=False)


def make_batch():
    from hpc_rl.training.train_batch import TrainBatch

    rng = random.Random(3)
    tokens, responses = [], []
    for _ in range(6):
        prompt, response = rng.randint(3, 7), rng.randint(2, 5)
        tokens.append([rng.randrange(24) for _ in range(prompt + response)])
        responses.append(response)
    return TrainBatch(tokens=tokens, response_lengths=responses, loss_masks=[[1] * r for r in responses],
                      rewards=[rng.gauss(0, 1) for _ in tokens], rollout_logprobs=[[-1.0] * r for r in responses])


def build(hf_dir: str, *, kl: bool = False, rollout_logprobs: bool = False, **training_fields):
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel

    training = TrainingConfig(**{"qkv_format": "thd", "micro_batch_size": 2, "global_batch_size": 6,
                                 "moe_token_dispatcher_type": "alltoall", "use_rollout_routing_replay": True,
                                 **training_fields})
    info = init_parallel(training, device="cpu")
    algorithm = AlgorithmConfig(use_kl_loss=kl, kl_loss_coef=0.1 if kl else 0.0, kl_loss_type="low_var_kl",
                                eps_clip=0.2, use_rollout_logprobs=rollout_logprobs)
    parts = build_trainer(arch=moe_arch(), training=training, algorithm=algorithm,
                          optimizer_config=OptimizerConfig(lr=0.05, lr_warmup_iters=0, clip_grad=0.0),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir), info=info)
    return parts, info


def share(batch, info):
    """This DP rank's samples and their indices in the whole batch."""
    size = len(batch) // info.dp_size
    indices = list(range(info.dp_rank * size, (info.dp_rank + 1) * size))
    return batch.select(indices), indices


def recorded_tables(trainer, micros, indices: list[int]) -> dict[int, np.ndarray]:
    """The routing the old-log-prob pass recorded, back per sample: [tokens, layers, topk] (dense layer 0s)."""
    from hpc_rl.training.router_tokens import router_tokens

    replay = trainer.moe.replay
    with replay.recording() as hooks:
        trainer._logprobs(trainer.actor, micros, hooks=hooks)
    tables = {}
    for micro in micros:
        record = replay._recorded[id(micro)]
        order = router_tokens(micro)
        for entry, (slot, position) in enumerate(zip(order.sample.tolist(), order.position.tolist())):
            if slot >= 0:
                table = tables.setdefault(indices[micro.indices[slot]], np.zeros(
                    (micro.total_lengths[slot], NUM_LAYERS, TOPK), dtype=np.int64))
                for row, layer in enumerate(replay.layers):
                    table[position, layer] = record[row, entry].numpy()
    replay.forget()
    return tables


def with_routing(batch, tables: dict[int, np.ndarray], indices: list[int]):
    """`batch` with the engine-style routing of each sample (its first tokens - 1 rows)."""
    return dataclasses.replace(batch, routed_experts=[tables[i][:-1].astype(np.uint8) for i in indices])


def layouts_rank(hf_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    batch = make_batch()
    natural_tables: dict[int, np.ndarray] = {}
    out: dict[str, dict] = {}
    for name, layout in LAYOUTS.items():
        parts, info = build(hf_dir, **layout)
        trainer = parts.trainer
        mine, indices = share(batch, info)
        micros = trainer._step_microbatches(mine, range(len(mine)))
        if not natural_tables:
            gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, recorded_tables(trainer, micros, indices))
            natural_tables = {i: t for part in gathered for i, t in part.items()}
        shifted = {i: (t + 1) % NUM_EXPERTS for i, t in natural_tables.items()}
        result: dict[str, dict[int, list[float]]] = {}
        for kind, tables in (("natural", None), ("same", natural_tables), ("shifted", shifted)):
            if tables is None:
                values = trainer._logprobs(trainer.actor, micros)
            else:
                # "same" reads each micro-batch's targets one ahead (the default read-ahead; PP2's 1F1B too), so
                # equal log-probs show every micro-batch got its own; "shifted" builds them at each forward.
                ahead = micros if kind == "same" else None
                assert trainer.moe.replay.prefetch_microbatches == 1
                with trainer.moe.replay.replaying(with_routing(mine, tables, indices), micros=ahead) as hooks:
                    values = trainer._logprobs(trainer.actor, micros, hooks=hooks)
            result[kind] = {indices[i]: v.tolist() for i, v in values.items()}
        out[name] = result
        parallel_state.destroy_model_parallel()
    out["steps"] = training_steps(hf_dir, batch, natural_tables)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def training_steps(hf_dir: str, batch, natural_tables: dict[int, np.ndarray]) -> dict:
    """Router metrics and KL of training steps at EP2 (see the module docstring)."""
    from megatron.core import parallel_state

    shifted = {i: (t + 1) % NUM_EXPERTS for i, t in natural_tables.items()}
    steps = {}
    for kind, tables in (("natural", natural_tables), ("shifted", shifted)):
        parts, info = build(hf_dir, kl=True, expert_model_parallel_size=2)
        mine, indices = share(batch, info)
        steps[kind] = parts.trainer.train_rollout(with_routing(mine, tables, indices))
        parallel_state.destroy_model_parallel()
    for kind, engine_logprobs in (("recorded", False), ("recorded_only", True)):  # old-log-prob pass / none
        parts, info = build(hf_dir, expert_model_parallel_size=2, use_rollout_routing_replay=False,
                            use_routing_replay=True, num_steps_per_rollout=2, global_batch_size=2,
                            rollout_logprobs=engine_logprobs)
        steps[kind] = parts.trainer.train_rollout(share(batch.select(range(4)), info)[0])
        parallel_state.destroy_model_parallel()
    parts, info = build(hf_dir, expert_model_parallel_size=2, use_rollout_routing_replay=False,
                        moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.01)
    steps["capacity"] = parts.trainer.train_rollout(share(batch, info)[0])
    return steps


def test_replay_lays_every_tokens_routing_out_in_every_parallel_layout(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    hf_dir = str(make_tiny_moe_model(tmp_path / "hf", TinyMoeSpec(num_hidden_layers=NUM_LAYERS, dense_layers=1,
                                                                    num_experts=NUM_EXPERTS)))
    ranks = run_ranks(layouts_rank, 2, hf_dir, timeout=600)

    def union(name: str, kind: str) -> dict[int, np.ndarray]:
        return {i: np.array(v) for rank in ranks for i, v in rank[name][kind].items()}

    reference = union("dp2", "shifted")
    assert sorted(reference) == list(range(6))
    for name in LAYOUTS:
        natural, same, shifted = (union(name, kind) for kind in ("natural", "same", "shifted"))
        assert sorted(natural) == sorted(same) == sorted(shifted) == list(range(6)), name
        for i in range(6):
            assert np.abs(same[i] - natural[i]).max() < 1e-5, (name, i)  # every token got its own routing
            assert np.abs(shifted[i] - natural[i]).max() > 1e-3, (name, i)  # the replay is what routes
            assert np.abs(shifted[i] - reference[i]).max() < 1e-5, (name, i)  # ... the same way in every layout

    for rank in ranks:
        natural, shifted = rank["steps"]["natural"][0], rank["steps"]["shifted"][0]
        assert natural["moe/replayed_routing_agreement"] == shifted["moe/replayed_routing_agreement"] == 1.0
        assert natural["moe/routing_agreement"] > 0.99
        # the first MoE layer's input is the same either way: its own choice is never the shifted one; later
        # layers see the shifted layers' outputs and may now and then choose what is replayed
        assert shifted["moe/routing_agreement/layer_1"] == 0.0 and shifted["moe/routing_agreement"] < 0.2
        assert natural["kl_loss"] < 1e-9 and shifted["kl_loss"] > 1e-5  # the reference keeps its own routing
        assert natural["ppo_kl"] == shifted["ppo_kl"] == 0.0
        for layer in (1, 2, 3):
            assert 1.0 <= natural[f"moe/max_over_mean_load/layer_{layer}"] <= NUM_EXPERTS / TOPK
        assert "moe/max_over_mean_load/layer_0" not in natural  # the dense layer
        for kind in ("recorded", "recorded_only"):
            first, second = rank["steps"][kind]
            assert first["moe/replayed_routing_agreement"] == second["moe/replayed_routing_agreement"] == 1.0, kind
            assert first["moe/routing_agreement"] > 0.99, kind  # the record is the routing at these weights
        capacity = rank["steps"]["capacity"][0]  # no replay: no agreement; drops and the aux loss reported
        assert "moe/routing_agreement" not in capacity and "moe/dropped_fraction/layer_0" not in capacity
        assert 0.0 < capacity["moe/dropped_fraction"] < 1.0 and capacity["moe/load_balancing_loss"] > 0.0
        assert all(f"moe/{name}/layer_{layer}" in capacity for name in ("dropped_fraction", "load_balancing_loss")
                   for layer in (1, 2, 3))
