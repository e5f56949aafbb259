"""In-place weight updates (issue 34 item 1; slime's --flush-cache-interval): the CPU engine keeps a request paused
in place in its running batch with its KV cache, refuses a flush meanwhile, and finishes the request across a
weight update with tokens of both versions; the controller pauses in place and flushes every N-th sync (fakes of
the engines' admin calls and of trainer rank 0); the flag's rules."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import Qwen3Config, Qwen3ForCausalLM

from hpc_rl.config.sections.cluster import ClusterConfig, ControllerConfig
from hpc_rl.config.sections.rollout import RolloutConfig
from hpc_rl.controller.engine_admin import BucketUpdate
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.weight_updates import WeightSyncSettings, WeightUpdates
from hpc_rl.engines.cpu.requests import GenerationRequest
from hpc_rl.engines.cpu.sampling import make_generator, parse_sampling_params
from hpc_rl.engines.cpu.scheduler import EngineStateError, Scheduler
from hpc_rl.engines.cpu.server import EngineServer, ServerInfo
from hpc_rl.engines.cpu.weight_sync import load_named
from hpc_rl.tiny_model import TINY_VOCAB, build_tokenizer
from tests.unit.test_weight_sync_recovery import RecordingFleet, trainer_rank0

EOS = TINY_VOCAB.index("<|im_end|>")
PROMPT = [7, 8, 9]
LENGTH = 12
BEFORE = 5
"""Tokens generated with v0 before the pause: the first scheduler step prefills, samples one token and decodes the
next, every later step decodes one."""


def generate_before_pause(scheduler: Scheduler) -> None:
    for _ in range(BEFORE - 1):
        scheduler.run_iteration()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(TINY_VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=2)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def seeded_request(rid: str) -> GenerationRequest:
    params = parse_sampling_params({"max_new_tokens": LENGTH, "ignore_eos": True, "sampling_seed": 3})
    return GenerationRequest(rid=rid, input_ids=list(PROMPT), params=params, return_logprob=True,
                             generator=make_generator(params))


def drive(scheduler: Scheduler, future, max_iterations: int = 200) -> dict:
    for _ in range(max_iterations):
        if future.done():
            return future.result()
        scheduler.run_iteration()
    raise AssertionError("the request did not finish")


def test_a_request_paused_in_place_finishes_across_the_update_with_both_versions(model, tokenizer) -> None:
    scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="0")
    future = scheduler.submit(seeded_request("r"))
    generate_before_pause(scheduler)
    request = scheduler._running[0]
    assert len(request.output_ids) == BEFORE
    before, batch = list(request.output_ids), scheduler._batch

    scheduler.pause("in_place")
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0 and scheduler._batch is batch  # KV kept
    assert not scheduler.run_iteration() and len(request.output_ids) == BEFORE  # nothing runs while paused
    with pytest.raises(EngineStateError, match="Flush cache failed"):
        scheduler.flush_cache()
    with pytest.raises(EngineStateError, match="paused in place"):
        scheduler.check_flush(True)  # a weight update that asks for a flush: SGLang's assert fails
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in new_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    scheduler.check_flush(False)
    load_named(model, list(new_model.state_dict().items()))  # what /update_weights_from_distributed does
    scheduler.weight_version = "1"
    scheduler.resume_generation()
    response = drive(scheduler, future)

    output = response["output_ids"]
    assert len(output) == LENGTH and output[:BEFORE] == before  # none lost or repeated
    assert response["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": BEFORE},
                                                        {"version": "1", "start": BEFORE, "end": LENGTH}]
    assert [entry[1] for entry in response["meta_info"]["output_token_logprobs"]] == output
    assert request.num_retractions == 0 and scheduler.num_running == 0
    scheduler.flush_cache()  # the batch drained: the flush succeeds now


def test_in_place_keeps_the_old_kv_cache_where_retract_recomputes_it(model, tokenizer) -> None:
    """The difference between the modes, read from the tokens' log-probs after the update: retract re-prefills
    the context with the new weights (its log-probs are the new model's exactly), in place decodes on the KV
    cache the old weights wrote (its first new log-prob differs from the new model's)."""
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in new_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    first_new_logprob = {}
    for mode in ("retract", "in_place"):
        engine_model = copy.deepcopy(model)
        scheduler = Scheduler(engine_model, tokenizer, max_running_requests=4, context_length=256, weight_version="0")
        future = scheduler.submit(seeded_request(mode))
        generate_before_pause(scheduler)
        scheduler.pause(mode)
        load_named(engine_model, list(new_model.state_dict().items()))
        scheduler.weight_version = "1"
        scheduler.resume_generation()
        response = drive(scheduler, future)
        output = response["output_ids"]
        with torch.no_grad():
            logits = new_model(torch.tensor([PROMPT + output])).logits[0].float()
        reference = torch.log_softmax(logits[len(PROMPT) - 1 + BEFORE], -1)[output[BEFORE]].item()
        first_new_logprob[mode] = (response["meta_info"]["output_token_logprobs"][BEFORE][0], reference)
        assert response["meta_info"]["weight_versions"][-1] == {"version": "1", "start": BEFORE, "end": LENGTH}
    got, reference = first_new_logprob["retract"]
    assert abs(got - reference) < 1e-4
    got, reference = first_new_logprob["in_place"]
    assert abs(got - reference) > 1e-3


def test_http_in_place_pause_refuses_flushes_until_the_request_finishes(model, tokenizer, tmp_path) -> None:
    """Over the engine's HTTP API, the request held by the engine (paused in place before the thread runs, so
    no race decides where it is): /flush_cache and a disk update (which always flushes) are refused, a version
    change without an abort goes through, and on continue the request ends with both versions."""
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)

    async def scenario() -> None:
        scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="0")
        future = scheduler.submit(seeded_request("h"))
        generate_before_pause(scheduler)
        scheduler.pause("in_place")
        scheduler.start()
        info = ServerInfo(model_path="/m", host="127.0.0.1", port=1, api_key=None, max_running_requests=4,
                          context_length=256)
        client = TestClient(TestServer(EngineServer(scheduler, info).build_app()))
        await client.start_server()
        try:
            paused = await client.post("/pause_generation", json={"mode": "in_place"})
            assert paused.status == 200
            flush = await client.post("/flush_cache", json={})
            assert flush.status == 400 and "Flush cache failed" in await flush.text()
            disk = await client.post("/update_weights_from_disk", json={"model_path": str(checkpoint),
                                                                        "weight_version": "9"})
            assert disk.status == 400 and "paused in place" in await disk.text()
            version = await client.post("/update_weight_version", json={"new_version": "1",
                                                                        "abort_all_requests": False})
            assert version.status == 200
            assert (await client.post("/continue_generation", json={})).status == 200
            response = await asyncio.wrap_future(future)
            assert len(response["output_ids"]) == LENGTH
            assert response["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": BEFORE},
                                                                {"version": "1", "start": BEFORE, "end": LENGTH}]
            assert (await client.post("/flush_cache", json={})).status == 200
        finally:
            await client.close()
            scheduler.stop()

    asyncio.run(scenario())


