"""The tiny Qwen3-MoE served by real SGLang 0.5.23 on CPU (marker `sglang_cpu`, skipped without
tools/install_sglang_cpu.sh's venv): sampled tokens' log-probs equal a transformers forward pass of the same
tokens. (hpc_rl's CPU engine serving it is checked against the trainer in test_moe_run.)

Found with SGLang: its Qwen3-MoE always builds its own lm_head, so a checkpoint with tied embeddings (no
lm_head.weight on disk) serves uniform log-probs (-log V for every token) without an error; the tiny MoE
asset is untied, as the real checkpoints are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from hpc_rl.process.child_process import planned_port
from hpc_rl.engines.engine_process import SglangEngineProcess
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_ENV, SGLANG_ON_CPU_OPTIONS, SglangLaunchSpec
from tests.integration.test_engine_conformance import SGLANG_PYTHON, needs_sglang

pytestmark = pytest.mark.slow
MOE_DIR = Path(__file__).resolve().parents[2] / "assets" / "tiny_qwen3_moe"
PROMPTS = [[3, 9, 5, 12, 7, 15], [5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.sglang_cpu
@needs_sglang
def test_sglang_serves_the_tiny_moe_with_transformers_logprobs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # float32 like the trainer (SGLang's "auto" keeps a float16 KV cache on CPU: ~1e-4 off)
    spec = SglangLaunchSpec(hf_checkpoint=str(MOE_DIR), host="127.0.0.1", port=planned_port(),
                            python=str(SGLANG_PYTHON),
                            sglang_options={**SGLANG_ON_CPU_OPTIONS, "max_total_tokens": 4096, "dtype": "float32"})
    engine = SglangEngineProcess(spec, log_path=tmp_path / "engine.log", env=SGLANG_ON_CPU_ENV)
    engine.start()
    try:
        engine.wait_healthy(600)
        answers = [requests.post(f"{engine.url}/generate", timeout=120, json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}}).json()
            for prompt in PROMPTS]
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(MOE_DIR, dtype=torch.float32).eval()
    for prompt, answer in zip(PROMPTS, answers):
        output = answer["output_ids"]
        got = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
        expected = [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]
        assert len(got) == len(output) == 6
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4, (prompt, got, expected)
