"""Building the run loop and what it runs on, from the resolved config: the one place that reads all of it.

Owns handing each part its own sections: the prompt source (rollout's data fields), the engine client
(sglang, controller), rewards (rollout's rm fields), the scheduler, eval (eval, rollout's sampling),
the trainers (algorithm), the weight path (cluster, rollout, controller), checkpoints (checkpoint),
the recorder (logging). Plug-ins (custom reward, filters, generate function) receive the whole config
as slime's flat `args`: that is slime's contract, so `plugin_args(config)` is built here too.
The training modes are built here as well, as parts of the same loop: SFT's trainer-only rollouts and eval
loss (`rollout.sft`, no engine), on-policy distillation's teacher log-probs fetched with each group's reward
(`rollout.teacher`); PPO's critic lives on the trainer ranks only.
Not here: the controller process itself (`app`), the loop (`run_loop`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

from hpc_rl.config import plugin_args
from hpc_rl.config.fp8_scheme import read_fp8_blocks
from hpc_rl.config.lora import syncs_adapters
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.schema import RolloutConfig, RunConfig
from hpc_rl.config.training_modes import is_sft
from hpc_rl.controller.checkpoints import Checkpoints
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.logprob_guard import LogprobGuard, threshold_for
from hpc_rl.controller.registry import Registry
from hpc_rl.controller.retention import Retention, allowed_lag
from hpc_rl.controller.rollouts import Rollouts
from hpc_rl.controller.run_loop import Evaluate, RunLoop
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.trainers import Trainers, reward_shaping
from hpc_rl.data.chat_loss_masks import ChatLossMasks
from hpc_rl.controller.weight_updates import WeightSyncSettings, WeightUpdates
from hpc_rl.data.prompt_tokenizer import load_prompt_tokenizer
from hpc_rl.data.vision_prompts import ImageGrid
from hpc_rl.data.prompts import DataKeys, PromptDataset, PromptEncoder, PromptSource, make_prompt_encoder
from hpc_rl.plugins import load_plugin
from hpc_rl.rewards.group import RewardSpec, reward_group
from hpc_rl.rewards.pool import RewardPool
from hpc_rl.rewards.reward_thread import RewardThread
from hpc_rl.rewards.scoring import REMOTE_RM, split_boxed_prefix
from hpc_rl.rewards.worker_scored import WorkerRewards
from hpc_rl.rollout import EngineClient, RolloutScheduler, eval_sampling_params, load_eval_datasets, run_eval
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.eval import dataset_sampling, drop_long_prompts, eval_prompt_length_limit
from hpc_rl.rollout.engine_client import engine_context_length
from hpc_rl.rollout.generate import load_generate_function
from hpc_rl.rollout.routed_experts import RoutingShape
from hpc_rl.rollout.sample_metrics import SampleMetricOptions
from hpc_rl.rollout.sample_plugins import SamplePlugins
from hpc_rl.rollout.scheduler import RewardFn
from hpc_rl.rollout.sft import SftRollouts, checkpoint_stop_token_ids, sft_eval_samples
from hpc_rl.rollout.teacher import TeacherLogprobs
from hpc_rl.telemetry.recorder import RunRecorder
from hpc_rl.telemetry.scalars import ScalarLog, eval_sampling_note, tensorboard_dir
from hpc_rl.weights.lora_sync import adapter_name

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
    teacher: TeacherLogprobs | None = None
    """On-policy distillation with a teacher server (closed by the controller)."""
    reward_thread: RewardThread | None = None
    """Where custom reward functions run (closed by the controller)."""


def image_grid(config: RunConfig) -> ImageGrid | None:
    """The checkpoint's image sizes when prompts carry images (multimodal_keys), else None."""
    return ImageGrid.from_checkpoint(config.checkpoint.hf_checkpoint) if config.rollout.multimodal_keys else None


def load_prompts(rollout: RolloutConfig) -> tuple[PromptDataset, DataKeys]:
    keys = DataKeys(input_key=rollout.input_key, label_key=rollout.label_key,
                    metadata_key=rollout.metadata_key, tool_key=rollout.tool_key,
                    multimodal_keys=dict(rollout.multimodal_keys))
    dataset = PromptDataset.load(rollout.prompt_data, keys, skip_bad_lines=rollout.skip_bad_lines)
    if dataset.skipped_lines:
        log.warning("%s: skipped %d bad line(s) (skip_bad_lines):\n%s", rollout.prompt_data,
                    dataset.skipped_lines, dataset.describe_skipped())
    return dataset, keys


