"""Tiny tokenizers that render chats with real models' chat templates (Qwen3's, GLM-Z1-0414's), for tests.

Each is a byte-level BPE without merges (one token per byte, so every text round-trips exactly) plus the
family's special tokens as single tokens, carrying the family's chat template from
`tests/unit/data/chat_templates/` (copied from the models' tokenizer_config.json). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"
FAMILIES = {
    "qwen3": {"template": "qwen3.jinja", "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              "eos": "<|im_end|>", "stop": ["<|im_end|>", "<|endoftext|>"]},
    "glm4": {"template": "glm_z1.jinja",
             "special": ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                         "<|observation|>"],
             "eos": "<|endoftext|>", "stop": ["<|endoftext|>", "<|user|>", "<|observation|>"]},
}


def chat_tokenizer(family: str):  # -> (transformers.PreTrainedTokenizerFast, stop token ids)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(spec["special"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=spec["eos"], pad_token="<|endoftext|>")
    tokenizer.chat_template = (TEMPLATES / spec["template"]).read_text()
    return tokenizer, [tokenizer.convert_tokens_to_ids(t) for t in spec["stop"]]
