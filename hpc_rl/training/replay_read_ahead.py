"""Read-ahead of routing replay targets (slime's --routing-replay-prefetch-microbatches N).

Owns `ReplayReadAhead`: within one pass, when a micro-batch's forward takes its replay targets, the targets of
the next `depth` micro-batches of the pass are built and sent to the device right away, so their host work
(gathering each token's row of the engines' routing, `routing_replay.replay_targets`) and their host-to-device
copy (on a side CUDA stream) run while this micro-batch computes, not in front of the next one. depth 0 builds
each micro-batch's targets at its own forward.

Memory bound: at most depth + 1 micro-batches' targets are held at once (the running one and the `depth` read
ahead): (depth + 1) x [MoE layers on this stage, router tokens of a micro-batch, topk] int64 on the device, e.g.
depth 1, 48 layers, 16,384 tokens, topk 8: 2 x 50 MiB. Does not own what the targets are (`routing_replay`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class ReplayReadAhead(Generic[T]):
    """The targets of a pass's micro-batches, built up to `depth` ahead of the one whose forward runs."""

    def __init__(self, build: Callable[[object], T], micros: Sequence[object] | None, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"routing replay read-ahead depth {depth} must be >= 0")
        self.build, self.depth = build, depth
        self.order = [id(micro) for micro in micros] if micros is not None and depth > 0 else []
        """The pass's micro-batches in forward order (no read-ahead without it)."""
        self.micros = {id(micro): micro for micro in micros or []}
        self.ready: dict[int, T] = {}
        """id(micro-batch) -> its targets, built ahead and not taken yet."""
        self.most_held = 0
        """Most targets held at once, the running micro-batch's included (the memory bound's check)."""

    def take(self, micro: object) -> T:
        """`micro`'s targets (read ahead, or built now); then those of the next `depth` micro-batches are built."""
        targets = self.ready.pop(id(micro), None)
        if targets is None:
            targets = self.build(micro)
        if id(micro) in self.order:
            position = self.order.index(id(micro))
            for key in self.order[position + 1: position + 1 + self.depth]:
                if key not in self.ready:
                    self.ready[key] = self.build(self.micros[key])
        self.most_held = max(self.most_held, len(self.ready) + 1)
        return targets
