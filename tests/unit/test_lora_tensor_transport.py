"""The LoRA tensor transport's controller half (issue 33, `controller.transports.lora_tensor`) against fakes of the
trainer channel, the engines' admin calls and the registry: colocated LoRA sends the adapter through
/load_lora_adapter_from_tensors (LoraTensorCommand, ranks paired with engines by GPU), re-sends the base first when
the engines' weights were dropped (colocated sync mode) and not with lora_base_cpu_backup, skips engines that hold
the version, and reports the bytes it moved."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.config.lora import LoraConfig, engine_lora_options
from hpc_rl.config.sections.cluster import ClusterConfig, ControllerConfig
from hpc_rl.config.sections.rollout import RolloutConfig
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.transports import WeightSyncSettings, make_transport
from hpc_rl.controller.transports.lora_tensor import LoraTensorTransport
from hpc_rl.protocol.messages import ColocatedSyncCommand, CommandDone, LoraTensorCommand

BASE_BYTES, ADAPTER_BYTES = 300_000, 65_536


class FakeTrainerChannel:
    """A fake of TrainerChannel: two 'ranks' that answer each command with the bytes it would move."""

    def __init__(self) -> None:
        self.commands: list[Any] = []

    async def run(self, make_command, timeout_s: float = 0.0) -> list[CommandDone]:
        commands = [make_command(rank, seq) for seq, rank in enumerate(range(2))]
        self.commands.append(commands[0])
        metrics = {"buckets": 1, "bytes": BASE_BYTES} if isinstance(commands[0], ColocatedSyncCommand) else \
            {"adapter_bytes": ADAPTER_BYTES}
        return [CommandDone(rank=rank, seq=rank, metrics=metrics) for rank in range(2)]


class FakeEngineAdmin:
    def __init__(self, calls: list[tuple], index: int) -> None:
        self.calls, self.index = calls, index

    async def begin_weight_update(self) -> None:
        self.calls.append(("begin", self.index))

    async def end_weight_update(self) -> None:
        self.calls.append(("end", self.index))

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("version", self.index, version))

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", self.index, name))


@dataclass
class FakeMember:
    info: dict[str, Any] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)


class FakeRegistry:
    """Two trainer ranks on node0's GPUs 0 and 1; engine 0 on GPU 1, engine 1 on GPU 0 (paired by device)."""

    trainer_world_size = 2
    trainers = {0: FakeMember(info={"device": "node0/gpu0"}), 1: FakeMember(info={"device": "node0/gpu1"})}
    engines = {0: FakeMember(devices=["node0/gpu1"]), 1: FakeMember(devices=["node0/gpu0"])}


class FakeFleet:
    def __init__(self, admins: dict[int, FakeEngineAdmin]) -> None:
        self.admins = admins


class FakeMemory:
    """A fake of ColocatedMemory: the trainer's offload state and the calls that move it."""

    def __init__(self) -> None:
        self.trainer_offloaded, self.moves = {"weights"}, []

    async def trainer(self, action: str, tags: list[str]) -> dict[str, Any]:
        self.moves.append((action, tuple(tags)))
        self.trainer_offloaded = self.trainer_offloaded - set(tags) if action == "onload" else \
            self.trainer_offloaded | set(tags)
        return {}


ENGINES = [EngineInfo(engine_index=0, url="http://e0"), EngineInfo(engine_index=1, url="http://e1")]


def make(**overrides: Any) -> tuple[LoraTensorTransport, FakeTrainerChannel, list[tuple], FakeMemory]:
    options = dict(backend="gloo", colocate=True, async_rollout=False, update_weights_interval=1,
                   bucket_bytes=1 << 20, timeout_s=30.0, num_engines=2, lora_dir="/run", lora_tensor=True)
    settings = WeightSyncSettings(**{**options, **overrides})
    calls: list[tuple] = []
    channel, memory = FakeTrainerChannel(), FakeMemory()
    made = make_transport(settings, channel=channel, fleet=FakeFleet({i: FakeEngineAdmin(calls, i) for i in range(2)}),
                          registry=FakeRegistry(), memory=memory)  # type: ignore[arg-type]
    assert isinstance(made, LoraTensorTransport)
    return made, channel, calls, memory


def test_colocated_lora_runs_choose_the_tensor_transport() -> None:
    lora = LoraConfig(lora_rank=8, target_modules="all-linear")
    cluster = ClusterConfig(colocate=True)
    made = WeightSyncSettings.from_sections(cluster, RolloutConfig(), ControllerConfig(), lora_dir="/run", lora=lora)
    assert made.transport_name == "lora_tensor" and made.lora_tensor and not made.sync_at_start
    decoupled = WeightSyncSettings.from_sections(ClusterConfig(), RolloutConfig(), ControllerConfig(),
                                                 lora_dir="/run", lora=LoraConfig(lora_rank=8, target_modules="q_proj",
                                                                                  lora_adapter_path="/a"))
    assert decoupled.transport_name == "lora" and decoupled.sync_at_start
    backup = LoraConfig(lora_rank=8, target_modules="q_proj", lora_base_cpu_backup=True)
    assert engine_lora_options(backup)["enable_weights_cpu_backup"] is True
    assert "enable_weights_cpu_backup" not in engine_lora_options(lora)


def test_colocated_sync_mode_resends_the_base_then_the_adapter_by_gpu() -> None:
    transport, channel, calls, memory = make()
    metrics = asyncio.run(transport.push(1, ENGINES))
    base, adapter = channel.commands
    assert isinstance(base, ColocatedSyncCommand) and isinstance(adapter, LoraTensorCommand)
    assert adapter.lora_name == "policy-v1" and adapter.rank_engines == [[1, 0], [0, 0]]  # by GPU, not rank
    assert adapter.engine_urls == ["http://e0", "http://e1"]
    assert metrics["perf/weight_sync_bytes"] == BASE_BYTES + ADAPTER_BYTES
    assert ("begin", 0) in calls and ("version", 1, "1") in calls
    assert memory.moves == [("onload", ("weights",)), ("offload", ("weights",))]  # weights back where they were
    calls.clear()
    asyncio.run(transport.push(2, ENGINES))
    assert sorted(c for c in calls if c[0] == "unload") == [("unload", 0, "policy-v1"), ("unload", 1, "policy-v1")]


def test_with_the_base_backed_up_or_async_only_the_adapter_moves() -> None:
    for overrides in ({"lora_base_cpu_backup": True}, {"async_rollout": True}):
        transport, channel, calls, _ = make(**overrides)
        metrics = asyncio.run(transport.push(1, ENGINES))
        assert [type(c) for c in channel.commands] == [LoraTensorCommand], overrides
        assert metrics["perf/weight_sync_bytes"] == ADAPTER_BYTES and not [c for c in calls if c[0] == "begin"]
        channel.commands.clear()
        asyncio.run(transport.push(1, ENGINES))  # an engine came back: the ones holding policy-v1 are skipped
        assert channel.commands[0].engine_urls == ["", ""]
        transport.engine_failed(1)
        asyncio.run(transport.push(1, ENGINES))
        assert channel.commands[1].engine_urls == ["", "http://e1"]
