"""Megatron MoE models (Qwen3-MoE, GLM-4.5 MoE) on real gloo ranks, against transformers and across layouts.

Tiny random checkpoints made by transformers (layer 0 dense, layer 1 MoE: 4 experts, top-2; GLM adds a
shared expert, the sigmoid router with a non-zero e_score_correction_bias and a scaling factor, partial
rotary and QKV bias). Three process launches, each checking everything it can:

* 4 ranks: TP2 x EP2 (ETP 2 then slime's ETP 1, sequence parallel, alltoall): logits equal transformers';
  at ETP 1 one optimizer step, every rank exporting every HF tensor (the colocated path's export), and
  HF -> torch_dist conversion; then PP2 x EP2 (stage 0 holds the dense layer, stage 1 the MoE layer): the
  same step, each stage exporting its tensors;
* EP2 (2 ranks, alltoall): the same step, export and conversion, and a full checkpoint (weights, AdamW
  state, expert bias);
* EP1 (1 rank): the reference step; torch_dist -> HF of both conversions is bit-exact; the EP2 checkpoint
  loads at EP1 with the same weights, expert bias and AdamW moments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1]])
COMMON = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
          "kv_channels": 16, "vocab_size": 24, "rotary_base": 1_000_000.0, "norm_epsilon": 1e-6,
          "max_position_embeddings": 512, "num_moe_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
          "moe_layer_freq": [0, 1]}
ARCHS = {
    "qwen3_moe": {**COMMON, "family": "qwen3_moe", "qk_layernorm": True, "tie_word_embeddings": True},
    "glm4_moe": {**COMMON, "family": "glm4_moe", "add_qkv_bias": True, "rotary_percent": 0.5,
                 "tie_word_embeddings": False, "moe_router_score_function": "sigmoid",
                 "moe_router_enable_expert_bias": True, "moe_router_topk_scaling_factor": 2.5,
                 "moe_shared_expert_intermediate_size": 32},
}
STEP_METRICS = ("loss", "pg_loss", "entropy_loss", "kl_loss", "grad_norm")


def make_models(root: Path) -> dict[str, tuple[str, str]]:
    """family -> (HF dir, architecture file)."""
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    specs = {"qwen3_moe": TinyMoeSpec(dense_layers=1, tie_word_embeddings=True),
             "glm4_moe": TinyMoeSpec(family="glm4_moe", dense_layers=1, routed_scaling_factor=2.5,
                                     tie_word_embeddings=False)}
    out = {}
    for family, spec in specs.items():
        hf_dir = make_tiny_moe_model(root / family, spec)
        model_file = root / f"{family}.yaml"
        model_file.write_text(yaml.safe_dump(ARCHS[family]))
        out[family] = (str(hf_dir), str(model_file))
    return out


def _training(tp: int, ep: int, etp: int | None, pp: int = 1):
    from hpc_rl.config.sections.training import TrainingConfig

    return TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                          pipeline_model_parallel_size=pp,
                          expert_tensor_parallel_size=etp, moe_token_dispatcher_type="alltoall", global_batch_size=8,
                          micro_batch_size=2, qkv_format="thd")


def _reinit(training) -> object:
    """Megatron's groups for `training` in the already-joined world (a new layout in the same processes)."""
    from megatron.core import parallel_state

    from hpc_rl.training.parallel import init_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    return init_parallel(training, device="cpu")


def _logits(arch, hf_dir: str, training, info) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.weights.hf_import import load_hf_into_model

    model = build_gpt_model(arch, training)
    load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size,
                       expert_tp_rank=info.expert_tp_rank, expert_tp_size=info.expert_tp_size)
    model.eval()
    with torch.no_grad():
        local = forward_logits(model, TOKENS)
    shards = [torch.empty_like(local) for _ in range(info.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., : arch.vocab_size]


def _build(arch, hf_dir: str, training, info, load: str | None = None):
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig
    from hpc_rl.training.actor import build_trainer

    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01)
    return build_trainer(arch=arch, training=training, algorithm=algorithm,
                         optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01),
                         checkpoints=CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir, load=load), info=info)


