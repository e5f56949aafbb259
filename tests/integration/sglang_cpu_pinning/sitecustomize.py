"""A stand-in for the LoRA check on real SGLang on CPU (tests/integration/test_sglang_lora.py), put first on the
SGLang process's PYTHONPATH by that test only: SGLang 0.5.23's LoRA layers and its torch_native LoRA backend pin
host memory unconditionally (`torch.tensor(..., pin_memory=True)`, `.pin_memory()`), which a CPU-only torch
refuses ("pin_memory=True requires a CUDA or other accelerator backend"). Pinning only speeds host-to-device
copies, so on a machine without an accelerator it is made a no-op here; nothing else changes."""

from __future__ import annotations

import functools
from typing import Any

import torch

if not torch.cuda.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]

    def _unpinned(factory: Any) -> Any:
        @functools.wraps(factory)
        def make(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return factory(*args, **kwargs)
        return make

    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
                  "full_like"):
        setattr(torch, _name, _unpinned(getattr(torch, _name)))
