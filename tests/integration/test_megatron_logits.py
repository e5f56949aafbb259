"""HF transformers vs Megatron GPTModel logits on the same weights, at TP=2 with sequence parallel:
tiny Qwen3 (head dim 16 and 32), Llama and GLM4 (sandwich norms, QKV bias, half-dim interleaved
rotary); plus vocab-parallel log-probs equal to HF's log_softmax, and the same log-probs from a
packed (THD) micro-batch of sequences of different lengths. (TP=1 is checked in
test_trainer_step, in the same process as the trainer sanity checks, to save a process start.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1]])
PACKED = [TOKENS[0].tolist(), TOKENS[1, :7].tolist(), [2, 9, 4, 21]]  # 23 tokens: padded to 24 for SP


def tiny_models(root: Path) -> list[tuple[str, str, dict]]:
    """(name, hf_dir, ModelArchitecture fields) for each family."""
    from transformers import Glm4Config, Glm4ForCausalLM, LlamaConfig, LlamaForCausalLM

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model

    base = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
                "vocab_size": 24, "max_position_embeddings": 512}
    qwen3 = ModelArchitecture.from_yaml(Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml")
    out = [("qwen3", str(make_tiny_model(root / "qwen3")), qwen3.to_dict())]
    wide = make_tiny_model(root / "qwen3_hd32", TinyModelSpec(head_dim=32))
    out.append(("qwen3_head_dim_32", str(wide), {**qwen3.to_dict(), "kv_channels": 32}))
    torch.manual_seed(1)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    llama.save_pretrained(root / "llama")
    out.append(("llama", str(root / "llama"), dict(base, family="llama", kv_channels=16, rotary_base=500000.0,
                                                  norm_epsilon=1e-5)))
    glm4 = Glm4ForCausalLM(Glm4Config(vocab_size=24, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      partial_rotary_factor=0.5, attention_bias=True, rms_norm_eps=1e-5, pad_token_id=0,
                                      tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}))
    with torch.no_grad():  # HF initialises biases and norms trivially: make them matter
        for name, param in glm4.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    glm4.save_pretrained(root / "glm4")
    out.append(("glm4", str(root / "glm4"), dict(base, family="glm4", kv_channels=16, rotary_base=10000.0,
                                                rotary_percent=0.5, rotary_interleaved=True, norm_epsilon=1e-5,
                                                add_qkv_bias=True, post_sublayer_norms=True)))
    return out


def megatron_rank(models: list[tuple[str, str, dict]]) -> dict | None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.layer_specs import PackedSequenceAttention
    from hpc_rl.training.logprobs import vocab_parallel_logprobs
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.hf_import import load_hf_into_model

    training = TrainingConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    info = init_parallel(training, device="cpu")
    group = parallel_state.get_tensor_model_parallel_group()
    out: dict = {}
    block_mask_max = PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS
    for name, hf_dir, fields in models:
        arch = ModelArchitecture(**fields)
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
        model.eval()
        with torch.no_grad():
            local = forward_logits(model, TOKENS)
            log_probs, entropy = vocab_parallel_logprobs(local[:, :-1], TOKENS[:, 1:], vocab_size=arch.vocab_size,
                                                         tp_group=group, with_entropy=True)
            micro = build_microbatch(PACKED, [len(t) - 1 for t in PACKED], [0, 1, 2], qkv_format="thd", pad_multiple=2)
            packed, _ = micro.response_logprobs(micro.forward(model), vocab_size=arch.vocab_size, tp_group=group)
            PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS = 0  # the per-sequence path for long rows
            looped, _ = micro.response_logprobs(micro.forward(model), vocab_size=arch.vocab_size, tp_group=group)
            PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS = block_mask_max
        shards = [torch.empty_like(local) for _ in range(info.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        out[name] = (torch.cat(shards, dim=-1)[..., : arch.vocab_size], log_probs, entropy, packed + looped)
    rank = info.rank
    shutdown_parallel()
    return out if rank == 0 else None


def test_megatron_logits_match_hf_at_tp2_sp(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    models = tiny_models(tmp_path)
    ours = run_ranks(megatron_rank, 2, models, timeout=240)[0]
    for name, hf_dir, _ in models:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            reference = hf(TOKENS).logits
        logits, log_probs, entropy, packed = ours[name]
        assert logits.shape == reference.shape, name
        assert (logits - reference).abs().max().item() < 1e-4, name
        ref_logp = torch.log_softmax(reference[:, :-1], -1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
        assert (log_probs - ref_logp).abs().max().item() < 1e-4, name
        ref_entropy = -(torch.log_softmax(reference[:, :-1], -1).exp() * torch.log_softmax(reference[:, :-1], -1)).sum(-1)
        assert (entropy - ref_entropy).abs().max().item() < 1e-4, name
        for sequence, got in zip(PACKED + PACKED, packed):
            ids = torch.tensor([sequence])
            with torch.no_grad():
                expected = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert (got - expected).abs().max().item() < 1e-4, (name, len(sequence))
