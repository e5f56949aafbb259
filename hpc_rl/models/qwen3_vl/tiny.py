"""Tiny random Qwen3-VL checkpoints (dense and MoE), written by transformers' own classes, with the processor files.

Owns: `make_tiny(output_dir, family=...)`: a `Qwen3VLForConditionalGeneration` (qwen3_vl) or
`Qwen3VLMoeForConditionalGeneration` (qwen3_vl_moe) whose text model is the tiny Qwen3 (hidden 64, 4 heads of 16 over
2 KV heads, `mrope_section` [4, 2, 2] interleaved as Qwen3-VL's) and whose vision tower is 2 blocks of hidden 32
(2 heads), patch 8, spatial merge 2, temporal patch 2, a 4x4 learned position grid, out_hidden 64 and deepstack from
both blocks (so LM layers 0 and 1 receive deepstack features). A 32x32 image is a 4x4 patch grid: 4 image tokens; a
16x16 one gives 1. The tokenizer is the tiny word-level one plus Qwen's vision tokens and the tiny visual task's
words; the chat template expands an `{"type": "image"}` content item to `<|vision_start|> <|image_pad|>
<|vision_end|>` (the processor repeats the pad per image token). `preprocessor_config.json` names transformers' PIL
image processor (`Qwen2VLImageProcessorPil`: no torchvision, which does not import here) with the patch/merge sizes
above (`make_image_processor` builds it in memory); `AutoImageProcessor.from_pretrained(dir)` works offline,
`AutoProcessor` does not here (Qwen3VLProcessor builds a video processor, which imports torchvision).
The MoE one's fused experts are stored in the released checkpoints' layout (`_experts_to_hub_layout`). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_VL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64
"""The image processor's pixel bounds: a 16x16 image is 1 token (2x2 patches merged), 64x64 is 16."""
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }} "
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_vl_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The tiny word-level tokenizer with Qwen's vision tokens (ids right after the tiny vocabulary, as special
    tokens), then the tiny visual task's words (`hpc_rl.data.tiny_vl_task.VL_TASK_WORDS`, so its questions and
    colour answers are not `<unk>`), and the VL chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hpc_rl.data.tiny_vl_task import VL_TASK_WORDS
    from hpc_rl.models.tiny_checkpoint import SPECIAL_TOKENS, TINY_VOCAB

    words = TINY_VOCAB + list(VISION_TOKENS) + [w for w in VL_TASK_WORDS if w not in TINY_VOCAB]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens(SPECIAL_TOKENS + list(VISION_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", bos_token=None)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def vision_config_fields(text_hidden: int = 64) -> dict[str, Any]:
    """The tiny vision tower's config keys."""
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=PATCH_SIZE,
                spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, out_hidden_size=text_hidden,
                num_position_embeddings=16, deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")


def text_config_fields(family: str, tokenizer: Any, *, hidden_size: int = 64, num_hidden_layers: int = 2,
                       intermediate_size: int = 128) -> dict[str, Any]:
    """The tiny text model's config keys (MoE: 4 experts of 16, top-2; 16 keeps every expert tensor non-square)."""
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
        tie_word_embeddings=False,  # as the top level says (the text config alone would default to tied)
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if family == "qwen3_vl_moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True)
    return fields


def _randomize(model: Any, seed: int) -> None:
    """Make every tensor matter: norms off 1, decisive routers (no near-ties between implementations), biases on."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", ".bias")):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)


def make_image_processor():  # -> transformers' Qwen2VLImageProcessorPil
    """The tiny checkpoints' image processor (what `preprocessor_config.json` describes), built in memory."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE,
                                    temporal_patch_size=TEMPORAL_PATCH_SIZE, size=size, image_mean=list(IMAGE_MEAN),
                                    image_std=list(IMAGE_STD))


def write_processor_files(output_dir: Path) -> None:
    """preprocessor_config.json (the PIL image processor) and video_preprocessor_config.json."""
    image = {"image_processor_type": "Qwen2VLImageProcessorPil", "processor_class": "Qwen3VLProcessor",
             "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
             "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD), "do_resize": True, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}
    (output_dir / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    video = {**image, "video_processor_type": "Qwen3VLVideoProcessor"}
    video.pop("image_processor_type")
    (output_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def _experts_to_hub_layout(output_dir: Path) -> None:
    """Rewrite the fused expert tensors as the released Qwen3-VL-MoE checkpoints hold them: `experts.gate_up_proj`
    [E, hidden, 2 * moe_inter] and `experts.down_proj` [E, moe_inter, hidden] (transformers 5.24 saves its in-memory
    [E, out, in] layout and reads both back; SGLang's loader reads the released layout)."""
    from safetensors.torch import load_file, save_file

    path = output_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_tiny(output_dir: str | Path, family: str = "qwen3_vl", seed: int = 0, hidden_size: int = 64,
              num_hidden_layers: int = 2, intermediate_size: int = 128) -> Path:
    """Write a randomly initialised tiny Qwen3-VL (`family`: qwen3_vl | qwen3_vl_moe) with tokenizer and processor
    files to `output_dir`; return it."""
    import torch

    if family not in TINY_VL_FAMILIES:
        raise ValueError(f"tiny VL family {family!r}: use one of {', '.join(TINY_VL_FAMILIES)}")
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config, Qwen3VLForConditionalGeneration as Model
    else:
        from transformers import Qwen3VLMoeConfig as Config, Qwen3VLMoeForConditionalGeneration as Model
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    config = Config(text_config=text_config_fields(family, tokenizer, hidden_size=hidden_size,
                                                   num_hidden_layers=num_hidden_layers,
                                                   intermediate_size=intermediate_size),
                    vision_config=vision_config_fields(hidden_size), tie_word_embeddings=False, **ids)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32)
    _randomize(model, seed)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    write_processor_files(output_dir)
    if family == "qwen3_vl_moe":
        _experts_to_hub_layout(output_dir)
    config_file = output_dir / "config.json"
    saved = json.loads(config_file.read_text())
    saved["torch_dtype"] = "float32"
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return output_dir


def make_tiny_qwen3_vl(output_dir: str | Path, **fields: Any) -> Path:
    """The qwen3_vl family's `make_tiny` hook."""
    return make_tiny(output_dir, family="qwen3_vl", **fields)


def make_tiny_qwen3_vl_moe(output_dir: str | Path, **fields: Any) -> Path:
    """The qwen3_vl_moe family's `make_tiny` hook."""
    return make_tiny(output_dir, family="qwen3_vl_moe", **fields)
