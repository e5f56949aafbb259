"""gpt-oss's weight sync sends each layer's experts fused, as the HF release and SGLang's loader have them (no
processes: the plan and the fusion as pure functions on the tiny checkpoint, the CPU engine's load by the fused
names, submit's remaining refusal). The real sender at EP1 / TP2 / EP2 on gloo ranks: tests/integration/
test_gpt_oss_model.py."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.gpt_oss.architecture import architecture_fields_from_hf
from hpc_rl.models.gpt_oss.checkpoint import PerExpertReader
from hpc_rl.models.registry import family
from hpc_rl.weights import hf_mapping
from hpc_rl.weights.engine_fusion import fuse_named, fusion_of, group_plan_entries
from hpc_rl.weights.hf_import import HFTensorReader


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpc_rl.models.gpt_oss.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("gpt_oss") / "tiny")


def _arch(hf_dir: Path) -> ModelArchitecture:
    return ModelArchitecture(**architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text())))


def _per_expert_entries(hf_dir: Path) -> tuple[list, dict[str, torch.Tensor]]:
    """The sync plan's entries (name-map order) and the per-expert tensors export_param yields for them."""
    reader = PerExpertReader(HFTensorReader(hf_dir))
    tensors = {name: reader[name] for name in reader.keys()}
    entries = [(megatron, [(hf, tuple(tensors[hf].shape)) for hf in hf_names])
               for megatron, hf_names in hf_mapping.name_map(_arch(hf_dir))]
    return entries, tensors


def test_sync_plans_and_sends_the_releases_fused_experts_bit_exact(tiny: Path) -> None:
    release = load_file(str(tiny / "model.safetensors"))
    fusion = fusion_of(_arch(tiny))
    assert fusion is family("gpt_oss").fuse_for_engine is not None
    entries, tensors = _per_expert_entries(tiny)
    planned = group_plan_entries(entries, fusion)
    names = [name for _, rows in planned for name, _ in rows]
    assert sorted(names) == sorted(release), set(names) ^ set(release)
    assert all(tuple(release[name].shape) == shape for _, rows in planned for name, shape in rows)
    experts = [sources for sources, rows in planned if rows[0][0].endswith("experts.gate_up_proj")]
    assert len(experts) == 2 and all(len(sources) == 4 * 4 for sources in experts)  # 4 experts x fc1/fc2 w+b
    named = [(hf, tensors[hf]) for _, hf_names in hf_mapping.name_map(_arch(tiny)) for hf in hf_names]
    sent = fuse_named(named, fusion)
    assert [name for name, _ in sent] == names
    unequal = [name for name, tensor in sent if not (tensor.dtype == release[name].dtype
                                                       and torch.equal(tensor, release[name]))]
    assert not unequal, f"fused tensors differ from the release's: {unequal}"


