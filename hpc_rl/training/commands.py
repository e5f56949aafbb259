"""The trainer's command loop: what a rank does for each controller command.

Owns `TrainerCommands.run()`: ask the command source for the next command, run it, report done
(or the error), until `StopCommand`. Every rank runs the loop and receives every command (its own
share for `TrainCommand`), so collectives line up. Commands are `hpc_rl.protocol.messages` types:

    TrainCommand(rollout_id, batch arrays)  -> RolloutTrainer.train_rollout, metrics to TensorBoard
                                               (optimizer moments reset before it, reference updated
                                               after it, as optimizer/algorithm ask)
    EvalLossCommand(batch arrays)           -> eval_loss.evaluate_loss (SFT's held-out loss, no update)
    SyncWeightsCommand(version, group, ...) -> WeightPlan from rank 0, then the bucket broadcasts (none when
                                               the controller told rank 0 to stop waiting for the engines
                                               to join a new group: {"join_abandoned": why});
                                               training.transports.broadcast
    SaveCommand(rollout_id, controller_state) -> checkpoint.save_checkpoint (+ the HF copy, save_hf)
    LoraAdapterCommand(version, path)       -> the LoRA adapter only, as a PEFT directory at path (transports.lora)
    LoraTensorCommand(version, name, ...)   -> the LoRA adapter only, to /load_lora_adapter_from_tensors (lora_tensor)
    DiskWeightsCommand(version, path)       -> the weights as an HF directory at path, then the post-write
                                               hook (training.transports.disk)
    TrainerMemoryCommand(action, tags)       -> colocated: offload/onload (hpc_rl.training.offload)
    ColocatedSyncCommand(version, engine_urls) -> colocated: /update_weights_from_tensor per bucket
                                               (training.transports.colocated)
    AbortWeightGroupCommand                  -> rank 0 aborts a weight-update group an engine broke
                                               (training.transports.broadcast)
    StopCommand                              -> leave

A command source is anything with `next_command()`, `done(seq, metrics)`, `failed(seq, error)`,
`send_weight_plan(plan)` and `join_verdict(seq)`: `ControllerLink` (the real controller) or `BatchFileCommands`
(a JSONL file of rollouts, for runs and tests before/without a controller).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.sections.training import CheckpointConfig
from hpc_rl.protocol.messages import (
    AbortWeightGroupCommand,
    ColocatedSyncCommand,
    DiskWeightsCommand,
    LoraAdapterCommand,
    LoraTensorCommand,
    EvalLossCommand,
    Message,
    SaveCommand,
    StopCommand,
    SyncWeightsCommand,
    TrainCommand,
    TrainerMemoryCommand,
    WeightPlan,
)
from hpc_rl.telemetry.scalars import ScalarLog
from hpc_rl.training import checkpoint
from hpc_rl.training.actor import TrainerParts
from hpc_rl.training.checkpoint_files import prune_iterations
from hpc_rl.training.nonfinite import NonFiniteSteps
from hpc_rl.training.eval_loss import evaluate_loss
from hpc_rl.training.critic import critic_save_dir
from hpc_rl.training.offload import TrainerOffload
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.train_batch import TrainBatch, read_batches_file
from hpc_rl.training.transports.base import TransportRank, export_dtype
from hpc_rl.training.transports.broadcast import TrainerBroadcast
from hpc_rl.training.transports.colocated import TrainerColocated
from hpc_rl.training.transports.disk import write_weights
from hpc_rl.training.transports.lora import write_adapter
from hpc_rl.training.transports.lora_tensor import TrainerLoraTensor
from hpc_rl.config.fp8_scheme import Fp8Blocks, read_fp8_blocks

log = logging.getLogger(__name__)

__all__ = ["BatchFileCommands", "JsonlBatchSource", "TrainerCommands", "export_dtype"]


class CommandSource(Protocol):
    def next_command(self) -> Message: ...
    def done(self, seq: int, metrics: dict[str, Any] | None = None) -> None: ...
    def failed(self, seq: int, error: str) -> None: ...
    def send_weight_plan(self, plan: WeightPlan) -> None: ...
    def join_verdict(self, seq: int) -> str: ...


class RolloutBatchSource(Protocol):
    """Where a rank's share of rollout `rollout_id` comes from (None: no more rollouts)."""

    def next_batch(self, rollout_id: int) -> TrainBatch | None: ...


