"""The typed config tree of one run: sections of `@dataclass(kw_only=True)` with a doc per field.

Owns: field names (slime's flag names, so recipes move over), defaults, types and the invariants a
single section can check by itself (`__post_init__`). Cross-section rules, file checks and plug-in
checks live in `hpc_rl.config.validation`; YAML/CLI merging in `hpc_rl.config.loading`.
Each field's docstring (the string literal after it) is its `--help` text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.config.lora import LoraConfig
from hpc_rl.config.model import ModelArchitecture

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
RM_TYPES = ("deepscaler", "dapo", "math", "f1", "remote_rm", "tiny_task")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
PG_LOSS_TYPES = ("ppo", "reinforce")
"""slime's --pg-loss-type choices."""
WANDB_MODES = ("online", "offline", "disabled")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
SGLANG_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
SFT_ROLLOUT = "slime.rollout.sft_rollout.generate_rollout"
VIME_ROLLOUT = "vime.rollout.vllm_rollout.generate_rollout"
"""vime's (slime on vLLM) default rollout: the same generation as slime's."""
ROLLOUT_FUNCTIONS = (SGLANG_ROLLOUT, VIME_ROLLOUT, SFT_ROLLOUT)
LOSS_MASK_TYPES = ("qwen", "qwen3")
OPD_TYPES = ("sglang", "megatron")
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
"""sglang-router 0.3.2's load-balancing policies."""


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the run's processes go: trainer GPUs, rollout GPUs, colocation."""

    actor_num_nodes: int = 1
    """Nodes for trainer ranks (het group 0)."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks per trainer node (one per GPU; on CPU, one per process)."""
    rollout_num_gpus: int = 1
    """GPUs for rollout engines in total (decoupled: on het group 1; colocated: shared with the trainer)."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per SGLang engine (its tensor-parallel size)."""
    num_gpus_per_node: int = 8
    """GPUs per node of the cluster (rollout nodes = rollout_num_gpus / this, rounded up)."""
    colocate: bool = False
    """Engines share the trainer's GPUs; memory is released/resumed around each train step."""
    device: str = "cuda"
    """cuda (NCCL, SGLang) or cpu (gloo, hpc_rl's CPU engine): the single CPU switch."""
    debug_train_only: bool = False
    """A trainer-only job (slime's --debug-train-only): no engines and no router, rollout_num_gpus 0; what SFT
    (rollout_function_path slime.rollout.sft_rollout.generate_rollout) runs, and it sets this itself."""
    opd_teacher_num_gpus: int = 0
    """GPUs of the on-policy-distillation teacher engine the job starts (distillation.opd_teacher_hf_checkpoint;
    its tensor-parallel size, on a het group of its own); 0: no teacher component (1 when that path is set)."""
    gpu_memory_gib: float = 79.6
    """Memory of one GPU in GiB, for the per-GPU memory plan that `--dry-run` prints and submit checks
    (default: an H100 80GB, 81559 MiB as nvidia-smi reports it)."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"cluster.device: {self.device!r} must be 'cuda' or 'cpu'")

    @property
    def trainer_world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        if self.debug_train_only:
            return 0
        return max(1, self.rollout_num_gpus // max(1, self.rollout_num_gpus_per_engine))


@dataclass(kw_only=True)
class RolloutConfig:
    """Prompt data, sampling, rewards, dynamic sampling and partial rollout."""

    prompt_data: str = ""
    """Path of the training prompts (.jsonl or .parquet)."""
    input_key: str = "prompt"
    """Field holding the prompt: a string or a list of chat messages."""
    label_key: str | None = "label"
    """Field holding the ground truth for the reward (null: none)."""
    metadata_key: str | None = None
    """Optional field holding a dict copied into each sample's metadata."""
    tool_key: str | None = None
    """Optional field with tool definitions passed to the chat template."""
    apply_chat_template: bool = False
    """Run the tokenizer's chat template (add_generation_prompt) on the prompt."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking: false} (slime's --apply-chat-template-kwargs,
    JSON on the command line)."""
    skip_bad_lines: bool = False
    """Skip malformed data lines (and report their count) instead of failing."""
    rollout_shuffle: bool = False
    """Shuffle the prompts each epoch (seeded by rollout_seed and the epoch)."""
    rollout_seed: int = 42
    """Seed of the data order and of sampling."""
    rm_type: str | None = None
    """Built-in reward: deepscaler | dapo | math | f1 | remote_rm | tiny_task."""
    custom_rm_path: str | None = None
    """Import path of a custom reward: `async fn(args, sample) -> float` (or a group of samples with group_rm)."""
    group_rm: bool = False
    """custom_rm_path scores a whole group: `async fn(args, samples) -> list[float]`."""
    rm_url: str | None = None
    """URL of the remote reward model (rm_type remote_rm)."""
    reward_workers: int = 0
    """Processes that score rule-based rewards (rm_type deepscaler|dapo|math|f1|tiny_task, boxed_ forms)
    off the controller's event loop, on its node; 0: on the loop. Worth it when answers are symbolic
    (fractions, roots: 1.5-2.8 ms of sympy per sample on the loop, 0.15 ms with a pool); integer-only data
    (DAPO-Math) is cheaper on the loop. Custom and remote rewards stay on the loop."""
    answer_parse_workers: int = 0
    """Processes that parse the engines' /generate answers (JSON to token and log-prob arrays) off the
    controller's process, on its node; 0: parsed on the event loop. Worth it at full response lengths and
    many engines: the parse was most of the controller's CPU per sample (docs/scaling.md)."""
    num_rollout: int | None = None
    """Number of rollout steps (None: derived from num_epoch and the data size)."""
    num_epoch: int | None = None
    """Passes over the prompt data when num_rollout is not given."""
    rollout_batch_size: int = 8
    """Prompt groups per rollout step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the GRPO group size)."""
    rollout_max_response_len: int = 1024
    """Maximum new tokens per sample."""
    rollout_max_context_len: int | None = None
    """Maximum prompt + response tokens (None: no extra limit)."""
    rollout_max_prompt_len: int | None = None
    """Longest prompt (tokens, chat template applied) a rollout uses; longer ones are dropped when drawn,
    counted (rollout/prompts_too_long) and the first named by its data row. None: rollout_max_context_len - 1,
    else what leaves the engines room for one response token."""
    reward_timeout: float = 300.0
    """Seconds one reward call may take (a sample's; a group's with group_rm). Custom rewards run in a thread
    of their own, never on the controller's event loop; one that takes longer is an error naming the sample
    and the reward function."""
    rollout_temperature: float = 1.0
    """Sampling temperature."""
    rollout_top_p: float = 1.0
    """Nucleus sampling threshold."""
    rollout_top_k: int = -1
    """Top-k sampling (-1: off)."""
    rollout_stop: list[str] | None = None
    """Stop strings."""
    rollout_stop_token_ids: list[int] | None = None
    """Stop token ids (besides EOS)."""
    over_sampling_batch_size: int | None = None
    """Prompt groups per refill when dynamic sampling is on (default: rollout_batch_size)."""
    dynamic_sampling_filter_path: str | None = None
    """Import path of the group filter: `fn(args, samples, **kwargs) -> bool | result`
    (built in: hpc_rl.rollout.filters.check_reward_nonzero_std)."""
    partial_rollout: bool = False
    """Keep unfinished groups (with their partial tokens) for the next rollout instead of dropping them."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Loss-mask tokens of a partial sample that an older policy generated."""
    buffer_filter_path: str | None = None
    """Import path of `fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]` (default: FIFO)."""
    buffer_sort_by_staleness: bool = False
    """The partial-rollout buffer resumes the groups with the oldest generated-token weight version first (slime's
    --buffer-sort-by-staleness); buffer_filter_path, when given, takes precedence."""
    custom_generate_function_path: str | None = None
    """Import path of `async fn(args, sample, sampling_params) -> Sample` (multi-turn, tools)."""
    max_turns: int | None = None
    """Turn limit handed to custom_generate_function_path as `args.max_turns` (needs that path)."""
    reward_key: str | None = None
    """When the custom reward or the reward server returns an object, the key holding the reward (slime's
    --reward-key)."""
    rollout_sample_hook_path: list[str] = field(default_factory=list)
    """Import paths of slime's sample hooks, `hook(args, sample, *, rollout_id=, evaluation=) -> Sample | None`,
    applied in order to every generated sample before its reward (rollout and eval; the flag repeats)."""
    rollout_sample_filter_path: str | None = None
    """Import path of slime's `fn(args, groups)` marking `sample.remove_sample` on the kept groups: those samples
    are not trained (loss mask zeros) but stay in their group's reward normalisation."""
    rollout_all_samples_process_path: str | None = None
    """Import path of slime's `fn(args, all_samples, data_source)`, called with every scored group of the
    rollout (those dynamic sampling dropped too) and hpc_rl's prompt source."""
    custom_rollout_log_function_path: str | None = None
    """Import path of slime's `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`, called
    after each rollout; True skips hpc_rl's rollout/* scalars of that rollout."""
    custom_config_path: str | None = None
    """YAML file of extra values for your plug-ins: each top-level key becomes an attribute of the `args` they
    receive (slime's --custom-config-path; keys that name a config field are refused: set those as flags)."""
    http_proxy: str | None = None
    """HTTP proxy for the calls to the reward server (rm_type remote_rm; slime's --http-proxy)."""
    custom_reward_post_process_path: str | None = None
    """Import path of slime's `fn(args, samples) -> (raw_rewards, rewards)`, called on the controller with each
    rollout's samples; its rewards replace the group-normalised ones the trainer receives. slime's on-policy-
    distillation one (slime.rollout.on_policy_distillation.post_process_rewards) is hpc_rl's
    hpc_rl.rollout.teacher.distillation_post_process: rewards 0, the teacher at rm_url (distillation.opd_teacher_url)."""
    update_weights_interval: int = 1
    """Sync weights to the engines every this many rollouts."""
    update_weight_buffer_size: int = 512 * 1024**2
    """Bytes per weight-broadcast bucket."""
    update_weight_transport: str = "nccl"
    """How weights reach decoupled engines: nccl (a broadcast group from trainer rank 0; gloo on CPU) or disk (the
    trainer writes an HF directory under update_weight_disk_dir, the engines load it with
    /update_weights_from_disk: for trainer and engines in separate jobs or partitions; slime's
    --update-weight-transport)."""
    update_weight_mode: str = "full"
    """full: every sync sends every weight (slime's delta mode is not offered)."""
    update_weight_disk_dir: str | None = None
    """With transport disk: a directory trainer and engines both see; each sync writes weights_v<version> there."""
    update_weight_disk_keep_files: bool = False
    """With transport disk: keep every version's directory (default: the previous one is removed once the engines
    loaded the new one)."""
    flush_cache_interval: int = 1
    """Async mode, decoupled engines, transport nccl: 1 (the default) has the rollout generated ahead finish
    before each sync and the engines flush their KV cache at every sync. N > 1 updates in place (PipelineRL):
    the sync pauses the engines with their running requests and KV cache kept, loads the new weights and the
    same requests go on (each token records the version it came from: TIS/MIS see the mix); every N-th sync
    flushes the cache instead (the engines retract their requests first, as SGLang requires). 0: never flush
    (slime's --flush-cache-interval; refused with --colocate, as slime does)."""
    custom_update_weight_post_write_path: str | None = None
    """Import path of slime's `hook(args, version_dir, rollout_engines)`, called on every trainer rank after a disk
    sync's files are written and before the engines read them (rollout_engines: the engines' URLs here)."""
    rollout_external_engine_addrs: list[str] = field(default_factory=list)
    """SGLang servers this job did not start (host:port or http://host:port; e.g. an inference job on another
    partition), used as the job's engines instead of starting any: health-checked (one that stops answering is
    waited for, then given the current weights), weights pushed over the weight-update group or, with
    update_weight_transport disk, through the shared filesystem. They must not need an api key other than the
    job's, and must reach trainer rank 0's node for the group (slime's --rollout-external-engine-addrs)."""
    max_staleness: int | None = None
    """Async mode: no sample is trained more than this many weight versions after its first token."""
    async_rollout: bool = False
    """Generate rollout k+1 while training on rollout k (bounded by max_staleness)."""

    engine: str = "auto"
    """Rollout engine: sglang (real SGLang, on cuda or cpu), cpu (hpc_rl's CPU engine, cluster.device cpu)
    or auto (sglang on cuda, cpu on cpu)."""
    # Training modes (SFT): slime's names.
    rollout_function_path: str = SGLANG_ROLLOUT
    """slime's rollout function: slime.rollout.sglang_rollout.generate_rollout (generate with the engines) or
    slime.rollout.sft_rollout.generate_rollout (SFT: the data's chats, loss on the assistant turns, no engines)."""
    loss_mask_type: str = "qwen"
    """SFT: how a chat's turns are rendered for their loss masks (slime's --loss-mask-type): qwen (each message
    rendered by the chat template alone) | qwen3 (each message rendered after a user turn, as in a conversation:
    Qwen3's template then adds its empty think block). Any chat template works with either (GLM's too)."""

    def __post_init__(self) -> None:
        if self.rm_type is not None and self.rm_type not in RM_TYPES:
            raise ValueError(f"rollout.rm_type: {self.rm_type!r} is not one of {', '.join(RM_TYPES)}")
        if self.over_sampling_batch_size is None:
            self.over_sampling_batch_size = self.rollout_batch_size


