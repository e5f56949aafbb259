"""How many parameters a model has, where Megatron and SGLang place them, and how many a token uses.

Owns: counting a `ModelArchitecture`'s parameters by kind (embeddings, attention, dense MLP, routed
experts, shared experts, routers, norms), per layer range (a pipeline stage), split into the parts that
tensor parallelism divides, that expert parallelism divides and that every rank replicates; and the
active count (a token uses top-k of the routed experts). Multi-latent attention counts its q/kv down
projections as replicated (Transformer Engine's duplicated linears); MTP layers sit on the last stage. A hybrid's
Gated DeltaNet layers (linear_attention_freq) count Megatron's GatedDeltaNet (in_proj [q|k|v|z|beta|alpha],
conv1d, A_log, dt_bias, the gated out_norm over one head, out_proj; no biases) in place of attention, and its full
attention layers their output gate (q_proj twice as wide); a gated shared expert its [1, h] gate.
The vocabulary is counted unpadded (Megatron's
padding adds < 0.1%). Pure arithmetic for `hpc_rl.config.memory_plan`; checked against the published
totals of Qwen3-4B, Qwen3-30B-A3B and GLM-4.5-Air in the unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.pipeline_split import StageSplit, stage_split


@dataclass(frozen=True)
class ParameterShare:
    """Parameters of a set of layers (and embeddings), by how parallelism splits them."""

    tensor_parallel: int = 0
    """Split over TP: q/k/v/out projections and their biases, dense MLPs, shared experts."""
    vocab_parallel: int = 0
    """Split over the vocabulary's TP ranks: input embedding, untied output layer."""
    attention: int = 0
    """Of tensor_parallel: the attention projections (SGLang splits them over its attention-TP group)."""
    dense_mlp: int = 0
    """Of tensor_parallel: the dense MLPs (SGLang splits them over --moe-dense-tp-size in MoE models)."""
    experts: int = 0
    """Routed experts: split over EP x ETP."""
    replicated: int = 0
    """On every rank: norms, q/k norms, routers and their expert biases."""
    active_experts: int = 0
    """Of experts: the top-k share a token passes through."""

    def __add__(self, other: ParameterShare) -> ParameterShare:
        return ParameterShare(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple[int, ...]:
        return (self.tensor_parallel, self.vocab_parallel, self.attention, self.dense_mlp, self.experts,
                self.replicated, self.active_experts)

    @property
    def total(self) -> int:
        return self.tensor_parallel + self.vocab_parallel + self.experts + self.replicated

    @property
    def active(self) -> int:
        return self.total - self.experts + self.active_experts

    @property
    def dense(self) -> int:
        """Everything but the routed experts (what the dense optimizer shards hold)."""
        return self.total - self.experts


def _mla_attention(arch: ModelArchitecture) -> ParameterShare:
    """Multi-latent attention: the q/kv down projections (and their latent norms) are replicated on every
    TP rank (Transformer Engine's duplicated linears), the up projections and the output projection split."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    q_head = (arch.qk_head_dim or 0) + (arch.qk_pos_emb_head_dim or 0)
    kv_rank, rope, v_head = arch.kv_lora_rank or 0, arch.qk_pos_emb_head_dim or 0, arch.v_head_dim or 0
    q_rank = arch.q_lora_rank
    down = (h * q_rank if q_rank else 0) + h * (kv_rank + rope)
    split = ((q_rank if q_rank else h) * heads * q_head + kv_rank * heads * ((arch.qk_head_dim or 0) + v_head)
             + heads * v_head * h)
    norms = h + kv_rank + (q_rank or 0) + (h if arch.post_sublayer_norms else 0)
    return ParameterShare(tensor_parallel=split, attention=split, replicated=down + norms)


def is_linear_attention_layer(arch: ModelArchitecture, layer: int) -> bool:
    """Decoder layer `layer` is Gated DeltaNet linear attention (a hybrid's linear_attention_freq says 1)."""
    return bool(arch.linear_attention_freq) and bool(arch.linear_attention_freq[layer])


def linear_attention_sizes(arch: ModelArchitecture) -> tuple[int, int, int]:
    """(q or k width, v width, value heads) of a Gated DeltaNet layer."""
    return (arch.linear_num_key_heads * arch.linear_key_head_dim,
            arch.linear_num_value_heads * arch.linear_value_head_dim, arch.linear_num_value_heads)


def _linear_attention(arch: ModelArchitecture) -> ParameterShare:
    """Megatron's GatedDeltaNet: in_proj, conv1d, A_log and dt_bias split over TP by heads, out_proj on its input;
    the input norm (fused into in_proj) and the out_norm (one head's width) replicated."""
    h = arch.hidden_size
    qk, v, heads = linear_attention_sizes(arch)
    split = h * (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) * arch.linear_conv_kernel_dim + 2 * heads + v * h
    return ParameterShare(tensor_parallel=split, attention=split, replicated=h + arch.linear_value_head_dim)


def _layer_attention(arch: ModelArchitecture, layer: int) -> ParameterShare:
    return _linear_attention(arch) if is_linear_attention_layer(arch, layer) else _attention(arch)


def _attention(arch: ModelArchitecture) -> ParameterShare:
    if arch.multi_latent_attention:
        return _mla_attention(arch)
    h, d = arch.hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    weights = h * q * (2 if arch.attention_output_gate else 1) + 2 * h * kv + q * h
    biases = (q + 2 * kv if arch.add_qkv_bias or arch.add_bias_linear else 0) + (h if arch.add_bias_linear else 0)
    norms = h + (2 * d if arch.qk_layernorm else 0) + (h if arch.post_sublayer_norms else 0)
    return ParameterShare(tensor_parallel=weights + biases, attention=weights + biases, replicated=norms)


def _swiglu(arch: ModelArchitecture, inner: int) -> int:
    return 3 * arch.hidden_size * inner + (2 * inner + arch.hidden_size if arch.add_bias_linear else 0)


def _mlp(arch: ModelArchitecture, moe: bool) -> ParameterShare:
    h = arch.hidden_size
    norms = h + (h if arch.post_sublayer_norms else 0)
    if not moe:
        mlp = _swiglu(arch, arch.ffn_hidden_size)
        return ParameterShare(tensor_parallel=mlp, dense_mlp=mlp, replicated=norms)
    experts = arch.num_moe_experts or 0
    one_expert = _swiglu(arch, arch.moe_ffn_hidden_size or arch.ffn_hidden_size)
    shared = _swiglu(arch, arch.moe_shared_expert_intermediate_size) if arch.moe_shared_expert_intermediate_size else 0
    router = experts * h + (experts if arch.moe_router_enable_expert_bias else 0)
    shared_gate = h if shared and arch.moe_shared_expert_gate else 0
    return ParameterShare(tensor_parallel=shared, experts=experts * one_expert,
                          replicated=norms + router + shared_gate,
                          active_experts=arch.moe_router_topk * one_expert)


def mtp_share(arch: ModelArchitecture) -> ParameterShare:
    """The MTP layers (after the decoder, on the last pipeline stage): each has two input norms, the [2h -> h]
    projection (TP-split), a decoder layer shaped like the last one, and its final norm; the embedding and the
    output layer are the model's own."""
    if not arch.mtp_num_layers:
        return ParameterShare()
    h = arch.hidden_size
    one = (ParameterShare(tensor_parallel=2 * h * h, replicated=3 * h)
           + _layer_attention(arch, arch.num_layers - 1)
           + _mlp(arch, arch.moe_layers()[-1]))
    share = ParameterShare()
    for _ in range(arch.mtp_num_layers):
        share = share + one
    return share


def layer_range_share(arch: ModelArchitecture, first: int, last: int, *, embedding: bool,
                      output: bool) -> ParameterShare:
    """Layers first..last-1, plus the input embedding and/or the output layer, final norm and MTP layers."""
    moe_layers = arch.moe_layers()
    share = mtp_share(arch) if output else ParameterShare()
    for layer in range(first, last):
        share = share + _layer_attention(arch, layer) + _mlp(arch, moe_layers[layer])
    vocab = arch.vocab_size * arch.hidden_size
    if embedding:
        share = share + ParameterShare(vocab_parallel=vocab)
    if output:
        share = share + ParameterShare(vocab_parallel=0 if arch.tie_word_embeddings and embedding else vocab,
                                       replicated=arch.hidden_size)
    return share


def model_share(arch: ModelArchitecture) -> ParameterShare:
    """The whole model (tied embeddings counted once)."""
    return layer_range_share(arch, 0, arch.num_layers, embedding=True, output=True)


def stage_shares(arch: ModelArchitecture, pipeline_stages: int, split: StageSplit | None = None) -> list[ParameterShare]:
    """Each pipeline stage's layers (`split`, default: the even split); a tied output layer on the last stage
    is a copy of the embedding there."""
    split = split or stage_split(arch.num_layers, pipeline_stages)
    return [layer_range_share(arch, split.layers(stage).start, split.layers(stage).stop, embedding=stage == 0,
                              output=stage == pipeline_stages - 1)
            if pipeline_stages > 1 else model_share(arch)
            for stage in range(pipeline_stages)]


def format_count(count: float) -> str:
    """1234567890 -> '1.23B'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(int(count))