class JsonlBatchSource:
    """Rollout i = line i of a JSONL file ({"samples": [...]}); each DP rank takes a contiguous share."""

    def __init__(self, path: str | Path, *, dp_rank: int, dp_size: int) -> None:
        self.batches = list(read_batches_file(path))
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def next_batch(self, rollout_id: int) -> TrainBatch | None:
        if rollout_id >= len(self.batches):
            return None
        batch = self.batches[rollout_id]
        if len(batch) % self.dp_size:
            raise ValueError(f"rollout {rollout_id}: {len(batch)} samples do not split over {self.dp_size} DP ranks")
        share = len(batch) // self.dp_size
        return batch.select(range(self.dp_rank * share, (self.dp_rank + 1) * share))


class BatchFileCommands:
    """A command source without a controller: train on each rollout, save every `save_interval`."""

    def __init__(self, source: RolloutBatchSource, *, start_rollout: int, num_rollouts: int | None,
                 save_dir: str | None, save_interval: int | None, controller_state: dict | None = None) -> None:
        self._commands = self._generate(source, start_rollout, num_rollouts, save_dir, save_interval,
                                        controller_state or {})
        self.finished: list[tuple[int, dict[str, Any]]] = []

    @staticmethod
    def _generate(source: RolloutBatchSource, start: int, count: int | None, save_dir: str | None,
                  interval: int | None, state: dict) -> Iterator[Message]:
        seq = 0
        rollout_id = start
        while count is None or rollout_id < start + count:
            batch = source.next_batch(rollout_id)
            if batch is None:
                break
            yield TrainCommand(seq=seq, rollout_id=rollout_id, batch=batch.to_arrays())
            seq += 1
            if save_dir and interval and (rollout_id + 1) % interval == 0:
                yield SaveCommand(seq=seq, rollout_id=rollout_id, controller_state={**state, "next_rollout": rollout_id + 1})
                seq += 1
            rollout_id += 1
        yield StopCommand(seq=seq, reason="batches file exhausted")

    def next_command(self) -> Message:
        return next(self._commands)

    def done(self, seq: int, metrics: dict[str, Any] | None = None) -> None:
        self.finished.append((seq, metrics or {}))

    def failed(self, seq: int, error: str) -> None:
        raise RuntimeError(f"command {seq} failed:\n{error}")

    def send_weight_plan(self, plan: WeightPlan) -> None:
        raise RuntimeError("a batches file run has no engines to sync weights to")