@dataclass(kw_only=True)
class TrainingConfig:
    """Trainer batch sizes, parallelism and recompute."""

    global_batch_size: int = 64
    """Samples per optimizer step."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout (rollout_batch_size*n_samples_per_prompt / global_batch_size)."""
    micro_batch_size: int = 1
    """Samples per micro-batch (ignored with use_dynamic_batch_size)."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by tokens up to max_tokens_per_gpu."""
    max_tokens_per_gpu: int | None = None
    """Token cap per micro-batch per GPU (x context parallel size) with dynamic batch size."""
    log_probs_max_tokens_per_gpu: int | None = None
    """With dynamic batch size: the token cap of the forward-only passes (reference and old log-probs), packed on
    their own (slime's --log-probs-max-tokens-per-gpu); None: they run on the training micro-batches (so the first
    step's KL is exactly 0)."""
    balance_by_flops: bool = False
    """With dynamic batch size: as many micro-batches as max_tokens_per_gpu needs, balanced by Karmarkar-Karp on each
    sample's forward cost c*L + L^2 instead of first-fit token packing (slime's --balance-by-flops; a micro-batch
    may exceed the token cap)."""
    tensor_model_parallel_size: int = 1
    """TP size."""
    sequence_parallel: bool = False
    """Sequence parallelism (needs TP > 1)."""
    pipeline_model_parallel_size: int = 1
    """PP size."""
    context_parallel_size: int = 1
    """CP size."""
    expert_model_parallel_size: int = 1
    """EP size (MoE)."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP size (MoE; default: TP)."""
    # MoE training settings (Megatron's TransformerConfig names and meanings; the architecture's MoE
    # fields are hpc_rl.config.model.ModelArchitecture's).
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach their experts' EP ranks: alltoall | allgather | flex (flex: DeepEP, GPU only)."""
    moe_grouped_gemm: bool = False
    """Run a rank's local experts as one grouped GEMM (a GPU kernel choice; same numerics)."""
    moe_permute_fusion: bool = False
    """Fused token permutation (a GPU kernel choice; same numerics)."""
    moe_enable_deepep: bool = False
    """DeepEP dispatch (GPU only; Megatron: with moe_token_dispatcher_type flex)."""
    moe_router_dtype: str | None = None
    """Router logits/probabilities dtype: fp32 | fp64 | None (the model's dtype)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: off)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the aux-loss-free expert-bias update (with the architecture's moe_router_enable_expert_bias)."""
    moe_token_drop_policy: str = "probs"
    """probs | position: which tokens an expert over its capacity drops (with moe_expert_capacity_factor)."""
    moe_expert_capacity_factor: float | None = None
    """Tokens an expert takes, as a multiple of the balanced share (None: no dropping)."""
    use_routing_replay: bool = False
    """The training forward reuses the experts chosen in the old-log-prob forward (slime's routing replay)."""
    use_rollout_routing_replay: bool = False
    """The trainer's routers use the experts the engines chose for each token (SGLang's
    --enable-return-routed-experts)."""
    routing_replay_prefetch_microbatches: int = 1
    """Routing replay (either kind): micro-batches whose replay targets are built and copied to the device ahead
    of their forward (slime's --routing-replay-prefetch-microbatches); 0: each at its own forward. Memory: up to
    N + 1 micro-batches' [MoE layers, tokens, topk] int64 targets on the device (hpc_rl.training.replay_read_ahead)."""
    # Uneven pipeline stages and multi-token prediction (issue 20; Megatron-LM's flag names).
    decoder_first_pipeline_num_layers: int | None = None
    """Layers of the first pipeline stage (None: an even split); the middle stages split the rest evenly."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers of the last pipeline stage (None: an even split)."""
    enable_mtp_training: bool = False
    """Train the MTP layers (model mtp_num_layers) on the rollout's tokens with their own loss; without it they
    are not run and reach the engines unchanged."""
    mtp_loss_scaling_factor: float = 0.2
    """Weight of the MTP loss, divided by the number of MTP layers (slime's default 0.2)."""
    recompute_granularity: str | None = None
    """Activation recompute: full | selective | None."""
    recompute_method: str | None = None
    """uniform | block (with full recompute)."""
    recompute_num_layers: int | None = None
    """Layers per recompute unit."""
    qkv_format: str = "auto"
    """Micro-batch layout: thd (samples packed into one row, no padding) | bshd (one right-padded row each) |
    auto (by shape: thd on GPU and under CP; on CPU bshd for short rows that padding does not double)."""
    calculate_per_token_loss: bool = False
    """Average the loss over all tokens of a step instead of summing per-sample means."""
    recompute_loss_function: bool = False
    """Recompute the loss from the logits in the backward pass instead of keeping its float32 softmax
    intermediates (slime's --recompute-loss-function: less memory, one more softmax per micro-batch)."""
    log_probs_chunk_size: int = -1
    """Compute log-probs and entropies this many tokens at a time (slime's --log-probs-chunk-size; -1: all at once),
    bounding the [tokens, vocab] float32 intermediates."""
    custom_megatron_init_path: str | None = None
    """Import path of slime's `fn(args)`, called on every trainer rank once its process groups are up."""
    save_debug_train_data: str | None = None
    """Each DP rank writes what it trains on per rollout (tokens, loss masks, rewards, advantages, returns, old /
    reference / rollout log-probs, per sample; torch.save) to this path, `{rollout_id}` and `{rank}` (the DP rank)
    replaced (slime's --save-debug-train-data)."""
    custom_model_provider_path: str | None = None
    """Import path of slime's `fn(pre_process, post_process, vp_stage=None) -> GPTModel` that builds each rank's
    model instead of hpc_rl (its parameter names must be the ones hpc_rl maps to HF: Megatron's GPT layers)."""
    distributed_timeout_minutes: int = 10
    """Timeout of the trainer's collectives (torch.distributed's process-group timeout; slime's
    --distributed-timeout-minutes, default 10)."""
    train_env_vars: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the trainer processes, e.g. {PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True}
    (slime's --train-env-vars, JSON on the command line)."""
    only_train_params_name_list: list[str] | None = None
    """Regular expressions (re.search) of the parameter names to train; every other parameter is frozen (slime's
    --only-train-params-name-list)."""
    freeze_params_name_list: list[str] | None = None
    """Regular expressions (re.search) of the parameter names to freeze (slime's --freeze-params-name-list)."""
    freeze_indexer: bool = False
    """Freeze every DeepSeek Sparse Attention indexer parameter (requires_grad False before DDP and the optimizer see
    them: never updated, still synced and saved); the rest of the model trains (slime's --freeze-indexer)."""
    custom_megatron_before_log_prob_hook_path: str | None = None
    """Import path of slime's `fn(args, model, store_prefix)`, called before each log-prob pass ("" for the old
    log-probs, "ref_" for the reference's)."""
    custom_megatron_before_train_step_hook_path: str | None = None
    """Import path of slime's `fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`, called before
    each optimizer step's forward and backward (opt_param_scheduler: Megatron's on GPU, None on CPU)."""
    seed: int = 1234
    """Trainer RNG seed."""
    max_nonfinite_steps: int = 3
    """Optimizer steps in a row whose loss or gradient norm is NaN/inf (each is skipped, and named in the
    trainer's log) before the run stops with an error; 0 stops at the first."""
    num_threads: int = 1
    """torch intra-op threads per rank on CPU (1 is fastest with several processes per core)."""
    offload_train: bool = False
    """Colocated: move the trainer's weights, gradients and optimizer state off the GPU while engines
    generate (slime's --offload-train / --offload; on by default when colocated, as in slime). False
    (--no-offload-train): they stay on the GPU beside the engines' KV cache. Decoupled runs refuse it."""
    train_memory_margin_bytes: int = 1024**3
    """Colocated: bytes of each GPU kept free for the trainer's transient allocations beside the engines'
    memory (vime/slime's --train-memory-margin-bytes, default 1 GiB); read by the colocated memory plan.
    Decoupled runs ignore it."""

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("training.sequence_parallel needs tensor_model_parallel_size > 1")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"training.recompute_granularity: {self.recompute_granularity!r} is not full|selective")
        if self.qkv_format not in ("thd", "bshd", "auto"):
            raise ValueError(f"training.qkv_format: {self.qkv_format!r} is not thd|bshd|auto")
        if self.context_parallel_size > 1 and self.qkv_format == "bshd":
            raise ValueError("training.context_parallel_size > 1 splits packed sequences: set qkv_format: thd")
        if self.routing_replay_prefetch_microbatches < 0:
            raise ValueError(f"training.routing_replay_prefetch_microbatches: "
                             f"{self.routing_replay_prefetch_microbatches} must be >= 0 (micro-batches read ahead; "
                             f"0: none)")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and loss terms of the GRPO family."""

    advantage_estimator: str = "grpo"
    """grpo | gspo | cispo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: k1 | k2 | k3 | low_var_kl."""
    kl_coef: float = 0.0
    """KL reward shaping (PPO / REINFORCE++)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    eps_clip: float = 0.2
    """PPO clip range below 1."""
    eps_clip_high: float | None = None
    """PPO clip range above 1 (clip-higher; default eps_clip)."""
    eps_clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages."""
    use_tis: bool = False
    """Truncated importance sampling against the rollout log-probs."""
    tis_clip: float = 2.0
    """Upper TIS weight clamp."""
    tis_clip_low: float = 0.0
    """Lower TIS weight clamp."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as old log-probs instead of recomputing them."""
    pg_loss_type: str | None = None
    """Policy-gradient objective (slime's --pg-loss-type): ppo (advantage_estimator's clipped objective: PPO, GSPO
    or CISPO) | reinforce (-A * logp per token, no clip; with use_tis the TIS weight multiplies it). None: ppo
    (slime's default without score centering; with use_score_centering, None means reinforce)."""
    use_score_centering: bool = False
    """Score centering (slime's --use-score-centering; arXiv:2609.20807): the engines return each generated
    token's top-k log-probs (score_centering_top_k) and the REINFORCE loss subtracts the sampler's expected
    score, estimated on that head (`hpc_rl.training.losses.score_centering_correction`). Needs pg_loss_type
    reinforce (unset means reinforce here) and context_parallel_size 1."""
    score_centering_top_k: int = 128
    """Head size k of score centering: how many top log-probs the engines return per generated token. Cost: 8 x k
    bytes per generated token (int32 id + float32 log-prob) on the controller and on the wire to the trainer
    (k 128: 1 KiB per token), and a [tokens, k] gather of the trainer's logits per micro-batch."""
    disable_grpo_std_normalization: bool = False
    """Dr. GRPO: subtract the group mean only."""
    disable_rewards_normalization: bool = False
    """Skip group normalisation of rewards entirely."""
    normalize_advantages: bool = False
    """Whiten advantages over the DP group."""
    gamma: float = 1.0
    """Discount (REINFORCE++, PPO)."""
    lambd: float = 1.0
    """GAE lambda (PPO)."""
    loss_type: str = "policy_loss"
    """policy_loss (the loss of advantage_estimator) | custom_loss (custom_loss_function_path's)."""
    custom_loss_function_path: str | None = None
    """With loss_type custom_loss: import path of slime's `fn(args, batch, logits, sum_of_sample_mean) ->
    (loss, metrics)`, called per micro-batch on the trainer (batch keys: hpc_rl.training.custom_hooks)."""
    custom_advantage_function_path: str | None = None
    """Import path of slime's `fn(args, rollout_data)` that sets rollout_data["advantages"] and ["returns"]
    (per-sample token tensors) in place of advantage_estimator's; called on the trainer per rollout."""
    disable_compute_advantages_and_returns: bool = False
    """No advantages, returns, reference or old log-probs (slime's flag; what sft_loss needs, which reads none)."""
    ref_update_interval: int | None = None
    """Every this many rollouts the reference model takes the actor's weights (slime's --ref-update-interval;
    None: the reference stays fixed). The updated reference is saved with each checkpoint."""
    keep_old_actor: bool = False
    """Old log-probs from the weights the engines generated the rollout with (kept on the host at each weight
    sync) instead of the trainer's current ones: they differ with update_weights_interval > 1 or in async mode
    (slime's --keep-old-actor)."""
    use_unbiased_kl: bool = False
    """Weight the KL-loss estimate by the importance ratio exp(logp - logp_old) (slime's --use-unbiased-kl,
    DeepSeek-V3.2's unbiased KL)."""
    use_opsm: bool = False
    """Off-policy sequence masking (slime's --use-opsm): no policy loss on the negative-advantage tokens of a sample
    whose mean log-ratio logp_old - logp exceeds opsm_delta; logs opsm_clipfrac."""
    opsm_delta: float = 1e-4
    """OPSM's threshold on a sample's mean log-ratio (slime's --opsm-delta)."""
    get_mismatch_metrics: bool = False
    """Run custom_tis_function_path every step for its train/inference mismatch metrics (and what it does to the
    loss), also without use_tis; with use_rollout_logprobs the trainer still recomputes its own log-probs for it
    (slime's --get-mismatch-metrics)."""
    custom_tis_function_path: str | None = None
    """Import path of slime's TIS/RS function, called with keywords: fn(args=, pg_loss=, train_log_probs=,
    rollout_log_probs=, loss_masks=, total_lengths=, response_lengths=) -> (pg_loss, loss_masks, metrics); it
    replaces the built-in TIS weighting (use_tis) and runs with get_mismatch_metrics."""
    use_rollout_entropy: bool = False
    """Compute each token's entropy in the old and reference log-prob passes and hand them to the custom advantage
    function as rollout_data["entropy"] and ["ref_entropy"] (slime's --use-rollout-entropy)."""
    rollout_data_postprocess_path: str | None = None
    """Import path of slime's `fn(args, rollout_id, rollout_data)`, called on the trainer after the advantages; it
    may change rollout_data["loss_masks"] and ["advantages"] (per-sample tensors) before training."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"algorithm.loss_type: {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)} "
                             f"(slime's value_loss is the critic's own, chosen by advantage_estimator ppo)")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"algorithm.advantage_estimator: {self.advantage_estimator!r} is not one of "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}"
            )
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(f"algorithm.kl_loss_type: {self.kl_loss_type!r} is not one of {', '.join(KL_TYPES)}")
        if self.pg_loss_type not in (None, *PG_LOSS_TYPES):
            raise ValueError(f"algorithm.pg_loss_type: {self.pg_loss_type!r} is not one of {', '.join(PG_LOSS_TYPES)} "
                             f"(or leave it unset for ppo)")
        if self.use_score_centering:
            if self.pg_loss_type == "ppo":
                raise ValueError("algorithm.use_score_centering corrects the REINFORCE gradient: set pg_loss_type "
                                 "reinforce (or leave it unset), or drop use_score_centering")
            self.pg_loss_type = "reinforce"
        if self.score_centering_top_k < 1:
            raise ValueError(f"algorithm.score_centering_top_k: {self.score_centering_top_k} must be >= 1 (the "
                             f"number of top log-probs the engines return per generated token)")
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"algorithm.eps_clip_c: {self.eps_clip_c} must be > 1 (dual clip) or null")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = "adam"
    """adam | sgd."""
    lr: float = 1e-6
    """Peak learning rate."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of lr_decay_iters (Megatron's; in place of lr_warmup_iters)."""
    lr_decay_iters: int | None = None
    """Steps of decay (default: all steps of the run, num_rollout * num_steps_per_rollout, as slime)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    # Megatron's optimizer offload (GPU runs; slime's Qwen3-30B-A3B and GLM-4.5 recipes carry these flags).
    optimizer_cpu_offload: bool = False
    """Keep the optimizer state (fp32 main params, Adam moments) in host memory and step it on the CPU
    (Megatron's hybrid device optimizer); needs use_precision_aware_optimizer, as in Megatron."""
    optimizer_offload_fraction: float = 1.0
    """Share of the optimizer state optimizer_cpu_offload moves to host memory (Megatron-LM's default 1.0)."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Overlap the CPU optimizer step with the gradient copies to host and the parameter copies back."""
    use_precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer (Transformer Engine's FusedAdam; fp32 main params kept as the
    16-bit remainders of the bf16 params)."""
    reset_optimizer_states: bool = False
    """Zero Adam's moments and step count before each rollout's training (slime's --reset-optimizer-states);
    the learning-rate schedule goes on."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer.optimizer: {self.optimizer!r} must be adam or sgd")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"optimizer.lr_decay_style: {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where weights come from and go to."""

    hf_checkpoint: str = ""
    """HF directory: tokenizer and engine weights (and the actor's start if ref_load is an HF dir). A block-FP8
    release (config.json quantization_config quant_method fp8) serves FP8 rollouts: each weight sync sends the
    weights it quantizes as e4m3 blocks + weight_scale_inv (hpc_rl.weights.fp8_blocks); the trainer reads it
    dequantized and trains in its own precision."""
    force_fp8_ue8m0_scale: bool = False
    """FP8 rollouts: round each block's scale up to a power of two (slime's --force-fp8-ue8m0-scale)."""
    ref_load: str | None = None
    """Frozen reference model: torch_dist dir or HF dir (default: hf_checkpoint)."""
    load: str | None = None
    """Actor checkpoint to resume from (empty dir or None: start from ref_load)."""
    save: str | None = None
    """Directory for actor + controller checkpoints (default: <run_dir>/checkpoints)."""
    save_interval: int | None = None
    """Save every this many rollouts (None: only at the end)."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints in `save` (older iter_* dirs are removed after each save;
    None: keep every one)."""
    save_optim: bool = True
    """Save the optimizer state with each checkpoint (slime's --no-save-optim: false; a resume from such a
    checkpoint restores the weights and the run's position and starts the optimizer's moments afresh)."""
    model_name: str | None = None
    """The model family the weight conversion uses (slime's --model-name); hpc_rl reads it from the architecture
    and checks that a given name agrees (qwen3, qwen2, llama, glm4, ...)."""
    save_hf: str | None = None
    """Also write the weights of each saved rollout as an HF directory (safetensors, config and tokenizer of
    hf_checkpoint) at this path, `{rollout_id}` replaced (slime's --save-hf)."""
    ref_ckpt_step: int | None = None
    """Load this iteration of ref_load (a torch_dist root) as the reference, and as the start when load holds no
    checkpoint, instead of its latest (slime's --ref-ckpt-step)."""
    ckpt_step: int | None = None
    """Resume from this iteration of load when load holds no whole checkpoint newer than it (Megatron's --ckpt-step,
    which slime passes on; a newer one is this run's own later position: a requeued attempt continues from it). It
    must be whole; its weights only when its hpc_rl_state.json is lost: add start_rollout_id."""
    start_rollout_id: int | None = None
    """First rollout id of a run that does not resume from a checkpoint with its position (None: 0): rollouts
    start_rollout_id .. num_rollout - 1 run, the schedules (eval, save) follow the ids (slime's
    --start-rollout-id; a checkpoint's own position wins, so a requeued run continues where it stopped)."""


@dataclass(kw_only=True)
class EvalDataset:
    """One eval dataset: a name for the metrics and a path (and, from an --eval-config file, its own settings;
    None: the eval section's)."""

    name: str
    """Metric prefix (eval/<name>/...)."""
    path: str
    """jsonl/parquet path."""
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    min_new_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None


@dataclass(kw_only=True)
class EvalConfig:
    """Periodic evaluation rollouts."""

    eval_interval: int | None = None
    """Evaluate every this many rollouts (None: never)."""
    eval_prompt_data: list[EvalDataset] = field(default_factory=list)
    """Name/path pairs (CLI: --eval-prompt-data aime /path/aime.jsonl gsm8k /path/gsm8k.jsonl)."""
    n_samples_per_eval_prompt: int = 1
    """Samples per eval prompt."""
    eval_max_response_len: int | None = None
    """Max new tokens in eval (default: rollout_max_response_len)."""
    eval_temperature: float | None = None
    """Eval temperature (default: rollout_temperature)."""
    eval_top_p: float | None = None
    """Eval top-p (default: rollout_top_p)."""
    eval_top_k: int | None = None
    """Eval top-k (default: rollout_top_k)."""
    skip_eval_before_train: bool = False
    """Do not evaluate the initial policy."""
    eval_reward_key: str | None = None
    """reward_key for eval rewards (default: reward_key; slime's --eval-reward-key)."""
    eval_input_key: str | None = None
    """input_key of the eval data (default: rollout.input_key; slime's --eval-input-key)."""
    eval_label_key: str | None = None
    """label_key of the eval data (default: rollout.label_key)."""
    eval_tool_key: str | None = None
    """tool_key of the eval data (default: rollout.tool_key)."""
    eval_max_prompt_len: int | None = None
    """Eval prompts longer than this many tokens (chat template applied) are left out, with a log line naming how
    many (slime's --eval-max-prompt-len)."""
    eval_max_context_len: int | None = None
    """Maximum prompt + response tokens in eval (default: rollout.rollout_max_context_len)."""
    eval_min_new_tokens: int | None = None
    """SGLang's min_new_tokens for eval sampling (slime's --eval-min-new-tokens)."""
    eval_config: str | None = None
    """YAML (or JSON) file of eval datasets, slime's --eval-config: `eval: {defaults: {...}, datasets: [{name, path,
    ...}]}` (or that mapping at the top level); each dataset may set n_samples_per_eval_prompt, temperature, top_p,
    top_k, max_response_len, min_new_tokens, stop, stop_token_ids, input_key, label_key, tool_key and
    metadata_key, defaults for all. Read when the config is loaded; it replaces eval_prompt_data."""
    custom_eval_rollout_log_function_path: str | None = None
    """Import path of slime's `fn(rollout_id, args, data, extra_metrics) -> bool` (data: {name: {rewards,
    truncated, samples}}), called after each eval; True skips hpc_rl's eval/<name>/* scalars."""


@dataclass(kw_only=True)
class SGLangConfig:
    """Options passed to each SGLang server (`--sglang-X` on the CLI becomes `--X` on the server)."""

    server_concurrency: int = 512
    """Maximum in-flight requests per engine from the controller."""
    mem_fraction_static: float | None = None
    """SGLang --mem-fraction-static."""
    cuda_graph_bs: list[int] | None = None
    """SGLang --cuda-graph-bs."""
    router_policy: str = "cache_aware"
    """sglang-router policy: cache_aware | round_robin | power_of_two | random."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Any other server option by SGLang name (e.g. {enable_memory_saver: true})."""

    def __post_init__(self) -> None:
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"sglang.router_policy: {self.router_policy!r} is not one of {', '.join(ROUTER_POLICIES)}")

    def server_options(self) -> dict[str, Any]:
        """All options for `sglang.launch_server`, by SGLang's own names."""
        options = dict(self.extra_args)
        if self.mem_fraction_static is not None:
            options["mem_fraction_static"] = self.mem_fraction_static
        if self.cuda_graph_bs is not None:
            options["cuda_graph_bs"] = self.cuda_graph_bs
        return options