def _exported(parts, arch, info) -> dict[str, torch.Tensor]:
    """Every HF tensor, on this rank (a collective over TP and the expert replica, as the colocated sync)."""
    from megatron.core import parallel_state

    from hpc_rl.weights.export import ExpertLayout, export_hf_state_dict

    tp_group = parallel_state.get_tensor_model_parallel_group() if info.tp_size > 1 else None
    exported = export_hf_state_dict(parts.actor, arch, tp_group, ExpertLayout.current(arch))
    return {name: tensor.clone() for name, tensor in exported}


def _moments(parts) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg of each parameter this rank holds, by global canonical name."""
    from hpc_rl.weights.stage import global_named_params

    return {name: parts.optimizer.moments(p)["exp_avg"].clone() for name, p in global_named_params(parts.actor).items()
            if p.requires_grad}


def _step(parts, info) -> dict[str, float]:
    from tests.integration.test_trainer_step import make_batch

    batch = make_batch(5)
    share = len(batch) // info.dp_size
    return parts.trainer.train_rollout(batch.select(range(info.dp_rank * share, (info.dp_rank + 1) * share)))[0]


def layout_rank(models: dict[str, tuple[str, str]],
                layouts: list[tuple[int, int, int | None, int, tuple[str, ...]]], work: str) -> dict:
    """For each (tp, ep, etp, pp, checks) in turn: the checks ("logits", "step", "convert", "save") per family."""
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.training.checkpoint import TrainerState, save_checkpoint
    from hpc_rl.training.convert import hf_to_torch_dist
    from hpc_rl.training.parallel import shutdown_parallel

    out: dict = {}
    for tp, ep, etp, pp, checks in layouts:
        training = _training(tp, ep, etp, pp)
        info = _reinit(training)
        tag = f"tp{tp}_ep{ep}_etp{etp or tp}" + (f"_pp{pp}" if pp > 1 else "")
        for family, (hf_dir, model_file) in models.items():
            arch = ModelArchitecture.from_yaml(model_file)
            if "logits" in checks:
                out[(tag, family, "logits")] = _logits(arch, hf_dir, training, info)
            if "step" in checks:
                parts = _build(arch, hf_dir, training, info)
                out[(tag, family, "metrics")] = _step(parts, info)
                out[(tag, family, "params")] = _exported(parts, arch, info)
                if "save" in checks:
                    save_checkpoint(f"{work}/{tag}_{family}_ckpt", parts.actor, parts.optimizer,
                                    TrainerState(rollout_id=1))
            if "convert" in checks:
                hf_to_torch_dist(hf_dir, model_file, f"{work}/{tag}_{family}_torch_dist", tensor_parallel_size=tp,
                                 expert_parallel_size=ep, expert_tensor_parallel_size=etp)
    shutdown_parallel()
    return out


def reference_rank(models: dict[str, tuple[str, str]], work: str, converted: list[str]) -> dict:
    """EP1: the reference step; torch_dist -> HF of the conversions; the EP2 checkpoint loaded at EP1."""
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.training.convert import torch_dist_to_hf
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel

    training = _training(1, 1, None)
    info = init_parallel(training, device="cpu")
    out: dict = {}
    for family, (hf_dir, model_file) in models.items():
        arch = ModelArchitecture.from_yaml(model_file)
        out[("ep1", family, "logits")] = _logits(arch, hf_dir, training, info)
        parts = _build(arch, hf_dir, training, info)
        out[("ep1", family, "metrics")] = _step(parts, info)
        out[("ep1", family, "params")] = _exported(parts, arch, info)
        out[("ep1", family, "moments")] = _moments(parts)
        resumed = _build(arch, hf_dir, training, info, load=f"{work}/tp1_ep2_etp1_{family}_ckpt")
        out[("resumed", family, "params")] = _exported(resumed, arch, info)
        out[("resumed", family, "moments")] = _moments(resumed)
        for tag in converted:
            torch_dist_to_hf(f"{work}/{tag}_{family}_torch_dist", model_file, f"{work}/{tag}_{family}_hf",
                             hf_reference=hf_dir)
    shutdown_parallel()
    return out


def _close(a: torch.Tensor | float, b: torch.Tensor | float, tolerance: float) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and (a - b).abs().max().item() < tolerance
    return abs(a - b) < tolerance * max(1.0, abs(b))


def test_moe_families_match_transformers_and_agree_across_ep_tp_etp(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    models = make_models(tmp_path)
    work = str(tmp_path)
    wide = run_ranks(layout_rank, 4, models, [(2, 2, None, 1, ("logits",)), (2, 2, 1, 1, ("logits", "step", "convert")),
                                              (1, 2, None, 2, ("step",))], work, timeout=900)
    ep2 = run_ranks(layout_rank, 2, models, [(1, 2, None, 1, ("logits", "step", "convert", "save"))], work, timeout=400)
    converted = ["tp2_ep2_etp1", "tp1_ep2_etp1"]
    reference = run_ranks(reference_rank, 1, models, work, converted, timeout=400)[0]

    for family, (hf_dir, _) in models.items():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf(TOKENS).logits
        logits = [reference[("ep1", family, "logits")]] + [
            out[(tag, family, "logits")] for outs, tag in ((wide, "tp2_ep2_etp2"), (wide, "tp2_ep2_etp1"),
                                                             (ep2, "tp1_ep2_etp1")) for out in outs]
        for got in logits:
            assert _close(got, expected, 1e-4), (family, (got - expected).abs().max().item())

        base_metrics, base_params = reference[("ep1", family, "metrics")], reference[("ep1", family, "params")]
        assert base_metrics["grad_norm"] > 0
        original = load_file(str(Path(hf_dir) / "model.safetensors"))
        tied = {"lm_head.weight"} if ARCHS[family]["tie_word_embeddings"] else set()
        assert set(base_params) == set(original) - tied
        for tag, outs in (("tp2_ep2_etp1", wide), ("tp1_ep2_etp1", ep2), ("tp1_ep2_etp1_pp2", wide)):
            for rank, out in enumerate(outs):
                where = (family, tag, rank)
                for metric in STEP_METRICS:
                    assert _close(out[(tag, family, "metrics")][metric], base_metrics[metric], 1e-5), (*where, metric)
                params = out[(tag, family, "params")]
                if tag.endswith("pp2"):  # a stage's tensors: layer 0 (dense) on stage 0, layer 1 (MoE) on stage 1
                    assert any(".layers.1.mlp.experts.3." in name for name in params) == (rank >= 2), where
                else:
                    assert set(params) == set(base_params), where  # every expert on every rank
                for name, value in params.items():
                    assert _close(value, base_params[name], 1e-5), (*where, name)
        staged = set().union(*(out[("tp1_ep2_etp1_pp2", family, "params")] for out in wide))
        assert staged == set(base_params), family
        if family == "glm4_moe":  # Megatron moved the expert bias (aux-loss-free balancing) and it travelled
            bias = "model.layers.1.mlp.gate.e_score_correction_bias"
            assert not torch.equal(base_params[bias], original[bias])

        for name, value in reference[("resumed", family, "params")].items():  # EP2 checkpoint -> EP1
            assert _close(value, ep2[0][("tp1_ep2_etp1", family, "params")][name], 1e-7), (family, name)
        resumed_moments, base_moments = reference[("resumed", family, "moments")], reference[("ep1", family, "moments")]
        assert set(resumed_moments) == set(base_moments)
        for name, value in base_moments.items():
            assert _close(resumed_moments[name], value, 1e-5), (family, "exp_avg", name)

        for tag in converted:  # HF -> torch_dist at TP2 x EP2 and EP2 -> HF: bit-exact
            back = load_file(f"{work}/{tag}_{family}_hf/model.safetensors")
            assert set(back) == set(base_params), (family, tag)
            for name, tensor in back.items():
                assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), (family, tag, name)
