"""Generation of one sample: `/generate` requests, resume of partial samples, retries, custom functions.

Owns:
- `GenerationSession`: one batch of generation (a rollout or an eval) over a shared `EngineClient`:
  its stop flag, its rids in flight, its request counters, the weight version to assume when an
  engine does not report one, and `stop()` (abort on every engine until none of its requests runs).
- `generate_turn(sample, sampling_params)`: continue a sample by one engine call. It sends
  prompt + already generated tokens with `max_new_tokens` reduced by what the sample has (and capped
  by `max_context_len`), appends tokens, logprobs and per-token weight versions, and sets the status.
  With `training.use_rollout_routing_replay` it asks for each token's routed experts too and keeps the
  last answer's (routed_experts.py): they cover the whole sequence sent, so a resumed sample's earlier
  tokens carry the routing the engine recomputed for them.
  Transport failures (an engine died) keep the tokens, back off, and resubmit the rest; after
  `RetryPolicy.max_transport_retries` consecutive failures the sample is FAILED with the error in
  `metadata["error"]`. Samples that call at the same moment share a batched request (engine_client.py;
  per group unless `batch_across_groups`); each keeps its own rid, answer, retries and failure. An abort the session did not ask for (engine paused for a weight update) is
  resumed the same way: the sample keeps the tokens of the old policy, tagged with its version.
- What no retry fixes ends the run (`RunEndingGenerationError`, raised through the scheduler):
  `RequestRejected`, the engine refused a request as invalid (a 4xx other than 401/403 authentication,
  408 and 429, which are retried like transport failures), e.g. a negative temperature, with the
  engine's own message; `NoWorkersAvailable`, the router answered 503 `no_available_workers` for
  `RetryPolicy.no_workers_timeout_s` while the controller counted engines serving (the router's
  circuit breaker has shut them all out; restarts, when no engine is serving, do not count).
- Custom generate functions (`rollout.custom_generate_function_path`), slime's signature:

      async def generate(args, sample: Sample, sampling_params: dict) -> Sample

  `args` is `hpc_rl.config.plugin_args(run_config)`; `sampling_params` is a fresh dict of SGLang
  sampling params (max_new_tokens = the whole response budget). The function calls
  `await generate_turn(sample, params)` for each model turn (it finds the session through a context
  variable, so aborts, retries and weight versions work) and `append_tool_tokens(...)` for tool output
  (loss_mask 0). It returns the sample with `status` set. See examples/two_turn_tool_generate.py.

Does not own: HTTP details (engine_client.py), rewards, groups, filters (scheduler.py), the sampling params of
the config and the per-token columns of an answer (request_fields.py, re-exported here).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

from hpc_rl.data.images import image_data_url
from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.data.uniform_column import UniformColumn
from hpc_rl.retry_policy import RetryPolicy
from hpc_rl.rollout.engine_client import (EngineClient, EngineHTTPError, GenerateAnswer, StopGeneration,
                                          TransportError)
from hpc_rl.rollout.metrics import GenerationMetrics
from hpc_rl.rollout.request_fields import (  # noqa: F401  (re-exported: callers import them from here)
    SamplingParams,
    eval_sampling_params,
    output_logprobs,
    parse_weight_versions,
    rollout_sampling_params,
    version_to_int,
    weight_version_column,
)
from hpc_rl.rollout.top_logprobs import REQUEST_FIELD as TOP_LOGPROBS_FIELD
from hpc_rl.rollout.top_logprobs import (TopLogprobsError, append_top_logprobs, pad_top_logprobs,
                                         top_logprobs_from_answer)
from hpc_rl.rollout.routed_experts import (REQUEST_FIELD, RoutedExpertsError, RoutingShape,
                                           routed_experts_from_answer)
from hpc_rl.rollout.worker_rewards import keep_reward, reward_request

GenerateFn = Callable[[Any, Sample, SamplingParams], Awaitable[Sample]]
"""`async fn(args, sample, sampling_params) -> Sample` (slime's custom generate signature)."""


class RunEndingGenerationError(RuntimeError):
    """Generation cannot succeed by retrying: the rollout stops and the run ends with this message."""


class RequestRejected(RunEndingGenerationError):
    """The engine refused a request as invalid (HTTP 4xx); the message quotes the engine."""

    def __init__(self, status: int, engine_message: str, sampling_params: SamplingParams) -> None:
        super().__init__(
            f"the engine rejected a generation request as invalid (HTTP {status}): {engine_message} "
            f"(sampling_params {sampling_params}); every request would fail the same way: fix the value "
            "(rollout.rollout_* / eval.eval_* in the config, or the custom generate function) and rerun")
        self.status = status


class NoWorkersAvailable(RunEndingGenerationError):
    """The router has had no worker to send requests to for too long while engines were up."""


RETRIED_CLIENT_STATUSES = frozenset({408, 429})
"""4xx answers that are about the moment, not the request: retried like transport failures."""
AUTH_STATUSES = frozenset({401, 403})
"""4xx answers about the key: the sample fails (the engine restarted with another key?), the run goes on."""
NO_WORKERS_CODE = "no_available_workers"
"""sglang-router 0.3.2's error code (503) when every worker is unhealthy or its circuit is open."""


def engine_error_message(body: str) -> str:
    """The engine's own words from an error body: SGLang's {"error": "..."}, {"error": {"message": ...}},
    FastAPI's {"detail": ...}, or the raw text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    error = parsed.get("error", parsed.get("detail", parsed)) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict) and "message" in error:
        error = error["message"]
    return str(error)[:500]


class GenerationSession:
    """One batch of generation over a shared client: stop flag, own rids in flight, counters."""

    def __init__(self, client: EngineClient, *, weight_version: int = 0, retry: RetryPolicy | None = None,
                 max_context_len: int | None = None, return_logprob: bool = True,
                 batch_across_groups: bool = False, routed_experts: RoutingShape | None = None,
                 top_logprobs_num: int = 0) -> None:
        self.client = client
        self.top_logprobs_num = top_logprobs_num
        """> 0: ask the engines for each generated token's top-k log-probs (score centering; top_logprobs.py)."""
        self.routed_experts = routed_experts
        """Ask the engines for each token's routed experts (`training.use_rollout_routing_replay`), of this
        shape; every answer with tokens must carry them (the sample keeps the last answer's, which cover
        its whole sequence: each request sends prompt + response so far)."""
        self.batch_across_groups = batch_across_groups
        """Requests of different groups sent at the same moment may share a batched request (True when the
        caller waits for every group anyway); False: one batched request per group, so a group's answer
        comes as soon as its own samples are done (dynamic sampling, over-sampling)."""
        self.weight_version = weight_version
        """Assumed version of tokens whose engine reports none (the controller updates it after a sync)."""
        self.retry = retry or RetryPolicy()
        self.max_context_len = max_context_len
        self.return_logprob = return_logprob
        self.stopped = asyncio.Event()
        self.no_workers_since: float | None = None
        """When the router began answering `no_available_workers` with engines serving (None: it is not)."""
        self.in_flight: set[str] = set()
        self.metrics = GenerationMetrics()
        self._changed = asyncio.Event()

    async def stop(self, *, timeout_s: float = 60.0, abort_every_s: float = 0.2) -> bool:
        """No new requests; abort on every engine until none of this session's requests is in flight.

        One abort_all, then wait while the aborted requests come back; only when none has come back for
        `abort_every_s` is abort_all sent again (a request that reached its engine just after the abort
        runs on: the next round catches it). Re-sending on every returning response made a stop with
        8,192 requests in flight on 1,024 engines a storm of 1,024-call rounds. Returns False if requests
        were still in flight after `timeout_s`.
        """
        self.stopped.set()
        await self.client.wake_waiters()  # queued requests see the flag and give up at once
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await self.client.abort_all()
            while self.in_flight and loop.time() < deadline:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=abort_every_s)
                except TimeoutError:
                    break  # nothing came back for a while: abort again
        return not self.in_flight

    def note_no_workers(self, error: TransportError) -> None:
        """The router said it has no worker: raise NoWorkersAvailable once that has lasted too long while
        the controller counts engines serving (while none serves, engines are restarting: not counted)."""
        now = time.monotonic()
        if not self.client.directory.engine_urls():
            self.no_workers_since = None
            return
        if self.no_workers_since is None:
            self.no_workers_since = now
        elif now - self.no_workers_since > self.retry.no_workers_timeout_s:
            serving = ", ".join(self.client.directory.engine_urls())
            raise NoWorkersAvailable(
                f"the router has answered '{NO_WORKERS_CODE}' for {now - self.no_workers_since:.0f} s while "
                f"engine(s) {serving} were up: its circuit breaker or health checks shut every worker out "
                f"(last answer: {error}); see logs/router.log and logs/engine-*.log")

    def _done(self, rid: str) -> None:
        self.in_flight.discard(rid)
        self._changed.set()

    async def _sleep_unless_stopped(self, delay_s: float) -> None:
        try:
            await asyncio.wait_for(self.stopped.wait(), timeout=delay_s)
        except TimeoutError:
            pass


