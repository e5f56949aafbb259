"""Pipeline-parallel execution of micro-batches over PP stages (1F1B), on gloo (CPU) and NCCL (GPU).

Owns: the order in which one stage runs its micro-batches' forward and backward passes and
exchanges activations with its neighbours (`one_f_one_b`, `forward_only`: pure lists of ops), and
`PipelineSchedule`, which runs such a list on this rank's model chunk with torch.distributed p2p on
the pipeline group. Does not own what a micro-batch is (`micro_batches`), the loss (`step` /
`losses`) or the model's layout per stage (`model_provider`).

Megatron's own schedules (`get_forward_backward_func`) allocate on CUDA and do not run on a CPU
build (notes/megatron-cpu.md); this one is plain torch.distributed, so the same code runs in CPU
tests and on GPUs. Facts it relies on: a non-first stage takes the previous stage's hidden states
through `model.set_input_tensor`; what a non-last stage outputs is [s, b, h] (s / TP under sequence
parallel), where [b, s] is the micro-batch's token layout ([1, T] when packed); the combined
"send one way, receive the other" steps of 1F1B are posted together (`batch_isend_irecv`), so two
neighbours never both wait for the other to receive first.

Only hidden states (and their gradients) travel. Every stage holds the micro-batch's tokens (the
controller sends a DP group's share to each of its ranks), so positions, masks and packed-sequence
parameters are built locally and the shape of what arrives is known without sending it first.
The last stage turns logits into what the caller wants (`on_output`: log-probs, or the loss to
backward); the other stages only run their chunk, and `forward_only` returns nothing there.

1F1B for P stages and M micro-batches (stage r: P-1-r warm-up forwards, then one forward + one
backward per step, then the cool-down backwards), so at most P-r micro-batches hold activations::

    P=3, M=4   stage 0:  F0 F1 F2 B0 F3 B1 B2 B3
               stage 1:  F0 F1 B0 F2 B1 F3 B2 B3
               stage 2:  F0 B0 F1 B1 F2 B2 F3 B3

With P=1 this is F0 B0 F1 B1 ... with no communication: the PP=1 trainer runs exactly as before.
As in Megatron's schedules, Megatron DDP's gradient reduction is held back (`no_sync`) until the
last micro-batch's backward (on GPU it overlaps that backward; on CPU it runs in the step).
Not done: interleaved (virtual) stages, overlapping p2p with compute.

Why this schedule and not Megatron's, also on GPU (issue 30; not measured on GPU yet, see below):
- One code path. megatron-core 0.16.1's schedules allocate on CUDA unconditionally, even at PP 1
  (`schedules.py`: `total_num_tokens = torch.zeros(..., device="cuda")` in all three schedules;
  `p2p_communication.py`: receive buffers and shape messages on `torch.cuda.current_device()`), so the
  CPU twin could not run them (notes/megatron-cpu.md: only a global cuda->cpu TorchFunctionMode hack did).
  Using them on GPU only would leave the GPU's pipeline code untested by CI.
- Per-micro-batch hooks: `StageHooks.before_backward` tells `routing_replay` / `router_health` whose
  backward (and activation recomputation) runs next; Megatron's `backward_step` takes no such callback.
- Cost of keeping it: no interleaving (bubble (P-1)/M of the ideal step time instead of (P-1)/(vM) with v
  virtual stages, Megatron's paper) and p2p not overlapped with compute. What would decide a switch, on
  >= 2 GPUs (one rank per stage): step time and peak memory of a PP 2 and PP 4 step of a real
  model, this schedule vs `forward_backward_pipelining_without_interleaving` vs the interleaved one with
  `overlap_p2p_comm`, at the M (micro-batches per step) a run uses. With M >> P the bubble is small and
  the difference is the p2p overlap; if that is a few percent of step time this schedule stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

TransferKind = Literal["send_forward", "recv_forward", "send_backward", "recv_backward"]
T = TypeVar("T")


@dataclass(frozen=True)
class Compute:
    """Run one micro-batch's forward or backward pass of this stage's chunk."""

    kind: Literal["forward", "backward"]
    micro: int


@dataclass(frozen=True)
class Transfer:
    """One p2p message: hidden states forward (to the next stage) or their gradient backward."""

    kind: TransferKind
    micro: int


@dataclass(frozen=True)
class Exchange:
    """Transfers posted together; all complete before the stage's next op."""

    transfers: tuple[Transfer, ...]


Op = Compute | Exchange


def _exchange(transfers: Sequence[Transfer], *, first: bool, last: bool) -> list[Op]:
    """The transfers that exist on this stage (none backward of the first, none forward of the last)."""
    kept = tuple(t for t in transfers
                 if not (first and t.kind in ("recv_forward", "send_backward"))
                 and not (last and t.kind in ("send_forward", "recv_backward")))
    return [Exchange(kept)] if kept else []


