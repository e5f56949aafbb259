"""gpt-oss on Megatron's own layers against transformers' GptOssForCausalLM, on real gloo ranks.

The tiny random checkpoint (`hpc_rl.models.gpt_oss.tiny`: layer 0 sliding window of 4, layer 1 full, 4 experts
top-2 with biases, sinks, clamps that cut, YaRN truncate false) is loaded from its fused on-disk experts. One
2-rank launch checks, at TP1 (DP2), TP2 (sequence parallel, expert TP 1: Megatron builds expert biases at ETP 1
only) and EP2 (alltoall): logits within 1e-4 of
transformers' eager forward on 12-token rows (past the window), packed (THD) rows equal to each sample run
alone, every exported HF tensor bit-equal to the checkpoint's (per-expert names), and every tensor the weight
sync's sender packs (`WeightSender.bucket_tensors`: each layer's experts gathered over EP and fused) bit-equal to
the release's fused tensors, names and shapes as its plan announces (and what each colocated rank hands its
engine: `ColocatedWeightSender`'s buckets). The CPU engine
(transformers' GptOssForCausalLM behind `engines.cpu`, left-padded KV cache) generates from two prompts; its
log-probs of the prompt and of every generated token equal the trainer's on the same sequences. The converters
take the checkpoint to torch_dist at EP2 and back to HF bit-exact, experts fused again as released.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [1, 4, 9, 16, 23, 0, 8, 6, 5, 3, 2, 1]])
PACKED = [[3, 5, 7, 11, 13, 17, 19, 2, 4, 6, 8, 10], [9, 8, 7, 6, 5, 14, 15, 12]]  # lengths divide by TP (SP)
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, EP)


def _rank(hf_dir: str, model_file: str, engine_rows: list[list[int]]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights.export import ExpertLayout, export_hf_state_dict
    from hpc_rl.weights.hf_import import load_hf_into_model
    from hpc_rl.weights.colocated_sender import ColocatedWeightSender
    from hpc_rl.weights.sender import WeightSender

    arch = ModelArchitecture.from_yaml(model_file)
    out: dict = {}
    for tp, ep in LAYOUTS:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                  moe_token_dispatcher_type="alltoall",
                                  global_batch_size=8, micro_batch_size=2, qkv_format="thd")
        info = init_parallel(training, device="cpu")
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size,
                           expert_tp_rank=info.expert_tp_rank, expert_tp_size=info.expert_tp_size)
        model.eval()
        tp_group = parallel_state.get_tensor_model_parallel_group()

        def gathered(local: torch.Tensor) -> torch.Tensor:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
            return torch.cat(shards, dim=-1)[..., : arch.vocab_size]

        with torch.no_grad():
            out[(tp, ep, "logits")] = gathered(forward_logits(model, TOKENS))
            micro = build_microbatch(PACKED, [1, 1], [0, 1], qkv_format="thd", pad_multiple=tp)
            out[(tp, ep, "packed")] = gathered(micro.forward(model))[0, : sum(map(len, PACKED))]
            out[(tp, ep, "alone")] = [gathered(forward_logits(model, torch.tensor([row])))[0] for row in PACKED]
            if (tp, ep) == (1, 1):
                out["engine_rows"] = [gathered(forward_logits(model, torch.tensor([row])))[0] for row in engine_rows]
                from hpc_rl.training.layer_specs import PackedSequenceAttention

                PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS = 8  # long rows: one attention call per sequence
                out["packed_per_sequence"] = gathered(micro.forward(model))[0, : sum(map(len, PACKED))]
                PackedSequenceAttention.BLOCK_MASK_MAX_TOKENS = 2048
        exported = export_hf_state_dict(model, arch, tp_group if tp > 1 else None, ExpertLayout.current(arch))
        out[(tp, ep, "export")] = {name: tensor.clone() for name, tensor in exported}
        sender = WeightSender(model, arch, tp_group=tp_group, tp_size=tp, dp_rank=info.dp_rank, rank=info.rank,
                              bucket_bytes=1 << 16)  # what a broadcast sync packs, bucket by bucket (EP: gathered)
        plan = sender.plan_buckets()
        sent = [pair for index in range(len(plan)) for pair in sender.bucket_tensors(index)]
        if info.rank == 0:
            out[(tp, ep, "sent")] = {name: tensor.clone() for name, tensor in sent}
            out[(tp, ep, "plan")] = [(n, tuple(s)) for meta in plan for n, s in zip(meta.names, meta.shapes)]
        colocated = ColocatedWeightSender(model, arch, tp_group=tp_group, tp_size=tp, rank=info.rank, world_size=2,
                                          bucket_bytes=1 << 16)  # every rank: what it hands its colocated engine
        out[(tp, ep, "colocated")] = {name: tensor.clone() for index in range(len(plan))
                                      for name, tensor in colocated._planner.export_bucket_everywhere(index)}
    shutdown_parallel()
    return out


def _engine_generation(hf_dir: str, prompts: tuple[list[int], ...] = ([3, 5, 7, 11, 13, 17, 19], [9, 8, 7]),
                       steps: int = 6) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The CPU engine's model and KV-cache path: prompts prefilled together (left-padded), `steps` greedy decode
    steps; each row's tokens and the log-probs of its tokens after the first."""
    from hpc_rl.engines.cpu.__main__ import load_model
    from hpc_rl.engines.cpu.kv_batch import decode_step, prefill

    model = load_model(hf_dir, "auto", "eager")
    batch, last, per_sequence = prefill(model, list(prompts), full_logits=True)
    rows = [list(p) for p in prompts]
    logprobs = [torch.log_softmax(seq[:-1].double(), -1).gather(-1, torch.tensor(p[1:])[:, None])[:, 0]
                for seq, p in zip(per_sequence, prompts)]
    for _ in range(steps):
        chosen = last.argmax(-1)
        step_logprobs = torch.log_softmax(last.double(), -1).gather(-1, chosen[:, None])[:, 0]
        for index, token in enumerate(chosen.tolist()):
            rows[index].append(token)
            logprobs[index] = torch.cat([logprobs[index], step_logprobs[index:index + 1]])
        batch, last = decode_step(model, batch, chosen)
    return rows, logprobs