@dataclass(kw_only=True)
class LoggingConfig:
    """Run naming, TensorBoard and (optionally) Weights & Biases."""

    run_name: str = "hpc_rl"
    """Name of the run (run dir and TensorBoard)."""
    tensorboard_dir: str | None = None
    """TensorBoard event dir (default: <run_dir>/tensorboard)."""
    log_level: str = "INFO"
    """Python log level of every component."""
    use_wandb: bool = False
    """Also log the controller's per-rollout scalars to Weights & Biases (needs `pip install 'hpc_rl[wandb]'`)."""
    wandb_mode: str | None = None
    """online | offline | disabled (None: $WANDB_MODE, else online if the first node reaches the wandb host,
    else offline; an offline run is uploaded later with `wandb sync <wandb_dir>/wandb/offline-run-*`)."""
    wandb_project: str | None = None
    """W&B project (None: wandb's default)."""
    wandb_team: str | None = None
    """W&B entity (team or user)."""
    wandb_group: str | None = None
    """W&B run group (None: run_name)."""
    wandb_key: str | None = None
    """W&B API key for `wandb.login` (None: $WANDB_API_KEY or ~/.netrc; a key here is written into
    config.resolved.yaml)."""
    wandb_host: str | None = None
    """W&B server URL (None: https://api.wandb.ai)."""
    wandb_dir: str | None = None
    """Directory of the wandb files (default: <run_dir>/wandb)."""
    wandb_run_id: str | None = None
    """W&B run id (None: derived from the run dir, so a requeued or resumed run continues the same W&B run)."""
    tb_experiment_name: str | None = None
    """TensorBoard writes under <tensorboard_dir>/<tb_experiment_name> (slime's --tb-experiment-name)."""
    log_passrate: bool = False
    """Log pass@1, pass@2, pass@4, ... up to the group size for every rollout and eval dataset (a sample with
    reward 1 is correct; slime's --log-passrate)."""
    log_correct_samples: bool = False
    """Log the correct samples' length quartiles and mean negative log-prob per rollout (slime's
    --log-correct-samples)."""
    log_reward_category: str | None = None
    """Log the share of each value under this key of the reward object a custom reward or reward server returns
    (rollout/error_cat/<value>; slime's --log-reward-category)."""
    save_debug_rollout_data: str | None = None
    """Write every trained sample of each rollout (all its fields, one JSON object per line, group after group) to
    this path, `{rollout_id}` replaced (slime's --save-debug-rollout-data; JSON lines here, not a torch file)."""
    log_multi_turn: bool = False
    """Log response lengths with and without observation tokens and the round counts of a multi-turn generate
    function (sample.metadata["round_number"]; slime's --log-multi-turn)."""

    def __post_init__(self) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode: {self.wandb_mode!r} is not one of {', '.join(WANDB_MODES)}")


