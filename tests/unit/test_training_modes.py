"""Issue 21, the pure parts of the training modes: SFT's rollouts and cursor, the teacher's log-probs on the wire,
the modes' config rules (slime's flags), the lr schedule over the run, and the job shapes (trainer-only, teacher)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hpc_rl.config import load_config
from hpc_rl.config.sections.cluster import ClusterConfig
from hpc_rl.config.sections.training import OptimizerConfig
from hpc_rl.config.validation import collect_problems
from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.chat_loss_masks import ChatLossMasks
from hpc_rl.data.prompts import DataError, DataKeys, PromptDataset, PromptSource
from hpc_rl.data.samples import Sample
from hpc_rl.launch.topology import plan_topology
from hpc_rl.rollout.sft import SftRollouts, checkpoint_stop_token_ids
from hpc_rl.rollout.teacher import TeacherError, generate_url, response_logprobs
from hpc_rl.tiny_model import build_tokenizer
from hpc_rl.training.lr_schedule import learning_rate, schedule_for_run
from hpc_rl.training.train_batch import TrainBatch

ROOT = Path(__file__).resolve().parents[2]
CHATS = ROOT / "data" / "tiny_copy_chat_train.jsonl"


def sft_source(batch: int = 5) -> SftRollouts:
    dataset = PromptDataset.load(CHATS, DataKeys(input_key="messages", label_key=None), limit=12)
    masks = ChatLossMasks(build_tokenizer(), rendering="qwen", stop_token_ids=[4])
    return SftRollouts(PromptSource(dataset, shuffle=True, seed=3), masks, rollout_batch_size=batch)


def test_sft_rollouts_are_the_data_s_chats_epoch_after_epoch_and_resume_exactly() -> None:
    source = sft_source()
    first = asyncio.run(source.run(0, 0))
    (sample,) = first.groups[0]
    tokenizer = build_tokenizer()
    assert tokenizer.decode(sample.response_token_ids) == sample.prompt[1]["content"] + " <|im_end|>"
    assert sample.loss_mask == [1, 1] and sample.reward == 0.0
    assert tokenizer.decode(sample.prompt_token_ids) == f"<|im_start|> user {sample.prompt[0]['content']} " \
                                                       f"<|im_end|> <|im_start|> assistant"
    asyncio.run(source.run(1, 0))
    state = json.loads(json.dumps(source.state_dict()))  # what a checkpoint keeps
    third = asyncio.run(source.run(2, 0))  # 15 chats of 12: the second epoch has begun
    assert third.metrics["rollout/epoch"] == 1.0 and source.source.epoch == 1
    resumed = sft_source()
    resumed.load_state_dict(state)
    again = asyncio.run(resumed.run(2, 0))
    assert [g[0].response_token_ids for g in again.groups] == [g[0].response_token_ids for g in third.groups]
    assert [g[0].index for g in again.groups] == [10, 11, 12, 13, 14]
    rows = [g[0].metadata["data_row"] for r in (first, third) for g in r.groups]
    assert len(set(rows[:5])) == 5


def test_a_chat_that_cannot_train_is_named() -> None:
    source = sft_source()
    record = source.source.dataset.records[0]
    record.prompt = "a plain string"
    with pytest.raises(DataError, match="SFT needs a list of chat messages"):
        source._samples([record], 0)


def test_stop_tokens_come_from_the_checkpoint_configs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [151329, 151336, 151338]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert checkpoint_stop_token_ids(tmp_path) == [151329, 151336, 151338, 7]
    assert checkpoint_stop_token_ids(ROOT / "assets" / "tiny_qwen3") == [4]


def test_teacher_log_probs_are_the_response_s_and_travel_to_the_trainer() -> None:
    sample = Sample(index=3, group_index=0, prompt="p", prompt_token_ids=[1, 2], response_token_ids=[5, 6, 7],
                    response_logprobs=[-1.0] * 3)
    result = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.1, 2, None], [-0.2, 5, None],
                                                     [-0.3, 6, None], [-0.4, 7, None]]}}
    assert response_logprobs(result, sample) == [-0.2, -0.3, -0.4]
    with pytest.raises(TeacherError, match="4 input log-probs for sample 3 of 5 tokens"):
        response_logprobs({"meta_info": {"input_token_logprobs": [[None, 1]] * 4}}, sample)
    assert generate_url("http://127.0.0.1:13141/generate") == ("http://127.0.0.1:13141", "/generate")
    assert generate_url("http://h:1") == ("http://h:1", "/generate")
    sample.teacher_logprobs = [-0.2, -0.3, -0.4]
    arrays = pack_samples([sample], [0.0])
    np.testing.assert_allclose(arrays["teacher_logprobs"], [-0.2, -0.3, -0.4])
    batch = TrainBatch.from_arrays(arrays)
    assert batch.teacher_logprobs is not None and batch.teacher_logprobs[0] == pytest.approx([-0.2, -0.3, -0.4])
    assert TrainBatch.from_arrays(batch.to_arrays()).teacher_logprobs == batch.teacher_logprobs
    assert "teacher_logprobs" not in pack_samples([Sample(index=0, group_index=0, prompt="p", prompt_token_ids=[1],
                                                          response_token_ids=[2], response_logprobs=[-1.0])], [0.0])


SFT_LINE = ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--input-key", "messages",
            "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
            "--debug-train-only"]


def problems(*flags: str, config: str = "configs/tiny_cpu.yaml") -> list[str]:
    return [str(p) for p in collect_problems(load_config([ROOT / config], list(flags)), check_files=False)]


def found(*flags: str, config: str = "configs/tiny_cpu.yaml") -> set[tuple[str, str]]:
    """(field, code) of every problem."""
    return {(p.field, p.code) for p in collect_problems(load_config([ROOT / config], list(flags)), check_files=False)}


def test_sft_is_a_trainer_only_job_with_slime_s_data_keys() -> None:
    config = load_config([], [*SFT_LINE, "--rollout-batch-size", "16", "--global-batch-size", "16",
                              "--rollout-num-gpus", "8"])
    assert (config.cluster.debug_train_only, config.cluster.rollout_num_gpus, config.cluster.num_engines) == (
        True, 0, 0)
    assert (config.rollout.n_samples_per_prompt, config.rollout.label_key, config.rollout.tool_key) == (1, None, "tools")
    assert plan_topology(config.cluster).engines == () and len(plan_topology(config.cluster).groups) == 1
    assert problems(config="configs/tiny_sft_cpu.yaml") == []
    assert ("rollout.n_samples_per_prompt", "unsupported") in found(
        "--n-samples-per-prompt", "8", "--global-batch-size", "128", config="configs/tiny_sft_cpu.yaml")
    assert ("algorithm.loss_type", "needs") in found("--loss-type", "sft_loss")
    assert ("cluster.debug_train_only", "needs") in found("--debug-train-only")
    assert ("rollout.partial_rollout", "unsupported") in found("--partial-rollout", config="configs/tiny_sft_cpu.yaml")
    assert ("rollout.rollout_function_path", "not_one_of") in found("--rollout-function-path", "my.rollout.fn")
    assert any("rollout.n_samples_per_prompt: 8: SFT trains each chat once" in p for p in problems(
        "--n-samples-per-prompt", "8", "--global-batch-size", "128", config="configs/tiny_sft_cpu.yaml"))
    assert any("SFT is --rollout-function-path" in p for p in problems("--loss-type", "sft_loss"))
    assert any("a trainer-only job trains on the data's chats" in p for p in problems("--debug-train-only"))
    assert any("rollout.partial_rollout: SFT runs no engines" in p for p in problems(
        "--partial-rollout", config="configs/tiny_sft_cpu.yaml"))
    assert any("per-sample generation logic goes in" in p for p in problems(
        "--rollout-function-path", "my.rollout.fn"))


def test_opd_rules_and_slime_s_sglang_line() -> None:
    slime = ["--use-opd", "--opd-type", "sglang", "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func",
             "--custom-reward-post-process-path", "slime.rollout.on_policy_distillation.post_process_rewards",
             "--rm-url", "http://10.0.0.1:13141/generate"]
    config = load_config([ROOT / "configs/tiny_cpu.yaml"], slime)
    assert config.distillation.opd_teacher_url == "http://10.0.0.1:13141/generate"
    assert config.rollout.custom_rm_path == "hpc_rl.rollout.teacher.distillation_reward"
    assert problems(*slime) == []
    assert ("distillation.opd_type", "needs") in found("--use-opd")
    assert ("distillation.opd_teacher_load", "needs") in found("--use-opd", "--opd-type", "megatron")
    assert ("distillation.opd_type", "unused") in found("--opd-type", "megatron")
    assert ("distillation.opd_teacher_hf_checkpoint", "needs") in found("--use-opd", "--opd-type", "sglang")
    assert ("distillation.use_opd", "needs") in found(*slime[3:])
    assert any("--use-opd needs --opd-type" in p for p in problems("--use-opd"))
    assert any("needs --opd-teacher-load" in p for p in problems("--use-opd", "--opd-type", "megatron"))
    assert any("is read only with --use-opd" in p for p in problems("--opd-type", "megatron"))
    assert any("needs one teacher" in p for p in problems("--use-opd", "--opd-type", "sglang"))
    assert any("add both" in p for p in problems(*slime[3:]))


def test_opd_teacher_and_student_must_share_a_tokenizer(tmp_path: Path) -> None:
    flags = ["--use-opd", "--opd-type", "sglang", "--set", f"distillation.opd_teacher_hf_checkpoint={tmp_path}"]
    (tmp_path / "config.json").write_text("{}")
    tokenizer = json.loads((ROOT / "assets/tiny_qwen3/tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["copy"], tokenizer["model"]["vocab"]["add"] = 9, 8
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = load_config([ROOT / "configs/tiny_cpu.yaml"], flags)
    assert config.cluster.opd_teacher_num_gpus == 1 and plan_topology(config.cluster).teacher is not None
    mismatched = [p for p in collect_problems(config) if p.code == "mismatch"]
    assert [p.field for p in mismatched] == ["distillation.opd_teacher_hf_checkpoint"]
    assert "tokenize differently" in mismatched[0].message
    assert not [p for p in collect_problems(load_config([ROOT / "configs/tiny_opd_cpu.yaml"])) if "tokeniz" in str(p)]


def test_megatron_role_file_sets_the_critic_and_the_actor(tmp_path: Path) -> None:
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - {name: default, role: critic, overrides: {lr: 1e-5, save: /c, load: /c}}\n"
                     "  - {name: default, role: actor, args: {lr: 1e-6, min_lr: 1e-7, num_gpus_per_node: 4}}\n")
    config = load_config([ROOT / "configs/tiny_ppo_cpu.yaml"], ["--megatron-config-path", str(roles)])
    assert config.critic.critic_optimizer == {"lr": 1e-5} and (config.critic.critic_save, config.critic.critic_load) \
        == ("/c", "/c")
    assert (config.optimizer.lr, config.optimizer.min_lr) == (1e-6, 1e-7)
    roles.write_text("megatron:\n  - {role: critic, overrides: {tensor_model_parallel_size: 4, foo: 1}}\n")
    with pytest.raises(Exception) as error:
        load_config([ROOT / "configs/tiny_ppo_cpu.yaml"], ["--megatron-config-path", str(roles)])
    assert "share one parallel layout" in str(error.value) and "role critic: foo: not a per-role setting" in str(
        error.value)
    assert any("critic.value_clip: is read only with --advantage-estimator ppo" in p
               for p in problems("--value-clip", "0.3"))
    assert problems("--advantage-estimator", "ppo", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2",
                    "--qkv-format", "thd") == []  # the critic at CP > 1 (and PP > 1): issue 29


def test_slimes_ppo_critic_only_line_resolves(tmp_path: Path) -> None:
    """slime's tests/test_qwen3_4B_ppo_train_critic_only.py: Qwen3-4B, TP2 + SP, CP2, colocated on 8 GPUs,
    critic-only rollouts first, the critic's own lr from its role file."""
    from tests.unit.slime_lines import flags_of

    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - {name: default, role: critic, overrides: {lr: 1e-5}}\n")
    config = load_config([], [*flags_of("qwen3_4B_model_args.txt"), *flags_of("qwen3_4B_ppo_critic_only_rest.txt"),
                              "--megatron-config-path", str(roles)])
    assert [str(p) for p in collect_problems(config, check_files=False)] == []
    training = config.training
    assert (training.tensor_model_parallel_size, training.context_parallel_size, config.cluster.colocate,
            config.cluster.trainer_world_size) == (2, 2, True, 8)
    assert (config.algorithm.advantage_estimator, config.critic.num_critic_only_steps,
            config.critic.critic_optimizer) == ("ppo", 2, {"lr": 1e-5})