def make_evaluate(config: RunConfig, client: EngineClient, keys: DataKeys, encoder: PromptEncoder,
                  reward_fn: RewardFn, args: Any, metric_options: SampleMetricOptions | None = None) -> Evaluate | None:
    """Eval rollouts over `eval_prompt_data`, or None (no data or no interval: no eval at all)."""
    if not (config.eval.eval_prompt_data and config.eval.eval_interval):
        return None
    evaluation = config.eval
    keys = dataclasses.replace(keys, input_key=evaluation.eval_input_key or keys.input_key,
                               label_key=evaluation.eval_label_key or keys.label_key,
                               tool_key=evaluation.eval_tool_key or keys.tool_key)
    datasets = load_eval_datasets(evaluation, keys)
    limit, why = eval_prompt_length_limit(evaluation, config.rollout, client.context_length)
    too_long: dict[str, float] = {}
    if limit is not None:  # as for training prompts: no prompt that leaves the engines no room for a response
        kept = {name: drop_long_prompts(name, records, encoder, limit, why) for name, records in datasets}
        datasets = [(name, kept[name][0]) for name, _ in datasets]
        too_long = {f"eval/{name}/prompts_too_long": float(count) for name, (_, count) in kept.items() if count}
    generate_fn = load_generate_function(config.rollout.custom_generate_function_path)
    sampling_params = eval_sampling_params(config.rollout, config.eval)

    plugins = SamplePlugins.from_config(config.rollout, config.eval)
    per_dataset = {d.name: dataset_sampling(d, evaluation.n_samples_per_eval_prompt, sampling_params)
                   for d in evaluation.eval_prompt_data}

    async def evaluate(weight_version: int, rollout_id: int) -> dict[str, float]:
        return await run_eval(client=client, datasets=datasets, encoder=encoder, reward_fn=reward_fn,
                              n_samples=config.eval.n_samples_per_eval_prompt, sampling_params=sampling_params,
                              args=args, generate_fn=generate_fn, weight_version=weight_version,
                              max_context_len=evaluation.eval_max_context_len or config.rollout.rollout_max_context_len,
                              metric_options=metric_options, plugins=plugins, rollout_id=rollout_id,
                              per_dataset=per_dataset) | too_long

    return evaluate


