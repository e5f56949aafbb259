"""The broadcast transport's trainer half: rank 0 plans the buckets, joins the weight-update group and
broadcasts each bucket (every rank gathers its TP/PP shards for it). Its controller half:
`hpc_rl.controller.transports.broadcast`, which drives the engines and tells rank 0 when to give up a join
or to abort a group an engine broke.

Owns the rank's `WeightSender` and the group's rendezvous address (kept until the controller asks for a new
group or an abort drops it).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from hpc_rl.process.child_process import free_port
from hpc_rl.protocol.messages import AbortWeightGroupCommand, SyncWeightsCommand, WeightPlan
from hpc_rl.training.nonfinite import check_finite_weights
from hpc_rl.training.sync_address import weight_sync_address
from hpc_rl.training.transports.base import TransportRank, export_dtype
from hpc_rl.weights.process_group import WeightGroupJoinAbandoned
from hpc_rl.weights.sender import LOAD_FORMAT, WeightSender

log = logging.getLogger(__name__)


class PlanSink(Protocol):
    """The command source's side rank 0 talks to during a broadcast sync."""

    def send_weight_plan(self, plan: WeightPlan) -> None: ...
    def join_verdict(self, seq: int) -> str: ...


class TrainerBroadcast:
    """`sync` runs a SyncWeightsCommand, `abort` an AbortWeightGroupCommand; `synchronize` before any other
    command (the GPU would wait for the group's broadcasts before new work)."""

    def __init__(self, rank: TransportRank, source: PlanSink) -> None:
        self.rank, self.source = rank, source
        self.sender: WeightSender | None = None
        self.group_address: tuple[str, int] | None = None

    def synchronize(self) -> None:
        if self.sender is not None:
            self.sender.synchronize()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def abort(self, command: AbortWeightGroupCommand) -> dict[str, Any]:
        """Rank 0 drops the weight-update group an engine broke (nothing waits for it); every rank answers."""
        if self.sender is not None:
            log.warning("aborting the weight-update group: %s", command.reason)
            self.sender.abort_group()
        self.group_address = None
        return {}

    def _sender(self, bucket_bytes: int) -> WeightSender:
        if self.sender is None:
            info = self.rank.info
            tp_group, pp_group = self.rank.parallel_groups()
            self.sender = WeightSender(self.rank.parts.actor, self.rank.arch, tp_group=tp_group, tp_size=info.tp_size,
                                       dp_rank=info.dp_rank, rank=info.rank, bucket_bytes=bucket_bytes,
                                       dtype=export_dtype(info.on_cpu), pp_group=pp_group,
                                       pp_rank=info.pp_rank, pp_size=info.pp_size, fp8=self.rank.engine_fp8)
        self.sender.set_bucket_bytes(bucket_bytes)
        return self.sender

    def sync(self, command: SyncWeightsCommand) -> dict[str, Any]:
        info = self.rank.info
        check_finite_weights(self.rank.parts.actor, device=info.device, rank=info.rank)
        sender = self._sender(command.bucket_bytes)
        plan = sender.plan_buckets()
        abandoned = self._join(command, plan) if info.rank == 0 else ""
        for index in range(len(plan)):  # every rank gathers as usual (TP/PP peers wait for rank 0 to take part)
            sender.send_bucket(index, broadcast=not abandoned)
        if abandoned:
            return {"join_abandoned": abandoned}
        sender.finish()
        self.rank.engines_updated()
        return {"buckets": len(plan), "bytes": sum(b.num_bytes for b in plan)}

    def _join(self, command: SyncWeightsCommand, plan: list[Any]) -> str:
        """Rank 0: send the plan, join a new group if asked; why it gave up the join ("" when it did not)."""
        assert self.sender is not None
        if command.new_group or self.group_address is None:
            self.group_address = (weight_sync_address(os.environ), free_port())
        address, port = self.group_address
        self.source.send_weight_plan(WeightPlan(
            weight_version=command.weight_version, master_address=address, master_port=port,
            buckets=[b.to_dict() for b in plan], load_format=LOAD_FORMAT))
        if not command.new_group:  # the engines are still in the group built last time
            return ""
        try:
            self.sender.connect(address, port, command.world_size, group_name=command.group_name,
                                backend=command.backend, give_up=lambda: self.source.join_verdict(command.seq))
        except WeightGroupJoinAbandoned as gave_up:  # an engine will not come: the controller rebuilds
            log.warning("weight sync v%d: %s", command.weight_version, gave_up)
            self.group_address = None
            return str(gave_up)
        return ""
