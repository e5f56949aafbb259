"""Qwen3.5's released checkpoints are vision-language (the text tower under `model.language_model.`): the config.json
check, the checkpoint reader, the export writer and the CPU engine's disk load take that layout, on tiny
checkpoints written by transformers' own VLM classes (hpc_rl.models.qwen3_next.tiny, `vlm=True`). The Megatron
round trip (HF VLM -> torch_dist -> HF VLM, every tensor bit-exact, the vision tower passed through) is
tests/integration/test_hybrid_models.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.config.model import ModelArchitecture, architecture_mismatches, load_hf_config
from hpc_rl.models.qwen3_next.tiny import make_tiny
from hpc_rl.models.qwen3_next.vlm_layout import TextTowerReader, text_tower_reader, vlm_state
from hpc_rl.models.registry import family
from hpc_rl.weights import hf_mapping

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoints(request, tmp_path_factory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, make_tiny(root / "vlm", family=request.param, vlm=True),
            make_tiny(root / "text", family=request.param))


def test_the_release_layout_is_what_transformers_writes(checkpoints) -> None:
    name, vlm, _ = checkpoints
    config = load_hf_config(vlm)
    assert config["model_type"] == name and "text_config" in config and "vision_config" in config
    names = set(load_file(str(vlm / "model.safetensors")))
    assert "model.language_model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert any(n.startswith("model.visual.") for n in names) and not any(n.startswith("model.layers.") for n in names)


def test_config_json_check_reads_the_text_config(checkpoints) -> None:
    name, vlm, _ = checkpoints
    arch = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{name}.yaml")
    assert architecture_mismatches(arch, load_hf_config(vlm)) == []
    wrong = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{name}.yaml")
    object.__setattr__(wrong, "hidden_size", 96)
    assert any("hidden_size" in line for line in architecture_mismatches(wrong, load_hf_config(vlm)))


def test_the_reader_serves_the_text_tower_under_the_text_models_names(checkpoints) -> None:
    name, vlm, text = checkpoints
    on_disk = load_file(str(vlm / "model.safetensors"))
    reader = family(name).hf_reader(on_disk, load_hf_config(vlm))
    assert isinstance(reader, TextTowerReader)
    arch = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{name}.yaml")
    needed = {n for _, hf_names in hf_mapping.name_map(arch) for n in hf_names}
    assert needed <= set(reader.keys())
    assert set(reader.keys()) == set(load_file(str(text / "model.safetensors")))  # the text model's names, no more
    assert reader.aside and all(n.startswith("model.visual.") for n in reader.aside)
    assert torch.equal(reader["model.layers.0.linear_attn.A_log"],
                       on_disk["model.language_model.layers.0.linear_attn.A_log"])
    plain = load_file(str(text / "model.safetensors"))
    assert text_tower_reader(plain, load_hf_config(text)) is plain  # a text checkpoint is read as is


def test_export_writes_the_reference_layout_and_passes_the_vision_tower_through(checkpoints, tmp_path) -> None:
    name, vlm, text = checkpoints
    on_disk = load_file(str(vlm / "model.safetensors"))
    reader = TextTowerReader(on_disk)
    trained = {n: reader[n] * 2 for n in reader.keys()}  # the text tower as the trainer exports it
    written = vlm_state(trained, None, vlm)
    assert set(written) == set(on_disk)
    for n, tensor in written.items():
        expected = on_disk[n] if n.startswith("model.visual.") else on_disk[n] * 2
        assert torch.equal(tensor, expected), n
    without_embedding = {n: t for n, t in trained.items() if n != "model.embed_tokens.weight"}  # a later PP stage
    assert not any(n.startswith("model.visual.") for n in vlm_state(without_embedding, None, vlm))
    assert vlm_state(trained, None, text) is trained  # a text reference: the text names
    assert vlm_state(trained, None, None) is trained


def test_the_cpu_engine_serves_the_text_model_and_loads_a_vlm_directory(checkpoints) -> None:
    from hpc_rl.engines.cpu.__main__ import load_model
    from hpc_rl.engines.cpu.weight_sync import load_from_disk

    _, vlm, _ = checkpoints
    model = load_model(str(vlm), "auto", "eager")
    assert type(model).__name__.endswith("ForCausalLM")  # the language model alone, under the text names
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(tokens).logits
    for parameter in model.parameters():
        parameter.data.zero_()
    load_from_disk(model, str(vlm), require_all=True)  # the VLM names, the vision tower left out
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, before)
