"""The CPU engine's scheduler thread: continuous batching, pause/abort, and weight swaps.

Owns: the waiting queue, the running batch (rows of `kv_batch.KvBatch`; for a family whose cache keeps more than
keys/values, of `state_batch.StateBatch` or `row_caches.RowCaches`), the pause state, the released-memory tags and
the weight version. One thread runs the model; HTTP handlers talk to it only through `submit` (a generation
request) and `call` (a function run on the scheduler thread between two steps), both returning futures. So a
weight update or an abort never lands in the middle of a forward pass.

    loop:  run queued calls -> if runnable: admit newcomers (prefill, first token, join batch)
                                            -> one decode step for every running row
                                            -> finished rows answer their futures, leave the batch
           else: sleep until submit/call wakes it

One module (~410 lines) on purpose: the loop, admission, the decode step and retirement all read and write the
one thread's batch, queue and pause state; the pieces with a life of their own already live apart (`kv_batch`,
`requests`, `sampling`, `memory_occupation`, `routed_experts`, `lora_serving`).
"""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from hpc_rl.engines.cpu import kv_batch
from hpc_rl.engines.cpu.faults import HOLD_POLL_S, generation_hold
from hpc_rl.engines.cpu.lora_serving import EngineLoraAdapters
from hpc_rl.engines.cpu.memory_occupation import MemoryOccupation, MemoryTagError, WeightsNotLoaded
from hpc_rl.engines.cpu.requests import (
    GenerationRequest,
    abort_reason,
    decode_in_context,
    render_response,
    response_texts,
)
from hpc_rl.engines.cpu.routed_experts import RoutedExpertsCapture
from hpc_rl.engines.cpu.sampling import find_stop_string, sample_next_tokens

log = logging.getLogger(__name__)


class EngineStateError(RuntimeError):
    """A control call SGLang would crash or refuse on; the HTTP layer answers 400 with the reason."""


class EngineFatalError(RuntimeError):
    """An error SGLang's scheduler process dies of (e.g. CUDA IPC handles of a GPU it cannot see): raised in
    a scheduler call, it reaches the caller and then ends the scheduler, and so the engine."""


class SchedulerDied(RuntimeError):
    """The scheduler thread ended on an error (e.g. an out-of-vocabulary input id): nothing runs any more.
    SGLang's process exits here; `python -m hpc_rl.engines.cpu` exits too (`on_fatal`)."""