def forward_only(num_micro: int, pp_size: int, pp_rank: int) -> list[Op]:
    """Receive, forward, send, for each micro-batch in turn (log-prob passes: no backward)."""
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    ops: list[Op] = []
    for micro in range(num_micro):
        ops += _exchange([Transfer("recv_forward", micro)], first=first, last=last)
        ops.append(Compute("forward", micro))
        ops += _exchange([Transfer("send_forward", micro)], first=first, last=last)
    return ops


def one_f_one_b(num_micro: int, pp_size: int, pp_rank: int) -> list[Op]:
    """The 1F1B (non-interleaved) order of stage `pp_rank` of `pp_size` over `num_micro` micro-batches."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is not in [0, {pp_size})")
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    warmup = min(pp_size - pp_rank - 1, num_micro)
    steady = num_micro - warmup
    ops: list[Op] = []
    for micro in range(warmup):
        ops += _exchange([Transfer("recv_forward", micro)], first=first, last=last)
        ops.append(Compute("forward", micro))
        ops += _exchange([Transfer("send_forward", micro)], first=first, last=last)
    if steady:
        ops += _exchange([Transfer("recv_forward", warmup)], first=first, last=last)
    for step in range(steady):
        forward, backward = warmup + step, step
        ops.append(Compute("forward", forward))
        ops += _exchange([Transfer("send_forward", forward), Transfer("recv_backward", backward)],
                         first=first, last=last)
        ops.append(Compute("backward", backward))
        if step == steady - 1:
            ops += _exchange([Transfer("send_backward", backward)], first=first, last=last)
        else:
            ops += _exchange([Transfer("send_backward", backward), Transfer("recv_forward", forward + 1)],
                             first=first, last=last)
    for backward in range(steady, num_micro):
        ops += _exchange([Transfer("recv_backward", backward)], first=first, last=last)
        ops.append(Compute("backward", backward))
        ops += _exchange([Transfer("send_backward", backward)], first=first, last=last)
    return ops


def stage_output_shape(tokens_shape: Sequence[int], hidden_size: int, sequence_split: int) -> tuple[int, int, int]:
    """[s / sequence_split, b, h]: what a non-last stage outputs for a micro-batch of tokens [b, s]."""
    batch, seq = int(tokens_shape[0]), int(tokens_shape[1])
    if seq % sequence_split:
        raise ValueError(f"sequence length {seq} does not divide by the sequence-parallel size {sequence_split}")
    return seq // sequence_split, batch, hidden_size


def _set_input_tensor(model: torch.nn.Module, tensor: torch.Tensor | None) -> None:
    inner: Any = model
    while hasattr(inner, "module"):  # DDP / Float16Module wrappers
        inner = inner.module
    inner.set_input_tensor(tensor)


class StageHooks:
    """Called around each micro-batch's compute on this stage (no-ops here; `routing_replay` and
    `router_health` override them): what runs inside the model depends on the micro-batch."""

    def before_forward(self, micro: Any) -> None:
        """Right before `micro`'s forward pass on this stage."""

    def after_forward(self, micro: Any) -> None:
        """Right after `micro`'s forward pass on this stage (before its output is sent on)."""

    def before_backward(self, micro: Any) -> None:
        """Right before `micro`'s backward pass (activation recomputation runs inside it)."""


NO_HOOKS = StageHooks()


@dataclass
class _MicroState:
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    loss: torch.Tensor | None = None


