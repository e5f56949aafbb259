"""LoRA on Megatron's parallel layers (issue 33) against transformers + PEFT on the tiny Qwen3, at TP1 and at TP2 with
sequence parallel (gloo ranks):
  * a PEFT adapter (one A per projection, PEFT's own) loaded into hpc_rl's adapters (lora_type canonical_lora):
    logits equal PEFT's on the HF model;
  * hpc_rl's adapters (lora_type lora: one A shared by the fused QKV's and gate/up's slices) trained 10 steps with
    Megatron's DDP and optimizer: only adapter weights change (after the first step and after all), the base is
    bit-identical, only adapters are in the optimizer and the grad buffers; the adapter hpc_rl saves loads into PEFT
    and gives the trainer's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1]])
ARCH_FILE = Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml"
RANK, ALPHA = 4, 8


def _logits(model, arch, group, tp: int) -> torch.Tensor:  # noqa: ANN001
    import torch.distributed as dist

    from hpc_rl.training.model_provider import forward_logits

    local = forward_logits(model, TOKENS)
    if tp > 1:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        local = torch.cat(shards, dim=-1)
    return local[..., : arch.vocab_size].detach()


def lora_rank(hf_dir: str, peft_dir: str, out_dir: str, tp: int) -> dict | None:
    from megatron.core import parallel_state

    from hpc_rl.config.lora import LoraConfig
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import OptimizerConfig, TrainingConfig
    from hpc_rl.training.logprobs import vocab_parallel_logprobs
    from hpc_rl.training.lora.attach import apply_lora, is_adapter_param
    from hpc_rl.training.lora.peft_files import adapter_state_dict, load_peft_adapter, save_peft_adapter
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.optimizer import ActorOptimizer, wrap_ddp
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.hf_import import load_hf_into_model

    training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    info = init_parallel(training, device="cpu")
    group = parallel_state.get_tensor_model_parallel_group()
    arch = ModelArchitecture.from_yaml(ARCH_FILE)
    out: dict = {}

    canonical = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_type="canonical_lora", target_modules="all-linear")
    model = build_gpt_model(arch, training)
    load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
    apply_lora(model, canonical)
    load_peft_adapter(model, peft_dir)
    model.eval()
    with torch.no_grad():
        out["peft_loaded"] = _logits(model, arch, group, tp)
    log_probs = vocab_parallel_logprobs(forward_logits(model, TOKENS)[:, :-1], TOKENS[:, 1:],
                                        vocab_size=arch.vocab_size, tp_group=group)[0]
    (-log_probs.mean()).backward()
    out["peft_loaded_grads"] = adapter_state_dict(model, grads=True)

    shared = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_type="lora", target_modules="linear_qkv,o_proj,"
                        "linear_fc1,down_proj")
    model = build_gpt_model(arch, training)
    load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
    adapters = apply_lora(model, shared)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_param(n)}
    adapters_before = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_param(n)}
    ddp = wrap_ddp(model)
    optimizer = ActorOptimizer(ddp, OptimizerConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.0))
    out["optimized"] = sorted(n for n, p in model.named_parameters() if any(p is q for q in optimizer.params))
    out["adapter_names"] = sorted(adapters_before)
    out["grad_buffer_params"] = sum(len(buffer.params) for buffer in ddp.buffers)
    changed = []
    for step in range(10):
        ddp.train()
        log_probs = vocab_parallel_logprobs(forward_logits(ddp, TOKENS)[:, :-1], TOKENS[:, 1:],
                                            vocab_size=arch.vocab_size, tp_group=group)[0]
        (-log_probs.mean()).backward()
        result = optimizer.step()
        assert not result.skipped
        if step == 0:
            changed = sorted(n for n, p in model.named_parameters() if not torch.equal(
                p.detach(), (base_before | adapters_before)[n]))
    out["changed_after_one_step"] = changed
    out["base_changed_after_ten"] = sorted(n for n, p in model.named_parameters()
                                           if n in base_before and not torch.equal(p.detach(), base_before[n]))
    out["adapters_a_shared"] = [sorted(a.lora_A) for a in adapters]
    from hpc_rl.config.lora_sizes import layer_adapter_parameters

    # the memory plan's count of adapter parameters on a trainer GPU is what the model holds
    out["adapter_elements"] = (sum(p.numel() for a in adapters for p in a.parameters()),
                               layer_adapter_parameters(arch, shared, tp) * arch.num_layers)
    ddp.eval()
    with torch.no_grad():
        out["trained"] = _logits(model, arch, group, tp)
    save_peft_adapter(model, shared, out_dir, base_model=hf_dir, write=info.rank == 0)
    rank = info.rank
    shutdown_parallel()
    return out if rank == 0 else None


def _peft_logits(hf_dir: str, adapter_dir: str) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _peft_grads(hf_dir: str, adapter_dir: str) -> dict[str, torch.Tensor]:
    """PEFT's adapter gradients of the mean next-token NLL of TOKENS, under the saved names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).eval()
    logits = model(TOKENS).logits
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, TOKENS[:, 1:, None]).mean()
    nll.backward()
    return {name.replace(".default", ""): p.grad for name, p in model.named_parameters() if p.grad is not None}


