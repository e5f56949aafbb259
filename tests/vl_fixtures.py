"""A tiny random Qwen3-VL checkpoint for the data/engine tests of issue 32, written by transformers.

Owns: `make_tiny_vl_checkpoint(dir)`: Qwen3VLForConditionalGeneration with a 2-layer text model and a depth-1
vision tower (patch 8, merge 2: a 16x16 image is 4 image tokens), the tiny word-level tokenizer with Qwen's vision
tokens and the tiny visual task's words, a chat template that renders `{"type": "image"}` items as
`<|vision_start|><|image_pad|><|vision_end|>`, and a `preprocessor_config.json` for transformers' PIL
Qwen2-VL image processor (no torchvision). A test helper only: the integrator swaps it for
`tools/make_tiny_model.py --family qwen3_vl` once that lands. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from hpc_rl.data.tiny_vl_task import VL_TASK_WORDS

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %} {% endfor %}{% endif %} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
PATCH_SIZE = 8
MERGE_SIZE = 2
MIN_PIXELS = 32 * 32
MAX_PIXELS = 64 * 64


def build_vl_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The tiny word-level vocabulary plus Qwen's vision tokens and the tiny visual task's words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hpc_rl.models.tiny_checkpoint import SPECIAL_TOKENS, WORDS

    specials = SPECIAL_TOKENS + VISION_TOKENS
    vocab_words = specials + WORDS + [w for w in VL_TASK_WORDS if w not in WORDS]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab_words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", bos_token=None)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def make_image_processor():  # -> Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def make_tiny_vl_checkpoint(output_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny random Qwen3-VL (float32) with its tokenizer and image processor config into `output_dir`."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    output_dir = Path(output_dir)
    tokenizer = build_vl_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                         tie_word_embeddings=True),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH_SIZE,
                           spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.text_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.text_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    make_image_processor().save_pretrained(output_dir)
    return output_dir
