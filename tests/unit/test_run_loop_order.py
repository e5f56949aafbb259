"""The order in which the run loop drives the trainer and the engines, per mode: the real loop (as the
controller assembles it) against a recording fake trainer rank, fake engines and a fake scheduler.

These sequences are the loop's contract with SGLang and the trainer (a colocated engine must release its
memory before the trainer onloads; a checkpoint is written while the trainer holds its whole state; an
async sync pauses with abort); they were recorded from the loop before its split into parts and are
the same after it, but for the pause/continue pair around a sync with nothing in flight, left out since
issue 23 (async mode's sync now waits for the rollout generated ahead, as slime's train_async.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hpc_rl.config import load_config
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry, TrainerInfo
from hpc_rl.controller.rollout_stack import assemble_loop
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.data.samples import Sample
from hpc_rl.protocol.messages import (ColocatedSyncCommand, CommandDone, SaveCommand, SyncWeightsCommand,
                                      TrainCommand, TrainerMemoryCommand, WeightPlan)
from hpc_rl.rollout.scheduler import RolloutResult
from hpc_rl.telemetry.recorder import RunRecorder
from hpc_rl.telemetry.scalars import ScalarLog


ENDS_AFTER_CAP_S = 10.0


class FakeScheduler:
    """Each rollout: one group of two scored samples (a fake of rollout.scheduler.RolloutScheduler)."""

    def __init__(self, events: list[str], seconds: float = 0.0, ends_after: dict[int, str] | None = None) -> None:
        self.events = events
        self.buffer: list[Any] = []
        self.seconds = seconds
        """How long each rollout generates (> 0: its end is recorded too, "generated k")."""
        self.ends_after = ends_after or {}
        """Rollout id -> an event that rollout generates until (at most `ENDS_AFTER_CAP_S`) instead of `seconds`:
        what a test says happens during the generation then does, however slow the machine (a fixed time raced it)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def set_weight_version(self, version: int) -> None:
        self.events.append(f"engines serve v{version}")

    async def run(self, rollout_id: int, weight_version: int) -> RolloutResult:
        self.events.append(f"generate {rollout_id}")
        if rollout_id in self.ends_after:
            awaited = self.ends_after[rollout_id]
            deadline = asyncio.get_running_loop().time() + ENDS_AFTER_CAP_S  # a loop that waits for the generation
            while awaited not in self.events and asyncio.get_running_loop().time() < deadline:  # fails its order
                await asyncio.sleep(0.005)                                                      # check, not hangs
        else:
            await asyncio.sleep(self.seconds)
        if self.seconds or rollout_id in self.ends_after:
            self.events.append(f"generated {rollout_id}")
        return RolloutResult(groups=[[Sample(index=2 * rollout_id + i, group_index=rollout_id, prompt="p",
                                             prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[-0.5],
                                             weight_versions=[weight_version], reward=float(i))
                                      for i in range(2)]])