@dataclass(kw_only=True)
class SlurmConfig:
    """Slurm submission options (ignored by the local executor)."""

    partition: str | None = None
    """--partition for every het group."""
    rollout_partition: str | None = None
    """--partition for the rollout group (default: partition)."""
    account: str | None = None
    """--account."""
    qos: str | None = None
    """--qos."""
    time: str = "04:00:00"
    """--time (HH:MM:SS or minutes)."""
    constraint: str | None = None
    """--constraint."""
    cpus_per_task: int | None = None
    """--cpus-per-task for every task of every component (overrides cpus_per_gpu)."""
    cpus_per_gpu: int = 8
    """GPU runs: CPUs per GPU of a task (trainer rank: this; engine: this x its GPUs); the driver,
    router and reward grading use what the trainer ranks leave on the first node. CPU runs: 1 per task."""
    mem: str | None = None
    """--mem per node."""
    gres_per_node: bool = True
    """Request --gpus-per-node (false on clusters without GPU gres)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` option lines, e.g. ['--exclusive', '--reservation=rl']."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the job (module loads, source venv, container env)."""
    requeue_signal_seconds: int = 120
    """Seconds before the time limit at which USR2 asks for checkpoint + requeue."""
    max_num_timeout: int = 3
    """How many times a timed-out/preempted job is requeued."""
    # -- GPU placement and containers (hpc_rl.launch.step_plan, srun_launcher) --
    gpus_for_cpu_runs: bool = False
    """CPU runs (cluster.device cpu) ask Slurm for GPUs as a GPU run would and place every step on them:
    the local test cluster's fake GPUs check Slurm's GPU placement without CUDA."""
    container_image: str | None = None
    """Run every srun step (engines, trainer) in this image: Pyxis/enroot (`--container-image`, e.g.
    'nvcr.io#nvidia/pytorch:25.01-py3' or a .sqsh) or Apptainer (a .sif). The driver stays on the host."""
    container_runtime: str = "pyxis"
    """pyxis (srun --container-image/--container-mounts) | apptainer (srun ... apptainer exec --nv)."""
    container_mounts: list[str] = field(default_factory=list)
    """Extra 'SRC:DST[:FLAGS]' mounts; the run dir and the working directory are always mounted."""


