"""Which routing each pass of a rollout's training uses on a MoE actor, and the step's router metrics.

Owns `MoeRouting`, built by `step` for an actor with experts: the stage hooks of each pass (replay,
record, router statistics) and the step's `train/moe/...` metrics; and the scale of the experts'
load-balancing losses in a step (`moe_aux_loss_scale`). The replay mechanics are
`routing_replay`'s, the statistics `router_health`'s. slime's stages, per pass:

    pass                        use_rollout_routing_replay   use_routing_replay        neither
    reference log-probs         the routers choose           the routers choose        choose
    old log-probs (own pass)    replay the engines'          record                    choose
    training steps              replay the engines'          replay the record (*)     choose

(*) With one optimizer step per rollout and no old-log-prob pass of its own (`step_settings.
old_logprobs_need_own_pass`), the training pass is the pass at the old weights on the same
micro-batches: its own choice is the record, so there is nothing to replay (slime records in a
separate pass and replays it: the same routing, one forward more). With several steps and the
engines' log-probs as old ones (`use_rollout_logprobs`: no old-log-prob pass), a pass that only
records runs before the first update, so later steps still replay the routing at the old weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.training.micro_batches import MicroBatch
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.pipeline import NO_HOOKS, StageHooks
from hpc_rl.training.router_health import RouterHealth, tracked_aux_losses
from hpc_rl.training.routing_replay import RoutingReplay
from hpc_rl.training.train_batch import TrainBatch


class ChainedHooks(StageHooks):
    """Several hooks, called in order."""

    def __init__(self, *hooks: StageHooks) -> None:
        self.hooks = hooks

    def before_forward(self, micro: object) -> None:
        for hook in self.hooks:
            hook.before_forward(micro)

    def after_forward(self, micro: object) -> None:
        for hook in self.hooks:
            hook.after_forward(micro)

    def before_backward(self, micro: object) -> None:
        for hook in self.hooks:
            hook.before_backward(micro)


class MoeRouting:
    """The actor's routers across one rollout's passes (module docstring)."""

    def __init__(self, actor: torch.nn.Module, arch: ModelArchitecture, training: TrainingConfig,
                 info: ParallelInfo) -> None:
        assert arch.num_moe_experts is not None, "MoeRouting is for models with experts"
        # sequence_parallel is off at TP 1 (TrainingConfig, the rule's one home)
        sp_size, sp_rank = (info.tp_size, info.tp_rank) if training.sequence_parallel else (1, 0)
        source = ("rollout" if training.use_rollout_routing_replay else "recorded" if training.use_routing_replay
                  else None)
        self.replay = None if source is None else RoutingReplay(
            actor, source=source, num_layers=arch.num_layers, num_experts=arch.num_moe_experts,
            topk=arch.moe_router_topk, device=info.device, sp_size=sp_size, sp_rank=sp_rank,
            recompute=training.recompute_granularity == "full",
            prefetch_microbatches=training.routing_replay_prefetch_microbatches)
        self.health = RouterHealth(
            actor, moe_layers=arch.moe_layers(), num_experts=arch.num_moe_experts, topk=arch.moe_router_topk,
            device=info.device, capacity_dropping=training.moe_expert_capacity_factor is not None,
            aux_losses=tracked_aux_losses(training.moe_router_load_balancing_type, training.moe_aux_loss_coeff),
            sp_size=sp_size, sp_rank=sp_rank, replay=self.replay)
        self.steps_per_rollout = training.num_steps_per_rollout

    def needs_record_pass(self) -> bool:
        """A record-only pass is due when no old-log-prob pass runs (the engines' log-probs are the old
        ones) and later steps need the routing at the old weights."""
        return (self.replay is not None and self.replay.source == "recorded" and self.steps_per_rollout > 1)

    @contextmanager
    def old_pass(self, batch: TrainBatch, micros: Sequence[MicroBatch] | None = None) -> Iterator[StageHooks]:
        """Hooks of the old-log-prob pass (or the record-only pass): replay the engines', or record. `micros`:
        the pass's micro-batches in order (routing replay reads their targets ahead)."""
        if self.replay is None:
            yield NO_HOOKS
        elif self.replay.source == "rollout":
            with self.replay.replaying(batch, micros=micros) as hooks:
                yield hooks
        else:
            with self.replay.recording() as hooks:
                yield hooks

    @contextmanager
    def training_pass(self, batch: TrainBatch, micros: Sequence[MicroBatch] | None = None) -> Iterator[StageHooks]:
        """Hooks of a training step's pass: replay (engines' or recorded) and count."""
        with ExitStack() as stack:
            hooks = [stack.enter_context(self.health.measuring())]
            if self.replay is not None and self.replay.source == "rollout":
                hooks.insert(0, stack.enter_context(self.replay.replaying(batch, backward=True, micros=micros)))
            elif self.replay is not None and self.replay.has_recording:
                hooks.insert(0, stack.enter_context(self.replay.replaying(None, backward=True, micros=micros)))
            yield ChainedHooks(*hooks)

    def step_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """The step's router metrics (a collective: every rank calls it)."""
        return self.health.step_metrics(num_micro_batches)

    def end_rollout(self) -> None:
        if self.replay is not None:
            self.replay.forget()


def moe_aux_loss_scale(num_micros: int, cp_size: int, per_token_loss: bool, global_tokens: float) -> float:
    """The factor Megatron's schedule gives the MoE load-balancing losses' gradient (`MoEAuxLossAutoScaler`),
    which its own `forward_step` sets and this pipeline must too: each micro-batch's aux loss is a mean over
    its tokens, so without per-token loss it is averaged over the micro-batches (times CP, which DDP's
    DP x CP average undoes); with it, DDP sums and Megatron divides every gradient by the global token count
    afterwards (`finalize_model_grads`), which the step applies here up front, as it does to the main loss."""
    if per_token_loss:
        return 1.0 / max(global_tokens, 1.0)
    return cp_size / max(num_micros, 1)


def set_moe_aux_loss_scale(num_micros: int, cp_size: int, per_token_loss: bool, global_tokens: float, *,
                           device: str | torch.device) -> None:
    """Set `moe_aux_loss_scale`'s factor for the coming backward passes (one value for the whole step)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    factor = moe_aux_loss_scale(num_micros, cp_size, per_token_loss, global_tokens)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(factor, dtype=torch.float32, device=device))
