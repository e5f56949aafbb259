"""The tokenizer the controller encodes prompts with, loaded without torch.

Owns: choosing how to load the HF checkpoint's tokenizer for prompt encoding. With a
`tokenizer.json` (every fast tokenizer has one), transformers' `PreTrainedTokenizerFast` reads it
directly: the same Rust tokenizer and the same chat-template renderer as `AutoTokenizer`, but
without the auto classes, which import torch (measured: 260 MB and seconds of start-up in the
controller, issue 11). Without one (a slow, sentencepiece-only tokenizer) it falls back to
`AutoTokenizer`, which may import torch. Encoding itself is `data.prompts.make_prompt_encoder`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_prompt_tokenizer(hf_checkpoint: str | Path) -> Any:
    """The checkpoint's tokenizer, torch-free when it has a `tokenizer.json`."""
    if (Path(hf_checkpoint) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(hf_checkpoint))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_checkpoint))
