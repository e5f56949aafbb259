"""The engines' health rounds probed in the answer workers (`{"op": "health"}` frames; answer_workers.py).

Owns `probe_round`, a worker's side of one round: a GET /health to each engine the controller named, all at once,
on the worker's own keep-alive connections (the ones it holds for those engines' /generate requests: warm), and
`serve_health`, which answers the round with ONE frame naming the engines that are not healthy.

Why: at 1,024 engines most engines are idle between weight syncs, so each health round (every
`controller.engine_health_interval`) probed ~1,000 engines from the coordinating process: ~20 us of its loop per
engine plus the answer's parse. Here the coordinating process writes one frame per worker and reads one back.

Same verdicts as the controller's own round (controller/engine_admin.healthy_all): an engine is healthy when it
answers 200 within `timeout_s`; an engine with an idle kept-alive connection is probed on it in one
`RequestRound`, the others per call (`concurrency` at a time, connecting); a probe whose connection failed or
closed before the answer (not a timeout) is made once more per call, which reconnects; a timeout is a failure.

Frames: controller to worker `{"op": "health", "id", "urls": [...], "timeout_s", "concurrency"}`; worker to
controller `{"id", "unhealthy": [indices into urls]}`. The controller's side (which worker, falling back to its
own probes when a worker is gone) is answer_pool.AnswerPool.probe_health's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hpc_rl.protocol.health_round import health_round
from hpc_rl.protocol.http_client import EngineConnection, EngineConnections, EngineHTTPTransportError
from hpc_rl.rollout.worker_frames import encode_frame


async def _probe_once(connection: EngineConnection, timeout_s: float) -> bool:
    try:
        status, _ = await connection.request("GET", "/health", None, timeout_s)
    except EngineHTTPTransportError:
        return False
    return status == 200


async def probe_round(engines: EngineConnections, urls: list[str], timeout_s: float, *,
                      concurrency: int = 64) -> list[bool]:
    """Whether each engine of `urls` answered /health with 200 (see the module docstring for the rules)."""
    connections = [engines.to(url) for url in urls]
    return await health_round(connections, lambda index: _probe_once(connections[index], timeout_s), timeout_s,
                              concurrency=concurrency)


async def serve_health(engines: EngineConnections, writer: asyncio.StreamWriter, header: dict[str, Any]) -> None:
    """Answer one `{"op": "health"}` frame with the indices of the engines that are not healthy."""
    urls: list[str] = header["urls"]
    verdicts = await probe_round(engines, urls, float(header["timeout_s"]),
                                 concurrency=int(header.get("concurrency", 64)))
    writer.writelines(encode_frame({"id": header["id"],
                                    "unhealthy": [index for index, healthy in enumerate(verdicts) if not healthy]}))
    try:
        await writer.drain()
    except ConnectionError:
        pass  # the controller is gone: the worker's loop ends on its own
