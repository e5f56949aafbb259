"""Pipeline parallelism (PP=2) on real gloo ranks:

- logits of every tiny family (tied and untied embeddings, GLM4's sandwich norms) and packed (THD)
  log-probs through the pipeline schedule equal HF's;
- a training rollout at PP=2 gives the PP=1 loss, metrics and updated weights; checkpoints
  reshard across PP both ways (PP=1 save -> PP=2 load, PP=2 save -> PP=1 resume + one more step);
- TP=2 x PP=2 with sequence parallel and DP=2 x PP=2 (4 ranks each) train like PP=1 too;
- weight export through the command loop at PP=2 reproduces the trainer's logits on a receiver.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.test_megatron_logits import PACKED, TOKENS, tiny_models
from tests.integration.test_megatron_weight_export import TOKENS as EXPORT_TOKENS
from tests.integration.test_megatron_weight_export import FakeControllerCommands, export_and_receive
from tests.integration.test_trainer_step import ARCH_FILE, make_batch

pytestmark = pytest.mark.slow


def pipeline_logits_rank(models: list[tuple[str, str, dict]]) -> dict | None:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.pipeline import PipelineSchedule
    from hpc_rl.weights.hf_import import load_hf_into_model

    training = TrainingConfig(pipeline_model_parallel_size=2)
    info = init_parallel(training)
    out: dict = {}
    for name, hf_dir, fields in models:
        arch = ModelArchitecture(**fields)
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
        model.eval()
        schedule = PipelineSchedule.for_model(model, device=info.device)
        padded = build_microbatch(TOKENS.tolist(), [TOKENS.shape[1] - 1] * 2, [0, 1], qkv_format="bshd")
        packed = build_microbatch(PACKED, [len(t) - 1 for t in PACKED], [0, 1, 2], qkv_format="thd")
        vocab = arch.vocab_size
        with torch.no_grad():
            logits = schedule.forward_only(model, [padded], lambda micro, logits, v=vocab: logits[..., :v].clone())
            log_probs = schedule.forward_only(
                model, [packed], lambda micro, logits, v=vocab: micro.response_logprobs(logits, vocab_size=v)[0])
        out[name] = (logits[0], log_probs[0]) if info.is_last_stage else None
    last = info.is_last_stage
    shutdown_parallel()
    return out if last else None


def test_pp2_logits_and_packed_logprobs_match_hf(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    models = tiny_models(tmp_path)
    first, last = run_ranks(pipeline_logits_rank, 2, models, timeout=240)
    assert first is None  # only the last stage has logits
    for name, hf_dir, _ in models:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        logits, packed = last[name]
        with torch.no_grad():
            assert (logits - hf(TOKENS).logits).abs().max().item() < 1e-4, name
            for sequence, got in zip(PACKED, packed):
                ids = torch.tensor([sequence])
                expected = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
                assert (got - expected).abs().max().item() < 1e-4, (name, len(sequence))


# ----------------------------------------------------------------------------- training


def _parts(hf_dir: str, *, pp: int = 1, tp: int = 1, load: str | None = None):
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel

    # 2 optimizer steps of 3 micro-batches each: 1F1B warm-up, steady state and cool-down all run
    training = TrainingConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                              global_batch_size=STEP_SAMPLES, num_steps_per_rollout=STEPS, micro_batch_size=2)
    info = init_parallel(training, device="cpu")
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01,
                                eps_clip=0.2, eps_clip_high=0.28)
    optimizer = OptimizerConfig(lr=1e-3, clip_grad=0.5, weight_decay=0.01, lr_warmup_iters=0)
    checkpoints = CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir, load=load)
    arch = ModelArchitecture.from_yaml(ARCH_FILE)
    parts = build_trainer(arch=arch, training=training, algorithm=algorithm, optimizer_config=optimizer,
                          checkpoints=checkpoints, info=info, model_file=ARCH_FILE)
    return parts, info


def _hf_params(parts, info) -> dict[str, torch.Tensor]:
    """This stage's weights under HF names (full tensors; TP gathered), on TP and DP rank 0 (else empty)."""
    from megatron.core import parallel_state

    from hpc_rl.weights.export import export_hf_state_dict

    group = parallel_state.get_tensor_model_parallel_group() if info.tp_size > 1 else None
    params = {name: t.clone() for name, t in export_hf_state_dict(parts.actor, parts.trainer.arch, group)}
    return params if info.tp_rank == 0 and info.dp_rank == 0 else {}


