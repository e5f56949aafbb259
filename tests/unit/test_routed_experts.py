"""Rollout routing replay, the pure parts: the engines' routed experts from an answer to the trainer's
micro-batches (SGLang's encoding, the sample, partial rollouts and checkpoints, batched requests, the
controller's packing, the trainer's batch, router token order and replay targets), its validation
rules and its engine flag. A fake SGLang engine (`FakeRoutingEngine`, in this file) stands in for one."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp import web

from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.rollout import SFT_ROLLOUT
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.routed_experts import compact_expert_ids, routing_from_json, routing_to_json
from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.engines.sglang_launch import ROUTED_EXPERTS_FLAG, SglangLaunchSpec, build_sglang_command
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory
from hpc_rl.rollout.generate import GenerationSession, RunEndingGenerationError, generate_turn
from hpc_rl.rollout.partial_buffer import PartialRolloutBuffer, reset_sample
from hpc_rl.rollout.request_batching import batchable, merge_payloads
from hpc_rl.rollout.routed_experts import RoutedExpertsError, RoutingShape, routed_experts_from_answer
from hpc_rl.training.train_batch import TrainBatch
from tests.unit.test_rollout_fake_engine import FakeSglangEngine

SHAPE = RoutingShape(num_layers=3, topk=2)
NUM_EXPERTS = 8


def engine_ids(sequence_length: int, salt: int = 0) -> np.ndarray:
    """What the fake engine routes token p of layer l to: distinct ids, a function of the position."""
    rows = max(0, sequence_length - 1)
    position = np.arange(rows)[:, None, None]
    layer = np.arange(SHAPE.num_layers)[None, :, None]
    choice = np.arange(SHAPE.topk)[None, None, :]
    return ((position * 3 + layer + choice * 5 + salt) % NUM_EXPERTS).astype(np.int32)


def encode(ids: np.ndarray) -> str:
    return base64.b64encode(ids.astype("<i4").tobytes()).decode("ascii")


class FakeRoutingEngine(FakeSglangEngine):
    """`FakeSglangEngine` launched with --enable-return-routed-experts (`routing=False`: without it):
    answers carry `engine_ids(prompt + output tokens)` when the request asks; it keeps each body."""

    def __init__(self, *, routing: bool = True, salt: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.routing, self.salt = routing, salt
        self.bodies: list[dict[str, Any]] = []

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        response = await super()._generate(request)
        if not (self.routing and body.get("return_routed_experts")) or response.status != 200:
            return response
        import json

        answers = json.loads(response.body)
        batched = isinstance(answers, list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        for answer, prompt in zip(answers if batched else [answers], prompts):
            answer["meta_info"]["routed_experts"] = encode(
                engine_ids(len(prompt) + len(answer["output_ids"]), self.salt))
        return web.json_response(answers)


async def run_with_engine(engine: FakeRoutingEngine, body: Any) -> None:
    await engine.start()
    client = EngineClient(StaticEngineDirectory([engine.url]), per_engine_concurrency=8)
    try:
        async with client:
            await body(client)
    finally:
        await engine.stop()


# ---------------------------------------------------------------------------------------- the sample's array

def test_compact_dtype_holds_the_ids_and_refuses_negative_ones() -> None:
    assert compact_expert_ids(np.array([0, 255], dtype=np.int32)).dtype == np.uint8
    assert compact_expert_ids(np.array([0, 256], dtype=np.int32)).dtype == np.int16
    assert compact_expert_ids(np.array([40_000], dtype=np.int64)).dtype == np.int32
    assert compact_expert_ids(np.array([255, 3], dtype=np.int32)).tolist() == [255, 3]
    with pytest.raises(ValueError, match=">= 0"):
        compact_expert_ids(np.array([-1, 2]))


def test_answer_decoding_follows_sglang_and_checks_the_shape() -> None:
    ids = engine_ids(6)
    routing = routed_experts_from_answer({"routed_experts": encode(ids)}, shape=SHAPE, sequence_length=6)
    assert routing.shape == (5, 3, 2) and routing.dtype == np.uint8 and (routing == ids).all()
    as_list = routed_experts_from_answer({"routed_experts": ids.tolist()}, shape=SHAPE, sequence_length=6)
    assert (as_list == ids).all()
    assert routed_experts_from_answer({}, shape=SHAPE, sequence_length=6) is None
    with pytest.raises(RoutedExpertsError, match=r"30 ids, expected 36 = \(7 tokens - 1\) x 3 layers x top-2"):
        routed_experts_from_answer({"routed_experts": encode(ids)}, shape=SHAPE, sequence_length=7)
    with pytest.raises(RoutedExpertsError, match="not base64"):
        routed_experts_from_answer({"routed_experts": "not base64!"}, shape=SHAPE, sequence_length=6)


def test_sample_checkpoint_keeps_routing_and_a_reset_drops_it() -> None:
    sample = Sample(index=3, group_index=1, prompt="p", prompt_token_ids=[1, 2], response_token_ids=[5, 6, 7],
                    routed_experts=compact_expert_ids(engine_ids(5)), status=SampleStatus.COMPLETED)
    buffer = PartialRolloutBuffer()
    buffer.add([[sample]], rollout_id=0)
    restored = PartialRolloutBuffer()
    import json

    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    back = restored.groups[0][0]
    assert back.routed_experts.dtype == np.uint8 and (back.routed_experts == engine_ids(5)).all()
    assert routing_from_json(routing_to_json(back.routed_experts)).shape == (4, 3, 2)
    reset_sample(back)
    assert back.routed_experts is None and back.to_dict()["routed_experts"] is None


# ---------------------------------------------------------------------------------------- requests

def test_batched_requests_ask_once_for_the_whole_batch() -> None:
    asks = {"rid": "a", "input_ids": [1, 2], "sampling_params": {}, "return_logprob": True,
            "return_routed_experts": True}
    assert batchable(asks)
    merged = merge_payloads([asks, {**asks, "rid": "b"}])
    assert merged["return_routed_experts"] is True and merged["rid"] == ["a", "b"]
    plain = {k: v for k, v in asks.items() if k != "return_routed_experts"}
    assert "return_routed_experts" not in merge_payloads([plain, {**plain, "rid": "b"}])


def test_generation_asks_keeps_the_last_answers_routing_and_refuses_an_engine_without_it() -> None:
    async def body(client: EngineClient) -> None:
        session = GenerationSession(client, routed_experts=SHAPE)
        sample = Sample(index=0, group_index=0, prompt="p", prompt_token_ids=[10, 11, 12])
        await generate_turn(sample, {"max_new_tokens": 2}, session=session)
        assert engine.bodies[-1]["return_routed_experts"] is True
        assert sample.status is SampleStatus.TRUNCATED and sample.routed_experts.shape == (4, 3, 2)
        assert (sample.routed_experts == engine_ids(5)).all()
        # a resumed sample: the new answer covers prompt + old and new tokens, and replaces the old rows
        engine.salt = 1
        await generate_turn(sample, {"max_new_tokens": 4}, session=session)
        assert sample.total_length == 7 and (sample.routed_experts == engine_ids(7, salt=1)).all()
        no_routing = GenerationSession(client)
        other = Sample(index=1, group_index=0, prompt="p", prompt_token_ids=[10, 11])
        await generate_turn(other, {"max_new_tokens": 2}, session=no_routing)
        assert "return_routed_experts" not in engine.bodies[-1] and other.routed_experts is None
        engine.routing = False
        with pytest.raises(RunEndingGenerationError, match="--enable-return-routed-experts"):
            await generate_turn(Sample(index=2, group_index=0, prompt="p", prompt_token_ids=[10]),
                                {"max_new_tokens": 2}, session=session)
        with pytest.raises(RunEndingGenerationError, match="sample 3: meta_info.routed_experts has"):
            wrong = GenerationSession(client, routed_experts=RoutingShape(num_layers=4, topk=2))
            engine.routing = True
            await generate_turn(Sample(index=3, group_index=0, prompt="p", prompt_token_ids=[10]),
                                {"max_new_tokens": 2}, session=wrong)

    engine = FakeRoutingEngine()
    asyncio.run(run_with_engine(engine, body))


# ---------------------------------------------------------------------------------------- to the trainer

def routed_sample(index: int, prompt: list[int], response: list[int], salt: int = 0) -> Sample:
    tokens = len(prompt) + len(response)
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=prompt, response_token_ids=response,
                  response_logprobs=[-0.1] * len(response), weight_versions=[0] * len(response),
                  routed_experts=compact_expert_ids(engine_ids(tokens, salt)))


def test_controller_packing_reaches_the_trainer_per_sample() -> None:
    samples = [routed_sample(0, [1, 2, 3], [4, 5]), routed_sample(1, [6], [7, 8, 9], salt=2)]
    arrays = pack_samples(samples, [0.5, -0.5])
    assert arrays["routed_experts"].dtype == np.uint8 and arrays["routed_experts"].shape == (4 + 3, 3, 2)
    assert arrays["routed_expert_rows"].tolist() == [4, 3]
    batch = TrainBatch.from_arrays(arrays)
    assert [r.shape for r in batch.routed_experts] == [(4, 3, 2), (3, 3, 2)]
    assert (batch.routed_experts[1] == engine_ids(4, salt=2)).all()
    again = TrainBatch.from_arrays(batch.select([1, 0]).to_arrays())
    assert (again.routed_experts[0] == engine_ids(4, salt=2)).all()
    assert "routed_experts" not in pack_samples([dataclasses.replace(s, routed_experts=None) for s in samples],
                                                [0.0, 0.0])
    with pytest.raises(ValueError, match=r"samples \[1\] have no routed experts"):
        pack_samples([samples[0], dataclasses.replace(samples[1], routed_experts=None)], [0.0, 0.0])
    rows = TrainBatch.from_rows([{"tokens": [1, 2, 3], "response_length": 1, "reward": 1.0,
                                  "routed_experts": engine_ids(3).tolist()}])
    assert rows.routed_experts[0].dtype == np.uint8 and rows.routed_experts[0].shape == (2, 3, 2)
    with pytest.raises(ValueError, match="sample 0: routed experts of shape"):
        TrainBatch(tokens=[[1, 2]], response_lengths=[1], loss_masks=[[1]], rewards=[0.0],
                   routed_experts=[np.zeros((3, 3, 2), np.uint8)])


# ---------------------------------------------------------------------------------------- config and launch

def routing_config(tmp_path, **training: Any) -> RunConfig:
    from hpc_rl.config.model import ModelArchitecture

    arch = ModelArchitecture.from_yaml("configs/models/tiny_qwen3.yaml")
    moe = dataclasses.replace(arch, family="qwen3_moe", num_moe_experts=4, moe_ffn_hidden_size=16)
    return RunConfig(model_args=moe, training=TrainingConfig(**training), run_dir=str(tmp_path))


def test_validation_names_what_replay_cannot_do(tmp_path, in_repo) -> None:
    from hpc_rl.config.moe_checks import routing_replay_problems as _routing_replay_problems

    assert _routing_replay_problems(routing_config(tmp_path, use_rollout_routing_replay=True)) == []
    problems = _routing_replay_problems(routing_config(
        tmp_path, use_rollout_routing_replay=True, moe_expert_capacity_factor=1.0,
        moe_router_load_balancing_type="sinkhorn"))
    assert [(p.field, p.code) for p in problems] == [("training.use_rollout_routing_replay", "unsupported"),
                                                     ("training.moe_expert_capacity_factor", "unsupported")]
    sft = routing_config(tmp_path, use_rollout_routing_replay=True)
    sft.rollout.rollout_function_path = SFT_ROLLOUT  # no engine routes the data's chats
    assert [p.where for p in _routing_replay_problems(sft)] == ["training.use_rollout_routing_replay"]
    sft.training.use_rollout_routing_replay, sft.training.use_routing_replay = False, True
    assert _routing_replay_problems(sft) == []


def test_engines_are_launched_to_return_routed_experts(tmp_path, in_repo) -> None:
    from hpc_rl.launch.step_plan import engine_command
    from hpc_rl.launch.topology import EnginePlacement

    spec = SglangLaunchSpec(hf_checkpoint="/m", host="h", port=1, return_routed_experts=True)
    assert build_sglang_command(spec).count(ROUTED_EXPERTS_FLAG) == 1
    assert ROUTED_EXPERTS_FLAG not in build_sglang_command(dataclasses.replace(spec, return_routed_experts=False))
    placement = EnginePlacement(engine_index=0, het_group=0, node_index=0, gpu_ids=(0,), port=1234,
                                weight_group_rank_offset=1)
    for device in ("cpu", "cuda"):  # the CPU engine's command and sglang.launch_server's
        config = routing_config(tmp_path, use_rollout_routing_replay=True)
        config.cluster.device = device
        assert engine_command(config, placement, "127.0.0.1", 1234).count(ROUTED_EXPERTS_FLAG) == 1, device
        config.training.use_rollout_routing_replay = False
        assert ROUTED_EXPERTS_FLAG not in engine_command(config, placement, "127.0.0.1", 1234), device


# ---------------------------------------------------------------------------------------- router token order

def test_router_order_of_padded_packed_context_and_sequence_parallel_micro_batches() -> None:
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.router_tokens import router_tokens

    tokens = [[1, 2, 3], [4, 5]]
    padded = router_tokens(build_microbatch(tokens, [1, 1], [7, 9], qkv_format="bshd"))
    # [s, b] position-major: (p0 s0) (p0 s1) (p1 s0) (p1 s1) (p2 s0) (p2 pad)
    assert padded.sample.tolist() == [0, 1, 0, 1, 0, -1] and padded.position.tolist() == [0, 0, 1, 1, 2, 0]
    packed = router_tokens(build_microbatch(tokens, [1, 1], [7, 9], qkv_format="thd", pad_multiple=2))
    assert packed.sample.tolist() == [0, 0, 0, 1, 1, -1] and packed.position.tolist() == [0, 1, 2, 0, 1, 0]
    halves = [router_tokens(build_microbatch(tokens, [1, 1], [7, 9], qkv_format="thd", pad_multiple=2),
                            sp_size=2, sp_rank=rank) for rank in (0, 1)]
    assert [h.sample.tolist() for h in halves] == [[0, 0, 0], [1, 1, -1]]
    sp_padded = router_tokens(build_microbatch(tokens, [1, 1], [7, 9], qkv_format="bshd", pad_multiple=2),
                              sp_size=2, sp_rank=1)
    assert sp_padded.sample.tolist() == [0, -1, -1, -1] and sp_padded.position.tolist() == [2, 0, 0, 0]


def test_router_order_under_context_parallel_follows_the_cp_chunks() -> None:
    from hpc_rl.training.context_parallel import split_packed
    from hpc_rl.training.micro_batches import MicroBatch
    from hpc_rl.training.router_tokens import router_tokens

    lengths = [5, 3]
    for rank in (0, 1):
        split = split_packed(lengths, 2, rank)
        micro = MicroBatch(indices=[0, 1], total_lengths=lengths, response_lengths=[1, 1],
                           tokens=torch.zeros(1, len(split.rows), dtype=torch.long),
                           position_ids=torch.zeros(1, len(split.rows), dtype=torch.long), attention_mask=None,
                           packed_seq_params=object(), starts=split.starts[:2], context_parallel=split)
        order = router_tokens(micro)
        # sample 0 is padded to 8 (chunks of 2), sample 1 to 4 (chunks of 1): rank r holds chunks r and 3-r
        expected = {0: ([0, 0, -1, -1, 1, -1], [0, 1, 0, 0, 0, 0]), 1: ([0, 0, 0, -1, 1, 1], [2, 3, 4, 0, 1, 2])}
        assert (order.sample.tolist(), order.position.tolist()) == expected[rank], rank


# ---------------------------------------------------------------------------------------- replay targets

def test_replay_targets_take_each_tokens_row_and_fill_the_rest() -> None:
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.router_tokens import router_tokens
    from hpc_rl.training.routing_replay import filler_experts, replay_targets

    tokens = [[1, 2, 3, 4], [5, 6]]
    micro = build_microbatch(tokens, [2, 1], [0, 1], qkv_format="bshd")
    order = router_tokens(micro)
    routing = [compact_expert_ids(engine_ids(4)), compact_expert_ids(engine_ids(2, salt=1))]
    targets, recorded = replay_targets(order, routing, [2, 0], num_experts=NUM_EXPERTS, topk=2)
    assert targets.shape == (2, 8, 2) and targets.dtype == torch.long
    filler = filler_experts(8, 2, NUM_EXPERTS)
    for entry, (slot, position) in enumerate(zip(order.sample.tolist(), order.position.tolist())):
        has_row = slot >= 0 and position < len(routing[slot])
        assert bool(recorded[entry]) == has_row
        for index, layer in enumerate([2, 0]):
            expected = routing[slot][position, layer] if has_row else filler[entry]
            assert targets[index, entry].tolist() == list(expected), (entry, layer)
    assert all(len(set(row.tolist())) == 2 for row in filler)


def test_trained_tokens_must_be_covered_by_the_engines_rows() -> None:
    from hpc_rl.training.routing_replay import check_routed_experts

    def batch(rows: int, mask: list[int]) -> TrainBatch:
        return TrainBatch(tokens=[[1, 2, 3, 4, 5]], response_lengths=[3], loss_masks=[mask], rewards=[0.0],
                          routed_experts=[np.zeros((rows, 3, 2), np.uint8)])

    check_routed_experts(batch(4, [1, 1, 1]), num_layers=3, topk=2)  # SGLang's seqlen - 1 rows
    check_routed_experts(batch(3, [1, 1, 0]), num_layers=3, topk=2)  # the untrained last token needs no row
    with pytest.raises(ValueError, match="cover its first 3 tokens, but its trained tokens depend on the first 4"):
        check_routed_experts(batch(3, [1, 0, 1]), num_layers=3, topk=2)
    with pytest.raises(ValueError, match=r"expected \[rows, 4, 2\]"):
        check_routed_experts(batch(4, [1, 1, 1]), num_layers=4, topk=2)
    with pytest.raises(ValueError, match="carries no routed experts"):
        check_routed_experts(TrainBatch(tokens=[[1, 2]], response_lengths=[1], loss_masks=[[1]], rewards=[0.0]),
                             num_layers=3, topk=2)


def test_aux_loss_names_follow_megatrons_types() -> None:
    from hpc_rl.training.router_health import layer_suffix, tracked_aux_losses

    assert tracked_aux_losses("aux_loss", 1e-3) == ["load_balancing_loss"]
    assert tracked_aux_losses("aux_loss", 0.0) == []
    assert tracked_aux_losses(["seq_aux_loss", "global_aux_loss"], [0.1, 0.0]) == ["seq_load_balancing_loss"]
    assert tracked_aux_losses("sinkhorn", 0.0) == [] and tracked_aux_losses("none", 1.0) == []
    assert [layer_suffix(i, 48) for i in (0, 47)] == ["layer_00", "layer_47"] and layer_suffix(3, 4) == "layer_3"
