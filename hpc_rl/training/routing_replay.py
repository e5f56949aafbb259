"""Routing replay: the actor's MoE routers take their top-k experts from a record instead of choosing.

Owns `RoutingReplay`, which drives Megatron-core's own mechanism (`moe/router_replay.py`: one
`RouterReplay` per `TopKRouter`, built when `moe_enable_routing_replay` is set, whose action RECORD
keeps the router's top-k, REPLAY_FORWARD uses a given top-k, REPLAY_BACKWARD pops the given top-ks in
order for activation recomputation; the router still computes its scores, so the gating weights of
the replayed experts and their gradient are the trainer's), and `replay_targets`, the engines'
per-sample routing laid out in a micro-batch's router order (`router_tokens`). Does not own which
pass replays what (`step`), the layout (`micro_batches`), or router statistics (`router_health`).

Two sources, as slime's flags:
- `use_rollout_routing_replay` (R3, arXiv 2510.11370): the experts the engine chose for every token,
  prompt and response (`TrainBatch.routed_experts`, SGLang's `--enable-return-routed-experts`). The
  old-log-prob pass and every training pass replay them, so the trainer computes the log-probs of the
  policy that generated the tokens. A token the engine never ran (the last one, or tool tokens
  appended after the last engine call) gets filler experts: its output scores no trained token,
  which `check_trained_tokens_covered` makes sure of.
- `use_routing_replay` (GSPO's "Routing Replay", arXiv 2507.18071): each router's own choice in the
  old-log-prob pass, per micro-batch, replayed in the training pass over the same micro-batch
  (`step` builds the micro-batches once per rollout), so the importance ratio compares the same
  experts before and after the updates.
The reference model never replays (its routers choose: slime's "fallthrough" stage).

Replayed ids are global expert ids [tokens, topk] per router in its token order on this rank, so
expert parallelism, sequence parallelism, context parallelism and pipeline stages (each stage's
routers only) need nothing more. Not replayed by Megatron itself: `moe_router_fusion` (TE's fused
top-k) and sinkhorn routing; validation refuses both with replay.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from hpc_rl.training.micro_batches import MicroBatch
from hpc_rl.training.pipeline import StageHooks
from hpc_rl.training.replay_read_ahead import ReplayReadAhead
from hpc_rl.training.router_tokens import RouterTokens, router_tokens
from hpc_rl.training.train_batch import TrainBatch

ReplaySource = Literal["rollout", "recorded"]


def moe_routers(model: torch.nn.Module) -> list[tuple[int, TopKRouter]]:
    """This stage's MoE routers of the decoder with their global 0-based layer index, in layer order. An MTP
    layer's router is not one of them: it is the draft's (SGLang's routed experts and the telemetry's layers
    are the decoder's), and Megatron numbers it past the decoder's layers."""
    routers = [(int(module.layer_number) - 1, module) for name, module in model.named_modules()
               if isinstance(module, TopKRouter) and ".mtp." not in f".{name}."]
    return sorted(routers, key=lambda pair: pair[0])


def filler_experts(tokens: int, topk: int, num_experts: int) -> torch.Tensor:
    """[tokens, topk] distinct experts per row, spread over all experts (for tokens with no record)."""
    return (torch.arange(tokens)[:, None] * topk + torch.arange(topk)) % num_experts


def replay_targets(tokens: RouterTokens, routing: Sequence[np.ndarray], layers: Sequence[int], *,
                   num_experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([len(layers), tokens, topk] long expert ids, [tokens] bool: taken from `routing`).

    `routing[slot]` is the [rows, num_layers, topk] record of the micro-batch's sample `slot`; a token
    past its sample's rows, and padding, gets `filler_experts`.
    """
    count = len(tokens)
    rows = torch.tensor([len(r) for r in routing], dtype=torch.long)
    slot = tokens.sample.clamp(min=0)
    recorded = tokens.real & (tokens.position < rows[slot])
    filler = filler_experts(count, topk, num_experts)
    if int(rows.sum()) == 0:
        return filler.expand(len(layers), count, topk).clone(), recorded
    table = torch.from_numpy(np.concatenate(routing, axis=0))  # [rows of all samples, num_layers, topk]
    index = ((torch.cumsum(rows, 0) - rows)[slot] + tokens.position).clamp(max=len(table) - 1)
    picked = table[index]  # a row for every token; those not recorded are replaced below
    if list(layers) != list(range(table.shape[1])):
        picked = picked[:, list(layers)]
    return torch.where(recorded[None, :, None], picked.transpose(0, 1).to(torch.long), filler), recorded


def check_routed_experts(batch: TrainBatch, *, num_layers: int, topk: int) -> None:
    """Every sample carries [rows, num_layers, topk] routing covering the tokens its trained log-probs
    depend on (causal: every position before its last trained token); ValueError naming the sample."""
    if batch.routed_experts is None:
        raise ValueError("training.use_rollout_routing_replay is set but the rollout carries no routed experts "
                         "(the engines must run with --enable-return-routed-experts)")
    for index, (routing, tokens, response, mask) in enumerate(zip(batch.routed_experts, batch.tokens,
                                                                  batch.response_lengths, batch.loss_masks)):
        if tuple(routing.shape[1:]) != (num_layers, topk):
            raise ValueError(f"sample {index}: routed experts of shape {tuple(routing.shape)}, expected "
                             f"[rows, {num_layers}, {topk}] (the model's num_layers and moe_router_topk)")
        last_trained = next((i for i in range(len(mask) - 1, -1, -1) if mask[i]), None)  # usually the last
        needed = 0 if last_trained is None else len(tokens) - response + last_trained
        if len(routing) < needed:
            raise ValueError(f"sample {index}: the engine's routed experts cover its first {len(routing)} tokens, "
                             f"but its trained tokens depend on the first {needed}")


class RoutingReplay:
    """Megatron's RouterReplay on the actor's routers, around the passes `step` runs (module docstring)."""

    def __init__(self, actor: torch.nn.Module, *, source: ReplaySource, num_layers: int, num_experts: int,
                 topk: int, device: torch.device, sp_size: int = 1, sp_rank: int = 0,
                 recompute: bool = False, prefetch_microbatches: int = 0) -> None:
        self.source = source
        self.prefetch_microbatches = prefetch_microbatches
        """Micro-batches whose targets are built and copied ahead of their forward (`replay_read_ahead`)."""
        self._copy_stream = (torch.cuda.Stream(device=device)
                             if prefetch_microbatches > 0 and torch.device(device).type == "cuda" else None)
        self.routers = moe_routers(actor)
        if any(router.router_replay is None for _, router in self.routers):
            raise RuntimeError("routing replay needs the actor built with moe_enable_routing_replay "
                               "(model_provider sets it from training.use_routing_replay / use_rollout_routing_replay)")
        self.layers = [layer for layer, _ in self.routers]
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.device, self.sp_size, self.sp_rank = device, sp_size, sp_rank
        self.recompute = recompute
        """Full activation recomputation reruns the routers in a training pass's backward: each micro-batch's
        targets are then kept for REPLAY_BACKWARD until its backward takes them (else dropped at once)."""
        self._recorded: dict[int, torch.Tensor] = {}
        """id(micro-batch) -> [layers here, tokens, topk] ids its old-log-prob pass chose (CPU)."""
        self._record_dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.current: tuple[torch.Tensor, torch.Tensor] | None = None
        """While a micro-batch's forward replays: ([layers here, tokens, topk] ids on the device, [tokens]
        bool: rows that come from the record rather than filler); read by `router_health`."""

    @property
    def has_recording(self) -> bool:
        return bool(self._recorded)

    def forget(self) -> None:
        """Drop the recorded routing (end of a rollout)."""
        self._recorded.clear()

    def _set_action(self, action: RouterReplayAction | None) -> None:
        for _, router in self.routers:
            if action is None:
                router.router_replay.clear_router_replay_action()
            else:
                router.router_replay.set_router_replay_action(action)

    def _clear(self) -> None:
        self._set_action(None)
        for _, router in self.routers:
            router.router_replay.clear_indices()
        self.current = None

    @contextmanager
    def recording(self) -> Iterator[StageHooks]:
        """Hooks of a pass whose micro-batches record each router's choice (the old-log-prob pass)."""
        try:
            yield _Record(self)
        finally:
            self._clear()

    @contextmanager
    def replaying(self, batch: TrainBatch | None, *, backward: bool = False,
                  micros: Sequence[MicroBatch] | None = None) -> Iterator[StageHooks]:
        """Hooks of a pass whose routers replay: the engines' routing of `batch` (rollout source; checked
        first) or, with `batch` None, what `recording` kept for each micro-batch. `backward`: a training
        pass (its recomputation replays too). `micros`: the pass's micro-batches in forward order, for the
        read-ahead (without them each micro-batch's targets are built at its forward)."""
        if batch is not None:
            check_routed_experts(batch, num_layers=self.num_layers, topk=self.topk)
        read_ahead = ReplayReadAhead(lambda micro: self._targets(micro, batch),  # type: ignore[arg-type]
                                     micros, self.prefetch_microbatches)
        try:
            yield _Replay(self, read_ahead, keep_for_backward=backward and self.recompute)
        finally:
            self._clear()

    def _tokens(self, micro: MicroBatch) -> RouterTokens:
        return router_tokens(micro, sp_size=self.sp_size, sp_rank=self.sp_rank)

    def _keep(self, micro: MicroBatch) -> None:
        if not self.routers:  # a pipeline stage of dense layers only
            return
        indices = [router.router_replay.get_recorded_indices() for _, router in self.routers]
        self._recorded[id(micro)] = torch.stack(indices).to("cpu", self._record_dtype)

    def _targets(self, micro: MicroBatch, batch: TrainBatch | None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """`micro`'s ([layers here, tokens, topk] ids, [tokens] recorded) on the device, and with read-ahead on a
        GPU the CUDA event of their copy on the side stream (`_replay` makes the compute stream wait for it;
        None otherwise)."""
        tokens = self._tokens(micro)
        if batch is not None:
            assert batch.routed_experts is not None
            targets, recorded = replay_targets(tokens, [batch.routed_experts[i] for i in micro.indices], self.layers,
                                               num_experts=self.num_experts, topk=self.topk)
        else:
            if id(micro) not in self._recorded:
                raise RuntimeError("routing replay: a micro-batch without a recorded old-log-prob pass")
            targets, recorded = self._recorded[id(micro)].to(torch.long), tokens.real
        if self._copy_stream is None:
            return targets.to(self.device), recorded.to(self.device), None
        with torch.cuda.stream(self._copy_stream):
            targets = targets.pin_memory().to(self.device, non_blocking=True)
            recorded = recorded.pin_memory().to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        return targets, recorded, copied

    def _replay(self, micro: MicroBatch, read_ahead: ReplayReadAhead, keep_for_backward: bool) -> None:
        if not self.routers:  # a pipeline stage of dense layers only
            return
        targets, recorded, copied = read_ahead.take(micro)
        if copied is not None:  # GPU read-ahead: this micro-batch's copy ran on the side stream
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            targets.record_stream(compute)
            recorded.record_stream(compute)
        for index, (_, router) in enumerate(self.routers):
            router.router_replay.set_target_indices(targets[index])
            if not keep_for_backward:  # no recomputation will pop it
                router.router_replay.replay_backward_list.pop()
        self._set_action(RouterReplayAction.REPLAY_FORWARD)
        self.current = (targets, recorded)


class _Record(StageHooks):
    def __init__(self, replay: RoutingReplay) -> None:
        self.replay = replay

    def before_forward(self, micro: MicroBatch) -> None:
        self.replay._set_action(RouterReplayAction.RECORD)

    def after_forward(self, micro: MicroBatch) -> None:
        self.replay._keep(micro)


class _Replay(StageHooks):
    def __init__(self, replay: RoutingReplay, read_ahead: ReplayReadAhead, keep_for_backward: bool) -> None:
        self.replay, self.read_ahead, self.keep_for_backward = replay, read_ahead, keep_for_backward

    def before_forward(self, micro: MicroBatch) -> None:
        self.replay._replay(micro, self.read_ahead, self.keep_for_backward)

    def after_forward(self, micro: MicroBatch) -> None:
        self.replay.current = None

    def before_backward(self, micro: MicroBatch) -> None:
        self.replay._set_action(RouterReplayAction.REPLAY_BACKWARD)
