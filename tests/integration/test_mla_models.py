"""Multi-latent attention models (DeepSeek-V3, GLM-4.7-Flash families) on real gloo ranks, against transformers.

Two tiny random checkpoints made by transformers, each with one MTP layer in DeepSeek's on-disk layout:
* `deepseek`: DeepseekV3ForCausalLM, 3 layers (dense, MoE, MoE), q latent, YaRN (factor 4, mscale 0.9,
  mscale_all_dim 0.8: every YaRN term matters), 4 experts in 2 groups;
* `glm`: Glm4MoeLiteForCausalLM, 2 layers, plain RoPE, one q projection (q_lora_rank null, Moonlight's form).

One launch of two ranks runs every layout in turn (Megatron's groups rebuilt in the same processes):
TP1 (DP 2): logits, MTP logits and the reference step's gradients (MTP training on); TP2 + SP: logits and MTP
logits, HF -> torch_dist; PP2 with uneven stages (2 + 1 layers, MTP on the last stage): the step's loss and
gradients equal the reference's, every rank gets every HF tensor for its colocated engine; CP2: the same;
EP2: HF -> torch_dist. slime's conversion line (torchrun tools/convert_hf_to_torch_dist.py with the model's
MODEL_ARGS) writes it at PP2 with uneven stages, and slime's reverse line (tools/convert_torch_dist_to_hf.py)
brings each conversion back: every tensor (MTP layers and DeepSeek's copies included) bit-exact. transformers' own
modules are the reference: the model for logits, its MtpModel (fed the checkpoint's MTP layer) for MTP logits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hpc_rl.process.child_process import planned_port
from hpc_rl.training.local_ranks import run_ranks
from tests.integration.grad_shards import gather_reduced_grads

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1]])
YARN = {"factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.9, "mscale_all_dim": 0.8,
        "beta_fast": 32.0, "beta_slow": 1.0}
COMMON = {"hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 4,
          "kv_channels": 16, "vocab_size": 24, "rotary_base": 10000.0, "norm_epsilon": 1e-6,
          "max_position_embeddings": 512, "tie_word_embeddings": False, "qk_layernorm": True, "num_moe_experts": 4,
          "moe_ffn_hidden_size": 32, "moe_router_topk": 2, "moe_shared_expert_intermediate_size": 32,
          "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
          "moe_router_topk_scaling_factor": 2.5, "multi_latent_attention": True, "kv_lora_rank": 16,
          "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "mtp_num_layers": 1}
ARCHS = {
    "deepseek": {**COMMON, "family": "deepseek_v3", "num_layers": 3, "moe_layer_freq": [0, 1, 1], "q_lora_rank": 32,
                 "moe_router_num_groups": 2, "moe_router_group_topk": 1, "rotary_scaling_factor": 4.0,
                 "original_max_position_embeddings": 128, "mscale": 0.9, "mscale_all_dim": 0.8},
    "glm": {**COMMON, "family": "glm4_moe_lite", "num_layers": 2, "moe_layer_freq": [0, 1], "q_lora_rank": None},
}
DEEPSEEK_FLAGS = ("--disable-bias-linear --num-layers 3 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
                  "--kv-channels 16 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
                  "--untie-embeddings-and-output-weights --vocab-size 24 --multi-latent-attention --q-lora-rank 32 "
                  "--kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm "
                  "--rotary-scaling-factor 4 --rotary-base 10000 --mscale 0.9 --mscale-all-dim 0.8 --num-experts 4 "
                  "--moe-layer-freq [0,1,1] --moe-ffn-hidden-size 32 --moe-router-topk 2 "
                  "--moe-shared-expert-intermediate-size 32 --moe-router-pre-softmax --moe-router-score-function sigmoid "
                  "--moe-router-enable-expert-bias --moe-router-group-topk 1 --moe-router-num-groups 2 "
                  "--moe-router-topk-scaling-factor 2.5 --mtp-num-layers 1")
"""The tiny DeepSeek's MODEL_ARGS, written as slime's scripts/models/deepseek-v3.sh writes DeepSeek-V3's (its
YaRN fields Megatron has no flag for come from config.json)."""


def make_models(root: Path) -> dict[str, tuple[str, str]]:
    """name -> (HF dir, architecture file)."""
    from hpc_rl.tiny_model import TinyMlaSpec, make_tiny_mla_model

    specs = {"deepseek": TinyMlaSpec(num_hidden_layers=3, yarn=YARN),
             "glm": TinyMlaSpec(family="glm4_moe_lite", q_lora_rank=None, n_group=1, topk_group=1)}
    out = {}
    for name, spec in specs.items():
        hf_dir = make_tiny_mla_model(root / name, spec)
        model_file = root / f"{name}.yaml"
        model_file.write_text(yaml.safe_dump(ARCHS[name]))
        out[name] = (str(hf_dir), str(model_file))
    return out


def _training(*, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, last_stage: int | None = None):
    from hpc_rl.config.sections.training import TrainingConfig

    return TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, pipeline_model_parallel_size=pp,
                          decoder_last_pipeline_num_layers=last_stage, expert_model_parallel_size=ep,
                          context_parallel_size=cp,
                          moe_token_dispatcher_type="alltoall", enable_mtp_training=True, global_batch_size=8,
                          micro_batch_size=2, qkv_format="thd")


def _reinit(training):
    from megatron.core import parallel_state

    from hpc_rl.training.parallel import init_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    return init_parallel(training, device="cpu")


def _gather_vocab(local: torch.Tensor, info, vocab: int) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    shards = [torch.empty_like(local) for _ in range(info.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., :vocab]


def _logits(arch, hf_dir: str, training, info) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, MTP depth-1 logits), full vocabulary."""
    from hpc_rl.training.model_provider import build_gpt_model, causal_mask, forward_logits
    from hpc_rl.weights.hf_import import load_hf_into_model

    model = build_gpt_model(arch, training)
    load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
    model.eval()
    with torch.no_grad():
        main = forward_logits(model, TOKENS)
        (mtp,) = model.mtp_logits(TOKENS, torch.arange(TOKENS.shape[1]).expand(TOKENS.shape[0], -1),
                                  causal_mask(TOKENS.shape[1]))
    return _gather_vocab(main, info, arch.vocab_size), _gather_vocab(mtp, info, arch.vocab_size)


