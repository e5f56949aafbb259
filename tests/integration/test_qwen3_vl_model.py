"""Qwen3-VL on Megatron's layers (+ transformers' vision tower) against transformers' Qwen3VL(Moe)ForConditionalGeneration,
on real gloo ranks.

The tiny random checkpoints (`hpc_rl.models.qwen3_vl.tiny`: 2 LM layers both receiving deepstack features, a 2-block
tower, patch 8, merge 2, mrope_section [4, 2, 2]; the MoE one 4 experts top-2, experts stored fused as released)
run two prompts: one with a 32x32 image (4 image tokens), one with a 32x32 and a 16x16 image (4 + 1), through
transformers' own image processor. One 2-rank launch per checkpoint checks the logits of both prompts, unpacked
(right-padded rows, bshd) and packed (one THD row, built as the trainer builds it: `TrainBatch.images` through the
controller's array format, `images_of`, `build_microbatch`, `MicroBatch.forward`), against transformers' per-prompt forward: dense at TP1 and TP2
(sequence parallel), MoE at TP1 and EP2 (alltoall). Every exported HF tensor (vision tower, merger, deepstack
mergers, LM) equals the checkpoint's bit for bit at every layout, and the weight sync's plan names exactly those
tensors. A training forward/backward of the packed row gives the vision tower (every tensor: blocks, merger,
deepstack mergers) transformers' gradients on every rank, TP2 included. The max gaps are printed (`pytest -s`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
LAYOUTS = {"qwen3_vl": [(1, 1), (2, 1)], "qwen3_vl_moe": [(1, 1), (1, 2)]}  # (TP, EP)
TOLERANCE = 1e-4


def prompts(hf_dir: Path) -> list[dict]:
    """Two prompts' token ids, pixel_values and image_grid_thw from the checkpoint's own image processor."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    processor = AutoImageProcessor.from_pretrained(hf_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rng = np.random.default_rng(0)

    def image(size: int) -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))

    def expand(text: str, grids: torch.Tensor) -> list[int]:
        ids, grid_iter = [], iter(grids.tolist())
        for token in tokenizer(text)["input_ids"]:
            ids += [pad] * (int(np.prod(next(grid_iter))) // 4) if token == pad else [token]
        return ids

    out = []
    for text, sizes in (("<|im_start|> user <|vision_start|> <|image_pad|> <|vision_end|> copy 1 2 <|im_end|> "
                         "<|im_start|> assistant 1 2", [32]),
                        ("<|im_start|> user <|vision_start|> <|image_pad|> <|vision_end|> add "
                         "<|vision_start|> <|image_pad|> <|vision_end|> 3 + 4 = <|im_end|> <|im_start|> assistant 7",
                         [32, 16])):
        processed = processor(images=[image(s) for s in sizes], return_tensors="pt")
        out.append({"ids": expand(text, processed["image_grid_thw"]), "pixel_values": processed["pixel_values"],
                    "image_grid_thw": processed["image_grid_thw"]})
    return out


def reference_logits(hf_dir: Path, family: str, samples: list[dict]) -> list[torch.Tensor]:
    """transformers' logits of each prompt alone."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    model_class = Qwen3VLMoeForConditionalGeneration if family == "qwen3_vl_moe" else Qwen3VLForConditionalGeneration
    model = model_class.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    image_id = model.config.image_token_id
    logits = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample["ids"]])
            logits.append(model(input_ids=ids, pixel_values=sample["pixel_values"],
                                image_grid_thw=sample["image_grid_thw"],
                                mm_token_type_ids=(ids == image_id).long()).logits[0])
    return logits


def loss_weights(tokens: int, vocab: int) -> torch.Tensor:
    """[tokens, vocab] fixed random weights: the test's loss is sum(logits * weights) (padded vocab columns: 0)."""
    weights = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(1))
    return weights


