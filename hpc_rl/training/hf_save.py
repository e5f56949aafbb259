"""HF checkpoints written during training (slime's --save-hf): a run's models usable without a conversion step.

Owns: writing the actor's weights, as the engines receive them (HF names and layouts, TP shards gathered by
`hpc_rl.weights.export`), into an HF directory with the config, tokenizer and generation files of
`checkpoint.hf_checkpoint` (`convert.write_hf_checkpoint`, the converter's writer). Collective over the trainer
world: the ranks of DP replica 0 (CP rank 0) gather, and TP rank 0 of each pipeline stage writes its stage's
tensors; with pipeline parallelism each stage writes its own safetensors file and global rank 0 indexes them
once every stage is done. The directory is written under `<name>.tmp` and renamed when complete, so a crash
never leaves a directory that looks whole. A LoRA actor (issue 33) is written as a PEFT adapter directory
(`lora.peft_files`: adapter_model.safetensors + adapter_config.json, the base named by `reference_dir`) and, with
lora.save_hf_merged (`merge_lora` callers: the checkpoint saves, not the adapter syncs), the merged model under
`merged/` (`lora.merge`: the base's HF tensors with W + alpha/r B@A).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.training.convert import copy_side_files, on_disk_state, write_hf_checkpoint
from hpc_rl.training.lora.attach import adapter_settings
from hpc_rl.training.lora.peft_files import save_peft_adapter
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.weights.export import export_hf_state_dict
from hpc_rl.config.fp8_scheme import Fp8Blocks
from hpc_rl.weights.fp8_blocks import quantize_named


def hf_output_dir(template: str, rollout_id: int) -> Path:
    """slime's rule: `save_hf.format(rollout_id=...)`."""
    return Path(template.format(rollout_id=rollout_id))


def _stage_file(pp_rank: int, pp_size: int) -> str:
    return f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"


def _index_stages(tmp: Path, pp_size: int, reference_dir: str | None, *, quantized: bool) -> None:
    from safetensors import safe_open

    weight_map, total = {}, 0
    for pp_rank in range(pp_size):
        name = _stage_file(pp_rank, pp_size)
        with safe_open(str(tmp / name), framework="pt") as shard:
            for key in shard.keys():
                weight_map[key] = name
                tensor = shard.get_slice(key)
                total += math.prod(tensor.get_shape()) * _itemsize(tensor.get_dtype())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    copy_side_files(reference_dir, tmp, quantized=quantized)


def _itemsize(safetensors_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(safetensors_dtype, 1)


def _write_merged(model: torch.nn.Module, arch: ModelArchitecture, adapter: dict[str, torch.Tensor], scale: float,
                  directory: Path, reference_dir: str | None, *, info: ParallelInfo,
                  tp_group: dist.ProcessGroup | None) -> None:
    """The base's HF tensors (TP shards gathered: every rank of the TP group takes part) with the adapter merged,
    written by TP rank 0 as an HF checkpoint (one pipeline stage: submit refuses --save-hf with LoRA and PP)."""
    from hpc_rl.training.lora.merge import merge_adapter

    base = {name: tensor.detach().to("cpu", copy=True) for name, tensor in export_hf_state_dict(model, arch, tp_group)}
    merged = merge_adapter(base, {k: v.cpu() for k, v in adapter.items()}, scale, where="the actor's adapter")
    if info.tp_rank == 0:
        write_hf_checkpoint(merged, directory, reference_dir)


def save_hf_checkpoint(model: torch.nn.Module, arch: ModelArchitecture, output_dir: str | Path, *,
                       reference_dir: str | None, info: ParallelInfo,
                       tp_group: dist.ProcessGroup | None, fp8: Fp8Blocks | None = None,
                       merge_lora: bool = False) -> Path:
    """Collective: every trainer rank calls it. Returns the finished directory. With `fp8` (the engines' checkpoint
    is a block-FP8 release) the weights it quantizes are written as its blocks, as slime writes them, and config.json
    keeps the reference's quantization_config; without, they are written unquantized and it is dropped. A LoRA actor:
    the PEFT adapter, and with `merge_lora` and its lora.save_hf_merged also the merged model under `merged/`."""
    output_dir = Path(output_dir)
    tmp = output_dir.with_name(output_dir.name + ".tmp")
    if info.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    lora = adapter_settings(model)
    if lora is not None and info.dp_rank == 0 and info.cp_rank == 0:
        adapter = save_peft_adapter(model, lora, tmp, base_model=reference_dir, write=info.tp_rank == 0)
        if merge_lora and lora.save_hf_merged:
            _write_merged(model, arch, adapter, lora.scaling, tmp / "merged", reference_dir, info=info,
                          tp_group=tp_group)
    elif info.dp_rank == 0 and info.cp_rank == 0:
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in export_hf_state_dict(model, arch, tp_group)}
        state = on_disk_state(state, arch, reference_dir)
        if fp8 is not None:
            state = dict(quantize_named(state.items(), fp8))
        if info.tp_rank == 0:
            if info.pp_size == 1:
                write_hf_checkpoint(state, tmp, reference_dir)
            else:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / _stage_file(info.pp_rank, info.pp_size)),
                          metadata={"format": "pt"})
    dist.barrier()
    if info.rank == 0:
        if info.pp_size > 1:
            _index_stages(tmp, info.pp_size, reference_dir, quantized=fp8 is not None)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        tmp.rename(output_dir)
    dist.barrier()
    return output_dir