def _random_peft_adapter(hf_dir: str, out: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    torch.manual_seed(3)
    with torch.no_grad():  # PEFT starts B at zero: give every matrix a value that matters
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(out)


def test_lora_adapters_equal_peft_and_train_only_adapters(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "qwen3"))
    _random_peft_adapter(hf_dir, tmp_path / "peft")
    trained = {}
    for tp in (1, 2):
        saved_dir = tmp_path / f"saved_tp{tp}"
        ours = run_ranks(lora_rank, tp, hf_dir, str(tmp_path / "peft"), str(saved_dir), tp, timeout=300)[0]
        _check(ours, hf_dir, tmp_path / "peft", saved_dir, tp)
        trained[tp] = ours["trained"]
    # the same initial adapters and 10 Adam steps at TP1 and TP2+SP: the adapters' TP gradients are whole
    gap = (trained[1] - trained[2]).abs().max().item()
    print(f"trained logits TP1 vs TP2+SP after 10 steps: max |diff| {gap:.2e}")
    assert gap < 1e-4


def _check(ours: dict, hf_dir: str, peft_dir: Path, saved_dir: Path, tp: int) -> None:

    reference = _peft_logits(hf_dir, str(peft_dir))
    gap = (ours["peft_loaded"] - reference).abs().max().item()
    print(f"TP{tp} PEFT adapter -> Megatron: max |logit diff| {gap:.2e}")
    assert gap < 1e-5
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        base_only = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(TOKENS).logits
    assert (reference - base_only).abs().max().item() > 1e-2  # the adapter matters
    expected = _peft_grads(hf_dir, str(peft_dir))
    ours_grads = ours["peft_loaded_grads"]
    assert sorted(ours_grads) == sorted(expected) and len(expected) == 2 * 7 * 2
    grad_gap = max((ours_grads[name] - expected[name]).abs().max().item() for name in expected)
    print(f"TP{tp} adapter gradients vs PEFT's: max |diff| {grad_gap:.2e}")
    assert grad_gap < 1e-5 and min(g.abs().max().item() for g in expected.values()) > 1e-4

    assert ours["optimized"] == ours["adapter_names"] and ours["adapter_names"]
    assert ours["grad_buffer_params"] == len(ours["adapter_names"])
    assert ours["changed_after_one_step"] and all(".lora." in n for n in ours["changed_after_one_step"])
    assert ours["base_changed_after_ten"] == []
    held, planned = ours["adapter_elements"]
    assert held == planned
    assert ["shared"] in ours["adapters_a_shared"]  # linear_qkv and linear_fc1 share one A (lora_type lora)

    config = json.loads((saved_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    saved = _peft_logits(hf_dir, str(saved_dir))
    gap_saved = (ours["trained"] - saved).abs().max().item()
    print(f"TP{tp} hpc_rl adapter after 10 steps -> PEFT: max |logit diff| {gap_saved:.2e}")
    assert gap_saved < 1e-5
    assert (saved - base_only).abs().max().item() > 1e-3  # training moved the adapter
