"""The per-GPU memory plan of a GPU run: what the trainer and the engines hold in each phase, and whether it fits.

Owns: bytes per GPU for the trainer (bf16 weights, fp32 gradient buffers, both twice with PPO's critic, the
distributed optimizer's state on the GPU or in host memory with `--optimizer-cpu-offload`, activations at the
micro-batch's tokens with and without recompute, the fp32 log-softmax of the logits), the trainer's host memory
(the reference model's weights when a KL term needs them and a megatron distillation teacher's live there and
swap in for their pass in place of the actor's, which wait in a host buffer meanwhile: `training.host_weights`;
the offloaded optimizer; colocated, the weights and optimizer state offloaded during generation) per GPU and per
node, and for an engine (bf16 weights as SGLang splits them, the static pool of
`mem_fraction_static` that holds weights + KV cache); the phases they share a GPU in (colocated:
generation, training with `training.train_memory_margin_bytes` kept free (vime's --train-memory-margin-bytes, which
the trainer's onload checks too), weight push; decoupled: each side alone); the problems of a phase over
`cluster.gpu_memory_gib`; the `--dry-run` text. Pure arithmetic over the config.

These are estimates, written from how Megatron-core 0.16.1 and SGLang 0.5.23 allocate, never measured on a
GPU (this project has none): the per-process overheads below are round numbers, activations follow the
tensors a layer keeps for backward (bf16; flash attention keeps no score matrix), MoE activations assume
balanced routing, and a sample longer than max_tokens_per_gpu is one micro-batch of its own (as in slime).

One module (~480 lines) on purpose: the trainer's and the engines' byte counts, the phases that add them on one GPU
and the text that prints them are one calculation, read top to bottom; split, each part would import the
others' private terms (the overhead constants, `_training_peak`, `_fused_group_bytes`) back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpc_rl.config.lora_sizes import layer_adapter_parameters, lora_note
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.parameter_counts import (
    ParameterShare,
    format_count,
    is_linear_attention_layer,
    linear_attention_sizes,
    model_share,
    stage_shares,
)
from hpc_rl.config.pipeline_split import PipelineSplitError, training_split
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import attention_dp_size
from hpc_rl.config.training_modes import frozen_model_roles

GIB = 1024**3
BF16, FP32 = 2, 4
PROCESS_OVERHEAD = int(1.5 * GIB)
"""One process on one GPU: CUDA context, NCCL communicator buffers, allocator fragmentation (estimate)."""
ENGINE_RELEASED = 2 * GIB
"""A colocated engine with weights and KV cache released: its CUDA graphs' pool and workspaces (estimate)."""
ENGINE_RUNTIME = 5 * GIB
"""An engine's memory outside mem_fraction_static: activations of a chunked prefill, CUDA graph buffers
(estimate; SGLang 0.5.23 itself reserves >= 10 GiB on a GPU above 60 GiB when it picks the fraction)."""
SGLANG_AUTO_RESERVE = 10 * GIB
"""What SGLang 0.5.23 leaves outside the static pool when mem_fraction_static is not given (its floor on
GPUs above 60 GiB, plus TP/8 GiB: `memory_hook._handle_gpu_memory_settings`)."""
OPTIMIZER_BYTES = 12
"""Distributed Adam per parameter shard: fp32 main param + two fp32 moments."""
PRECISION_AWARE_OPTIMIZER_BYTES = 10
"""Precision-aware Adam: the main param kept as the 16-bit remainder of the bf16 param + two fp32 moments."""
HOST_OPTIMIZER_BYTES = 16
"""Offloaded Adam per parameter: fp32 param, fp32 gradient copy and two fp32 moments in host memory."""
LOGITS_BYTES = BF16 + FP32 + FP32
"""Per token and vocabulary entry of a TP shard: bf16 logits, their fp32 log-softmax and its gradient."""


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer GPU (the fullest pipeline stage), bytes."""

    parameters: int
    """Parameters this GPU holds (all of its stage's share)."""
    dense_parameters: int
    expert_parameters: int
    weights: int
    """The trained models' (the actor's, and PPO's critic's): the frozen ones are in host memory."""
    frozen_weights_in_host: int
    """The reference's and a megatron teacher's weights, in host memory (swapped in for their pass)."""
    swap_buffer_in_host: int
    """The actor's weights while a frozen model is on the GPU (0 without one)."""
    colocated_offload_in_host: int
    """Colocated with offload_train: the weights and GPU optimizer state offloaded during generation (beyond the
    swap buffer, which holds the actor's weights then too)."""
    grads: int
    optimizer_on_gpu: int
    optimizer_on_gpu_without_offload: int
    optimizer_in_host: int
    activations: int
    activations_no_recompute: int
    activations_full_recompute: int
    logits: int
    tokens: int
    """Tokens of one micro-batch on this GPU."""
    adapter_parameters: int = 0
    """LoRA (issue 33): the actor's adapter parameters on this GPU, its only trained ones (the frozen base has
    no gradients and no optimizer state: Megatron's DDP and optimizer skip parameters without requires_grad)."""

    @property
    def state(self) -> int:
        """What stays on the GPU between steps: weights, gradients, optimizer state (no frozen model's weights:
        they swap in for their pass in place of the actor's)."""
        return self.weights + self.grads + self.optimizer_on_gpu

    @property
    def host(self) -> int:
        """Host memory this GPU's trainer rank holds."""
        return (self.frozen_weights_in_host + self.swap_buffer_in_host + self.optimizer_in_host
                + self.colocated_offload_in_host)


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU, bytes."""

    gpus_per_engine: int
    attention_tp: int
    weights: int
    static: int
    """mem_fraction_static x GPU memory: weights + KV cache."""
    kv_cache: int
    kv_bytes_per_token: int
    mem_fraction_static: float
    fraction_is_auto: bool
    linear_state_bytes_per_request: int = 0
    """A hybrid's Gated DeltaNet layers: each running request's conv window and SSM state, whatever its length
    (SGLang's mamba pool holds them apart from the KV cache; kv_bytes_per_token counts full-attention layers)."""

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache) // max(1, self.kv_bytes_per_token)


@dataclass(frozen=True)
class Phase:
    """What shares one GPU at one moment."""

    name: str
    where: str
    """The config field a user changes when the phase does not fit."""
    advice: str
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parts)

    def text(self, gpu: int) -> str:
        parts = " + ".join(f"{label} {_gib(size)}" for label, size in self.parts if size)
        verdict = "fits" if self.total <= gpu else "DOES NOT FIT"
        return f"{self.name}: {_gib(self.total)} of {_gib(gpu)} GiB ({verdict}) = {parts}"


