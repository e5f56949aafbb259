"""The CPU engine's weight endpoints, as SGLang 0.5.23 serves them: the weight-update group (init/destroy), the
weight-update session (`/begin_weight_update` ... `/end_weight_update`), the updates from a broadcast, from tensors
(colocated mode) and from disk, the weight version and `/get_weights_by_name`.

Model work runs on the scheduler thread (`EngineServer._on_scheduler`); the blocking group rendezvous in a worker
thread, so the server stays responsive while the trainer and the other engines join. As node-rank 0 of a multi-node
engine the updates are forwarded to the other node-ranks (`EngineServer._forward`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from hpc_rl.engines.cpu.follower import open_node_shares
from hpc_rl.engines.cpu.node_group import EngineNodes, FollowerFailed
from hpc_rl.engines.cpu.scheduler import EngineFatalError, Scheduler
from hpc_rl.engines.cpu.weight_sync import (
    WeightUpdateGroups,
    load_from_disk,
    load_named,
    named_tensors,
    receive_bucket,
)
from hpc_rl.engines.http_api import fail as _fail
from hpc_rl.engines.http_api import json_body as _json_body
from hpc_rl.engines.http_api import json_response
from hpc_rl.engines.http_api import ok as _ok
from hpc_rl.engines.http_api import validation_error as _validation_error
from hpc_rl.weights.fp8_blocks import Fp8Intake


class WeightRoutes:
    """Mixed into `EngineServer` (which sets these attributes and has `_on_scheduler` and `_forward`)."""

    scheduler: Scheduler
    info: Any
    nodes: EngineNodes | None
    groups: WeightUpdateGroups
    in_weight_update: bool
    fp8: Fp8Intake | None

    async def _on_scheduler(self, function) -> Any:  # noqa: ANN001 - EngineServer's
        raise NotImplementedError

    def _forward(self, command: dict[str, Any], loaded: list[str] | None = None) -> None:  # EngineServer's
        raise NotImplementedError

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if self.nodes is not None:
            return _fail(f"this CPU engine spans {self.nodes.nnodes} nodes: in SGLang each node's TP ranks join the "
                         "weight-update group with their own ranks, which the CPU engine (one rank) cannot follow; "
                         "use colocated mode or --update-weight-transport disk")
        try:
            await asyncio.to_thread(
                self.groups.init, master_address=body["master_address"], master_port=int(body["master_port"]),
                rank_offset=int(body["rank_offset"]), world_size=int(body["world_size"]),
                group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "gloo"),
            )
        except (KeyError, ValueError, RuntimeError) as error:
            return _fail(f"Failed to init the weight update group: {error!r}")
        return _ok("Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = (await _json_body(request)).get("group_name", "weight_update_group")
        try:
            await asyncio.to_thread(self.groups.destroy, name)
        except KeyError:
            return _fail("The group to be destroyed does not exist.")
        return _ok("Succeeded to destroy custom process group.")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        if self.in_weight_update:
            return _fail("a weight-update session is already open; call end_weight_update() first")
        self.in_weight_update = True
        return _ok()

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self.in_weight_update:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        self.in_weight_update = False
        if self.fp8 is not None and self.fp8.pending():
            missing = self.fp8.pending()
            self.fp8.clear()
            return _fail(f"the weight update ended with FP8 tensors whose pair never came: {missing[:5]}")
        return _ok()

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not self.in_weight_update:
            return _fail("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
        names, dtypes, shapes = body.get("names", []), body.get("dtypes", []), body.get("shapes", [])
        group_name = body.get("group_name", "weight_update_group")
        version = body.get("weight_version")

        def work() -> None:
            if body.get("abort_all_requests"):
                self.scheduler.abort(None, abort_all=True)
            received = receive_bucket(self.groups.get(group_name), names, dtypes, shapes, body.get("load_format"))
            self.scheduler.check_flush(bool(body.get("flush_cache", True)))  # after the receive: the broadcast ends
            weights = self.fp8.take(received) if self.fp8 is not None else received
            load_named(self.scheduler.model, weights, update=True)
            if version is not None:
                self.scheduler.weight_version = str(version)

        try:
            await self._on_scheduler(work)
        except (KeyError, ValueError, RuntimeError) as error:
            return _fail(f"Failed to update parameter online: {error}")
        return _ok("Succeeded to update parameter online.")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Colocated mode (SGLang's body; the CPU twin's share is a shared-memory descriptor, never a pickle).
        As SGLang 0.5.23: inside a begin/end session; entry [tp_rank] is this engine's (TP 1: [0])."""
        body = await _json_body(request)
        if not self.in_weight_update:
            return _fail("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        shares, version = body.get("serialized_named_tensors"), body.get("weight_version")
        if not isinstance(shares, list) or not shares:
            return _fail("serialized_named_tensors must be a non-empty list (one entry per engine TP rank)")
        if body.get("load_format") not in (None, "direct"):
            return _fail(f"load_format {body.get('load_format')!r} is not supported by the CPU engine (null)")

        def work() -> None:
            if body.get("abort_all_requests"):
                self.scheduler.abort(None, abort_all=True)
            self.scheduler.check_flush(bool(body.get("flush_cache", True)))
            nnodes = self.nodes.nnodes if self.nodes is not None else 1
            try:  # every TP rank of this node opens its own share (SGLang: "Invalid device_uuid=..." kills it)
                weights = open_node_shares(list(shares), nnodes, 0)
            except FollowerFailed as error:
                raise EngineFatalError(str(error)) from error
            command: dict[str, Any] = {"op": "update_weights_from_tensor", "shares": list(shares)}
            if self.fp8 is not None:  # FP8 blocks: every node-rank pairs and dequantizes them alike
                weights, command["fp8_block"] = self.fp8.take(weights), list(self.fp8.block)
            load_named(self.scheduler.model, weights, update=True)
            self._forward(command, [n for n, _ in weights])
            if version is not None:
                self.scheduler.weight_version = str(version)

        try:
            await self._on_scheduler(work)
        except (KeyError, ValueError, RuntimeError) as error:
            return _fail(f"Failed to update weights from tensor: {error}")
        return _ok("Success" + (f" Weight version updated to {version}." if version is not None else ""))

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        model_path, version = body.get("model_path"), body.get("weight_version")

        def work() -> None:
            if body.get("abort_all_requests"):
                self.scheduler.abort(None, abort_all=True)
            self.scheduler.check_flush(True)  # SGLang's disk update always flushes
            load_from_disk(self.scheduler.model, model_path)
            self._forward({"op": "update_weights_from_disk", "model_path": model_path},
                          [name for name, _ in self.scheduler.model.named_parameters()])
            self.info.model_path = model_path
            if version is not None:
                self.scheduler.weight_version = str(version)

        try:
            await self._on_scheduler(work)
        except (OSError, KeyError, ValueError, RuntimeError, TypeError) as error:
            return _fail(f"Failed to update weights from disk: {error}")
        return json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        version = body.get("new_version")
        if version is None:
            return _validation_error("1 validation error for UpdateWeightVersionReqInput\nnew_version\n  Field required")

        def work() -> None:
            if body.get("abort_all_requests", True):
                self.scheduler.abort(None, abort_all=True)
            self.scheduler.weight_version = str(version)

        await self._on_scheduler(work)
        return json_response({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = dict(request.query) if request.method == "GET" else await _json_body(request)
        name, truncate = body.get("name"), int(body.get("truncate_size", 100))

        def work() -> list:
            tensor = named_tensors(self.scheduler.model).get(name)
            if tensor is None:
                raise KeyError(name)
            return tensor.detach()[:truncate].tolist()

        try:
            return json_response(await self._on_scheduler(work))
        except KeyError:
            return json_response({"error": {"message": f"unknown parameter name {name!r}"}}, status=400)
