"""The rollout scheduler against real processes: two CPU engines behind a real sglang-router.

What runs: `hpc_rl.engines.cpu` x2 (tiny Qwen3), `sglang_router.launch_router`, the rollout scheduler
in this process. Checks: dynamic sampling + abort + partial rollout resume (the issue's done-when),
an engine dying mid-rollout without losing a sample, the two-turn tool example, eval metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_rl.data.prompts import PromptDataset, PromptRecord, PromptSource, make_prompt_encoder
from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.data.tiny_task import tiny_task_reward, tiny_task_rows
from hpc_rl.engines.cpu.faults import HOLD_GENERATION, HOLD_POLL_S
from hpc_rl.engines.engine_process import CpuEngineProcess
from hpc_rl.engines.router import RouterProcess
from hpc_rl.rollout import (
    EngineClient,
    RetryPolicy,
    RolloutScheduler,
    SchedulerSettings,
    StaticEngineDirectory,
    generate_turn,
    load_generate_function,
    run_eval,
)
from hpc_rl.rollout.engine_client import engine_context_length

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_turn_tool_generate.py"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    logs = tmp_path_factory.mktemp("rollout_logs")
    engines = [CpuEngineProcess(tiny_model_dir, log_path=logs / f"engine{i}.log", max_running_requests=64)
               for i in range(2)]
    router = None
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(timeout=180)
        router = RouterProcess(log_path=logs / "router.log", policy="cache_aware",
                               worker_urls=[e.url for e in engines])
        router.start()
        router.wait_ready(timeout=60)
        yield SimpleNamespace(engines=engines, router=router, model=str(tiny_model_dir), logs=logs)
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def source(rows: int = 64) -> PromptSource:
    records = [PromptRecord(row=i, prompt=r["prompt"], label=r["label"])
               for i, r in enumerate(tiny_task_rows(rows, seed=0))]
    return PromptSource(PromptDataset(path="tiny_task", records=records), shuffle=False, seed=0)


def row(sample: Sample) -> int:
    return int(sample.metadata["data_row"])


async def varied_reward(samples: list[Sample]) -> list[float]:
    return [tiny_task_reward(s.response_text, s.label) + 0.01 * k for k, s in enumerate(samples)]


def odd_rows_only(args: Any, samples: list[Sample], **kwargs: Any) -> bool:
    """Drops half the groups (even data rows): a bool-returning filter, as old slime filters are."""
    return row(samples[0]) % 2 == 1


def make_scheduler(client: EngineClient, model: str, **settings: Any) -> RolloutScheduler:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    defaults: dict[str, Any] = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "over_sampling_batch_size": 6,
                                "partial_rollout": True}
    kwargs = {k: settings.pop(k) for k in list(settings) if k in ("generate_fn", "group_filter", "args", "retry")}
    return RolloutScheduler(settings=SchedulerSettings(**{**defaults, **settings}), client=client, source=source(),
                            encoder=make_prompt_encoder(tokenizer, apply_chat_template=True), reward_fn=varied_reward,
                            sampling_params={"max_new_tokens": 2000, "temperature": 1.0}, **kwargs)


def check_accounting(metrics: dict[str, float]) -> None:
    assert metrics["rollout/requests_sent"] == (
        metrics["rollout/requests_finished"] + metrics["rollout/requests_aborted"]
        + metrics["rollout/requests_transport_failed"] + metrics["rollout/requests_http_failed"])


def test_dynamic_sampling_abort_and_partial_resume(cluster: SimpleNamespace) -> None:
    slow_rows: set[int] = set(range(4, 1000))

    async def per_row_generate(args: Any, sample: Sample, params: dict) -> Sample:
        """Slow rows run long (ignore_eos) so they are in flight when the batch is full."""
        if row(sample) in slow_rows:
            return await generate_turn(sample, {**params, "ignore_eos": True})
        return await generate_turn(sample, {**params, "max_new_tokens": sample.response_length + 6})

    async def main() -> None:
        directory = StaticEngineDirectory([e.url for e in cluster.engines])
        # 2000 new tokens exceed the context (a 400 from SGLang and the CPU engine): the client clips them.
        async with EngineClient(directory, router_url=cluster.router.url, per_engine_concurrency=16,
                                context_length=engine_context_length(cluster.model)) as client:
            scheduler = make_scheduler(client, cluster.model, generate_fn=per_row_generate, group_filter=odd_rows_only)
            first = await scheduler.run(rollout_id=0, weight_version=0)
            assert sorted(row(g[0]) for g in first.groups) == [1, 3]
            for sample in (s for g in first.groups for s in g):
                assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and sample.reward is not None
                assert len(sample.response_logprobs) == len(sample.weight_versions) == sample.response_length > 0
                assert all(isinstance(v, int) for v in sample.weight_versions)
            m = first.metrics
            assert m["rollout/requests_aborted"] >= 2  # the slow rows' requests
            check_accounting(m)
            buffered = {row(g[0]): [list(s.response_token_ids) for s in g] for g in scheduler.buffer.groups}
            # Rows 0 and 2 were dropped by the filter, or were still unprocessed (then buffered) when 1, 3 won.
            assert {4, 5} <= set(buffered) <= {0, 2, 4, 5}
            assert m.get("rollout/groups_dropped/filter", 0) + len(set(buffered) & {0, 2}) == 2
            assert all(tokens for r in (4, 5) for tokens in buffered[r])

            slow_rows.clear()
            slow_rows.update(range(8, 1000))  # resumed rows now finish; of the new prompts only 6, 7 do
            second = await scheduler.run(rollout_id=1, weight_version=0)
            assert second.metrics["rollout/groups_from_buffer"] == len(buffered)
            kept = {row(g[0]): g for g in second.groups}
            assert sorted(kept) == [5, 7]  # the resumed odd group, and the first new odd one
            for sample, old in zip(kept[5], buffered[5]):
                assert sample.response_token_ids[:len(old)] == old and sample.metadata["start_rollout_id"] == 0
            check_accounting(second.metrics)

    asyncio.run(main())


async def _until_running(url: str, timeout_s: float = 60.0) -> None:
    """Until the engine reports a running request in /server_info (loaded machines start slowly)."""
    import aiohttp

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            async with session.get(f"{url}/server_info") as response:
                states = (await response.json())["internal_states"]
            if states[0]["num_running_reqs"] > 0:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never ran a request")


def test_engine_death_loses_no_sample(cluster: SimpleNamespace) -> None:
    """An engine crashes mid-rollout and is removed (as the controller's registry would): no sample lost.

    Its own round-robin router over [a cluster engine, a fresh engine], so the victim surely has work; once it runs
    requests, its hold gate (`faults.HOLD_GENERATION`, its environment only) keeps them there until it dies."""
    hold_gate = cluster.logs / "hold-the-victims-generation"
    extra = CpuEngineProcess(cluster.model, log_path=cluster.logs / "engine_extra.log",
                             env={**os.environ, HOLD_GENERATION: str(hold_gate)})
    router = RouterProcess(log_path=cluster.logs / "router_rr.log", policy="round_robin",
                           worker_urls=[cluster.engines[0].url])
    extra.start()
    router.start()
    try:
        extra.wait_healthy(timeout=180)
        router.wait_ready(timeout=60)
        router.add_worker(extra.url)

        async def main() -> dict[str, float]:
            directory = StaticEngineDirectory([cluster.engines[0].url, extra.url])
            retry = RetryPolicy(max_transport_retries=8, base_delay_s=0.2, max_delay_s=2.0)
            async with EngineClient(directory, router_url=router.url, per_engine_concurrency=16) as client:
                scheduler = make_scheduler(client, cluster.model, rollout_batch_size=6, over_sampling_batch_size=6,
                                           partial_rollout=False, retry=retry)
                scheduler.sampling_params = {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True}
                run = asyncio.create_task(scheduler.run(rollout_id=0))
                await _until_running(extra.url)
                hold_gate.touch()  # from here the victim decodes nothing: what runs on it stays until it dies
                await asyncio.sleep(40 * HOLD_POLL_S)  # a step under way when the gate opened has ended
                await _until_running(extra.url)  # the victim surely has work when it dies
                os.killpg(extra.process.pid, signal.SIGKILL)  # a crash, not a clean shutdown
                directory.urls.remove(extra.url)
                await asyncio.to_thread(router.remove_worker, extra.url)
                result = await run
                samples = [s for g in result.groups for s in g]
                assert len(samples) == 12 and all(s.response_length == 300 for s in samples)
                assert result.metrics.get("rollout/groups_dropped/failed", 0) == 0
                check_accounting(result.metrics)
                return result.metrics

        metrics = asyncio.run(main())
        print({k: v for k, v in metrics.items() if "requests" in k})
        assert metrics["rollout/requests_retried"] >= 1  # the dead engine had work
    finally:
        router.stop()
        extra.stop()


def test_two_turn_tool_example_and_eval(cluster: SimpleNamespace) -> None:
    generate = load_generate_function(f"{EXAMPLE}:generate")

    async def main() -> None:
        directory = StaticEngineDirectory([e.url for e in cluster.engines])
        async with EngineClient(directory, router_url=cluster.router.url) as client:
            args = SimpleNamespace(hf_checkpoint=cluster.model)
            scheduler = make_scheduler(client, cluster.model, generate_fn=generate, args=args, partial_rollout=False,
                                       over_sampling_batch_size=2)
            scheduler.sampling_params = {"max_new_tokens": 24, "temperature": 1.0}
            result = await scheduler.run(rollout_id=0)
            for sample in (s for g in result.groups for s in g):
                mask = sample.effective_loss_mask()
                assert sample.metadata["tool_done"] and 0 in mask and mask[0] == 1
                assert "answer" in sample.response_text
            records = [PromptRecord(row=i, prompt=r["prompt"], label=r["label"])
                       for i, r in enumerate(tiny_task_rows(4, seed=1))]

            async def reward(samples: list[Sample]) -> list[float]:
                return [tiny_task_reward(s.response_text, s.label) for s in samples]

            metrics = await run_eval(client=client, datasets=[("tiny", records)], encoder=scheduler.encoder,
                                     reward_fn=reward, n_samples=2, sampling_params={"max_new_tokens": 4})
            assert metrics["eval/tiny/num_samples"] == 8
            assert 0.0 <= metrics["eval/tiny/pass@1"] <= 1.0 and metrics["eval/tiny/response_len_mean"] <= 4

    asyncio.run(main())