@dataclass(kw_only=True)
class ControllerConfig:
    """The asyncio controller: addresses and timeouts."""

    port: int = 0
    """TCP port of the controller (0: pick a free one)."""
    registration_timeout: float = 600.0
    """Seconds to wait for every trainer rank and engine to register."""
    engine_health_interval: float = 5.0
    """Seconds between engine health checks (slime's --rollout-health-check-interval)."""
    engine_health_timeout: float = 10.0
    """Seconds an engine has to answer a health check before it is failed and restarted (slime's
    --rollout-health-check-timeout)."""
    engine_health_first_wait: float = 0.0
    """Seconds after an engine registers (at start and after each restart) before its first health check: room
    for compilation and warm-up (slime's --rollout-health-check-first-wait; raise it for DeepGEMM)."""
    engine_request_timeout: float = 600.0
    """Seconds before a generate request is considered hung."""
    engine_admin_timeout: float = 300.0
    """Seconds an admin call (pause, a weight-update bucket, memory release/resume) may go without an answer
    before it fails, and its engine with it. A call unanswered for 5 s is logged, and an engine that answers
    neither the call nor /health is failed sooner, by the health check (restart path)."""
    max_engine_restarts: int = 3
    """Restarts of a failed engine before the run fails."""
    trainer_command_timeout: float = 600.0
    """Seconds a trainer rank may stay silent (no heartbeat: stopped, frozen) while a command runs before the run
    fails naming it; named in the log and status after min(30 s, half of this). A long step that computes keeps
    beating: this bounds silence, not a step's length (default: NCCL's 10 min collective watchdog)."""
    max_restarts: int = 0
    """Restarts of the whole run from its last checkpoint after a trainer rank dies (0: fail at once)."""
    max_logprob_mismatch: float | None = None
    """Fail the run when, right after a weight sync, the engines' log-probs differ from the trainer's by more
    than this per token (mean |trainer - rollout|); None: 1e-4 on cpu, 0.1 on cuda, 0.1 with FP8 engines (an FP8
    hf_checkpoint); 0: never fail."""