@dataclass(frozen=True)
class MemoryPlan:
    """The run's per-GPU plan."""

    gpu: int
    layout: ParallelLayout
    model: ParameterShare
    trainer: TrainerMemory
    engine: EngineMemory
    phases: tuple[Phase, ...]
    notes: tuple[str, ...] = field(default=())
    longest_sample: int = 0
    gpus_per_node: int = 1
    """Trainer GPUs per node (host memory adds up per node)."""

    def problems(self) -> list[Problem]:
        """(field, message) for every phase over the GPU's memory and an engine without room for a sample."""
        problems = [Problem(phase.where, "memory", f"{phase.name} needs {_gib(phase.total)} GiB per GPU "
                                  f"({', '.join(f'{label} {_gib(size)}' for label, size in phase.parts if size)}), "
                                  f"over the GPU's {_gib(self.gpu)} GiB (cluster.gpu_memory_gib): {phase.advice}")
                    for phase in self.phases if phase.total > self.gpu]
        engine = self.engine
        if engine.kv_tokens < self.longest_sample:
            problems.append(Problem("sglang.mem_fraction_static", "memory", (
                f"an engine GPU's static pool ({engine.mem_fraction_static:.2f} x {_gib(self.gpu)} = "
                f"{_gib(engine.static)} GiB) minus its weights ({_gib(engine.weights)} GiB) leaves KV cache for "
                f"{engine.kv_tokens} tokens, under one sample of {self.longest_sample}: raise "
                f"--sglang-mem-fraction-static or --rollout-num-gpus-per-engine")))
        return problems

    def _split(self) -> str:
        t, layout = self.trainer, self.layout
        if not t.expert_parameters:
            return f" (TP {layout.tp}, PP {layout.pp})"
        return (f" (dense {format_count(t.dense_parameters)} over TP {layout.tp}, experts "
                f"{format_count(t.expert_parameters)} over EP {layout.ep} x ETP {layout.etp}; PP {layout.pp})")

    def _host_line(self) -> str:
        t = self.trainer
        parts = [(label, size) for label, size in (
            ("reference/teacher weights", t.frozen_weights_in_host), ("actor weights while swapped out",
                                                                      t.swap_buffer_in_host),
            ("optimizer", t.optimizer_in_host), ("colocated offload", t.colocated_offload_in_host)) if size]
        listed = " + ".join(f"{label} {_gib(size)}" for label, size in parts) or "nothing"
        return (f"  trainer host memory: {_gib(t.host)} GiB per GPU ({listed}); {_gib(self.host_per_node)} GiB per "
                f"node ({self.gpus_per_node} trainer GPUs)")

    @property
    def host_per_node(self) -> int:
        """Host memory the trainer ranks of one node hold."""
        return self.trainer.host * self.gpus_per_node

    def describe(self) -> str:
        t, e, gpu = self.trainer, self.engine, self.gpu
        lines = [f"memory plan per GPU ({_gib(gpu)} GiB, cluster.gpu_memory_gib; estimates):",
                 f"  model: {format_count(self.model.total)} parameters, {format_count(self.model.active)} active "
                 f"per token; {_gib(self.model.total * BF16)} GiB in bf16",
                 f"  trainer GPU: {format_count(t.parameters)} parameters{self._split()}; weights {_gib(t.weights)}, "
                 f"fp32 grads {_gib(t.grads)} GiB (reference weights on the GPU: none, they swap in from host memory)"
                 if t.frozen_weights_in_host else
                 f"  trainer GPU: {format_count(t.parameters)} parameters{self._split()}; weights {_gib(t.weights)}, "
                 f"fp32 grads {_gib(t.grads)} GiB",
                 f"    optimizer: {_gib(t.optimizer_on_gpu)} GiB on the GPU, {_gib(t.optimizer_in_host)} GiB in host "
                 f"memory ({_gib(t.optimizer_in_host * self.gpus_per_node)} GiB per node; without "
                 f"--optimizer-cpu-offload: {_gib(t.optimizer_on_gpu_without_offload)} GiB on the GPU)",
                 f"    activations at {t.tokens} tokens: {_gib(t.activations_full_recompute)} GiB with full "
                 f"recompute, {_gib(t.activations_no_recompute)} GiB without; logits {_gib(t.logits)} GiB",
                 self._host_line(),
                 f"  engine GPU ({e.gpus_per_engine} GPU(s) per engine, attention TP {e.attention_tp}): weights "
                 f"{_gib(e.weights)} GiB, static pool {_gib(e.static)} GiB at mem_fraction_static "
                 f"{e.mem_fraction_static:.2f}{' (SGLang picks it)' if e.fraction_is_auto else ''} -> KV cache "
                 f"{_gib(e.kv_cache)} GiB = {e.kv_tokens} tokens"
                 + (f" (full-attention layers only; linear-attention state "
                    f"{e.linear_state_bytes_per_request / 2**20:.1f} MiB per running request, in SGLang's mamba pool)"
                    if e.linear_state_bytes_per_request else "")]
        lines += [f"  {phase.text(gpu)}" for phase in self.phases]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _gib(size: float) -> str:
    return f"{size / GIB:.1f}"