def _step_grads(arch, hf_dir: str, training, info, *, colocated_export: bool = False) -> dict:
    """One training step with MTP training (rank's share of the batch): its metrics and the gradients after
    the reduction (global canonical names); with `colocated_export`, first every HF tensor as the colocated
    push hands them to this rank's engine."""
    from megatron.core import parallel_state

    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.weights.colocated_sender import ColocatedWeightSender
    from hpc_rl.weights.stage import global_named_params
    from tests.integration.test_trainer_step import make_batch

    parts = build_trainer(arch=arch, training=training, algorithm=AlgorithmConfig(entropy_coef=0.01),
                          optimizer_config=OptimizerConfig(lr=1e-2, clip_grad=0.0),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir), info=info)
    out: dict = {}
    if colocated_export:
        pp_group = parallel_state.get_pipeline_model_parallel_group() if info.pp_size > 1 else None
        sender = ColocatedWeightSender(parts.actor, arch, tp_group=None, tp_size=1, rank=info.rank,
                                       world_size=info.world_size, bucket_bytes=50_000,
                                       pp_size=info.pp_size, pp_rank=info.pp_rank, pp_group=pp_group)
        out["colocated"] = {name: tensor.clone() for meta in sender._planner.plan_buckets()
                            for source in meta.megatron_names for name, tensor in sender._planner.export_everywhere(source)}
    grads: dict[str, torch.Tensor] = {}
    reduce_then_norm = parts.optimizer.grad_norm

    def capture() -> float:  # after finalize_model_grads: the gradients the optimizer steps on
        gather_reduced_grads(parts.actor)
        grads.update({name: p.main_grad.clone() for name, p in global_named_params(parts.actor).items()
                      if getattr(p, "main_grad", None) is not None})
        return reduce_then_norm()

    parts.optimizer.grad_norm = capture
    batch = make_batch(5)
    share = len(batch) // info.dp_size
    out["metrics"] = parts.trainer.train_rollout(batch.select(range(info.dp_rank * share, (info.dp_rank + 1) * share)))[0]
    out["grads"] = grads
    return out