@dataclass(kw_only=True)
class DistillationConfig:
    """On-policy distillation (slime's --use-opd): a per-token reverse-KL penalty against a teacher's log-probs,
    added to the advantages of whatever advantage_estimator computes."""

    use_opd: bool = False
    """Distil from a teacher on the student's own samples."""
    opd_type: str | None = None
    """sglang (teacher log-probs from a teacher SGLang server) | megatron (teacher loaded on the trainer ranks)."""
    opd_kl_coef: float = 1.0
    """Weight of the penalty: A_t -= opd_kl_coef * (logp_student_t - logp_teacher_t)."""
    opd_teacher_load: str | None = None
    """megatron: the teacher's torch_dist checkpoint, or an HF directory (the student's architecture and tokenizer)."""
    opd_teacher_ckpt_step: int | None = None
    """megatron: which iteration of opd_teacher_load (default: its latest)."""
    opd_teacher_hf_checkpoint: str | None = None
    """sglang: start the teacher as a component of this job, serving this HF directory (its own GPUs, health-
    checked, behind the job's engine key; cluster.opd_teacher_num_gpus GPUs). Without it, the teacher is
    slime's --rm-url server."""
    opd_teacher_url: str | None = None
    """sglang: /generate URL of a teacher server started outside the job (slime's --rm-url with its OPD reward)."""

    def __post_init__(self) -> None:
        if self.opd_type is not None and self.opd_type not in OPD_TYPES:
            raise ValueError(f"distillation.opd_type: {self.opd_type!r} is not one of {', '.join(OPD_TYPES)}")


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's critic (advantage_estimator ppo): a value model beside the actor, on the same trainer ranks and
    parallel layout, with its own optimizer and checkpoints."""

    num_critic_only_steps: int = 0
    """The first this many rollouts train the critic only (the actor's weights stay)."""
    value_clip: float = 0.2
    """Value clipping: the new value moves at most this far from the old one in the clipped term."""
    megatron_config_path: str | None = None
    """slime's role file (`megatron: [{role: critic, overrides: {lr: ...}}, {role: actor, ...}]`): read at submit
    into critic_optimizer / critic_load / critic_save and, for role actor, into the optimizer and checkpoint."""
    critic_optimizer: dict[str, Any] = field(default_factory=dict)
    """The critic's optimizer settings that differ from the actor's, by optimizer field name (lr, min_lr, ...)."""
    critic_load: str | None = None
    """Critic checkpoint to resume from (default: <checkpoint.load>/critic)."""
    critic_save: str | None = None
    """Where critic checkpoints go (default: <checkpoint.save, else run_dir/checkpoints>/critic)."""


@dataclass(kw_only=True)
class RunConfig:
    """One complete run: every section plus the model architecture file."""

    model: str = ""
    """Path of the model architecture file (configs/models/*.yaml); optional with Megatron's model flags."""
    model_args: ModelArchitecture | None = None
    """The architecture from Megatron's model flags (slime's MODEL_ARGS: --num-layers 36 ...), on top of
    the model file when both are given; written to <run_dir>/model.yaml at submit."""
    run_dir: str = ""
    """Directory of every artifact of the run (default: runs/<run_name>-<timestamp>)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def section_fields(self) -> Iterator[tuple[str, str, Any]]:
        """(section, field, value) of every field of every section (model_args included when set)."""
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if dataclasses.is_dataclass(value):
                for item in dataclasses.fields(value):
                    yield section.name, item.name, getattr(value, item.name)
