"""Context parallelism on gloo ranks: packed log-probs equal HF's for sequences of several lengths
(tiny Qwen3, and GLM4 with its half-dim interleaved rotary) at CP=2, through both paths of the CPU
CP attention (one block-masked call, and per sequence), and at TP=2 + SP x CP=2 (4 ranks); a CP=2
training step gives the loss, the reduced gradients and the updated weights of CP=1 on the same
batch (fixed micro-batches and token-packed ones). Also: the layout matches the rotary slice
Megatron takes per CP rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.grad_shards import gather_reduced_grads
from tests.integration.test_megatron_logits import tiny_models
from tests.integration.test_trainer_step import _parts, make_batch

pytestmark = pytest.mark.slow
SEQUENCES = [[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8], [2, 9, 4, 21], [7, 7],
             [5, 1, 22, 3, 8, 13, 2, 6, 11]]  # padded to multiples of 4: 12 + 8 + 4 + 4 + 12


def test_layout_matches_megatron_rotary_slice_per_cp_rank() -> None:
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    from hpc_rl.training.context_parallel import local_positions, packed_lengths

    for cp_size in (2, 4):
        _, padded = packed_lengths([5, 12, 1, 30], cp_size)
        freqs = torch.arange(max(padded)).view(-1, 1, 1, 1)  # "frequency" of position p = p
        for rank in range(cp_size):
            expected = torch.cat([_get_thd_freqs_on_this_cp_rank(rank, cp_size, torch.empty(n // cp_size), freqs)
                                  for n in padded]).flatten().tolist()
            assert local_positions(padded, cp_size, rank) == expected


def cp_logprobs_rank(models: list[tuple[str, str, dict]], tp: int) -> dict | None:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.layer_specs import PackedSequenceAttention
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.hf_import import load_hf_into_model

    training = TrainingConfig(context_parallel_size=2, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    info = init_parallel(training, device="cpu")
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    assert (info.cp_size, info.dp_size, info.tp_size, group.size()) == (2, 1, tp, 2)
    out: dict = {}
    for name, hf_dir, fields in models:
        arch = ModelArchitecture(**fields)
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size)
        model.eval()
        micro = build_microbatch(SEQUENCES, [len(t) - 1 for t in SEQUENCES], list(range(len(SEQUENCES))),
                                 cp_group=group, pad_multiple=tp)
        assert micro.tokens.shape == (1, 20)  # 40 padded tokens, half per CP rank
        results = []
        for block_limit in (2048, 8)[:3 - tp]:  # block mask, then per sequence
            PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS = block_limit
            with torch.no_grad():
                results.append(micro.response_logprobs(micro.forward(model), vocab_size=arch.vocab_size,
                                                       tp_group=tp_group, with_entropy=True))
        PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS = 2048
        out[name] = results
    shutdown_parallel()
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["cp2", "tp2_sp_cp2"])
def test_cp2_packed_logprobs_match_hf(tmp_path: Path, tp: int) -> None:
    from transformers import AutoModelForCausalLM

    models = [m for m in tiny_models(tmp_path) if m[0] in ("qwen3", "glm4")]
    ranks = run_ranks(cp_logprobs_rank, 2 * tp, models, tp, timeout=180)
    for name, hf_dir, _ in models:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        for sample, sequence in enumerate(SEQUENCES):
            ids = torch.tensor([sequence])
            with torch.no_grad():
                log_softmax = torch.log_softmax(hf(ids).logits[0, :-1], -1)
            expected = log_softmax.gather(-1, ids[0, 1:, None]).squeeze(-1)
            expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
            for rank, out in enumerate(ranks):
                for path, (log_probs, entropy) in zip(("block", "per-sequence"), out[name]):
                    where = (name, len(sequence), rank, path)
                    assert (log_probs[sample] - expected).abs().max().item() < 1e-5, where
                    assert (entropy[sample] - expected_entropy).abs().max().item() < 1e-5, where


def cp_train_rank(hf_dir: str, cp: int) -> dict:
    from megatron.core.distributed import finalize_model_grads

    from hpc_rl.training.optimizer import StepResult
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.step import RolloutTrainer
    from hpc_rl.weights.export import export_hf_state_dict

    parts, info = _parts(hf_dir, context_parallel_size=cp)
    assert info.cp_size == cp and info.dp_size == 1
    batch = make_batch(3)
    grads: list[dict[str, torch.Tensor]] = []

    def record_instead_of_step() -> StepResult:  # keep the reduced grads, leave the weights alone
        finalize_model_grads([parts.actor])
        gather_reduced_grads(parts.actor)  # each CP rank holds its shard of the reduced gradient
        grads.append({n: p.main_grad.clone() for n, p in parts.actor.named_parameters()})
        parts.optimizer.zero_grad()
        return StepResult(grad_norm=0.0, lr=0.0, skipped=True)

    real_step = parts.optimizer.step
    parts.optimizer.step = record_instead_of_step  # type: ignore[method-assign]
    recorded = parts.trainer.train_rollout(batch)[0]
    dynamic_training = type(parts.trainer.training)(global_batch_size=8, use_dynamic_batch_size=True,
                                                    max_tokens_per_gpu=12, context_parallel_size=cp)
    dynamic = RolloutTrainer(actor=parts.actor, optimizer=parts.optimizer, ref_model=parts.ref_model,
                             arch=parts.trainer.arch, training=dynamic_training, algorithm=parts.trainer.algorithm,
                             info=info)
    dynamic_bins = len(dynamic._step_microbatches(batch, range(len(batch))))
    dynamic_metrics = dynamic.train_rollout(batch)[0]
    parts.optimizer.step = real_step  # type: ignore[method-assign]
    first = parts.trainer.train_rollout(batch)[0]
    second = parts.trainer.train_rollout(make_batch(4))[0]
    params = {name: t.clone() for name, t in export_hf_state_dict(parts.actor, parts.trainer.arch, None)}
    shutdown_parallel()
    return {"recorded": recorded, "dynamic": dynamic_metrics, "dynamic_bins": dynamic_bins, "grads": grads,
            "first": first, "second": second, "params": params}


def test_cp2_training_step_equals_cp1(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf"))
    reference = run_ranks(cp_train_rank, 1, hf_dir, 1, timeout=120)[0]
    ranks = run_ranks(cp_train_rank, 2, hf_dir, 2, timeout=180)
    # CP packs max_tokens_per_gpu * cp tokens per micro-batch: fewer micro-batches than CP=1
    assert ranks[0]["dynamic_bins"] < reference["dynamic_bins"]
    for out in ranks:
        for key in ("recorded", "dynamic", "first", "second"):
            for metric in ("loss", "pg_loss", "entropy_loss", "kl_loss", "ppo_kl"):
                assert abs(out[key][metric] - reference[key][metric]) < 1e-6, (key, metric)
        assert out["first"]["grad_norm"] == pytest.approx(reference["first"]["grad_norm"], rel=1e-6)
        scale = max(g.abs().max().item() for g in reference["grads"][0].values())
        assert scale > 0
        for mine, theirs in zip(out["grads"], reference["grads"]):
            for name, grad in theirs.items():
                assert (mine[name] - grad).abs().max().item() < 1e-6 * max(1.0, scale), name
        for name, value in reference["params"].items():
            assert (out["params"][name] - value).abs().max().item() < 1e-5, name
    assert ranks[0]["second"]["kl_loss"] > 0  # the weights did move
