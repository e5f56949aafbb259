"""The batch arithmetic and GPU topology rules of a run: how samples split into steps and ranks onto GPUs.

Owns: rollout samples == global_batch_size x num_steps_per_rollout (with a hint of sizes that fit), engines formed
from rollout GPUs, colocation's GPU sharing, engines spanning whole nodes, external engine addresses; the trainer's
own layout (TP x PP x CP dividing its GPUs, DP the batch) is `parallel_layout`'s, called from here. Called by
`hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

from hpc_rl.config.parallel_layout import ParallelLayout, dense_layout_problems
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.cluster import ClusterConfig
from hpc_rl.config.sglang_options import engine_kind, external_engine_url
from hpc_rl.config.training_modes import is_sft


def batch_problems(config: RunConfig) -> list[Problem]:
    rollout, training = config.rollout, config.training
    problems = []
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    trained = training.global_batch_size * training.num_steps_per_rollout
    if samples != trained:
        problems.append(Problem(
            "rollout.rollout_batch_size",
            "not_divisible",
            f"rollout_batch_size * n_samples_per_prompt ({rollout.rollout_batch_size} * "
            f"{rollout.n_samples_per_prompt} = {samples}) must equal global_batch_size * num_steps_per_rollout "
            f"({training.global_batch_size} * {training.num_steps_per_rollout} = {trained})"
            + _batch_hint(samples, training.num_steps_per_rollout, rollout.rollout_batch_size,
                          rollout.n_samples_per_prompt, training.global_batch_size),
        ))
    prompt_len, context_len = rollout.rollout_max_prompt_len, rollout.rollout_max_context_len
    if prompt_len is not None and context_len is not None and prompt_len > context_len - 1:
        problems.append(Problem(
            "rollout.rollout_max_prompt_len",
            "out_of_range",
            f"{prompt_len} leaves no room for a response in rollout_max_context_len {context_len}: set it to at most "
            f"{context_len - 1} (or leave it unset: rollout_max_context_len - 1)",
        ))
    if rollout.over_sampling_batch_size is not None and rollout.over_sampling_batch_size < rollout.rollout_batch_size:
        problems.append(Problem(
            "rollout.over_sampling_batch_size",
            "out_of_range",
            f"{rollout.over_sampling_batch_size} is below rollout_batch_size ({rollout.rollout_batch_size}); "
            f"set it >= rollout_batch_size",
        ))
    if training.use_dynamic_batch_size and not training.max_tokens_per_gpu:
        problems.append(Problem("training.max_tokens_per_gpu", "needs",
                                "use_dynamic_batch_size needs max_tokens_per_gpu"))
    if rollout.rm_type is None and rollout.custom_rm_path is None and not is_sft(rollout.rollout_function_path):
        problems.append(Problem("rollout.rm_type", "needs",
                                "no reward: set rm_type (e.g. deepscaler) or custom_rm_path"))
    if rollout.rm_type == "remote_rm" and not rollout.rm_url:
        problems.append(Problem("rollout.rm_url", "needs", "rm_type remote_rm needs rm_url"))
    if config.eval.eval_interval is not None and not config.eval.eval_prompt_data:
        problems.append(Problem("eval.eval_interval", "needs",
                                "eval_interval is set but eval_prompt_data is empty"))
    if rollout.num_rollout is None and rollout.num_epoch is None:
        problems.append(Problem("rollout.num_rollout", "needs", "set num_rollout or num_epoch"))
    return problems


def _batch_hint(samples: int, steps: int, *sizes: int) -> str:
    """What to set so that a rollout's samples split into optimizer steps; '' when a size is itself invalid
    (below 1: its own range problem says so, and any arithmetic on it would mislead)."""
    if min(steps, *sizes) < 1:
        return ""
    if samples % steps == 0:
        return f"; e.g. set global_batch_size to {samples // steps}"
    divisors = sorted((d for d in range(1, samples + 1) if samples % d == 0), key=lambda d: (abs(d - steps), d))[:3]
    options = ", ".join(f"{samples // d} x {d}" for d in sorted(divisors))
    return (f"; num_steps_per_rollout {steps} does not divide {samples} samples: set global_batch_size x "
            f"num_steps_per_rollout to one of {options}, or change rollout_batch_size")


def engine_count_problems(cluster: ClusterConfig) -> list[Problem]:
    """Engines are formed from the rollout GPUs: a whole number of engines of >= 1 GPU (validation and
    `hpc_rl.launch.topology.plan_topology` both ask this)."""
    if cluster.rollout_num_gpus_per_engine < 1:
        return [Problem("cluster.rollout_num_gpus_per_engine", "out_of_range", "must be >= 1")]
    if cluster.rollout_num_gpus % cluster.rollout_num_gpus_per_engine:
        return [Problem("cluster.rollout_num_gpus", "not_divisible",
                        f"{cluster.rollout_num_gpus} is not divisible by rollout_num_gpus_per_engine "
                        f"({cluster.rollout_num_gpus_per_engine}); engines cannot be formed")]
    return []


def engine_span_problem(engine_tp: int, gpus_per_node: int) -> Problem | None:
    """An engine larger than a node takes whole nodes (SGLang splits its TP ranks evenly over its --nnodes);
    validation and `hpc_rl.launch.topology.engine_nodes` both ask this."""
    if engine_tp <= gpus_per_node or gpus_per_node < 1 or engine_tp % gpus_per_node == 0:
        return None
    return Problem("cluster.rollout_num_gpus_per_engine", "not_divisible",
                   f"an engine of {engine_tp} GPUs spans nodes of {gpus_per_node} GPUs, so it must take whole nodes: "
                   f"make rollout_num_gpus_per_engine a multiple of {gpus_per_node} (or at most {gpus_per_node}; "
                   f"SGLang splits an engine's TP ranks evenly over its --nnodes)")


def topology_problems(config: RunConfig) -> list[Problem]:
    cluster, training = config.cluster, config.training
    problems = engine_count_problems(cluster)
    world = cluster.trainer_world_size
    problems += dense_layout_problems(ParallelLayout.of_run(config), training.global_batch_size)
    if cluster.colocate:
        if cluster.rollout_num_gpus != world:
            problems.append(Problem(
                "cluster.rollout_num_gpus",
                "mismatch",
                f"colocate: engines share the trainer's GPUs, so rollout_num_gpus ({cluster.rollout_num_gpus}) "
                f"must equal actor_num_nodes * actor_num_gpus_per_node ({world})",
            ))
        engine_tp, per_node = cluster.rollout_num_gpus_per_engine, cluster.actor_num_gpus_per_node
        if engine_tp >= 1 and per_node % engine_tp and engine_tp % per_node:
            problems.append(Problem(
                "cluster.rollout_num_gpus_per_engine",
                "not_divisible",
                f"colocate: an engine of {engine_tp} GPUs must sit on the GPUs of whole trainer ranks: it must divide "
                f"actor_num_gpus_per_node ({per_node}) or, spanning nodes, be a multiple of it",
            ))
    elif (cluster.rollout_num_gpus < 1 and not config.rollout.rollout_external_engine_addrs
          and not cluster.debug_train_only):
        problems.append(Problem("cluster.rollout_num_gpus", "needs",
                                "decoupled mode needs rollout_num_gpus >= 1"))
    problems += _engine_span_problems(config) + _external_engine_problems(config)
    if cluster.device == "cuda":
        if cluster.actor_num_gpus_per_node > cluster.num_gpus_per_node:
            problems.append(Problem(
                "cluster.actor_num_gpus_per_node",
                "out_of_range",
                f"{cluster.actor_num_gpus_per_node} exceeds num_gpus_per_node ({cluster.num_gpus_per_node})",
            ))
    return problems


def _external_engine_problems(config: RunConfig) -> list[Problem]:
    """slime's --rollout-external-engine-addrs: each address well formed; engines another job runs cannot share
    the trainer's GPUs."""
    addresses = config.rollout.rollout_external_engine_addrs
    problems = []
    for index, address in enumerate(addresses):
        try:
            external_engine_url(address)
        except ValueError as error:
            problems.append(Problem(f"rollout.rollout_external_engine_addrs[{index}]", "bad_type",
                                    str(error)))
    if addresses and config.cluster.colocate:
        problems.append(Problem("rollout.rollout_external_engine_addrs",
                                "conflict",
                                "external engines run on GPUs this job does not hold, so they cannot be colocated "
                                "with the trainer: drop --colocate (or the external engines)"))
    return problems


def _engine_span_problems(config: RunConfig) -> list[Problem]:
    """An engine larger than a node spans whole nodes (SGLang's --nnodes splits its TP ranks evenly); the CPU
    engine cannot follow such an engine's weight-update group (each node's TP ranks join it in SGLang)."""
    cluster = config.cluster
    engine_tp = cluster.rollout_num_gpus_per_engine
    per_node = cluster.actor_num_gpus_per_node if cluster.colocate else cluster.num_gpus_per_node
    if engine_tp <= per_node or per_node < 1:
        return []
    span = engine_span_problem(engine_tp, per_node)
    if span is not None:  # colocated: the colocation rule (whole trainer ranks) says it
        return [] if cluster.colocate else [span]
    if (not cluster.colocate and config.rollout.update_weight_transport != "disk"
            and engine_kind(config.rollout.engine, cluster.device) == "cpu"):
        return [Problem("cluster.rollout_num_gpus_per_engine",
                        "unsupported",
                        f"the CPU engine spans {engine_tp // per_node} nodes here, and cannot join a weight-update "
                        "group with the TP ranks of every node (as SGLang does): use colocated mode, "
                        "--update-weight-transport disk, or engines of at most one node")]
    return []
