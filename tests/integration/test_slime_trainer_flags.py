"""Issue 26: slime's checkpoint and trainer flags on a real gloo trainer rank (Megatron-core on CPU):
--reset-optimizer-states, --ref-update-interval, --keep-old-actor, --no-save-optim, --save-hf and --ref-ckpt-step,
each with slime's meaning, through the trainer's command loop as the controller drives it; the trainer's
--recompute-loss-function and --use-rollout-entropy; and slime's trainer plug-ins (--custom-megatron-init-path,
--custom-megatron-before-log-prob-hook-path, --custom-megatron-before-train-step-hook-path,
--rollout-data-postprocess-path); --freeze-params-name-list, --distributed-timeout-minutes, --balance-by-flops,
--log-probs-max-tokens-per-gpu, --save-debug-train-data and --custom-model-provider-path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.test_trainer_step import ARCH_FILE, make_batch

pytestmark = pytest.mark.slow


def _configs(hf_dir: str, root: str, training_changes: dict[str, Any] | None = None, **checkpoint: Any):
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig

    training = TrainingConfig(global_batch_size=8, micro_batch_size=4, qkv_format="thd",
                              custom_megatron_init_path="tests.unit.plugin_fixtures.record_init",
                              **(training_changes or {}))
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=2, keep_old_actor=True)
    optimizer = OptimizerConfig(lr=1e-2, reset_optimizer_states=True)
    checkpoints = CheckpointConfig(**{"hf_checkpoint": hf_dir, "ref_load": hf_dir, "save_optim": False,
                                      "save_hf": f"{root}/hf/rollout_{{rollout_id}}", **checkpoint})
    return training, algorithm, optimizer, checkpoints


def _build(hf_dir: str, root: str, info, training_changes: dict[str, Any] | None = None, **checkpoint: Any):
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.training.actor import build_trainer

    training, algorithm, optimizer, checkpoints = _configs(hf_dir, root, training_changes, **checkpoint)
    return build_trainer(arch=ModelArchitecture.from_yaml(ARCH_FILE), training=training, algorithm=algorithm,
                         optimizer_config=optimizer, checkpoints=checkpoints, info=info, model_file=ARCH_FILE), checkpoints


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def train_and_save_rank(hf_dir: str, root: str) -> dict[str, Any]:
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.protocol.messages import SaveCommand, TrainCommand
    from hpc_rl.training.commands import TrainerCommands
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel

    info = init_parallel(TrainingConfig(global_batch_size=8, distributed_timeout_minutes=7), device="cpu")
    from torch.distributed import distributed_c10d

    timeout = distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    parts, checkpoints = _build(hf_dir, root, info)
    commands = TrainerCommands(parts, arch=parts.trainer.arch, info=info, source=None,  # type: ignore[arg-type]
                               save_dir=f"{root}/ckpt", checkpoint_config=checkpoints)
    commands._engines_updated()  # the run's first weight sync: the engines serve the initial weights
    out: dict[str, Any] = {"old_pass": parts.trainer.separate_old_logprob_pass, "timeout_s": timeout.total_seconds()}
    for rollout_id in (0, 1):
        result = commands.execute(TrainCommand(seq=rollout_id, rollout_id=rollout_id,
                                               batch=make_batch(rollout_id).to_arrays()))
        out[f"ppo_kl_{rollout_id}"] = result["steps"][0]["ppo_kl"]
        out[f"ref_is_actor_{rollout_id}"] = _same(_weights(parts.ref_model), _weights(parts.actor))
        out[f"adam_step_{rollout_id}"] = float(parts.optimizer.moments(parts.optimizer.params[0])["step"])
        saved = commands.execute(SaveCommand(seq=10 + rollout_id, rollout_id=rollout_id,
                                             controller_state={"next_rollout_id": rollout_id + 1}))
        out[f"actor_{rollout_id}"] = _weights(parts.actor)
    out["saved"] = saved
    out["ref"] = _weights(parts.ref_model)
    out["steps_done"] = parts.optimizer.steps_done
    from hpc_rl.weights.export import export_hf_state_dict

    out["hf_state"] = {name: t.clone() for name, t in export_hf_state_dict(parts.actor, parts.trainer.arch)}
    out["resumed"] = _resume(hf_dir, root, info)  # as a new job would, in the same process (one start-up)
    out |= _loss_options(parts, root)
    shutdown_parallel()
    return out


def _loss_options(parts, root: str) -> dict[str, Any]:
    """Bytes autograd keeps for backward with and without --recompute-loss-function (the loss is recomputed
    from the logits instead), and what --use-rollout-entropy hands a custom advantage function."""
    import dataclasses

    from hpc_rl.training.step import RolloutTrainer
    from tests.unit import plugin_fixtures

    def trainer(training_changes: dict[str, Any], algorithm_changes: dict[str, Any]) -> RolloutTrainer:
        base = parts.trainer
        return RolloutTrainer(actor=parts.actor, optimizer=parts.optimizer, ref_model=parts.ref_model, arch=base.arch,
                              training=dataclasses.replace(base.training, **training_changes),
                              algorithm=dataclasses.replace(base.algorithm, **algorithm_changes), info=base.info)

    def saved_bytes(variant: RolloutTrainer) -> int:
        total = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            total[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            variant.train_rollout(make_batch(5))
        return total[0]

    kept = {recompute: saved_bytes(trainer({"recompute_loss_function": recompute}, {"keep_old_actor": False}))
            for recompute in (False, True)}
    trainer({}, {"use_rollout_entropy": True, "keep_old_actor": False,
                 "custom_advantage_function_path": "tests.unit.plugin_fixtures.recording_advantages"}
            ).train_rollout(make_batch(6))
    plugin_fixtures.TRAINER_CALLS.clear()
    hooked = trainer({"custom_megatron_before_log_prob_hook_path": "tests.unit.plugin_fixtures.record_log_prob_pass",
                      "custom_megatron_before_train_step_hook_path": "tests.unit.plugin_fixtures.record_train_step",
                      "num_steps_per_rollout": 2, "global_batch_size": 4},
                     {"keep_old_actor": False,
                      "rollout_data_postprocess_path": "tests.unit.plugin_fixtures.untrain_everything"})
    steps = hooked.train_rollout(make_batch(7), rollout_id=9)
    template = f"{root}/debug/{{rollout_id}}_{{rank}}.pt"
    trainer({"save_debug_train_data": template}, {"keep_old_actor": False}).train_rollout(make_batch(8), 4)
    dumped = torch.load(template.format(rollout_id=4, rank=0))
    from hpc_rl.training.batching import flops_balanced_microbatches, flops_linear_coefficient

    batch, dynamic = make_batch(9), {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 20}
    by_flops = trainer({**dynamic, "balance_by_flops": True}, {"keep_old_actor": False})
    arch = parts.trainer.arch
    coefficient = flops_linear_coefficient(hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
                                           num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
                                           ffn_hidden_size=arch.ffn_hidden_size)
    flops_bins = ([m.indices for m in by_flops._step_microbatches(batch, range(8))],
                  flops_balanced_microbatches(batch.total_lengths, 20, coefficient))
    capped = trainer({**dynamic, "log_probs_max_tokens_per_gpu": 400}, {"keep_old_actor": False})
    plan = [capped._step_microbatches(batch, range(8))]
    logprob_passes = (len(plan[0]), len(capped.logprob_microbatches(batch, plan, 8)))
    return {"saved_bytes": kept, "flops_bins": flops_bins, "logprob_passes": logprob_passes, "rollout_data": plugin_fixtures.SEEN_ROLLOUT_DATA[-1],
            "init_calls": list(plugin_fixtures.INIT_CALLS), "hook_calls": list(plugin_fixtures.TRAINER_CALLS),
            "untrained_losses": [step["loss"] for step in steps],
            "dumped": {key: len(value) if isinstance(value, list) else value for key, value in dumped.items()}}


def _resume(hf_dir: str, root: str, info) -> dict[str, Any]:
    resumed, _ = _build(hf_dir, root, info, load=f"{root}/ckpt")
    resumed.optimizer.ensure_state()  # zeros unless a checkpoint filled them
    moments = [resumed.optimizer.moments(p)["exp_avg"].abs().sum().item() for p in resumed.optimizer.params]
    older, _ = _build(hf_dir, root, info, ref_load=f"{root}/ckpt", ref_ckpt_step=0)
    out = {"rollout_id": resumed.resumed.rollout_id if resumed.resumed else None, "actor": _weights(resumed.actor),
           "ref": _weights(resumed.ref_model), "steps_done": resumed.optimizer.steps_done, "moments": moments,
           "older_actor": _weights(older.actor), "older_ref": _weights(older.ref_model)}
    try:
        _build(hf_dir, root, info, ref_load=f"{root}/ckpt", ref_ckpt_step=7)
    except FileNotFoundError as error:
        out["missing_step"] = str(error)
    frozen, _ = _build(hf_dir, root, info, {"freeze_params_name_list": ["embedding"]})
    before = dict(frozen.actor.module.named_parameters())
    before = {name: p.detach().clone() for name, p in before.items()}
    frozen.trainer.train_rollout(make_batch(3))
    after = dict(frozen.actor.module.named_parameters())
    out["moved"] = {name: not torch.equal(before[name], after[name]) for name in before}
    custom, _ = _build(hf_dir, root, info, {"custom_model_provider_path": "tests.unit.plugin_fixtures.tagged_model_provider"})
    out["custom_provider"] = (getattr(custom.actor.module, "built_by_custom_provider", None),
                              getattr(custom.ref_model, "built_by_custom_provider", None))
    return out


def test_checkpoint_and_trainer_flags_with_slimes_meaning(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf_in"))
    run = run_ranks(train_and_save_rank, 1, hf_dir, str(tmp_path))[0]
    # --keep-old-actor: rollout 1's old log-probs come from the weights the engines still serve (rollout 0's
    # start: no sync since), so its first step already sees a ratio != 1; rollout 0's do not
    assert run["old_pass"] and run["ppo_kl_0"] == 0.0 and run["ppo_kl_1"] != 0.0
    # --reset-optimizer-states: Adam's step count starts over every rollout (1, not 2, after the second)
    assert (run["adam_step_0"], run["adam_step_1"], run["steps_done"]) == (1.0, 1.0, 2)
    # --ref-update-interval 2: the reference takes the actor's weights after rollout 1, not after rollout 0
    assert not run["ref_is_actor_0"] and run["ref_is_actor_1"]
    # --save-hf: an HF directory per save (config and tokenizer of --hf-checkpoint), holding the actor's weights
    # under HF names (the converters' tests show such a directory loads in transformers)
    hf_out = tmp_path / "hf" / "rollout_1"
    assert run["saved"]["hf_checkpoint"] == str(hf_out)
    assert (hf_out / "config.json").read_text() == (Path(hf_dir) / "config.json").read_text()
    assert (hf_out / "tokenizer.json").is_file()
    assert not (tmp_path / "hf" / "rollout_1.tmp").exists() and (tmp_path / "hf" / "rollout_0").is_dir()
    loaded = load_file(str(hf_out / "model.safetensors"))
    assert loaded.keys() == run["hf_state"].keys()
    for name, value in run["hf_state"].items():
        assert torch.equal(loaded[name], value), name
    # --no-save-optim: no optimizer shards in the checkpoint; a resume takes the weights, the position, the
    # updated reference and the lr schedule's step, with fresh moments
    resumed = run["resumed"]
    assert resumed["rollout_id"] == 1 and resumed["steps_done"] == 2
    assert _same(resumed["actor"], run["actor_1"]) and _same(resumed["ref"], run["ref"])
    assert resumed["moments"] and all(m == 0.0 for m in resumed["moments"])  # with the optimizer saved: > 0
    # --ref-ckpt-step 0: iteration 0 of the root (not its latest, 1) is the reference and the start
    assert _same(resumed["older_ref"], run["actor_0"]) and _same(resumed["older_actor"], run["actor_0"])
    assert not _same(run["actor_0"], run["actor_1"])
    assert "no iteration 7 (iter_0000007)" in resumed["missing_step"]
    # --freeze-params-name-list embedding: the embedding stays as loaded, the rest trains
    moved = resumed["moved"]
    assert [name for name, changed in moved.items() if not changed] == ["embedding.word_embeddings.weight"]
    # --custom-model-provider-path: actor and reference come from the provider, called as slime calls it
    assert resumed["custom_provider"] == ((True, True, None), (True, True, None))
    # --distributed-timeout-minutes 7: the trainer's process group times out after 7 minutes
    assert run["timeout_s"] == 7 * 60
    # --recompute-loss-function: the loss's float32 softmax intermediates are not kept for backward
    assert run["saved_bytes"][True] < run["saved_bytes"][False]
    # --use-rollout-entropy: the old and reference passes' entropies, one per response token, reach the function
    seen = run["rollout_data"]
    assert seen["entropy"] == seen["ref_entropy"] == seen["loss_masks"] and seen["entropy"]
    # the trainer plug-ins, with slime's arguments: init once per build (here 4 builds), the log-prob hook before
    # the reference's and the old pass, the step hook before each of the 2 steps, the post-process after the
    # advantages (its all-zero loss masks leave nothing to train: loss 0)
    assert run["init_calls"] == [8] * 6
    assert run["hook_calls"][:3] == [("log_prob", "ref_"), ("log_prob", ""), ("postprocess", 9, [
        "advantages", "log_probs", "loss_masks", "ref_log_probs", "response_lengths", "returns", "rewards",
        "rollout_log_probs", "total_lengths"])]
    assert run["hook_calls"][3:] == [("train_step", 9, 0), ("train_step", 9, 1)]
    assert run["untrained_losses"] == [0.0, 0.0]
    # --balance-by-flops: the trainer's micro-batches are the Karmarkar-Karp partition on c*L + L^2
    assert run["flops_bins"][0] == run["flops_bins"][1] and len(run["flops_bins"][0]) > 1
    # --log-probs-max-tokens-per-gpu 400: the forward-only passes run on fewer, larger micro-batches
    assert run["logprob_passes"][1] == 1 < run["logprob_passes"][0]
    # --save-debug-train-data: what the rank trains on, per sample (8 samples of rollout 4, DP rank 0)
    dumped = run["dumped"]
    assert (dumped["rollout_id"], dumped["dp_rank"], dumped["tokens"], dumped["advantages"]) == (4, 0, 8, 8)