_SESSION: contextvars.ContextVar[GenerationSession] = contextvars.ContextVar("hpc_rl_generation_session")


def current_session() -> GenerationSession:
    """The session of the running generation task (set by the scheduler / eval around each call)."""
    try:
        return _SESSION.get()
    except LookupError:
        raise RuntimeError("generate_turn called outside a rollout: no GenerationSession is active "
                           "(call it from a custom generate function run by the rollout scheduler)") from None


def response_budget(sample: Sample, sampling_params: SamplingParams, max_context_len: int | None) -> int:
    """New tokens this sample may still generate: max_new_tokens minus what it has, within the context."""
    budget = int(sampling_params.get("max_new_tokens", 128)) - sample.response_length
    if max_context_len is not None:
        budget = min(budget, max_context_len - sample.total_length)
    return budget


def _append(sample: Sample, token_ids: list[int] | array, logprobs: list[float] | array,
            versions: list[int] | array | UniformColumn, text: str, trained: bool, adopt: bool = False) -> None:
    """`adopt`: the three arrays are this call's own (read from one answer), so a fresh sample may hold them."""
    if sample.loss_mask is not None or not trained:
        if sample.loss_mask is None:
            sample.loss_mask = [1] * sample.response_length
        sample.loss_mask.extend([1 if trained else 0] * len(token_ids))
    sample.extend_response(token_ids, logprobs, versions, adopt=adopt)  # compact columns (data/samples.py)
    sample.response_text += text


