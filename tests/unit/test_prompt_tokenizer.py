"""The controller's torch-free tokenizer encodes prompts exactly as AutoTokenizer does."""

from __future__ import annotations

import subprocess
import sys

from hpc_rl.data.prompt_tokenizer import load_prompt_tokenizer
from hpc_rl.data.prompts import make_prompt_encoder

PROMPTS = ["copy 3", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy 7 7"}]]


def test_same_token_ids_as_auto_tokenizer(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    light = load_prompt_tokenizer(tiny_model_dir)
    for chat in (True, False):
        expected = make_prompt_encoder(reference, apply_chat_template=chat)
        actual = make_prompt_encoder(light, apply_chat_template=chat)
        for prompt in PROMPTS:
            assert actual(prompt, {}) == expected(prompt, {}) != []


def test_loading_it_imports_no_torch(tiny_model_dir) -> None:
    probe = ("import sys; from hpc_rl.data.prompt_tokenizer import load_prompt_tokenizer; "
             f"load_prompt_tokenizer({str(tiny_model_dir)!r}); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