class RecordingAdmin:
    """An engine's admin calls, recorded and answered at once (a fake of controller.engine_admin.EngineAdmin)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __getattr__(self, method: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> None:
            if method == "weight_update":  # one pipelined write: begin, every bucket, end
                self.events += ["engine begin_weight_update()", *["engine update bucket"] * len(args[0]),
                                "engine end_weight_update()"]
                return
            shown = ",".join(str(a) if not isinstance(a, list) else "+".join(a) for a in args)
            self.events.append(f"engine {method}({shown})" if method != "update_weights_from_distributed"
                               else "engine update bucket")
        return call


class FakeFleet:
    """What the loop reads of the fleet (a fake of controller.engine_fleet.EngineFleet)."""

    def __init__(self, events: list[str], engine_waiting: bool = False) -> None:
        self.engine_waiting = asyncio.Event()
        if engine_waiting:  # an engine came back and waits for the weights (the fleet clears it once served)
            self.engine_waiting.set()
        self.fatal = None
        self.admins = {0: RecordingAdmin(events)}

    async def mark_serving(self, indices: list[int]) -> None:
        self.engine_waiting.clear()

    async def serve_before_router(self, indices: list[int]) -> None:
        self.engine_waiting.clear()

    async def fail_engine(self, index: int, reason: str) -> None:
        raise AssertionError(reason)


def describe(command: Any) -> str:
    if isinstance(command, TrainCommand):
        return f"trainer train {command.rollout_id}"
    if isinstance(command, SaveCommand):
        state = command.controller_state
        return f"trainer save {command.rollout_id} (next {state['next_rollout_id']}, v{state['weight_version']})"
    if isinstance(command, SyncWeightsCommand):
        return f"trainer broadcast v{command.weight_version}"
    if isinstance(command, ColocatedSyncCommand):
        return f"trainer send to colocated engines v{command.weight_version}"
    if isinstance(command, TrainerMemoryCommand):
        return f"trainer {command.action}({'+'.join(command.tags)})"
    return f"trainer {type(command).__name__}"


async def recording_trainer_rank(channel: TrainerChannel, events: list[str]) -> None:
    """Rank 0 (the only one): records each command and reports it done; a sync's plan has one bucket."""
    while True:
        command = await channel.next_command(0)
        events.append(describe(command))
        await answer_command(channel, command)


async def answer_command(channel: TrainerChannel, command: object) -> None:
    """What a fake rank 0 does with any command: a sync's plan (one bucket), then done."""
    if isinstance(command, SyncWeightsCommand):
        channel.on_weight_plan(WeightPlan(weight_version=command.weight_version, master_address="127.0.0.1",
                                          master_port=1, buckets=[{"names": ["w"], "dtypes": ["float32"],
                                                                   "shapes": [[1]], "num_bytes": 4}]))
    await asyncio.sleep(0)
    channel.on_done(CommandDone(rank=0, seq=command.seq))  # type: ignore[attr-defined]


def run_mode(tmp_path: Path, *, colocate: bool, async_rollout: bool, num_rollout: int = 2,
             update_weights_interval: int = 1, engine_state: EngineState = EngineState.SERVING,
             flags: tuple[str, ...] = (), trainer_starts_after_engines: bool = False,
             generation_seconds: float = 0.0, engine_waiting: bool = False,
             generation_ends_after: dict[int, str] | None = None) -> list[str]:
    config = load_config(["configs/tiny_cpu.yaml"], ["--set", f"run_dir={tmp_path}", *flags])
    config.rollout.update_weights_interval = update_weights_interval
    config.cluster.colocate = colocate
    config.rollout.async_rollout = async_rollout
    config.rollout.n_samples_per_prompt = 2
    config.checkpoint.save_interval = 1
    events: list[str] = []

    async def main() -> None:
        registry = Registry(trainer_world_size=1, num_engines=1)
        registry.add_trainer(TrainerInfo(rank=0, world_size=1, host="h", pid=1,
                                         info={"dp_rank": 0, "dp_size": 1, "device": "h/gpu0"}))
        registry.add_engine(EngineInfo(engine_index=0, url="http://e0", state=engine_state, devices=["h/gpu0"]))
        channel = TrainerChannel(1)
        recorder = RunRecorder(tmp_path, ScalarLog(None), num_rollout=num_rollout, print_fn=lambda line: None)
        loop = assemble_loop(config, scheduler=FakeScheduler(events, generation_seconds, generation_ends_after), registry=registry, channel=channel,  # type: ignore[arg-type]
                             fleet=FakeFleet(events, engine_waiting), recorder=recorder, evaluate=None,  # type: ignore[arg-type]
                             num_rollout=num_rollout)
        if trainer_starts_after_engines:  # what the driver does before starting a colocated trainer
            await loop.weights.hand_gpus_to_trainer()
        trainer = asyncio.create_task(recording_trainer_rank(channel, events))
        try:
            await loop.run(resumed=False)
        finally:
            trainer.cancel()

    asyncio.run(main())
    return events


