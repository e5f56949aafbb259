"""A Qwen3.5 vision-language release through the converters (one gloo rank): HF (text tower under
`model.language_model.`, a vision tower) -> torch_dist -> HF with the release as reference gives back every tensor
bit for bit (the language model through Megatron, the vision tower passed through), and Megatron's logits on the
release equal transformers' text model's (< 1e-4, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10]])


def convert_both_ways(hf_dir: str, work: str) -> torch.Tensor:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.convert import hf_to_torch_dist, torch_dist_to_hf
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.hf_import import load_hf_into_model

    model_file = ROOT / "configs" / "models" / "tiny_qwen3_5_moe.yaml"
    arch = ModelArchitecture.from_yaml(model_file)
    try:
        hf_to_torch_dist(hf_dir, model_file, f"{work}/dist")
        torch_dist_to_hf(f"{work}/dist", model_file, f"{work}/hf", hf_reference=hf_dir)
        training = TrainingConfig()
        init_parallel(training, device="cpu")
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=0, tp_size=1)
        model.eval()
        with torch.no_grad():
            return forward_logits(model, TOKENS)[..., :arch.vocab_size]
    finally:
        shutdown_parallel()


def test_a_vlm_release_converts_bit_exact_with_its_vision_tower(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hpc_rl.models.qwen3_next.tiny import make_tiny

    release = make_tiny(tmp_path / "release", family="qwen3_5_moe", vlm=True)
    [logits] = run_ranks(convert_both_ways, 1, str(release), str(tmp_path))
    before, after = load_file(str(release / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(after) == set(before) and any(name.startswith("model.visual.") for name in after)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []
    text_model = AutoModelForCausalLM.from_pretrained(str(release), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = text_model(TOKENS).logits
    assert (logits - expected).abs().max().item() < 1e-4
