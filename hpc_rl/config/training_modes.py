"""The training modes besides GRPO-style RL, as the config sees them: SFT, on-policy distillation, PPO's critic.

Owns what slime's flags for these modes derive when the config is built (`derive_mode_settings`, on the raw
section dicts, before slime's batch split) and their cross-field rules at submit time (`mode_problems`):

    (any) --sequence-parallel at tensor_model_parallel_size 1 is turned off, as Megatron does (slime's SFT
          recipe passes both)
    SFT   rollout_function_path slime.rollout.sft_rollout.generate_rollout: a trainer-only job
          (cluster.debug_train_only, rollout_num_gpus 0), one sample per chat (n_samples_per_prompt 1),
          slime's data keys for chats (label_key null, tool_key "tools"), loss_type sft_loss
    OPD   slime's sglang line (--custom-rm-path ...on_policy_distillation.reward_func
          --custom-reward-post-process-path ...post_process_rewards --rm-url U): teacher log-probs from U
          (distillation.opd_teacher_url), task reward 0, as slime's post-process returns
    PPO   --megatron-config-path: its role=actor overrides go to the optimizer / checkpoint sections, its
          role=critic overrides to the critic section (slime keeps parallel settings shared: so does this)

Not here: what each mode does at run time (`hpc_rl.rollout.sft`, `hpc_rl.rollout.teacher`,
`hpc_rl.training.critic`), the fields themselves (`schema`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.algorithm import AlgorithmConfig, DistillationConfig
from hpc_rl.config.sections.rollout import ROLLOUT_FUNCTIONS, SFT_ROLLOUT
from hpc_rl.config.sections.training import OptimizerConfig
from hpc_rl.config.typing_rules import ConfigError, coerce_value

log = logging.getLogger(__name__)

SLIME_OPD_POST_PROCESS = "slime.rollout.on_policy_distillation.post_process_rewards"
OPD_TASK_REWARD = "hpc_rl.rollout.teacher.distillation_reward"
"""What slime's OPD reward function becomes: reward 0 for every sample (slime's post-process returns 0.0)."""
OPD_POST_PROCESS = "hpc_rl.rollout.teacher.distillation_post_process"
"""What slime's OPD post-process becomes (slime_flags maps the path)."""

OPTIMIZER_KEYS = frozenset(f.name for f in dataclasses.fields(OptimizerConfig))
OPTIMIZER_HINTS = typing.get_type_hints(OptimizerConfig)
SHARED_LAYOUT_KEYS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
    "expert_model_parallel_size", "expert_tensor_parallel_size"})
IGNORED_ROLE_KEYS = frozenset({"num_nodes", "num_gpus_per_node"})
"""slime ignores these in a role's overrides (GPU allocation follows the command line): so does hpc_rl."""

Given = Callable[[str, str], Any]
"""(section, field) -> the value given, else the field's default."""


def is_sft(rollout_function_path: str | None) -> bool:
    return rollout_function_path == SFT_ROLLOUT


def derive_mode_settings(raw: dict[str, dict[str, Any]], given: Given) -> list[str]:
    """Fill in what the modes imply and was not given; returns problems (a bad role file)."""
    rollout, cluster, training = raw["rollout"], raw["cluster"], raw["training"]
    if is_sft(given("rollout", "rollout_function_path")):
        cluster.setdefault("debug_train_only", True)
        rollout.setdefault("n_samples_per_prompt", 1)
        rollout.setdefault("label_key", None)
        rollout.setdefault("tool_key", "tools")
    if given("cluster", "debug_train_only"):
        if cluster.get("rollout_num_gpus"):
            log.info("a trainer-only job (SFT) starts no engine: rollout_num_gpus %s is ignored",
                     cluster["rollout_num_gpus"])
        cluster["rollout_num_gpus"] = 0
    if given("distillation", "opd_teacher_hf_checkpoint"):
        cluster.setdefault("opd_teacher_num_gpus", 1)
    if given("rollout", "custom_reward_post_process_path") == OPD_POST_PROCESS and given("rollout", "rm_url"):
        raw["distillation"].setdefault("opd_teacher_url", given("rollout", "rm_url"))
    path = given("critic", "megatron_config_path")
    return apply_role_file(path, raw) if path else []


