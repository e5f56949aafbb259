"""SGLang's HTTP API on aiohttp, served by the CPU engine's scheduler.

Owns: the handlers behind SGLang's routes (the route table, the api-key rule and the JSON helpers
are hpc_rl.engines.http_api's, shared with the simulated engines) and request/response JSON shapes, except the
weight endpoints and the weight-update session (`/begin_weight_update` ... `/end_weight_update`, required as in
SGLang 0.5.23), which are `weight_routes`'s, and the LoRA ones (`lora_routes`'s). Model work happens
on the scheduler thread (`Scheduler.call`). As node-rank 0 of a multi-node
engine it forwards weight and memory commands to the other node-ranks (`node_group`) on that thread too.

Authentication, as SGLang 0.5.23's `--api-key` (srt/utils/auth.py): with a key, every endpoint needs
`Authorization: Bearer <key>` (401 otherwise), `/generate` and the info endpoints included; only
`/health*`, `/ready*`, `/metrics*` and OPTIONS stay open. sglang-router sends the key to a worker when
it was added with `POST /workers {"url", "api_key"}` (hpc_rl.engines.router).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from hpc_rl.config.fp8_scheme import read_fp8_blocks
from hpc_rl.engines.cpu.faults import EXIT_IN_GENERATE, fail_here_if_asked
from hpc_rl.engines.cpu.follower import loaded_digest
from hpc_rl.engines.cpu.memory_occupation import WeightsNotLoaded
from hpc_rl.engines.cpu.node_group import EngineNodes, FollowerFailed, same_digest
from hpc_rl.engines.cpu.requests import GenerationRequest, RequestError, parse_generate_body, render_response
from hpc_rl.engines.cpu.scheduler import EngineFatalError, EngineStateError, Scheduler, SchedulerDied
from hpc_rl.engines.cpu.weight_sync import WeightUpdateGroups
from hpc_rl.engines.cpu.lora_routes import LoraRoutes
from hpc_rl.engines.cpu.weight_routes import WeightRoutes
from hpc_rl.engines.http_api import add_sglang_routes, authorized, json_response, sglang_http_errors, unauthorized
from hpc_rl.engines.http_api import fail as _fail
from hpc_rl.engines.http_api import json_body as _json_body
from hpc_rl.engines.http_api import read_json as _read_json
from hpc_rl.engines.http_api import validation_error as _validation_error
from hpc_rl.weights.fp8_blocks import Fp8Intake

log = logging.getLogger(__name__)

CPU_ENGINE_VERSION = "0.5.23+hpc_rl.cpu"
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")
"""SGLang 0.5.23's /flush_cache answer (200, plain text)."""
ALL_MEMORY_TAGS = ["weights", "kv_cache", "cuda_graph"]


@dataclass(kw_only=True)
class ServerInfo:
    """What `/server_info` and `/model_info` report."""

    model_path: str
    host: str
    port: int
    api_key: str | None
    max_running_requests: int
    context_length: int
    architectures: list[str] = field(default_factory=list)
    model_type: str = ""
    dtype: str = "float32"
    base_gpu_id: int = 0
    weight_version: str = "default"
    """The launch value (`--weight-version`), what SGLang's /server_info reports."""


