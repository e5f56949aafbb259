"""Integration: 2 CPU engines behind sglang-router on loopback, real processes.

Covers routing of concurrent requests with exact logprobs, workers added/removed at run time,
abort/pause semantics and misuse answers on an engine, and a weight update over gloo from a test
"trainer rank 0" process following SGLang's protocol (pause, init group, begin, update per tensor
and as a flattened bucket, end, continue). Tests share one cluster and run in file order; the
weight update is last because it changes the engines' weights.

Where a check acts on requests that must still be running when its call lands (a pause, an abort), the test
holds the engines first (`held`: their hold gate, `faults.HOLD_GENERATION`, set only in this module's engines),
so no request finishes by length in between, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
import torch

from hpc_rl.engines.cpu.faults import HOLD_GENERATION
from hpc_rl.weights.bucket_layout import order_for_alignment
from hpc_rl.process.child_process import planned_port
from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.engines.router import RouterProcess
from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model
from tests.integration.run_helpers import held

pytestmark = pytest.mark.slow
API_KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def hold_gate(tmp_path_factory) -> Path:
    """The engines' hold gate: while this file exists they decode nothing (`held`)."""
    return tmp_path_factory.mktemp("gate") / "hold"


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory, hold_gate):
    logs = tmp_path_factory.mktemp("logs")
    environment = {**os.environ, HOLD_GENERATION: str(hold_gate)}
    engines = [CpuEngineProcess(model_dir, log_path=logs / f"engine{i}.log", api_key=API_KEY, env=environment)
               for i in range(2)]
    router = RouterProcess(log_path=logs / "router.log", policy="cache_aware", api_key=API_KEY)
    started = []
    try:
        for process in (*engines, router):
            process.start()
            started.append(process)
        router.wait_listening(60)
        for engine in engines:
            engine.wait_healthy(120)
            router.add_worker(engine.url)
        router.wait_ready(30)
        yield engines, router
    finally:
        with ThreadPoolExecutor(len(started) or 1) as pool:  # stop in parallel: each takes ~1-2 s
            list(pool.map(lambda process: process.stop(), started))


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def forward_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]


async def post(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None):
    async with session.post(url, json=body, headers=headers) as response:
        text = await response.text()
        try:
            import json

            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


def generate_body(rid: str, prompt: list[int], max_new_tokens: int, **sampling) -> dict:
    return {"rid": rid, "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, **sampling}}


def test_router_serves_64_concurrent_requests_with_forward_pass_logprobs(cluster, model_dir):
    _, router = cluster
    prompts = [[5 + (i % 7), 12 + (i % 5), 6, 9 + (i % 3)] for i in range(64)]

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            return await asyncio.gather(*[
                post(session, f"{router.url}/generate", generate_body(f"req-{i}", p, 12 + i % 5, ignore_eos=True))
                for i, p in enumerate(prompts)])

    results = asyncio.run(scenario())
    model = load_model(model_dir)
    worst = 0.0
    for i, (status, body) in enumerate(results):
        assert status == 200, body
        output = body["output_ids"]
        assert len(output) == 12 + i % 5 and body["meta_info"]["id"] == f"req-{i}"
        got = [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, forward_logprobs(model, prompts[i], output))))
    assert worst < 1e-4


def test_the_key_is_required_by_engines_and_router_and_the_router_presents_it(cluster):
    """Engines demand the key on /generate as SGLang does; the router demands it of its clients and
    presents it to the workers it was given (POST /workers {"url", "api_key"}), so routed requests pass."""
    engines, router = cluster
    body = generate_body("auth-1", [5, 6], 2, ignore_eos=True)

    async def scenario():
        async with aiohttp.ClientSession() as anonymous:
            assert (await post(anonymous, f"{engines[0].url}/generate", body))[0] == 401
            assert (await post(anonymous, f"{engines[0].url}/pause_generation", {}))[0] == 401
            assert (await post(anonymous, f"{router.url}/generate", body))[0] == 401
            wrong = {"Authorization": "Bearer not-the-key"}
            assert (await post(anonymous, f"{router.url}/generate", body, wrong))[0] == 401
            async with anonymous.get(f"{engines[0].url}/health") as response:
                assert response.status == 200
            status, answer = await post(anonymous, f"{router.url}/generate", body, AUTH)
            assert status == 200 and len(answer["output_ids"]) == 2, answer

    asyncio.run(scenario())
    assert sorted(router.worker_urls()) == sorted(e.url for e in engines)


def test_router_removes_and_adds_workers_at_run_time(cluster):
    engines, router = cluster
    router.remove_worker(engines[1].url)
    assert router.worker_urls() == [engines[0].url]
    router.add_worker(engines[1].url)
    assert sorted(router.worker_urls()) == sorted(e.url for e in engines)


