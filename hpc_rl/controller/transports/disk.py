"""The disk transport's controller half: weight syncs through the shared filesystem (slime's
--update-weight-transport disk, full mode). Its trainer half: `hpc_rl.training.transports.disk`.

Owns one disk sync: every trainer rank takes part in writing the weights as an HF directory
`<update_weight_disk_dir>/weights_v<version>` (written under a temporary name and renamed when complete, by the
trainer: `hpc_rl.training.hf_save`), then every engine loads it with SGLang's `/update_weights_from_disk`
(`weight_version` set), and the previous version's directory is removed unless `keep_files`. No collective joins
trainer and engines, so they may run in separate Slurm jobs or partitions; the directory must be on a
filesystem both see. SGLang's /update_weights_from_disk always flushes the engines' cache, so the engines
cannot keep requests paused in place across it (`keeps_cache` False). Not here: pausing and resuming the
engines around it (`weight_updates`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import struct
import time
from pathlib import Path

from hpc_rl.controller.engine_admin import EngineAdmin
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.transports.base import WeightTransport
from hpc_rl.protocol.messages import DiskWeightsCommand

log = logging.getLogger(__name__)


def safetensors_payload_bytes(path: Path) -> int:
    """The tensor bytes of one safetensors file (perf/weight_sync_bytes): its size less the 8-byte length and the
    JSON header."""
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
    return path.stat().st_size - 8 - header_len


def version_dir(disk_dir: str | Path, version: int) -> Path:
    return Path(disk_dir) / f"weights_v{version:06d}"


async def push_weights_through_disk(*, version: int, channel: TrainerChannel, engines: list[EngineInfo],
                                    admins: dict[int, EngineAdmin], disk_dir: str, keep_files: bool,
                                    timeout_s: float = 600.0) -> dict[str, float]:
    """The trainer writes `version`, every engine in `engines` loads it; timing metrics."""
    start = time.perf_counter()
    path = version_dir(disk_dir, version)
    urls = [e.url for e in engines]
    await channel.run(lambda rank, seq: DiskWeightsCommand(seq=seq, weight_version=version, path=str(path),
                                                           engine_urls=urls), timeout_s=timeout_s)
    written = time.perf_counter()
    written_bytes = sum(safetensors_payload_bytes(f) for f in path.glob("*.safetensors"))  # the weights' tensors
    await asyncio.gather(*(admins[e.engine_index].update_weights_from_disk(str(path), str(version))
                           for e in engines))
    if not keep_files:
        for old in Path(disk_dir).glob("weights_v*"):
            if old != path and old.is_dir() and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
    done = time.perf_counter()
    log.info("weights v%d -> %d engine(s) through %s: written in %.2f s, loaded in %.2f s", version, len(engines),
             path, written - start, done - written)
    return {"weight_sync/seconds": done - start, "weight_sync/write_seconds": written - start,
            "weight_sync/load_seconds": done - written, "perf/weight_sync_bytes": float(written_bytes)}


class DiskTransport(WeightTransport):
    """`push_weights_through_disk` into `rollout.update_weight_disk_dir`."""

    name = "disk"

    async def push(self, version: int, engines: list[EngineInfo], *, flush_cache: bool = True) -> dict[str, float]:
        settings = self.settings
        assert settings.disk_dir is not None, "validation requires update_weight_disk_dir with disk"
        return await push_weights_through_disk(version=version, channel=self.channel, engines=engines,
                                               admins=self.fleet.admins, disk_dir=settings.disk_dir,
                                               keep_files=settings.keep_disk_files, timeout_s=settings.timeout_s)
