"""The adapter-only weight sync end to end (issue 33, item 3): the tiny GRPO run with `--lora-rank 8` on CPU engines
started with --enable-lora; after every sync the engine's log-probs equal the trainer's, and each sync moved the
adapter alone (`perf/weight_sync_bytes` in TensorBoard = the adapter's bytes computed from the shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.lora_sizes import adapter_sync_bytes
from hpc_rl.config.model_checks import run_architecture
from tests.integration.run_helpers import REPO_ROOT, run_tiny_recipe_in_sync
from tests.integration.test_run_local import tensorboard_scalars

pytestmark = pytest.mark.slow

LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--lr", "2e-2")
"""A large learning rate, so the adapter moves the log-probs far more than the engine==trainer bound (1e-4)."""


def test_tiny_grpo_with_lora_syncs_only_the_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "lora_rl"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_cpu.yaml", *LORA)
    config = load_config([str(REPO_ROOT / "configs" / "tiny_cpu.yaml")], list(LORA))
    arch = run_architecture(config)
    assert arch is not None
    adapter = adapter_sync_bytes(arch, config.lora, dtype_bytes=4)  # float32 on CPU
    synced = tensorboard_scalars(run_dir, "perf/weight_sync_bytes")
    assert synced and all(value == adapter for value in synced), (synced, adapter)
    seconds = [row["metrics"]["weight_sync/seconds"] for row in rows if "weight_sync/seconds" in row["metrics"]]
    print(f"LoRA r=8 sync: {adapter} bytes, seconds per sync {seconds}")
    assert "as policy-v3" in (run_dir / "logs" / "controller.log").read_text()
    assert [p.name for p in (run_dir / "adapters").iterdir()] == [f"policy-v{len(rows)}"]  # older ones removed
    # the engines served the adapter, not the base: the last adapter moves PEFT's log-probs well beyond the bound
    assert adapter_effect(run_dir / "adapters" / f"policy-v{len(rows)}") > 1e-3


def adapter_effect(directory: Path) -> float:
    """Max |log-prob difference| between the base and base + the PEFT adapter at `directory`, on a few tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2]])
    base = AutoModelForCausalLM.from_pretrained(REPO_ROOT / "assets" / "tiny_qwen3", dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(tokens).logits.log_softmax(-1)
        after = PeftModel.from_pretrained(base, str(directory)).eval()(tokens).logits.log_softmax(-1)
    return (after - before).abs().max().item()


@pytest.mark.parametrize("backup", [True, False], ids=["base-cpu-backup", "base-resent"])
def test_colocated_tiny_lora_run_serves_the_adapter_after_every_sync(tmp_path: Path, backup: bool) -> None:
    """Colocated LoRA (transports.lora_tensor): the adapter goes through /load_lora_adapter_from_tensors to the engine
    on the trainer rank's GPU; with --lora-base-cpu-backup the engine keeps its base across the memory release and
    each sync moves the adapter alone, without it the base (discarded by the memory saver) is re-sent first."""
    run_dir = tmp_path / "colocated_lora"
    flags = (*LORA, "--colocate", *(["--lora-base-cpu-backup"] if backup else []))
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_cpu.yaml", *flags)
    config = load_config([str(REPO_ROOT / "configs" / "tiny_cpu.yaml")], list(LORA))
    arch = run_architecture(config)
    assert arch is not None
    adapter = adapter_sync_bytes(arch, config.lora, dtype_bytes=4)
    synced = tensorboard_scalars(run_dir, "perf/weight_sync_bytes")
    base = [row["metrics"].get("weight_sync/base_bytes", 0.0) for row in rows]
    print(f"colocated LoRA (backup={backup}): bytes per sync {synced}, base {base}, seconds "
          f"{[row['metrics'].get('weight_sync/seconds') for row in rows]}")
    assert synced and all(value == adapter + (0 if backup else base[0]) for value in synced), (synced, adapter)
    assert (base[0] == 0) == backup
    log = (run_dir / "logs" / "controller.log").read_text()
    assert f"as policy-v{len(rows)}" in log and not (run_dir / "adapters").exists()  # tensors, no directory


def test_a_run_starting_from_an_adapter_serves_it_from_rollout_0(tmp_path: Path) -> None:
    """--lora-adapter-path with engines: the trainer loads the PEFT adapter into its adapters and the engines get it
    before rollout 0 (a sync at start), so rollout 0's log-probs are the adapter's on both sides (the adapter moves
    them far beyond the 1e-4 bound the helper checks on every rollout)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(REPO_ROOT / "assets" / "tiny_qwen3", dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn_like(param))
    start = tmp_path / "start_adapter"
    model.save_pretrained(start)
    assert adapter_effect(start) > 1e-2
    run_dir = tmp_path / "from_adapter"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_cpu.yaml", "--lora-rank", "8", "--lora-alpha", "16",
                                   "--target-modules", "all-linear", "--lora-type", "canonical_lora",
                                   "--lora-adapter-path", str(start))
    assert rows[0]["metrics"]["train/train_rollout_logprob_abs_diff"] < 1e-4
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "the adapter the trainer starts from" in log and "as policy-v0" in log