def build_rollout_stack(config: RunConfig, *, registry: Registry, channel: TrainerChannel, fleet: EngineFleet,
                        router_url: str | None, teacher_url: str | None = None) -> RolloutStack:
    """Tokenizer, prompts, engine client, scheduler, eval and every part of the loop (seconds: run it in a
    thread; a bad prompt file or plug-in path raises here). `teacher_url`: the teacher the driver started
    (on-policy distillation with opd_teacher_hf_checkpoint)."""
    rollout = config.rollout
    if is_sft(rollout.rollout_function_path):
        return build_sft_stack(config, registry=registry, channel=channel, fleet=fleet)
    encoder = make_prompt_encoder(load_prompt_tokenizer(config.checkpoint.hf_checkpoint),
                                  apply_chat_template=rollout.apply_chat_template,
                                  chat_template_kwargs=rollout.apply_chat_template_kwargs,
                                  image_grid=image_grid(config))
    dataset, keys = load_prompts(rollout)
    source = PromptSource(dataset, shuffle=rollout.rollout_shuffle, seed=rollout.rollout_seed)
    client = EngineClient(registry, router_url=router_url, per_engine_concurrency=config.sglang.server_concurrency,
                          request_timeout_s=config.controller.engine_request_timeout, api_key=fleet.api_key,
                          context_length=engine_context_length(config.checkpoint.hf_checkpoint,
                                                               config.sglang.server_options()),
                          answer_pool=AnswerPool(rollout.answer_parse_workers, api_key=fleet.api_key)
                          if rollout.answer_parse_workers else None)
    fleet.generation_answered_at = client.answered_at  # a /generate answer is proof of life: no health probe
    # its workers probe the other engines (worker_probes.py) and make the weight updates' per-engine exchanges
    fleet.answer_pool = client.answer_pool
    args = plugin_args(config)
    # No workers for custom functions (they run on the loop) or remote_rm (an HTTP call, no CPU to offload).
    rule_rewards = not rollout.custom_rm_path and split_boxed_prefix((rollout.rm_type or "").strip())[1] != REMOTE_RM
    if client.answer_pool is not None and not rollout.custom_rm_path:  # rule rewards scored with the answers
        client.worker_rewards = WorkerRewards(rollout.rm_type)
    pool = RewardPool(rollout.reward_workers) if rollout.reward_workers and rule_rewards else None
    thread = RewardThread() if rollout.custom_rm_path else None  # custom functions never block the loop
    spec = RewardSpec(rm_type=rollout.rm_type, custom_rm_path=rollout.custom_rm_path, rm_url=rollout.rm_url,
                      group_rm=rollout.group_rm, args=args, pool=pool, timeout_s=rollout.reward_timeout,
                      thread=thread, reward_key=rollout.reward_key,
                      category_key=config.logging.log_reward_category, proxy=rollout.http_proxy,
                      worker_rewards=client.worker_rewards)
    eval_spec = dataclasses.replace(spec, reward_key=config.eval.eval_reward_key or rollout.reward_key)

    async def reward_fn(samples: list[Any]) -> list[float]:
        return await reward_group(spec, samples)

    async def eval_reward_fn(samples: list[Any]) -> list[float]:
        return await reward_group(eval_spec, samples)

    teacher = None
    distillation = config.distillation
    if distillation.use_opd and distillation.opd_type == "sglang":
        teacher = TeacherLogprobs(teacher_url or distillation.opd_teacher_url or "",
                                  api_key=fleet.api_key if teacher_url else None,
                                  temperature=rollout.rollout_temperature,
                                  timeout_s=config.controller.engine_request_timeout)

    async def scored_with_teacher(samples: list[Any]) -> list[float]:
        """The group's rewards and, for distillation, its teacher log-probs (both before the filter sees it)."""
        assert teacher is not None
        rewards, _ = await asyncio.gather(reward_fn(samples), teacher.score(samples))
        return rewards

    metric_options = SampleMetricOptions.from_config(config.logging, rollout)
    scheduler = RolloutScheduler.from_config(rollout, args=args, client=client, source=source, encoder=encoder,
                                             reward_fn=scored_with_teacher if teacher else reward_fn,
                                             metric_options=metric_options,
                                             plugins=SamplePlugins.from_config(rollout, config.eval),
                                             routed_experts=rollout_routing_shape(config),
                                             top_logprobs_num=config.algorithm.score_centering_top_k
                                             if config.algorithm.use_score_centering else 0)
    num_rollout = num_rollouts(rollout, len(dataset))
    loop = assemble_loop(config, scheduler=scheduler, registry=registry, channel=channel, fleet=fleet,
                         recorder=run_recorder(config, num_rollout),
                         evaluate=make_evaluate(config, client, keys, encoder, eval_reward_fn, args, metric_options),
                         num_rollout=num_rollout)
    return RolloutStack(client=client, loop=loop, reward_pool=pool, reward_thread=thread, teacher=teacher)


def run_recorder(config: RunConfig, num_rollout: int) -> RunRecorder:
    eval_temperature = (config.eval.eval_temperature if config.eval.eval_temperature is not None
                        else config.rollout.rollout_temperature)
    return RunRecorder(config.run_dir, ScalarLog.for_controller(tensorboard_dir(config, config.run_dir), config,
                                                                run_dir=config.run_dir),
                       num_rollout=num_rollout, print_fn=lambda line: print(line, flush=True),
                       eval_sampling=eval_sampling_note(eval_temperature, config.eval.n_samples_per_eval_prompt),
                       debug_rollout_data=config.logging.save_debug_rollout_data)