@pytest.fixture(autouse=True)
def _in_repo(in_repo: Path) -> None:
    pass


def test_sync_decoupled(tmp_path: Path) -> None:
    """No request is in flight between rollouts, so the sync has no pause/continue pair (SGLang's update calls
    take its model update lock, which waits only for requests in flight)."""
    one = ["trainer broadcast v{v}", "engine init_weight_group()",
           "engine begin_weight_update()", "engine update bucket", "engine end_weight_update()",
           "engines serve v{v}"]
    expected = ["generate 0", "trainer train 0", *[e.format(v=1) for e in one], "trainer save 0 (next 1, v1)",
                "generate 1", "trainer train 1", *[e.format(v=2) for e in one if "init_weight" not in e],
                "trainer save 1 (next 2, v2)"]
    assert run_mode(tmp_path, colocate=False, async_rollout=False) == expected


def test_colocated_sync_trades_the_gpus_and_saves_while_the_trainer_holds_everything(tmp_path: Path) -> None:
    def step(k: int) -> list[str]:
        return [f"generate {k}", "engine pause(retract)", "engine release_memory(kv_cache+cuda_graph+weights)",
                "trainer onload(weights+grads+optimizer)", f"trainer train {k}", f"trainer save {k} (next {k + 1}, v{k + 1})",
                "trainer offload(grads+optimizer)", "engine resume_memory(weights)", "engine begin_weight_update()",
                f"trainer send to colocated engines v{k + 1}", "engine end_weight_update()", f"engines serve v{k + 1}",
                "trainer offload(weights)", "engine resume_memory(kv_cache+cuda_graph)", "engine resume_generation()"]
    expected = ["trainer offload(weights+grads+optimizer)", *step(0), *step(1)]
    assert run_mode(tmp_path, colocate=True, async_rollout=False) == expected


def test_colocated_engines_free_the_gpus_for_the_trainers_start_then_serve_its_weights(tmp_path: Path) -> None:
    """slime's order: the engines release everything before the trainer builds its model; the trainer then
    offloads and the engines get its weights (v0) before the first rollout."""
    events = run_mode(tmp_path, colocate=True, async_rollout=False, num_rollout=1, trainer_starts_after_engines=True)
    assert events[:10] == ["engine release_memory(kv_cache+cuda_graph+weights)", "trainer offload(grads+optimizer)",
                           "engine resume_memory(weights)", "engine begin_weight_update()",
                           "trainer send to colocated engines v0", "engine end_weight_update()", "engines serve v0",
                           "trainer offload(weights)", "engine resume_memory(kv_cache+cuda_graph)",
                           "engine resume_generation()"]
    assert events[10] == "generate 0"


def test_async_generates_the_next_rollout_while_training_and_syncs_after_it(tmp_path: Path) -> None:
    """slime's train_async.py order: rollout k+1 generates while k trains; the sync waits until it is generated
    (its samples are all one version behind, no request is in flight while the weights change, so there is no
    pause/continue pair); rollout k+2 then starts on the new weights."""
    events = run_mode(tmp_path, colocate=False, async_rollout=True, num_rollout=3, generation_seconds=0.05)
    # rollout 1 started once rollout 0 went to the trainer (in sync mode: after the sync)
    assert events.index("trainer train 0") < events.index("generate 1") < events.index("trainer broadcast v1")
    # each sync after the rollout ahead was generated (training took no time here, generating 0.05 s)
    assert events.index("generated 1") < events.index("trainer broadcast v1")
    assert events.index("generated 2") < events.index("trainer broadcast v2")
    # rollout 2 generates on the weights of the sync after training 0
    assert events.index("engines serve v1") < events.index("generate 2")
    assert not [e for e in events if "pause" in e or "resume_generation" in e]
    assert events[-1] == "trainer save 2 (next 3, v3)" and events.count("generate 1") == 1


