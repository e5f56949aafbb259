"""One simulated engine's continuous batching, in simulated time.

Owns `SimEngine`: the running batch (at most `max_running_requests`) and the waiting queue, the
requests' progress, pause (abort | retract | in_place) and continue, abort by rid or all, the weight
version and the per-token version spans, and the engine's busy time and token counters.

A fluid model, event-driven: between two events (arrival, completion, abort, pause) the batch is
fixed and every running request gains `EngineModel.wire_tokens_per_second(batch)` tokens per simulated
second; a prefill (on admission) stalls the batch for `prefill_seconds(input)`. Only the next
completion is scheduled (one timer per engine), so 1,024 engines cost events, not decode steps.
Does not own HTTP (server.py) or the draws (model.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpc_rl.sim.model import EngineModel

PAUSE_MODES = ("abort", "retract", "in_place")


class SimClock(Protocol):
    """Simulated time, and one-shot timers at a simulated instant."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Any:
        """Returns a handle with `cancel()`."""
        ...


class LoopClock:
    """Simulated seconds on an asyncio loop: real time since start, divided by the time scale."""

    def __init__(self, model: EngineModel, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.model = model
        self.start = self.loop.time()

    def now(self) -> float:
        return self.model.simulated_seconds(self.loop.time() - self.start)

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_at(self.start + self.model.real_seconds(when), callback)


@dataclass
class SimRequest:
    """A /generate request inside the engine."""

    rid: str
    input_len: int
    budget: int
    """Tokens this request generates unless aborted (wire tokens)."""
    finish_type: str
    """'stop' or 'length' when it completes."""
    arrived: float
    done: asyncio.Future[dict[str, Any]] | None = None
    progress: float = 0.0
    spans: list[list[Any]] = field(default_factory=list)
    """[version, start_token] in order."""
    needs_prefill: bool = True

    @property
    def tokens(self) -> int:
        return min(self.budget, int(self.progress + 1e-9))


@dataclass
class EngineCounters:
    busy_s: float = 0.0
    """Simulated seconds with a running batch or a prefill."""
    generated_tokens: float = 0.0
    """Wire tokens generated (completed, aborted or still running)."""
    aborted_tokens: int = 0
    """Wire tokens returned in responses cut by /abort_request."""
    requests_done: int = 0
    requests_aborted: int = 0


class SimEngine:
    """Continuous batching of one engine (see the module docstring)."""

    def __init__(self, model: EngineModel, clock: SimClock, *, weight_version: str = "default") -> None:
        self.model = model
        self.clock = clock
        self.weight_version = weight_version
        self.running: dict[str, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.paused: str | None = None
        self.counters = EngineCounters()
        self._last = clock.now()
        self._stall_until = self._last
        self._timer: Any = None

    # -- time ------------------------------------------------------------------------------------
    def _advance(self) -> None:
        """Credit progress to the running batch from the last event to now."""
        now = self.clock.now()
        if now <= self._last:
            return
        frozen = self.paused == "in_place"
        if (self.running or self._stall_until > self._last) and not frozen:
            self.counters.busy_s += now - self._last
        decoding_from = max(self._last, min(self._stall_until, now))
        if self.running and not frozen and now > decoding_from:
            gained = (now - decoding_from) * self.model.wire_tokens_per_second(len(self.running))
            for request in self.running.values():
                before = request.progress
                request.progress = min(float(request.budget), request.progress + gained)
                self.counters.generated_tokens += request.progress - before
        self._last = now

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.running or self.paused == "in_place":
            return
        left = min(r.budget - r.progress for r in self.running.values())
        rate = self.model.wire_tokens_per_second(len(self.running))
        when = max(self._last, self._stall_until) + max(0.0, left) / rate
        self._timer = self.clock.call_at(when, self.step)

    def step(self) -> None:
        """Advance to now: finish completed requests, admit waiting ones, schedule the next event."""
        self._timer = None
        self._advance()
        for request in [r for r in self.running.values() if r.progress >= r.budget - 1e-9]:
            del self.running[request.rid]
            self._finish(request, request.finish_type)
        self._admit()
        self._reschedule()

    def _admit(self) -> None:
        if self.paused is not None:
            return
        while self.waiting and len(self.running) < self.model.max_running_requests:
            request = self.waiting.popleft()
            if request.needs_prefill:
                start = max(self._last, self._stall_until)
                self._stall_until = start + self.model.prefill_seconds(request.input_len + request.tokens)
                request.needs_prefill = False
            if not request.spans or request.spans[-1][0] != self.weight_version:
                request.spans.append([self.weight_version, request.tokens])
            self.running[request.rid] = request

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        self._advance()
        request.done = asyncio.get_running_loop().create_future() if request.done is None else request.done
        self.waiting.append(request)
        self._admit()
        self._reschedule()

    def _finish(self, request: SimRequest, finish_type: str) -> None:
        tokens = request.tokens
        self.counters.requests_done += 1
        if finish_type == "abort":
            self.counters.requests_aborted += 1
        spans = []
        for position, (version, start) in enumerate(request.spans):
            end = request.spans[position + 1][1] if position + 1 < len(request.spans) else tokens
            if end > start:
                spans.append({"version": version, "start": start, "end": end})
        result = {"tokens": tokens, "finish_type": finish_type, "spans": spans,
                  "weight_version": self.weight_version, "simulated_latency": self.clock.now() - request.arrived}
        if request.done is not None and not request.done.done():
            request.done.set_result(result)

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """End matching requests (running or waiting) with finish 'abort'; returns how many."""
        self._advance()
        matched = [r for r in list(self.running.values()) + list(self.waiting) if abort_all or r.rid == rid]
        for request in matched:
            self.running.pop(request.rid, None)
            if request in self.waiting:
                self.waiting.remove(request)
            self.counters.aborted_tokens += request.tokens
            self._finish(request, "abort")
        self._admit()
        self._reschedule()
        return len(matched)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self._advance()
        self.paused = mode
        if mode == "abort":
            for request in list(self.running.values()) + list(self.waiting):
                self._finish(request, "abort")
            self.running.clear()
            self.waiting.clear()
        elif mode == "retract":  # back to the queue with their tokens; KV recomputed on resume
            for request in reversed(list(self.running.values())):
                request.needs_prefill = True
                self.waiting.appendleft(request)
            self.running.clear()
        self._reschedule()

    def resume(self) -> None:
        self._advance()
        self.paused = None
        self._admit()
        self._reschedule()

    def set_weight_version(self, version: str) -> None:
        self._advance()
        self.weight_version = version
        for request in self.running.values():  # in_place: the frozen requests continue on the new weights
            if request.spans[-1][0] != version:
                request.spans.append([version, request.tokens])


def sample_index_of(rid: str) -> int | None:
    """hpc_rl names rids `s<sample index>-<hex>` (rollout/generate.py); None for other rids."""
    if rid.startswith("s"):
        head = rid[1:].split("-", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def plan_request(model: EngineModel, *, rid: str, input_len: int, max_new_tokens: int, now: float,
                 ignore_eos: bool = False) -> SimRequest:
    """What this request will generate: the rest of its sample's drawn length, within its budget
    (all of the budget with `ignore_eos`, as SGLang).

    The sample already has `max_wire_response_len - max_new_tokens` tokens (hpc_rl resumes a partial
    sample with the budget reduced by what it has)."""
    if ignore_eos:
        return SimRequest(rid=rid, input_len=input_len, budget=max(0, max_new_tokens), finish_type="length",
                          arrived=now)
    key: int | str = sample_index_of(rid)
    if key is None:
        key = rid
    already = max(0, model.max_wire_response_len - max_new_tokens)
    left = model.target_response_tokens(key) - already
    if left > max_new_tokens:
        return SimRequest(rid=rid, input_len=input_len, budget=max(0, max_new_tokens), finish_type="length",
                          arrived=now)
    return SimRequest(rid=rid, input_len=input_len, budget=max(1, min(left, max_new_tokens)), finish_type="stop",
                      arrived=now)

