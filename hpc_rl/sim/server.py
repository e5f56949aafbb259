"""SGLang's HTTP API for many simulated engines in one process: one aiohttp app, one listening port per
engine, the engine chosen by the port a request arrived on.

Owns the handlers behind SGLang 0.5.23's routes (the route table, the api-key rule and the JSON helpers
are hpc_rl.engines.http_api's, shared with the CPU engine), the weight-update session (begin ... end, required as in SGLang), and the simulated cost of each control
call (abort, pause/continue, weight-update calls: `EngineModel`). The group rendezvous and the
broadcast are NOT done: `/init_weights_update_group` and `/update_weights_from_distributed` only take
their simulated time (the harness measures the orchestration around them).

Refusals reproduced from SGLang: an unknown sampling param (400), stream=true here (400), a weight
update outside a session (400), a weight update that asks for a flush while requests hold KV (in_place pause:
400, as flush_cache fails), and memory release while requests run (500: it kills a real SGLang server; the
simulated engine stops serving).

Plus `GET /sim_stats` (this engine) and `GET /sim_fleet_stats` (every engine of the process): busy
time, tokens, aborts, for the harness.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from hpc_rl.engines.http_api import (OPEN_PATH_PREFIXES, RequestError, add_sglang_routes, authorized, json_response,
                                     per_item, request_ids, unauthorized)
from hpc_rl.engines.http_api import fail as _fail
from hpc_rl.engines.http_api import json_body as _json_body
from hpc_rl.engines.http_api import ok as _ok
from hpc_rl.sim.engine import LoopClock, SimEngine, plan_request, sample_index_of
from hpc_rl.sim.model import EngineModel

SIM_ENGINE_VERSION = "0.5.23+hpc_rl.sim"
SAMPLING_PARAMS = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "min_new_tokens", "n", "sampling_seed", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "spaces_between_special_tokens", "json_schema", "regex", "ebnf",
    "custom_params", "stream_interval", "logit_bias",
})
OUTPUT_TOKEN_ID = 7
"""Every simulated token is this id (the tiny tokenizer's 'copy'); the text carries the answer."""


@dataclass
class SimEndpoint:
    """One simulated engine behind its port."""

    index: int
    port: int
    engine: SimEngine
    in_weight_update: bool = False
    released: set[str] = field(default_factory=set)
    dead: str = ""


class SimFleetServer:
    """Serves `count` simulated engines; `start()` binds their ports, `stop()` closes them."""

    def __init__(self, model: EngineModel, *, count: int, host: str = "127.0.0.1", api_key: str | None = None,
                 model_path: str = "sim-model", ports: list[int] | None = None) -> None:
        self.model = model
        self.count = count
        self.host = host
        self.api_key = api_key
        self.model_path = model_path
        self.requested_ports = ports or [0] * count
        self.endpoints: dict[int, SimEndpoint] = {}
        self._runner: web.AppRunner | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Listen on every engine's port; returns their base URLs in engine order."""
        self._runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        clock = LoopClock(self.model)
        urls = []
        for index, port in enumerate(self.requested_ports):
            site = web.TCPSite(self._runner, self.host, port, backlog=1024)
            await site.start()
            bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.endpoints[bound] = SimEndpoint(index=index, port=bound,
                                                engine=SimEngine(self.model, clock, weight_version="0"))
            urls.append(f"http://{self.host}:{bound}")
        return urls

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 28)
        add_sglang_routes(app, self)
        app.router.add_get("/sim_stats", self.sim_stats)
        app.router.add_get("/sim_fleet_stats", self.sim_fleet_stats)
        return app

    def _endpoint(self, request: web.Request) -> SimEndpoint:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        endpoint = self.endpoints.get(sockname[1]) if sockname else None
        if endpoint is None:
            raise web.HTTPNotFound(text="no simulated engine on this port")
        return endpoint

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if not authorized(request, self.api_key):
            return unauthorized()
        endpoint = self._endpoint(request)
        if endpoint.dead and not request.path.startswith(OPEN_PATH_PREFIXES[0]):
            return json_response({"error": f"engine is down: {endpoint.dead}"}, status=503)
        if endpoint.dead:
            return web.Response(status=503, text=endpoint.dead)
        return await handler(request)

    async def _take(self, simulated_s: float) -> None:
        if simulated_s > 0:
            await asyncio.sleep(self.model.real_seconds(simulated_s))

    # -- info ------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        engine = endpoint.engine
        return json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "served_model_name": self.model_path,
            "host": self.host, "port": endpoint.port, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "max_running_requests": self.model.max_running_requests,
            "context_length": self.model.max_wire_response_len * 4, "device": "sim", "dtype": "bfloat16",
            "skip_tokenizer_init": False, "version": SIM_ENGINE_VERSION, "engine": "hpc_rl.sim",
            "weight_version": engine.weight_version,
            "internal_states": [{"num_running_reqs": len(engine.running), "num_waiting_reqs": len(engine.waiting)}],
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self._endpoint(request).engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
        })

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        return json_response({"error": {"message": "a simulated engine holds no weights"}}, status=400)

    async def sim_stats(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        endpoint.engine.step()
        return json_response({"port": endpoint.port, "simulated_now": endpoint.engine.clock.now(),
                                  **asdict(endpoint.engine.counters)})

    async def sim_fleet_stats(self, request: web.Request) -> web.Response:
        engines = [e.engine for e in self.endpoints.values()]
        for engine in engines:
            engine.step()
        now = engines[0].clock.now() if engines else 0.0
        total = {key: sum(getattr(e.counters, key) for e in engines) for key in asdict(engines[0].counters)} \
            if engines else {}
        return json_response({"engines": len(engines), "simulated_now": now, **total,
                                  "running": sum(len(e.running) for e in engines),
                                  "waiting": sum(len(e.waiting) for e in engines),
                                  "token_scale": self.model.token_scale})

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        """One request, or SGLang's batched form (`input_ids` a list of lists, `rid` / `sampling_params` /
        `return_logprob` one each or one per item): each item runs as its own request, answers in order."""
        endpoint = self._endpoint(request)
        body = await _json_body(request)
        if body.get("stream"):
            return json_response({"error": "stream=true is not supported by the simulated engine"}, status=400)
        input_ids = body.get("input_ids")
        if input_ids is None and body.get("text") is None:
            return json_response({"error": "Either text or input_ids should be provided."}, status=400)
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        count = len(input_ids) if batched else 1
        try:
            rids = request_ids(body.get("rid"), count, batched)
            items_ids = input_ids if batched else [input_ids]
            item_params = per_item(body, "sampling_params", count, {})
            item_logprob = per_item(body, "return_logprob", count, False)
        except RequestError as error:
            return json_response(error.body(), status=400)
        items = []
        for ids, rid, params, logprob in zip(items_ids, rids, item_params, item_logprob):
            params = params or {}
            if not isinstance(params, dict):
                return json_response({"error": "sampling_params must be an object"}, status=400)
            unknown = sorted(set(params) - SAMPLING_PARAMS)
            if unknown:
                return json_response({"error": f"unknown sampling params: {unknown}"}, status=400)
            input_len = len(ids) if isinstance(ids, list) else len(str(body.get("text")).split())
            items.append((rid, input_len, params, bool(logprob)))
        answers = await asyncio.gather(*(self._run_item(endpoint, *item) for item in items))
        return json_response(answers if batched else answers[0])

    async def _run_item(self, endpoint: Any, rid: str, input_len: int, params: dict[str, Any],
                        return_logprob: bool) -> dict[str, Any]:
        engine = endpoint.engine
        sim_request = plan_request(self.model, rid=rid, input_len=input_len,
                                   max_new_tokens=int(params.get("max_new_tokens", 128)),
                                   now=engine.clock.now(), ignore_eos=bool(params.get("ignore_eos")))
        engine.submit(sim_request)
        assert sim_request.done is not None
        try:
            result = await sim_request.done
        except asyncio.CancelledError:  # the client went away: abort it, as SGLang does
            engine.abort(rid, abort_all=False)
            raise
        return self._response(rid, input_len, result, return_logprob)

    def _response(self, rid: str, input_len: int, result: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
        tokens, finish = result["tokens"], result["finish_type"]
        if finish == "stop":
            index = sample_index_of(rid)
            reward = self.model.sample_reward(index) if index is not None else 0
            text = f" </think> The answer is \\boxed{{{reward}}}"
            finish_reason: dict[str, Any] = {"type": "stop", "matched": 2}
        elif finish == "length":
            text, finish_reason = "", {"type": "length", "length": tokens}
        else:
            text, finish_reason = "", {"type": "abort", "message": "Aborted", "status_code": 200}
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish_reason, "prompt_tokens": input_len, "completion_tokens": tokens,
            "cached_tokens": 0, "weight_version": result["weight_version"], "weight_versions": result["spans"],
            "e2e_latency": self.model.real_seconds(result["simulated_latency"]),
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[-0.5, OUTPUT_TOKEN_ID, None]] * tokens
        return {"text": text, "output_ids": [OUTPUT_TOKEN_ID] * tokens, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        body = await _json_body(request)
        await self._take(self.model.abort_s)
        endpoint.engine.abort(body.get("rid"), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        mode = (await _json_body(request)).get("mode", "abort")
        try:
            endpoint.engine.pause(mode)
        except ValueError as error:
            return _fail(str(error))
        await self._take(self.model.pause_s)
        return _ok("Generation paused successfully.")

    async def continue_generation(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        await self._take(self.model.pause_s)
        endpoint.engine.resume()
        return _ok("Generation continued successfully.")

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self._endpoint(request).engine.running:
            return web.Response(status=400, text="Flush cache failed.")
        return web.Response(status=200, text="Cache flushed.")

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        tags = (await _json_body(request)).get("tags") or ["weights", "kv_cache", "cuda_graph"]
        if endpoint.engine.running:
            endpoint.dead = "release_memory_occupation while requests were running (kills SGLang)"
            return _fail(endpoint.dead, status=500)
        endpoint.released |= set(tags)
        await self._take(self.model.pause_s)
        return _ok()

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        tags = set((await _json_body(request)).get("tags") or ["weights", "kv_cache", "cuda_graph"])
        if not tags <= endpoint.released:
            endpoint.dead = f"resume_memory_occupation of {sorted(tags - endpoint.released)} never released (kills SGLang)"
            return _fail(endpoint.dead, status=500)
        endpoint.released -= tags
        await self._take(self.model.pause_s)
        return _ok()

    # -- weights ---------------------------------------------------------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            return _fail(f"Failed to init the weight update group: missing {missing}")
        await self._take(self.model.init_group_s)
        return _ok("Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        await _json_body(request)
        await self._take(self.model.weight_call_s)
        return _ok("Succeeded to destroy custom process group.")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        if endpoint.in_weight_update:
            return _fail("a weight update session is already open: call /end_weight_update first")
        endpoint.in_weight_update = True
        await self._take(self.model.weight_call_s)
        return _ok()

    async def end_weight_update(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        if not endpoint.in_weight_update:
            return _fail("no weight update session is open: call /begin_weight_update first")
        endpoint.in_weight_update = False
        await self._take(self.model.weight_call_s)
        return _ok()

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        body = await _json_body(request)
        if not endpoint.in_weight_update:
            return _fail("update_weights_from_distributed outside a session: call /begin_weight_update first")
        if endpoint.engine.running and body.get("flush_cache", True):
            return _fail("Failed to update parameter online: flush cache failed (requests hold KV cache)")
        seconds = self.model.weight_call_s
        if self.model.broadcast_gbytes_per_s > 0:
            seconds += bucket_bytes(body) / (self.model.broadcast_gbytes_per_s * 1e9)
        await self._take(seconds)
        if body.get("weight_version") is not None:
            endpoint.engine.set_weight_version(str(body["weight_version"]))
        return _ok("Succeeded to update parameter online.")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        body = await _json_body(request)
        await self._take(self.model.init_group_s)
        if body.get("weight_version") is not None:
            endpoint.engine.set_weight_version(str(body["weight_version"]))
        return json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        endpoint = self._endpoint(request)
        body = await _json_body(request)
        if body.get("new_version") is None:
            return _fail("new_version is required")
        if body.get("abort_all_requests", True):
            endpoint.engine.abort(None, abort_all=True)
        endpoint.engine.set_weight_version(str(body["new_version"]))
        return _ok(f"Weight version updated to {body['new_version']}")


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1, "float8_e4m3fn": 1}


def bucket_bytes(body: dict[str, Any]) -> int:
    """Bytes of one /update_weights_from_distributed bucket, from its dtypes and shapes."""
    total = 0
    for dtype, shape in zip(body.get("dtypes") or [], body.get("shapes") or []):
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 2)
    return total