def _role_entries(path: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """role -> its overrides, from slime's `megatron: [{name, role, overrides | args}]` file."""
    where = f"critic.megatron_config_path {path}"
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        return {}, [f"{where}: cannot be read: {error}"]
    entries = data.get("megatron") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return {}, [f"{where}: needs a top-level `megatron` list, e.g. megatron: [{{name: default, role: critic, "
                    f"overrides: {{lr: 1e-5}}}}]"]
    roles: dict[str, dict[str, Any]] = {}
    problems = []
    for entry in entries:
        role = entry.get("role") if isinstance(entry, dict) else None
        if role not in ("actor", "critic"):
            problems.append(f"{where}: entry {entry!r} needs role actor or critic")
        elif role in roles:
            problems.append(f"{where}: more than one entry with role {role} (slime takes at most one)")
        else:
            roles[role] = dict(entry.get("overrides") or entry.get("args") or {})
    return roles, problems


def apply_role_file(path: str, raw: dict[str, dict[str, Any]]) -> list[str]:
    """slime's role overrides: optimizer settings and load/save per role; anything else is a problem."""
    roles, problems = _role_entries(path)
    for role, overrides in roles.items():
        for key, value in overrides.items():
            where = f"critic.megatron_config_path {path}: role {role}: {key}"
            if key in IGNORED_ROLE_KEYS:
                continue
            if key in SHARED_LAYOUT_KEYS:
                problems.append(f"{where}: actor and critic share one parallel layout (as in slime): set it on the "
                                f"command line, not per role")
            elif key in OPTIMIZER_KEYS:  # YAML reads 1e-5 as a string: typed as the field (slime coerces too)
                try:
                    value = coerce_value(value, OPTIMIZER_HINTS[key], where)
                except ConfigError as error:
                    problems.append(str(error))
                    continue
                if role == "actor":
                    raw["optimizer"][key] = value
                else:
                    raw["critic"].setdefault("critic_optimizer", {})[key] = value
            elif key in ("load", "save"):
                target = ("checkpoint", key) if role == "actor" else ("critic", f"critic_{key}")
                raw[target[0]][target[1]] = value
            else:
                problems.append(f"{where}: not a per-role setting hpc_rl applies (per role: "
                                f"{', '.join(sorted(OPTIMIZER_KEYS))}, load, save)")
    return problems


# ----------------------------------------------------------------------------------------------- submit time


def mode_problems(config: RunConfig, *, check_files: bool = True) -> list[Problem]:
    """A problem for every rule of the training modes the config breaks (with check_files: the teacher's
    files too, and that teacher and student share a tokenizer)."""
    problems = [*_sft_problems(config), *_distillation_problems(config), *_critic_problems(config),
                *_schedule_problems(config)]
    if check_files and config.distillation.use_opd:
        problems += _teacher_file_problems(config)
    return problems


def _sft_problems(config: RunConfig) -> list[Problem]:
    rollout, algorithm, cluster = config.rollout, config.algorithm, config.cluster
    problems = []
    if rollout.rollout_function_path not in ROLLOUT_FUNCTIONS:
        problems.append(Problem("rollout.rollout_function_path",
                         "not_one_of",
                         f"{rollout.rollout_function_path}: hpc_rl runs slime's {' or '.join(ROLLOUT_FUNCTIONS)}; "
                         f"per-sample generation logic goes in --custom-generate-function-path"))
    sft = is_sft(rollout.rollout_function_path)
    if sft != (algorithm.loss_type == "sft_loss"):
        problems.append(Problem("algorithm.loss_type",
                         "needs",
                         "SFT is --rollout-function-path slime.rollout.sft_rollout.generate_rollout with --loss-type "
                         "sft_loss: give both (slime's SFT line does)"))
    if cluster.debug_train_only and not sft:
        problems.append(Problem("cluster.debug_train_only",
                         "needs",
                         "a trainer-only job trains on the data's chats (SFT): add --rollout-function-path "
                         "slime.rollout.sft_rollout.generate_rollout --loss-type sft_loss; replaying saved rollouts "
                         "(--load-debug-rollout-data) is not offered"))
    if sft and not cluster.debug_train_only:
        problems.append(Problem("cluster.debug_train_only", "unsupported",
                                "SFT generates nothing: it runs as a trainer-only job; drop "
                                "--no-debug-train-only"))
    if sft and rollout.n_samples_per_prompt != 1:
        problems.append(Problem("rollout.n_samples_per_prompt", "unsupported",
                                f"{rollout.n_samples_per_prompt}: SFT trains each chat "
                                f"once per epoch; set 1"))
    if not sft:
        return problems
    engine_settings = {"cluster.colocate": cluster.colocate, "rollout.partial_rollout": rollout.partial_rollout,
                       "rollout.dynamic_sampling_filter_path": rollout.dynamic_sampling_filter_path,
                       "rollout.custom_generate_function_path": rollout.custom_generate_function_path,
                       "distillation.use_opd": config.distillation.use_opd}
    for field, value in engine_settings.items():
        if value:
            problems.append(Problem(field, "unsupported",
                                    "SFT runs no engines (a trainer-only job): drop it"))
    if config.algorithm.advantage_estimator == "ppo":
        problems.append(Problem("algorithm.advantage_estimator", "unsupported",
                                "ppo trains a critic on rewards; SFT has none"))
    return problems


def _distillation_problems(config: RunConfig) -> list[Problem]:
    opd, rollout = config.distillation, config.rollout
    problems = []
    slime_opd_reward = rollout.custom_rm_path == OPD_TASK_REWARD
    post = rollout.custom_reward_post_process_path
    if (slime_opd_reward or post == OPD_POST_PROCESS) and not (opd.use_opd and opd.opd_type == "sglang"):
        problems.append(Problem("distillation.use_opd", "needs",
                                "slime's OPD reward fetches teacher log-probs for --use-opd "
                                "--opd-type sglang: add both"))
    if slime_opd_reward and post != OPD_POST_PROCESS:
        problems.append(Problem("rollout.custom_reward_post_process_path",
                         "needs",
                         f"slime's OPD reward needs its post-process: add --custom-reward-post-process-path "
                         f"{SLIME_OPD_POST_PROCESS}"))
    if not opd.use_opd:
        for name in ("opd_type", "opd_teacher_load", "opd_teacher_ckpt_step", "opd_teacher_hf_checkpoint"):
            if getattr(opd, name) is not None:
                problems.append(Problem(f"distillation.{name}", "unused",
                                        "is read only with --use-opd: add it or drop this"))
        return problems
    if opd.opd_type is None:
        problems.append(Problem("distillation.opd_type", "needs",
                                "--use-opd needs --opd-type sglang or megatron"))
    if opd.opd_type == "megatron":
        if not opd.opd_teacher_load:
            problems.append(Problem("distillation.opd_teacher_load", "needs",
                                    "--opd-type megatron needs --opd-teacher-load (the "
                                    "teacher's torch_dist checkpoint)"))
        for name in ("opd_teacher_hf_checkpoint", "opd_teacher_url"):
            if getattr(opd, name):
                problems.append(Problem(f"distillation.{name}", "unused",
                                        "is for --opd-type sglang (a teacher server)"))
    if opd.opd_type == "sglang":
        if opd.opd_teacher_load:
            problems.append(Problem("distillation.opd_teacher_load", "unused",
                                    "is for --opd-type megatron; with sglang the teacher is "
                                    "a server (--rm-url) or opd_teacher_hf_checkpoint"))
        if bool(opd.opd_teacher_hf_checkpoint) == bool(opd.opd_teacher_url):
            problems.append(Problem("distillation.opd_teacher_hf_checkpoint",
                             "needs",
                             "--opd-type sglang needs one teacher: opd_teacher_hf_checkpoint (started with the job) or "
                             "slime's --rm-url with its OPD reward and post-process (a server you started)"))
        if opd.opd_teacher_url and not opd.opd_teacher_url.startswith("http://"):
            problems.append(Problem("distillation.opd_teacher_url", "unsupported",
                                    f"{opd.opd_teacher_url}: the teacher is an SGLang server "
                                    f"reached over http://"))
    teacher_gpus = config.cluster.opd_teacher_num_gpus
    if bool(teacher_gpus) != bool(opd.use_opd and opd.opd_type == "sglang" and opd.opd_teacher_hf_checkpoint):
        problems.append(Problem("cluster.opd_teacher_num_gpus",
                         "needs",
                         f"{teacher_gpus}: GPUs of the teacher the job starts, for --use-opd --opd-type sglang with "
                         f"distillation.opd_teacher_hf_checkpoint (>= 1 with it, 0 without)"))
    if config.algorithm.disable_compute_advantages_and_returns:
        problems.append(Problem("algorithm.disable_compute_advantages_and_returns", "unsupported",
                                "OPD adds its penalty to the advantages"))
    return problems


def frozen_model_roles(algorithm: AlgorithmConfig, distillation: DistillationConfig) -> list[str]:
    """The frozen models a trainer rank holds beside the actor (in host memory, swapped in for their pass): the
    reference when a KL term needs one (not with SFT or --disable-compute-advantages-and-returns, which compute
    no KL), and a teacher for on-policy distillation with opd_type megatron."""
    roles = []
    kl = algorithm.use_kl_loss or algorithm.kl_coef != 0.0
    if kl and not (algorithm.loss_type == "sft_loss" or algorithm.disable_compute_advantages_and_returns):
        roles.append("reference")
    if distillation.use_opd and distillation.opd_type == "megatron":
        roles.append("teacher")
    return roles


def _critic_problems(config: RunConfig) -> list[Problem]:
    critic, training = config.critic, config.training
    problems = []
    ppo = config.algorithm.advantage_estimator == "ppo"
    if not ppo:
        default = type(critic)()
        changed = [f.name for f in dataclasses.fields(critic) if getattr(critic, f.name) != getattr(default, f.name)]
        return [Problem(f"critic.{name}", "unused",
                        "is read only with --advantage-estimator ppo (the critic)") for name in changed]
    unknown = sorted(set(critic.critic_optimizer) - OPTIMIZER_KEYS)
    if unknown:
        problems.append(Problem("critic.critic_optimizer", "unknown_key",
                                f"unknown optimizer fields {unknown}; known: "
                                f"{', '.join(sorted(OPTIMIZER_KEYS))}"))
    if critic.value_clip <= 0:
        problems.append(Problem("critic.value_clip", "out_of_range", f"{critic.value_clip} must be > 0"))
    if critic.num_critic_only_steps < 0:
        problems.append(Problem("critic.num_critic_only_steps", "out_of_range", "must be >= 0"))
    if config.algorithm.loss_type != "policy_loss":
        problems.append(Problem("algorithm.loss_type", "unsupported",
                                "PPO trains the actor with policy_loss (and the critic with its "
                                "value loss)"))
    return problems


def _schedule_problems(config: RunConfig) -> list[Problem]:
    optimizer = config.optimizer
    fraction = optimizer.lr_warmup_fraction
    if fraction is None:
        return []
    if not 0 <= fraction <= 1:
        return [Problem("optimizer.lr_warmup_fraction", "out_of_range", f"{fraction} must be within [0, 1]")]
    if optimizer.lr_warmup_iters:
        return [Problem("optimizer.lr_warmup_fraction", "conflict",
                        "give lr_warmup_fraction or lr_warmup_iters, not both (Megatron)")]
    return []


def _vocabulary(directory: Path) -> dict[str, Any] | None:
    """What makes two tokenizers the same: tokenizer.json's vocabulary and added tokens (else vocab.json)."""
    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        data = json.loads(tokenizer_json.read_text())
        added = sorted((t["id"], t["content"]) for t in data.get("added_tokens") or [])
        return {"vocab": (data.get("model") or {}).get("vocab"), "added": added}
    vocab_json = directory / "vocab.json"
    if vocab_json.is_file():
        return {"vocab": json.loads(vocab_json.read_text())}
    return None


def _teacher_file_problems(config: RunConfig) -> list[Problem]:
    opd = config.distillation
    if opd.opd_type == "megatron" and opd.opd_teacher_load:
        teacher = Path(opd.opd_teacher_load)
        if (teacher / "config.json").is_file():  # an HF directory (hpc_rl loads those as ref_load too)
            return _same_tokenizer(teacher, Path(config.checkpoint.hf_checkpoint), "distillation.opd_teacher_load")
        if not ((teacher / "latest_checkpointed_iteration.txt").is_file() or (teacher / ".metadata").is_file()):
            return [Problem("distillation.opd_teacher_load", "bad_file",
                            f"{teacher} is neither a torch_dist checkpoint (no "
                            f"latest_checkpointed_iteration.txt, no .metadata) nor an HF "
                            f"directory: convert it with tools/convert_hf_to_torch_dist.py")]
        return []  # the student's architecture: a vocabulary that differs fails the load, naming the tensor
    if opd.opd_type != "sglang" or not opd.opd_teacher_hf_checkpoint:
        return []  # a teacher server started outside the job: its tokenizer cannot be read from here
    teacher, student = Path(opd.opd_teacher_hf_checkpoint), Path(config.checkpoint.hf_checkpoint)
    if not (teacher / "config.json").is_file():
        return [Problem("distillation.opd_teacher_hf_checkpoint", "bad_file",
                        f"{teacher} is not an HF model directory (no config.json)")]
    return _same_tokenizer(teacher, student, "distillation.opd_teacher_hf_checkpoint")


def _same_tokenizer(teacher: Path, student: Path, field: str) -> list[Problem]:
    try:
        teacher_vocab, student_vocab = _vocabulary(teacher), _vocabulary(student)
    except (OSError, ValueError) as error:
        return [Problem(field, "bad_file", f"cannot read a tokenizer: {error}")]
    if teacher_vocab is None or student_vocab is None:
        which = teacher if teacher_vocab is None else student
        return [Problem(field, "bad_file", f"{which} has no tokenizer.json or vocab.json to compare")]
    if teacher_vocab != student_vocab:
        return [Problem(field,
                 "mismatch",
                 f"teacher {teacher} and student {student} tokenize differently: the teacher's log-probs are read on "
                 f"the student's token ids, so they must share a tokenizer")]
    return []