STEPS, STEP_SAMPLES = 2, 6


def _rollout(seed: int, info):
    """Rollout `seed` (12 samples, 2 steps of 6); a DP rank takes its half of each step, so a DP=2 step
    trains the same 6 samples as a DP=1 step."""
    batch = make_batch(seed, n=STEPS * STEP_SAMPLES)
    share = STEP_SAMPLES // info.dp_size
    return batch.select([step * STEP_SAMPLES + info.dp_rank * share + i for step in range(STEPS) for i in range(share)])


def train_rank(hf_dir: str, pp: int, tp: int, save_dir: str | None, load_dir: str | None) -> dict:
    """Train rollout 0 from HF weights (and save), then optionally load `load_dir` into a fresh trainer."""
    from hpc_rl.training.checkpoint import TrainerState, save_checkpoint
    from hpc_rl.training.parallel import shutdown_parallel

    parts, info = _parts(hf_dir, pp=pp, tp=tp)
    metrics = parts.trainer.train_rollout(_rollout(0, info))
    out = {"metrics": metrics, "params": _hf_params(parts, info), "stage": info.pp_rank}
    if save_dir:
        save_checkpoint(save_dir, parts.actor, parts.optimizer, TrainerState(rollout_id=0))
        out["next"] = parts.trainer.train_rollout(_rollout(1, info))  # continues from the saved state
        out["next_params"] = _hf_params(parts, info)
    if load_dir:
        loaded, _ = _parts(hf_dir, pp=pp, tp=tp, load=load_dir)
        assert loaded.resumed is not None and loaded.resumed.rollout_id == 0
        out["loaded_params"] = _hf_params(loaded, info)
        out["loaded_next"] = loaded.trainer.train_rollout(_rollout(1, info))
        out["loaded_next_params"] = _hf_params(loaded, info)
    shutdown_parallel()
    return out


def _union(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert not set(merged) & set(result[key])  # every tensor lives on exactly one stage
        merged.update(result[key])
    return merged


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tolerance: float) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert (got[name] - value).abs().max().item() <= tolerance, name


