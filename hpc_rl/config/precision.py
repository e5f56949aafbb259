"""The one answer to "which dtype do the trainer's weights have, and so the engines'?", by device.

Owns: the trainer's parameter dtype (float32 on CPU: gloo and Megatron's CPU path; bfloat16 on GPUs, as
slime's `--bf16`), which is also what every weight update exports and what each engine is told to serve
in (SGLang `--dtype`, the CPU engine's `--dtype`). An engine left at SGLang's `auto` serves a float32
checkpoint in float16 on CPU: trainer and rollout log-probs then differ by ~3e-4 instead of ~1e-7
(issue 22). Names, not torch dtypes: the controller and the driver never load torch.
"""

from __future__ import annotations

TRAINER_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def trainer_dtype_name(device: str) -> str:
    """'float32' (cpu) or 'bfloat16' (cuda): the trainer's parameters, its weight exports, the engines'."""
    try:
        return TRAINER_DTYPES[device]
    except KeyError:
        raise ValueError(f"cluster.device {device!r}: expected one of {sorted(TRAINER_DTYPES)}") from None