@dataclass
class PipelineSchedule:
    """Runs micro-batches through this rank's pipeline stage; with pp_size 1, just through the model."""

    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    hidden_size: int = 0
    sequence_split: int = 1
    """TP size under sequence parallel (stage outputs are split along the sequence), else 1."""
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    peers: tuple[int, int] = (-1, -1)
    """Global ranks of the previous and the next stage."""
    _warmed_up: bool = field(default=False, init=False, repr=False)

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, device: torch.device) -> PipelineSchedule:
        """The schedule for this rank's stage of `model` (Megatron's groups must exist)."""
        from megatron.core import parallel_state

        config: Any = model.config
        size = parallel_state.get_pipeline_model_parallel_world_size()
        if size == 1:
            return cls(device=device)
        return cls(pp_size=size, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                   pp_group=parallel_state.get_pipeline_model_parallel_group(), hidden_size=config.hidden_size,
                   sequence_split=config.tensor_model_parallel_size if config.sequence_parallel else 1,
                   dtype=config.pipeline_dtype or config.params_dtype, device=device,
                   peers=(parallel_state.get_pipeline_model_parallel_prev_rank(),
                           parallel_state.get_pipeline_model_parallel_next_rank()))

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ------------------------------------------------------------------ entry points

    def forward_only(self, model: torch.nn.Module, micros: Sequence[Any],
                     on_output: Callable[[Any, torch.Tensor], T], hooks: StageHooks = NO_HOOKS) -> list[T]:
        """`on_output(micro, logits)` for every micro-batch, on the last stage (empty list elsewhere).

        Call it under `torch.no_grad()`.
        """
        results: list[T] = []
        self._run(forward_only(len(micros), self.pp_size, self.pp_rank), model, micros,
                  lambda micro, logits: results.append(on_output(micro, logits)), training=False, hooks=hooks)
        return results

    def forward_backward(self, model: torch.nn.Module, micros: Sequence[Any],
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], hooks: StageHooks = NO_HOOKS) -> None:
        """Forward and backward of every micro-batch in 1F1B order; `loss_fn(micro, logits)` runs on
        the last stage and returns the scalar to backpropagate (already scaled by the caller)."""
        self._run(one_f_one_b(len(micros), self.pp_size, self.pp_rank), model, micros, loss_fn, training=True,
                  hooks=hooks)

    # ------------------------------------------------------------------ execution

    def _run(self, ops: list[Op], model: torch.nn.Module, micros: Sequence[Any],
             on_output: Callable[[Any, torch.Tensor], Any], *, training: bool, hooks: StageHooks) -> None:
        states = [_MicroState() for _ in micros]
        if self.pp_size > 1:
            self._warm_up()
        for op in ops:
            if isinstance(op, Exchange):
                self._exchange(op, states, micros, training=training)
            elif op.kind == "forward":
                hooks.before_forward(micros[op.micro])
                self._forward(model, micros[op.micro], states[op.micro], on_output, training=training)
                hooks.after_forward(micros[op.micro])
            else:
                # Megatron DDP's grad reduction (overlapped on GPU) starts on the last micro-batch only
                no_sync = getattr(model, "no_sync", None) if op.micro != len(micros) - 1 else None
                hooks.before_backward(micros[op.micro])
                with no_sync() if no_sync is not None else nullcontext():
                    self._backward(states[op.micro])
        if self.pp_size > 1:
            _set_input_tensor(model, None)  # do not keep the last micro-batch's activations alive

    def _forward(self, model: torch.nn.Module, micro: Any, state: _MicroState,
                 on_output: Callable[[Any, torch.Tensor], Any], *, training: bool) -> None:
        if not self.is_first:
            _set_input_tensor(model, state.input)
        output = micro.forward(model)
        if self.is_last:
            result = on_output(micro, output)
            if training:
                state.loss = result
            return
        expected = stage_output_shape(micro.tokens.shape, self.hidden_size, self.sequence_split)
        if tuple(output.shape) != expected:
            raise RuntimeError(f"pipeline stage {self.pp_rank} produced {tuple(output.shape)}, the next stage "
                               f"expects {expected} (tokens {tuple(micro.tokens.shape)})")
        state.output = output

    def _backward(self, state: _MicroState) -> None:
        if self.is_last:
            if state.loss is None:
                raise RuntimeError("backward before the loss was computed")
            state.loss.backward()
        else:
            assert state.output is not None, "backward of a micro-batch without its forward"
            torch.autograd.backward(state.output, grad_tensors=state.output_grad)
        state.loss = state.output = state.output_grad = None

    def _exchange(self, op: Exchange, states: list[_MicroState], micros: Sequence[Any], *, training: bool) -> None:
        prev_rank, next_rank = self.peers
        p2p: list[dist.P2POp] = []
        received: list[tuple[Transfer, torch.Tensor]] = []
        for transfer in op.transfers:
            state = states[transfer.micro]
            if transfer.kind == "send_forward":
                assert state.output is not None, "send before forward"
                p2p.append(dist.P2POp(dist.isend, state.output.detach().contiguous(), next_rank, self.pp_group))
                if not training:
                    state.output = None
            elif transfer.kind == "recv_forward":
                shape = stage_output_shape(micros[transfer.micro].tokens.shape, self.hidden_size, self.sequence_split)
                buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
                p2p.append(dist.P2POp(dist.irecv, buffer, prev_rank, self.pp_group))
                received.append((transfer, buffer))
            elif transfer.kind == "send_backward":
                grad = state.input.grad if state.input is not None else None
                if grad is None:
                    raise RuntimeError(f"micro-batch {transfer.micro}: no gradient for the stage input")
                p2p.append(dist.P2POp(dist.isend, grad.contiguous(), prev_rank, self.pp_group))
                state.input = None
            else:  # recv_backward
                assert state.output is not None, "gradient for a micro-batch without its forward"
                buffer = torch.empty_like(state.output)
                p2p.append(dist.P2POp(dist.irecv, buffer, next_rank, self.pp_group))
                received.append((transfer, buffer))
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
        if self.device.type == "cuda":  # batch_isend_irecv's streams vs the compute stream (as Megatron does)
            torch.cuda.synchronize()
        for transfer, buffer in received:
            state = states[transfer.micro]
            if transfer.kind == "recv_forward":
                state.input = buffer.requires_grad_(training)
            else:
                state.output_grad = buffer

    def _warm_up(self) -> None:
        """One collective on the pipeline group before its first p2p (NCCL creates communicators
        lazily, and batch_isend_irecv as a group's first call needs every rank of the group)."""
        if self._warmed_up:
            return
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_group)
        self._warmed_up = True
