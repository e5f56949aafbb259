"""A rollout's forward-only passes on a trainer rank: its micro-batches and the old, reference and teacher log-probs.

Owns: splitting the samples of a step into micro-batches (fixed `micro_batch_size`, or token-packed with
`use_dynamic_batch_size`, with the same count on every DP rank; packed again under
`log_probs_max_tokens_per_gpu` for the forward-only passes), the forward-only passes that give per-sample response
log-probs (and entropies with `use_rollout_entropy`), and the weights kept beside the actor for them.

Ref log-probs are computed for the whole rollout before its first update, on the same micro-batches the training
pass uses, so with ref == actor weights the KL term is exactly 0. The reference and a Megatron teacher keep their
weights in host memory and swap in for their pass, the actor's weights waiting in host memory meanwhile
(`host_weights`): one model's weights on the device at a time. Old log-probs come from the training pass itself
(detached) when there is one optimizer step per rollout and no KL reward shaping
(`step_settings.old_logprobs_need_own_pass`), else from their own pass here, before the first update on the same
micro-batches: either way logp_old == logp bit for bit on the first step (ppo_kl == 0). With `keep_old_actor` that
pass runs at the weights the engines last received (`remember_rollout_weights`).

`LogProbPasses` is a part of `hpc_rl.training.step.RolloutTrainer` (a base class of it): it reads the trainer's
actor, ref_weights, teacher_weights, rollout_weights, moe, pipeline, arch, training, algorithm, distillation, info,
tp/cp/dp groups, plugin_args, before_log_prob_hook and _entropy, all set by `RolloutTrainer.__init__`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hpc_rl.training.batching import (
    equalize_microbatch_count, flops_balanced_microbatches, flops_linear_coefficient, pack_microbatches,
)
from hpc_rl.training.host_weights import HostResidentModel
from hpc_rl.training.micro_batches import MicroBatch, build_microbatch, choose_qkv_format
from hpc_rl.training.pipeline import NO_HOOKS, StageHooks
from hpc_rl.training.train_batch import TrainBatch


class LogProbPasses:
    """The micro-batches and forward-only log-prob passes of `RolloutTrainer` (see the module docstring)."""

    def _actor_params(self) -> list[torch.nn.Parameter]:
        return list(self.actor.parameters())

    @torch.no_grad()
    def remember_rollout_weights(self) -> None:
        """The engines now serve the actor's current weights: keep a host copy for the old log-probs
        (keep_old_actor; slime's old_actor backup)."""
        params = self._actor_params()
        if self.rollout_weights is None:
            self.rollout_weights = [torch.empty(p.shape, dtype=p.dtype, device="cpu",
                                                pin_memory=p.device.type == "cuda") for p in params]
        for copy, param in zip(self.rollout_weights, params):
            copy.copy_(param)

    @torch.no_grad()
    def update_reference(self) -> None:
        """The reference model takes the actor's weights (slime's --ref-update-interval)."""
        if self.ref_weights is None:
            raise ValueError("algorithm.ref_update_interval needs a reference model (use_kl_loss or kl_coef)")
        self.ref_weights.copy_from(self.actor)

    @torch.no_grad()
    def _old_logprobs(self, batch: TrainBatch, micros: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """The old log-probs' own pass: at the engines' weights with keep_old_actor, else the current ones
        (a MoE actor's routers replay or record in it)."""
        if not self.algorithm.keep_old_actor or self.rollout_weights is None:
            return self._actor_logprobs(batch, micros)
        params = self._actor_params()
        current = [p.detach().to("cpu", copy=True) for p in params]
        for param, old in zip(params, self.rollout_weights):
            param.copy_(old)
        try:
            return self._actor_logprobs(batch, micros)
        finally:
            for param, value in zip(params, current):
                param.copy_(value)

    def _step_microbatches(self, batch: TrainBatch, step_indices: Sequence[int],
                           max_tokens_per_gpu: int | None = None, *,
                           same_count_on_every_dp_rank: bool = True) -> list[MicroBatch]:
        """The micro-batches of the samples at `step_indices`; a training step needs the same count on every
        DP rank (collectives per micro-batch), a forward-only pass alone (SFT's eval) does not."""
        lengths = [batch.total_lengths[i] for i in step_indices]
        if self.training.use_dynamic_batch_size:
            cap = max_tokens_per_gpu or self.training.max_tokens_per_gpu
            if not cap:
                raise ValueError("training.use_dynamic_batch_size needs training.max_tokens_per_gpu")
            # max_tokens_per_gpu counts one GPU's tokens: a CP group holds cp_size times that (slime's rule)
            if self.training.balance_by_flops:
                arch = self.arch
                coefficient = flops_linear_coefficient(
                    hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
                    num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
                    ffn_hidden_size=arch.ffn_hidden_size)
                bins = flops_balanced_microbatches(lengths, cap * self.info.cp_size, coefficient)
            else:
                bins = pack_microbatches(lengths, cap * self.info.cp_size)
            if same_count_on_every_dp_rank:
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
                                        device=self.info.device, cp_group=self.cp_group,
                                        images=batch.images_of(indices)))
        return out

    def _response_logprobs(self, micro: MicroBatch, logits: torch.Tensor, *, with_entropy: bool):
        return micro.response_logprobs(logits, vocab_size=self.arch.vocab_size, tp_group=self.tp_group,
                                       with_entropy=with_entropy, chunk_size=self.training.log_probs_chunk_size)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, micros: list[MicroBatch],
                  store_prefix: str | None = None, hooks: StageHooks = NO_HOOKS) -> dict[int, torch.Tensor]:
        """Per-sample response log-probs, by batch index; empty on stages other than the last. `store_prefix`
        (slime's: "" old, "ref_" reference) names the pass for the before-log-prob hook; with
        use_rollout_entropy the pass's entropies are kept under store_prefix + "entropy". `hooks` run around each
        micro-batch's forward on this stage (a MoE actor's routing replay)."""
        if store_prefix is not None and self.before_log_prob_hook is not None:
            self.before_log_prob_hook(self.plugin_args, model, store_prefix)
        entropy_key = None if store_prefix is None else store_prefix + "entropy"
        with_entropy = entropy_key is not None and self.algorithm.use_rollout_entropy
        out: dict[int, torch.Tensor] = {}
        entropies: dict[int, torch.Tensor] = {}
        for micro, (values, entropy) in zip(micros, self.pipeline.forward_only(
                model, micros, lambda m, logits: self._response_logprobs(m, logits, with_entropy=with_entropy),
                hooks)):
            out.update(zip(micro.indices, values))
            if entropy is not None:
                entropies.update(zip(micro.indices, entropy))
        if with_entropy:
            self._entropy[entropy_key] = entropies  # type: ignore[index]
        return out

    def _frozen_logprobs(self, frozen: HostResidentModel, micros: list[MicroBatch],
                         store_prefix: str) -> dict[int, torch.Tensor]:
        """A frozen model's log-probs (the reference's, the teacher's), its weights swapped in for the actor's."""
        with frozen.on_device() as model:
            return self._logprobs(model, micros, store_prefix)

    def _actor_logprobs(self, batch: TrainBatch, micros: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """The actor's old log-probs pass as it stands (a MoE actor's routers replay or record)."""
        if self.moe is None:
            return self._logprobs(self.actor, micros, "")
        with self.moe.old_pass(batch, micros) as hooks:
            return self._logprobs(self.actor, micros, "", hooks)

    def _teacher_logprobs(self, batch: TrainBatch, micros: list[MicroBatch]) -> dict[int, torch.Tensor] | None:
        """On-policy distillation: the teacher's log-probs of the response tokens, by batch index."""
        if not self.distillation.use_opd:
            return None
        if self.teacher_weights is not None:
            return self._frozen_logprobs(self.teacher_weights, micros, "teacher_")
        if batch.teacher_logprobs is None:
            raise ValueError("on-policy distillation (opd_type sglang): the batch carries no teacher log-probs")
        return {i: torch.as_tensor(lp, dtype=torch.float32, device=self.info.device)
                for i, lp in enumerate(batch.teacher_logprobs)}

    def logprob_microbatches(self, batch: TrainBatch, plan: list[list[MicroBatch]], per_step: int) -> list[MicroBatch]:
        """The micro-batches of the forward-only passes: the training ones, or (log_probs_max_tokens_per_gpu with
        dynamic batch size) each step's samples packed again under that cap."""
        cap = self.training.log_probs_max_tokens_per_gpu
        if not (cap and self.training.use_dynamic_batch_size):
            return [m for step in plan for m in step]
        return [m for s in range(len(plan))
                for m in self._step_microbatches(batch, range(s * per_step, (s + 1) * per_step), cap)]