class RecordingAdmin:
    """A fake of EngineAdmin that records the pause modes and each bucket's flush_cache."""

    def __init__(self, url: str, calls: list[str]) -> None:
        self.url, self.calls = url, calls

    async def pause(self, mode: str = "retract") -> None:
        self.calls.append(f"{self.url} pause {mode}")

    async def resume_generation(self) -> None:
        self.calls.append(f"{self.url} continue")

    async def init_weight_group(self, **kwargs: object) -> None:
        pass

    async def destroy_weight_group(self, group_name: str) -> None:
        pass

    async def weight_update(self, buckets: list[BucketUpdate], *, gate: object = None) -> None:
        flushes = {json.loads(bucket.body)["flush_cache"] for bucket in buckets}
        self.calls.append(f"{self.url} update flush_cache={flushes.pop()}" if len(flushes) == 1 else "mixed")


def in_place_weight_updates(interval: int, calls: list[str]) -> tuple[WeightUpdates, TrainerChannel]:
    registry = Registry(trainer_world_size=1, num_engines=2)
    for index in range(2):
        registry.add_engine(EngineInfo(engine_index=index, url=f"e{index}", state=EngineState.SERVING))
    admins = {index: RecordingAdmin(f"e{index}", calls) for index in range(2)}
    fleet = RecordingFleet(registry, admins)  # type: ignore[arg-type]
    channel = TrainerChannel(1)
    settings = WeightSyncSettings.from_sections(
        ClusterConfig(device="cpu", rollout_num_gpus=2),
        RolloutConfig(async_rollout=True, flush_cache_interval=interval), ControllerConfig())
    weights = WeightUpdates(settings, registry=registry, fleet=fleet, channel=channel,  # type: ignore[arg-type]
                            engines_serve=lambda version: None, num_rollout=10)
    return weights, channel