def layouts_rank(models: dict[str, tuple[str, str]], work: str) -> dict:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.training.convert import hf_to_torch_dist
    from hpc_rl.training.parallel import shutdown_parallel

    out: dict = {}
    archs = {name: ModelArchitecture.from_yaml(model_file) for name, (_, model_file) in models.items()}
    deepseek_dir, deepseek_file = models["deepseek"]
    for tag, training in (("tp1", _training()), ("tp2", _training(tp=2))):
        info = _reinit(training)
        for name, (hf_dir, _) in models.items():
            out[(tag, name, "logits")] = _logits(archs[name], hf_dir, training, info)
        if tag == "tp1":
            out[("tp1", "step")] = _step_grads(archs["deepseek"], deepseek_dir, training, info)
        else:
            hf_to_torch_dist(deepseek_dir, deepseek_file, f"{work}/tp2_torch_dist", tensor_parallel_size=2)
    training = _training(pp=2, last_stage=1)
    info = _reinit(training)
    out[("pp2", "step")] = _step_grads(archs["deepseek"], deepseek_dir, training, info, colocated_export=True)
    training = _training(cp=2)
    out[("cp2", "step")] = _step_grads(archs["deepseek"], deepseek_dir, training, _reinit(training))
    _reinit(_training(ep=2))
    hf_to_torch_dist(deepseek_dir, deepseek_file, f"{work}/ep2_torch_dist", expert_parallel_size=2)
    shutdown_parallel()
    for layout in ("tp2", "ep2"):  # where tools/convert_hf_to_torch_dist.py leaves the architecture
        Path(f"{work}/{layout}_torch_dist/model.yaml").write_text(Path(deepseek_file).read_text())
    return out