def append_tool_tokens(sample: Sample, token_ids: list[int], text: str, *, weight_version: int | None = None) -> None:
    """Append tokens the model did not generate (tool output): logprob 0.0, loss_mask 0."""
    version = current_session().weight_version if weight_version is None else weight_version
    pad_top_logprobs(sample, len(token_ids))
    _append(sample, list(token_ids), [0.0] * len(token_ids), UniformColumn(version, len(token_ids)), text,
            trained=False)


def _finish(sample: Sample, status: SampleStatus, error: str | None = None) -> Sample:
    sample.status = status
    if error is not None:
        sample.metadata["error"] = error
    return sample


async def generate_turn(sample: Sample, sampling_params: SamplingParams, *,
                        session: GenerationSession | None = None, worker_reward: bool = False) -> Sample:
    """Continue `sample` until the engine stops (stop/length), the session stops, or it fails.
    `worker_reward` (the built-in single-turn generate): the answer worker may score a fresh sample's answer
    (worker_rewards.py)."""
    return await _Turns(sample, sampling_params, session or current_session(), worker_reward=worker_reward).run()


async def generate_group(samples: list[Sample], sampling_params: SamplingParams, session: GenerationSession) -> None:
    """`default_generate` of a group's samples, with one wait for their first engine call: the built-in generate
    function's path in the scheduler. Each sample's first request is made at once and all of them go to the client
    together (`EngineClient.generate_many`: one Future for the group), instead of a task, a context and a Future per
    sample (bench_scale N=256, full length, cProfile of the loop: the event loop's callbacks in a run went from 38,845
    to 23,207 and its tasks from 10,699 to 5,990). What each sample does with its answer is `_Turns.take`, as in
    `generate_turn`; a sample that needs another call (resumed after an abort it did not ask for, a retried
    transport failure) goes on alone, as `generate_turn` would. Errors as in `run_generate`: a RunEndingGenerationError
    is raised (after every answer of the call was taken), anything else fails only its sample."""
    turns = [_Turns(sample, sampling_params, session, worker_reward=True) for sample in samples]
    calls = [(turn, payload) for turn in turns if (payload := turn.request()) is not None]
    if not calls:
        return
    outcomes = await session.client.generate_many([payload for _, payload in calls], stopped=session.stopped,
                                                  group=samples[0].group_index,
                                                  across_groups=session.batch_across_groups,
                                                  reward_requests=[turn.scoring for turn, _ in calls])
    ending: RunEndingGenerationError | None = None
    again: list[Awaitable[Sample]] = []
    for (turn, _), outcome in zip(calls, outcomes):
        try:
            delay = turn.take(outcome)
        except RunEndingGenerationError as error:
            ending = ending or error
            continue
        except Exception as error:  # noqa: BLE001 - as run_generate: the sample fails, not the rollout
            _failed_by(turn.sample, session, error)
            continue
        if delay is not None or turn.to_abort is not None:
            again.append(_guarded(turn.go_on(delay), turn.sample, session))
    if ending is not None:
        raise ending
    if again:
        await asyncio.gather(*again)


