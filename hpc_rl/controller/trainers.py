"""What the loop asks of the trainer ranks: train on a rollout, save a checkpoint, stop.

Owns turning a rollout's groups into each data-parallel rank's `TrainCommand` (group-normalised rewards
and the token-balanced split are `train_batches`'), the train metrics a rollout reports, SFT's held-out
loss (`evaluate_loss`: an `EvalLossCommand` per rank, no update), and the save and stop commands. Not here: the command queue, sequence numbers and completion (`trainer_channel`),
and what the ranks do with a command (`hpc_rl.training`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hpc_rl.config.schema import AlgorithmConfig
from hpc_rl.controller.logprob_guard import LogprobGuard
from hpc_rl.controller.registry import Registry
from hpc_rl.controller.train_batches import PackBuffers, RewardShaping, pack_samples, split_for_data_parallel
from hpc_rl.controller.trainer_channel import TrainerChannel, merge_metrics
from hpc_rl.data.samples import Group, Sample
from hpc_rl.protocol.messages import EvalLossCommand, SaveCommand, StopCommand, TrainCommand


def reward_shaping(algorithm: AlgorithmConfig, n_samples_per_prompt: int,
                   post_process: Callable[[list[Any]], Any] | None = None) -> RewardShaping:
    """The algorithm section's reward-normalisation fields (groups have `n_samples_per_prompt` samples);
    `post_process`: a custom reward post-process function with its args bound."""
    return RewardShaping(advantage_estimator=algorithm.advantage_estimator, n_samples_per_prompt=n_samples_per_prompt,
                         std_normalization=not algorithm.disable_grpo_std_normalization,
                         disabled=algorithm.disable_rewards_normalization, post_process=post_process)


def trainer_summary(reported: dict[str, Any]) -> dict[str, Any]:
    """A rollout's train metrics: the last optimizer step's, plus the first step's ppo_kl / kl_loss
    (the first-step sanity checks: both are exactly 0 when weights = rollout weights = reference) and
    train/rollout log-prob gap (before any update: what `logprob_guard` checks after a sync)."""
    steps = reported.get("steps") or []
    summary = {k: v for k, v in reported.items() if k != "steps"}
    if steps:
        summary.update(steps[-1])
        for key in ("ppo_kl", "kl_loss", "train_rollout_logprob_abs_diff"):
            if key in steps[0]:
                summary[f"first_step_{key}"] = steps[0][key]
        summary["num_steps"] = len(steps)
    return summary


class Trainers:
    """Every trainer rank, as the loop sees them: each call is one collective command, done on every rank."""

    def __init__(self, channel: TrainerChannel, registry: Registry, *, shaping: RewardShaping,
                 num_rollout: int, guard: LogprobGuard | None = None) -> None:
        self.channel, self.registry, self.shaping, self.num_rollout = channel, registry, shaping, num_rollout
        self.guard = guard
        """Fails the run when the engines' log-probs are not the trainer's right after a sync."""
        self.pack_buffers = PackBuffers()
        """The train batches' per-token arrays, reused from one rollout to the next (given back only once every
        rank reported the command that carried them done)."""
        self.trained: tuple[int, int] | None = None
        """(rollout id, weight version) the ranks hold after their last train command; None while one runs
        or after one was abandoned (their state is then not known here)."""

    async def train(self, rollout_id: int, groups: list[Group], weight_version: int) -> dict[str, Any]:
        """One rollout's optimizer step(s) on every rank; its metrics (train/..., time/train)."""
        dp_of = {rank: int(t.info.get("dp_rank", 0)) for rank, t in self.registry.trainers.items()}
        dp_size = max(1, int(next(iter(self.registry.trainers.values())).info.get("dp_size", 1)))
        lease = self.pack_buffers.lease()
        batches = split_for_data_parallel(groups, self.shaping, dp_size, lease)
        start = time.perf_counter()
        self.trained = None
        done = await self.channel.run(lambda rank, seq: TrainCommand(
            seq=seq, rollout_id=rollout_id, batch=batches[dp_of[rank]],
            meta={"weight_version": weight_version, "num_rollout": self.num_rollout}))
        # Every rank read its whole frame: no connection, transport or signer holds the arrays now. (Not reached
        # when the command failed or was abandoned: that lease's arrays are never reused.)
        lease.release()
        self.trained = (rollout_id, weight_version + 1)
        metrics = {f"train/{k}" if "/" not in k else k: v for k, v in trainer_summary(merge_metrics(done)).items()}
        metrics["time/train"] = time.perf_counter() - start
        if self.guard is not None:
            self.guard.check(rollout_id, groups, weight_version, metrics)
        return metrics

    async def evaluate_loss(self, name: str, samples: list[Sample]) -> dict[str, float]:
        """SFT's eval: loss and greedy accuracy of the assistant tokens of `samples`, dealt to the DP ranks in
        order of length (shares may differ by one, or be empty: a forward-only pass needs no equal counts);
        eval/<name>/... metrics."""
        dp_of = {rank: int(t.info.get("dp_rank", 0)) for rank, t in self.registry.trainers.items()}
        dp_size = max(1, int(next(iter(self.registry.trainers.values())).info.get("dp_size", 1)))
        by_length = sorted(range(len(samples)), key=lambda i: samples[i].total_length)
        parts = [by_length[rank::dp_size] for rank in range(dp_size)]
        batches = [pack_samples([samples[i] for i in sorted(part)], [0.0] * len(part)) for part in parts]
        done = await self.channel.run(lambda rank, seq: EvalLossCommand(seq=seq, batch=batches[dp_of[rank]]))
        return {f"eval/{name}/{key}": value for key, value in merge_metrics(done).items()}

    async def save(self, rollout_id: int, controller_state: dict[str, Any]) -> float:
        """Every rank saves its checkpoint of rollout `rollout_id`, with the controller's state; seconds taken."""
        start = time.perf_counter()
        await self.channel.run(lambda rank, seq: SaveCommand(seq=seq, rollout_id=rollout_id,
                                                             controller_state=controller_state))
        return time.perf_counter() - start

    async def stop(self, reason: str, timeout_s: float = 120.0) -> None:
        """Tell every rank to exit (skipped when a rank is already lost: no one would answer)."""
        if self.channel.failure is None:
            await self.channel.run(lambda rank, seq: StopCommand(seq=seq, reason=reason), timeout_s=timeout_s)
