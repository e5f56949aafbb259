"""The worker side of the answer pool: a process that makes the /generate exchanges the controller hands it and
sends back each answer with its token arrays as raw memory (`rollout.answer_parse_workers`; answer_pool.py).

Owns: `compact_answers(raw)`, the parse (JSON to SGLang's answer dicts, with each answer's `output_ids` an
`array('i')` (`array('q')` when an id does not fit int32) and `meta_info.output_token_logprobs` an `array('f')` of the
output tokens' log-probs (`array('d')` when one is not a float32 value: data/column_forms.py); the
controller's loop uses it too when there is no pool), the local frame format between the controller and
its workers, and the worker's program.

Frames (both ways, over a socketpair between the controller and a worker it spawned; never the network):
`<u32 header bytes><u32 payload bytes>`, a JSON header, then the payload. Controller to worker:
`{"op": "post", "id", "url", "path", "timeout_s", "parse"}` with the request body as payload (`parse` false: a
control call, e.g. /abort_request, answered raw), or `{"op": "cancel", "id"}`. A post may carry `"score": {"rids",
"requests"}`: its answers' rule rewards, computed here and returned inside each answer dict (worker_rewards.py).
Worker to controller, one per post: `{"id", "status", "body", "arrays"}` with the answer's token ids (int32, or
int64) and log-probs (float32, or float64) as payload, `arrays` saying where each goes back (answer index, field,
count, typecode; a spec without the typecode is int64 / float64); or
`{"id", "status", "raw": true}` with the engine's body (not 200); or `{"id", "not_json": orjson's message}`;
or `{"id", "error": the transport error}`. `{"op": "health", "id", "urls", "timeout_s", "concurrency"}`: one health
round over those engines, answered `{"id", "unhealthy": [indices into urls]}` (worker_probes.py). The "pipeline"
op (one frame, the same pipelined requests to many engines, answered by a few batched frames) is worker_fanout.py's. No pickle: JSON and machine numbers only.

Why: at full response length a batched answer is ~1.2 MB of JSON; reading it and handing it to a parsing
process cost the coordinating process more than the rest of a sample's work (docs/scaling.md). Here the
body never enters the coordinating process: it gets ~40 kB of numbers per sample and the rest of each
answer (text, meta_info) as JSON.

Does not own: which engine is asked, retries, aborts (engine_client.py, generate.py); the parse itself
(answer_pool.compact_answers).
"""

from __future__ import annotations

import asyncio
import gc
import socket
from array import array
from operator import itemgetter
from typing import Any

import orjson

from hpc_rl.data.column_forms import COLUMN_FORMS, narrowed
from hpc_rl.protocol.http_client import EngineConnections, EngineHTTPTransportError
from hpc_rl.rollout.worker_frames import PREFIX, encode_frame, read_frame
from hpc_rl.rollout.worker_fanout import run_pipeline

COLLECT_EVERY = 1024
"""A worker's full GC collection every this many answers (its automatic GC is off: a full-length answer is
~10k lists, and gen-0 collections over a half-built one cost 1.5x the parse)."""
ARRAY_FIELDS = (("ids", "q"), ("logprobs", "d"))
"""Each array field and its typecode when a spec names none (a spec of three: before the narrow forms)."""
_FORMS = {"ids": COLUMN_FORMS["response_token_ids"], "logprobs": COLUMN_FORMS["response_logprobs"]}


def _spec_code(spec: list[Any]) -> str:
    """The typecode of a frame's array spec ([answer index, field, count, typecode]): one of the field's forms."""
    if len(spec) == 3:
        return dict(ARRAY_FIELDS)[spec[1]]
    _, field, _, code = spec
    if code not in _FORMS[field]:
        raise ValueError(f"array spec {spec!r}: typecode {code!r} is not one of {_FORMS[field]}")
    return code


def split_arrays(body: Any) -> tuple[Any, list[list[Any]], list[array]]:
    """Take the compact arrays out of a parsed body (answer_pool.compact_answers): (the body without them,
    [answer index, field, count] per array, the arrays)."""
    specs: list[list[Any]] = []
    buffers: list[array] = []
    for index, item in enumerate(body if isinstance(body, list) else (body,)):
        if not isinstance(item, dict):
            continue
        ids = item.get("output_ids")
        if isinstance(ids, array):
            specs.append([index, "ids", len(ids), ids.typecode])
            buffers.append(ids)
            item["output_ids"] = None
        meta = item.get("meta_info")
        logprobs = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if isinstance(logprobs, array):
            specs.append([index, "logprobs", len(logprobs), logprobs.typecode])
            buffers.append(logprobs)
            meta["output_token_logprobs"] = None
    return body, specs, buffers


def join_arrays(body: Any, specs: list[list[Any]], payload: bytes) -> Any:
    """Put the arrays `split_arrays` took out back into `body` (one copy of each from the payload)."""
    items = body if isinstance(body, list) else [body]
    view, offset = memoryview(payload), 0
    for spec in specs:
        index, field, count = spec[:3]
        values = array(_spec_code(spec))
        end = offset + count * values.itemsize
        values.frombytes(view[offset:end])
        offset = end
        if field == "ids":
            items[index]["output_ids"] = values
        else:
            items[index]["meta_info"]["output_token_logprobs"] = values
    return body