async def _guarded(turns: Awaitable[Sample], sample: Sample, session: GenerationSession) -> Sample:
    """A sample's further calls in `generate_group`, with `run_generate`'s rule for errors."""
    try:
        return await turns
    except RunEndingGenerationError:
        raise
    except Exception as error:  # noqa: BLE001
        return _failed_by(sample, session, error)


def _failed_by(sample: Sample, session: GenerationSession, error: Exception) -> Sample:
    session.metrics.samples_failed += 1
    return _finish(sample, SampleStatus.FAILED, f"generate function raised {type(error).__name__}: {error}")


_RID_PREFIX = uuid.uuid4().hex[:6]
_rid_counter = itertools.count()


class _Turns:
    """One sample's engine calls: the next request (`request`), what an answer or a failure does to the sample
    (`take`: done, or wait and call again), and the loop of the two (`run`, which is `generate_turn`)."""

    __slots__ = ("sample", "sampling_params", "session", "transport_failures", "unrequested_aborts", "payload",
                 "to_abort", "worker_reward", "scoring")

    def __init__(self, sample: Sample, sampling_params: SamplingParams, session: GenerationSession, *,
                 worker_reward: bool = False) -> None:
        self.sample, self.sampling_params, self.session = sample, sampling_params, session
        self.worker_reward = worker_reward
        self.scoring: dict[str, Any] | None = None
        """What the answer worker scores of the last request's answer (worker_rewards.reward_request), or None."""
        self.transport_failures = 0
        self.unrequested_aborts = 0
        self.payload: dict[str, Any] = {}
        self.to_abort: str | None = None
        """The rid of a failed request to abort before the next one (`settle`)."""

    async def run(self) -> Sample:
        """Call the engine until the sample is finished (its status set)."""
        session = self.session
        while (payload := self.request()) is not None:
            outcome: GenerateAnswer | Exception
            try:
                outcome = await session.client.generate(payload, stopped=session.stopped,
                                                        group=self.sample.group_index,
                                                        across_groups=session.batch_across_groups,
                                                        reward_request=self.scoring)
            except (StopGeneration, EngineHTTPError, TransportError) as error:
                outcome = error
            if not await self.settle(self.take(outcome)):
                break
        return self.sample

    async def go_on(self, delay: float | None) -> Sample:
        """After a `take` made outside `run` (generate_group): settle it, and call again if the sample needs it."""
        if await self.settle(delay):
            await self.run()
        return self.sample

    async def settle(self, delay: float | None) -> bool:
        """After `take`: abort a failed request wherever it may still run (a timeout, not a death), then wait
        `delay`; False when the sample is finished."""
        if self.to_abort is not None:
            rid, self.to_abort = self.to_abort, None
            await self.session.client.abort(rid)
        if delay is None:
            return False
        await self.session._sleep_unless_stopped(delay)
        return True

    def request(self) -> dict[str, Any] | None:
        """The next /generate payload (its rid counted in flight), or None when the sample is finished: no
        response budget left (TRUNCATED) or the session stopped (ABORTED)."""
        sample, sampling_params, session = self.sample, self.sampling_params, self.session
        budget = response_budget(sample, sampling_params, session.max_context_len)
        if budget <= 0:
            _finish(sample, SampleStatus.TRUNCATED)
            return None
        if session.stopped.is_set():
            _finish(sample, SampleStatus.ABORTED)
            return None
        rid = f"s{sample.index}-{_RID_PREFIX}{next(_rid_counter):x}"
        sample.rid = rid
        payload = {
            "rid": rid,
            "input_ids": [*sample.prompt_token_ids, *sample.column("response_token_ids")],
            "sampling_params": {**sampling_params, "max_new_tokens": budget},
            "return_logprob": session.return_logprob,
        }
        if sample.images:  # SGLang's image_data, with the ids' pad runs already expanded (a resume sends them again)
            payload["image_data"] = [image_data_url(ref) for ref in sample.images]
        if session.routed_experts is not None:
            payload[REQUEST_FIELD] = True
        if session.top_logprobs_num > 0:
            payload["return_logprob"] = True
            payload[TOP_LOGPROBS_FIELD] = session.top_logprobs_num
        session.in_flight.add(rid)
        session.metrics.requests_sent += 1
        self.scoring = reward_request(session.client, sample) if self.worker_reward else None
        self.payload = payload
        return payload

    def take(self, outcome: GenerateAnswer | Exception) -> float | None:
        """Apply the outcome of the last request: None when the sample is finished (its status set), else the
        seconds to wait before the next request (a retried failure, an abort the session did not ask for)."""
        sample, session, payload = self.sample, self.session, self.payload
        metrics, retry = session.metrics, session.retry
        session._done(payload["rid"])
        if isinstance(outcome, StopGeneration):
            metrics.requests_sent -= 1  # never left the client
            _finish(sample, SampleStatus.ABORTED)
            return None
        if isinstance(outcome, Exception):
            failure = outcome
            if isinstance(outcome, EngineHTTPError):
                metrics.requests_http_failed += 1
                if outcome.status in AUTH_STATUSES:
                    metrics.samples_failed += 1
                    _finish(sample, SampleStatus.FAILED, str(outcome))
                    return None
                if outcome.status not in RETRIED_CLIENT_STATUSES:
                    raise RequestRejected(outcome.status, engine_error_message(str(outcome).partition(": ")[2]),
                                          payload["sampling_params"]) from None
            elif isinstance(outcome, TransportError):
                metrics.requests_transport_failed += 1
                if NO_WORKERS_CODE in str(outcome):
                    session.note_no_workers(outcome)
            else:
                raise outcome
            # a failure worth retrying: transport, 408, 429
            self.transport_failures += 1
            self.to_abort = payload["rid"]  # it may still run somewhere (a timeout, not a death): `settle`
            if self.transport_failures > retry.max_transport_retries:
                metrics.samples_failed += 1
                _finish(sample, SampleStatus.FAILED,
                        f"{self.transport_failures} transport failures in a row, last: {failure}")
                return None
            metrics.requests_retried += 1
            return min(retry.max_delay_s, retry.base_delay_s * 2 ** (self.transport_failures - 1))
        session.no_workers_since = None
        self.transport_failures = 0
        body = outcome.body
        meta = body.get("meta_info") or {}
        output_ids = body.get("output_ids") or []
        # Arrays from answer_pool.compact_answers are kept as they are: the sample holds compact columns.
        token_ids = output_ids if isinstance(output_ids, array) else list(map(int, output_ids))
        logprobs = output_logprobs(meta.get("output_token_logprobs") or [])
        if len(logprobs) != len(token_ids):  # none asked for, or a malformed answer: pad or cut
            logprobs = (list(logprobs) + [0.0] * len(token_ids))[:len(token_ids)]
        versions = weight_version_column(meta, len(token_ids), session.weight_version)
        if session.routed_experts is not None:
            _keep_routed_experts(sample, meta, session.routed_experts, len(payload["input_ids"]) + len(token_ids),
                                 generated=bool(token_ids))
        if session.top_logprobs_num > 0:
            try:
                head = top_logprobs_from_answer(meta, n_tokens=len(token_ids), k=session.top_logprobs_num)
            except TopLogprobsError as error:
                raise RunEndingGenerationError(f"sample {sample.index}: {error}") from None
            append_top_logprobs(sample, *head)
        text = str(body.get("text") or "")
        # The answer's arrays were made for this exchange (answer_workers.array_targets in the frame reader,
        # compact_answers; the version column just above) and nothing reads the body's after this: a fresh sample
        # holds them, uncopied.
        _append(sample, token_ids, logprobs, versions, text, trained=True, adopt=True)
        keep_reward(session.client.worker_rewards, sample, self.scoring, body, payload["rid"], text)
        metrics.generated_tokens += len(token_ids)
        reason = meta.get("finish_reason")
        finish = reason.get("type") if isinstance(reason, dict) else reason
        if finish == "abort":
            metrics.requests_aborted += 1
            if session.stopped.is_set():
                _finish(sample, SampleStatus.ABORTED)
                return None
            # Not ours: the engine was paused (weight update) or preempted. Resume with the new policy.
            self.unrequested_aborts = 0 if token_ids else self.unrequested_aborts + 1
            if self.unrequested_aborts > retry.max_unrequested_aborts:
                metrics.samples_failed += 1
                _finish(sample, SampleStatus.FAILED,
                        f"aborted {self.unrequested_aborts} times in a row without progress: {meta.get('finish_reason')}")
                return None
            metrics.requests_resumed += 1
            return min(retry.max_delay_s, 0.05 * (1 + self.unrequested_aborts))
        metrics.requests_finished += 1
        _finish(sample, SampleStatus.TRUNCATED if finish == "length" else SampleStatus.COMPLETED)
        return None