def reference_vision_grads(hf_dir: Path, family: str, samples: list[dict], vocab: int) -> dict[str, torch.Tensor]:
    """transformers' gradients of the vision tower for the same loss, prompts run one by one."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    model_class = Qwen3VLMoeForConditionalGeneration if family == "qwen3_vl_moe" else Qwen3VLForConditionalGeneration
    model = model_class.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    weights = loss_weights(sum(len(s["ids"]) for s in samples), vocab)
    offset = 0
    for sample in samples:
        ids = torch.tensor([sample["ids"]])
        logits = model(input_ids=ids, pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"],
                       mm_token_type_ids=(ids == model.config.image_token_id).long()).logits[0]
        (logits * weights[offset: offset + len(sample["ids"]), : logits.shape[-1]]).sum().backward()
        offset += len(sample["ids"])
    return {name[len("model.visual."):]: p.grad for name, p in model.named_parameters()
            if name.startswith("model.visual.")}


def _rank(hf_dir: str, layouts: list[tuple[int, int]], samples: list[dict]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf
    from hpc_rl.training.micro_batches import build_microbatch
    from hpc_rl.training.model_provider import build_gpt_model, causal_mask
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.train_batch import TrainBatch
    from hpc_rl.weights.export import ExpertLayout, export_hf_state_dict
    from hpc_rl.weights.hf_import import load_hf_into_model
    from hpc_rl.weights.sender import WeightSender

    fields = architecture_fields_from_hf(json.loads((Path(hf_dir) / "config.json").read_text()))
    arch = ModelArchitecture(**fields, make_vocab_size_divisible_by=8)
    pixels = torch.cat([s["pixel_values"] for s in samples])
    grids = torch.cat([s["image_grid_thw"] for s in samples])
    rows = [s["ids"] for s in samples]
    out: dict = {}
    for tp, ep in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                  moe_token_dispatcher_type="alltoall", global_batch_size=8, micro_batch_size=2)
        info = init_parallel(training, device="cpu")
        model = build_gpt_model(arch, training)
        load_hf_into_model(model, hf_dir, arch, tp_rank=info.tp_rank, tp_size=info.tp_size,
                           expert_tp_rank=info.expert_tp_rank, expert_tp_size=info.expert_tp_size)
        model.eval()  # no dropout anywhere; gradients still flow
        tp_group = parallel_state.get_tensor_model_parallel_group()

        def gathered(local: torch.Tensor) -> torch.Tensor:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
            return torch.cat(shards, dim=-1)[..., : arch.vocab_size]

        with torch.no_grad():
            width = max(map(len, rows))
            width += (-width) % tp
            tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            logits = gathered(model(tokens, None, causal_mask(width), pixel_values=pixels, image_grid_thw=grids))
            out[(tp, ep, "unpacked")] = [logits[i, : len(r)] for i, r in enumerate(rows)]
            batch = TrainBatch(tokens=rows, response_lengths=[1, 1], loss_masks=[[1], [1]], rewards=[0.0, 0.0],
                               images=[{"pixel_values": s["pixel_values"].numpy(),
                                        "image_grid_thw": s["image_grid_thw"].numpy()} for s in samples])
            batch = TrainBatch.from_arrays(batch.to_arrays())  # the controller's wire format
            micro = build_microbatch(rows, [1, 1], [0, 1], qkv_format="thd", pad_multiple=tp,
                                     images=batch.images_of([0, 1]))  # the trainer's path (logprob_passes)
            packed = gathered(micro.forward(model))[0]
            out[(tp, ep, "packed")] = [packed[start: start + len(r)] for start, r in zip(micro.starts, rows)]
        local = micro.forward(model)[0]  # training forward: gradients reach the tower through the image pads
        vocab_local = local.shape[-1]
        weights = loss_weights(sum(map(len, rows)), vocab_local * tp)[:, info.tp_rank * vocab_local:
                                                                        (info.tp_rank + 1) * vocab_local]
        (local[: weights.shape[0]] * weights).sum().backward()  # column-parallel backward: full input gradients
        out[(tp, ep, "vision_grads")] = {name: param.grad.clone() for name, param in model.named_parameters()
                                         if name.startswith("vision_model.")}
        exported = export_hf_state_dict(model, arch, tp_group if tp > 1 else None, ExpertLayout.current(arch))
        out[(tp, ep, "export")] = {name: tensor.clone() for name, tensor in exported}
        sender = WeightSender(model, arch, tp_group=tp_group, tp_size=tp, dp_rank=info.dp_rank, rank=info.rank,
                              bucket_bytes=1 << 16)
        out[(tp, ep, "plan")] = [n for meta in sender.plan_buckets() for n in meta.names]
    shutdown_parallel()
    return out


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_matches_transformers_unpacked_packed_and_exports(family: str, tmp_path: Path) -> None:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.models.qwen3_vl.names import FusedExpertReader, architecture_fields_from_hf
    from hpc_rl.models.qwen3_vl.tiny import make_tiny
    from hpc_rl.weights.hf_import import HFTensorReader

    hf_dir = make_tiny(tmp_path / family, family=family)
    samples = prompts(hf_dir)
    expected = reference_logits(hf_dir, family, samples)
    arch = ModelArchitecture(**architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text())))
    reader = HFTensorReader(hf_dir)
    if family == "qwen3_vl_moe":
        reader = FusedExpertReader(reader, arch)
    checkpoint = {name: reader[name] for name in reader.keys()}
    assert any(name.startswith("model.visual.deepstack_merger_list.") for name in checkpoint)
    results = run_ranks(_rank, 2, str(hf_dir), LAYOUTS[family], samples, timeout=600)
    padded_vocab = -(-arch.vocab_size // 8) * 8
    expected_grads = reference_vision_grads(hf_dir, family, samples, padded_vocab)
    for tp, ep in LAYOUTS[family]:
        for rank_out in results:
            for layout in ("unpacked", "packed"):
                gap = max((ours - ref).abs().max().item() for ours, ref in zip(rank_out[(tp, ep, layout)], expected))
                print(f"{family} TP{tp} EP{ep} {layout}: max |logit gap| {gap:.2e}")
                assert gap < TOLERANCE, f"{family} TP{tp} EP{ep} {layout}: logits differ from transformers' by {gap}"
            grads = rank_out[(tp, ep, "vision_grads")]
            assert len(grads) == len(expected_grads)
            gap = max(((grads["vision_model." + n] - g).abs().max() / g.abs().max()).item()
                      for n, g in expected_grads.items())
            print(f"{family} TP{tp} EP{ep}: vision tower gradients, max relative gap {gap:.2e}")
            assert gap < 1e-4, f"{family} TP{tp} EP{ep}: the vision tower's gradients differ from transformers' by {gap}"
        exported = results[0][(tp, ep, "export")]
        assert set(exported) == set(checkpoint), f"TP{tp} EP{ep}: {sorted(set(exported) ^ set(checkpoint))[:6]}"
        unequal = [name for name in checkpoint if not torch.equal(exported[name], checkpoint[name])]
        assert not unequal, f"TP{tp} EP{ep}: exported tensors differ from the checkpoint: {unequal[:4]}"
        planned = results[0][(tp, ep, "plan")]
        assert sorted(planned) == sorted(checkpoint), f"TP{tp} EP{ep}: {sorted(set(planned) ^ set(checkpoint))[:6]}"


def _to_torch_dist(hf_dir: str, model_file: str, out: str, tp: int, ep: int) -> None:
    from hpc_rl.training.convert import hf_to_torch_dist
    from hpc_rl.training.parallel import shutdown_parallel

    hf_to_torch_dist(hf_dir, model_file, out, tensor_parallel_size=tp, expert_parallel_size=ep,
                     expert_tensor_parallel_size=1 if ep > 1 else None)
    shutdown_parallel()


def _to_hf(load_dir: str, model_file: str, out: str, reference: str) -> None:
    from hpc_rl.training.convert import torch_dist_to_hf
    from hpc_rl.training.parallel import shutdown_parallel

    torch_dist_to_hf(load_dir, model_file, out, hf_reference=reference)
    shutdown_parallel()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_converters_round_trip_bit_exact(family: str, tmp_path: Path) -> None:
    """HF -> torch_dist (dense at TP2, MoE at EP2) -> HF: every tensor, the vision tower's included, bit-equal
    under the same names and layouts (the MoE experts fused again as released)."""
    import yaml
    from safetensors.torch import load_file

    from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf
    from hpc_rl.models.qwen3_vl.tiny import make_tiny

    hf_dir = make_tiny(tmp_path / family, family=family)
    model_file = tmp_path / f"{family}.yaml"
    fields = architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text()))
    model_file.write_text(yaml.safe_dump({**fields, "make_vocab_size_divisible_by": 8}))
    tp, ep = (2, 1) if family == "qwen3_vl" else (1, 2)
    run_ranks(_to_torch_dist, 2, str(hf_dir), str(model_file), str(tmp_path / "torch_dist"), tp, ep, timeout=600)
    run_ranks(_to_hf, 1, str(tmp_path / "torch_dist"), str(model_file), str(tmp_path / "back"), str(hf_dir),
              timeout=600)
    original = load_file(str(hf_dir / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original), sorted(set(back) ^ set(original))[:6]
    assert any(name.startswith("model.visual.") for name in back)
    unequal = [name for name in original if not torch.equal(back[name], original[name])]
    assert not unequal, f"{family}: tensors changed in the round trip: {unequal[:4]}"


def _train_rank(hf_dir: str, model_file: str, samples: list[dict]) -> dict:
    """One GRPO step of the whole trainer (build_trainer, Megatron's DDP, a KL reference, packed micro-batches with
    the images) at TP2+SP, twice: the tower trained, then frozen by slime's --freeze-params-name-list."""
    from megatron.core import parallel_state

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.train_batch import TrainBatch

    arch = ModelArchitecture.from_yaml(model_file)
    rows = [s["ids"] for s in samples]
    batch = TrainBatch(tokens=rows, response_lengths=[2, 1], loss_masks=[[1, 1], [1]], rewards=[1.0, -1.0],
                       rollout_logprobs=[[-1.0, -2.0], [-1.5]],
                       images=[{"pixel_values": s["pixel_values"].numpy(), "image_grid_thw": s["image_grid_thw"].numpy()}
                               for s in samples])
    out = {}
    for frozen in ([], ["vision_model"]):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training = TrainingConfig(tensor_model_parallel_size=2, sequence_parallel=True, qkv_format="thd",
                                  global_batch_size=2, micro_batch_size=1, freeze_params_name_list=frozen)
        info = init_parallel(training, device="cpu")
        parts = build_trainer(arch=arch, training=training,
                              algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
                              optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1.0, lr_warmup_iters=0),
                              checkpoints=CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir), info=info,
                              model_file=model_file)
        before = {n: p.detach().clone() for n, p in parts.actor.named_parameters()}
        metrics = parts.trainer.train_rollout(batch)[0]
        after = dict(parts.actor.named_parameters())
        moved = {n.split("vision_model.")[-1] if "vision_model." in n else n for n in before
                 if not torch.equal(before[n], after[n].detach())}
        out[bool(frozen)] = {"metrics": metrics, "vision_moved": sorted(n for n in moved if "decoder." not in n
                                                                          and "embedding." not in n
                                                                          and "output_layer" not in n),
                             "lm_moved": any("decoder.layers.0." in n for n in moved)}
    shutdown_parallel()
    return out


