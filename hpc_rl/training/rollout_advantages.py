"""A rollout's advantages on a trainer rank's last pipeline stage, and slime's plug-in views of them.

Owns: the per-sample advantages and returns of a rollout (the estimator's from `advantages`, or slime's
`--custom-advantage-function-path`'s through `custom_hooks`; the KL reward shaping from the old and reference
log-probs; on-policy distillation subtracting opd_kl_coef * (logp_old - logp_teacher); whitening over DP),
slime's `--rollout-data-postprocess-path` (which may change the loss masks and advantages) and
`--save-debug-train-data` (what a DP rank trains on, in one torch file). The formulas are `advantages`' and
`losses`' (pure); this module gathers their inputs.

`RolloutAdvantages` is a part of `hpc_rl.training.step.RolloutTrainer` (a base class of it): it reads the trainer's
algorithm, distillation, training, info, dp_group, custom_advantages, rollout_data_postprocess, plugin_args and
_entropy, and keeps the rollout's returns in `_returns` (a custom loss receives them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.training.advantages import compute_advantages, masked_whiten
from hpc_rl.training.custom_hooks import run_custom_advantages
from hpc_rl.training.loss_terms import approx_kl
from hpc_rl.training.train_batch import TrainBatch


class RolloutAdvantages:
    """The advantage preparation of `RolloutTrainer` (see the module docstring)."""

    def _advantages(self, batch: TrainBatch, masks: list[torch.Tensor], old: dict[int, torch.Tensor] | None,
                    ref: dict[int, torch.Tensor] | None, rollout: list[torch.Tensor] | None,
                    teacher: dict[int, torch.Tensor] | None,
                    values: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Per-sample advantages (the estimator's, or the custom function's; OPD's penalty; whitening); the
        returns are kept for a custom loss. None with --disable-compute-advantages-and-returns."""
        if self.algorithm.disable_compute_advantages_and_returns:
            self._returns = []
            return []
        n, device = len(batch), self.info.device
        kl = None
        if ref is not None and old is not None:
            kl = [approx_kl(old[i], ref[i], self.algorithm.kl_loss_type) for i in range(n)]
        student = [old[i] if old is not None else rollout[i] for i in range(n)] if teacher is not None else None
        if self.custom_advantages is not None:
            advantages, returns = self._custom_advantages(batch, masks, old, ref, rollout, kl, values)
        else:
            advantages, returns = compute_advantages(
                self.algorithm.advantage_estimator, rewards=batch.rewards, loss_masks=masks, kl=kl,
                kl_coef=self.algorithm.kl_coef, gamma=self.algorithm.gamma, lambd=self.algorithm.lambd, values=values,
                normalize_advantages=self.algorithm.normalize_advantages,
                all_reduce=self._dp_sum if self.info.dp_size > 1 else None, student_log_probs=student,
                teacher_log_probs=[teacher[i] for i in range(n)] if teacher is not None else None,
                opd_kl_coef=self.distillation.opd_kl_coef)
        self._returns = [r.to(device) for r in returns]
        return [a.to(device) for a in advantages]

    def _custom_advantages(self, batch: TrainBatch, masks: list[torch.Tensor], old: dict[int, torch.Tensor] | None,
                           ref: dict[int, torch.Tensor] | None, rollout: list[torch.Tensor] | None,
                           kl: list[torch.Tensor] | None,
                           values: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """slime's `custom_advantage_function_path(args, rollout_data)`, then advantage whitening if asked."""
        n = len(batch)
        rollout_data: dict[str, Any] = {
            "rewards": list(batch.rewards), "loss_masks": masks, "response_lengths": list(batch.response_lengths),
            "total_lengths": list(batch.total_lengths),
            "log_probs": [old[i] for i in range(n)] if old is not None else None,
            "ref_log_probs": [ref[i] for i in range(n)] if ref is not None else None,
            "rollout_log_probs": rollout, "values": values,
            "kl": kl if kl is not None else [torch.zeros_like(m) for m in masks]}
        for key, entropies in self._entropy.items():  # use_rollout_entropy: slime's "entropy", "ref_entropy"
            rollout_data[key] = [entropies[i] for i in range(n)] if entropies else None
        path = self.algorithm.custom_advantage_function_path or ""
        advantages, returns = run_custom_advantages(self.custom_advantages, path, self.plugin_args, rollout_data, masks)
        if self.algorithm.normalize_advantages and advantages:
            flat = masked_whiten(torch.cat(advantages), torch.cat(masks),
                                 all_reduce=self._dp_sum if self.info.dp_size > 1 else None)
            advantages = list(flat.split([a.numel() for a in advantages]))
        return advantages, returns

    def _postprocess(self, rollout_id: int, batch: TrainBatch, masks: list[torch.Tensor],
                     old: dict[int, torch.Tensor] | None, ref: dict[int, torch.Tensor] | None,
                     rollout: list[torch.Tensor] | None,
                     advantages: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """slime's `rollout_data_postprocess_path(args, rollout_id, rollout_data)`: it may change the loss masks
        and the advantages (each checked against the sample's response length)."""
        n = len(batch)
        rollout_data: dict[str, Any] = {
            "rewards": list(batch.rewards), "loss_masks": list(masks), "advantages": list(advantages),
            "returns": list(self._returns), "response_lengths": list(batch.response_lengths),
            "total_lengths": list(batch.total_lengths),
            "log_probs": [old[i] for i in range(n)] if old is not None else None,
            "ref_log_probs": [ref[i] for i in range(n)] if ref is not None else None, "rollout_log_probs": rollout,
            **{key: [values[i] for i in range(n)] for key, values in self._entropy.items() if values}}
        self.rollout_data_postprocess(self.plugin_args, rollout_id, rollout_data)
        out = []
        for key in ("loss_masks", "advantages"):
            values = rollout_data[key]
            if len(values) != n or any(torch.as_tensor(v).numel() != m.numel() for v, m in zip(values, masks)):
                raise ValueError(f"algorithm.rollout_data_postprocess_path: rollout_data[{key!r}] must stay one tensor "
                                 f"per sample, as long as its response")
            out.append([torch.as_tensor(v, dtype=torch.float32, device=m.device).reshape(-1)
                        for v, m in zip(values, masks)])
        return out[0], out[1]

    def _save_debug_train_data(self, rollout_id: int, batch: TrainBatch, masks: list[torch.Tensor],
                               old: dict[int, torch.Tensor] | None, ref: dict[int, torch.Tensor] | None,
                               rollout: list[torch.Tensor] | None, advantages: list[torch.Tensor]) -> None:
        """slime's --save-debug-train-data: what this DP rank trains on, per sample, in one torch file."""
        template = self.training.save_debug_train_data or ""
        path = Path(template.format(rollout_id=rollout_id, rank=self.info.dp_rank))
        if "{rank}" not in template and self.info.dp_size > 1:
            path = path.with_name(f"{path.name}.rank{self.info.dp_rank}")
        n = len(batch)
        data = {"rollout_id": rollout_id, "dp_rank": self.info.dp_rank,
                "tokens": [torch.as_tensor(t) for t in batch.tokens], "response_lengths": list(batch.response_lengths),
                "loss_masks": [m.cpu() for m in masks], "rewards": list(batch.rewards),
                "advantages": [a.cpu() for a in advantages], "returns": [r.cpu() for r in self._returns],
                "log_probs": [old[i].cpu() for i in range(n)] if old is not None else None,
                "ref_log_probs": [ref[i].cpu() for i in range(n)] if ref is not None else None,
                "rollout_log_probs": [r.cpu() for r in rollout] if rollout is not None else None}
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)

    def _dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.dp_group)
        return tensor
