"""The adapter-only weight sync's controller half (issue 33, `controller.transports.lora`) against a fake of the
engines' admin calls and a fake trainer that writes a PEFT adapter file: each sync writes one versioned directory,
loads it by its versioned name on every engine, reports the version, unloads the name before, removes older
directories and reports the adapter's bytes; restarted engines get the adapter again; the rollouts ask for it by
name; the engines start with SGLang's LoRA options (checked against 0.5.23's list)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hpc_rl.config import load_config
from hpc_rl.config.lora import LoraConfig, engine_lora_options
from hpc_rl.config.sections.cluster import ClusterConfig, ControllerConfig
from hpc_rl.config.sections.rollout import RolloutConfig
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.transports import TRANSPORTS, WeightSyncSettings, make_transport
from hpc_rl.controller.transports.disk import safetensors_payload_bytes
from hpc_rl.controller.transports.lora import LoraTransport
from hpc_rl.protocol.messages import LoraAdapterCommand
from hpc_rl.rollout.request_batching import batchable, merge_payloads

ADAPTER = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8, dtype=torch.bfloat16)}
ADAPTER_BYTES = 8 * 64 * 4 + 64 * 8 * 2


class FakeTrainerChannel:
    """A fake of TrainerChannel: 'trainer ranks' that write the adapter file the command names."""

    def __init__(self, ranks: int = 2) -> None:
        self.ranks, self.commands = ranks, []

    async def run(self, make_command, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        commands = [make_command(rank, seq) for seq, rank in enumerate(range(self.ranks))]
        self.commands += commands
        path = Path(commands[0].path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(ADAPTER, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text("{}")
        return [{"path": str(path)} for _ in commands]


class FakeEngineAdmin:
    """A fake of EngineAdmin's LoRA calls: records them; `refuse_unload` makes /unload_lora_adapter fail."""

    def __init__(self, calls: list[tuple], index: int, refuse_unload: bool = False) -> None:
        self.calls, self.index, self.refuse_unload = calls, index, refuse_unload

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        assert (Path(lora_path) / "adapter_model.safetensors").is_file()
        self.calls.append(("load", self.index, lora_name))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        self.calls.append(("unload", self.index, lora_name))
        if self.refuse_unload:
            raise RuntimeError("adapter in use")

    async def update_weight_version(self, weight_version: str) -> None:
        self.calls.append(("version", self.index, weight_version))


class FakeFleet:
    def __init__(self, admins: dict[int, FakeEngineAdmin]) -> None:
        self.admins = admins


def settings(run_dir: Path | None, **overrides: Any) -> WeightSyncSettings:
    base = dict(backend="gloo", colocate=False, async_rollout=False, update_weights_interval=1, bucket_bytes=1 << 20,
                timeout_s=30.0, num_engines=2, lora_dir=str(run_dir) if run_dir else None)
    return WeightSyncSettings(**{**base, **overrides})


def transport(tmp_path: Path, refuse_unload: bool = False) -> tuple[LoraTransport, list[tuple], FakeTrainerChannel]:
    calls: list[tuple] = []
    admins = {i: FakeEngineAdmin(calls, i, refuse_unload=refuse_unload and i == 1) for i in range(2)}
    channel = FakeTrainerChannel()
    made = make_transport(settings(tmp_path), channel=channel, fleet=FakeFleet(admins),  # type: ignore[arg-type]
                          registry=None, memory=None)  # type: ignore[arg-type]
    assert isinstance(made, LoraTransport)
    return made, calls, channel


ENGINES = [EngineInfo(engine_index=0, url="http://e0"), EngineInfo(engine_index=1, url="http://e1")]


def test_the_lora_transport_is_chosen_only_for_a_decoupled_lora_run(tmp_path: Path) -> None:
    assert TRANSPORTS["lora"] is LoraTransport
    assert settings(tmp_path).transport_name == "lora"
    assert settings(tmp_path, transport="disk", disk_dir="/x").transport_name == "lora"  # never the whole weights
    assert settings(None).transport_name == "broadcast"
    assert settings(tmp_path, colocate=True).transport_name == "lora_tensor"  # transports.lora_tensor
    made = WeightSyncSettings.from_sections(ClusterConfig(), RolloutConfig(), ControllerConfig(), lora_dir="/run")
    assert made.lora_dir == "/run"