class EngineServer(LoraRoutes, WeightRoutes):
    """The aiohttp application around one `Scheduler` (its LoRA endpoints: `lora_routes`; its weight endpoints:
    `weight_routes`)."""

    def __init__(self, scheduler: Scheduler, info: ServerInfo, *, nodes: EngineNodes | None = None) -> None:
        self.scheduler = scheduler
        self.info = info
        self.groups = WeightUpdateGroups()
        self.in_weight_update = False
        self.requests_total = 0
        """Generation requests finished (each of a batch counts), SGLang's sglang:num_requests_total."""
        self.nodes = nodes
        """A multi-node engine's node-ranks (this process is node-rank 0); None on one node."""
        fp8 = read_fp8_blocks(info.model_path)
        self.fp8 = Fp8Intake(fp8.block) if fp8 is not None else None
        """A block-FP8 checkpoint: the trainer's syncs send e4m3 weights + weight_scale_inv, dequantized here in
        pairs (a pair may span buckets) as SGLang's FP8 linear layers would use them."""

    # ---- plumbing ------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[sglang_http_errors, self._auth], client_max_size=1 << 30)
        add_sglang_routes(app, self)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app: web.Application) -> None:
        if self.nodes is not None:
            try:
                await self._on_scheduler(self.nodes.stop_followers)
            except (SchedulerDied, RuntimeError) as error:
                log.warning("the other node-ranks were not told to stop: %s", error)
        await asyncio.to_thread(self.scheduler.stop)

    def _forward(self, command: dict[str, Any], loaded: list[str] | None = None) -> None:
        """Node-rank 0 (scheduler thread): run `command` on the other node-ranks; with `loaded` (the names this
        node just loaded), their weights must equal this node's. A follower's fatal refusal, or a follower gone,
        ends this engine (SGLang's engine dies with any of its schedulers)."""
        if self.nodes is None:
            return
        own = {"digest": loaded_digest(self.scheduler.model, loaded)} if loaded is not None else {}
        try:
            answers = self.nodes.forward(command)
        except FollowerFailed as error:
            if error.fatal:
                raise EngineFatalError(str(error)) from error
            raise RuntimeError(str(error)) from error
        except RuntimeError as error:
            raise EngineFatalError(f"a node-rank of this engine is gone: {error}") from error
        for rank, answer in enumerate(answers, start=1):
            if loaded is not None and not same_digest(answer.get("digest", []), own["digest"]):
                raise RuntimeError(f"node-rank {rank} holds other weights than node-rank 0 after the update: its TP "
                                   "ranks were sent another model (every trainer rank must send the same full tensors)")

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if not authorized(request, self.info.api_key):
            return unauthorized()
        return await handler(request)

    async def _on_scheduler(self, function) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(function))

    async def _control(self, function) -> web.Response:
        """A memory call: SGLang 0.5.23 answers 200 with a JSON `null` body (the CPU engine's refusals: 400)."""
        try:
            await self._on_scheduler(function)
        except EngineStateError as error:
            return _fail(str(error))
        return json_response(None)

    # ---- info ----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.info
        return json_response({
            "model_path": info.model_path, "tokenizer_path": info.model_path, "served_model_name": info.model_path,
            "host": info.host, "port": info.port, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "max_running_requests": info.max_running_requests, "context_length": info.context_length,
            "device": "cpu", "dtype": info.dtype, "base_gpu_id": info.base_gpu_id, "skip_tokenizer_init": False,
            "version": CPU_ENGINE_VERSION,
            # SGLang's /server_info reports the launch value (its server arg) even after updates: /model_info
            # has the live one, so the twin gives no live value here that real SGLang would not
            "weight_version": info.weight_version,
            "internal_states": [{"num_running_reqs": self.scheduler.num_running,
                                 "num_waiting_reqs": self.scheduler.num_waiting}],
        })

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, SGLang's counter of finished requests (real SGLang serves /metrics with
        --enable-metrics; tests count the generations a run asked for with it)."""
        labels = f'model_name="{self.info.model_path}",is_streaming="false"'
        return web.Response(text="# TYPE sglang:num_requests_total counter\n"
                                 f"sglang:num_requests_total{{{labels}}} {float(self.requests_total)}\n")

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response({
            "model_path": self.info.model_path, "tokenizer_path": self.info.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": self.info.model_type,
            "architectures": self.info.architectures, "served_model_name": self.info.model_path,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        })

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        fail_here_if_asked(EXIT_IN_GENERATE)
        body = await _read_json(request)
        try:
            parsed = parse_generate_body(body, tokenizer=self.scheduler.tokenizer,
                                         context_length=self.info.context_length, images=self.scheduler.images)
        except RequestError as error:
            return json_response(error.body(), status=400)
        lora_error = self.lora_request_error([r.lora_path for r in parsed.requests])
        if lora_error:
            return json_response({"error": {"message": lora_error}}, status=400)
        if parsed.stream:
            if parsed.batched:
                return json_response({"error": {"message": "stream=true with a batch is not supported by the "
                                                           "CPU engine: stream one request at a time"}}, status=400)
            try:
                return await self._stream(request, parsed.requests[0])
            finally:
                self.requests_total += 1
        try:
            results = await self._run_all(parsed.requests)
            self.requests_total += len(results)
        except asyncio.CancelledError:  # client went away: abort them, as SGLang does
            self._abort_requests(parsed.requests)
            raise
        except (SchedulerDied, WeightsNotLoaded) as error:  # a dead scheduler; weights resumed, not reloaded
            return json_response({"error": {"message": str(error)}}, status=500)
        return json_response(results if parsed.batched else results[0])

    async def _run_all(self, requests: list[GenerationRequest]) -> list[dict]:
        """Submit `requests` and wait for all of them with one asyncio future (a batch of 128 would
        otherwise cost 128 wrapped futures and a gather on the event loop)."""
        loop = asyncio.get_running_loop()
        all_done: asyncio.Future[None] = loop.create_future()
        remaining = [len(requests)]
        lock = threading.Lock()

        def one_done(_: object) -> None:  # on the scheduler thread
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                loop.call_soon_threadsafe(lambda: all_done.done() or all_done.set_result(None))

        for gen in requests:
            gen.future.add_done_callback(one_done)
        self.scheduler.submit_all(requests)
        await all_done
        return [gen.future.result() for gen in requests]

    def _abort_requests(self, requests: list[GenerationRequest]) -> None:
        rids = [gen.rid for gen in requests if not gen.future.done()]
        if rids:
            self.scheduler.call(lambda: [self.scheduler.abort(rid, abort_all=False) for rid in rids])

    async def _stream(self, request: web.Request, gen: GenerationRequest) -> web.StreamResponse:
        """SSE as SGLang: one `data: <json>` event per token (cumulative text and ids, finish_reason null
        until the last), then `data: [DONE]`."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[dict] = asyncio.Queue()
        tokenizer, scheduler = self.scheduler.tokenizer, self.scheduler

        def progress(current: GenerationRequest) -> None:  # scheduler thread
            chunk = render_response(current, tokenizer=tokenizer, weight_version=scheduler.weight_version)
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        gen.on_progress = progress
        future = asyncio.wrap_future(self.scheduler.submit(gen))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                getter = asyncio.ensure_future(chunks.get())
                await asyncio.wait([getter, future], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    await response.write(b"data: " + orjson.dumps(getter.result()) + b"\n\n")
                    continue
                getter.cancel()
                while not chunks.empty():
                    await response.write(b"data: " + orjson.dumps(chunks.get_nowait()) + b"\n\n")
                try:
                    final = future.result()
                except (SchedulerDied, WeightsNotLoaded) as error:
                    final = {"error": {"message": str(error)}}
                await response.write(b"data: " + orjson.dumps(final) + b"\n\n")
                break
            await response.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self._abort_requests([gen])
            raise
        await response.write_eof()
        return response

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        await self._on_scheduler(lambda: self.scheduler.abort(rid, abort_all))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _json_body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _validation_error(f"1 validation error for PauseGenerationReqInput\nmode\n  Input should be "
                                     f"'abort', 'retract' or 'in_place' [input_value={mode!r}]")
        await self._on_scheduler(lambda: self.scheduler.pause(mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._on_scheduler(self.scheduler.resume_generation)
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            await self._on_scheduler(self.scheduler.flush_cache)
        except EngineStateError as error:
            return web.Response(status=400, text=str(error))
        return web.Response(status=200, text=FLUSHED)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = list((await _json_body(request)).get("tags") or ALL_MEMORY_TAGS)

        def work() -> None:
            self.scheduler.release_memory(tags)
            self._forward({"op": "release_memory", "tags": tags})

        return await self._control(work)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = list((await _json_body(request)).get("tags") or ALL_MEMORY_TAGS)

        def work() -> None:
            self.scheduler.resume_memory(tags)
            self._forward({"op": "resume_memory", "tags": tags})

        return await self._control(work)
