"""One rollout's training on a trainer rank: the order of its passes, the loss, the optimizer steps.

Owns: splitting a `TrainBatch` into `num_steps_per_rollout` steps, the order of a rollout's passes (reference,
old and teacher log-probs: `logprob_passes`; the critic: `critic`; advantages: `rollout_advantages`; then each
step), each micro-batch's loss, the loss scale that makes a step's gradient independent of the micro-batching,
the optimizer-step loop and the step's metrics. The formulas are `losses`' (pure) or, with slime's
`--custom-loss-function-path`, the user's (`custom_hooks`); which passes run is `step_settings`'; the micro-batch
packing is `batching`'s, log-probs under TP are `logprobs`', running micro-batches through pipeline stages is
`pipeline`'s.

Pipeline parallel: every stage builds the same micro-batches (it has the tokens), but only the last
stage sees logits, so the per-sample results live there: ref/old log-probs, KL, advantages, the
loss and its metrics are computed on the last stage only; the other stages run their chunk's
forward and backward. After the optimizer step the last stage broadcasts the step's metrics over
the pipeline group, so every rank (global rank 0 included, which reports them) returns the same.

MTP layers (`--enable-mtp-training`) learn in the training pass: each micro-batch carries its MTP
targets (`MicroBatch.mtp_loss_mask`, the trained response tokens) and the model attaches their loss
(`mtp_model`), scaled per trained token of the whole step; train/mtp_<k>_loss and mtp_loss are logged.

Training modes (one loop, issue 21): SFT (loss_type sft_loss) computes no reference, old log-probs or
advantages, only -log p of the assistant tokens; on-policy distillation takes the teacher's log-probs (a
teacher model on these ranks, or a teacher server's, in the batch) and subtracts opd_kl_coef * (logp_old -
logp_teacher) from the advantages; PPO trains the critic (`critic.train_critic`) first on each rollout, its
values (before its update) giving the actor's GAE advantages, and the actor not at all for
num_critic_only_steps rollouts.

A MoE actor's routers replay or record in these passes and report their health per step (`moe_routing`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.sections.algorithm import AlgorithmConfig, DistillationConfig
from hpc_rl.config.sections.training import CriticConfig, TrainingConfig
from hpc_rl.plugins import load_plugin
from hpc_rl.training.critic import critic_metrics, train_critic
from hpc_rl.training.custom_hooks import (
    check_custom_loss_result, load_custom_advantages, load_custom_loss, trainer_args,
)
from hpc_rl.training.host_weights import HostResidentModel
from hpc_rl.training.logprob_passes import LogProbPasses
from hpc_rl.training.loss_reduction import sum_of_sample_mean, sum_of_tokens
from hpc_rl.training.losses import policy_loss_and_metrics, sft_loss
from hpc_rl.training.micro_batches import MicroBatch
from hpc_rl.training.moe_routing import MoeRouting, set_moe_aux_loss_scale
from hpc_rl.training.mtp_model import mtp_model_of
from hpc_rl.training.optimizer import ActorOptimizer, grad_sum_loss_multiplier
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.pipeline import NO_HOOKS, PipelineSchedule
from hpc_rl.training.rollout_advantages import RolloutAdvantages
from hpc_rl.training.step_settings import old_logprobs_need_own_pass, policy_loss_config
from hpc_rl.training.train_batch import TrainBatch
from hpc_rl.weights.json_collectives import broadcast_json


@dataclass
class CriticPart:
    """PPO's critic on this rank (`hpc_rl.training.actor.build_critic` builds it): model, optimizer, settings."""

    model: torch.nn.Module
    optimizer: ActorOptimizer
    config: CriticConfig


