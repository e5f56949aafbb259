"""The colocated transport's trainer half: every rank posts its buckets to the engine on its own GPU
(/update_weights_from_tensor; `hpc_rl.weights.colocated_sender`). Its controller half:
`hpc_rl.controller.transports.colocated` (pairs ranks with engines, opens and closes the engines' sessions).

Owns the rank's `ColocatedWeightSender` and the check that the weights are on the device for it."""

from __future__ import annotations

from typing import Any

from hpc_rl.protocol.messages import ColocatedSyncCommand
from hpc_rl.training.nonfinite import check_finite_weights
from hpc_rl.training.offload import TrainerOffload
from hpc_rl.training.transports.base import TransportRank, export_dtype


class TrainerColocated:
    """`sync` runs a ColocatedSyncCommand."""

    def __init__(self, rank: TransportRank, offload: TrainerOffload, *, engine_api_key: str | None) -> None:
        self.rank, self.offload, self.engine_api_key = rank, offload, engine_api_key
        self.sender: Any = None

    def sync(self, command: ColocatedSyncCommand) -> dict[str, Any]:
        info = self.rank.info
        if "weights" in self.offload.offloaded_tags:
            self.offload.require_onloaded("a colocated weight update")
        check_finite_weights(self.rank.parts.actor, device=info.device, rank=info.rank)
        if self.sender is None:
            from hpc_rl.weights.colocated_sender import ColocatedWeightSender
            from hpc_rl.weights.device_identity import trainer_rank_device

            tp_group, pp_group = self.rank.parallel_groups()
            self.sender = ColocatedWeightSender(
                self.rank.parts.actor, self.rank.arch, tp_group=tp_group, tp_size=info.tp_size, rank=info.rank,
                world_size=info.world_size, bucket_bytes=command.bucket_bytes,
                dtype=export_dtype(info.on_cpu), api_key=self.engine_api_key, pp_group=pp_group,
                pp_rank=info.pp_rank, pp_size=info.pp_size, device=trainer_rank_device(),
                fp8=self.rank.engine_fp8)
        engine, _ = command.rank_engines[info.rank]
        url = command.engine_urls[engine] if 0 <= engine < len(command.engine_urls) else ""
        metrics = self.sender.sync(version=command.weight_version, engine_url=url,
                                   bucket_bytes=command.bucket_bytes, rank_engines=command.rank_engines)
        self.rank.engines_updated()
        return metrics
