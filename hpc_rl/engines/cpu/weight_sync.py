"""Weight loading for the CPU engine: by HF name, from a broadcast, from shared memory, from disk.

Owns: the engine's weight-update groups (joined through `hpc_rl.weights.process_group`), receiving
one bucket from trainer rank 0 (per tensor, or one `flattened_bucket` laid out by
`hpc_rl.weights.bucket_layout`), reading a colocated share from shared memory
(`hpc_rl.weights.colocated`), refusing in an update the unfused tensors SGLang would skip (gpt-oss's per-expert
names: `refuse_unfused_update`), dequantizing a block-FP8 checkpoint's weights (`hpc_rl.weights.fp8_blocks`:
its release at load, the trainer's FP8 syncs through `Fp8Intake`), and copying tensors into the model by HF
parameter name (the
checkpoint's names, also for MoE experts that transformers keeps fused in memory, and for the MTP layers
SGLang's NextN draft holds: `nextn_draft`). The
scheduler decides when these run (between decode steps); this module never touches requests.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_rl.engines.cpu.faults import (EXIT_IN_GROUP_INIT, EXIT_IN_WEIGHT_SYNC, STOP_IN_WEIGHT_SYNC,
                                     fail_here_if_asked)
from hpc_rl.engines.cpu.nextn_draft import draft_tensors, ignored_update
from hpc_rl.weights.bucket_layout import compute_layout, dtype_from_name, unpack_bucket
from hpc_rl.weights.colocated import read_shared_memory_bucket
from hpc_rl.weights.device_identity import refuse_invisible_device
from hpc_rl.config.fp8_scheme import read_fp8_blocks
from hpc_rl.weights.fp8_blocks import dequantize_named
from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group


def fused_expert_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each routed expert's weights under the checkpoint's names, as views into transformers 5's fused
    expert tensors (Qwen3-MoE, GLM-4.5 and the other `*Experts` modules): `<prefix>.gate_up_proj`
    [E, 2I, H] holds expert K's `<prefix>.K.gate_proj.weight` in rows [K, :I] and its `up_proj` in
    [K, I:]; `<prefix>.down_proj` [E, H, I] holds `<prefix>.K.down_proj.weight` at [K] (transformers'
    own checkpoint conversion: MergeModulelist(dim=0), Concatenate(dim=1)); gpt-oss's GptOssExperts
    ([E, H, 2I] interleaved, with biases) by `hpc_rl.models.gpt_oss.checkpoint.expert_views` (its weight syncs
    send the module's own fused names, gate_up_proj ...: plain parameters here). Writing a view writes the model's
    tensor, so weight updates by HF name reach fused experts like any other parameter."""
    views: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if type(module).__name__ == "GptOssExperts":  # [E, H, 2I], gate/up interleaved, with biases
            from hpc_rl.models.gpt_oss.checkpoint import expert_views

            views.update(expert_views(prefix, module))
            continue
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
            continue
        inner = gate_up.shape[1] // 2
        for expert in range(gate_up.shape[0]):
            views[f"{prefix}.{expert}.gate_proj.weight"] = gate_up[expert, :inner]
            views[f"{prefix}.{expert}.up_proj.weight"] = gate_up[expert, inner:]
            views[f"{prefix}.{expert}.down_proj.weight"] = down[expert]
    return views


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by HF name, tied aliases included (e.g. `lm_head.weight`), and fused
    experts under their per-expert checkpoint names (`fused_expert_views`)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    tensors.update(fused_expert_views(model))
    tensors.update(draft_tensors(model))  # a DeepSeek-V3 / GLM-4.7-Flash checkpoint's MTP layers (nextn_draft)
    return tensors


def refuse_unfused_update(model: torch.nn.Module, names: list[str]) -> None:
    """A weight update (broadcast or colocated) of a family whose engine reads some tensors only fused (the
    registry's `fuse_for_engine`: gpt-oss's experts) must send them fused: SGLang 0.5.23's gpt-oss loader skips a
    per-expert name without an error (`hpc_rl.models.gpt_oss.engine_sync`); this engine refuses it instead."""
    from hpc_rl.models.registry import family_for_hf_model_type

    found = family_for_hf_model_type(getattr(getattr(model, "config", None), "model_type", None))
    fusion = found.fuse_for_engine if found is not None else None
    unfused = [name for name in names if fusion is not None and fusion.group_of(name) is not None]
    if unfused:
        raise ValueError(f"{unfused[:3]}: SGLang's {found.name} loader skips these names in a weight update without "
                         f"an error; it reads them only fused ({fusion.group_of(unfused[0])}.*): the trainer must "
                         f"send each group fused (hpc_rl.weights.engine_fusion)")


