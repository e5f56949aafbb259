"""A LoRA run end to end (issue 33): the tiny SFT job (trainer-only) with miles' flags trains adapters on the frozen
base through the resolved config, and every `--save-hf` directory is a PEFT adapter that loads on the HF model, with
the merged model beside it (`--save-hf-merged`) giving PEFT's logits in transformers alone."""

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
        "all-linear", "--lr", "2e-2", "--save-hf", str(run_dir / "peft_{rollout_id}"), "--save-interval", "16",
        "--num-epoch", "1", "--save-hf-merged")
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
            merged = AutoModelForCausalLM.from_pretrained(directory / "merged", dtype=torch.float32).eval()
            merged_logits = merged(tokens).logits  # --save-hf-merged: transformers alone, no PEFT
        assert (merged_logits - logits[-1]).abs().max().item() < 1e-5
    assert (logits[0] - logits[1]).abs().max().item() > 1e-3  # the adapter kept training between the saves
    converted_checkpoint_matches_save_hf(run_dir, saved[-1], tmp_path / "converted")


def converted_checkpoint_matches_save_hf(run_dir: Path, saved: Path, out: Path) -> None:
    """tools/convert_torch_dist_to_hf.py on the run's last torch_dist checkpoint with its LoRA flags writes the same
    PEFT adapter and the same merged model as --save-hf / --save-hf-merged at that rollout."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    result = subprocess.run([sys.executable, "tools/convert_torch_dist_to_hf.py", "--input-dir",
                             str(run_dir / "checkpoints"), "--model", "configs/models/tiny_qwen3.yaml",
                             "--output-dir", str(out / "merged"), "--origin-hf-dir",
                             str(REPO_ROOT / "assets" / "tiny_qwen3"), "--lora-rank", "8", "--lora-alpha", "16",
                             "--target-modules", "all-linear", "--merge-lora", "--lora-adapter-out",
                             str(out / "peft")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for written, reference in ((out / "peft" / "adapter_model.safetensors", saved / "adapter_model.safetensors"),
                               (out / "merged" / "model.safetensors", saved / "merged" / "model.safetensors")):
        ours, theirs = load_file(str(written)), load_file(str(reference))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), written