def build_sft_stack(config: RunConfig, *, registry: Registry, channel: TrainerChannel,
                    fleet: EngineFleet) -> RolloutStack:
    """A trainer-only job's loop (SFT): the data's chats as rollouts, the held-out chats' loss as its eval."""
    rollout = config.rollout
    hf = config.checkpoint.hf_checkpoint
    masks = ChatLossMasks(load_prompt_tokenizer(hf), rendering=rollout.loss_mask_type,
                          stop_token_ids=checkpoint_stop_token_ids(hf))
    dataset, keys = load_prompts(rollout)
    source = SftRollouts(PromptSource(dataset, shuffle=rollout.rollout_shuffle, seed=rollout.rollout_seed), masks,
                         rollout_batch_size=rollout.rollout_batch_size)
    num_rollout = num_rollouts(rollout, len(dataset))
    trainers = Trainers(channel, registry, shaping=reward_shaping(config.algorithm, rollout.n_samples_per_prompt),
                        num_rollout=num_rollout)
    evaluate = None
    if config.eval.eval_prompt_data and config.eval.eval_interval:
        held_out = sft_eval_samples([(d.name, d.path) for d in config.eval.eval_prompt_data], keys, masks)

        async def evaluate(weight_version: int, rollout_id: int) -> dict[str, float]:
            metrics: dict[str, float] = {}
            for name, samples in held_out.items():
                metrics |= await trainers.evaluate_loss(name, samples)
            return metrics

    client = EngineClient(registry, router_url=None, per_engine_concurrency=1,
                          request_timeout_s=config.controller.engine_request_timeout, api_key=fleet.api_key)
    loop = assemble_loop(config, scheduler=source, registry=registry, channel=channel, fleet=fleet,
                         recorder=run_recorder(config, num_rollout), evaluate=evaluate, num_rollout=num_rollout,
                         trainers=trainers)
    return RolloutStack(client=client, loop=loop)


def assemble_loop(config: RunConfig, *, scheduler: RolloutScheduler | SftRollouts, registry: Registry,
                  channel: TrainerChannel, fleet: EngineFleet, recorder: RunRecorder, evaluate: Evaluate | None,
                  num_rollout: int, trainers: Trainers | None = None) -> RunLoop:
    """The loop's parts, each given its own sections of `config`."""
    rollout = config.rollout
    guard = LogprobGuard(threshold_for(config.cluster.device, config.controller.max_logprob_mismatch,
                                       fp8_engines=read_fp8_blocks(config.checkpoint.hf_checkpoint) is not None))

    lora_dir = config.run_dir if syncs_adapters(config.lora) and config.cluster.num_engines else None

    def engines_serve(version: int) -> None:
        scheduler.set_weight_version(version)
        guard.note_served(version, cache_flushed=not weights.cache_kept)  # `weights` is bound below, before any sync
        client = getattr(scheduler, "client", None)
        if lora_dir is not None and client is not None:  # the rollouts ask for the adapter synced (issue 33)
            client.lora_path = adapter_name(version) if version > 0 or weights.pushes else None

    weights = WeightUpdates(WeightSyncSettings.from_sections(config.cluster, rollout, config.controller,
                                                             lora_dir=lora_dir, lora=config.lora),
                            registry=registry, fleet=fleet, channel=channel, engines_serve=engines_serve,
                            num_rollout=num_rollout)
    fleet.on_failed = weights.engine_failed
    retention = Retention(config.run_dir, session_id=rollout.rollout_session_id,
                          allowed_lag=allowed_lag(max_staleness=rollout.max_staleness,
                                                  async_rollout=rollout.async_rollout),
                          enabled=bool(config.checkpoint.save_interval) and not isinstance(scheduler, SftRollouts),
                          print_fn=recorder.print if recorder is not None else print)
    rollouts = Rollouts(scheduler, fleet=fleet, channel=channel, weights=weights, overlap=rollout.async_rollout,
                        num_rollout=num_rollout, retention=retention)
    post_process = (functools.partial(load_plugin("reward_post_process", rollout.custom_reward_post_process_path),
                                      plugin_args(config)) if rollout.custom_reward_post_process_path else None)
    trainers = trainers or Trainers(channel, registry, num_rollout=num_rollout, guard=guard,
                                    shaping=reward_shaping(config.algorithm, rollout.n_samples_per_prompt,
                                                           post_process))
    checkpoints = Checkpoints(config.checkpoint, trainers=trainers, rollouts=rollouts, colocated=weights.colocated,
                              num_rollout=num_rollout)
    return RunLoop(rollouts=rollouts, trainers=trainers, weights=weights, checkpoints=checkpoints, recorder=recorder,
                   evaluate=evaluate, eval_config=config.eval, num_rollout=num_rollout,
                   first_rollout_id=config.checkpoint.start_rollout_id or 0)
