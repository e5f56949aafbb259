"""Read HuggingFace checkpoints into a (possibly TP-sharded) Megatron model.

Owns: reading `*.safetensors` (single file or sharded with an index) into an HF state dict, checking
the architecture file against `config.json` first (a wrong rotary base trains silently wrong), and
copying each rank's shards into the model's parameters (and the routers' expert-bias buffers): under
pipeline parallelism only the global layers (and ends) this rank's stage holds, under expert
parallelism only this rank's experts (sharded over the expert-TP group), and a tied output layer on the last stage from
the HF embedding. The name/layout logic is `hf_mapping`'s, the stage's slice is `stage`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from hpc_rl.config.model import ModelArchitecture, architecture_mismatches, load_hf_config
from hpc_rl.models.registry import family
from hpc_rl.weights import hf_mapping
from hpc_rl.config.fp8_scheme import SCALE_SUFFIX, read_fp8_blocks
from hpc_rl.weights.fp8_blocks import FP8_DTYPE, dequantize_blocks
from hpc_rl.weights.stage import EMBEDDING, OUTPUT_LAYER, global_named_params, stage_layout, stage_name_map


def is_hf_checkpoint(path: str | Path) -> bool:
    """True for a directory holding config.json and safetensors weights (not a torch_dist tree)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def check_architecture(arch: ModelArchitecture, hf_dir: str | Path, model_file: str | Path | None = None) -> None:
    """Raise a readable error when the model file disagrees with the checkpoint's config.json."""
    problems = architecture_mismatches(arch, load_hf_config(hf_dir))
    if problems:
        where = f"model file {model_file}" if model_file else "the model architecture"
        raise ValueError(
            f"{where} does not match {Path(hf_dir) / 'config.json'}:\n  " + "\n  ".join(problems)
            + "\nFix the model file (configs/models/*.yaml) or point at the right checkpoint."
        )


class HFTensorReader:
    """Lazy access to the tensors of an HF safetensors checkpoint (sharded or not), by name.

    Each rank reads only the tensors it needs, one at a time, so loading a 9B model on 8 ranks of
    a node does not hold 8 full copies in host memory. A block-FP8 release (config.json quantization_config)
    reads as its dequantized weights: each e4m3 weight times its weight_scale_inv, in float32 (the model's copy
    casts it once, to bf16 on a GPU trainer), as slime's fp8_cast_bf16 does.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        hf_dir = Path(hf_dir)
        self.fp8 = read_fp8_blocks(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: hf_dir / file for name, file in weight_map.items()}
        else:
            paths = sorted(hf_dir.glob("*.safetensors"))
            if not paths:
                raise FileNotFoundError(f"{hf_dir}: no *.safetensors files")
            self.file_of = {}
            for path in paths:
                with safe_open(str(path), framework="pt") as handle:
                    self.file_of.update({name: path for name in handle.keys()})  # noqa: SIM118 - not a dict
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def keys(self) -> list[str]:
        return list(self.file_of)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._read(name)
        if tensor.dtype != FP8_DTYPE or self.fp8 is None:
            return tensor
        if name + SCALE_SUFFIX not in self.file_of:
            raise KeyError(f"{name} is FP8 but its {name + SCALE_SUFFIX} is not in the checkpoint")
        return dequantize_blocks(tensor, self._read(name + SCALE_SUFFIX), self.fp8.block)

    def _read(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]


@torch.no_grad()
def load_hf_into_model(model: torch.nn.Module, hf_dir: str | Path, arch: ModelArchitecture,
                       *, tp_rank: int, tp_size: int, model_file: str | Path | None = None,
                       expert_tp_rank: int | None = None, expert_tp_size: int | None = None) -> None:
    """Copy an HF checkpoint into this rank's Megatron parameters (every parameter must be covered).
    Routed experts: only this rank's (expert parallelism), sharded over the expert-TP group (default:
    the TP rank and size, Megatron's default expert TP)."""
    check_architecture(arch, hf_dir, model_file)
    reader: HFTensorReader | Mapping[str, torch.Tensor] = HFTensorReader(hf_dir)
    own_reader = family(arch.family).hf_reader  # gpt-oss's fused experts, a VLM release's text tower
    if own_reader is not None:
        reader = own_reader(reader, load_hf_config(hf_dir))
    load_hf_state_into_model(model, reader, arch, tp_rank=tp_rank, tp_size=tp_size,
                             expert_tp_rank=expert_tp_rank, expert_tp_size=expert_tp_size)


@torch.no_grad()
def load_hf_state_into_model(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor] | HFTensorReader,
                             arch: ModelArchitecture, *, tp_rank: int, tp_size: int,
                             expert_tp_rank: int | None = None, expert_tp_size: int | None = None) -> None:
    """Like `load_hf_into_model` from a state dict or reader; one Megatron parameter at a time."""
    params = global_named_params(model)
    vocab_param = params.get(EMBEDDING, params.get(OUTPUT_LAYER))
    padded = vocab_param.shape[0] * tp_size if vocab_param is not None else None
    covered = set()
    for name, hf_names in stage_name_map(arch, stage_layout(model), with_tied_output=True):
        expert = hf_mapping.is_expert_param(name)
        if expert and name not in params:
            continue  # another EP rank's expert
        missing = [n for n in hf_names if n not in hf_state]
        if missing:
            raise KeyError(f"HF checkpoint lacks {', '.join(missing)} (needed for {name})")
        if name not in params:
            raise KeyError(f"the Megatron model has no parameter {name} (architecture file vs model spec?)")
        full = hf_mapping.to_megatron(name, [hf_state[n] for n in hf_names], arch, padded_vocab=padded)
        piece = (hf_mapping.shard(name, full, tp_rank if expert_tp_rank is None else expert_tp_rank,
                                  tp_size if expert_tp_size is None else expert_tp_size)
                 if expert else hf_mapping.shard(name, full, tp_rank, tp_size, arch))
        param = params[name]
        if piece.shape != param.shape:
            raise ValueError(f"{name}: HF gives shard {tuple(piece.shape)}, model has {tuple(param.shape)}")
        param.copy_(piece.to(param.dtype))
        covered.add(name)
    unset = set(params) - covered
    if unset:
        raise KeyError(f"parameters not covered by the HF mapping: {sorted(unset)}")