class Scheduler:
    """Runs generation for one model on its own thread (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, max_running_requests: int,
                 context_length: int, weight_version: str,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 memory_saver: bool = False, routed_experts: RoutedExpertsCapture | None = None,
                 lora: EngineLoraAdapters | None = None, weights_cpu_backup: bool = False,
                 images: Any = None) -> None:
        self.model = model
        self.images = images
        """The engine's `vision.EngineImages` when the model sees images (`/generate` reads image_data), else None."""
        kind = kv_batch.cache_kind(model)
        if kind != "batched" and (lora is not None or routed_experts is not None):
            raise ValueError(f"{type(model).__name__} runs on transformers' own cache (its family's "
                             f"cpu_engine_cache={kind!r}): the CPU engine serves it without --enable-lora and "
                             f"--enable-return-routed-experts (neither was built or tested on that cache)")
        self.lora = lora
        """The LoRA adapters served on the model (`--enable-lora`), else None: each forward's rows use theirs."""
        if lora is not None:
            lora.in_use = lambda name: any(r.lora_path == name for r in (*self._running, *self._waiting,
                                                                          *self._admitting))
        self.routed_experts = routed_experts
        """The model's routers' choices of each forward (`--enable-return-routed-experts`), else None."""
        self.tokenizer = tokenizer
        self.max_running_requests = max_running_requests
        self.context_length = context_length
        self.weight_version = weight_version
        self.paused = False
        self._held = generation_hold()
        """A test's gate (`faults.HOLD_GENERATION`): while it says True nothing decodes; None in real runs."""
        self.memory = MemoryOccupation(model, memory_saver=memory_saver, weights_cpu_backup=weights_cpu_backup)
        """Released memory tags; with the memory saver, released weights are discarded as in SGLang."""
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._running: list[GenerationRequest] = []
        self._admitting: list[GenerationRequest] = []
        self._batch: kv_batch.AnyBatch | None = None
        self._inbox: collections.deque[tuple[Callable[[], Any] | None, concurrent.futures.Future | None,
                                             GenerationRequest | None]] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self.died: BaseException | None = None
        """Why the scheduler thread ended, if it did on an error (then every request fails at once)."""
        self.on_fatal = on_fatal
        """Called on the dying thread after the error (the engine process exits there; tests: None)."""
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)

    # ---- called from other threads -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        """Queue a request; its future resolves with the SGLang response dict."""
        self.submit_all([request])
        return request.future

    def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Queue requests together (one batched `/generate`): the scheduler wakes once, after the last, so
        they are prefilled as one batch rather than cut wherever the thread switch fell."""
        if self.died is not None:
            for request in requests:
                request.future.set_exception(SchedulerDied(f"the engine's scheduler died: {self.died!r}"))
            return
        self._inbox.extend([(None, None, request) for request in requests])
        self._wake.set()

    def call(self, function: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `function` on the scheduler thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.died is not None:
            future.set_exception(SchedulerDied(f"the engine's scheduler died: {self.died!r}"))
            return future
        self._inbox.append((function, future, None))
        self._wake.set()
        return future

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- scheduler-thread operations (run them through `call`) --------------------------------
    def abort(self, rid: str | None, abort_all: bool) -> None:
        """Finish matching requests with finish_reason abort and their partial output."""
        keep_waiting = collections.deque()
        for request in self._waiting:
            if abort_all or request.rid == rid:
                self._finish(request, abort_reason())
            else:
                keep_waiting.append(request)
        self._waiting = keep_waiting
        survivors = []
        for index, request in enumerate(self._running):
            if abort_all or request.rid == rid:
                self._finish(request, abort_reason())
            else:
                survivors.append(index)
        self._keep_rows(survivors)

    def pause(self, mode: str) -> None:
        """SGLang's three modes. abort: end everything in flight; retract: back to the queue, KV recomputed on
        continue; in_place: the running requests stay in the batch with their KV cache and go on from there on
        continue (with whatever weights were loaded meanwhile), so until they finish `flush_cache` fails, and so
        does a weight update that asks for a flush (`check_flush`)."""
        if mode == "abort":
            self.abort(None, abort_all=True)
        elif mode == "in_place":
            pass
        elif mode == "retract":
            for request in self._running:
                request.num_retractions += 1
            self._waiting.extendleft(reversed(self._running))
            self._running = []
            self._batch = None
        else:
            raise EngineStateError(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        self.paused = True

    def resume_generation(self) -> None:
        self.paused = False

    def flush_cache(self) -> None:
        if self._running:
            raise EngineStateError("Flush cache failed.")

    def check_flush(self, flush_cache: bool) -> None:
        """A weight update's `flush_cache`: SGLang flushes after loading and asserts the flush succeeded, which
        it cannot while requests sit in the running batch (paused in place); refused here before loading."""
        if flush_cache and self._running:
            raise EngineStateError(f"Cache flush failed after updating weights: {len(self._running)} request(s) "
                                   "are paused in place with their KV cache; send flush_cache false, or pause "
                                   "with mode retract or abort")

    def release_memory(self, tags: list[str]) -> None:
        try:
            self.memory.release(tags, requests_running=bool(self._running))
        except MemoryTagError as error:
            raise EngineStateError(str(error)) from None

    def resume_memory(self, tags: list[str]) -> None:
        try:
            self.memory.resume(tags)
        except MemoryTagError as error:
            raise EngineStateError(str(error)) from None

    @property
    def released_tags(self) -> set[str]:
        return self.memory.released_tags

    def _refuse_waiting_if_weights_discarded(self) -> bool:
        """Fail every waiting request (a clear error, never garbage) while discarded weights were not reloaded."""
        refusal = self.memory.generation_refusal() if self._waiting else None
        if refusal is None:
            return False
        while self._waiting:
            request = self._waiting.popleft()
            if not request.future.done():
                request.future.set_exception(WeightsNotLoaded(refusal))
        return True

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while not self._stopping:
                self._wake.clear()
                if not self.run_iteration():
                    self._wake.wait(None if self._held is None else HOLD_POLL_S)
        except BaseException as error:  # noqa: BLE001 - a dead scheduler must end the engine, never hang it
            self._die(error)
            return
        for request in list(self._waiting) + self._running:
            self._finish(request, abort_reason("Engine shut down."))

    def _die(self, error: BaseException) -> None:
        """Fail every queued, running and future request and call `on_fatal` (SGLang's process exits on
        the same errors: an out-of-vocabulary id, a failing forward pass)."""
        self.died = error
        log.critical("CPU engine scheduler died: %r", error, exc_info=error)
        failure = SchedulerDied(f"the engine's scheduler died: {error!r}")
        pending = list(self._waiting) + self._running + self._admitting
        while self._inbox:
            function, future, request = self._inbox.popleft()
            pending.extend([request] if request is not None else [])
            if future is not None and not future.done():
                future.set_exception(failure)
        for request in pending:
            if not request.future.done():
                request.future.set_exception(failure)
        self._waiting.clear()
        self._running = []
        self._batch = None
        if self.on_fatal is not None:
            self.on_fatal(error)

    def run_iteration(self) -> bool:
        """Run queued calls, then one admit+decode step if allowed; False when there was nothing to do.
        The thread's loop body; tests call it directly to drive the scheduler step by step."""
        self._drain_inbox()
        if self.paused or self.released_tags or not (self._waiting or self._running):
            return False
        if self._held is not None and self._held():
            return False
        if self._refuse_waiting_if_weights_discarded():
            return False
        self._step()
        return True

    def _drain_inbox(self) -> None:
        while self._inbox:
            function, future, request = self._inbox.popleft()
            if request is not None:
                self._waiting.append(request)
                continue
            try:
                future.set_result(function())
            except EngineFatalError as error:
                future.set_exception(error)
                raise  # the loop dies of it (on_fatal), as SGLang's scheduler does
            except BaseException as error:  # noqa: BLE001 - handed to the HTTP handler
                future.set_exception(error)

    def _step(self) -> None:
        free = self.max_running_requests - len(self._running)
        if free > 0 and self._waiting:
            self._admitting = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            self._admit(self._admitting)
            self._admitting = []
        if self._running:
            tokens = torch.tensor([request.output_ids[-1] for request in self._running], dtype=torch.long)
            with self._adapters(self._running):
                self._batch, logits = kv_batch.decode_step(self.model, self._batch, tokens)
            if self.routed_experts is not None:
                ids = self.routed_experts.take(len(self._running), 1)
                for row, request in enumerate(self._running):
                    if request.routed_experts is not None:
                        request.routed_experts.append(ids[row])
            self._sample_and_retire(list(range(len(self._running))), logits)

    def _adapters(self, rows: list[GenerationRequest]) -> contextlib.AbstractContextManager:
        """The forward of these rows (in batch order) with each request's LoRA adapter (`lora_path`)."""
        if self.lora is None or not any(r.lora_path for r in rows):
            return contextlib.nullcontext()
        return self.lora.rows_of([r.lora_path for r in rows])

    def _admit(self, newcomers: list[GenerationRequest]) -> None:
        wants_input_logprobs = any(
            r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None for r in newcomers
        )
        with self._adapters(newcomers):  # rows of one context run once unless they differ per row (kv_batch)
            batch, last_logits, full_logits = kv_batch.prefill(
                self.model, [r.context for r in newcomers], full_logits=wants_input_logprobs,
                vision=[r.vision for r in newcomers],
                share_repeats=self.routed_experts is None and not any(r.lora_path for r in newcomers))
        if self.routed_experts is not None:  # a (re-)prefill routes every context token again
            length = max(len(r.context) for r in newcomers)
            ids = self.routed_experts.take(len(newcomers), length)
            for row, request in enumerate(newcomers):
                if request.return_routed_experts:
                    request.routed_experts = [ids[row, length - len(request.context):]]
        if full_logits is not None:
            for request, logits in zip(newcomers, full_logits):
                if request.return_logprob and request.logprob_start_len >= 0 and request.input_logprobs is None:
                    logprobs = torch.log_softmax(logits[: len(request.input_ids) - 1], dim=-1)
                    targets = torch.tensor(request.input_ids[1:], dtype=torch.long).unsqueeze(1)
                    request.input_logprobs = [None] + logprobs.gather(1, targets).squeeze(1).tolist()
        zero_budget = [i for i, r in enumerate(newcomers) if r.params.max_new_tokens == 0]
        for index in zero_budget:
            self._finish(newcomers[index], {"type": "length", "length": 0})
        live = [i for i in range(len(newcomers)) if i not in zero_budget]
        if not live:
            return
        if len(live) < len(newcomers):
            batch, last_logits = batch.select(live), last_logits[live]
            newcomers = [newcomers[i] for i in live]
        first_row = len(self._running)
        self._running.extend(newcomers)
        self._batch = kv_batch.join(self._batch, batch)
        self._sample_and_retire(list(range(first_row, len(self._running))), last_logits)

    def _sample_and_retire(self, rows: list[int], logits: torch.Tensor) -> None:
        """Sample one token for each of `rows` of the running batch; drop rows that finished."""
        requests = [self._running[row] for row in rows]
        banned = [self._banned_tokens(request) for request in requests]
        top_nums = [r.top_logprobs_num if r.return_logprob else 0 for r in requests]
        tops: list[list[list]] = []
        tokens, logprobs = sample_next_tokens(
            logits, [r.params for r in requests], [r.generator for r in requests], banned,
            top_logprobs_num=top_nums if any(top_nums) else None, top_logprobs=tops,
        )
        finished_rows = set()
        finished = []
        for index, (row, request, token, logprob) in enumerate(zip(rows, requests, tokens.tolist(), logprobs.tolist())):
            request.append(token, logprob, self.weight_version)
            if tops and request.output_top_logprobs is not None:
                request.output_top_logprobs.append(tops[index])
            reason = self._finish_reason(request, token)
            if reason is not None:
                request.finish_reason = reason
                finished.append(request)
                finished_rows.add(row)
            elif request.on_progress is not None:
                request.on_progress(request)
        self._answer(finished)
        if finished_rows:
            self._keep_rows([i for i in range(len(self._running)) if i not in finished_rows])

    def _keep_rows(self, indices: list[int]) -> None:
        if len(indices) == len(self._running):
            return
        self._running = [self._running[i] for i in indices]
        self._batch = self._batch.select(indices) if indices and self._batch is not None else None

    def _banned_tokens(self, request: GenerationRequest) -> list[int]:
        if len(request.output_ids) >= request.params.min_new_tokens:
            return []
        # SGLang's min_new_tokens penalizer holds back stop ids and EOS, with or without ignore_eos.
        return [*request.params.stop_token_ids, *self.eos_token_ids]

    def _finish_reason(self, request: GenerationRequest, token: int) -> dict | None:
        """SGLang's order (schedule_batch `update_finish_state`): stop string, then stop token / EOS
        (none of them with `ignore_eos`, which also ignores `stop_token_ids`), then length."""
        params = request.params
        if params.stop and len(request.output_ids) >= params.min_new_tokens:
            text = decode_in_context(self.tokenizer, request.input_ids, request.output_ids,
                                     params.skip_special_tokens)
            found = find_stop_string(text, params.stop)
            if found is not None:
                return {"type": "stop", "matched": found[0]}
        if not params.ignore_eos and (token in params.stop_token_ids or token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(request.output_ids)}
        if len(request.input_ids) + len(request.output_ids) >= self.context_length:
            return {"type": "length", "length": len(request.output_ids)}
        return None

    def _finish(self, request: GenerationRequest, reason: dict) -> None:
        request.finish_reason = reason
        self._answer([request])

    def _answer(self, finished: list[GenerationRequest]) -> None:
        """Resolve the futures of finished requests (texts decoded in one batch)."""
        finished = [request for request in finished if not request.future.done()]
        for request, text in zip(finished, response_texts(finished, self.tokenizer)):
            request.future.set_result(render_response(request, tokenizer=self.tokenizer,
                                                      weight_version=self.weight_version, text=text))
