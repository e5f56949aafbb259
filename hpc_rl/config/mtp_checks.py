"""Submit-time checks of multi-token prediction (MTP) and SGLang's speculative decoding (which drafts with the MTP
layers). Named for what it checks: MLA's own field rules are `hpc_rl.models.mla`'s, MoE's `moe_checks`'.

Owns: what slime, Megatron-core 0.16.1 or SGLang 0.5.23 would refuse only after the queue wait, as problems
that name the numbers: `--enable-mtp-training` without MTP layers (slime asserts), MTP layers on a model
family hpc_rl cannot map (uneven pipeline stages: `pipeline_split`, checked with the model), SGLang's EAGLE / NEXTN
draft on a DeepSeek-V3 / GLM-4.7-Flash checkpoint (SGLang drafts with the checkpoint's own MTP layer,
exactly one: `DeepseekV3ForCausalLMNextN`; hpc_rl keeps that layer current only when the trainer holds it,
`--mtp-num-layers 1`) and the speculative options SGLang asserts on at start; and the note a cpu-engine
run with speculative options gets (the CPU engine decodes token by token; the MTP weights still arrive).
"""

from __future__ import annotations

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import engine_kind

Problems = list[Problem]
DRAFTING_ALGORITHMS = ("EAGLE", "NEXTN")
"""SGLang algorithms that draft with a DeepSeek-V3 / GLM-4.7-Flash checkpoint's own MTP layer (NEXTN is an
alias of EAGLE in 0.5.23)."""
NEXTN_LAYERS = 1
"""MTP layers SGLang 0.5.23's NextN draft loads (it asserts num_nextn_predict_layers == 1)."""


def mtp_training_problems(config: RunConfig, arch: ModelArchitecture | None) -> Problems:
    training = config.training
    problems: Problems = []
    if training.enable_mtp_training and (arch is None or not arch.mtp_num_layers):
        problems.append(Problem("training.enable_mtp_training", "needs",
                                "trains the MTP layers, but the model has none: add "
                                "--mtp-num-layers (slime asserts the same)"))
    return problems


def speculative_problems(config: RunConfig, arch: ModelArchitecture | None) -> Problems:
    """SGLang's speculative options against the model (checked when SGLang is the engine)."""
    if engine_kind(config.rollout.engine, config.cluster.device) != "sglang":
        return []
    options = config.sglang.server_options()
    algorithm = str(options.get("speculative_algorithm") or "").upper()
    if not algorithm:
        return []
    problems: Problems = []
    if options.get("speculative_num_steps") is None and (options.get("speculative_eagle_topk") is not None
                                                         or options.get("speculative_num_draft_tokens") is not None):
        problems.append(Problem("sglang.extra_args.speculative_num_steps", "unsupported", (
            "--sglang-speculative-eagle-topk / --sglang-speculative-num-draft-tokens without "
            "--sglang-speculative-num-steps: SGLang 0.5.23 asserts they come together (or all three left out)")))
    if (algorithm in DRAFTING_ALGORITHMS and arch is not None and arch.multi_latent_attention
            and not options.get("speculative_draft_model_path")):
        if (arch.mtp_num_layers or 0) != NEXTN_LAYERS:
            problems.append(Problem("sglang.extra_args.speculative_algorithm", "needs", (
                f"{algorithm} drafts with the checkpoint's MTP layer (SGLang's NextN draft, exactly "
                f"{NEXTN_LAYERS} layer), which stays current only if the trainer holds and syncs it: the model has "
                f"mtp_num_layers {arch.mtp_num_layers}; add --mtp-num-layers {NEXTN_LAYERS}")))
    return problems


def speculative_notes(config: RunConfig) -> list[str]:
    """One line when speculative options meet the CPU engine."""
    options = config.sglang.server_options()
    if engine_kind(config.rollout.engine, config.cluster.device) == "cpu" and options.get("speculative_algorithm"):
        return [f"--sglang-speculative-algorithm {options['speculative_algorithm']}: the CPU engine decodes token by "
                f"token (drafting changes SGLang's speed, not what it samples); the MTP layers' weights still reach "
                f"it in every weight sync, under the names SGLang's NextN draft loads"]
    return []


def mtp_problems(config: RunConfig, arch: ModelArchitecture | None) -> Problems:
    """MTP training and the speculative options that draft with the MTP layers."""
    return mtp_training_problems(config, arch) + speculative_problems(config, arch)