def test_each_sync_loads_the_new_version_by_name_and_unloads_the_one_before(tmp_path: Path) -> None:
    lora, calls, channel = transport(tmp_path)
    first = asyncio.run(lora.push(1, ENGINES))
    assert sorted(calls) == [("load", 0, "policy-v1"), ("load", 1, "policy-v1"), ("version", 0, "1"),
                             ("version", 1, "1")]
    assert all(isinstance(c, LoraAdapterCommand) and c.weight_version == 1 for c in channel.commands)
    assert channel.commands[0].path == str(tmp_path / "adapters" / "policy-v1")
    assert first["perf/weight_sync_bytes"] == ADAPTER_BYTES
    calls.clear()
    second = asyncio.run(lora.push(2, ENGINES))
    loads = sorted(c for c in calls if c[0] == "load")
    unloads = sorted(c for c in calls if c[0] == "unload")
    assert loads == [("load", 0, "policy-v2"), ("load", 1, "policy-v2")]
    assert unloads == [("unload", 0, "policy-v1"), ("unload", 1, "policy-v1")]
    assert calls.index(("load", 0, "policy-v2")) < calls.index(("unload", 0, "policy-v1"))  # never without one
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["policy-v2"]
    assert second["perf/weight_sync_bytes"] == ADAPTER_BYTES and second["weight_sync/seconds"] > 0


def test_a_restarted_engine_gets_the_adapter_again_and_a_refused_unload_only_warns(tmp_path: Path,
                                                                                     caplog) -> None:
    lora, calls, _ = transport(tmp_path, refuse_unload=True)
    asyncio.run(lora.push(1, ENGINES))
    calls.clear()
    asyncio.run(lora.push(1, ENGINES))  # the same version again (an engine came back): nobody reloads it
    assert not [c for c in calls if c[0] in ("load", "unload")]
    lora.engine_failed(1)
    calls.clear()
    asyncio.run(lora.push(1, ENGINES))
    assert [c for c in calls if c[0] == "load"] == [("load", 1, "policy-v1")]
    asyncio.run(lora.push(2, ENGINES))
    assert "unloading LoRA adapter policy-v1 failed" in caplog.text
    assert lora.loaded == {0: "policy-v2", 1: "policy-v2"}


def test_safetensors_payload_bytes_are_the_tensor_bytes(tmp_path: Path) -> None:
    save_file(ADAPTER, str(tmp_path / "a.safetensors"))
    assert safetensors_payload_bytes(tmp_path / "a.safetensors") == ADAPTER_BYTES


def test_rollouts_ask_for_the_adapter_by_name_in_single_and_batched_requests() -> None:
    one = {"rid": "a", "input_ids": [1, 2], "sampling_params": {}, "lora_path": "policy-v3"}
    assert batchable(one)
    assert merge_payloads([one, {**one, "rid": "b"}])["lora_path"] == "policy-v3"
    assert merge_payloads([one, {**one, "rid": "b", "lora_path": None}])["lora_path"] == ["policy-v3", None]
    assert "lora_path" not in merge_payloads([{k: v for k, v in one.items() if k != "lora_path"}])


def test_engines_start_with_sglangs_lora_options(in_repo: Path) -> None:
    lora = LoraConfig(lora_rank=8, target_modules="all-linear", exclude_modules="o_proj")
    options = engine_lora_options(lora)
    assert options == {"enable_lora": True, "max_lora_rank": 8,
                       "lora_target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]}
    known = {line.split("\t")[0] for line in Path("hpc_rl/config/sglang_options_0.5.23.txt").read_text().splitlines()}
    assert {"--" + key.replace("_", "-") for key in options} <= known
    backup = engine_lora_options(LoraConfig(lora_rank=8, target_modules="q_proj", lora_base_cpu_backup=True))
    assert backup["enable_weights_cpu_backup"] is True and "--enable-weights-cpu-backup" in known
    assert engine_lora_options(LoraConfig(lora_rank=8, target_modules="all-linear", lora_train_only=True)) == {}
    assert engine_lora_options(LoraConfig()) == {}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_engine_command_carries_the_lora_options(in_repo: Path, tmp_path: Path, device: str) -> None:
    """The CPU engine's command and sglang.launch_server's."""
    from hpc_rl.launch.step_plan import engine_command
    from hpc_rl.launch.topology import plan_topology

    config = load_config(["configs/tiny_cpu.yaml"], ["--lora-rank", "8", "--target-modules", "q_proj,v_proj"])
    config.run_dir, config.cluster.device = str(tmp_path), device
    argv = engine_command(config, plan_topology(config.cluster).engines[0], "127.0.0.1", 30000)
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"
    at = argv.index("--lora-target-modules")
    assert argv[at + 1:at + 3] == ["q_proj", "v_proj"] and (at + 3 == len(argv) or argv[at + 3].startswith("--"))
    from hpc_rl.launch.step_plan import teacher_engine_config

    assert teacher_engine_config(config).lora.lora_rank == 0  # a distillation teacher serves no adapter
    config.lora.lora_rank, config.lora.target_modules = 0, None
    assert "--enable-lora" not in engine_command(config, plan_topology(config.cluster).engines[0], "127.0.0.1", 1)