def array_targets(specs: Any, size: int) -> list[array] | None:
    """Empty-valued arrays to receive a frame's payload into, one per spec of `split_arrays` (in the payload's
    order), so the payload lands in the arrays the samples keep (no buffer, no second copy; answer_pool's frame
    reader); None when the specs do not account for exactly `size` bytes (the payload is then read as bytes, and
    `join_arrays` makes of it what it made before)."""
    arrays: list[array] = []
    total = 0
    try:
        for spec in specs:
            field, count = spec[1], spec[2]
            values = array(_spec_code(spec), _ZERO[field]) * count
            total += len(values) * values.itemsize
            arrays.append(values)
    except (TypeError, ValueError, KeyError, OverflowError, MemoryError):
        return None
    return arrays if total == size else None


_ZERO = {"ids": (0,), "logprobs": (0.0,)}


def place_arrays(body: Any, specs: list[list[Any]], arrays: list[array]) -> Any:
    """Put the arrays `array_targets` made (and the payload filled) back into `body`, as `join_arrays` does."""
    items = body if isinstance(body, list) else [body]
    for (index, field, *_), values in zip(specs, arrays):
        if field == "ids":
            items[index]["output_ids"] = values
        else:
            items[index]["meta_info"]["output_token_logprobs"] = values
    return body


class AnswerNotJSON(ValueError):
    """The body is not JSON; the message is orjson's."""


def _compact(item: Any) -> None:
    """Replace one answer dict's per-token lists by arrays, in place (kept as lists when not plain numbers)."""
    if not isinstance(item, dict):
        return
    ids = item.get("output_ids")
    if isinstance(ids, list):
        try:  # int32 when every id fits (always, in practice: data/column_forms.py), else int64
            item["output_ids"] = array("i", ids)
        except OverflowError:
            try:
                item["output_ids"] = array("q", ids)
            except (TypeError, OverflowError):
                pass
        except TypeError:
            pass
    meta = item.get("meta_info")
    entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if isinstance(entries, list):
        try:
            logprobs = array("d", map(itemgetter(0), entries))
        except (TypeError, IndexError, KeyError):
            return  # None or a malformed entry: generate.output_logprobs reads the lists
        meta["output_token_logprobs"] = narrowed(logprobs)  # float32 when exact (SGLang's are), else float64


def compact_answers(raw: bytes) -> tuple[bool, Any]:
    """Run in a worker (or inline): (True, the parsed body with compact token arrays) or (False, orjson's
    message) for a body that is not JSON. A batched answer (a list) has each of its dicts compacted."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        return False, str(error)
    for item in body if isinstance(body, list) else (body,):
        _compact(item)
    return True, body


# -- the worker's program ---------------------------------------------------------------------------------
def worker_main(connection: socket.socket, api_key: str | None) -> None:
    """Entry point of a spawned worker: serve the controller's posts until it closes the connection."""
    gc.disable()
    asyncio.run(_serve(connection, api_key))


async def _serve(connection: socket.socket, api_key: str | None) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=connection)
    engines = EngineConnections(api_key=api_key)
    tasks: dict[int, asyncio.Task[None]] = {}
    answered = 0

    def finished(request_id: int) -> None:
        nonlocal answered
        tasks.pop(request_id, None)
        answered += 1
        if answered % COLLECT_EVERY == 0:
            gc.collect()

    try:
        while True:
            try:
                header, payload = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the controller closed its end: stop
            request_id = header["id"]
            if header["op"] == "post":
                task = asyncio.create_task(_post(engines, writer, header, payload))
                tasks[request_id] = task
                task.add_done_callback(lambda _, rid=request_id: finished(rid))
            elif header["op"] == "health":  # one health round over this worker's engines (worker_probes.py)
                from hpc_rl.rollout.worker_probes import serve_health

                task = asyncio.create_task(serve_health(engines, writer, header))
                tasks[request_id] = task
                task.add_done_callback(lambda _, rid=request_id: finished(rid))
            elif header["op"] == "pipeline":  # an admin fan-out to many engines (worker_fanout.py)
                task = asyncio.create_task(run_pipeline(engines, lambda head: writer.writelines(encode_frame(head)),
                                                        header, payload))
                tasks[request_id] = task
                task.add_done_callback(lambda _, rid=request_id: finished(rid))
            elif header["op"] == "cancel" and request_id in tasks:
                tasks[request_id].cancel()  # the connection is dropped, as the controller's own client does
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await engines.close()
        writer.close()


async def _post(engines: EngineConnections, writer: asyncio.StreamWriter, header: dict[str, Any], body: bytes) -> None:
    request_id = header["id"]
    try:
        status, raw = await engines.to(header["url"]).request("POST", header["path"], body, header["timeout_s"])
    except EngineHTTPTransportError as error:
        frame = encode_frame({"id": request_id, "error": str(error)})
    else:
        if status != 200 or not header.get("parse", True):
            frame = encode_frame({"id": request_id, "status": status, "raw": True}, [raw])
        else:
            ok, parsed = compact_answers(raw)
            if not ok:
                frame = encode_frame({"id": request_id, "not_json": parsed})
            else:
                if header.get("score"):  # rule rewards of the answers' texts (worker_rewards.py)
                    from hpc_rl.rollout.worker_rewards import attach_rewards

                    attach_rewards(parsed, header["score"])
                stripped, specs, buffers = split_arrays(parsed)
                try:
                    frame = encode_frame({"id": request_id, "status": 200, "body": stripped, "arrays": specs}, buffers)
                except (TypeError, ValueError) as error:  # JSON orjson read but cannot write back: no answer lost
                    frame = encode_frame({"id": request_id, "error": f"{header['url']}: the answer worker could "
                                                                      f"not hand the answer back: {error}"})
    writer.writelines(frame)  # one call: frames of concurrent answers never interleave
    try:
        await writer.drain()
    except ConnectionError:
        pass  # the controller is gone: _serve ends on its own
