"""A LoRA run end to end (issue 33): the tiny SFT job (trainer-only) with miles' flags trains adapters on the frozen
base through the resolved config, and every `--save-hf` directory is a PEFT adapter that loads on the HF model."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tests.integration.run_helpers import REPO_ROOT, records
from tests.integration.test_training_modes_runs import metric, run

pytestmark = pytest.mark.slow


def test_tiny_sft_with_lora_trains_adapters_and_saves_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "lora_sft"
    run(run_dir, "configs/tiny_sft_cpu.yaml", "--lora-rank", "8", "--lora-alpha", "16", "--target-modules",
        "all-linear", "--lr", "2e-2", "--save-hf", str(run_dir / "peft_{rollout_id}"), "--save-interval", "16", "--num-epoch", "1")
    rows = records(run_dir)
    losses = metric(rows, "train/loss")
    assert len(losses) == 32 and statistics.mean(losses[-8:]) < 0.85 * statistics.mean(losses[:2]), losses
    assert "lora.linear_qkv.lora_A.shared" in (run_dir / "logs" / "trainer.log").read_text()  # in DDP's buckets
    saved = sorted(run_dir.glob("peft_*"))
    assert [p.name for p in saved] == ["peft_15", "peft_31"]
    hf_dir = REPO_ROOT / "assets" / "tiny_qwen3"
    tokens = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2]])
    logits = []
    for directory in saved:
        assert json.loads((directory / "adapter_config.json").read_text())["r"] == 8
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            logits.append(PeftModel.from_pretrained(base, str(directory)).eval()(tokens).logits)
    assert (logits[0] - logits[1]).abs().max().item() > 1e-3  # the adapter kept training between the saves
