"""The CPU engine's LoRA endpoints (issue 33), as SGLang 0.5.23 serves them with `--enable-lora`.

Owns: `/load_lora_adapter {lora_name, lora_path}` and `/unload_lora_adapter {lora_name}` (run on the scheduler thread
between two steps; answered with SGLang's LoRAUpdateOutput shape: success, error_message, loaded_adapters as
{name: path}, 400 on a refusal), and the `/generate` check that a request's `lora_path` names a loaded adapter.
The adapters themselves: `lora_serving`.

`/load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors, load_format}` (SGLang 0.5.23's
body, `weights.lora_sync`): entry [0] is this engine's copy; the CPU twin of SGLang's pickled CUDA IPC handles is a
shared-memory descriptor (`weights.colocated`), checked against the engine's GPUs as a colocated weight update is; a
pickle is refused (400), as are the refusals SGLang makes (LoRA not enabled, a name already loaded, a rank over
--max-lora-rank, modules the model has not). load_format "flattened_bucket" is SGLang's, not the twin's (400).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from hpc_rl.engines.cpu.lora_serving import EngineLoraAdapters, LoraAdapterError
from hpc_rl.engines.http_api import json_response, read_json

NOT_ENABLED = "LoRA is not enabled on this engine: start it with --enable-lora"


class LoraRoutes:
    """Mixed into `EngineServer` (which has `scheduler` and `_on_scheduler`)."""

    scheduler: Any

    async def _on_scheduler(self, function) -> Any:  # noqa: ANN001 - EngineServer's
        raise NotImplementedError

    def _lora_answer(self, lora: EngineLoraAdapters | None, error: str | None) -> web.Response:
        loaded = dict(lora.paths) if lora is not None else {}
        return json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                             status=200 if error is None else 400)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        lora = self.scheduler.lora
        if lora is None:
            return self._lora_answer(None, NOT_ENABLED)
        name, path = str(body.get("lora_name") or ""), str(body.get("lora_path") or "")
        try:
            await self._on_scheduler(lambda: lora.load_dir(name, path))
        except LoraAdapterError as error:
            return self._lora_answer(lora, str(error))
        return self._lora_answer(lora, None)

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        lora = self.scheduler.lora
        if lora is None:
            return self._lora_answer(None, NOT_ENABLED)
        name, config, shares = body.get("lora_name"), body.get("config_dict"), body.get("serialized_named_tensors")
        if not isinstance(name, str) or not isinstance(config, dict) or not isinstance(shares, list) or not shares:
            return self._lora_answer(lora, "load_lora_adapter_from_tensors needs lora_name (str), config_dict (the "
                                     "PEFT adapter_config) and serialized_named_tensors (one entry per TP rank)")
        if body.get("load_format") is not None:
            return self._lora_answer(lora, f"load_format {body.get('load_format')!r} is not supported by the CPU "
                                     "engine (null)")

        def work() -> None:
            from hpc_rl.engines.cpu.weight_sync import read_tensor_share

            tensors = {key: tensor.clone() for key, tensor in read_tensor_share(shares[0])}
            lora.load_tensors(name, config, tensors)

        try:
            await self._on_scheduler(work)
        except ValueError as error:  # LoraAdapterError, PayloadError (a pickle, a bad descriptor), a foreign GPU
            return self._lora_answer(lora, str(error))
        return self._lora_answer(lora, None)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        lora = self.scheduler.lora
        if lora is None:
            return self._lora_answer(None, NOT_ENABLED)
        try:
            await self._on_scheduler(lambda: lora.unload(str(body.get("lora_name") or "")))
        except LoraAdapterError as error:
            return self._lora_answer(lora, str(error))
        return self._lora_answer(lora, None)

    def lora_request_error(self, lora_paths: list[str | None]) -> str | None:
        """Why `/generate` must refuse these requests' adapters (None: they may run)."""
        wanted = [path for path in lora_paths if path is not None]
        if not wanted:
            return None
        lora = self.scheduler.lora
        if lora is None:
            return NOT_ENABLED
        try:
            for path in wanted:
                lora.check_request(path)
        except LoraAdapterError as error:
            return str(error)
        return None