def _transformers_logits(hf_dir: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' logits and (DeepSeek-V3 family) its MtpModel's depth-1 logits at positions 0..s-2, the MTP
    layer filled from the checkpoint's on-disk names (transformers' own MTP loader looks for layer 61 only)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from hpc_rl.engines.cpu.weight_sync import named_tensors

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        outputs = hf(TOKENS, output_hidden_states=True)
        if not hasattr(hf.config, "num_mtp_layers"):  # Glm4MoeLite: transformers has no MTP module for it
            return outputs.logits, None
        mtp = MtpModel(hf, 1).eval()
        targets = named_tensors(mtp)
        own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "shared_head.norm.weight": "post_norm.weight"}
        prefix = f"model.layers.{hf.config.num_hidden_layers}."
        loaded = 0
        for name, tensor in load_file(f"{hf_dir}/model.safetensors").items():
            rest = name[len(prefix):]
            if name.startswith(prefix) and rest not in ("embed_tokens.weight", "shared_head.head.weight"):
                targets["layers.0." + own[rest] if rest in own else "layers.0.mtp_block." + rest].copy_(tensor)
                loaded += 1
        assert loaded == len([n for n in targets if n.startswith("layers.0.") and ".experts.gate_up_proj" not in n
                              and ".experts.down_proj" not in n])
        positions = torch.arange(TOKENS.shape[1]).expand(TOKENS.shape[0], -1)
        hidden = mtp.forward_layer(0, outputs.hidden_states[-1][:, :-1], positions[:, 1:], None,
                                   input_ids=TOKENS[:, 1:])
        return outputs.logits, mtp._project_to_logits(hidden)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_mla_families_match_transformers_across_layouts_and_convert_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models = make_models(tmp_path)
    ranks = run_ranks(layouts_rank, 2, models, str(tmp_path), timeout=900)

    for name, (hf_dir, _) in models.items():
        expected, expected_mtp = _transformers_logits(hf_dir)
        for tag in ("tp1", "tp2"):
            for rank in ranks:
                logits, mtp = rank[(tag, name, "logits")]
                assert _max_diff(logits, expected) < 1e-4, (name, tag)
                if expected_mtp is not None:
                    assert _max_diff(mtp[:, :-1], expected_mtp) < 1e-4, (name, tag, "mtp")
    plain_rope = _transformers_logits(models["glm"][0])[0]
    assert _max_diff(ranks[0][("tp1", "glm", "logits")][0], plain_rope) < 1e-4

    reference = {**ranks[0][("tp1", "step")]["grads"]}  # DP 2: both ranks hold the same reduced gradients
    assert reference.keys() == ranks[1][("tp1", "step")]["grads"].keys()
    staged = {}
    for rank in ranks:
        step = rank[("pp2", "step")]
        for metric in ("loss", "pg_loss", "entropy_loss", "mtp_1_loss", "grad_norm"):
            assert abs(step["metrics"][metric] - ranks[0][("tp1", "step")]["metrics"][metric]) < 1e-5, metric
        staged.update(step["grads"])
    assert set(staged) == set(reference) and any(n.startswith("mtp.layers.0.") for n in staged)
    for param, grad in reference.items():
        assert _max_diff(staged[param], grad) < 1e-6, param
    for rank in ranks:  # CP 2 (MLA's keys wider than its values; MTP targets across CP chunks)
        step = rank[("cp2", "step")]
        for metric in ("loss", "pg_loss", "mtp_1_loss", "grad_norm"):
            expected_value = ranks[0][("tp1", "step")]["metrics"][metric]
            assert abs(step["metrics"][metric] - expected_value) < 1e-5 * max(1.0, abs(expected_value)), ("cp2", metric)
        for param, grad in reference.items():
            assert _max_diff(step["grads"][param], grad) < 1e-4 * max(1.0, grad.abs().max().item()), ("cp2", param)
    assert reference["mtp.layers.0.eh_proj.weight"].abs().max() > 0  # the MTP layer learns ...
    original = load_file(str(Path(models["deepseek"][0]) / "model.safetensors"))
    synced = {n: t for n, t in original.items() if not n.endswith(("layers.3.embed_tokens.weight",
                                                                   "layers.3.shared_head.head.weight"))}
    for rank in ranks:  # ... and every rank hands every tensor (MTP layer included) to its colocated engine
        pushed = rank[("pp2", "step")]["colocated"]
        assert set(pushed) == set(synced)
        for hf_name, tensor in pushed.items():
            assert torch.equal(tensor, synced[hf_name]), hf_name

    forward = subprocess.run(  # slime's conversion line (MODEL_ARGS as scripts/models/deepseek-v3.sh), PP 2 uneven
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(planned_port()),
         str(ROOT / "tools/convert_hf_to_torch_dist.py"), *DEEPSEEK_FLAGS.split(), "--hf-checkpoint",
         models["deepseek"][0], "--save", str(tmp_path / "pp2_torch_dist"), "--pipeline-model-parallel-size", "2",
         "--decoder-last-pipeline-num-layers", "1"], capture_output=True, text=True, timeout=300)
    assert forward.returncode == 0, forward.stderr[-3000:]
    for layout in ("tp2", "pp2", "ep2"):  # slime's reverse line, once per conversion
        out_dir = tmp_path / f"{layout}_hf"
        subprocess.run([sys.executable, str(ROOT / "tools/convert_torch_dist_to_hf.py"), "--input-dir",
                        str(tmp_path / f"{layout}_torch_dist"), "--output-dir", str(out_dir), "--origin-hf-dir",
                        models["deepseek"][0]], check=True, timeout=300, capture_output=True)
        back = load_file(str(out_dir / "model.safetensors"))
        assert set(back) == set(original), layout
        for hf_name, tensor in back.items():
            assert torch.equal(tensor, original[hf_name]), (layout, hf_name)
