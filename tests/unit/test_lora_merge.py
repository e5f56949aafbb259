"""A PEFT adapter merged into its HF base (issue 33: `--save-hf-merged`, tools/merge_lora_adapter.py): the merged
checkpoint loads in transformers without PEFT and its logits equal PEFT's model (merged by PEFT and unmerged);
bad adapters are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.lora.merge import adapter_scale, merge_adapter

TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2], [1, 4, 9, 16, 23, 0, 8, 6]])


def _peft_adapter(tiny_model_dir: Path, directory: Path) -> torch.Tensor:
    """A PEFT adapter with random A and B saved at `directory`; PEFT's logits for TOKENS."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj",
                                                                                  "down_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
        logits = model.eval()(TOKENS).logits
    model.save_pretrained(directory)
    return logits


def test_merged_checkpoint_has_peft_logits_in_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tools.merge_lora_adapter import main

    peft_logits = _peft_adapter(tiny_model_dir, tmp_path / "adapter")
    main(["--base", str(tiny_model_dir), "--adapter", str(tmp_path / "adapter"), "--output-dir",
          str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    by_peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().eval()
    with torch.no_grad():
        ours, peft_merged = merged(TOKENS).logits, by_peft(TOKENS).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()(TOKENS).logits
    assert (peft_logits - plain).abs().max().item() > 1e-2  # the adapter matters
    assert (ours - peft_merged).abs().max().item() < 1e-5
    assert (ours - peft_logits).abs().max().item() < 1e-5
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()


def test_bad_adapters_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only plain LoRA"):
        adapter_scale({"r": 4, "use_dora": True}, "a")
    with pytest.raises(ValueError, match="r=0"):
        adapter_scale({"r": 0}, "a")
    base = {"model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4)}
    a, b = torch.ones(2, 4), torch.ones(6, 2)
    key = "base_model.model.model.layers.0.mlp.up_proj"
    assert torch.equal(merge_adapter(base, {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, 0.5)[
        "model.layers.0.mlp.up_proj.weight"], torch.full((6, 4), 1.0))
    with pytest.raises(ValueError, match="has no model.layers.1"):
        merge_adapter(base, {"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": a,
                             "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight": b}, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        merge_adapter(base, {f"{key}.lora_A.weight": torch.ones(2, 5), f"{key}.lora_B.weight": b}, 1.0)
    from tools.merge_lora_adapter import main

    with pytest.raises(SystemExit, match="not a PEFT adapter directory"):
        main(["--base", str(tmp_path), "--adapter", str(tmp_path), "--output-dir", str(tmp_path / "out")])
