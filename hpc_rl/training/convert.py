"""Checkpoint conversion HF <-> Megatron torch_dist (the logic behind tools/convert_*.py).

Owns: HF safetensors -> torch_dist (run on any number of TP x PP x EP ranks; the result reshards on
load because torch_dist stores global tensors, layers and experts under global indices, and our vocab
padding does not depend on TP), and
torch_dist -> HF safetensors on one CPU process, with config.json, tokenizer and generation files
copied from the original HF directory (a LoRA checkpoint: the base, or the base with the adapter merged, and the
PEFT adapter apart). The architecture file is checked against config.json
before anything is converted. Bit-exact both ways: only reshuffles, no arithmetic. MTP layers travel like
any layer (HF layers num_layers + k); DeepSeek's per-MTP-layer embedding and head copies are written back
from the model's own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hpc_rl.config.lora import LoraConfig
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.deepseek_v3.hf_names import mtp_copies

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "tokenizer.model",
                "added_tokens.json")
MAX_SHARD_BYTES = 5 * 1024**3


def ensure_process_group() -> None:
    """Join torchrun's world, or make a one-rank gloo world when started as a plain script."""
    import torch.distributed as dist

    from hpc_rl.process.child_process import free_port

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())})


def hf_to_torch_dist(hf_dir: str | Path, model_file: str | Path, save_dir: str | Path, *,
                     tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, expert_parallel_size: int = 1,
                     expert_tensor_parallel_size: int | None = None, first_stage_layers: int | None = None,
                     last_stage_layers: int | None = None) -> Path:
    """Collective over the world's ranks: write `save_dir/iter_0000000` (+ tracker). Returns it.
    Each rank reads only its shards (its experts under EP); the remaining ranks are data-parallel."""
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.checkpoint import save_model_weights
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import init_parallel
    from hpc_rl.weights.hf_import import check_architecture, load_hf_into_model

    arch = ModelArchitecture.from_yaml(model_file)
    check_architecture(arch, hf_dir, model_file)
    ensure_process_group()
    training = TrainingConfig(tensor_model_parallel_size=tensor_parallel_size,
                              pipeline_model_parallel_size=pipeline_parallel_size,
                              expert_model_parallel_size=expert_parallel_size,
                              expert_tensor_parallel_size=expert_tensor_parallel_size,
                              decoder_first_pipeline_num_layers=first_stage_layers,
                              decoder_last_pipeline_num_layers=last_stage_layers)
    info = init_parallel(training, device="cpu")
    model = build_gpt_model(arch, training)
    load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size,
                           model_file=model_file, expert_tp_rank=info.expert_tp_rank,
                           expert_tp_size=info.expert_tp_size)
    return save_model_weights(save_dir, model, iteration=0)


def write_hf_checkpoint(state: dict, output_dir: str | Path, reference_dir: str | Path | None) -> Path:
    """Save tensors as safetensors (sharded with an index above 5 GiB) and copy the side files."""
    from safetensors.torch import save_file

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, shard in enumerate(shards, 1):
            filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(output_dir / filename), metadata={"format": "pt"})
            weight_map.update({name: filename for name in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (output_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    copy_side_files(reference_dir, output_dir,
                    quantized=any(str(tensor.dtype) == "torch.float8_e4m3fn" for tensor in state.values()))
    return output_dir


def copy_side_files(reference_dir: str | Path | None, output_dir: str | Path, *, quantized: bool = False) -> None:
    """config.json, tokenizer and generation files of the original HF directory (`COPIED_FILES`) into output_dir.
    Unless the weights written are `quantized` (FP8 blocks), config.json loses the reference's quantization_config
    (an FP8 release's): the directory then holds the trained weights unquantized, and says so."""
    if reference_dir is None:
        return
    for name in COPIED_FILES:
        if (Path(reference_dir) / name).is_file():
            shutil.copy2(Path(reference_dir) / name, Path(output_dir) / name)
    config_path = Path(output_dir) / "config.json"
    if not quantized and config_path.is_file():
        config = json.loads(config_path.read_text())
        if config.pop("quantization_config", None) is not None:
            config_path.write_text(json.dumps(config, indent=2) + "\n")


def torch_dist_to_hf(load_dir: str | Path, model_file: str | Path, output_dir: str | Path, *,
                     hf_reference: str | Path | None = None, lora: LoraConfig | None = None,
                     adapter_out: str | Path | None = None, merge_lora: bool = False) -> Path:
    """One CPU process: load torch_dist (saved at any TP/PP) at TP=1, PP=1 and write an HF directory. A LoRA run's
    checkpoint (`lora`: its settings, which put the adapters on the model before loading): the base is written, or
    with `merge_lora` the base with the adapter merged (`lora.merge`), and `adapter_out` gets the PEFT adapter."""
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.checkpoint import load_model_weights
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import init_parallel
    from hpc_rl.weights.export import export_hf_state_dict
    from hpc_rl.weights.hf_import import check_architecture

    arch = ModelArchitecture.from_yaml(model_file)
    if hf_reference is not None:
        check_architecture(arch, hf_reference, model_file)
    ensure_process_group()
    init_parallel(TrainingConfig(), device="cpu")
    model = build_gpt_model(arch, TrainingConfig())
    if lora is not None and lora.enabled:
        from hpc_rl.training.lora.attach import apply_lora

        apply_lora(model, lora)
    elif adapter_out is not None or merge_lora:
        raise ValueError("an adapter to export or merge needs the run's LoRA settings (--lora-rank, --target-modules)")
    load_model_weights(load_dir, model)
    state = {name: tensor.clone() for name, tensor in export_hf_state_dict(model, arch)}
    if lora is not None and lora.enabled:
        from hpc_rl.training.lora.merge import merge_adapter
        from hpc_rl.training.lora.peft_files import save_peft_adapter

        adapter = save_peft_adapter(model, lora, adapter_out or "", base_model=str(hf_reference or "") or None,
                                    write=adapter_out is not None)
        if merge_lora:
            state = merge_adapter(state, adapter, lora.scaling, where=str(load_dir))
    for copy, source in mtp_copies(arch):  # DeepSeek's per-MTP-layer embedding / head copies
        state[copy] = state[source].clone()
    state = on_disk_state(state, arch, hf_reference)
    return write_hf_checkpoint(state, output_dir, hf_reference)


def merge_adapter_dir(base_dir: str | Path, adapter_dir: str | Path, output_dir: str | Path) -> Path:
    """HF base + PEFT LoRA adapter -> a merged HF directory (side files copied from the base; `lora.merge`)."""
    from hpc_rl.training.lora.merge import merge_adapter, read_adapter, read_hf_weights

    adapter, scale = read_adapter(adapter_dir)
    merged = merge_adapter(read_hf_weights(base_dir), adapter, scale, where=str(adapter_dir))
    return write_hf_checkpoint(merged, output_dir, base_dir)


def on_disk_state(state: dict, arch: ModelArchitecture, reference_dir: str | Path | None) -> dict:
    """The exported HF tensors as the family writes them to disk (its `hf_export` hook: gpt-oss's experts fused as
    released, a VLM release's text tower under its prefix with the vision tower passed through); else unchanged."""
    from hpc_rl.models.registry import family

    own_export = family(arch.family).hf_export
    return state if own_export is None else own_export(state, arch, None if reference_dir is None
                                                       else Path(reference_dir))
