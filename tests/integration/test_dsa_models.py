"""DeepSeek-V3.2 (DeepSeek Sparse Attention) from Megatron's DSAttention / DSAIndexer against transformers' own
DeepseekV32ForCausalLM, and GLM-5 (glm_moe_dsa: the indexer's interleaved rotary and 1e-6 key norm, at TP1) against
GlmMoeDsaForCausalLM, on the tiny random checkpoints (hpc_rl.models.deepseek_v32.tiny: 2 layers, MLA with an
indexer of 4 heads choosing 4 keys of up to 12, layer 1 MoE), at TP1 (one gloo rank) and TP2 with sequence
parallelism (two), fp32 on CPU (the Hadamard rotation is its CPU twin, hpc_rl.models.deepseek_v32.layers_dsa).
Checks: logits equal transformers' (< 1e-5); each layer's indexer picks the same keys as transformers' indexer
for every query (the causal keys among its top-k); at TP1 two packed samples (THD) give each sample's logits as
run alone; every HF tensor exported from the Megatron model (the weight-sync path) equals the checkpoint's bit
for bit (the indexer's head layout is permuted on load and back on export); slime's --freeze-indexer freezes
exactly the indexer's parameters, and a training-mode backward (DSAttention's indexer-loss path) gives every
other parameter a gradient and the indexer none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1]])
SAMPLES = ([3, 5, 7, 11, 13, 17, 19, 2, 4], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2])


def selected(topk: torch.Tensor) -> torch.Tensor:
    """[b, s, k] indices -> [b, s, s] bool: the causal keys each query attends to."""
    batch, seq, _ = topk.shape
    chosen = torch.zeros(batch, seq, seq, dtype=torch.bool).scatter(-1, topk.long(), True)
    return chosen & torch.ones(seq, seq, dtype=torch.bool).tril()


def rank_checks(hf_dir: str, tp: int, family: str = "deepseek_v32") -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.actor import freeze_indexer
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.export import ExpertLayout, export_hf_state_dict
    from hpc_rl.weights.hf_import import load_hf_into_model

    # TP2 runs with sequence parallelism (Megatron's MoE needs it) and unpacked rows: DSA over packed samples
    # under SP is refused (hpc_rl.models.deepseek_v32.config_rules.training_problems)
    training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, global_batch_size=8,
                              micro_batch_size=2, qkv_format="thd" if tp == 1 else "bshd",
                              moe_token_dispatcher_type="alltoall")
    info = init_parallel(training, device="cpu")
    group = parallel_state.get_tensor_model_parallel_group()

    def gathered(local: torch.Tensor, vocab: int) -> torch.Tensor:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        return torch.cat(shards, dim=-1)[..., :vocab]
    try:
        arch = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{family}.yaml")
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
        model.eval()
        picks: list[torch.Tensor] = []  # each indexer's top-k, recorded from DSAttention's call
        original = DSAIndexer.forward_with_scores

        def recording(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            scores, topk = original(self, *args, **kwargs)
            picks.append(topk.clone())
            return scores, topk

        for module in (m for m in model.modules() if isinstance(m, DSAIndexer)):
            module.forward_with_scores = recording.__get__(module)
        with torch.no_grad():
            logits = gathered(forward_logits(model, TOKENS), arch.vocab_size)
            unpacked_picks = list(picks)
            gaps = [0.0]
            if tp == 1:
                batch = build_microbatch(SAMPLES, [1, 1], [0, 1], qkv_format="thd")
                packed = model(batch.tokens, batch.position_ids, None,
                               packed_seq_params=batch.packed_seq_params)[0][..., :arch.vocab_size]
                for start, sample in zip(batch.starts, SAMPLES):
                    alone = forward_logits(model, torch.tensor([sample]))[0][..., :arch.vocab_size]
                    gaps.append((packed[start:start + len(sample)] - alone).abs().max().item())
            exported = {name: tensor.clone() for name, tensor in
                        export_hf_state_dict(model, arch, group if tp > 1 else None, ExpertLayout.current(arch))}
        # --freeze-indexer on the real model, then one training-mode backward (DSAttention's indexer-loss path)
        frozen = freeze_indexer(model)
        model.train()
        loss = forward_logits(model, TOKENS).logsumexp(-1).mean()  # this rank's vocab shard (autograd: no gather)
        loss.backward()
        grads = {name: param.grad is not None for name, param in model.named_parameters()}
        return {"logits": logits, "picks": unpacked_picks, "packed_gap": max(gaps), "exported": exported,
                "frozen": frozen, "grads": grads}
    finally:
        shutdown_parallel()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from hpc_rl.models.registry import family

    root = tmp_path_factory.mktemp("dsa")
    return {name: str(family(name).make_tiny(root / name)) for name in ("deepseek_v32", "glm_moe_dsa")}


def _reference(hf_dir: str) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    picks: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.self_attn.indexer.register_forward_hook(lambda _m, _i, out: picks.append(out.clone()))
    with torch.no_grad():
        logits = model(TOKENS).logits
    return logits, picks, load_file(str(Path(hf_dir) / "model.safetensors"))


@pytest.mark.parametrize(("family", "tp"), [("deepseek_v32", 1), ("deepseek_v32", 2), ("glm_moe_dsa", 1)])
def test_megatron_dsa_equals_transformers_packed_and_exported(checkpoints: dict[str, str], family: str,
                                                              tp: int) -> None:
    checkpoint = checkpoints[family]
    got = run_ranks(rank_checks, tp, checkpoint, tp, family, timeout=600)[0]
    logits, picks, tensors = _reference(checkpoint)
    gap = (got["logits"] - logits).abs().max().item()
    print(f"{family} TP{tp}: max |logits - transformers'| {gap:.2e}, packed vs alone {got['packed_gap']:.2e}")
    assert gap < 1e-5, f"logits differ from transformers' by {gap}"  # GLM-5 with Megatron's norm eps: 5.7e-5
    assert len(got["picks"]) == len(picks) == 2
    for layer, (ours, theirs) in enumerate(zip(got["picks"], picks)):
        differ = (selected(ours) != selected(theirs)).sum().item()
        assert differ == 0, f"layer {layer}: the indexers pick {differ} different (query, key) pairs"
        assert not selected(theirs).all(), "the tiny indexer selects every key: top-k would not be tested"
    assert got["packed_gap"] < 1e-5, f"packed samples differ from alone by {got['packed_gap']}"
    assert sorted(got["frozen"]) == sorted(f"decoder.layers.{layer}.self_attention.core_attention.indexer.{suffix}"
                                          for layer in (0, 1) for suffix in ("linear_wq_b.weight", "linear_wk.weight",
                                          "k_norm.weight", "k_norm.bias", "linear_weights_proj.weight"))
    assert not any(got["grads"][name] for name in got["frozen"])
    assert all(has for name, has in got["grads"].items() if name not in got["frozen"]), got["grads"]
    assert sorted(got["exported"]) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(got["exported"][name], tensor), f"{name} does not round-trip"
