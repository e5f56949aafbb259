"""The CPU engine's tokenizer: the checkpoint's `tokenizer.json` through the `tokenizers` library.

Owns: what the engine needs of a tokenizer — encode a text prompt without special tokens, decode
(single and batched, with or without special tokens), the EOS id — read straight from
`tokenizer.json` and `tokenizer_config.json`, so engine start-up does not import transformers.
The answers are transformers' fast tokenizer's (it calls the same `tokenizers` object; its only
extra step, `clean_up_tokenization_spaces`, makes `load_engine_tokenizer` fall back to transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


PLAIN_FAST_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_config classes that are tokenizer.json and nothing else (transformers 5's and 4's names)."""


class EngineTokenizer:
    """encode / decode / batch_decode / eos_token_id of a `tokenizers.Tokenizer`."""

    def __init__(self, backend: Any, eos_token_id: int | None) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend.decode_batch([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens)


def _token_content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _tokenizer_config(path: Path) -> dict[str, Any]:
    config_path = path / "tokenizer_config.json"
    return json.loads(config_path.read_text()) if config_path.is_file() else {}


def native_tokenizer_support(model_path: str | Path, config: dict[str, Any] | None = None) -> str | None:
    """None when `EngineTokenizer` answers as transformers would for this checkpoint; else why not.
    `config`: its tokenizer_config.json when already read."""
    path = Path(model_path)
    if not (path / "tokenizer.json").is_file():
        return "no tokenizer.json"
    config = _tokenizer_config(path) if config is None else config
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces is set"
    if config.get("tokenizer_class", "TokenizersBackend") not in PLAIN_FAST_TOKENIZERS:
        return f"tokenizer_class {config.get('tokenizer_class')!r} may add its own processing"
    if config.get("additional_special_tokens") or config.get("extra_special_tokens"):
        return "tokenizer_config.json registers extra special tokens"
    return None


def load_engine_tokenizer(model_path: str | Path) -> Any:
    """`EngineTokenizer` when `native_tokenizer_support` allows it, else transformers' AutoTokenizer."""
    path = Path(model_path)
    config = _tokenizer_config(path)
    if native_tokenizer_support(path, config) is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.no_truncation()
    backend.no_padding()
    eos = _token_content(config.get("eos_token"))
    return EngineTokenizer(backend, backend.token_to_id(eos) if eos else None)
