"""Building the run loop and what it runs on, from the resolved config: the one place that reads all of it.

Owns handing each part its own sections: the prompt source (rollout's data fields), the engine client
(sglang, controller), rewards (rollout's rm fields), the scheduler, eval (eval, rollout's sampling),
the trainers (algorithm), the weight path (cluster, rollout, controller), checkpoints (checkpoint),
the recorder (logging). Plug-ins (custom reward, filters, generate function) receive the whole config
as slime's flat `args`: that is slime's contract, so `plugin_args(config)` is built here too.
Not here: the controller process itself (`app`), the loop (`run_loop`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.config import plugin_args
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.schema import RolloutConfig, RunConfig
from hpc_rl.controller.checkpoints import Checkpoints
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import Registry
from hpc_rl.controller.rollouts import Rollouts
from hpc_rl.controller.run_loop import Evaluate, RunLoop
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.trainers import Trainers, reward_shaping
from hpc_rl.controller.weight_updates import WeightSyncSettings, WeightUpdates
from hpc_rl.data.prompt_tokenizer import load_prompt_tokenizer
from hpc_rl.data.prompts import DataKeys, PromptDataset, PromptEncoder, PromptSource, make_prompt_encoder
from hpc_rl.rewards.group import RewardSpec, reward_group
from hpc_rl.rewards.pool import RewardPool
from hpc_rl.rewards.scoring import REMOTE_RM, split_boxed_prefix
from hpc_rl.rollout import EngineClient, RolloutScheduler, eval_sampling_params, load_eval_datasets, run_eval
from hpc_rl.rollout.engine_client import engine_context_length
from hpc_rl.rollout.generate import load_generate_function
from hpc_rl.rollout.routed_experts import RoutingShape
from hpc_rl.rollout.scheduler import RewardFn
from hpc_rl.telemetry.recorder import RunRecorder
from hpc_rl.telemetry.scalars import ScalarLog

log = logging.getLogger(__name__)


def num_rollouts(rollout: RolloutConfig, dataset_size: int) -> int:
    """`num_rollout`, else `num_epoch` (default 1) passes over the prompts."""
    if rollout.num_rollout is not None:
        return rollout.num_rollout
    epochs = rollout.num_epoch or 1
    return max(1, epochs * dataset_size // rollout.rollout_batch_size)


def rollout_routing_shape(config: RunConfig) -> RoutingShape | None:
    """With `training.use_rollout_routing_replay`: the routed experts the engines return (every layer's top-k)."""
    if not config.training.use_rollout_routing_replay:
        return None
    arch = ModelArchitecture.from_yaml(config.model)  # the run's one architecture file (model flags: model.yaml)
    return RoutingShape(num_layers=arch.num_layers, topk=arch.moe_router_topk)


@dataclass
class RolloutStack:
    client: EngineClient
    loop: RunLoop
    reward_pool: RewardPool | None = None
    """Started and closed by the controller (`rollout.reward_workers` > 0)."""


def load_prompts(rollout: RolloutConfig) -> tuple[PromptDataset, DataKeys]:
    keys = DataKeys(input_key=rollout.input_key, label_key=rollout.label_key,
                    metadata_key=rollout.metadata_key, tool_key=rollout.tool_key)
    dataset = PromptDataset.load(rollout.prompt_data, keys, skip_bad_lines=rollout.skip_bad_lines)
    if dataset.skipped_lines:
        log.warning("%s: skipped %d bad line(s) (skip_bad_lines):\n%s", rollout.prompt_data,
                    dataset.skipped_lines, dataset.describe_skipped())
    return dataset, keys


def make_evaluate(config: RunConfig, client: EngineClient, keys: DataKeys, encoder: PromptEncoder,
                  reward_fn: RewardFn, args: Any) -> Evaluate | None:
    """Eval rollouts over `eval_prompt_data`, or None (no data or no interval: no eval at all)."""
    if not (config.eval.eval_prompt_data and config.eval.eval_interval):
        return None
    datasets = load_eval_datasets(config.eval, keys)
    generate_fn = load_generate_function(config.rollout.custom_generate_function_path)
    sampling_params = eval_sampling_params(config.rollout, config.eval)

    async def evaluate(weight_version: int) -> dict[str, float]:
        return await run_eval(client=client, datasets=datasets, encoder=encoder, reward_fn=reward_fn,
                              n_samples=config.eval.n_samples_per_eval_prompt, sampling_params=sampling_params,
                              args=args, generate_fn=generate_fn, weight_version=weight_version,
                              max_context_len=config.rollout.rollout_max_context_len)

    return evaluate


def build_rollout_stack(config: RunConfig, *, registry: Registry, channel: TrainerChannel, fleet: EngineFleet,
                        router_url: str | None) -> RolloutStack:
    """Tokenizer, prompts, engine client, scheduler, eval and every part of the loop (seconds: run it in a
    thread; a bad prompt file or plug-in path raises here)."""
    rollout = config.rollout
    encoder = make_prompt_encoder(load_prompt_tokenizer(config.checkpoint.hf_checkpoint),
                                  apply_chat_template=rollout.apply_chat_template)
    dataset, keys = load_prompts(rollout)
    source = PromptSource(dataset, shuffle=rollout.rollout_shuffle, seed=rollout.rollout_seed)
    client = EngineClient(registry, router_url=router_url, per_engine_concurrency=config.sglang.server_concurrency,
                          request_timeout_s=config.controller.engine_request_timeout, api_key=fleet.api_key,
                          context_length=engine_context_length(config.checkpoint.hf_checkpoint,
                                                               config.sglang.server_options()))
    args = plugin_args(config)
    # No workers for custom functions (they run on the loop) or remote_rm (an HTTP call, no CPU to offload).
    rule_rewards = not rollout.custom_rm_path and split_boxed_prefix((rollout.rm_type or "").strip())[1] != REMOTE_RM
    pool = RewardPool(rollout.reward_workers) if rollout.reward_workers and rule_rewards else None
    spec = RewardSpec(rm_type=rollout.rm_type, custom_rm_path=rollout.custom_rm_path, rm_url=rollout.rm_url,
                      group_rm=rollout.group_rm, args=args, pool=pool)

    async def reward_fn(samples: list[Any]) -> list[float]:
        return await reward_group(spec, samples)

    scheduler = RolloutScheduler.from_config(rollout, args=args, client=client, source=source, encoder=encoder,
                                             reward_fn=reward_fn, routed_experts=rollout_routing_shape(config))
    num_rollout = num_rollouts(rollout, len(dataset))
    tensorboard_dir = config.logging.tensorboard_dir or str(Path(config.run_dir) / "tensorboard")
    recorder = RunRecorder(config.run_dir, ScalarLog.for_controller(tensorboard_dir, config, run_dir=config.run_dir),
                           num_rollout=num_rollout, print_fn=lambda line: print(line, flush=True))
    loop = assemble_loop(config, scheduler=scheduler, registry=registry, channel=channel, fleet=fleet,
                         recorder=recorder, evaluate=make_evaluate(config, client, keys, encoder, reward_fn, args),
                         num_rollout=num_rollout)
    return RolloutStack(client=client, loop=loop, reward_pool=pool)


def assemble_loop(config: RunConfig, *, scheduler: RolloutScheduler, registry: Registry, channel: TrainerChannel,
                  fleet: EngineFleet, recorder: RunRecorder, evaluate: Evaluate | None, num_rollout: int) -> RunLoop:
    """The loop's parts, each given its own sections of `config`."""
    rollout = config.rollout
    weights = WeightUpdates(WeightSyncSettings.from_sections(config.cluster, rollout, config.controller),
                            registry=registry, fleet=fleet, channel=channel,
                            engines_serve=scheduler.set_weight_version, num_rollout=num_rollout)
    rollouts = Rollouts(scheduler, fleet=fleet, channel=channel, weights=weights, overlap=rollout.async_rollout,
                        num_rollout=num_rollout)
    trainers = Trainers(channel, registry, shaping=reward_shaping(config.algorithm, rollout.n_samples_per_prompt),
                        num_rollout=num_rollout)
    checkpoints = Checkpoints(config.checkpoint, trainers=trainers, rollouts=rollouts, colocated=weights.colocated,
                              num_rollout=num_rollout)
    return RunLoop(rollouts=rollouts, trainers=trainers, weights=weights, checkpoints=checkpoints, recorder=recorder,
                   evaluate=evaluate, eval_config=config.eval, num_rollout=num_rollout)
