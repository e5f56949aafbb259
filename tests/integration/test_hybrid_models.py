"""Hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5 dense, Qwen3.5-MoE) from Megatron's own layers on real gloo
ranks, against transformers on tiny random checkpoints (hpc_rl.models.qwen3_next.tiny: three linear-attention layers
and one gated full-attention layer, zero-centred norms, a quarter-rotated head, the MoE ones with a gated shared
expert). Two launches: TP1 (1 rank, all three families) and TP2 with sequence parallelism (2 ranks, all three). Each
checks: logits equal transformers' (fp32, < 1e-4); two packed samples (THD, one row) give each sample's logits as
run alone (the linear-attention state and convolution window restart at the boundary); every HF tensor exported from
the Megatron model (the weight-sync path, gathered over TP) equals the checkpoint's bit for bit, and so does every
tensor after HF -> torch_dist (saved at that TP, Megatron's own sharded state dict of GatedDeltaNet) -> HF (TP1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10, 12, 14, 9, 1, 0, 5, 7, 3],
                       [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1, 7, 7, 7, 9, 9, 9, 1, 2]])
SAMPLES = ([3, 5, 7, 11, 13, 17, 19, 2, 4], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1, 7])


def rank_checks(models: dict[str, str], tp: int, work: str) -> dict[str, dict]:
    """Per family: the full logits, packed vs alone max |diff|, and the exported HF tensors (rank 0 returns them);
    then each checkpoint converted to torch_dist at this TP (`work`/<family>_tp<tp>)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.schema import TrainingConfig
    from hpc_rl.training.convert import hf_to_torch_dist
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.export import ExpertLayout, export_hf_state_dict
    from hpc_rl.weights.hf_import import load_hf_into_model

    training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, global_batch_size=8,
                              micro_batch_size=2, qkv_format="thd", moe_token_dispatcher_type="alltoall")
    info = init_parallel(training, device="cpu")
    group = parallel_state.get_tensor_model_parallel_group()

    def gathered(local: torch.Tensor, vocab: int) -> torch.Tensor:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        return torch.cat(shards, dim=-1)[..., :vocab]

    results = {}
    try:
        for family, hf_dir in models.items():
            arch = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{family}.yaml")
            model = build_gpt_model(arch, training)
            load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
            model.eval()
            with torch.no_grad():
                logits = gathered(forward_logits(model, TOKENS), arch.vocab_size)
                batch = build_microbatch(SAMPLES, [1, 1], [0, 1], qkv_format="thd", pad_multiple=tp)
                packed = gathered(model(batch.tokens, batch.position_ids, None,
                                        packed_seq_params=batch.packed_seq_params), arch.vocab_size)[0]
                gaps = []
                for start, sample in zip(batch.starts, SAMPLES):
                    padded = sample + [0] * (-len(sample) % tp)  # right padding: causal, so the sample's logits stay
                    alone = gathered(forward_logits(model, torch.tensor([padded])), arch.vocab_size)[0][:len(sample)]
                    gaps.append((packed[start:start + len(sample)] - alone).abs().max().item())
                exported = {name: tensor.clone() for name, tensor in
                            export_hf_state_dict(model, arch, group if tp > 1 else None, ExpertLayout.current(arch))}
            results[family] = {"logits": logits, "packed_gap": max(gaps), "exported": exported}
            hf_to_torch_dist(hf_dir, ROOT / "configs" / "models" / f"tiny_{family}.yaml", f"{work}/{family}_tp{tp}",
                             tensor_parallel_size=tp)  # the same layout: Megatron's groups stay
    finally:
        shutdown_parallel()
    return results


def convert_back(models: dict[str, str], tp: int, work: str) -> None:
    """torch_dist (saved at `tp`) -> HF at TP1, one rank."""
    from hpc_rl.training.convert import torch_dist_to_hf
    from hpc_rl.training.parallel import shutdown_parallel

    try:
        for family, hf_dir in models.items():
            torch_dist_to_hf(f"{work}/{family}_tp{tp}", ROOT / "configs" / "models" / f"tiny_{family}.yaml",
                             f"{work}/{family}_tp{tp}_hf", hf_reference=hf_dir)
    finally:
        shutdown_parallel()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from hpc_rl.models.qwen3_next.tiny import make_tiny

    root = tmp_path_factory.mktemp("hybrid")
    return {family: str(make_tiny(root / family, family=family)) for family in FAMILIES}


def _reference(hf_dir: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    return logits, load_file(str(Path(hf_dir) / "model.safetensors"))


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_hybrids_equal_transformers_packed_and_exported(models: dict[str, str], tp: int,
                                                                 tmp_path: Path) -> None:
    results = run_ranks(rank_checks, tp, models, tp, str(tmp_path), timeout=600)[0]
    run_ranks(convert_back, 1, models, tp, str(tmp_path), timeout=600)
    for family, hf_dir in models.items():
        logits, tensors = _reference(hf_dir)
        got = results[family]
        gap = (got["logits"] - logits).abs().max().item()
        print(f"{family} TP{tp}: max |logits - transformers'| {gap:.2e}, packed vs alone {got['packed_gap']:.2e}")
        assert gap < 1e-4, f"{family} TP{tp}: logits differ from transformers' by {gap}"
        assert got["packed_gap"] < 1e-5, f"{family} TP{tp}: packed samples differ from alone by {got['packed_gap']}"
        assert sorted(got["exported"]) == sorted(tensors), family
        converted = load_file(str(tmp_path / f"{family}_tp{tp}_hf" / "model.safetensors"))
        assert sorted(converted) == sorted(tensors), family
        for name, tensor in tensors.items():
            assert torch.equal(got["exported"][name], tensor), f"{family} TP{tp}: {name} does not round-trip"
            assert torch.equal(converted[name], tensor), f"{family}: {name} HF -> torch_dist (TP{tp}) -> HF differs"
