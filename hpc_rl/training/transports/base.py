"""What the trainer halves of the weight transports share: the dtype every weight update exports in, and the
rank's pieces a transport reads (`TransportRank`). Not here: any one transport (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.precision import trainer_dtype_name
from hpc_rl.training.parallel import ParallelInfo

if TYPE_CHECKING:
    from hpc_rl.config.fp8_scheme import Fp8Blocks
    from hpc_rl.training.actor import TrainerParts


def export_dtype(on_cpu: bool) -> torch.dtype:
    """What every weight update exports in: the trainer's parameter dtype (`config.precision`), which the
    engines were started with (SGLang `--dtype`), so both compute in the same precision."""
    return getattr(torch, trainer_dtype_name("cpu" if on_cpu else "cuda"))


@dataclass(kw_only=True)
class TransportRank:
    """One trainer rank as a transport sees it."""

    parts: TrainerParts
    arch: ModelArchitecture
    info: ParallelInfo
    engines_updated: Callable[[], None]
    """Called once the engines serve the actor's weights (keep_old_actor keeps a copy for the old log-probs)."""
    engine_fp8: Fp8Blocks | None = None
    """The engines' checkpoint's block-FP8 scheme (None: not quantized): every transport quantizes as it does."""

    def parallel_groups(self) -> tuple[object | None, object | None]:
        """(TP group, PP group) of this rank; None for a dimension of size 1."""
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group() if self.info.tp_size > 1 else None
        pp_group = parallel_state.get_pipeline_model_parallel_group() if self.info.pp_size > 1 else None
        return tp_group, pp_group