def test_gpt_oss_matches_transformers_at_tp_ep_and_packed(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import GptOssForCausalLM

    from hpc_rl.models.gpt_oss.architecture import architecture_fields_from_hf
    from hpc_rl.models.gpt_oss.checkpoint import PerExpertReader
    from hpc_rl.models.gpt_oss.tiny import make_tiny
    from hpc_rl.weights.hf_import import HFTensorReader

    hf_dir = make_tiny(tmp_path / "gpt_oss")
    fields = architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text()))
    model_file = tmp_path / "gpt_oss.yaml"
    model_file.write_text(yaml.safe_dump({**fields, "make_vocab_size_divisible_by": 8}))
    reference = GptOssForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(TOKENS).logits
    per_expert = PerExpertReader(HFTensorReader(hf_dir))
    checkpoint = {name: per_expert[name] for name in per_expert.keys()}
    release = load_file(str(hf_dir / "model.safetensors"))  # experts fused: what SGLang's loader reads

    engine_rows, engine_logprobs = _engine_generation(str(hf_dir))
    results = run_ranks(_rank, 2, str(hf_dir), str(model_file), engine_rows, timeout=600)
    for row, engine, trainer in zip(engine_rows, engine_logprobs, results[0]["engine_rows"]):
        ours = torch.log_softmax(trainer[:-1].double(), -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0]
        gap = (ours - engine).abs().max().item()
        assert gap < 1e-4, f"CPU engine log-probs differ from the trainer's by {gap}"
    for tp, ep in LAYOUTS:
        for rank_out in results:
            gap = (rank_out[(tp, ep, "logits")] - expected).abs().max().item()
            assert gap < 1e-4, f"TP{tp} EP{ep}: logits differ from transformers' by {gap}"
            packed, alone = rank_out[(tp, ep, "packed")], torch.cat(rank_out[(tp, ep, "alone")])
            assert (packed - alone).abs().max().item() < 1e-5, f"TP{tp} EP{ep}: packed rows see their neighbour"
            if (tp, ep) == (1, 1):
                gap = (rank_out["packed_per_sequence"] - alone).abs().max().item()
                assert gap < 1e-5, f"packed rows run per sequence differ by {gap}"
        exported = results[0][(tp, ep, "export")]
        assert set(exported) == set(checkpoint), f"TP{tp} EP{ep}: {set(exported) ^ set(checkpoint)}"
        unequal = [name for name in checkpoint if not torch.equal(exported[name], checkpoint[name])]
        assert not unequal, f"TP{tp} EP{ep}: exported tensors differ from the checkpoint: {unequal[:4]}"
        sent, plan = results[0][(tp, ep, "sent")], results[0][(tp, ep, "plan")]
        assert [name for name, _ in plan] == list(sent) and set(sent) == set(release), set(sent) ^ set(release)
        unequal = [name for name, shape in plan if not (tuple(sent[name].shape) == shape
                                                       and torch.equal(sent[name], release[name]))]
        assert not unequal, f"TP{tp} EP{ep}: the sync's fused tensors differ from the release's: {unequal[:4]}"
        for rank_out in results:
            colocated = rank_out[(tp, ep, "colocated")]
            assert set(colocated) == set(release), set(colocated) ^ set(release)
            unequal = [name for name in release if not torch.equal(colocated[name], release[name])]
            assert not unequal, f"TP{tp} EP{ep}: the colocated sync's tensors differ from the release's: {unequal[:4]}"