def _keep_routed_experts(sample: Sample, meta: dict[str, Any], shape: RoutingShape, sequence_length: int, *,
                         generated: bool) -> None:
    """The answer's routed experts replace the sample's (they cover its whole sequence). An answer
    without any is fine only when it generated nothing (aborted while queued, or no engine call)."""
    try:
        routing = routed_experts_from_answer(meta, shape=shape, sequence_length=sequence_length)
    except RoutedExpertsError as error:
        raise RunEndingGenerationError(f"sample {sample.index}: {error}") from None
    if routing is not None:
        sample.routed_experts = routing
    elif generated:
        raise RunEndingGenerationError(
            "training.use_rollout_routing_replay is set but the engine answered without meta_info.routed_experts: "
            "it was not launched with --enable-return-routed-experts (hpc_rl adds it to the engines it starts; "
            "an engine started by hand needs it), or it does not serve a MoE model")


async def default_generate(args: Any, sample: Sample, sampling_params: SamplingParams) -> Sample:
    """The built-in single-turn generate function."""
    return await generate_turn(sample, sampling_params, worker_reward=True)


def load_generate_function(path: str | None) -> GenerateFn:
    """`custom_generate_function_path` resolved and signature-checked; None -> `default_generate`."""
    if path is None:
        return default_generate
    from hpc_rl.plugins import load_plugin

    return load_plugin("generate", path)


async def run_generate(fn: GenerateFn, args: Any, sample: Sample, sampling_params: SamplingParams,
                       session: GenerationSession) -> Sample:
    """Call a generate function inside `session`; its exceptions make the sample FAILED, not the run,
    except a `RunEndingGenerationError` (raised on, through the scheduler, to end the run)."""
    token = _SESSION.set(session)
    try:
        result = await fn(args, sample, dict(sampling_params))
        if not isinstance(result, Sample):
            raise TypeError(f"generate function returned {type(result).__name__}, expected Sample")
        if result.status is SampleStatus.PENDING:
            result.status = SampleStatus.ABORTED if session.stopped.is_set() else SampleStatus.COMPLETED
        return result
    except StopGeneration:
        return _finish(sample, SampleStatus.ABORTED)
    except RunEndingGenerationError:
        raise  # no retry can help: the rollout stops and the run ends with this message
    except Exception as error:  # noqa: BLE001 - a user's function must not kill the rollout
        session.metrics.samples_failed += 1
        return _finish(sample, SampleStatus.FAILED, f"generate function raised {type(error).__name__}: {error}")
    finally:
        _SESSION.reset(token)