class TrainerCommands:
    """Runs commands on one trainer rank until Stop."""

    def __init__(self, parts: TrainerParts, *, arch: ModelArchitecture, info: ParallelInfo, source: CommandSource,
                 save_dir: str | None, scalars: ScalarLog | None = None, engine_api_key: str | None = None,
                 offload_train: bool = True, train_memory_margin_bytes: int = 0,
                 checkpoint_config: CheckpointConfig | None = None, keep_last: int | None = None,
                 max_nonfinite_steps: int = 3) -> None:
        self.parts, self.arch, self.info, self.source = parts, arch, info, source
        self.save_dir, self.scalars = save_dir, scalars
        self.checkpoint_config = checkpoint_config or CheckpointConfig()
        """save_optim, save_hf (and its hf_checkpoint side files) for SaveCommand."""
        self.keep_last = keep_last
        """checkpoint.keep_last: rank 0 removes older checkpoints after each save."""
        self._image_processor: Any = None
        """Image prompts: the checkpoint's image processor, built at the first batch with images (`with_images`)."""
        self.nonfinite = NonFiniteSteps(max_nonfinite_steps)
        self.after_done: list[Callable[[], None]] = []
        """What a command leaves to do once its `done` is sent (a train command's TensorBoard scalars and log line):
        nothing waits for it, so the controller goes on meanwhile (it is on a sync-mode step's path otherwise)."""
        self.engine_api_key = engine_api_key
        """Colocated mode: this rank posts its weights to its engine itself (derived from the job secret)."""
        # the reference's and teacher's weights live in host memory already (`host_weights`): not offloaded; the
        # actor's host copy is the one its weights use while a frozen model is on the device
        self.offload = TrainerOffload(models=[parts.actor, parts.critic_model],
                                      optimizer=[parts.optimizer, parts.critic_optimizer], enabled=offload_train,
                                      margin_bytes=train_memory_margin_bytes,
                                      host_buffers=parts.trainer.actor_host_buffers)
        """Colocated: training.offload_train false keeps the state on the device (slime's --no-offload-train)."""
        rank = TransportRank(parts=parts, arch=arch, info=info, engines_updated=self._engines_updated,
                             engine_fp8=self.engine_fp8())
        self.broadcast = TrainerBroadcast(rank, source)
        """The broadcast transport's trainer half (`training.transports.broadcast`)."""
        self.colocated = TrainerColocated(rank, self.offload, engine_api_key=engine_api_key)
        """The colocated transport's trainer half (`training.transports.colocated`)."""
        self.lora_tensor = TrainerLoraTensor(rank, self.offload, self.checkpoint_config, engine_api_key=engine_api_key)
        """The LoRA tensor transport's trainer half (`training.transports.lora_tensor`)."""
        self.transport_rank = rank

    def run(self) -> None:
        while True:
            command = self.source.next_command()
            if isinstance(command, StopCommand):
                self.source.done(command.seq)
                break
            try:
                metrics = self.execute(command)
            except Exception:  # reported to the controller, which decides; then re-raised
                self.after_done.clear()
                self.source.failed(command.seq, traceback.format_exc())
                raise
            self.source.done(command.seq, metrics)
            while self.after_done:
                self.after_done.pop(0)()
        self.broadcast.close()

    def execute(self, command: Message) -> dict[str, Any]:
        if isinstance(command, AbortWeightGroupCommand):
            return self.broadcast.abort(command)
        self.broadcast.synchronize()  # the GPU would wait for the group's broadcasts before any new work
        if isinstance(command, TrainerMemoryCommand):
            return self.memory(command)
        if isinstance(command, ColocatedSyncCommand):
            return self.colocated.sync(command)
        if isinstance(command, LoraTensorCommand):
            return self.lora_tensor.sync(command)
        self.offload.require_onloaded(type(command).__name__)
        if isinstance(command, TrainCommand):
            return self.train(command)
        if isinstance(command, EvalLossCommand):
            return evaluate_loss(self.parts.trainer, TrainBatch.from_arrays(self.with_images(command.batch),
                                                                             command.meta))
        if isinstance(command, SyncWeightsCommand):
            return self.broadcast.sync(command)
        if isinstance(command, DiskWeightsCommand):
            return write_weights(self.transport_rank, command, self.checkpoint_config)
        if isinstance(command, LoraAdapterCommand):
            return write_adapter(self.transport_rank, command, self.checkpoint_config)
        if isinstance(command, SaveCommand):
            root = self.save_dir or ""
            if not root:
                raise ValueError("SaveCommand but checkpoint.save is not set")
            return self.save(root, command)
        raise ValueError(f"unknown trainer command {type(command).__name__}")

    def save(self, root: str, command: SaveCommand) -> dict[str, Any]:
        trainer, config = self.parts.trainer, self.checkpoint_config
        path = checkpoint.save_checkpoint(
            root, self.parts.actor, self.parts.optimizer,
            checkpoint.TrainerState(rollout_id=command.rollout_id, controller_state=command.controller_state),
            save_optim=config.save_optim,
            ref_model=self.parts.ref_model if trainer.algorithm.ref_update_interval else None)
        out, roots = {"checkpoint": str(path)}, [root]
        if self.parts.critic_model is not None and self.parts.critic_optimizer is not None:  # PPO's critic
            roots.append(critic_save_dir(self.parts.critic_config, root) or "")
            out["critic_checkpoint"] = str(checkpoint.save_checkpoint(
                roots[-1], self.parts.critic_model, self.parts.critic_optimizer,
                checkpoint.TrainerState(rollout_id=command.rollout_id), save_optim=config.save_optim))
        if self.keep_last and self.info.rank == 0:
            for kept_root in roots:
                for old in prune_iterations(kept_root, self.keep_last):
                    log.info("removed %s (checkpoint.keep_last=%d)", old, self.keep_last)
        if config.save_hf:
            from hpc_rl.training.hf_save import hf_output_dir, save_hf_checkpoint

            out["hf_checkpoint"] = str(save_hf_checkpoint(
                self.parts.actor, self.arch, hf_output_dir(config.save_hf, command.rollout_id),
                reference_dir=config.hf_checkpoint or None, info=self.info, tp_group=trainer.tp_group,
                fp8=self.engine_fp8(), merge_lora=True))
        return out

    def with_images(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Image prompts: the controller's image references processed by the checkpoint's image processor (the one
        the CPU engine uses), as TrainBatch.from_arrays reads them; other batches as they are."""
        from hpc_rl.data.images import IMAGE_REFS_ARRAY

        if IMAGE_REFS_ARRAY not in arrays:
            return arrays
        from hpc_rl.data.vision_prompts import image_processor, with_processed_images

        if self._image_processor is None:
            self._image_processor = image_processor(self.checkpoint_config.hf_checkpoint)
        return with_processed_images(arrays, self._image_processor)

    def train(self, command: TrainCommand) -> dict[str, Any]:
        batch = TrainBatch.from_arrays(self.with_images(command.batch), command.meta)
        trainer = self.parts.trainer
        if "num_rollout" in command.meta:  # the lr schedule's length (slime: decay over every step of the run)
            total = int(command.meta["num_rollout"]) * trainer.training.num_steps_per_rollout
            for optimizer in (self.parts.optimizer, self.parts.critic_optimizer):
                if optimizer is not None:
                    optimizer.set_run_length(total)
        if self.parts.optimizer.config.reset_optimizer_states:
            self.parts.optimizer.reset_state()
        steps = trainer.train_rollout(batch, command.rollout_id)
        self.nonfinite.check(command.rollout_id, steps)
        interval = trainer.algorithm.ref_update_interval
        if interval and (command.rollout_id + 1) % interval == 0:
            trainer.update_reference()
        if self.info.rank == 0:
            first_step = self.parts.optimizer.steps_done - len(steps) + 1  # steps done, as rollout/* counts rollouts
            self.after_done.append(lambda: self._record_steps(command.rollout_id, first_step, steps))
        return {"steps": steps, "rollout_id": command.rollout_id}

    def _record_steps(self, rollout_id: int, first_step: int, steps: list[dict[str, Any]]) -> None:
        """Rank 0: a train command's steps as TensorBoard scalars and one log line each."""
        for step, metrics in enumerate(steps, first_step):
            if self.scalars is not None:
                self.scalars.log({f"train/{k}": v for k, v in metrics.items()}, step)
            log.info("rollout %d step %d: %s", rollout_id, step,  # per-layer MoE metrics: TensorBoard only
                     " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if "/layer_" not in k))

    def memory(self, command: TrainerMemoryCommand) -> dict[str, Any]:
        if command.action == "offload":
            return self.offload.offload(command.tags)
        if command.action == "onload":
            return self.offload.onload(command.tags)
        raise ValueError(f"trainer memory action {command.action!r}: use offload or onload")

    def engine_fp8(self) -> Fp8Blocks | None:
        """The engines' checkpoint's block-FP8 scheme (None: not quantized): weight syncs quantize as it does."""
        config = self.checkpoint_config
        if not config.hf_checkpoint:
            return None
        return read_fp8_blocks(config.hf_checkpoint, ue8m0=config.force_fp8_ue8m0_scale)

    def _engines_updated(self) -> None:
        """The engines now serve the actor's weights (keep_old_actor keeps a copy for the old log-probs)."""
        if self.parts.trainer.algorithm.keep_old_actor:
            self.parts.trainer.remember_rollout_weights()