def tokens_per_micro_batch(config: RunConfig) -> tuple[int, int]:
    """(tokens of one micro-batch on one GPU, the longest sample). Prompt tokens count only through
    rollout_max_context_len (hpc_rl does not know prompt lengths at submit)."""
    training, rollout = config.training, config.rollout
    longest = rollout.rollout_max_context_len or rollout.rollout_max_response_len
    per_gpu_sample = math.ceil(longest / training.context_parallel_size)
    if training.use_dynamic_batch_size and training.max_tokens_per_gpu:
        return max(training.max_tokens_per_gpu, per_gpu_sample), longest
    return training.micro_batch_size * per_gpu_sample, longest


def _layer_activation_elements(arch: ModelArchitecture, moe: bool, linear: bool = False) -> int:
    """bf16 elements one token keeps for backward in one layer (before any TP split): each norm's input and
    output, the q/k/v projection's output (q and k only when q/k norms read them), the rotated q and k and the
    attention output (flash attention's saved tensors; with an output gate, the gate and the gated output too), an
    MLP's fc1 output and activation; in an MoE layer the router's fp32 probabilities and, per routed copy of the
    token, its dispatched input, fc1 output, activation and expert output; a shared expert's fc1 output and
    activation. A Gated DeltaNet layer (`linear`) keeps in place of attention its norm's input and output, in_proj's
    output, the convolution's output, the normalised q and k, the kernel's output and the gated norm's output (fla's
    chunked kernel recomputes its per-chunk states in backward)."""
    h, d = arch.hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    attention = 2 * h + (q + 2 * kv if arch.qk_layernorm else kv) + (q + kv) + q + (2 * q if arch.attention_output_gate
                                                                                      else 0)
    if linear:
        qk, v, heads = linear_attention_sizes(arch)
        attention = 2 * h + (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) + 2 * qk + 2 * v
    if arch.multi_latent_attention:  # latents and their norms, up-projected q and kv, rotated k, output
        heads, nope, rope = arch.num_attention_heads, arch.qk_head_dim or 0, arch.qk_pos_emb_head_dim or 0
        latent = 2 * (arch.q_lora_rank or 0) + 2 * (arch.kv_lora_rank or 0) + rope
        attention = 2 * h + latent + heads * (nope + rope) + heads * (nope + (arch.v_head_dim or 0)) \
            + heads * (nope + rope) + heads * (arch.v_head_dim or 0)
    if not moe:
        return attention + 2 * h + 3 * arch.ffn_hidden_size
    experts, inner = arch.num_moe_experts or 0, arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    routed = 2 * h + 4 * experts + arch.moe_router_topk * (2 * h + 3 * inner)
    shared = 3 * (arch.moe_shared_expert_intermediate_size or 0)
    return attention + routed + shared