def _to_torch_dist(hf_dir: str, model_file: str, out: str) -> None:
    from hpc_rl.training.convert import hf_to_torch_dist
    from hpc_rl.training.parallel import shutdown_parallel

    hf_to_torch_dist(hf_dir, model_file, out, expert_parallel_size=2, expert_tensor_parallel_size=1)
    shutdown_parallel()


def _to_hf(load_dir: str, model_file: str, out: str, reference: str) -> None:
    from hpc_rl.training.convert import torch_dist_to_hf
    from hpc_rl.training.parallel import shutdown_parallel

    torch_dist_to_hf(load_dir, model_file, out, hf_reference=reference)
    shutdown_parallel()


def test_gpt_oss_converters_round_trip_bit_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from hpc_rl.models.gpt_oss.architecture import architecture_fields_from_hf
    from hpc_rl.models.gpt_oss.tiny import make_tiny

    hf_dir = make_tiny(tmp_path / "gpt_oss")
    fields = architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text()))
    model_file = tmp_path / "gpt_oss.yaml"
    model_file.write_text(yaml.safe_dump({**fields, "make_vocab_size_divisible_by": 8}))
    run_ranks(_to_torch_dist, 2, str(hf_dir), str(model_file), str(tmp_path / "torch_dist"), timeout=600)
    run_ranks(_to_hf, 1, str(tmp_path / "torch_dist"), str(model_file), str(tmp_path / "back"), str(hf_dir),
              timeout=600)
    original, back = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original), set(back) ^ set(original)
    unequal = [name for name in original if not torch.equal(back[name], original[name])]
    assert not unequal, f"not bit-exact after HF -> torch_dist (EP2) -> HF: {unequal[:4]}"


def test_tiny_gpt_oss_run_engine_logprobs_equal_the_trainers_after_every_sync(tmp_path: Path) -> None:
    """configs/tiny_moe_cpu.yaml with the tiny gpt-oss: two trainer ranks at EP2 and a CPU engine serving
    transformers' GptOssForCausalLM; every broadcast sync sends each layer's experts fused under the release's
    names (gate_up_proj ..., as SGLang's loader reads them), which the engine copies into its GptOssExperts: its
    log-probs equal the trainer's after every sync."""
    from hpc_rl.models.gpt_oss.architecture import architecture_fields_from_hf
    from hpc_rl.models.gpt_oss.tiny import make_tiny
    from tests.integration.run_helpers import processes_mentioning, run_tiny_recipe_in_sync

    hf_dir = make_tiny(tmp_path / "tiny_gpt_oss")
    fields = architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text()))
    model_file = tmp_path / "tiny_gpt_oss.yaml"
    model_file.write_text(yaml.safe_dump({**fields, "make_vocab_size_divisible_by": 8}))
    run_dir = tmp_path / "run"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_moe_cpu.yaml", "--model", str(model_file),
                                   "--hf-checkpoint", str(hf_dir), "--eval-interval", "100")
    assert all(row["metrics"]["train/samples"] == 128.0 for row in rows)
    assert "Traceback" not in (run_dir / "logs" / "trainer.log").read_text()
    assert processes_mentioning(str(run_dir)) == []