async def until_counted(session: aiohttp.ClientSession, engine: str, state: str, count: int,
                        timeout_s: float = 120) -> None:
    """Until `count` requests are in `state` in the engine (its /server_info `internal_states`: "running" in the
    running batch, "waiting" queued)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with session.get(f"{engine}/server_info") as response:
            seen = (await response.json())["internal_states"][0][f"num_{state}_reqs"]
        if seen >= count:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{seen} of {count} requests {state} after {timeout_s} s"
        await asyncio.sleep(0.05)


async def until_running(session: aiohttp.ClientSession, engine: str, count: int, timeout_s: float = 120) -> None:
    await until_counted(session, engine, "running", count, timeout_s)


async def until_waiting(session: aiohttp.ClientSession, engine: str, count: int, timeout_s: float = 120) -> None:
    await until_counted(session, engine, "waiting", count, timeout_s)


def test_abort_pause_and_misuse_on_one_engine(cluster, hold_gate):
    engine = cluster[0][0].url
    long = {"ignore_eos": True}

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            # 29 filler requests share the batch (each decode step ~10 ms on an idle box). Once all 32 are
            # admitted (each has its first token), the engine is held (it decodes nothing) and paused in place (they
            # keep their rows), so none can finish by length before the aborts land, whatever the load.
            fillers = [asyncio.create_task(post(session, f"{engine}/generate", generate_body(f"f{i}", [5], 480, **long)))
                       for i in range(29)]
            tasks = [asyncio.create_task(post(session, f"{engine}/generate", generate_body(rid, [5, 6], 480, **long)))
                     for rid in ("a1", "a2", "a3")]
            await until_running(session, engine, 32)
            with held(hold_gate):
                assert (await post(session, f"{engine}/pause_generation", {"mode": "in_place"}, AUTH))[0] == 200
                # misuse while requests run
                status, body = await post(session, f"{engine}/release_memory_occupation", {"tags": None}, AUTH)
                assert status == 400 and "pause" in body["message"]
                status, _ = await post(session, f"{engine}/abort_request", {"rid": "a2"},
                                       {"Authorization": "Bearer x"})
                assert status == 401  # admin endpoint with a wrong key
                assert (await post(session, f"{engine}/abort_request", {"rid": "a2"}, AUTH))[0] == 200
                assert not tasks[0].done()
                assert (await post(session, f"{engine}/abort_request", {"abort_all": True}, AUTH))[0] == 200
                assert (await post(session, f"{engine}/continue_generation", {}, AUTH))[0] == 200
            status, body = await tasks[1]
            assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(body["output_ids"]) < 480
            for task in (tasks[0], tasks[2], *fillers):
                status, body = await task
                assert body["meta_info"]["finish_reason"]["type"] == "abort"
                assert len(body["meta_info"]["output_token_logprobs"]) == len(body["output_ids"])

            # pause(abort) mid-generation, then requests wait until continue
            fillers = [asyncio.create_task(post(session, f"{engine}/generate", generate_body(f"g{i}", [5], 480, **long)))
                       for i in range(29)]
            running = asyncio.create_task(post(session, f"{engine}/generate", generate_body("p1", [7], 480, **long)))
            await until_running(session, engine, 30)  # all admitted; held below, none can finish by length
            with held(hold_gate):
                assert (await post(session, f"{engine}/pause_generation", {"mode": "abort"}, AUTH))[0] == 200
            for task in (running, *fillers):
                status, body = await task
                assert body["meta_info"]["finish_reason"]["type"] == "abort"
            waiting = asyncio.create_task(post(session, f"{engine}/generate", generate_body("p2", [7], 4, **long)))
            await until_waiting(session, engine, 1)  # it reached the engine, which queues it behind the pause
            assert not waiting.done()
            status, body = await post(session, f"{engine}/resume_memory_occupation", {"tags": ["weights"]}, AUTH)
            assert status == 400 and "not released" in body["message"]
            status, body = await post(session, f"{engine}/update_weights_from_distributed",
                                      {"names": [], "dtypes": [], "shapes": []}, AUTH)
            assert status == 400 and "begin_weight_update" in body["message"]
            assert not waiting.done()
            assert (await post(session, f"{engine}/continue_generation", {}, AUTH))[0] == 200
            status, body = await waiting
            assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length"

    asyncio.run(scenario())


def _trainer_rank0(master_port: int, world_size: int, checkpoint: str, per_tensor: list[str],
                   bucket: list[str]) -> None:
    """A stand-in for trainer rank 0: joins the group and broadcasts the new weights."""
    from safetensors.torch import load_file

    from hpc_rl.weights.bucket_layout import pack_bucket
    from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group

    torch.set_num_threads(1)
    weights = load_file(str(Path(checkpoint) / "model.safetensors"))
    group = init_weight_update_group(master_address="127.0.0.1", master_port=master_port, rank=0,
                                     world_size=world_size, timeout_seconds=120)
    for name in per_tensor:
        torch.distributed.broadcast(weights[name].contiguous(), src=0, group=group)
    buffer, _ = pack_bucket([(name, weights[name]) for name in bucket])
    torch.distributed.broadcast(buffer, src=0, group=group)
    destroy_weight_update_group(group)


def test_weight_update_over_gloo_changes_outputs(cluster, model_dir, tmp_path, hold_gate):
    engines, _ = cluster
    urls = [engine.url for engine in engines]
    new_dir = make_tiny_model(tmp_path / "new", TinyModelSpec(seed=1))
    new_model, old_model = load_model(new_dir), load_model(model_dir)
    from safetensors.torch import load_file

    tensors = load_file(str(new_dir / "model.safetensors"))
    names = [name for name, _ in order_for_alignment(sorted(tensors.items()))]
    per_tensor, bucket = names[: len(names) // 2], names[len(names) // 2:]
    fields = lambda subset: {"names": subset, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in subset],
                             "shapes": [list(tensors[n].shape) for n in subset], "group_name": "weight_update_group"}
    master_port = planned_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer_rank0, args=(master_port, 3, str(new_dir), per_tensor, bucket), daemon=True)

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            # a request in flight across the update: retracted, then finished by the new weights
            spanning = asyncio.create_task(post(session, f"{urls[0]}/generate",
                                                generate_body("span", [5, 6], 480, ignore_eos=True)))
            # pause as soon as it runs (a fixed sleep raced a fast idle machine: all 480 tokens came first)
            while True:
                async with session.get(f"{urls[0]}/server_info") as response:
                    if (await response.json())["internal_states"][0]["num_running_reqs"] >= 1:
                        break
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.03)  # a few tokens from the old weights (480 take ~0.4 s on an idle machine)
            hold_gate.touch()  # from here it decodes nothing until the continue: it cannot finish by length first
            for url in urls:
                assert (await post(session, f"{url}/pause_generation", {"mode": "retract"}, AUTH))[0] == 200
            assert not spanning.done()
            trainer.start()
            init = [post(session, f"{url}/init_weights_update_group",
                         {"master_address": "127.0.0.1", "master_port": master_port, "rank_offset": 1 + i,
                          "world_size": 3, "group_name": "weight_update_group", "backend": "gloo"}, AUTH)
                    for i, url in enumerate(urls)]
            assert all(status == 200 for status, _ in await asyncio.gather(*init))
            for url in urls:
                assert (await post(session, f"{url}/begin_weight_update", {}, AUTH))[0] == 200

            async def update(url: str) -> None:
                status, body = await post(session, f"{url}/update_weights_from_distributed",
                                          {**fields(per_tensor), "flush_cache": True}, AUTH)
                assert status == 200, body
                status, body = await post(session, f"{url}/update_weights_from_distributed",
                                          {**fields(bucket), "flush_cache": True, "weight_version": "1",
                                           "load_format": "flattened_bucket"}, AUTH)
                assert status == 200, body

            await asyncio.gather(*(update(url) for url in urls))
            for url in urls:
                assert (await post(session, f"{url}/end_weight_update", {}, AUTH))[0] == 200
                assert (await post(session, f"{url}/continue_generation", {}, AUTH))[0] == 200
                async with session.get(f"{url}/model_info") as response:
                    assert (await response.json())["weight_version"] == "1"
            hold_gate.unlink()
            _, spanned = await spanning
            greedy = [await post(session, f"{url}/generate", generate_body(f"g{i}", [5, 6, 7], 10, temperature=0))
                      for i, url in enumerate(urls)]
            for url in urls:
                assert (await post(session, f"{url}/destroy_weights_update_group",
                                   {"group_name": "weight_update_group"}, AUTH))[0] == 200
            return spanned, greedy

    try:
        spanned, greedy = asyncio.run(scenario())
        trainer.join(60)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()
    versions = [span["version"] for span in spanned["meta_info"]["weight_versions"]]
    assert versions == ["default", "1"] and spanned["meta_info"]["weight_version"] == "1"
    with torch.no_grad():
        expected = new_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, do_sample=False,
                                      attention_mask=torch.ones(1, 3, dtype=torch.long))[0, 3:].tolist()
    for status, body in greedy:
        assert status == 200 and body["output_ids"][: len(expected)] == expected[: len(body["output_ids"])]
        assert body["meta_info"]["weight_version"] == "1"
        assert body["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": len(body["output_ids"])}]
        got = [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, forward_logprobs(new_model, [5, 6, 7], body["output_ids"]))) < 1e-4
        old = forward_logprobs(old_model, [5, 6, 7], body["output_ids"])
        assert max(abs(a - b) for a, b in zip(got, old)) > 1e-3