def test_a_checkpoint_without_a_sync_stores_the_trainers_version_in_every_mode(tmp_path: Path) -> None:
    """Rollout 0 trains the weights to v1 without a sync (interval 2): its checkpoint says v1, as a decoupled
    run's does, so a run resumed from it labels the weights as a run that never stopped would. (The
    colocated loop saved v0 here: a resumed run then counted versions one behind.)"""
    for colocate in (False, True):
        (tmp_path / str(colocate)).mkdir()
        events = run_mode(tmp_path / str(colocate), colocate=colocate, async_rollout=False, num_rollout=2,
                          update_weights_interval=2)
        assert [e for e in events if e.startswith("trainer save")] == ["trainer save 0 (next 1, v1)",
                                                                         "trainer save 1 (next 2, v2)"]


def test_a_sync_with_no_live_engine_pushes_nothing(tmp_path: Path) -> None:
    """Every engine down (restarting): no broadcast (the trainer would send buckets into a group no engine
    joined: "send_bucket before connect()"); the trainer's version is what a restarted engine gets."""
    events = run_mode(tmp_path, colocate=False, async_rollout=False, num_rollout=1, engine_state=EngineState.FAILED)
    assert events == ["generate 0", "trainer train 0", "engines serve v1", "trainer save 0 (next 1, v1)"]


def test_start_rollout_id_starts_a_fresh_run_there(tmp_path: Path) -> None:
    """slime's --start-rollout-id: rollouts start_rollout_id .. num_rollout - 1, schedules by rollout id."""
    events = run_mode(tmp_path, colocate=False, async_rollout=False, num_rollout=3, flags=("--start-rollout-id", "2"))
    assert [e for e in events if e.startswith(("generate", "trainer train", "trainer save"))] == [
        "generate 2", "trainer train 2", "trainer save 2 (next 3, v1)"]


def test_an_engine_waiting_mid_rollout_gets_the_weights_alone_while_the_others_generate(tmp_path: Path) -> None:
    """Sync mode, an engine restarted (or joined from an engine job) mid-rollout: it gets the current weights at once,
    over a group of the waiting engines only, so the engines serving are not paused (no pause/continue pair), and it
    serves before the rollout ends."""
    events = run_mode(tmp_path, colocate=False, async_rollout=False, num_rollout=1, engine_state=EngineState.STARTING,
                      engine_waiting=True, generation_ends_after={0: "engine end_weight_update()"})
    assert events[:3] == ["generate 0", "trainer broadcast v0", "engine init_weight_group()"]
    assert "engine pause(retract)" not in events and "engine resume_generation()" not in events
    assert events.index("engine end_weight_update()") < events.index("generated 0")


def test_async_in_place_syncs_while_the_rollout_ahead_generates(tmp_path: Path) -> None:
    """flush_cache_interval 2 (slime's --flush-cache-interval): the sync does not wait for the rollout ahead; its
    requests pause in place (kept with their KV cache) around the push and go on; every second sync retracts
    them instead, so the engines can flush their cache."""
    events = run_mode(tmp_path, colocate=False, async_rollout=True, num_rollout=3,
                      generation_ends_after={1: "engine resume_generation()", 2: "engines serve v2"},
                      flags=("--async-rollout", "--flush-cache-interval", "2"))
    assert events.index("generate 1") < events.index("trainer broadcast v1") < events.index("generated 1")
    first = events.index("trainer broadcast v1")
    assert events[first - 1] == "engine pause(in_place)"
    assert events.index("engines serve v1") + 1 == events.index("engine resume_generation()")
    second = events.index("trainer broadcast v2")
    assert events[second - 1] == "engine pause(retract)" and events.index("generate 2") < second
    assert events.count("engine pause(in_place)") == 1 and events.count("engine pause(retract)") == 1
