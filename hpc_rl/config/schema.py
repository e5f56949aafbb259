"""The typed config tree of one run: sections of `@dataclass(kw_only=True)` with a doc per field.

Owns: field names (slime's flag names, so recipes move over), defaults, types and the invariants a
single section can check by itself (`__post_init__`). Cross-section rules, file checks and plug-in
checks live in `hpc_rl.config.validation`; YAML/CLI merging in `hpc_rl.config.loading`.
Each field's docstring (the string literal after it) is its `--help` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpc_rl.config.model import ModelArchitecture

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
RM_TYPES = ("deepscaler", "dapo", "math", "f1", "remote_rm", "tiny_task")
LOSS_TYPES = ("policy_loss", "custom_loss")
WANDB_MODES = ("online", "offline", "disabled")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


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
    custom_generate_function_path: str | None = None
    """Import path of `async fn(args, sample, sampling_params) -> Sample` (multi-turn, tools)."""
    max_turns: int | None = None
    """Turn limit handed to custom_generate_function_path as `args.max_turns` (needs that path)."""
    update_weights_interval: int = 1
    """Sync weights to the engines every this many rollouts."""
    update_weight_buffer_size: int = 512 * 1024**2
    """Bytes per weight-broadcast bucket."""
    max_staleness: int | None = None
    """Async mode: no sample is trained more than this many weight versions after its first token."""
    async_rollout: bool = False
    """Generate rollout k+1 while training on rollout k (bounded by max_staleness)."""

    engine: str = "auto"
    """Rollout engine: sglang (real SGLang, on cuda or cpu), cpu (hpc_rl's CPU engine, cluster.device cpu)
    or auto (sglang on cuda, cpu on cpu)."""

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
    seed: int = 1234
    """Trainer RNG seed."""
    num_threads: int = 1
    """torch intra-op threads per rank on CPU (1 is fastest with several processes per core)."""
    offload_train: bool = False
    """Colocated: move the trainer's weights, gradients and optimizer state off the GPU while engines
    generate (slime's --offload-train / --offload; on by default when colocated, as in slime). False
    (--no-offload-train): they stay on the GPU beside the engines' KV cache. Decoupled runs refuse it."""

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("training.sequence_parallel needs tensor_model_parallel_size > 1")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"training.recompute_granularity: {self.recompute_granularity!r} is not full|selective")
        if self.qkv_format not in ("thd", "bshd", "auto"):
            raise ValueError(f"training.qkv_format: {self.qkv_format!r} is not thd|bshd|auto")
        if self.context_parallel_size > 1 and self.qkv_format == "bshd":
            raise ValueError("training.context_parallel_size > 1 splits packed sequences: set qkv_format: thd")

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

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"algorithm.loss_type: {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)} "
                             f"(slime's sft_loss and value_loss are not offered)")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"algorithm.advantage_estimator: {self.advantage_estimator!r} is not one of "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}"
            )
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(f"algorithm.kl_loss_type: {self.kl_loss_type!r} is not one of {', '.join(KL_TYPES)}")
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
    lr_decay_iters: int | None = None
    """Steps of decay (default: all steps of the run)."""
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

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer.optimizer: {self.optimizer!r} must be adam or sgd")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"optimizer.lr_decay_style: {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where weights come from and go to."""

    hf_checkpoint: str = ""
    """HF directory: tokenizer and engine weights (and the actor's start if ref_load is an HF dir)."""
    ref_load: str | None = None
    """Frozen reference model: torch_dist dir or HF dir (default: hf_checkpoint)."""
    load: str | None = None
    """Actor checkpoint to resume from (empty dir or None: start from ref_load)."""
    save: str | None = None
    """Directory for actor + controller checkpoints (default: <run_dir>/checkpoints)."""
    save_interval: int | None = None
    """Save every this many rollouts (None: only at the end)."""


@dataclass(kw_only=True)
class EvalDataset:
    """One eval dataset: a name for the metrics and a path."""

    name: str
    """Metric prefix (eval/<name>/...)."""
    path: str
    """jsonl/parquet path."""


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


@dataclass(kw_only=True)
class ControllerConfig:
    """The asyncio controller: addresses and timeouts."""

    port: int = 0
    """TCP port of the controller (0: pick a free one)."""
    registration_timeout: float = 600.0
    """Seconds to wait for every trainer rank and engine to register."""
    engine_health_interval: float = 5.0
    """Seconds between engine health checks."""
    engine_request_timeout: float = 600.0
    """Seconds before a generate request is considered hung."""
    max_engine_restarts: int = 3
    """Restarts of a failed engine before the run fails."""
    max_restarts: int = 0
    """Restarts of the whole run from its last checkpoint after a trainer rank dies (0: fail at once)."""


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
