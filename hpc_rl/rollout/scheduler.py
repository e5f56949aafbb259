"""The rollout scheduler: prompt groups -> generation -> rewards -> dynamic sampling -> partial buffer.

Owns one rollout step, `await RolloutScheduler.run(rollout_id, weight_version)`:

    groups in:  partial buffer first (buffer filter, default FIFO; stale samples reset), then the
                prompt source (next_records -> encode -> make_group; a prompt longer than max_prompt_len is
                dropped, counted, the first named); first wave = over_sampling_batch_size
    per group:  generate every unfinished sample concurrently (generate fn, via GenerationSession)
                -> as soon as the whole group is generated: reward_fn(group) (concurrently with others)
    as groups finish:  failed sample -> drop("failed"); filter(args, group) -> keep | drop(reason);
                refill exactly the missing groups: rollout_batch_size - kept - in flight
    when kept == rollout_batch_size:
                session.stop(): abort_all on every engine until none of our requests runs;
                cancel reward calls still running (never wait on a slow reward);
                unfinished groups -> partial buffer with start_rollout_id (partial_rollout) or dropped
    out:        RolloutResult(groups: exactly rollout_batch_size, metrics)

Async mode: `run` may be called for rollout k+1 while the trainer trains rollout k; weights can be
updated under it (the engines pause with abort: requests come back aborted, are resumed, and every
token carries the version that generated it). Call `set_weight_version(v)` after each sync. The
staleness rule is in partial_buffer.py. One `run` at a time per scheduler.

Also owns the scheduler's checkpoint: buffer, group/sample index counters, prompt cursor.
Does not own: HTTP (engine_client.py), a sample's generation (generate.py), reward rules (hpc_rl.rewards),
the prompt length limit (context_length.py, re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.data.prompts import DataError, PromptEncoder, PromptSource, encode_record, make_group
from hpc_rl.data.samples import Group, Sample, SampleStatus
from hpc_rl.rollout.context_length import (  # noqa: F401  (re-exported: callers import them from here)
    length_limit,
    prompt_length_limit,
)
from hpc_rl.rollout.engine_client import EngineClient
from hpc_rl.rollout.filters import GroupFilter, filter_verdict, load_buffer_filter, load_group_filter
from hpc_rl.rollout.generate import (
    GenerateFn,
    GenerationSession,
    RetryPolicy,
    SamplingParams,
    default_generate,
    generate_group,
    load_generate_function,
    rollout_sampling_params,
    run_generate,
)
from hpc_rl.rollout.metrics import RolloutMetrics
from hpc_rl.rollout.sample_metrics import SampleMetricOptions, sample_metrics
from hpc_rl.rollout.sample_plugins import SamplePlugins
from hpc_rl.rollout.partial_buffer import (
    FINISHED,
    PartialRolloutBuffer,
    mask_offpolicy,
    reset_sample,
    trained_token_staleness,
    version_range,
    violates_staleness,
)
from hpc_rl.rollout.routed_experts import RoutingShape

log = logging.getLogger(__name__)

RewardFn = Callable[[list[Sample]], Awaitable[list[float]]]
"""Scores one group: one float per sample, in order (e.g. a partial of `hpc_rl.rewards.reward_group`)."""


@dataclass
class RolloutResult:
    groups: list[Group]
    """Exactly `rollout_batch_size` kept groups, generated and scored."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class SchedulerSettings:
    """The rollout config fields the scheduler reads."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    over_sampling_batch_size: int | None = None
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    max_staleness: int | None = None
    max_context_len: int | None = None
    max_dropped_per_kept: int = 100
    """Give up (raise) when the filter dropped this many groups per group wanted: the filter or reward is broken."""
    max_prompt_len: int | None = None
    """Longer prompts (tokens) are dropped when drawn; None: no limit."""
    max_prompt_len_why: str = ""
    """Where the limit comes from, for the message."""
    routed_experts: RoutingShape | None = None
    """Ask the engines for each token's routed experts, of this shape (`training.use_rollout_routing_replay`)."""
    top_logprobs_num: int = 0
    """> 0: ask the engines for each generated token's top-k log-probs (`algorithm.use_score_centering`)."""

    @classmethod
    def from_config(cls, rollout: Any, engine_context_len: int | None = None,
                    routed_experts: RoutingShape | None = None, top_logprobs_num: int = 0) -> SchedulerSettings:
        limit, why = prompt_length_limit(rollout, engine_context_len)
        return cls(rollout_batch_size=rollout.rollout_batch_size, n_samples_per_prompt=rollout.n_samples_per_prompt,
                   over_sampling_batch_size=rollout.over_sampling_batch_size,
                   partial_rollout=rollout.partial_rollout,
                   mask_offpolicy_in_partial_rollout=rollout.mask_offpolicy_in_partial_rollout,
                   max_staleness=rollout.max_staleness, max_context_len=rollout.rollout_max_context_len,
                   max_prompt_len=limit, max_prompt_len_why=why, routed_experts=routed_experts,
                   top_logprobs_num=top_logprobs_num)