@pytest.mark.parametrize("interval, flushed", [(1, [1, 2, 3, 4, 5, 6, 7, 8]), (0, []), (4, [4, 8]),
                                               (3, [3, 6])])
def test_every_nth_sync_flushes_the_others_pause_in_place(interval: int, flushed: list[int]) -> None:
    async def scenario() -> None:
        calls: list[str] = []
        weights, channel = in_place_weight_updates(interval, calls)
        assert weights.in_place == (interval != 1)
        trainer = asyncio.create_task(trainer_rank0(channel, []))
        seen: list[int] = []
        for version in range(1, 9):
            calls.clear()
            metrics = await weights.sync(version, generating=True)
            flush = version in flushed
            mode, flag = ("retract", True) if flush else ("in_place", False)
            assert sorted(calls) == sorted([f"e{i} {call}" for i in (0, 1) for call in (
                f"pause {mode}", f"update flush_cache={flag}", "continue")]), calls
            for engine in ("e0", "e1"):  # each engine: paused, updated, continued, in that order
                assert [c for c in calls if c.startswith(engine)] == [
                    f"{engine} pause {mode}", f"{engine} update flush_cache={flag}", f"{engine} continue"]
            if interval != 1:
                assert metrics["weight_sync/flushed_cache"] == float(flush)
            if flush:
                seen.append(version)
        trainer.cancel()
        assert seen == flushed and weights.flushes == len(flushed) and weights.pushes == 8

    asyncio.run(scenario())


def test_a_transport_that_always_flushes_never_pauses_in_place() -> None:
    """SGLang's disk (and tensor) update flushes whatever it is asked: such a sync retracts, never in place."""
    settings = WeightSyncSettings.from_sections(
        ClusterConfig(device="cpu", rollout_num_gpus=1),
        RolloutConfig(async_rollout=True, flush_cache_interval=0, update_weight_transport="disk",
                      update_weight_disk_dir="/unused"), ControllerConfig())
    registry = Registry(trainer_world_size=1, num_engines=1)
    weights = WeightUpdates(settings, registry=registry, fleet=RecordingFleet(registry, {}),  # type: ignore[arg-type]
                            channel=TrainerChannel(1), engines_serve=lambda version: None, num_rollout=10)
    assert weights.transport.name == "disk" and not weights.transport.keeps_cache
    assert weights.flush_due()


@pytest.mark.parametrize("rollout, cluster, problem", [
    ({"flush_cache_interval": 4}, {}, "--async-rollout"),
    ({"flush_cache_interval": 4, "async_rollout": True}, {"colocate": True}, "--colocate"),
    ({"flush_cache_interval": 0, "async_rollout": True, "update_weight_transport": "disk",
      "update_weight_disk_dir": "/tmp/x"}, {}, "always flushes"),
    ({"flush_cache_interval": -1, "async_rollout": True}, {}, "negative"),
    ({"flush_cache_interval": 4, "async_rollout": True}, {}, None),
    ({"flush_cache_interval": 1}, {"colocate": True}, None),
])
def test_flush_cache_interval_rules(rollout: dict, cluster: dict, problem: str | None) -> None:
    from hpc_rl.config.schema import RunConfig
    from hpc_rl.config.slime_flag_checks import flush_cache_interval_problems

    config = RunConfig(rollout=RolloutConfig(**rollout), cluster=ClusterConfig(**cluster))
    problems = flush_cache_interval_problems(config)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].where == "rollout.flush_cache_interval"
        assert problem in problems[0].message