def _assert_same_metrics(got: list[dict], want: list[dict], tolerance: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step_got, step_want in zip(got, want):
        for key in ("loss", "pg_loss", "kl_loss", "entropy_loss", "ppo_kl", "pg_clipfrac", "grad_norm", "lr", "samples"):
            if key in step_want:
                assert abs(step_got[key] - step_want[key]) <= tolerance * max(1.0, abs(step_want[key])), key


def test_pp2_training_matches_pp1_and_checkpoints_reshard(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf"))
    pp1_dir, pp2_dir = str(tmp_path / "ckpt_pp1"), str(tmp_path / "ckpt_pp2")
    (single,) = run_ranks(train_rank, 1, hf_dir, 1, 1, pp1_dir, None, timeout=240)
    assert single["metrics"][1]["kl_loss"] > 0  # the second step trained on moved weights
    staged = run_ranks(train_rank, 2, hf_dir, 2, 1, pp2_dir, pp1_dir, timeout=240)
    # Metrics are the last stage's, on every rank (global rank 0 reports them).
    untimed = [[{k: v for k, v in m.items() if k not in ("step_time", "tokens_per_second")} for m in r["metrics"]]
               for r in staged]
    assert untimed[0] == untimed[1]
    _assert_same_metrics(staged[0]["metrics"], single["metrics"])
    _assert_same_metrics(staged[0]["next"], single["next"])
    _assert_close(_union(staged, "params"), single["params"], 1e-5)
    _assert_close(_union(staged, "next_params"), single["next_params"], 1e-5)
    # PP=1 checkpoint (weights + AdamW moments) -> PP=2: the same weights, the same next step.
    _assert_close(_union(staged, "loaded_params"), single["params"], 1e-7)
    _assert_same_metrics(staged[0]["loaded_next"], single["next"])
    _assert_close(_union(staged, "loaded_next_params"), single["next_params"], 1e-5)
    # PP=2 checkpoint -> PP=1.
    (resumed,) = run_ranks(train_rank, 1, hf_dir, 1, 1, None, pp2_dir, timeout=240)
    _assert_close(resumed["loaded_params"], _union(staged, "params"), 1e-7)
    _assert_same_metrics(resumed["loaded_next"], staged[0]["next"])
    _assert_close(resumed["loaded_next_params"], _union(staged, "next_params"), 1e-5)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2_pp2_sp", "dp2_pp2"])
def test_four_rank_grids_match_pp1(tmp_path: Path, tp: int) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf"))
    (single,) = run_ranks(train_rank, 1, hf_dir, 1, 1, None, None, timeout=240)
    grid = run_ranks(train_rank, 4, hf_dir, 2, tp, None, None, timeout=300)
    for result in grid:
        _assert_same_metrics(result["metrics"], single["metrics"])
    _assert_close(_union(grid, "params"), single["params"], 1e-5)


# ----------------------------------------------------------------------------- weight export


def export_trainer_rank(hf_dir: str, plan_file: str):
    import os

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.commands import TrainerCommands
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.pipeline import PipelineSchedule
    from hpc_rl.training.sync_address import TRAINER_NODE_ADDRESSES_ENV

    os.environ[TRAINER_NODE_ADDRESSES_ENV] = "127.0.0.1"  # as the driver passes it
    training = TrainingConfig(pipeline_model_parallel_size=2)
    info = init_parallel(training)
    arch = ModelArchitecture.from_yaml(ARCH_FILE)
    parts = build_trainer(arch=arch, training=training, algorithm=AlgorithmConfig(), optimizer_config=OptimizerConfig(),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir), info=info)
    torch.manual_seed(123 + info.rank)  # move away from the HF file: the receiver must get the *current* weights
    with torch.no_grad():
        for param in parts.actor.parameters():
            param.add_(0.05 * torch.randn_like(param))
        if info.is_first_stage:  # keep the tied copies equal, as training does
            embedding = parts.actor.module.embedding.word_embeddings.weight.detach().clone()
        else:
            embedding = torch.empty_like(parts.actor.module.output_layer.weight)
        torch.distributed.broadcast(embedding, src=0)
        if info.is_last_stage:
            parts.actor.module.output_layer.weight.copy_(embedding)
    source = FakeControllerCommands(plan_file, info.rank)
    TrainerCommands(parts, arch=arch, info=info, source=source, save_dir=None).run()
    assert source.metrics[0]["buckets"] > 2
    parts.actor.eval()
    micro = build_microbatch(EXPORT_TOKENS.tolist(), [7, 7], [0, 1], qkv_format="bshd")
    with torch.no_grad():
        logits = PipelineSchedule.for_model(parts.actor, device=info.device).forward_only(
            parts.actor, [micro], lambda micro, logits: logits[..., : arch.vocab_size].clone())
    shutdown_parallel()
    return logits[0] if logits else None


def test_pp2_weight_export_reproduces_trainer_logits(tmp_path: Path) -> None:
    trainer_logits, received = export_and_receive(export_trainer_rank, 2, 1, tmp_path)  # logits on the last stage
    assert (trainer_logits - received).abs().max().item() < 1e-4
