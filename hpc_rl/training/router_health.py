"""Router health of the actor's MoE layers over one training pass, as step metrics (TensorBoard `train/moe/...`).

Owns `RouterHealth`: forward hooks on the actor's Megatron `TopKRouter`s that count, over the real
tokens of a training pass (padding left out with `router_tokens`, activation recomputation not
counted), each layer's tokens per expert after capacity dropping, and, while routing replay is on,
how often the router's own top-k agrees with the replayed one; and `step_metrics()`, which sums
them over every rank and adds the load-balancing losses Megatron tracks. Does not own replay
(`routing_replay`) or writing scalars (`commands` logs every step metric).

Metrics (layer indices are global, 0-based like HF's `model.layers.N`; zero-padded so they sort):
- `moe/max_over_mean_load[/layer_NN]`: the busiest expert's tokens over the mean per expert (1 =
  balanced, num_experts / topk when every token goes to the same experts: routing collapse). Without
  the per-layer suffix: the worst layer.
- `moe/dropped_fraction[/layer_NN]` (with `moe_expert_capacity_factor`): routed token slots dropped
  for going over an expert's capacity.
- `moe/routing_agreement[/layer_NN]` (with routing replay): fraction of tokens with a replayed record
  whose top-k set the trainer's router would choose itself at the current weights (its scores
  recomputed from the same input); 1 minus it is the train/inference routing mismatch R3 removes.
- `moe/replayed_routing_agreement`: fraction of those tokens whose routing the layer used equals the
  record (1 unless capacity dropping removes replayed experts).
- `moe/<tracked loss>[/layer_NN]` when an aux loss is on: Megatron's tracker (`load_balancing_loss`,
  `seq_load_balancing_loss`, `global_load_balancing_loss`: the loss over its coefficient), averaged over
  micro-batches, reduced as Megatron's `track_moe_metrics` does; the un-suffixed one is the mean over
  MoE layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
    topk_routing_with_score_function,
)

from hpc_rl.training.micro_batches import MicroBatch
from hpc_rl.training.pipeline import StageHooks
from hpc_rl.training.router_tokens import router_tokens
from hpc_rl.training.routing_replay import RoutingReplay, moe_routers

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
"""Megatron's load-balancing types -> the names its router logs the loss under."""

TOKENS, ASSIGNED, COMPARED, NATURAL_MATCH, REPLAYED_MATCH = range(5)


def tracked_aux_losses(load_balancing_type: str | list[str], aux_loss_coeff: float | list[float]) -> list[str]:
    """Names Megatron tracks for this load-balancing configuration (types with a coefficient > 0)."""
    types = [load_balancing_type] if isinstance(load_balancing_type, str) else list(load_balancing_type)
    coeffs = [aux_loss_coeff] * len(types) if isinstance(aux_loss_coeff, (int, float)) else list(aux_loss_coeff)
    return [AUX_LOSS_NAMES[kind] for kind, coeff in zip(types, coeffs) if kind in AUX_LOSS_NAMES and coeff > 0]


def layer_suffix(layer: int, num_layers: int) -> str:
    return f"layer_{layer:0{len(str(max(num_layers - 1, 0)))}d}"