def test_lr_schedule_runs_over_the_whole_run_with_a_warmup_fraction() -> None:
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_fraction=0.1)
    run = schedule_for_run(config, 100)
    assert (run.lr_decay_iters, run.lr_warmup_iters) == (100, 10)
    assert learning_rate(run, 5) == pytest.approx(5e-4)  # linear warm-up from 0
    assert learning_rate(run, 10) == pytest.approx(1e-3)
    middle = 1e-4 + 0.9e-3 * 0.5 * (math.cos(math.pi * 0.5) + 1)
    assert learning_rate(run, 55) == pytest.approx(middle)
    assert learning_rate(run, 100) == pytest.approx(1e-4)
    assert schedule_for_run(run, 500) == run  # idempotent once the run's length is known
    assert schedule_for_run(OptimizerConfig(lr_decay_iters=7), 100).lr_decay_iters == 7
    assert any("not both" in p for p in problems("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"))


def test_teacher_component_gets_a_het_group_of_its_own() -> None:
    topology = plan_topology(ClusterConfig(rollout_num_gpus=2, opd_teacher_num_gpus=2))
    assert [g.role for g in topology.groups] == ["trainer", "rollout", "teacher"]
    assert topology.teacher is not None and topology.teacher.gpu_ids == (0, 1)
    assert topology.teacher.port not in {e.port for e in topology.engines}
    assert "teacher (on-policy distillation)" in topology.describe()
    trainer_only = plan_topology(ClusterConfig(debug_train_only=True, rollout_num_gpus=0))
    assert "no engines, no router" in trainer_only.describe() and "router" not in trainer_only.describe().split(
        "ports:")[1]


def test_greedy_hits_ignore_the_padded_vocabulary() -> None:
    import torch

    from hpc_rl.training.logprobs import vocab_parallel_greedy_hits

    logits = torch.tensor([[0.1, 2.0, 0.3, 9.0], [1.0, 0.5, 1.0, 9.0]])  # column 3 is padding (vocab_size 3)
    hits = vocab_parallel_greedy_hits(logits, torch.tensor([1, 2]), vocab_size=3)
    assert hits.tolist() == [1.0, 1.0]  # row 2: a tie with token 0 counts (greedy may pick it)
    assert vocab_parallel_greedy_hits(logits, torch.tensor([0, 1]), vocab_size=3).tolist() == [0.0, 0.0]