@torch.no_grad()
def load_named(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]], *, update: bool = False) -> None:
    """Copy each tensor into the model's tensor of that name (dtype converted); all names checked first. An
    `update` (a weight sync's tensors) also refuses what SGLang would skip (`refuse_unfused_update`)."""
    if update:
        refuse_unfused_update(model, [name for name, _ in weights])
    targets = named_tensors(model)
    weights = [(name, tensor) for name, tensor in weights if not ignored_update(model, name)]
    unknown = [name for name, _ in weights if name not in targets]
    if unknown:
        raise KeyError(f"unknown parameter names (not in the model): {unknown[:5]}")
    for name, tensor in weights:
        target = targets[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
    for name, tensor in weights:
        targets[name].copy_(tensor)


def read_tensor_share(payload: str) -> list[tuple[str, torch.Tensor]]:
    """This engine's share of an `/update_weights_from_tensor` body: a shared-memory descriptor (the
    CPU twin of SGLang's CUDA IPC handles; a pickle is refused with PayloadError, a ValueError). A share
    from a GPU this engine's step cannot see raises InvisibleDeviceError: SGLang's scheduler dies on it."""
    return read_shared_memory_bucket(payload, check_device=refuse_invisible_device)


def text_tower_weights(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]
                       ) -> list[tuple[str, torch.Tensor]]:
    """A vision-language checkpoint's tensors (Qwen3.5's releases, an --save-hf of one) for the text model this
    engine serves (transformers' AutoModelForCausalLM builds the language model alone): `model.language_model.X`
    as `model.X`, the vision tower and MTP tensors left out (hpc_rl.models.qwen3_next.vlm_layout); others as is."""
    from hpc_rl.models.qwen3_next.vlm_layout import TEXT_PREFIX, is_vlm_layout, text_name

    names = [name for name, _ in weights]
    if not is_vlm_layout(names) or any(name.startswith(TEXT_PREFIX) for name, _ in model.named_parameters()):
        return weights
    return [(text, tensor) for name, tensor in weights if (text := text_name(name)) is not None]


def load_from_disk(model: torch.nn.Module, model_path: str, *, require_all: bool = False) -> None:
    """Load every safetensors file of an HF checkpoint directory into the model by name; with
    `require_all`, every parameter of the model must be in it (a model built without initial values)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    weights: list[tuple[str, torch.Tensor]] = []
    for file in files:
        weights.extend(load_file(str(file)).items())
    weights = text_tower_weights(model, weights)
    fp8 = read_fp8_blocks(model_path)
    if fp8 is not None:  # an FP8 release: e4m3 weights + weight_scale_inv, served dequantized (SGLang's blocks)
        weights = dequantize_named(weights, fp8.block, source=model_path)
    if require_all:
        names = {name for name, _ in weights}
        views = fused_expert_views(model)  # a fused experts tensor is covered by all its per-expert names
        fused = {view.rsplit(".", 3)[0] for view in views}
        covered = {f"{prefix}.{part}" for prefix in fused for part in ("gate_up_proj", "down_proj")
                   if all(view in names for view in views if view.startswith(prefix + "."))}
        missing = [name for name, _ in model.named_parameters() if name not in names and name not in covered]
        if missing:
            raise KeyError(f"{model_path}: the checkpoint has no {', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''}")
    load_named(model, weights)


class WeightUpdateGroups:
    """The live weight-update groups of this engine, by name (one live group per name, as SGLang)."""

    def __init__(self) -> None:
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()

    def init(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str) -> None:
        """Join as rank `rank_offset` (an engine of TP 1); blocks until all ranks joined."""
        fail_here_if_asked(EXIT_IN_GROUP_INIT)
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"weight update group {group_name!r} already exists: destroy it first")
        if backend == "nccl":
            backend = "gloo"  # the CPU engine has no NCCL; the trainer side must use gloo too
        group = init_weight_update_group(
            master_address=master_address, master_port=master_port, rank=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
        )
        with self._lock:
            self._groups[group_name] = group

    def get(self, group_name: str) -> dist.ProcessGroup:
        with self._lock:
            if group_name not in self._groups:
                raise KeyError(f"weight update group {group_name!r} does not exist: call /init_weights_update_group")
            return self._groups[group_name]

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise KeyError(f"weight update group {group_name!r} does not exist")
        destroy_weight_update_group(group)


def receive_bucket(
    group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
    load_format: str | None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast by rank 0: one tensor per name, or one flattened uint8 tensor."""
    fail_here_if_asked(EXIT_IN_WEIGHT_SYNC, STOP_IN_WEIGHT_SYNC)
    if load_format == "flattened_bucket":
        layout = compute_layout(names, dtypes, shapes)
        buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=group)
        return unpack_bucket(buffer, layout)
    if load_format not in (None, "auto", "direct"):
        raise ValueError(f"load_format {load_format!r} is not supported (null or 'flattened_bucket')")
    received = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(tuple(shape), dtype=dtype_from_name(dtype))
        dist.broadcast(tensor, src=0, group=group)
        received.append((name, tensor))
    return received
