"""slime's trainer plug-ins: `--custom-loss-function-path` and `--custom-advantage-function-path`.

Owns: loading both on a trainer rank (the same checks as at submit time), what they are handed, and
checking what they give back (a wrong shape fails at once, naming the plug-in, instead of training on it).

Custom loss (`--loss-type custom_loss --custom-loss-function-path mod.fn`), slime's signature:

    def fn(args, batch, logits, sum_of_sample_mean) -> tuple[loss, dict[str, metric]]

called once per micro-batch on the last pipeline stage, in place of the policy loss. `args` is the run's
flat config (slime's flag names); `logits` are the micro-batch's logits as the model returns them
([1, T, V/TP] packed or [b, s, V/TP] padded, vocab-sharded under TP), so the per-token values slime's
own losses compute from them are in `batch` already (hpc_rl's TP/CP gather):

    current_log_probs  per sample, response tokens, WITH grad (the policy being trained)
    entropy            per sample, response tokens, with grad
    log_probs          old log-probs (slime's meaning; the detached current ones on a one-step rollout)
    ref_log_probs, rollout_log_probs   per sample, or None
    advantages, returns                per sample (advantage_estimator's or your advantage function's)
    loss_masks                         per sample (1 = trained token)
    rewards, response_lengths, total_lengths, unconcat_tokens (per-sample token tensors)

`sum_of_sample_mean(x)` reduces a per-token tensor (the samples' response tokens concatenated, or a
list of per-sample tensors) as the built-in loss does: the sum over samples of each sample's masked
mean (a masked token sum with --calculate-per-token-loss). The loss must be such a sum (hpc_rl divides
by the step's sample count across DP ranks, as slime); metrics likewise (they are reported summed over
micro-batches and divided the same way).

Custom advantages, slime's signature `fn(args, rollout_data) -> None`, called once per rollout on the
last stage before the first optimizer step; it sets `rollout_data["advantages"]` and
`rollout_data["returns"]` (one 1-D tensor per sample, as long as its loss mask). It receives rewards
(group-normalised as for advantage_estimator), loss_masks, response_lengths, total_lengths,
log_probs (old), ref_log_probs, rollout_log_probs, kl (per sample; zeros without a reference) and
values (None: hpc_rl has no critic).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from hpc_rl.plugins import load_plugin


class CustomHookError(ValueError):
    """A custom loss or advantage function gave back something hpc_rl cannot train on."""


def load_custom_loss(path: str) -> Callable[..., Any]:
    return load_plugin("loss", path)


def load_custom_advantages(path: str) -> Callable[..., Any]:
    return load_plugin("advantage", path)


def run_custom_advantages(fn: Callable[..., Any], path: str, args: SimpleNamespace, rollout_data: dict[str, Any],
                          loss_masks: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Call `fn(args, rollout_data)` and return the advantages and returns it set, checked and as float32."""
    fn(args, rollout_data)
    out = []
    for key in ("advantages", "returns"):
        values = rollout_data.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != len(loss_masks):
            raise CustomHookError(
                f"algorithm.custom_advantage_function_path {path!r} must set rollout_data[{key!r}] to a list of "
                f"{len(loss_masks)} per-sample tensors; got {type(values).__name__}"
                + (f" of length {len(values)}" if isinstance(values, (list, tuple)) else ""))
        checked = []
        for i, (value, mask) in enumerate(zip(values, loss_masks)):
            tensor = torch.as_tensor(value, dtype=torch.float32, device=mask.device).reshape(-1)
            if tensor.numel() != mask.numel():
                raise CustomHookError(
                    f"algorithm.custom_advantage_function_path {path!r}: rollout_data[{key!r}][{i}] has "
                    f"{tensor.numel()} values, sample {i} has {mask.numel()} response tokens")
            checked.append(tensor)
        out.append(checked)
    return out[0], out[1]


def check_custom_loss_result(result: Any, path: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The (loss, metrics) a custom loss returned, or CustomHookError saying what is wrong with it."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CustomHookError(f"algorithm.custom_loss_function_path {path!r} must return (loss, metrics dict); "
                              f"got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CustomHookError(f"algorithm.custom_loss_function_path {path!r}: the loss must be a one-element tensor; "
                              f"got {type(loss).__name__}"
                              + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
    if not loss.requires_grad:
        raise CustomHookError(f"algorithm.custom_loss_function_path {path!r}: the loss has no gradient (computed "
                              f"from detached values only); build it from batch['current_log_probs'] or logits")
    if not isinstance(metrics, dict):
        raise CustomHookError(f"algorithm.custom_loss_function_path {path!r}: metrics must be a dict; "
                              f"got {type(metrics).__name__}")
    return loss.reshape(()), {str(k): torch.as_tensor(v).detach().reshape(()) for k, v in metrics.items()}


def trainer_args(training: object, algorithm: object) -> SimpleNamespace:
    """A flat `args` of the trainer's own sections, for trainers built without the whole run config."""
    return SimpleNamespace(**{**vars(training), **vars(algorithm)})