LossOfMicro = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro-batch, model output) -> (its loss as a sum over its samples, metrics summed likewise)."""


def _optional_plugin(kind: str, path: str | None) -> Any:
    return load_plugin(kind, path) if path else None


def per_sample_tensors(rows: Sequence[Sequence[float]], device: torch.device | str) -> list[torch.Tensor]:
    """One float32 tensor per row (a sample's loss mask or log-probs), views of one tensor built in one call: a
    tensor per row costs ~2 us each (0.25 ms per 128 samples)."""
    flat = torch.tensor([value for row in rows for value in row], dtype=torch.float32, device=device)
    return list(flat.split([len(row) for row in rows]))


class RolloutTrainer(LogProbPasses, RolloutAdvantages):
    """`train_rollout(batch)` -> one metrics dict per optimizer step."""

    def __init__(self, *, actor: torch.nn.Module, optimizer: ActorOptimizer, ref_model: torch.nn.Module | None,
                 arch: ModelArchitecture, training: TrainingConfig, algorithm: AlgorithmConfig,
                 info: ParallelInfo, separate_old_logprob_pass: bool | None = None,
                 plugin_args: SimpleNamespace | None = None, teacher_model: torch.nn.Module | None = None,
                 distillation: DistillationConfig | None = None, critic: CriticPart | None = None) -> None:
        from megatron.core import parallel_state

        self.actor, self.optimizer, self.ref_model = actor, optimizer, ref_model
        self.teacher_model, self.critic = teacher_model, critic
        self.actor_host_buffers: dict[str, list[torch.Tensor]] = {}
        """Host memory for the actor's weights while a frozen model is on the device (one copy, shared with the
        colocated offload: `commands.TrainerCommands`)."""
        self.ref_weights = (HostResidentModel(ref_model, actor=actor, device=info.device,
                                              actor_host_buffers=self.actor_host_buffers)
                            if ref_model is not None else None)
        """The reference's weights in host memory, swapped with the actor's for its pass (`host_weights`)."""
        self.teacher_weights = (HostResidentModel(teacher_model, actor=actor, device=info.device,
                                                  actor_host_buffers=self.actor_host_buffers)
                                if teacher_model is not None else None)
        self.distillation = distillation or DistillationConfig()
        """use_opd: the teacher's log-probs come from `teacher_model` (megatron) or the batch (sglang)."""
        self.arch, self.training, self.algorithm, self.info = arch, training, algorithm, info
        self.loss_config = policy_loss_config(algorithm, training)
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if info.tp_size > 1 else None
        self.cp_group = parallel_state.get_context_parallel_group() if info.cp_size > 1 else None
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group() if info.pp_size > 1 else None
        self.pipeline = PipelineSchedule.for_model(actor, device=info.device)
        self.grad_sum_multiplier = grad_sum_loss_multiplier(actor)
        self.critic_pipeline = PipelineSchedule.for_model(critic.model, device=info.device) if critic else None
        self.separate_old_logprob_pass = (old_logprobs_need_own_pass(training, algorithm, has_ref=ref_model is not None,
                                                                     distilling=self.distillation.use_opd)
                                          if separate_old_logprob_pass is None else separate_old_logprob_pass)
        """False: the old log-probs are the training pass's own, detached (see old_logprobs_need_own_pass)."""
        if algorithm.use_kl_loss and ref_model is None:
            raise ValueError("algorithm.use_kl_loss needs a reference model (checkpoint.ref_load)")
        self.plugin_args = plugin_args if plugin_args is not None else trainer_args(training, algorithm)
        """slime's flat `args` handed to the custom loss / advantage functions."""
        self._returns: list[torch.Tensor] = []
        """The current rollout's returns (a custom loss receives them as batch["returns"])."""
        self.custom_loss = (load_custom_loss(algorithm.custom_loss_function_path)
                            if algorithm.loss_type == "custom_loss" and algorithm.custom_loss_function_path else None)
        self.custom_advantages = (load_custom_advantages(algorithm.custom_advantage_function_path)
                                  if algorithm.custom_advantage_function_path else None)
        self.moe = MoeRouting(actor, arch, training, info) if arch.is_moe else None
        """Routing replay and router metrics of a MoE actor (`moe_routing`)."""
        self.custom_tis = load_plugin("tis", algorithm.custom_tis_function_path) if algorithm.custom_tis_function_path \
            else None
        self.before_log_prob_hook = _optional_plugin("before_log_prob_hook",
                                                     training.custom_megatron_before_log_prob_hook_path)
        self.before_train_step_hook = _optional_plugin("before_train_step_hook",
                                                       training.custom_megatron_before_train_step_hook_path)
        self.rollout_data_postprocess = _optional_plugin("rollout_data_postprocess",
                                                         algorithm.rollout_data_postprocess_path)
        self._entropy: dict[str, dict[int, torch.Tensor]] = {}
        """use_rollout_entropy: the old and ref passes' per-sample entropies ("entropy", "ref_entropy")."""
        self._train_logprobs: dict[int, torch.Tensor] | None = None
        """get_mismatch_metrics with use_rollout_logprobs: the trainer's own old log-probs, for the TIS function."""
        self.rollout_weights: list[torch.Tensor] | None = None
        """keep_old_actor: host copies of the actor's parameters as the engines last received them."""

    def train_rollout(self, batch: TrainBatch, rollout_id: int = 0) -> list[dict[str, float]]:
        try:
            return self._train_rollout(batch, rollout_id)
        finally:
            if self.moe is not None:
                self.moe.end_rollout()

    def _train_rollout(self, batch: TrainBatch, rollout_id: int) -> list[dict[str, float]]:
        steps = self.training.num_steps_per_rollout
        if len(batch) == 0 or len(batch) % steps:
            raise ValueError(f"{len(batch)} samples do not split into num_steps_per_rollout={steps} steps")
        per_step = len(batch) // steps
        plan = [self._step_microbatches(batch, range(s * per_step, (s + 1) * per_step)) for s in range(steps)]
        device = self.info.device
        masks = per_sample_tensors(batch.loss_masks, device)
        all_micros = self.logprob_microbatches(batch, plan, per_step)
        if self.algorithm.loss_type == "sft_loss":
            return [self._step(rollout_id, step, batch, micros, masks, self._sft_loss(masks))
                    for step, micros in enumerate(plan)]

        self._entropy = {}
        ref = self._frozen_logprobs(self.ref_weights, all_micros, "ref_") if self.ref_weights is not None else None
        self._train_logprobs = None
        if self.algorithm.use_rollout_logprobs:
            if batch.rollout_logprobs is None:
                raise ValueError("algorithm.use_rollout_logprobs is set but the batch has no rollout log-probs")
            old = {i: torch.as_tensor(lp, dtype=torch.float32, device=device)
                   for i, lp in enumerate(batch.rollout_logprobs)}
            if self.algorithm.get_mismatch_metrics:  # the mismatch is the trainer's log-probs vs the engine's
                self._train_logprobs = self._old_logprobs(batch, all_micros)  # (also records a MoE's routing)
            elif self.moe is not None and self.moe.needs_record_pass():
                self._old_logprobs(batch, all_micros)  # records the routing later steps replay
        elif self.separate_old_logprob_pass:
            old = self._old_logprobs(batch, all_micros)
        else:
            old = None  # the training pass's own log-probs, detached (losses: old_log_probs=None)
        teacher = self._teacher_logprobs(batch, all_micros)
        rollout = per_sample_tensors(batch.rollout_logprobs, device) if batch.rollout_logprobs is not None else None
        # PPO's critic first, on every pipeline stage (its values live on the last)
        values, critic_steps = train_critic(self, batch, plan, masks) if self.critic is not None else (None, [])
        if self.critic is not None and rollout_id < self.critic.config.num_critic_only_steps:
            return [critic_metrics(m) for m in critic_steps]  # the actor waits for a trained critic
        if not self.info.is_last_stage:  # log-probs, advantages and the loss live on the last stage
            actor_steps = [self._step(rollout_id, step, batch, micros, masks,
                                      self._policy_loss(batch, masks, old, ref, [], rollout, None))
                           for step, micros in enumerate(plan)]
        else:
            actor_steps = self._last_stage_steps(rollout_id, batch, plan, masks, old, ref, rollout, teacher, values)
        for actor_step, critic_step in zip(actor_steps, critic_steps):
            actor_step.update(critic_metrics(critic_step))
        return actor_steps

    def _last_stage_steps(self, rollout_id: int, batch: TrainBatch, plan: list[list[MicroBatch]],
                          masks: list[torch.Tensor], old: dict[int, torch.Tensor] | None,
                          ref: dict[int, torch.Tensor] | None, rollout: list[torch.Tensor] | None,
                          teacher: dict[int, torch.Tensor] | None,
                          values: list[torch.Tensor] | None) -> list[dict[str, float]]:
        """The actor's steps where the logits are: advantages, slime's post-process and debug dump, the loss."""
        advantages = self._advantages(batch, masks, old, ref, rollout, teacher, values)
        if self.rollout_data_postprocess is not None:
            masks, advantages = self._postprocess(rollout_id, batch, masks, old, ref, rollout, advantages)
        if self.training.save_debug_train_data and self.info.tp_rank == 0 and self.info.cp_rank == 0:
            self._save_debug_train_data(rollout_id, batch, masks, old, ref, rollout, advantages)
        return [self._step(rollout_id, step, batch, micros, masks,
                           self._policy_loss(batch, masks, old, ref, advantages, rollout, teacher))
                for step, micros in enumerate(plan)]

    def _sft_loss(self, masks: list[torch.Tensor]) -> LossOfMicro:
        per_token = self.loss_config.calculate_per_token_loss

        def loss_of(micro: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            log_probs, _ = self._response_logprobs(micro, logits, with_entropy=False)
            return sft_loss(log_probs, [masks[i] for i in micro.indices], per_token=per_token)

        return loss_of

    def _step(self, rollout_id: int, step_id: int, batch: TrainBatch, micros: list[MicroBatch],
              masks: list[torch.Tensor], loss_of: LossOfMicro) -> dict[str, float]:
        """One of the actor's optimizer steps (slime's before-train-step hook first)."""
        if self.before_train_step_hook is not None:
            self.before_train_step_hook(self.plugin_args, rollout_id, step_id, self.actor, self.optimizer,
                                        getattr(self.optimizer, "scheduler", None))
        return self._train_step(batch, micros, masks, loss_of)

    def _custom_loss(self, batch: TrainBatch, micro: MicroBatch, logits: torch.Tensor, log_probs: list[torch.Tensor],
                     entropy: list[torch.Tensor] | None, masks: list[torch.Tensor], old: dict[int, torch.Tensor] | None,
                     ref: dict[int, torch.Tensor] | None, advantages: list[torch.Tensor],
                     rollout: list[torch.Tensor] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's loss from slime's `custom_loss_function_path(args, batch, logits, sum_of_sample_mean)`."""
        idx = micro.indices
        micro_masks = [masks[i] for i in idx]
        reduce = sum_of_tokens if self.loss_config.calculate_per_token_loss else sum_of_sample_mean
        loss_batch = {
            "current_log_probs": log_probs, "entropy": entropy,
            "log_probs": [old[i] for i in idx] if old is not None else [lp.detach() for lp in log_probs],
            "ref_log_probs": [ref[i] for i in idx] if ref is not None else None,
            "rollout_log_probs": [rollout[i] for i in idx] if rollout is not None else None,
            "advantages": [advantages[i] for i in idx] if advantages else None,
            "returns": [self._returns[i] for i in idx] if self._returns else None,
            "loss_masks": micro_masks, "rewards": [batch.rewards[i] for i in idx],
            "response_lengths": list(micro.response_lengths), "total_lengths": list(micro.total_lengths),
            "unconcat_tokens": [torch.as_tensor(batch.tokens[i], device=self.info.device) for i in idx]}
        result = self.custom_loss(self.plugin_args, loss_batch, logits, lambda values: reduce(values, micro_masks))
        return check_custom_loss_result(result, self.algorithm.custom_loss_function_path or "")

    def _start_mtp(self, batch: TrainBatch, micros: list[MicroBatch], masks: list[torch.Tensor],
                   global_trained: float) -> Any:
        """With MTP training: each micro-batch's MTP targets and the step's MTP loss scale (the factor over the
        depths, per trained token of the whole step, as `micro_loss` scales the policy loss). None without."""
        if not (self.training.enable_mtp_training and self.arch.mtp_num_layers):
            return None
        model = mtp_model_of(self.actor)
        for micro in micros:
            micro.mtp_loss_mask = micro.next_token_mask([masks[i] for i in micro.indices])
        if model is None:  # a stage without the MTP layers
            return None
        model.mtp_loss_scale = (self.training.mtp_loss_scaling_factor / self.arch.mtp_num_layers
                                * self.grad_sum_multiplier / max(global_trained, 1.0))
        model.reset_mtp_metrics()
        return model

    def _mtp_metrics(self, model: Any) -> dict[str, float]:
        """slime's train/mtp_<k>_loss (mean cross entropy per trained token, k from 1) and their sum mtp_loss."""
        from megatron.core import parallel_state

        sums = torch.tensor([*model.mtp_loss_sums, *model.mtp_token_counts], dtype=torch.float64,
                            device=self.info.device)
        if self.info.dp_size * self.info.cp_size > 1:  # each CP rank scored its own chunks' targets
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        depths = len(model.mtp_loss_sums)
        losses = [float(sums[k]) / max(float(sums[depths + k]), 1.0) for k in range(depths)]
        return {**{f"mtp_{k + 1}_loss": loss for k, loss in enumerate(losses)}, "mtp_loss": sum(losses)}

    def _policy_loss(self, batch: TrainBatch, masks: list[torch.Tensor], old: dict[int, torch.Tensor] | None,
                     ref: dict[int, torch.Tensor] | None, advantages: list[torch.Tensor],
                     rollout: list[torch.Tensor] | None, teacher: dict[int, torch.Tensor] | None) -> LossOfMicro:
        reduce = sum_of_tokens if self.loss_config.calculate_per_token_loss else sum_of_sample_mean

        def loss_from_logits(micro: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            idx = micro.indices
            log_probs, entropy = self._response_logprobs(micro, logits, with_entropy=True)
            if self.custom_loss is not None:
                return self._custom_loss(batch, micro, logits, log_probs, entropy, masks, old, ref, advantages,
                                         rollout)
            trained = self._train_logprobs
            loss, metrics = policy_loss_and_metrics(
                self.loss_config, log_probs=log_probs,
                old_log_probs=[old[i] for i in idx] if old is not None else None,
                advantages=[advantages[i] for i in idx], loss_masks=[masks[i] for i in idx], entropy=entropy,
                ref_log_probs=[ref[i] for i in idx] if ref is not None else None,
                rollout_log_probs=[rollout[i] for i in idx] if rollout is not None else None,
                train_log_probs=[trained[i] for i in idx] if trained is not None else None,
                tis_function=functools.partial(self.custom_tis, args=self.plugin_args,
                                               total_lengths=list(micro.total_lengths),
                                               response_lengths=list(micro.response_lengths))
                if self.custom_tis is not None else None,
                score_centering=self._score_centering_heads(batch, micro, logits))
            if teacher is not None:  # slime's opd_reverse_kl: the penalty's KL, reduced like the loss
                student = [old[i] if old is not None else rollout[i] for i in idx]  # type: ignore[index]
                metrics["opd_reverse_kl"] = reduce(
                    torch.cat([s.detach() - teacher[i] for s, i in zip(student, idx)]), [masks[i] for i in idx])
            return loss, metrics

        return loss_from_logits

    def _score_centering_heads(self, batch: TrainBatch, micro: MicroBatch,
                               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """algorithm.use_score_centering: (trainer, engine) log-probs of the engine's top-k ids at each response
        token of `micro`, [tokens, k] each (the trainer's with a gradient)."""
        if not self.algorithm.use_score_centering:
            return None
        if batch.top_logprob_ids is None or batch.top_logprobs is None:
            raise ValueError("algorithm.use_score_centering is set but the batch has no top-k log-probs from the "
                             "engines (the rollout asks for them with top_logprobs_num; a batches file lacks them)")
        ids = [torch.as_tensor(batch.top_logprob_ids[i]) for i in micro.indices]
        train_head = micro.response_head_logprobs(logits, ids, vocab_size=self.arch.vocab_size, tp_group=self.tp_group)
        sampler_head = torch.cat([torch.as_tensor(batch.top_logprobs[i]) for i in micro.indices])
        return train_head, sampler_head.to(train_head.device, torch.float32)

    def _train_step(self, batch: TrainBatch, micros: list[MicroBatch], masks: list[torch.Tensor],
                    loss_of: LossOfMicro, *, model: torch.nn.Module | None = None,
                    optimizer: ActorOptimizer | None = None, pipeline: PipelineSchedule | None = None) -> dict[str, float]:
        """One optimizer step of `model` (default: the actor) over `micros`, with `loss_of` each micro-batch's."""
        model, optimizer = model or self.actor, optimizer or self.optimizer
        pipeline = pipeline or self.pipeline
        start = time.perf_counter()
        samples = sum(len(m.indices) for m in micros)
        tokens_here = sum(batch.total_lengths[i] for m in micros for i in m.indices)
        step_masks = [masks[i] for m in micros for i in m.indices]
        trained_here = float(torch.cat(step_masks).sum(dtype=torch.float64)) if step_masks else 0.0
        counts = torch.tensor([float(samples), float(tokens_here), trained_here], device=self.info.device)
        if self.info.dp_size > 1:
            dist.all_reduce(counts, group=self.dp_group)
        global_samples, global_tokens, global_trained = (float(x) for x in counts)
        # The step's gradient is the sum over DP ranks of their micro-batch gradients, and under CP each
        # CP rank's gradient is its share of one sum (every CP rank computes the same loss;
        # micro_batches' log-prob gather back-propagates only the local slice), divided by the global
        # denominator. DDP sums or averages over DP x CP depending on calculate_per_token_loss in the
        # model's TransformerConfig: the multiplier undoes an average.
        denominator = global_trained if self.loss_config.calculate_per_token_loss else global_samples
        scale = self.grad_sum_multiplier / max(denominator, 1.0)
        sums: dict[str, float] = {}

        def micro_loss(micro: MicroBatch, logits: torch.Tensor) -> torch.Tensor:  # last stage only
            if self.training.recompute_loss_function:  # slime's --recompute-loss-function: keep only the logits
                loss, metrics = torch.utils.checkpoint.checkpoint(loss_of, micro, logits, use_reentrant=False)
            else:
                loss, metrics = loss_of(micro, logits)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            return loss * scale

        mtp = self._start_mtp(batch, micros, masks, global_trained) if model is self.actor else None
        model.train()
        if self.arch.is_moe:
            set_moe_aux_loss_scale(len(micros), self.info.cp_size, self.loss_config.calculate_per_token_loss,
                                   global_trained, device=self.info.device)
        moe = self.moe if model is self.actor else None  # the actor's routers (a critic's are not tracked)
        with (moe.training_pass(batch, micros) if moe is not None else nullcontext(NO_HOOKS)) as hooks:
            pipeline.forward_backward(model, micros, micro_loss, hooks)
        result = optimizer.step()
        out: dict[str, float] = {}
        if self.info.is_last_stage:
            names = sorted(sums)
            totals = torch.tensor([sums[k] for k in names], dtype=torch.float64, device=self.info.device)
            if self.info.dp_size > 1:
                dist.all_reduce(totals, group=self.dp_group)
            out = {k: float(v) / max(denominator, 1.0) for k, v in zip(names, totals)}
            if mtp is not None:
                out.update(self._mtp_metrics(mtp))
        if self.pp_group is not None:  # the loss metrics to every stage (rank 0 reports them)
            out = dict(broadcast_json(out, src=dist.get_global_rank(self.pp_group, self.info.pp_size - 1),
                                      group=self.pp_group, device=self.info.device))
        if moe is not None:
            out.update(moe.step_metrics(len(micros)))
        seconds = time.perf_counter() - start
        out.update({"grad_norm": result.grad_norm, "lr": result.lr, "step_time": seconds,
                    "tokens_per_second": global_tokens / seconds, "samples": global_samples,
                    "skipped": float(result.skipped)})
        return out
