"""The tiny GRPO run on the families the CPU engine serves on transformers' own caches, batched (registry
`cpu_engine_cache="batched_states"`, engines/cpu/state_batch): a Gated DeltaNet hybrid (Qwen3.5-MoE: conv and
recurrent states, one row per request, beside the full-attention keys/values) and DeepSeek-V3.2 (the DSA indexer's
keys beside the latent cache).

Real processes: controller, sglang-router, a CPU engine serving transformers' model of the family, two torchrun
trainer ranks (configs/tiny_moe_cpu.yaml: expert parallelism 2) on the family's tiny model file. Over three rollouts
the engine's log-probs must equal the trainer's at the first step and after every sync (float32 both sides): a
cache the engine kept wrong, or a tensor a sync missed, would show. That batched (and per-request) generation
equals a plain forward pass is tests/unit/test_engine_hybrid_caches.py's; that GRPO learns on a hybrid,
test_tiny_hybrid_run_learns's (tools/hybrid_learning_run.py, 40 rollouts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.models.registry import family
from tests.integration.run_helpers import SHORT_RUN_ROLLOUTS, processes_mentioning, run_tiny_recipe_in_sync

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


INDEX_HEADS = 16
"""DeepSeek-V3.2's run uses 16 indexer heads, not the tiny model file's 4: with 4, a key's index score is exactly 0
(every head's ReLU off) often enough that top-k ties among zeros are common, and torch.topk breaks them by the row's
length; transformers' own full forward then differs from its forward over a prefix at ~2% of positions (measured:
5 of 220 positions; 0 of 220 with 16 heads), so no engine that decodes token by token could equal a trainer that
runs the whole sequence at once."""


def test_tiny_hybrid_run_engine_logprobs_equal_the_trainers_after_every_sync(tmp_path: Path) -> None:
    hf_dir = family("qwen3_5_moe").make_tiny(tmp_path / "tiny_qwen3_5_moe")
    run_dir = tmp_path / "run"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_moe_cpu.yaml", "--model",
                                   str(ROOT / "configs" / "models" / "tiny_qwen3_5_moe.yaml"), "--hf-checkpoint",
                                   str(hf_dir), "--eval-interval", str(SHORT_RUN_ROLLOUTS))
    print("qwen3_5_moe engine vs trainer per rollout:", [row["metrics"]["train/train_rollout_logprob_abs_diff"]
                                                         for row in rows])
    assert all(row["metrics"]["train/samples"] == 128.0 for row in rows)
    assert "Traceback" not in (run_dir / "logs" / "trainer.log").read_text()
    assert processes_mentioning(str(run_dir)) == []


def nonzero_pad_embedding(hf_dir: Path) -> None:
    """Give the tiny checkpoint's pad token (<|endoftext|>, which the random policy samples) a random embedding in
    place of transformers' zero `padding_idx` row: a zero hidden state gives an all-zero indexer query, every key
    then ties at score 0, and torch.topk breaks the tie by the row's length, so the engine (one query against the
    cache) and the trainer (the whole sequence) pick different keys for it and every later token (measured: 2.7e-3
    and 4.7e-3 mean per token at rollout 0, before the first update moves the row)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    pad = json.loads((hf_dir / "config.json").read_text())["pad_token_id"]
    embedding = tensors["model.embed_tokens.weight"]
    assert embedding[pad].abs().sum() == 0
    embedding[pad] = torch.randn(embedding.shape[1], generator=torch.Generator().manual_seed(5)) * embedding.std()
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_tiny_dsa_run_engine_logprobs_equal_the_trainers_after_every_sync(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "models" / "tiny_deepseek_v32.yaml").read_text()
    assert "dsa_indexer_n_heads: 4" in text
    model_file = tmp_path / "tiny_deepseek_v32.yaml"
    model_file.write_text(text.replace("dsa_indexer_n_heads: 4", f"dsa_indexer_n_heads: {INDEX_HEADS}"))
    hf_dir = family("deepseek_v32").make_tiny(tmp_path / "tiny_deepseek_v32", index_n_heads=INDEX_HEADS)
    nonzero_pad_embedding(hf_dir)
    run_dir = tmp_path / "run"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_moe_cpu.yaml", "--model", str(model_file),
                                   "--hf-checkpoint", str(hf_dir), "--eval-interval", str(SHORT_RUN_ROLLOUTS))
    print("deepseek_v32 engine vs trainer per rollout:", [row["metrics"]["train/train_rollout_logprob_abs_diff"]
                                                          for row in rows])
    assert all(row["metrics"]["train/samples"] == 128.0 for row in rows)
    assert "Traceback" not in (run_dir / "logs" / "trainer.log").read_text()
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.timeout(900)
def test_tiny_hybrid_run_learns(tmp_path: Path) -> None:
    """The one learning run of the new families (issue 31): GRPO on the tiny Qwen3.5-MoE (Gated DeltaNet + gated
    attention + experts), served by the CPU engine's batched state cache, 40 rollouts (65 s at load ~9 on 2 cores,
    Nov 29: sampled reward 0.102 -> 0.234 over the first / last 5, greedy eval 1.0 at the end). Asserts the greedy
    eval (0.1-0.2 before training) and the sampled reward both rise, and the engine stayed equal to the trainer."""
    result = subprocess.run([sys.executable, "tools/hybrid_learning_run.py", str(tmp_path / "learn"), "--num-rollout",
                             "40", "--family", "qwen3_5_moe"], cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "learn" / "run" / "rollouts.jsonl").read_text().splitlines()
            if line.strip()]
    rewards = [row["metrics"]["rollout/reward_mean"] for row in rows]
    final_eval = rows[-1]["metrics"]["eval/tiny_copy/reward_mean"]
    assert len(rows) == 40 and final_eval >= 0.5, (final_eval, result.stdout[-2000:])
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.03, rewards
    assert max(row["metrics"]["train/train_rollout_logprob_abs_diff"] for row in rows) < 1e-4
