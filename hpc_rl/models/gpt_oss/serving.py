"""What SGLang 0.5.23 cannot serve of gpt-oss: the family's `sglang_problems` hook (pure: no torch).

Facts, read in the installed wheel (sglang 0.5.23, `srt/models/gpt_oss.py`, `srt/layers/moe/fused_moe_triton/
layer.py`):
  * A bf16 checkpoint's experts are loaded fused (`use_weight_loader_fused` when the quantization is not mxfp4):
    `FusedMoE.weight_loader_fused` narrows the loaded [E, ...] tensor by the MoE TP rank only, never by the EP rank,
    and copies it into the parameter of E / EP local experts; with EP > 1 the copy's shapes differ and the load
    fails (at start, and in every weight update). Its MXFP4 path (`_load_mxfp4_experts_weights`) does narrow by EP
    rank, but an MXFP4 engine skips the bf16 experts every sync sends (refused below).
  * An MXFP4 engine reads experts in an update only as `_blocks` / `_scales`: the bf16 experts every weight sync
    sends are skipped without an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _ep_size(options: Mapping[str, Any]) -> tuple[str, int]:
    key = "ep_size" if "ep_size" in options else "expert_parallel_size"
    return key, int(options.get(key) or 1)


def sglang_problems(options: Mapping[str, Any], hf_config: Mapping[str, Any] | None) -> list[tuple[str | None, str]]:
    """(SGLang option name, or None for the checkpoint itself; message) per option / checkpoint the engines cannot
    serve gpt-oss with."""
    from hpc_rl.models.gpt_oss.checkpoint import is_mxfp4

    problems = []
    try:
        mxfp4 = hf_config is not None and is_mxfp4(dict(hf_config))
    except ValueError:
        mxfp4 = False  # another quantisation: the checkpoint checks name it
    if mxfp4:
        problems.append((None, (
            "is gpt-oss's MXFP4 release (config.json quantization_config mxfp4): SGLang then serves MXFP4 experts, "
            "and its gpt-oss loader reads experts in an update only as MXFP4 _blocks / _scales, skipping the bf16 "
            "ones every weight sync sends (broadcast, colocated, disk) without an error (the engine would keep its "
            "first experts); give the bf16 checkpoint (hpc_rl reads the MXFP4 release as bf16; "
            "tools/convert_hf_to_torch_dist.py then tools/convert_torch_dist_to_hf.py, or --save-hf, write it with "
            "bf16 fused experts) as --hf-checkpoint")))
    key, ep = _ep_size(options)
    if ep > 1 and not mxfp4:
        problems.append((key, (
            f"{ep}: SGLang 0.5.23 loads gpt-oss's bf16 experts fused (FusedMoE.weight_loader_fused), narrowing them "
            f"by the MoE TP rank only and never by the EP rank, so an engine with EP > 1 fails to load them (at "
            f"start and in every weight update); serve gpt-oss with EP 1 (experts split by MoE TP: the engine's "
            f"tp_size)")))
    return problems


def read_hf_config(path: str) -> dict[str, Any] | None:
    """config.json of the checkpoint directory `path`, or None when it is not readable here."""
    from pathlib import Path

    file = Path(path or "") / "config.json"
    try:
        return json.loads(file.read_text()) if path and file.is_file() else None
    except (OSError, ValueError):
        return None
