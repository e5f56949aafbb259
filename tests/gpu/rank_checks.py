"""What the GPU checks run inside fresh trainer ranks (`hpc_rl.training.local_ranks.run_ranks`); each returns
plain numbers for the test to assert on. Never imported without CUDA (the tests skip first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "configs" / "models" / "tiny_qwen3.yaml"
TINY_CHECKPOINT = REPO / "assets" / "tiny_qwen3"


def _tiny(training_overrides: dict[str, Any] | None = None):
    import torch

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.parallel import init_parallel

    training = TrainingConfig(**(training_overrides or {}))
    info = init_parallel(training, device="cuda")
    arch = ModelArchitecture.from_yaml(TINY_MODEL)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    return torch, arch, training, info, tokens


def te_local_and_transformers_log_probs() -> dict[str, float]:
    """The tiny checkpoint through Transformer Engine's layer spec, Megatron's local spec and transformers
    (all float32 on the GPU): the largest log-prob differences."""
    torch, arch, training, info, tokens = _tiny()
    from transformers import AutoModelForCausalLM

    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.weights.hf_import import load_hf_into_model

    log_probs = {}
    for name, device in (("te", "cuda"), ("local", "cpu")):  # device "cpu" picks the local spec; it runs on CUDA
        model = build_gpt_model(arch, training, params_dtype=torch.float32, device=device).cuda().eval()
        load_hf_into_model(model, TINY_CHECKPOINT, arch, tp_rank=0, tp_size=1)
        with torch.no_grad():
            log_probs[name] = forward_logits(model, tokens)[..., :arch.vocab_size].float().log_softmax(-1)
    reference = AutoModelForCausalLM.from_pretrained(TINY_CHECKPOINT, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        log_probs["hf"] = reference(tokens).logits.float().log_softmax(-1)
    shutdown_parallel()
    return {"te_vs_local": (log_probs["te"] - log_probs["local"]).abs().max().item(),
            "te_vs_transformers": (log_probs["te"] - log_probs["hf"]).abs().max().item()}


def megatron_optimizer_steps() -> dict[str, Any]:
    """`optimizer.ActorOptimizer` (Megatron's distributed optimizer, bf16 params): two steps of a loss that
    rewards one token; its log-prob must rise, the parameters change and stay finite, the state round-trips."""
    torch, arch, training, info, tokens = _tiny()
    from hpc_rl.config.sections.training import OptimizerConfig
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.optimizer import ActorOptimizer, wrap_ddp
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.weights.hf_import import load_hf_into_model

    actor = wrap_ddp(build_gpt_model(arch, training, device="cuda"), distributed_optimizer=True)
    load_hf_into_model(actor.module, TINY_CHECKPOINT, arch, tp_rank=0, tp_size=1)
    optimizer = ActorOptimizer(actor, OptimizerConfig(lr=1e-2))
    optimizer.reload_model_params()  # the loaded weights into the fp32 main copies
    before = [p.detach().float().clone() for p in actor.parameters()]

    def target_log_prob() -> torch.Tensor:
        return forward_logits(actor, tokens)[..., :arch.vocab_size].float().log_softmax(-1)[..., 7].mean()

    start = target_log_prob().item()
    for _ in range(2):
        optimizer.zero_grad()
        loss = -target_log_prob()
        loss.backward()
        optimizer.step()
    end = target_log_prob().item()
    changed = sum(bool((p.detach().float() - b).abs().max() > 0) for p, b in zip(actor.parameters(), before))
    finite = all(torch.isfinite(p).all().item() for p in actor.parameters())
    state = optimizer.sharded_state(actor.sharded_state_dict())  # what a checkpoint saves
    dtype = str(next(actor.parameters()).dtype)
    shutdown_parallel()
    return {"start": start, "end": end, "changed": changed, "params": len(before), "finite": finite,
            "steps": optimizer.steps_done, "state_keys": sorted(state)[:5], "dtype": dtype}


def bf16_export() -> dict[str, Any]:
    """The weight export on GPU: every HF tensor in bfloat16 (the engines' dtype), equal to the checkpoint's
    values rounded to bfloat16."""
    torch, arch, training, info, tokens = _tiny()
    from safetensors.torch import load_file

    from hpc_rl.training.commands import export_dtype
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.weights.export import export_hf_state_dict
    from hpc_rl.weights.hf_import import load_hf_into_model

    model = build_gpt_model(arch, training, params_dtype=torch.float32, device="cuda").cuda()
    load_hf_into_model(model, TINY_CHECKPOINT, arch, tp_rank=0, tp_size=1)
    exported = {name: tensor.to(export_dtype(on_cpu=False)) for name, tensor in export_hf_state_dict(model, arch)}
    reference = load_file(str(TINY_CHECKPOINT / "model.safetensors"))
    worst = max((exported[name].float().cpu() - reference[name].to(torch.bfloat16).float()).abs().max().item()
                for name in reference if name in exported)
    shutdown_parallel()
    return {"dtypes": sorted({str(t.dtype) for t in exported.values()}), "worst": worst,
            "missing": sorted(set(reference) - set(exported))}


def nccl_weight_group(rank_port: int) -> dict[str, Any]:
    """Two processes on two GPUs join a weight-update group over NCCL (as trainer rank 0 and an engine);
    rank 0 broadcasts a bucket; `wait()` does not block the CPU (CollectiveStream, NCCL side)."""
    import os
    import time

    import torch
    import torch.distributed as dist

    from hpc_rl.weights.collective_stream import CollectiveStream
    from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    os.environ["NCCL_CUMEM_ENABLE"] = "0"
    group = init_weight_update_group(master_address="127.0.0.1", master_port=rank_port, rank=rank, world_size=2,
                                     group_name="gpu_check", backend="nccl", timeout_seconds=120,
                                     device_id=f"local/gpu{rank}")
    bucket = torch.arange(1 << 20, dtype=torch.float32, device="cuda") if rank == 0 else \
        torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
    stream = CollectiveStream("nccl", timeout_s=120)
    start = time.monotonic()
    work = dist.broadcast(bucket, src=0, group=group, async_op=True)
    stream.wait(work)
    waited = time.monotonic() - start
    torch.cuda.synchronize()
    ok = bool(torch.equal(bucket.cpu(), torch.arange(1 << 20, dtype=torch.float32)))
    destroy_weight_update_group(group)
    return {"equal": ok, "wait_s": waited}