class _GroupRun:
    """One group's task and whether it is being scored (those are cancelled, not awaited, on stop)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.scoring = False
        self.task: asyncio.Task[str] | None = None


class RolloutScheduler:
    """Runs rollout steps over a shared `EngineClient`; keeps the partial buffer between them."""

    def __init__(self, *, settings: SchedulerSettings, client: EngineClient, source: PromptSource,
                 encoder: PromptEncoder, reward_fn: RewardFn, sampling_params: SamplingParams, args: Any = None,
                 group_filter: GroupFilter | None = None, buffer: PartialRolloutBuffer | None = None,
                 generate_fn: GenerateFn = default_generate, retry: RetryPolicy | None = None,
                 stop_timeout_s: float = 60.0, metric_options: SampleMetricOptions | None = None,
                 plugins: SamplePlugins | None = None) -> None:
        self.settings = settings
        self.client = client
        self.source = source
        self.encoder = encoder
        self.reward_fn = reward_fn
        self.sampling_params = dict(sampling_params)
        self.args = args
        self.group_filter = group_filter
        self.buffer = buffer if buffer is not None else PartialRolloutBuffer(args=args)
        self.generate_fn = generate_fn
        self.retry = retry or RetryPolicy()
        self.stop_timeout_s = stop_timeout_s
        self.metric_options = metric_options or SampleMetricOptions()
        """slime's optional --log-* sample metrics of the kept groups."""
        self.plugins = plugins or SamplePlugins()
        """slime's sample hooks, sample filter, all-samples process and rollout log function."""
        self._rollout_id: int | None = None
        self._filtered_out: list[Group] = []
        """This rollout's scored groups the dynamic-sampling filter dropped (for the all-samples process)."""
        self.next_group_index = 0
        self.next_sample_index = 0
        self.weight_version = 0
        self._session: GenerationSession | None = None
        self._running = False
        self._changes = 0
        """Bumped by whatever may change the state (`run`, `load_state_dict`): a `snapshot` of the same count is
        the state now."""
        self._snapshot: tuple[int, dict[str, Any]] | None = None
        self._too_long_said = False
        self._too_long_in_a_row = 0

    @classmethod
    def from_config(cls, rollout: Any, *, args: Any, client: EngineClient, source: PromptSource,
                    encoder: PromptEncoder, reward_fn: RewardFn, routed_experts: RoutingShape | None = None,
                    top_logprobs_num: int = 0, **overrides: Any) -> RolloutScheduler:
        """Everything from the rollout section (`RolloutConfig`); `args` is what plug-ins receive
        (`hpc_rl.config.plugin_args`). Plug-ins are resolved here: a bad path fails before generation."""
        kwargs: dict[str, Any] = {
            "settings": SchedulerSettings.from_config(rollout, getattr(client, "context_length", None),
                                                      routed_experts, top_logprobs_num),
            "client": client, "source": source,
            "encoder": encoder, "reward_fn": reward_fn, "sampling_params": rollout_sampling_params(rollout),
            "args": args, "group_filter": load_group_filter(rollout.dynamic_sampling_filter_path),
            "buffer": PartialRolloutBuffer(load_buffer_filter(rollout.buffer_filter_path), args=args,
                                           sort_by_staleness=rollout.buffer_sort_by_staleness),
            "generate_fn": load_generate_function(rollout.custom_generate_function_path)}
        kwargs.update(overrides)
        return cls(**kwargs)

    def set_weight_version(self, version: int) -> None:
        """The engines now serve `version` (call after each weight sync, also during a run)."""
        self.weight_version = version
        if self._session is not None:
            self._session.weight_version = version

    # -- groups in -----------------------------------------------------------------------------------
    def _next_groups(self, rollout_id: int, count: int, metrics: RolloutMetrics) -> list[Group]:
        groups = self.buffer.take(rollout_id, count) if count > 0 else []
        metrics.groups_from_buffer += len(groups)
        for group in groups:
            for sample in group:
                if violates_staleness(sample, self.weight_version, self.settings.max_staleness):
                    metrics.wasted_tokens += reset_sample(sample)
                    metrics.samples_stale_reset += 1
        n = self.settings.n_samples_per_prompt
        while len(groups) < count:
            for record in self.source.next_records(count - len(groups)):
                prompt_token_ids = encode_record(self.encoder, record)
                if self._too_long(record, len(prompt_token_ids), metrics):
                    continue
                groups.append(make_group(record, group_index=self.next_group_index,
                                         first_sample_index=self.next_sample_index, n_samples=n,
                                         prompt_token_ids=prompt_token_ids))
                self.next_group_index += 1
                self.next_sample_index += n
        metrics.groups_submitted += len(groups)
        return groups

    def _too_long(self, record: Any, length: int, metrics: RolloutMetrics) -> bool:
        """Whether the prompt is dropped for its length (counted; the first one is named in the log)."""
        limit = self.settings.max_prompt_len
        if limit is None or length <= limit:
            self._too_long_in_a_row = 0
            return False
        metrics.prompts_too_long += 1
        self._too_long_in_a_row += 1
        where = getattr(self.source.dataset, "path", "the prompt data")
        if self._too_long_in_a_row > len(self.source.dataset):
            raise DataError(f"{where}: every prompt drawn in a whole pass is longer than {limit} tokens "
                            f"({self.settings.max_prompt_len_why}); shorten them or raise the limit")
        if not self._too_long_said:
            self._too_long_said = True
            log.warning("%s: data row %d has %d prompt tokens, more than %d (%s): such prompts are dropped when "
                        "drawn, counted in rollout/prompts_too_long (said once)", where, record.row, length, limit,
                        self.settings.max_prompt_len_why)
        return True

    async def _process_group(self, run: _GroupRun, session: GenerationSession) -> str:
        """'scored' | 'failed' | 'unfinished' (the session stopped before the group was generated)."""
        todo = [s for s in run.group if s.status not in FINISHED]
        if self.generate_fn is default_generate:  # the built-in: one wait for the group (generate_group)
            if todo:
                await generate_group(todo, self.sampling_params, session)
        else:
            await asyncio.gather(*(run_generate(self.generate_fn, self.args, s, self.sampling_params, session)
                                   for s in todo))
        failed = [s for s in run.group if s.status is SampleStatus.FAILED]
        if failed:
            log.warning("group %d dropped: sample %d failed: %s", run.group[0].group_index, failed[0].index,
                        failed[0].metadata.get("error", "no error recorded"))
            return "failed"
        if session.stopped.is_set() or any(s.status not in FINISHED for s in run.group):
            return "unfinished"
        await self.plugins.apply_hooks_to_group(self.args, run.group, rollout_id=self._rollout_id, evaluation=False)
        run.scoring = True
        rewards = await self.reward_fn(run.group)
        if len(rewards) != len(run.group):
            raise ValueError(f"reward function returned {len(rewards)} rewards for a group of {len(run.group)}")
        for sample, reward in zip(run.group, rewards):
            sample.reward = float(reward)
        return "scored"

    def _drop(self, group: Group, reason: str, metrics: RolloutMetrics) -> None:
        metrics.groups_dropped[reason] += 1
        metrics.wasted_tokens += sum(s.response_length for s in group)

    # -- one rollout ---------------------------------------------------------------------------------
    async def run(self, rollout_id: int, weight_version: int | None = None) -> RolloutResult:
        """Exactly `rollout_batch_size` kept, scored groups (see the module docstring)."""
        if self._running:
            raise RuntimeError("RolloutScheduler.run is already running: one rollout at a time")
        self._running = True
        self._changes += 1
        started = time.monotonic()
        if weight_version is not None:
            self.weight_version = weight_version
        settings = self.settings
        target = settings.rollout_batch_size
        metrics = RolloutMetrics()
        self._rollout_id, self._filtered_out = rollout_id, []
        # Without a filter or over-sampling every submitted group is waited for: batch across groups.
        every_group_needed = self.group_filter is None and (settings.over_sampling_batch_size or target) <= target
        session = GenerationSession(self.client, weight_version=self.weight_version, retry=self.retry,
                                    max_context_len=settings.max_context_len, batch_across_groups=every_group_needed,
                                    routed_experts=settings.routed_experts,
                                    top_logprobs_num=settings.top_logprobs_num)
        self._session = session
        kept: list[Group] = []
        surplus: list[Group] = []
        runs: dict[asyncio.Task[str], _GroupRun] = {}
        finished: asyncio.Queue[asyncio.Task[str]] = asyncio.Queue()
        first_wave = True
        failed = True
        try:
            while len(kept) < target:
                missing = target - len(kept) - len(runs)
                if first_wave:
                    missing = max(missing, settings.over_sampling_batch_size or target)
                    first_wave = False
                for group in self._next_groups(rollout_id, missing, metrics):
                    run = _GroupRun(group)
                    run.task = asyncio.create_task(self._process_group(run, session))
                    run.task.add_done_callback(finished.put_nowait)
                    runs[run.task] = run
                # A queue of finished tasks, not asyncio.wait over all of them: O(1) per group.
                done = [await finished.get()]
                while not finished.empty():
                    done.append(finished.get_nowait())
                for task in done:
                    outcome = task.result()  # a reward error propagates; the group stays in `runs`
                    group = runs.pop(task).group
                    if outcome == "failed":
                        self._drop(group, "failed", metrics)
                    elif len(kept) >= target:
                        surplus.append(group)
                    else:
                        keep, reason = (True, None) if self.group_filter is None else \
                            filter_verdict(self.group_filter(self.args, group))
                        if keep:
                            kept.append(group)
                        else:
                            self._drop(group, reason or "filter", metrics)
                            self._filtered_out.append(group)
                dropped = sum(metrics.groups_dropped.values())
                if dropped > settings.max_dropped_per_kept * target:
                    raise RuntimeError(
                        f"rollout {rollout_id}: {dropped} groups dropped for {len(kept)} kept "
                        f"({dict(metrics.groups_dropped)}); check the dynamic sampling filter and the reward")
            failed = False
        finally:
            leftovers = await self._stop(session, runs, metrics)
            self._session = None
            self._running = False
            self._settle(leftovers + surplus + (kept if failed else []), rollout_id, metrics)
        self._finish_kept(kept, metrics)
        metrics.buffer_size = len(self.buffer)
        metrics.wall_time_s = time.monotonic() - started
        removed = self.plugins.filter_kept(self.args, kept)
        self.plugins.process_all(self.args, kept + self._filtered_out, self.source)
        self._filtered_out = []
        out = {**metrics.as_dict(), **session.metrics.as_dict(), **_sample_stats(kept, self.weight_version),
               **sample_metrics(kept, self.metric_options, "rollout/")}
        if self.plugins.sample_filter is not None:
            out["rollout/samples_removed_by_filter"] = float(removed)
        if self.plugins.skip_rollout_scalars(rollout_id, self.args, kept, out, metrics.wall_time_s):
            out = {key: value for key, value in out.items() if not key.startswith("rollout/")}
        return RolloutResult(groups=kept, metrics=out)

    async def _stop(self, session: GenerationSession, runs: dict[asyncio.Task[str], _GroupRun],
                    metrics: RolloutMetrics) -> list[Group]:
        """Abort what runs, cancel rewards in progress, wait for generation tasks; return their groups."""
        if not await session.stop(timeout_s=self.stop_timeout_s):
            log.warning("requests %s still in flight %.0f s after abort_all", sorted(session.in_flight),
                        self.stop_timeout_s)
        for run in runs.values():
            if run.scoring:
                run.task.cancel()  # type: ignore[union-attr]
        if runs:
            _, pending = await asyncio.wait(list(runs), timeout=self.stop_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        return [run.group for run in runs.values()]

    def _settle(self, groups: list[Group], rollout_id: int, metrics: RolloutMetrics) -> None:
        """Unfinished (or surplus) groups: to the buffer with partial_rollout, else dropped."""
        for group in groups:
            if any(s.status is SampleStatus.FAILED for s in group):
                self._drop(group, "failed", metrics)
            elif self.settings.partial_rollout:
                self.buffer.add([group], rollout_id)
                metrics.groups_to_buffer += 1
            else:
                self._drop(group, "unfinished", metrics)

    def _finish_kept(self, kept: list[Group], metrics: RolloutMetrics) -> None:
        metrics.groups_kept = len(kept)
        for group in kept:
            for sample in group:
                if self.settings.mask_offpolicy_in_partial_rollout:
                    mask_offpolicy(sample, self.weight_version)
                metrics.kept_response_tokens += sample.response_length

    # -- checkpoint ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able: buffer, index counters, prompt cursor (take it between runs)."""
        return {"version": 1, "next_group_index": self.next_group_index,
                "next_sample_index": self.next_sample_index, "weight_version": self.weight_version,
                "buffer": self.buffer.state_dict(), "prompt_source": self.source.state_dict()}

    def snapshot(self) -> dict[str, Any]:
        """`state_dict()` with the buffer as a `BufferSnapshot` (memory copies of its samples, no JSON lists:
        what the controller keeps at each rollout boundary; `buffer_snapshot.json_state` makes it `state_dict()`'s
        form). `load_state_dict` takes either. Taken once per state: the one a rollout leaves is the next one's
        start unless a `run` or `load_state_dict` came between (only its weight version may differ: a sync), so
        it is returned again (nobody changes a snapshot)."""
        cached = self._snapshot
        if cached is not None and cached[0] == self._changes and not self._running:
            state = cached[1]
            return state if state["weight_version"] == self.weight_version else {
                **state, "weight_version": self.weight_version}
        state = {"version": 1, "next_group_index": self.next_group_index,
                 "next_sample_index": self.next_sample_index, "weight_version": self.weight_version,
                 "buffer": self.buffer.snapshot(), "prompt_source": self.source.state_dict()}
        if not self._running:
            self._snapshot = (self._changes, state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"rollout scheduler checkpoint has version {state.get('version')!r}, expected 1")
        self._changes += 1
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self.weight_version = state["weight_version"]
        self.buffer.load_state_dict(state["buffer"])
        self.source.load_state_dict(state["prompt_source"])


def _sample_stats(groups: list[Group], current_version: int) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    ranges = [version_range(versions) if len(versions) else None
              for versions in (s.column("weight_versions") for s in samples)]
    spans = [span for span in ranges if span is not None]
    lags = [current_version - low for low, _ in spans]
    return {
        "rollout/reward_mean": sum(float(s.reward or 0.0) for s in samples) / len(samples),
        "rollout/response_len_mean": sum(s.response_length for s in samples) / len(samples),
        "rollout/truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/resumed_partial_samples": float(sum("start_rollout_id" in s.metadata for s in samples)),
        "rollout/samples_spanning_versions": float(sum(low != high for low, high in spans)),
        "rollout/staleness_max": float(max(lags)) if lags else 0.0,
        **dict(zip(("rollout/staleness_trained_mean", "rollout/staleness_trained_max"),
                   trained_token_staleness(samples, current_version, ranges=ranges))),
    }
