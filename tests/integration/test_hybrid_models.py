"""Hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5 dense, Qwen3.5-MoE) from Megatron's own layers on real gloo
ranks, against transformers on tiny random checkpoints (hpc_rl.models.qwen3_next.tiny: three linear-attention layers
and one gated full-attention layer, zero-centred norms, a quarter-rotated head, the MoE ones with a gated shared
expert). Two launches: TP1 (1 rank, all three families) and TP2 with sequence parallelism (2 ranks, all three). Each
checks: logits equal transformers' (fp32, < 1e-4); two packed samples (THD, one row) give each sample's logits as
run alone (the linear-attention state and convolution window restart at the boundary); every HF tensor exported from
the Megatron model (the weight-sync path, gathered over TP) equals the checkpoint's bit for bit, and so does every
tensor after HF -> torch_dist (saved at that TP, Megatron's own sharded state dict of GatedDeltaNet) -> HF (TP1).
At TP1 every parameter's gradient of the next-token loss equals transformers' (relative 1e-4); one GRPO step
(Megatron's DDP, packed micro-batches) moves every Gated DeltaNet parameter and gives the same loss and gradient
norm at TP1 and TP2."""

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
    from hpc_rl.config.sections.training import TrainingConfig
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
            if tp == 1:
                results[family]["grad_gap"] = _gradient_gap(model, arch, hf_dir)
            results[family].update(_step(arch, hf_dir, training, info))
    finally:
        shutdown_parallel()
    return results


def _gradient_gap(model: torch.nn.Module, arch, hf_dir: str) -> tuple[float, str]:  # noqa: ANN001
    """The largest relative difference between Megatron's and transformers' gradients of the next-token loss, over
    every parameter (backward through the kernels' twins; the tokens avoid the pad id, whose embedding row
    transformers keeps at zero gradient)."""
    from transformers import AutoModelForCausalLM

    from hpc_rl.training.model_provider import forward_logits
    from hpc_rl.weights import hf_mapping
    from hpc_rl.weights.stage import global_named_params

    tokens = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 4, 6, 8, 10, 12, 14, 9, 1, 0, 5, 7, 3, 21]])
    model.train()
    model.zero_grad()
    logits = forward_logits(model, tokens)[0, :-1, :arch.vocab_size]
    torch.nn.functional.cross_entropy(logits, tokens[0, 1:]).backward()
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.nn.functional.cross_entropy(reference(tokens).logits[0, :-1], tokens[0, 1:]).backward()
    theirs = {name: p.grad for name, p in reference.named_parameters()}
    for name in [n for n in theirs if n.endswith("mlp.experts.gate_up_proj")]:  # transformers' fused experts
        prefix, gate_up, down = name[: -len("gate_up_proj")], theirs[name], theirs[name[: -len("gate_up_proj")]
                                                                                  + "down_proj"]
        for expert in range(gate_up.shape[0]):
            gate, up = gate_up[expert].chunk(2, dim=0)
            theirs.update({f"{prefix}{expert}.gate_proj.weight": gate, f"{prefix}{expert}.up_proj.weight": up,
                           f"{prefix}{expert}.down_proj.weight": down[expert]})
    ours = global_named_params(model)
    worst = (0.0, "")
    for name, hf_names in hf_mapping.name_map(arch):
        expected = hf_mapping.to_megatron(name, [theirs[n] for n in hf_names], arch)
        got = ours[name].grad[: expected.shape[0]]
        gap = ((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12)).item()
        worst = max(worst, (gap, name))
    model.zero_grad()
    model.eval()
    return worst


def _step(arch, hf_dir: str, training, info) -> dict:  # noqa: ANN001 - hpc_rl config objects
    """One GRPO optimizer step (Megatron's DDP, packed micro-batches): its metrics, and the linear-attention
    parameters' movement (the gradient reaches them through the kernels' twins)."""
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.weights.stage import global_named_params
    from tests.integration.test_trainer_step import make_batch

    parts = build_trainer(arch=arch, training=training, algorithm=AlgorithmConfig(entropy_coef=0.01),
                          optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1.0),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir), info=info)
    before = {name: p.detach().clone() for name, p in global_named_params(parts.actor).items()}
    metrics = parts.trainer.train_rollout(make_batch(5))[0]
    after = global_named_params(parts.actor)
    moved = {name for name in before if "self_attention." in name and not torch.equal(before[name], after[name])}
    return {"metrics": metrics, "moved": moved}


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


def test_megatron_hybrids_equal_transformers_packed_exported_and_trained(models: dict[str, str],
                                                                        tmp_path: Path) -> None:
    by_tp = {}
    for tp in (1, 2):
        by_tp[tp] = run_ranks(rank_checks, tp, models, tp, str(tmp_path), timeout=600)[0]
        run_ranks(convert_back, 1, models, tp, str(tmp_path), timeout=600)
        _check(models, by_tp[tp], tp, tmp_path)
    for family in models:
        one, two = by_tp[1][family], by_tp[2][family]
        print(f"{family}: step loss TP1 {one['metrics']['loss']:.6f} TP2 {two['metrics']['loss']:.6f}, grad_norm "
              f"{one['metrics']['grad_norm']:.6f} / {two['metrics']['grad_norm']:.6f}")
        for key in ("loss", "grad_norm"):
            assert abs(one["metrics"][key] - two["metrics"][key]) < 1e-5 * max(1.0, abs(one["metrics"][key])), key
        gdn = {name for name in one["moved"] if name.startswith("decoder.layers.0.")}
        assert {"decoder.layers.0.self_attention.A_log", "decoder.layers.0.self_attention.dt_bias",
                "decoder.layers.0.self_attention.conv1d.weight", "decoder.layers.0.self_attention.in_proj.weight",
                "decoder.layers.0.self_attention.out_norm.weight"} <= gdn, gdn


def _check(models: dict[str, str], results: dict, tp: int, tmp_path: Path) -> None:
    for family, hf_dir in models.items():
        logits, tensors = _reference(hf_dir)
        got = results[family]
        gap = (got["logits"] - logits).abs().max().item()
        print(f"{family} TP{tp}: max |logits - transformers'| {gap:.2e}, packed vs alone {got['packed_gap']:.2e}")
        assert gap < 1e-4, f"{family} TP{tp}: logits differ from transformers' by {gap}"
        assert got["packed_gap"] < 1e-5, f"{family} TP{tp}: packed samples differ from alone by {got['packed_gap']}"
        if tp == 1:
            print(f"{family}: largest relative gradient gap to transformers {got['grad_gap'][0]:.2e} "
                  f"({got['grad_gap'][1]})")
            assert got["grad_gap"][0] < 1e-4, f"{family}: gradients differ from transformers': {got['grad_gap']}"
        assert sorted(got["exported"]) == sorted(tensors), family
        converted = load_file(str(tmp_path / f"{family}_tp{tp}_hf" / "model.safetensors"))
        assert sorted(converted) == sorted(tensors), family
        for name, tensor in tensors.items():
            assert torch.equal(got["exported"][name], tensor), f"{family} TP{tp}: {name} does not round-trip"
            assert torch.equal(converted[name], tensor), f"{family}: {name} HF -> torch_dist (TP{tp}) -> HF differs"
