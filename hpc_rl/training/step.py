"""One rollout's training on a trainer rank: ref/old log-probs, advantages, loss, optimizer steps.

Owns: splitting a `TrainBatch` into `num_steps_per_rollout` steps and each step into micro-batches
(fixed `micro_batch_size`, or token-packed with `use_dynamic_batch_size`, with the same count on
every DP rank), the forward passes, the loss scale that makes a step's gradient independent of the
micro-batching, and the step's metrics. The formulas are `losses` / `advantages`' (pure) or, with
slime's `--custom-loss-function-path` / `--custom-advantage-function-path`, the user's (`custom_hooks`), the
micro-batch packing is `batching`'s, log-probs under TP are `logprobs`', running micro-batches
through pipeline stages is `pipeline`'s.

Pipeline parallel: every stage builds the same micro-batches (it has the tokens), but only the last
stage sees logits, so the per-sample results live there: ref/old log-probs, KL, advantages, the
loss and its metrics are computed on the last stage only; the other stages run their chunk's
forward and backward. After the optimizer step the last stage broadcasts the step's metrics over
the pipeline group, so every rank (global rank 0 included, which reports them) returns the same.

Ref log-probs are computed for the whole rollout before its first update, on the same micro-batches
the training pass uses, so with ref == actor weights the KL term is exactly 0. Old log-probs come
from the training pass itself (detached) when there is one optimizer step per rollout and no KL
reward shaping (`old_logprobs_need_own_pass`), else from their own pass before the first update on
the same micro-batches: either way logp_old == logp bit for bit on the first step (ppo_kl == 0).

A MoE actor's routers replay or record in these passes and report their health per step (`moe_routing`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.schema import AlgorithmConfig, TrainingConfig
from hpc_rl.training.advantages import compute_advantages, masked_whiten
from hpc_rl.training.custom_hooks import (
    check_custom_loss_result, load_custom_advantages, load_custom_loss, run_custom_advantages, trainer_args,
)
from hpc_rl.training.batching import equalize_microbatch_count, pack_microbatches
from hpc_rl.weights.json_collectives import broadcast_json
from hpc_rl.training.losses import (
    PolicyLossConfig, approx_kl, policy_loss_and_metrics, policy_loss_type_for, sum_of_sample_mean, sum_of_tokens,
)
from hpc_rl.training.micro_batches import MicroBatch, build_microbatch, choose_qkv_format
from hpc_rl.training.moe_routing import MoeRouting
from hpc_rl.training.optimizer import ActorOptimizer, grad_sum_loss_multiplier
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.pipeline import NO_HOOKS, PipelineSchedule, StageHooks
from hpc_rl.training.train_batch import TrainBatch


def policy_loss_config(algorithm: AlgorithmConfig, training: TrainingConfig) -> PolicyLossConfig:
    """The loss knobs from the `algorithm` section."""
    return PolicyLossConfig(
        policy_loss_type=policy_loss_type_for(algorithm.advantage_estimator),
        eps_clip=algorithm.eps_clip, eps_clip_high=algorithm.eps_clip_high, eps_clip_c=algorithm.eps_clip_c,
        entropy_coef=algorithm.entropy_coef, use_kl_loss=algorithm.use_kl_loss,
        kl_loss_coef=algorithm.kl_loss_coef, kl_loss_type=algorithm.kl_loss_type, use_tis=algorithm.use_tis,
        tis_clip=algorithm.tis_clip, tis_clip_low=algorithm.tis_clip_low,
        calculate_per_token_loss=training.calculate_per_token_loss,
    )


def old_logprobs_need_own_pass(training: TrainingConfig, algorithm: AlgorithmConfig, *, has_ref: bool) -> bool:
    """Whether the old log-probs need a forward pass of their own before the first update.

    Old log-probs are the actor's at the weights the rollout's training starts from (slime
    recomputes them; the engine's are `rollout_log_probs`, compared by TIS), whatever policy
    generated the samples: async or partial (off-policy) samples do not change that. With one
    optimizer step per rollout, the training pass runs at exactly those weights on the same
    micro-batches, so its log-probs, detached, ARE the old log-probs (ratio 1, ppo_kl 0, the same
    gradient). A separate pass is needed only when (a) later steps follow an update
    (`num_steps_per_rollout` > 1), or (b) something needs them before the loss: KL reward shaping
    (`kl_coef` != 0 with a reference) enters the advantages, which are computed first, and a custom
    advantage function receives them (slime's `rollout_data["log_probs"]`).
    `use_rollout_logprobs` takes them from the engine instead (no pass either way).
    """
    if algorithm.use_rollout_logprobs:
        return False
    return (training.num_steps_per_rollout > 1 or (has_ref and algorithm.kl_coef != 0.0)
            or algorithm.custom_advantage_function_path is not None)


class RolloutTrainer:
    """`train_rollout(batch)` -> one metrics dict per optimizer step."""

    def __init__(self, *, actor: torch.nn.Module, optimizer: ActorOptimizer, ref_model: torch.nn.Module | None,
                 arch: ModelArchitecture, training: TrainingConfig, algorithm: AlgorithmConfig,
                 info: ParallelInfo, separate_old_logprob_pass: bool | None = None,
                 plugin_args: SimpleNamespace | None = None) -> None:
        from megatron.core import parallel_state

        self.actor, self.optimizer, self.ref_model = actor, optimizer, ref_model
        self.arch, self.training, self.algorithm, self.info = arch, training, algorithm, info
        self.loss_config = policy_loss_config(algorithm, training)
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if info.tp_size > 1 else None
        self.cp_group = parallel_state.get_context_parallel_group() if info.cp_size > 1 else None
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group() if info.pp_size > 1 else None
        self.pipeline = PipelineSchedule.for_model(actor, device=info.device)
        self.grad_sum_multiplier = grad_sum_loss_multiplier(actor)
        self.separate_old_logprob_pass = (old_logprobs_need_own_pass(training, algorithm, has_ref=ref_model is not None)
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

    # ------------------------------------------------------------------ micro-batches

    def _step_microbatches(self, batch: TrainBatch, step_indices: Sequence[int]) -> list[MicroBatch]:
        lengths = [batch.total_lengths[i] for i in step_indices]
        if self.training.use_dynamic_batch_size:
            if not self.training.max_tokens_per_gpu:
                raise ValueError("training.use_dynamic_batch_size needs training.max_tokens_per_gpu")
            # max_tokens_per_gpu counts one GPU's tokens: a CP group holds cp_size times that (slime's rule)
            bins = pack_microbatches(lengths, self.training.max_tokens_per_gpu * self.info.cp_size)
            count = torch.tensor(len(bins), device=self.info.device)
            if self.info.dp_size > 1:
                dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
            bins = equalize_microbatch_count(bins, int(count), lengths)
        else:
            size = self.training.micro_batch_size
            bins = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
        multiple = self.info.tp_size if self.training.sequence_parallel else 1
        out = []
        for local in bins:
            indices = [step_indices[i] for i in local]
            layout = choose_qkv_format(self.training.qkv_format, [lengths[i] for i in local], on_cpu=self.info.on_cpu,
                                       cp_size=self.info.cp_size)
            out.append(build_microbatch([batch.tokens[i] for i in indices],
                                        [batch.response_lengths[i] for i in indices], indices,
                                        qkv_format=layout, pad_multiple=multiple,
                                        device=self.info.device, cp_group=self.cp_group))
        return out

    def _response_logprobs(self, micro: MicroBatch, logits: torch.Tensor, *, with_entropy: bool):
        return micro.response_logprobs(logits, vocab_size=self.arch.vocab_size, tp_group=self.tp_group,
                                       with_entropy=with_entropy)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, micros: list[MicroBatch],
                  hooks: StageHooks = NO_HOOKS) -> dict[int, torch.Tensor]:
        """Per-sample response log-probs, by batch index; empty on stages other than the last."""
        out: dict[int, torch.Tensor] = {}
        for micro, values in zip(micros, self.pipeline.forward_only(
                model, micros, lambda m, logits: self._response_logprobs(m, logits, with_entropy=False)[0], hooks)):
            out.update(zip(micro.indices, values))
        return out

    def _old_logprobs(self, batch: TrainBatch, micros: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """The actor's log-probs before the first update (a MoE actor's routers replay or record)."""
        if self.moe is None:
            return self._logprobs(self.actor, micros)
        with self.moe.old_pass(batch) as hooks:
            return self._logprobs(self.actor, micros, hooks)

    # ------------------------------------------------------------------ the rollout

    def train_rollout(self, batch: TrainBatch) -> list[dict[str, float]]:
        try:
            return self._train_rollout(batch)
        finally:
            if self.moe is not None:
                self.moe.end_rollout()

    def _train_rollout(self, batch: TrainBatch) -> list[dict[str, float]]:
        steps = self.training.num_steps_per_rollout
        if len(batch) == 0 or len(batch) % steps:
            raise ValueError(f"{len(batch)} samples do not split into num_steps_per_rollout={steps} steps")
        per_step = len(batch) // steps
        plan = [self._step_microbatches(batch, range(s * per_step, (s + 1) * per_step)) for s in range(steps)]
        device = self.info.device
        masks = [torch.as_tensor(m, dtype=torch.float32, device=device) for m in batch.loss_masks]
        all_micros = [m for step in plan for m in step]

        ref = self._logprobs(self.ref_model, all_micros) if self.ref_model is not None else None
        if self.algorithm.use_rollout_logprobs:
            if batch.rollout_logprobs is None:
                raise ValueError("algorithm.use_rollout_logprobs is set but the batch has no rollout log-probs")
            old = {i: torch.as_tensor(lp, dtype=torch.float32, device=device)
                   for i, lp in enumerate(batch.rollout_logprobs)}
            if self.moe is not None and self.moe.needs_record_pass():
                self._old_logprobs(batch, all_micros)  # records the routing later steps replay
        elif self.separate_old_logprob_pass:
            old = self._old_logprobs(batch, all_micros)
        else:
            old = None  # the training pass's own log-probs, detached (losses: old_log_probs=None)
        if not self.info.is_last_stage:  # log-probs, advantages and the loss live on the last stage
            return [self._train_step(batch, micros, masks, old, ref, [], None) for micros in plan]
        kl = None
        if ref is not None and old is not None:
            kl = [approx_kl(old[i], ref[i], self.algorithm.kl_loss_type) for i in range(len(batch))]
        rollout = ([torch.as_tensor(lp, dtype=torch.float32, device=device) for lp in batch.rollout_logprobs]
                   if batch.rollout_logprobs is not None else None)
        if self.custom_advantages is not None:
            advantages, returns = self._custom_advantages(batch, masks, old, ref, rollout, kl)
        else:
            advantages, returns = compute_advantages(
                self.algorithm.advantage_estimator, rewards=batch.rewards, loss_masks=masks, kl=kl,
                kl_coef=self.algorithm.kl_coef, gamma=self.algorithm.gamma, lambd=self.algorithm.lambd,
                normalize_advantages=self.algorithm.normalize_advantages,
                all_reduce=self._dp_sum if self.info.dp_size > 1 else None)
        self._returns = [r.to(device) for r in returns]
        advantages = [a.to(device) for a in advantages]
        return [self._train_step(batch, micros, masks, old, ref, advantages, rollout) for micros in plan]

    def _custom_advantages(self, batch: TrainBatch, masks: list[torch.Tensor], old: dict[int, torch.Tensor] | None,
                           ref: dict[int, torch.Tensor] | None, rollout: list[torch.Tensor] | None,
                           kl: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """slime's `custom_advantage_function_path(args, rollout_data)`, then advantage whitening if asked."""
        n = len(batch)
        rollout_data: dict[str, Any] = {
            "rewards": list(batch.rewards), "loss_masks": masks, "response_lengths": list(batch.response_lengths),
            "total_lengths": list(batch.total_lengths),
            "log_probs": [old[i] for i in range(n)] if old is not None else None,
            "ref_log_probs": [ref[i] for i in range(n)] if ref is not None else None,
            "rollout_log_probs": rollout, "values": None,
            "kl": kl if kl is not None else [torch.zeros_like(m) for m in masks]}
        path = self.algorithm.custom_advantage_function_path or ""
        advantages, returns = run_custom_advantages(self.custom_advantages, path, self.plugin_args, rollout_data, masks)
        if self.algorithm.normalize_advantages and advantages:
            flat = masked_whiten(torch.cat(advantages), torch.cat(masks),
                                 all_reduce=self._dp_sum if self.info.dp_size > 1 else None)
            advantages = list(flat.split([a.numel() for a in advantages]))
        return advantages, returns

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
            "advantages": [advantages[i] for i in idx], "returns": [self._returns[i] for i in idx],
            "loss_masks": micro_masks, "rewards": [batch.rewards[i] for i in idx],
            "response_lengths": list(micro.response_lengths), "total_lengths": list(micro.total_lengths),
            "unconcat_tokens": [torch.as_tensor(batch.tokens[i], device=self.info.device) for i in idx]}
        result = self.custom_loss(self.plugin_args, loss_batch, logits, lambda values: reduce(values, micro_masks))
        return check_custom_loss_result(result, self.algorithm.custom_loss_function_path or "")

    def _dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def _train_step(self, batch: TrainBatch, micros: list[MicroBatch], masks: list[torch.Tensor],
                    old: dict[int, torch.Tensor] | None, ref: dict[int, torch.Tensor] | None,
                    advantages: list[torch.Tensor], rollout: list[torch.Tensor] | None) -> dict[str, float]:
        start = time.perf_counter()
        samples = sum(len(m.indices) for m in micros)
        tokens_here = sum(batch.total_lengths[i] for m in micros for i in m.indices)
        counts = torch.tensor([float(samples), float(tokens_here),
                               float(sum(sum(batch.loss_masks[i]) for m in micros for i in m.indices))],
                              device=self.info.device)
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
            idx = micro.indices
            log_probs, entropy = self._response_logprobs(micro, logits, with_entropy=True)
            if self.custom_loss is not None:
                loss, metrics = self._custom_loss(batch, micro, logits, log_probs, entropy, masks, old, ref,
                                                  advantages, rollout)
            else:
                loss, metrics = policy_loss_and_metrics(
                    self.loss_config, log_probs=log_probs,
                    old_log_probs=[old[i] for i in idx] if old is not None else None,
                    advantages=[advantages[i] for i in idx], loss_masks=[masks[i] for i in idx], entropy=entropy,
                    ref_log_probs=[ref[i] for i in idx] if ref is not None else None,
                    rollout_log_probs=[rollout[i] for i in idx] if rollout is not None else None)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            return loss * scale

        self.actor.train()
        with (self.moe.training_pass(batch) if self.moe is not None else nullcontext(NO_HOOKS)) as hooks:
            self.pipeline.forward_backward(self.actor, micros, micro_loss, hooks)
        result = self.optimizer.step()
        out: dict[str, float] = {}
        if self.info.is_last_stage:
            names = sorted(sums)
            totals = torch.tensor([sums[k] for k in names], dtype=torch.float64, device=self.info.device)
            if self.info.dp_size > 1:
                dist.all_reduce(totals, group=self.dp_group)
            out = {k: float(v) / max(denominator, 1.0) for k, v in zip(names, totals)}
        if self.pp_group is not None:  # the loss metrics to every stage (rank 0 reports them)
            out = dict(broadcast_json(out, src=dist.get_global_rank(self.pp_group, self.info.pp_size - 1),
                                      group=self.pp_group, device=self.info.device))
        if self.moe is not None:
            out.update(self.moe.step_metrics(len(micros)))
        seconds = time.perf_counter() - start
        out.update({"grad_norm": result.grad_norm, "lr": result.lr, "step_time": seconds,
                    "tokens_per_second": global_tokens / seconds, "samples": global_samples,
                    "skipped": float(result.skipped)})
        return out