def test_qwen3_vl_trainer_step_trains_or_freezes_the_tower(tmp_path: Path) -> None:
    """The trainer's own step on image prompts at TP2+SP: finite loss, the tower moves, and with
    --freeze-params-name-list vision_model it stays bit-equal while the language model moves. (Deepstack merger 1
    feeds the last layer's output at the image positions only, which no response token's loss reads: it gets no
    gradient from this loss, rightly.)"""
    import yaml

    from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf
    from hpc_rl.models.qwen3_vl.tiny import make_tiny

    hf_dir = make_tiny(tmp_path / "qwen3_vl", family="qwen3_vl")
    model_file = tmp_path / "qwen3_vl.yaml"
    fields = architecture_fields_from_hf(json.loads((hf_dir / "config.json").read_text()))
    model_file.write_text(yaml.safe_dump({**fields, "make_vocab_size_divisible_by": 8}))
    results = run_ranks(_train_rank, 2, str(hf_dir), str(model_file), prompts(hf_dir), timeout=600)
    for rank_out in results:
        trained, frozen = rank_out[False], rank_out[True]
        assert all(np.isfinite(v) for v in trained["metrics"].values()), trained["metrics"]
        assert "blocks.0.attn.qkv.weight" in trained["vision_moved"] and "merger.linear_fc2.weight" in \
            trained["vision_moved"] and "deepstack_merger_list.0.linear_fc1.weight" in trained["vision_moved"]
        assert frozen["vision_moved"] == [] and frozen["lm_moved"], frozen