def test_a_layers_experts_stay_one_bucket_and_must_be_adjacent(tiny: Path) -> None:
    from hpc_rl.weights.sender import _plan

    fusion = fusion_of(_arch(tiny))
    entries, _ = _per_expert_entries(tiny)
    plan = _plan(group_plan_entries(entries, fusion), torch.bfloat16, bucket_bytes=64)  # smaller than any expert
    layer0 = [meta for meta in plan if "model.layers.0.mlp.experts.gate_up_proj" in meta.names]
    assert len(layer0) == 1 and len(layer0[0].megatron_names) == 16
    assert sorted(layer0[0].names) == sorted(f"model.layers.0.mlp.experts.{n}" for n in (
        "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
    expert = [i for i, (_, rows) in enumerate(entries) if ".experts.0." in rows[0][0]][0]
    shuffled = entries[:expert] + [entries[expert + 2], entries[expert]] + entries[expert + 1:expert + 2] + \
        entries[expert + 3:]
    assert group_plan_entries(shuffled, fusion)  # reordered inside the layer: still adjacent
    split = entries[:expert] + [entries[expert]] + [entries[0]] + entries[expert + 1:]
    with pytest.raises(ValueError, match="not adjacent"):
        group_plan_entries(split, fusion)
    with pytest.raises(ValueError, match="needs every expert"):
        fusion.fuse("model.layers.0.mlp.experts", [(n, t) for n, t in _per_expert_entries(tiny)[1].items()
                                                   if n.startswith("model.layers.0.mlp.experts.1.")])


def test_families_without_the_hook_sync_as_mapped() -> None:
    entries = [("a", [("a.q", (4, 4))]), ("b", [("b", (2,))])]
    assert group_plan_entries(entries, None) == [(["a"], [("a.q", (4, 4))]), (["b"], [("b", (2,))])]
    named = [("a.q", torch.zeros(4, 4))]
    assert fuse_named(named, None) is named
    assert family("qwen3_moe").fuse_for_engine is None


def test_cpu_engine_loads_the_fused_names_a_sync_sends_and_refuses_what_sglang_skips(tiny: Path) -> None:
    from transformers import GptOssForCausalLM

    from hpc_rl.engines.cpu.weight_sync import load_named, named_tensors

    model = GptOssForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    prefix = "model.layers.1.mlp.experts"
    generator = torch.Generator().manual_seed(5)
    new = {f"{prefix}.{part}": torch.randn(tuple(named_tensors(model)[f"{prefix}.{part}"].shape), generator=generator)
           for part in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    load_named(model, list(new.items()), update=True)
    experts = model.model.layers[1].mlp.experts
    for name, tensor in new.items():
        assert torch.equal(getattr(experts, name.rsplit(".", 1)[-1]).detach(), tensor), name
    per_expert = [(f"{prefix}.0.down_proj.bias", torch.zeros(64))]
    load_named(model, per_expert)  # a checkpoint read by name may still hold per-expert tensors
    with pytest.raises(ValueError, match="skips these names in a weight update"):  # as SGLang's loader would
        load_named(model, per_expert, update=True)


def test_submit_takes_gpt_oss_over_broadcast_and_refuses_an_mxfp4_engine(tmp_path: Path) -> None:
    from hpc_rl.config import load_config
    from hpc_rl.config.validation import collect_problems
    from tests.unit.test_gpt_oss import FIXED_LINE, HF_20B

    line = shlex.split(FIXED_LINE) + ["--expert-tensor-parallel-size", "1"]
    for transport in (["--update-weight-transport", "nccl"], ["--colocate"]):
        found = {p.where for p in collect_problems(load_config([], line + transport + [
            "--hf-checkpoint", "/nonexistent/gpt-oss"]), check_files=False)}
        assert not found & {"rollout.update_weight_transport", "checkpoint.hf_checkpoint"}, (transport, found)
    (tmp_path / "config.json").write_text(json.dumps(HF_20B))
    found = {p.where: p.message for p in collect_problems(load_config([], line + ["--hf-checkpoint", str(tmp_path)]),
                                                          check_files=False)}
    assert "reads experts in an update only as MXFP4 _blocks" in found["checkpoint.hf_checkpoint"]


def test_memory_plan_counts_a_layers_fused_experts_as_the_smallest_bucket() -> None:
    from hpc_rl.config import load_config
    from hpc_rl.config.memory_plan import plan_memory
    from hpc_rl.config.model_checks import run_architecture
    from tests.unit.test_gpt_oss import FIXED_LINE

    config = load_config([], shlex.split(FIXED_LINE) + ["--hf-checkpoint", "/nonexistent/gpt-oss"])
    arch = run_architecture(config)
    layer = 32 * (3 * 2880 * 2880 + 2 * 2880 + 2880) * 2  # gpt-oss-20b: 32 experts, bf16
    assert family("gpt_oss").fuse_for_engine.largest_group_bytes(arch, 2) == layer
    phases = {phase.name: dict(phase.parts) for phase in plan_memory(config, arch).phases}
    assert layer > config.rollout.update_weight_buffer_size
    assert phases["trainer, weight push"]["bucket"] == layer
    assert phases["trainer, weight push"]["a layer's experts, gathered and fused"] == 2 * layer
    assert phases["engine, receiving a bucket"]["bucket"] == layer


def test_submit_refuses_sglang_expert_parallelism_for_gpt_oss() -> None:
    """SGLang 0.5.23 loads gpt-oss's bf16 experts fused and narrows them by MoE TP only (hpc_rl.models.gpt_oss.
    serving): an engine with EP > 1 cannot load them, so the submit names the option; EP 1 passes."""
    from hpc_rl.config import load_config
    from hpc_rl.config.validation import collect_problems
    from tests.unit.test_gpt_oss import FIXED_LINE

    line = shlex.split(FIXED_LINE) + ["--expert-tensor-parallel-size", "1", "--hf-checkpoint", "/nonexistent/gpt-oss",
                                      "--rollout-num-gpus-per-engine", "2"]
    found = {p.where: p.message for p in collect_problems(load_config([], line + ["--sglang-ep-size", "2"]),
                                                          check_files=False)}
    assert "never by the EP rank" in found["sglang.extra_args.ep_size"], found
    found = {p.where for p in collect_problems(load_config([], line + ["--sglang-ep-size", "1"]), check_files=False)}
    assert "sglang.extra_args.ep_size" not in found


def test_shared_modules_ask_the_registry_not_the_family_name() -> None:
    """The gpt-oss specifics of shared modules are the family's registry capabilities (hf_reader, hf_export,
    expert_hf_suffixes, yarn_on_gqa, megatron_flags, sglang_problems): no shared module tests for its name."""
    root = Path(__file__).resolve().parents[2] / "hpc_rl"
    named = [str(path.relative_to(root)) for path in root.rglob("*.py")
             if "models/gpt_oss" not in str(path) and '"gpt_oss"' in path.read_text()]
    assert named == []
    assert family("gpt_oss").yarn_on_gqa and family("gpt_oss").megatron_flags.given({"quick_geglu": True})