def _activations(arch: ModelArchitecture, config: RunConfig, layers: list[int], tokens: int,
                 in_flight: int) -> tuple[int, int]:
    """(no recompute, full recompute) bytes of one stage's layers, times the micro-batches in flight (1F1B:
    PP - stage). Full recompute keeps each unit's input (uniform: units of recompute_num_layers layers; block:
    the first recompute_num_layers layers, the others keep everything) plus one unit recomputed in backward.
    Selective recompute counts as none: with flash attention there is no score matrix left to drop."""
    training = config.training
    tp = training.tensor_model_parallel_size
    moe = arch.moe_layers()
    per_layer = [_layer_activation_elements(arch, moe[layer], is_linear_attention_layer(arch, layer)) * tokens * BF16
                 // tp for layer in layers]
    layer_input = tokens * arch.hidden_size * BF16 // (tp if training.sequence_parallel or tp == 1 else 1)
    chunk = training.recompute_num_layers or 1
    if not per_layer:
        return 0, 0
    kept = sum(per_layer) * in_flight
    if training.recompute_method == "block":
        chunk = min(chunk, len(per_layer))
        recompute = (layer_input * chunk + sum(per_layer[chunk:])) * in_flight + max(per_layer)
    else:
        recompute = layer_input * math.ceil(len(per_layer) / chunk) * in_flight + max(per_layer) * chunk
    return kept, recompute


def trainer_memory(config: RunConfig, arch: ModelArchitecture, layout: ParallelLayout) -> TrainerMemory:
    """The fullest pipeline stage's GPU."""
    training, optimizer = config.training, config.optimizer
    tokens, _ = tokens_per_micro_batch(config)
    split = training_split(arch.num_layers, training)
    stages = stage_shares(arch, layout.pp, split)
    best: TrainerMemory | None = None
    for stage, share in enumerate(stages):
        dense = (share.tensor_parallel + share.vocab_parallel) // layout.tp + share.replicated
        experts = share.experts // (layout.ep * layout.etp)
        params = dense + experts
        shards = dense / layout.dense_optimizer_shards + experts / layout.expert_optimizer_shards
        full = PRECISION_AWARE_OPTIMIZER_BYTES if optimizer.use_precision_aware_optimizer else OPTIMIZER_BYTES
        offloaded = optimizer.optimizer_offload_fraction if optimizer.optimizer_cpu_offload else 0.0
        last = stage == layout.pp - 1
        layers = list(split.layers(stage)) + ([arch.num_layers - 1] * (arch.mtp_num_layers or 0) if last else [])
        kept, recompute = _activations(arch, config, layers, tokens, in_flight=layout.pp - stage)
        # Training modes: the distillation teacher (opd_type megatron) is one more frozen model beside the
        # reference, both in host memory; PPO's critic is a second trained model of the same size, resident with
        # the actor.
        frozen = len(frozen_model_roles(config.algorithm, config.distillation))
        trained = 2 if config.algorithm.advantage_estimator == "ppo" else 1
        adapters = layer_adapter_parameters(arch, config.lora, layout.tp) * len(layers) if config.lora.enabled else 0
        # the actor's trained parameters and optimizer shards: its adapters under LoRA (the critic trains whole)
        actor_params, actor_shards = (adapters, adapters / layout.dense_optimizer_shards) if adapters else (params,
                                                                                                            shards)
        optimizer_on_gpu = int(actor_shards * full * (1 - offloaded)) + int(shards * full * (1 - offloaded)) * (
            trained - 1)
        offload_train = config.cluster.colocate and config.training.offload_train
        memory = TrainerMemory(
            parameters=params, dense_parameters=dense, expert_parameters=experts,
            weights=(params * trained + adapters) * BF16, adapter_parameters=adapters,
            frozen_weights_in_host=params * BF16 * frozen, swap_buffer_in_host=params * BF16 if frozen else 0,
            # the actor's weights offloaded for the engines reuse the swap buffer (one host copy)
            colocated_offload_in_host=(params * BF16 * (trained - (1 if frozen else 0)) + optimizer_on_gpu
                                       if offload_train else 0),
            grads=(actor_params + params * (trained - 1)) * FP32, optimizer_on_gpu=optimizer_on_gpu,
            optimizer_on_gpu_without_offload=int(actor_shards * full) + int(shards * full) * (trained - 1),
            optimizer_in_host=int(actor_shards * HOST_OPTIMIZER_BYTES * offloaded)
            + int(shards * HOST_OPTIMIZER_BYTES * offloaded) * (trained - 1),
            activations=recompute if training.recompute_granularity == "full" else kept,
            activations_no_recompute=kept, activations_full_recompute=recompute,
            logits=tokens * math.ceil(arch.vocab_size / layout.tp) * LOGITS_BYTES if last else 0, tokens=tokens)
        if best is None or _training_peak(memory) > _training_peak(best):
            best = memory
    assert best is not None
    return best


def _training_peak(memory: TrainerMemory) -> int:
    return memory.state + memory.activations + memory.logits


def _sglang_parallel(config: RunConfig) -> tuple[int, int, int, int]:
    """(GPUs per engine, attention TP, vocabulary TP, dense-MLP TP) from the sglang options slime passes."""
    options = config.sglang.server_options()
    gpus = config.cluster.rollout_num_gpus_per_engine
    attention_tp = max(1, gpus // attention_dp_size(options))
    vocab_tp = attention_tp if options.get("enable_dp_lm_head") else gpus
    return gpus, attention_tp, vocab_tp, int(options.get("moe_dense_tp_size") or gpus)


def engine_memory(config: RunConfig, arch: ModelArchitecture, gpu: int) -> EngineMemory:
    gpus, attention_tp, vocab_tp, dense_tp = _sglang_parallel(config)
    share = model_share(arch)
    shared_experts = share.tensor_parallel - share.attention - share.dense_mlp
    weights = BF16 * (share.attention // attention_tp + share.dense_mlp // (dense_tp if arch.is_moe else gpus)
                      + shared_experts // gpus + share.vocab_parallel // vocab_tp + share.experts // gpus
                      + share.replicated)
    fraction = config.sglang.mem_fraction_static
    auto = fraction is None
    if fraction is None:
        fraction = round((gpu - SGLANG_AUTO_RESERVE - gpus * GIB // 8) / gpu, 3)
    static = int(fraction * gpu)
    kv_heads = math.ceil(arch.num_query_groups / attention_tp)
    linear_layers = sum(is_linear_attention_layer(arch, layer) for layer in range(arch.num_layers))
    kv_per_token = (arch.num_layers - linear_layers) * 2 * kv_heads * arch.kv_channels * BF16
    if arch.multi_latent_attention:  # SGLang caches MLA's latent and rotary key, whole on every attention-TP rank
        kv_per_token = arch.num_layers * ((arch.kv_lora_rank or 0) + (arch.qk_pos_emb_head_dim or 0)) * BF16
    state = 0
    if linear_layers:  # SGLang's mamba pool: per request a conv window (bf16) and an fp32 SSM state per layer
        qk, v, heads = linear_attention_sizes(arch)
        conv = (2 * qk + v) * (arch.linear_conv_kernel_dim - 1) * BF16
        ssm = heads * arch.linear_key_head_dim * arch.linear_value_head_dim * FP32
        state = linear_layers * (conv + ssm) // attention_tp
    return EngineMemory(gpus_per_engine=gpus, attention_tp=attention_tp, weights=weights, static=static,
                        kv_cache=static - weights, kv_bytes_per_token=kv_per_token, mem_fraction_static=fraction,
                        fraction_is_auto=auto, linear_state_bytes_per_request=state)


TRAINING_ADVICE = ("add --optimizer-cpu-offload --use-precision-aware-optimizer, raise TP/EP/PP, lower "
                   "--max-tokens-per-gpu, or use --recompute-granularity full")


def _phases(config: RunConfig, t: TrainerMemory, e: EngineMemory, fused_group: int = 0) -> tuple[Phase, ...]:
    """`fused_group`: bytes of the largest tensor group a sync sends fused (gpt-oss: a layer's experts, one bucket
    whatever the buffer size; the sender holds it gathered and fused beside its buckets)."""
    bucket = max(config.rollout.update_weight_buffer_size, fused_group)
    fusing = (("a layer's experts, gathered and fused", 2 * fused_group),) if fused_group else ()
    training = (("trainer weights", t.weights), ("grads", t.grads),
                ("optimizer", t.optimizer_on_gpu), ("activations", t.activations), ("logits", t.logits),
                ("trainer process", PROCESS_OVERHEAD))
    if not config.cluster.colocate:
        return (Phase("trainer, training", "training", TRAINING_ADVICE, training),
                Phase("trainer, weight push", "rollout.update_weight_buffer_size", "lower --update-weight-buffer-size",
                      (("trainer state", t.state), ("bucket", bucket), *fusing,
                       ("trainer process", PROCESS_OVERHEAD))),
                Phase("engine, generation", "sglang.mem_fraction_static", "lower --sglang-mem-fraction-static",
                      (("static pool", e.static), ("engine runtime", ENGINE_RUNTIME),
                       ("engine process", PROCESS_OVERHEAD))),
                Phase("engine, receiving a bucket", "rollout.update_weight_buffer_size",
                      "lower --update-weight-buffer-size or --sglang-mem-fraction-static",
                      (("static pool", e.static), ("bucket", bucket), ("engine process", PROCESS_OVERHEAD))))
    offloaded = config.training.offload_train
    resident = 0 if offloaded else t.state
    push_trainer = t.weights + (0 if offloaded else t.grads + t.optimizer_on_gpu)
    return (
        Phase("colocated generation", "sglang.mem_fraction_static",
              "lower --sglang-mem-fraction-static" + ("" if offloaded else " or drop --no-offload-train"),
              (("trainer " + ("process (offloaded)" if offloaded else "state"), resident + PROCESS_OVERHEAD),
               ("engine static pool", e.static), ("engine runtime", ENGINE_RUNTIME),
               ("engine process", PROCESS_OVERHEAD))),
        Phase("colocated training", "training", TRAINING_ADVICE,
              (*training, ("released engine", ENGINE_RELEASED + PROCESS_OVERHEAD),
               ("train memory margin", config.training.train_memory_margin_bytes))),
        Phase("colocated weight push", "rollout.update_weight_buffer_size",
              "lower --update-weight-buffer-size, or add --optimizer-cpu-offload",
              (("trainer weights", push_trainer), ("engine weights", e.weights), ("bucket", bucket), *fusing,
               ("trainer process", PROCESS_OVERHEAD), ("released engine", ENGINE_RELEASED + PROCESS_OVERHEAD))))


def _fused_group_bytes(arch: ModelArchitecture) -> int:
    """The family's largest group a weight sync sends fused, in bf16 (0: none; `ModelFamily.fuse_for_engine`)."""
    from hpc_rl.models.registry import family

    fusion = family(arch.family).fuse_for_engine
    return fusion.largest_group_bytes(arch, BF16) if fusion is not None else 0


def plan_memory(config: RunConfig, arch: ModelArchitecture, layout: ParallelLayout | None = None) -> MemoryPlan:
    """The plan for a cuda run's trainer and engine GPUs (`layout`: the run's, when the caller has it)."""
    gpu = int(config.cluster.gpu_memory_gib * GIB)
    layout = layout or ParallelLayout.of_run(config, arch)
    trainer = trainer_memory(config, arch, layout)
    engine = engine_memory(config, arch, gpu)
    _, longest = tokens_per_micro_batch(config)
    notes = []
    if config.sglang.server_options().get("speculative_algorithm"):
        notes.append("speculative decoding's draft model and its KV cache are not counted")
    if config.lora.enabled:
        notes.append(lora_note(arch, config.lora, trainer.adapter_parameters, trainer.parameters))
    return MemoryPlan(gpu=gpu, layout=layout, model=model_share(arch), trainer=trainer, engine=engine,
                      phases=_phases(config, trainer, engine, _fused_group_bytes(arch)), notes=tuple(notes),
                      longest_sample=longest,
                      gpus_per_node=config.cluster.actor_num_gpus_per_node)


def plan_summary(config: RunConfig, arch: ModelArchitecture | None) -> str:
    """The `--dry-run` lines: the trainer's parallel layout, then the per-GPU memory plan (cuda runs)."""
    if arch is None:
        return "parallel layout and memory plan: no model architecture"
    layout = ParallelLayout.of_run(config, arch)
    described = layout.describe() + _stages_line(config, arch)
    if config.cluster.device != "cuda":
        return f"{described}\nmemory plan: device {config.cluster.device}, no GPU memory to plan"
    return f"{described}\n{plan_memory(config, arch, layout).describe()}"


def _stages_line(config: RunConfig, arch: ModelArchitecture) -> str:
    """Which layers each pipeline stage holds, when there are stages or MTP layers to place."""
    try:
        split = training_split(arch.num_layers, config.training)
    except PipelineSplitError as error:
        return f"\n  pipeline stages: {error}"
    if len(split.counts) == 1 and not arch.mtp_num_layers:
        return ""
    stages = [f"layers {r.start}-{r.stop - 1}" for r in (split.layers(s) for s in range(len(split.counts)))]
    if arch.mtp_num_layers:
        stages[-1] += f" + {arch.mtp_num_layers} MTP layer(s)"
    return "\n  pipeline stages: " + " | ".join(stages)
