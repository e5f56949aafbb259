"""The simulated engine's model (pure timing/draw functions) and its continuous batching on a fake clock."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from hpc_rl.sim.engine import SimEngine, plan_request, sample_index_of
from hpc_rl.sim.model import EngineModel, SimConfigError

REPO = Path(__file__).resolve().parents[2]


class FakeSimClock:
    """A hand-driven simulated clock (a fake, for these tests): timers fire when `advance` passes them."""

    def __init__(self) -> None:
        self.time = 0.0
        self.timers: list[tuple[float, object]] = []

    def now(self) -> float:
        return self.time

    def call_at(self, when, callback):
        clock = self

        class Handle:
            def cancel(self) -> None:
                clock.timers = [t for t in clock.timers if t[1] is not callback]

        self.timers.append((when, callback))
        return Handle()

    def advance_to(self, when: float) -> None:
        while True:
            due = sorted((t for t in self.timers if t[0] <= when), key=lambda t: t[0])
            if not due:
                break
            at, callback = due[0]
            self.timers.remove(due[0])
            self.time = max(self.time, at)
            callback()
        self.time = when


def test_decode_step_grows_with_the_batch_and_stops_at_the_limit():
    model = EngineModel(decode_step_base_s=0.007, decode_step_per_request_s=2.5e-5, max_running_requests=256)
    assert model.decode_step_seconds(1) == pytest.approx(0.007025)
    assert model.decode_step_seconds(256) == pytest.approx(0.0134)
    assert model.decode_step_seconds(1000) == model.decode_step_seconds(256)
    assert model.engine_tokens_per_second(256) == pytest.approx(256 / 0.0134)
    assert model.prefill_seconds(100) == pytest.approx(100 * model.prefill_s_per_token)


def test_token_and_time_scales():
    model = EngineModel(token_scale=32, time_scale_ms=20, max_response_len=8192)
    assert model.max_wire_response_len == 256
    assert model.wire_tokens_per_second(1) == pytest.approx(1 / (model.decode_step_seconds(1) * 32))
    assert model.prefill_seconds(10) == pytest.approx(320 * model.prefill_s_per_token)
    assert model.real_seconds(50.0) == pytest.approx(1.0)
    assert model.simulated_seconds(1.0) == pytest.approx(50.0)


def test_lengths_are_long_tailed_capped_and_stable_per_sample():
    model = EngineModel(response_len_median=2500, response_len_sigma=0.8, max_response_len=8192)
    lengths = [model.target_response_tokens(i) for i in range(4000)]
    assert lengths == [model.target_response_tokens(i) for i in range(4000)]
    assert sorted(lengths)[2000] == pytest.approx(2500, rel=0.08)
    truncated = sum(length > 8192 for length in lengths) / len(lengths)
    assert 0.04 < truncated < 0.10  # P(z > ln(8192/2500)/0.8) = 6.9%
    assert sum(lengths) / len(lengths) > 2500 * 1.2  # mean above median: a right tail


def test_zero_variance_share_of_groups():
    model = EngineModel(zero_variance_share=0.3, n_samples_per_prompt=8)
    flat = 0
    for group in range(3000):
        rewards = {model.sample_reward(group * 8 + k) for k in range(8)}
        assert rewards <= {0, 1}
        flat += len(rewards) == 1
    assert flat / 3000 == pytest.approx(0.3, abs=0.03)


def test_shipped_parameter_file_loads_and_bad_fields_name_file_and_field(tmp_path):
    model = EngineModel.from_yaml(REPO / "configs" / "sim" / "qwen3_4b_h100_tp2.yaml")
    assert model.max_running_requests == 256 and model.max_response_len == 8192
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode_step_base_s: 0.007\nbatch_limit: 3\n")
    with pytest.raises(SimConfigError, match=r"bad.yaml: unknown field 'batch_limit'"):
        EngineModel.from_yaml(bad)
    bad.write_text("zero_variance_share: 1.5\n")
    with pytest.raises(SimConfigError, match=r"bad.yaml: field 'zero_variance_share' must be in \[0, 1\]"):
        EngineModel.from_yaml(bad)


def test_request_plan_resumes_a_partial_sample_where_it_stopped():
    model = EngineModel(token_scale=32, max_response_len=8192)
    target = model.target_response_tokens(5)
    first = plan_request(model, rid="s5-aa", input_len=10, max_new_tokens=256, now=0.0)
    assert sample_index_of("s5-aa") == 5 and sample_index_of("probe-1") is None
    if target <= 256:
        assert (first.budget, first.finish_type) == (target, "stop")
        already = max(0, target - 3)
        resumed = plan_request(model, rid="s5-bb", input_len=10 + already, max_new_tokens=256 - already, now=0.0)
        assert resumed.budget == target - already
    else:
        assert (first.budget, first.finish_type) == (256, "length")
    forced = plan_request(model, rid="s5-cc", input_len=3, max_new_tokens=100, now=0.0, ignore_eos=True)
    assert (forced.budget, forced.finish_type) == (100, "length")


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_continuous_batching_timing_on_a_fake_clock():
    async def scenario():
        model = EngineModel(decode_step_base_s=0.01, decode_step_per_request_s=0.0, prefill_s_per_token=0.0,
                            max_running_requests=2)
        clock = FakeSimClock()
        engine = SimEngine(model, clock)
        requests = [plan_request(model, rid=f"r{i}", input_len=1, max_new_tokens=100, now=0.0, ignore_eos=True)
                    for i in range(3)]
        for request in requests:
            engine.submit(request)
        assert len(engine.running) == 2 and len(engine.waiting) == 1  # the batch limit
        clock.advance_to(1.0)  # 100 tokens at 10 ms per step: both finish at t=1
        assert [r.done.done() for r in requests] == [True, True, False]
        clock.advance_to(1.5)
        engine.pause("abort")  # the third has run 0.5 s: 50 tokens, returned with finish abort
        result = requests[2].done.result()
        assert result["finish_type"] == "abort" and result["tokens"] == 50
        assert engine.counters.busy_s == pytest.approx(1.5)
        assert requests[0].done.result()["spans"] == [{"version": "default", "start": 0, "end": 100}]

    _run(scenario())


def test_retract_keeps_tokens_and_records_the_new_weight_version():
    async def scenario():
        model = EngineModel(decode_step_base_s=0.01, decode_step_per_request_s=0.0, prefill_s_per_token=0.0)
        clock = FakeSimClock()
        engine = SimEngine(model, clock, weight_version="0")
        request = plan_request(model, rid="r", input_len=1, max_new_tokens=100, now=0.0, ignore_eos=True)
        engine.submit(request)
        clock.advance_to(0.3)
        engine.pause("retract")
        clock.advance_to(5.0)  # paused: no progress, not busy
        engine.set_weight_version("1")
        engine.resume()
        clock.advance_to(5.7)
        result = request.done.result()
        assert result["tokens"] == 100 and result["finish_type"] == "length"
        assert result["spans"] == [{"version": "0", "start": 0, "end": 30}, {"version": "1", "start": 30, "end": 100}]
        assert engine.counters.busy_s == pytest.approx(1.0)
        assert math.isclose(engine.counters.generated_tokens, 100)

    _run(scenario())
