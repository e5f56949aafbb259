"""How the trainer trains: the `training`, `optimizer`, `checkpoint` and `critic` sections of the run config.

Owns: those sections' field names, defaults, types and own invariants, and the allowed-value tables of their
fields (lr decay styles, optimizers, recompute, micro-batch layouts, Megatron's MoE dispatchers, router dtypes,
load balancing and drop policies): each a `Literal` alias, the field's type, which
`hpc_rl.config.typing_rules.coerce_value` reads (a value outside it is refused at its file line).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from hpc_rl.config.problems import Problem, raise_problems
from hpc_rl.config.typing_rules import literal_problems

LrDecayStyle = Literal["constant", "linear", "cosine"]
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)
OptimizerName = Literal["adam", "sgd"]
RecomputeGranularity = Literal["full", "selective"]
QkvFormat = Literal["thd", "bshd", "auto"]
MoeDispatcher = Literal["alltoall", "allgather", "flex"]
MoeRouterDtype = Literal["fp32", "fp64"]
LoadBalancingType = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
LOAD_BALANCING_TYPES: tuple[str, ...] = get_args(LoadBalancingType)
DropPolicy = Literal["probs", "position"]
log = logging.getLogger(__name__)


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
    """Sequence parallelism (TP > 1; at TP 1 it is turned off, with a log line, as Megatron does)."""
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
    moe_token_dispatcher_type: MoeDispatcher = "alltoall"
    """How tokens reach their experts' EP ranks: alltoall | allgather | flex (flex: DeepEP, GPU only)."""
    moe_grouped_gemm: bool = False
    """Run a rank's local experts as one grouped GEMM (a GPU kernel choice; same numerics)."""
    moe_permute_fusion: bool = False
    """Fused token permutation (a GPU kernel choice; same numerics)."""
    moe_enable_deepep: bool = False
    """DeepEP dispatch (GPU only; Megatron: with moe_token_dispatcher_type flex)."""
    moe_router_dtype: MoeRouterDtype | None = None
    """Router logits/probabilities dtype: fp32 | fp64 | None (the model's dtype)."""
    moe_router_load_balancing_type: LoadBalancingType = "aux_loss"
    """aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: off)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the aux-loss-free expert-bias update (with the architecture's moe_router_enable_expert_bias)."""
    moe_token_drop_policy: DropPolicy = "probs"
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
    recompute_granularity: RecomputeGranularity | None = None
    """Activation recompute: full | selective | None."""
    recompute_method: str | None = None
    """uniform | block (with full recompute)."""
    recompute_num_layers: int | None = None
    """Layers per recompute unit."""
    qkv_format: QkvFormat = "auto"
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
        problems = literal_problems(self, "training")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:  # the one home of this rule
            # slime's SFT recipe passes --sequence-parallel at TP 1; Megatron turns it off there (validate_args)
            log.info("--sequence-parallel with --tensor-model-parallel-size 1: nothing to split; off, as Megatron does")
            self.sequence_parallel = False
        if self.context_parallel_size > 1 and self.qkv_format == "bshd":
            problems.append(Problem("training.qkv_format", "unsupported",
                                    "bshd: context_parallel_size > 1 splits "
                                    "packed sequences: set qkv_format: thd"))
        if self.routing_replay_prefetch_microbatches < 0:
            problems.append(Problem("training.routing_replay_prefetch_microbatches", "out_of_range",
                                    f"{self.routing_replay_prefetch_microbatches} must be >= 0 (micro-batches read "
                                    f"ahead; 0: none)"))
        raise_problems(problems)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: OptimizerName = "adam"
    """adam | sgd."""
    lr: float = 1e-6
    """Peak learning rate."""
    lr_decay_style: LrDecayStyle = "constant"
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
        raise_problems(literal_problems(self, "optimizer"))


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