class RouterHealth:
    """Counts per MoE layer over a training pass (`measuring()`), reported by `step_metrics()`."""

    def __init__(self, actor: torch.nn.Module, *, moe_layers: list[bool], num_experts: int, topk: int,
                 device: torch.device, capacity_dropping: bool = False, aux_losses: list[str] | None = None,
                 sp_size: int = 1, sp_rank: int = 0, replay: RoutingReplay | None = None) -> None:
        num_layers = len(moe_layers)
        self.moe_layers = [layer for layer, is_moe in enumerate(moe_layers) if is_moe]
        """Global indices of the model's MoE layers (all stages)."""
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.device, self.sp_size, self.sp_rank = device, sp_size, sp_rank
        self.capacity_dropping = capacity_dropping
        self.aux_losses = list(aux_losses or [])
        self.replay = replay
        self.routers = moe_routers(actor)
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        """Tokens per expert (after capacity dropping), per global layer, this rank."""
        self.counts = torch.zeros(num_layers, 5, dtype=torch.float64, device=device)
        """Per layer: TOKENS, ASSIGNED slots, COMPARED (tokens with a replayed record), NATURAL_MATCH, REPLAYED_MATCH."""
        self._real: torch.Tensor | None = None
        """While a training micro-batch's forward runs: [tokens] bool, real (not padding) in router order."""
        self._replayed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for replay_index, (layer, router) in enumerate(self.routers):
            router.register_forward_pre_hook(self._compare_hook(layer, replay_index))
            router.register_forward_hook(self._count_hook(layer))

    # ------------------------------------------------------------------ the pass

    @contextmanager
    def measuring(self) -> Iterator[StageHooks]:
        """Hooks of a training pass whose routers are counted."""
        try:
            yield _Measure(self)
        finally:
            self._real = None
            self._replayed.clear()

    def _compare_hook(self, layer: int, replay_index: int):
        def compare(router: torch.nn.Module, args: tuple[Any, ...]) -> None:
            current = self.replay.current if self.replay is not None else None
            if self._real is None or current is None:
                return
            targets, recorded = current[0][replay_index], current[1]
            config = router.config
            with torch.no_grad():
                logits = router.gating(args[0]).view(-1, self.num_experts)
                _, natural = topk_routing_with_score_function(
                    logits, self.topk, use_pre_softmax=config.moe_router_pre_softmax,
                    num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                    scaling_factor=config.moe_router_topk_scaling_factor, score_function=router.score_function,
                    expert_bias=router.expert_bias, fused=False, router_replay=None)
                replayed = torch.zeros_like(natural).scatter(1, targets, True)
                self.counts[layer, COMPARED] += recorded.sum()
                self.counts[layer, NATURAL_MATCH] += ((natural == replayed).all(1) & recorded).sum()
            self._replayed[layer] = (replayed, recorded)

        return compare

    def _count_hook(self, layer: int):
        def count(router: torch.nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self._real is None:
                return
            routing_map = output[1].detach()
            with torch.no_grad():
                used = routing_map[self._real]
                self.load[layer] += used.sum(0)
                self.counts[layer, TOKENS] += self._real.sum()
                self.counts[layer, ASSIGNED] += used.sum()
                if layer in self._replayed:
                    replayed, recorded = self._replayed.pop(layer)
                    self.counts[layer, REPLAYED_MATCH] += ((routing_map == replayed).all(1) & recorded).sum()

        return count

    # ------------------------------------------------------------------ the step's metrics

    def step_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """This step's metrics (same on every rank; a collective: call it on every rank), then reset."""
        stats = torch.cat([self.load, self.counts], dim=1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        load, counts = stats[:, :self.num_experts], stats[:, self.num_experts:]
        out: dict[str, float] = {}
        layers = [layer for layer in range(self.num_layers) if counts[layer, TOKENS] > 0]
        self._per_layer(out, "max_over_mean_load", {
            layer: float(load[layer].max() / (load[layer].sum() / self.num_experts))
            for layer in layers if load[layer].sum() > 0}, worst=True)
        if self.capacity_dropping:
            self._per_layer(out, "dropped_fraction", {
                layer: 1.0 - float(counts[layer, ASSIGNED] / (counts[layer, TOKENS] * self.topk)) for layer in layers})
        compared = [layer for layer in layers if counts[layer, COMPARED] > 0]
        if compared:
            self._per_layer(out, "routing_agreement", {
                layer: float(counts[layer, NATURAL_MATCH] / counts[layer, COMPARED]) for layer in compared})
            total = counts[compared, COMPARED].sum()
            out["moe/routing_agreement"] = float(counts[compared, NATURAL_MATCH].sum() / total)
            out["moe/replayed_routing_agreement"] = float(counts[compared, REPLAYED_MATCH].sum() / total)
        out.update(self._aux_loss_metrics(num_micro_batches))
        self.load.zero_()
        self.counts.zero_()
        return out

    def _per_layer(self, out: dict[str, float], name: str, values: dict[int, float], *, worst: bool = False) -> None:
        if not values:
            return
        for layer, value in values.items():
            out[f"moe/{name}/{layer_suffix(layer, self.num_layers)}"] = value
        out[f"moe/{name}"] = max(values.values()) if worst else sum(values.values()) / len(values)

    def _aux_loss_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """Megatron's tracked load-balancing losses; every rank takes part (a stage without MoE layers
        tracks zeros, as `track_moe_metrics(force_initialize=True)` does)."""
        if not self.aux_losses:
            return {}
        tracker = get_moe_layer_wise_logging_tracker()
        for name in self.aux_losses:
            if name not in tracker:
                tracker[name] = {"values": torch.zeros(self.num_layers, device=self.device), "reduce_group": None,
                                 "avg_group": None, "reduce_group_has_dp": False}
        reduce_aux_losses_tracker_across_ranks(self.aux_losses)
        out: dict[str, float] = {}
        for name in self.aux_losses:
            values = (tracker[name]["values"].float() / max(num_micro_batches, 1)).tolist()
            self._per_layer(out, name, {layer: values[layer] for layer in self.moe_layers})
        clear_aux_losses_tracker()
        return out


class _Measure(StageHooks):
    def __init__(self, health: RouterHealth) -> None:
        self.health = health

    def before_forward(self, micro: MicroBatch) -> None:
        tokens = router_tokens(micro, sp_size=self.health.sp_size, sp_rank=self.health.sp_rank)
        self.health._real = tokens.real.to(self.health.device)

    def after_forward(self, micro: MicroBatch) -> None:
        self.health._real = None

    def before_backward(self, micro: MicroBatch) -> None:
        self.health._real = None
