"""Qwen3-VL's pure parts against transformers: M-RoPE position ids (`get_rope_index`), the interleaved channel
layout, the fused-expert reader and writer, the HF name rows (every tensor of the tiny checkpoints, the vision tower
included) and the tiny checkpoints' processor files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_rl.models.qwen3_vl.layers_rope import batch_mrope_positions, interleaved_channel_source, mrope_positions

IMAGE = 26
GRIDS = torch.tensor([[1, 4, 4], [1, 2, 6], [1, 2, 2]])  # 4, 3 and 1 tokens at merge 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hpc_rl.models.qwen3_vl.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny_vl")
    return {family: make_tiny(root / family, family=family) for family in ("qwen3_vl", "qwen3_vl_moe")}


def _hf_rope_index(rows: list[list[int]], grids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    config = Qwen3VLConfig(image_token_id=IMAGE, vision_config={"spatial_merge_size": 2})
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    positions, _ = Qwen3VLModel.get_rope_index(type("Stub", (), {"config": config, "get_vision_position_ids":
                                                                 Qwen3VLModel.get_vision_position_ids})(),
                                               ids, (ids == IMAGE).int(), image_grid_thw=grids, attention_mask=mask)
    return positions


def test_mrope_positions_equal_transformers_padded_and_packed() -> None:
    rows = [[3, 9, 24] + [IMAGE] * 4 + [25, 14, 15, 4], [3, 24] + [IMAGE] * 3 + [25, 7, 24, IMAGE, 25, 8, 8, 8, 9]]
    expected = _hf_rope_index(rows, GRIDS)
    width = max(map(len, rows))
    padded = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    ours = batch_mrope_positions(padded, IMAGE, GRIDS, 2)
    for index, row in enumerate(rows):
        assert torch.equal(ours[:, index, : len(row)], expected[:, index, : len(row)])
    packed = torch.tensor([rows[0] + rows[1]])
    cu = torch.tensor([0, len(rows[0]), len(rows[0]) + len(rows[1])])
    ours = batch_mrope_positions(packed, IMAGE, GRIDS, 2, cu_seqlens=cu)
    assert torch.equal(ours[:, 0, : len(rows[0])], expected[:, 0, : len(rows[0])])
    assert torch.equal(ours[:, 0, len(rows[0]):], expected[:, 1, : len(rows[1])])
    assert ours[1, 0, 3:7].tolist() == [3, 3, 4, 4] and ours[2, 0, 3:7].tolist() == [3, 4, 3, 4]


def test_mrope_positions_refuse_mismatched_images() -> None:
    with pytest.raises(ValueError, match="needs 4 consecutive image pad tokens"):
        mrope_positions([1, IMAGE, IMAGE, 2], IMAGE, [[1, 4, 4]], 2)
    with pytest.raises(ValueError, match="image_grid_thw has 2 image"):
        batch_mrope_positions(torch.tensor([[1] + [IMAGE] * 4]), IMAGE, GRIDS[:2], 2)


def test_interleaved_channels_equal_transformers_recomposition() -> None:
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    section = [24, 20, 20]
    rotary = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": section}))
    marked = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 1, 64).clone()  # row r's channels hold r
    recomposed = rotary.recomposition_frequencies(marked)[0, 0, :64]
    assert torch.equal(recomposed.long(), interleaved_channel_source(section))
    assert interleaved_channel_source(section).bincount().tolist() == section


def test_fused_expert_reader_and_writer_invert_each_other(tiny: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.models.qwen3_vl.names import FusedExpertReader, architecture_fields_from_hf, fused_state

    hf_dir = tiny["qwen3_vl_moe"]
    arch = ModelArchitecture(**architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text())))
    released = load_file(str(hf_dir / "model.safetensors"))
    per_expert = {name: FusedExpertReader(released, arch)[name] for name in FusedExpertReader(released, arch).keys()}
    fused = released["model.language_model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    assert torch.equal(per_expert["model.language_model.layers.1.mlp.experts.2.up_proj.weight"], fused[2, :, 16:].t())
    again = fused_state(per_expert, arch)
    assert set(again) == set(released) and all(torch.equal(again[n], released[n]) for n in released)
    transformers_layout = {n: (t.transpose(1, 2) if ".experts." in n else t) for n, t in released.items()}
    reader = FusedExpertReader(transformers_layout, arch)
    assert all(torch.equal(reader[n], per_expert[n]) for n in per_expert)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_name_map_covers_every_checkpoint_tensor(family: str, tiny: dict[str, Path]) -> None:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.models.qwen3_vl.names import FusedExpertReader, architecture_fields_from_hf
    from hpc_rl.weights import hf_mapping
    from hpc_rl.weights.hf_import import HFTensorReader

    hf_dir = tiny[family]
    arch = ModelArchitecture(**architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text())))
    reader = HFTensorReader(hf_dir)
    names = set(FusedExpertReader(reader, arch).keys() if arch.is_moe else reader.keys())
    mapped = [hf for _, hfs in hf_mapping.name_map(arch) for hf in hfs]
    assert sorted(mapped) == sorted(names)
    assert hf_mapping.tp_split("vision_model.blocks.0.mlp.linear_fc1.weight").dim is None
    assert hf_mapping.to_hf("vision_model.merger.linear_fc1.weight", torch.ones(2), arch)[0][0] == \
        "model.visual.merger.linear_fc1.weight"


def test_tiny_checkpoint_images_give_few_tokens(tiny: dict[str, Path]) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    hf_dir = tiny["qwen3_vl"]
    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config["image_token_id"]
    processor = AutoImageProcessor.from_pretrained(hf_dir)
    grids = processor(images=[Image.new("RGB", (32, 32)), Image.new("RGB", (16, 16))])["image_grid_thw"]
    assert [int(g.prod()) // 4 for g in torch.as_tensor(grids)] == [4, 1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": "copy 1"}]}],
                                         tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|> <|image_pad|> <|vision_end|> copy 1" in text


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_architecture_from_config_json_passes_the_shared_check(family: str, tiny: dict[str, Path]) -> None:
    from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
    from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf

    hf = json.loads((tiny[family] / "config.json").read_text())
    arch = ModelArchitecture(**architecture_fields_from_hf(hf))
    assert architecture_mismatches(arch, hf) == []
    assert arch.vision_config["mrope_section"] == [4, 2, 2] and arch.vision_config["deepstack_visual_indexes"] == [0, 1]
    wrong = ModelArchitecture(**{**architecture_fields_from_hf(hf), "num_layers": 3})
    assert any(line.startswith("num_layers:") for line in architecture_mismatches(wrong, hf))


def test_train_batch_images_cross_the_wire_and_concatenate_per_micro_batch() -> None:
    import numpy as np

    from hpc_rl.training.train_batch import TrainBatch

    def images(grids: list[list[int]]) -> dict:
        rows = sum(t * h * w for t, h, w in grids)
        return {"pixel_values": np.arange(rows * 6, dtype=np.float32).reshape(rows, 6) + len(grids),
                "image_grid_thw": np.array(grids, dtype=np.int64)}

    batch = TrainBatch(tokens=[[1, 2, 3]] * 3, response_lengths=[1] * 3, loss_masks=[[1]] * 3, rewards=[0.0] * 3,
                       images=[images([[1, 2, 2]]), None, images([[1, 4, 4], [1, 2, 2]])])
    again = TrainBatch.from_arrays(batch.to_arrays())
    assert again.images[1] is None
    for ours, theirs in zip((again.images[0], again.images[2]), (batch.images[0], batch.images[2])):
        assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
    joined = again.images_of([2, 1, 0])
    assert joined["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2], [1, 2, 2]]
    assert joined["pixel_values"].shape == (24, 6) and joined["pixel_values"][0, 0].item() == 2.0
    assert again.images_of([1]) is None and again.select([2, 1]).images[1] is None
    with pytest.raises(ValueError, match="sample 0: images need pixel_values"):
        TrainBatch(tokens=[[1, 2]], response_lengths=[1], loss_masks=[[1]], rewards=[0.0],
                   images=[{"pixel_values": np.zeros((3, 6)), "image_grid_thw": np.array([[1, 2, 2]])}])


def test_slime_qwen3_vl_30b_model_flags_with_its_config_json_build_the_vl_family() -> None:
    """slime's scripts/models/qwen3-vl-30b-a3b.sh describes the text model with Qwen3-30B-A3B's Megatron flags (its
    rotary base 5e6); with the release's config.json the architecture is qwen3_vl_moe with the vision tower."""
    from hpc_rl.config.megatron_model import architecture_from_flags
    from hpc_rl.config.model import architecture_mismatches
    from hpc_rl.config.settings_sources import MEGATRON_PREFIX, cli_settings_and_problems
    from hpc_rl.models.qwen3_vl.releases import RELEASES
    from tests.unit.slime_lines import flags_of

    argv = [*flags_of("qwen3_30B_A3B_model_args.txt")]
    argv[argv.index("--rotary-base") + 1] = "5000000"
    settings, problems = cli_settings_and_problems(argv)
    flags = {s.path[len(MEGATRON_PREFIX):]: s.value for s in settings if s.path.startswith(MEGATRON_PREFIX)}
    hf = RELEASES["Qwen3-VL-30B-A3B-Instruct"]
    arch, problems = architecture_from_flags(flags, hf_config=hf)
    assert problems == [] and arch is not None
    assert arch.family == "qwen3_vl_moe" and arch.vision_config["depth"] == 27
    assert architecture_mismatches(arch, hf) == []
    _, problems = architecture_from_flags(flags, hf_config=RELEASES["Qwen3-VL-8B-Instruct"])
    assert any("qwen3_vl checkpoint but the model flags describe a qwen3_moe" in p for p in problems)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_tiny_model_files_describe_the_tiny_checkpoints(family: str, tiny: dict[str, Path]) -> None:
    from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
    from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf

    model_file = Path(__file__).resolve().parents[2] / "configs" / "models" / f"tiny_{family}.yaml"
    hf = json.loads((tiny[family] / "config.json").read_text())
    arch = ModelArchitecture.from_yaml(model_file)
    assert arch.to_dict() == ModelArchitecture(**architecture_fields_from_hf(hf), make_vocab_size_divisible_by=8).to_dict()
    assert architecture_mismatches(arch, hf) == []


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_a_generated_image_pad_token_is_text_for_the_model(layout: str) -> None:
    """The micro-batch tells the model where the images are (`vision_input_ids`: the responses' tokens -1), so an
    image pad token the policy generated stays text (the engine's decode embedded it as text) instead of taking the
    next sample's image."""
    from hpc_rl.training.micro_batches import build_microbatch

    pad, start, end = 26, 24, 25
    tokens = [[3, start, pad, end, 7, pad, 8], [3, start, pad, end, 7, 9]]  # sample 0 generated a pad (response 3)
    images = {"pixel_values": torch.zeros(8, 6), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}
    micro = build_microbatch(tokens, [3, 2], [0, 1], qkv_format=layout, images=images)
    vision = micro.images["vision_input_ids"]
    assert vision.shape == micro.tokens.shape
    assert (vision == pad).sum().item() == 2 and (micro.tokens == pad).sum().item() == 3
    cu = micro.packed_seq_params.cu_seqlens_q if micro.packed else None
    positions = batch_mrope_positions(vision, pad, images["image_grid_thw"], 2, cu_seqlens=cu)
    assert positions.shape == (3, *micro.tokens.shape)
    with pytest.raises(ValueError, match="image pad token at position"):
        batch_mrope_positions(micro.tokens, pad, images["image_grid_thw"], 2, cu_seqlens=cu)
    assert build_microbatch(tokens, [3, 2], [0, 1], qkv_format=layout).images is None  # text: nothing new
