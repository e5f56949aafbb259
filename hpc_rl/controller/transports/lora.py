"""The LoRA adapter transport's controller half (issue 33): each sync moves only the trained adapter; the engines
keep the base they started from (SGLang's --enable-lora, `config.lora.engine_lora_options`) and it is never re-sent.
Its trainer half: `hpc_rl.training.transports.lora`.

Owns one adapter sync: every trainer rank takes part in writing the adapter as a PEFT directory
`<run_dir>/adapters/policy-v<version>` (`weights.lora_sync.adapter_directory`; written under a temporary name and
renamed when complete), every engine loads it with `/load_lora_adapter` under the versioned name
`weights.lora_sync.adapter_name(version)` and reports the version (`/update_weight_version`), then the name each
engine served before is unloaded (a refused unload only warns: the engine keeps serving the new name) and the older
directories are removed. The rollouts ask for the served name (`lora_path` on /generate: the loop's
`engines_serve` hands it to the `EngineClient`). Which names each engine holds is kept here, so an engine that
restarted (it lost them) gets the current adapter on the next push and one that has it is not asked again.

Bytes moved per sync (`perf/weight_sync_bytes`): the adapter's tensor bytes, read from the safetensors header of
the directory written (what each engine reads). SGLang's /load_lora_adapter reads the directory on every engine,
so it must be on a filesystem both see (as the disk transport's). Not here: the adapter as tensors
(`/load_lora_adapter_from_tensors`, colocated engines: `lora_tensor`, which reuses this bookkeeping through `_send`
and `_forget_older`), pausing the engines around a sync (`weight_updates`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time

from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.transports.base import WeightTransport
from hpc_rl.controller.transports.disk import safetensors_payload_bytes
from hpc_rl.protocol.messages import LoraAdapterCommand
from hpc_rl.weights.lora_sync import ADAPTER_PREFIX, adapter_directory, adapter_name

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraTransport(WeightTransport):
    """Only the adapter, as a PEFT directory under the run dir `settings.lora_dir`, loaded by name on every engine."""

    name = "lora"

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - WeightTransport's
        super().__init__(*args, **kwargs)
        self.loaded: dict[int, str] = {}
        """Engine index -> the adapter name it serves (what the next sync unloads)."""

    def engine_failed(self, engine_index: int) -> None:
        self.loaded.pop(engine_index, None)  # a restarted engine holds no adapter

    async def push(self, version: int, engines: list[EngineInfo], *, flush_cache: bool = True) -> dict[str, float]:
        start = time.perf_counter()
        name = adapter_name(version)
        metrics = await self._send(version, name, engines)
        sent = time.perf_counter()
        admins = self.fleet.admins
        await asyncio.gather(*(admins[e.engine_index].update_weight_version(str(version)) for e in engines))
        await self._unload_older(engines, name)
        self._forget_older(version)
        done = time.perf_counter()
        log.info("LoRA adapter v%d (%d bytes) -> %d engine(s) as %s in %.2f s", version,
                 int(metrics["perf/weight_sync_bytes"]), len(engines), name, sent - start)
        return {**metrics, "weight_sync/seconds": done - start}

    async def _send(self, version: int, name: str, engines: list[EngineInfo]) -> dict[str, float]:
        """Version `version`'s adapter loaded as `name` on every engine that does not hold it; metrics with the
        bytes moved (`perf/weight_sync_bytes`)."""
        assert self.settings.lora_dir is not None, "transport_name is lora only with lora_dir"
        start = time.perf_counter()
        path = adapter_directory(self.settings.lora_dir, version)
        await self.channel.run(lambda rank, seq: LoraAdapterCommand(seq=seq, weight_version=version, path=str(path)),
                               timeout_s=self.settings.timeout_s)
        written = time.perf_counter()
        sync_bytes = safetensors_payload_bytes(path / ADAPTER_WEIGHTS)
        admins = self.fleet.admins
        to_load = [e for e in engines if self.loaded.get(e.engine_index) != name]
        await asyncio.gather(*(admins[e.engine_index].load_lora_adapter(name, str(path)) for e in to_load))
        loaded = time.perf_counter()
        return {"weight_sync/write_seconds": written - start, "weight_sync/load_seconds": loaded - written,
                "weight_sync/mbytes": sync_bytes / 1e6, "perf/weight_sync_bytes": float(sync_bytes)}

    def _forget_older(self, version: int) -> None:
        """The directories of versions before `version` are removed (the engines hold the adapter now)."""
        assert self.settings.lora_dir is not None
        path = adapter_directory(self.settings.lora_dir, version)
        for old in path.parent.glob(f"{ADAPTER_PREFIX}-v*"):
            if old != path and old.is_dir() and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)

    async def _unload_older(self, engines: list[EngineInfo], name: str) -> None:
        """Each engine's adapter before `name` is unloaded; `name` is what it serves now."""
        admins, older = self.fleet.admins, {e.engine_index: self.loaded.get(e.engine_index) for e in engines}
        for engine in engines:
            self.loaded[engine.engine_index] = name
        unloads = [(index, old) for index, old in older.items() if old is not None and old != name]
        results = await asyncio.gather(*(admins[index].unload_lora_adapter(old) for index, old in unloads),
                                       return_exceptions=True)
        for (index, old), result in zip(unloads, results):
            if isinstance(result, BaseException):
                log.warning("engine %d: unloading LoRA adapter %s failed (it keeps it; the rollouts ask for %s): %s",
                            index, old, name, result)
