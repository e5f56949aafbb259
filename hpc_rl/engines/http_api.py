"""SGLang 0.5.23's HTTP surface as hpc_rl's own engines serve it (the CPU engine, the simulated ones).

Owns, torch-free: the route table (path, methods, handler name), the api-key rule as SGLang's
`--api-key` applies it (srt/utils/auth.py: `Authorization: Bearer <key>` on every endpoint but
`/health*`, `/ready*`, `/metrics*` and OPTIONS), SGLang's JSON shapes for success, failure and
validation errors, FastAPI's 404/405 bodies, reading JSON bodies (orjson), and SGLang's rules for a
batched `/generate` body (`per_item`, `request_ids`; `RequestError` is its 400).
Does not own: what an endpoint does (hpc_rl.engines.cpu.server on torch, hpc_rl.sim.server in
simulated time).
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

import orjson
from aiohttp import web

OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
"""Served without the api key (probes), as in SGLang."""

GET_AND_POST_ROUTES = (
    ("/health", "health"), ("/health_generate", "health"),
    ("/server_info", "server_info"), ("/get_server_info", "server_info"),
    ("/model_info", "model_info"), ("/get_model_info", "model_info"),
    ("/get_weights_by_name", "get_weights_by_name"),
)
POST_ROUTES = (
    ("/generate", "generate"), ("/abort_request", "abort_request"),
    ("/pause_generation", "pause_generation"), ("/continue_generation", "continue_generation"),
    ("/flush_cache", "flush_cache"),
    ("/init_weights_update_group", "init_weights_update_group"),
    ("/destroy_weights_update_group", "destroy_weights_update_group"),
    ("/begin_weight_update", "begin_weight_update"), ("/end_weight_update", "end_weight_update"),
    ("/update_weights_from_distributed", "update_weights_from_distributed"),
    ("/update_weights_from_disk", "update_weights_from_disk"),
    ("/update_weights_from_tensor", "update_weights_from_tensor"),
    ("/update_weight_version", "update_weight_version"),
    ("/release_memory_occupation", "release_memory_occupation"),
    ("/resume_memory_occupation", "resume_memory_occupation"),
    ("/load_lora_adapter", "load_lora_adapter"), ("/unload_lora_adapter", "unload_lora_adapter"),
    ("/load_lora_adapter_from_tensors", "load_lora_adapter_from_tensors"),
)
GET_ROUTES = (("/flush_cache", "flush_cache"), ("/metrics", "metrics"))


def add_sglang_routes(app: web.Application, server: object) -> list[str]:
    """Route every SGLang endpoint whose handler (the method named in the table) `server` has; returns
    the paths it does not serve (they answer 404, as an SGLang build without them would)."""
    missing = []
    for table, methods in ((GET_AND_POST_ROUTES, ("GET", "POST")), (POST_ROUTES, ("POST",)), (GET_ROUTES, ("GET",))):
        for path, name in table:
            handler = getattr(server, name, None)
            if handler is None:
                missing.append(path)
                continue
            if "GET" in methods:
                app.router.add_get(path, handler)  # HEAD too, as aiohttp's add_get does
            if "POST" in methods:
                app.router.add_post(path, handler)
    return missing


def authorized(request: web.Request, api_key: str | None) -> bool:
    """Whether `request` may pass SGLang's api-key check (always, without a key)."""
    if not api_key or request.method == "OPTIONS" or request.path.startswith(OPEN_PATH_PREFIXES):
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def unauthorized() -> web.Response:
    return json_response({"error": "Unauthorized"}, status=401)


def ok(message: str = "Success") -> web.Response:
    return json_response({"success": True, "message": message})


def fail(message: str, status: int = 400) -> web.Response:
    return json_response({"success": False, "message": message}, status=status)


def validation_error(message: str) -> web.Response:
    """SGLang's 400 for a body its pydantic model rejects (the legacy `ErrorResponse` shape)."""
    return json_response({"object": "error", "message": message, "type": "Bad Request", "param": None,
                          "code": 400}, status=400)


async def read_json(request: web.Request) -> Any:
    if not request.can_read_body:
        return {}
    raw = await request.read()
    try:
        return orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as error:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"invalid JSON: {error}"}),
                                 content_type="application/json") from None


async def json_body(request: web.Request) -> dict:
    body = await read_json(request)
    return body if isinstance(body, dict) else {}


@web.middleware
async def sglang_http_errors(request: web.Request, handler) -> web.StreamResponse:
    """404/405 as FastAPI answers them in SGLang: JSON `{"detail": "Not Found"}`."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, status=405)


class RequestError(ValueError):
    """A request SGLang would reject with 400; `semantic` selects `{"error": {"message": ...}}`
    (SGLang's ValueError path) over `{"error": "..."}` (its schema check)."""

    def __init__(self, message: str, *, semantic: bool = False) -> None:
        super().__init__(message)
        self.semantic = semantic

    def body(self) -> dict:
        return {"error": {"message": str(self)}} if self.semantic else {"error": str(self)}


def per_item(body: dict, key: str, count: int, default: Any) -> list[Any]:
    """A batched body's `key`, one per item (a list must have one per item; one value is shared)."""
    value = body.get(key)
    if isinstance(value, list) and key != "stop":
        if len(value) != count:
            raise RequestError(f"The length of {key} ({len(value)}) should be equal to the batch size ({count}).",
                               semantic=True)
        return value
    return [default if value is None else value] * count


def request_ids(rid: Any, count: int, batched: bool) -> list[str]:
    """SGLang's rids: a string becomes <rid>_<i> in a batch, a list needs one unique rid per item."""
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if not batched else [f"{base}_{i}" for i in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    if isinstance(rid, list) and batched:
        if len(rid) != count:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.",
                               semantic=True)
        rids = [str(item) for item in rid]
        if len(set(rids)) != len(rids):
            duplicates = [item for item in dict.fromkeys(rids) if rids.count(item) > 1]
            raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}", semantic=True)
        return rids
    raise RequestError("The rid should be a string or a list of strings.", semantic=True)
