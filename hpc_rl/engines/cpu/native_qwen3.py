"""The CPU engine's own Qwen3 forward pass: no transformers modeling import at start-up.

Owns: a Qwen3 causal LM as a torch module whose parameter names are the HF checkpoint's (so weight
updates, `get_weights_by_name` and `update_weights_from_disk` address it exactly as the transformers
model), its loading from a checkpoint directory (config.json + *.safetensors), and one cached forward
call over a left-padded batch (`forward_cached`), used by `kv_batch`. Which checkpoints it takes is
`native_support`: plain Qwen3 (default RoPE, no sliding window, SiLU; unquantized or block FP8, whose weights
`weight_sync.load_from_disk` dequantizes); anything else loads through transformers, as before.

Why: importing transformers' Qwen3 modeling pulls torch.distributed.tensor and torch dynamo, ~5 s of
CPU at engine start on this machine kind, for a forward pass of a few dozen lines. The math is
transformers' Qwen3 (RMSNorm in float32, RoPE on the normed q/k, grouped-query attention, an additive
mask with the dtype's minimum, so a padding row never turns into NaN), computed with torch's fused
`rms_norm` and `scaled_dot_product_attention` (no copy of the kv heads per query head); logits agree
with transformers' eager forward within 1e-5 (tests/unit/test_native_qwen3.py: padded batches and
decode steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

QWEN3_MODEL_TYPE = "qwen3"


def read_config(model_path: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_path) / "config.json").read_text())


def _rope_theta(config: dict[str, Any]) -> tuple[float, str]:
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), str(parameters.get("rope_type", parameters.get("type", "default")))


def native_support(config: dict[str, Any]) -> str | None:
    """None when the native forward computes this checkpoint exactly; else why it does not."""
    if config.get("model_type") != QWEN3_MODEL_TYPE:
        return f"model_type {config.get('model_type')!r} is not {QWEN3_MODEL_TYPE!r}"
    _, rope_type = _rope_theta(config)
    if rope_type != "default":
        return f"rope type {rope_type!r} (only the default RoPE is implemented)"
    if config.get("use_sliding_window"):
        return "use_sliding_window is set"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r}"
    quantization = config.get("quantization_config")
    if quantization and quantization.get("quant_method") != "fp8":
        return f"the checkpoint is quantized ({quantization.get('quant_method')!r}; block FP8 is dequantized at load)"
    return None


class Linear(nn.Module):
    """nn.Linear without its random initialisation (every weight is loaded from the checkpoint)."""

    def __init__(self, inputs: int, outputs: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs))
        self.bias = nn.Parameter(torch.empty(outputs)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """nn.Embedding without its random initialisation."""

    def __init__(self, count: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op: same formula, float32 throughout
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, additive_mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(rows, length, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(rows, length, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(rows, length, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(rows, length, -1)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = Attention(hidden, int(config["num_attention_heads"]),
                                   int(config.get("num_key_value_heads") or config["num_attention_heads"]), head_dim,
                                   bool(config.get("attention_bias", False)), eps)
        self.mlp = MLP(hidden, int(config["intermediate_size"]))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, additive_mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attended, k, v = self.self_attn(self.input_layernorm(x), cos, sin, additive_mask, past)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Backbone(nn.Module):
    """`model.*` of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(int(config["vocab_size"]), int(config["hidden_size"]))
        self.layers = nn.ModuleList(DecoderLayer(config, head_dim) for _ in range(int(config["num_hidden_layers"])))
        self.norm = RMSNorm(int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6)))


def inverse_frequencies(config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Default RoPE's inverse frequencies (float32, as transformers computes them)."""
    theta, _ = _rope_theta(config)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class NativeQwen3ForCausalLM(nn.Module):
    """Qwen3ForCausalLM's parameters under the same names, and a cached forward over left-padded rows."""

    def __init__(self, config: dict[str, Any], generation_eos: Any = None) -> None:
        super().__init__()
        reason = native_support(config)
        if reason is not None:
            raise ValueError(f"the native Qwen3 forward cannot run this checkpoint: {reason}")
        heads = int(config["num_attention_heads"])
        self.head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        self.model = Backbone(config, self.head_dim)
        self.lm_head = Linear(int(config["hidden_size"]), int(config["vocab_size"]), bias=False)
        if config.get("tie_word_embeddings", False):  # lm_head shares the embedding matrix
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(config, self.head_dim), persistent=False)
        self.config = SimpleNamespace(model_type=config["model_type"], architectures=config.get("architectures") or [],
                                      max_position_embeddings=config.get("max_position_embeddings"))
        eos = generation_eos if generation_eos is not None else config.get("eos_token_id")
        self.generation_config = SimpleNamespace(eos_token_id=eos)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (self.inv_freq[None, :, None].expand(positions.shape[0], -1, 1)
                 @ positions[:, None, :].float()).transpose(1, 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)

    @torch.inference_mode()
    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                       past: list[tuple[torch.Tensor, torch.Tensor]] | None, last_only: bool
                       ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Logits ([rows, 1 or length, vocab]) and every layer's keys/values after this call.

        `input_ids`/`positions`: [rows, length]; `attention_mask`: [rows, past + length], 1 = real token;
        `past`: each layer's (keys, values) [rows, kv_heads, past, head_dim] or None."""
        length = input_ids.shape[1]
        total = attention_mask.shape[1]
        dtype = self.model.embed_tokens.weight.dtype
        allowed = attention_mask.bool()[:, None, None, :]
        if length > 1:  # causal within the new tokens (the past is all visible)
            causal = torch.ones(length, total, dtype=torch.bool).tril(diagonal=total - length)
            allowed = allowed & causal[None, None]
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        cos, sin = (part.to(dtype) for part in self._rope(positions))  # computed in float32, used in the model's
        x = self.model.embed_tokens(input_ids)
        keys, values = [], []
        for index, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, additive, None if past is None else past[index])
            keys.append(k)
            values.append(v)
        x = self.model.norm(x[:, -1:] if last_only else x)
        return self.lm_head(x), keys, values


def _generation_eos(model_path: Path) -> Any:
    path = model_path / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None


def load_native_qwen3(model_path: str | Path, dtype: torch.dtype = torch.float32) -> NativeQwen3ForCausalLM:
    """The checkpoint in `model_path` (config.json + *.safetensors) as a native Qwen3, in eval mode."""
    from hpc_rl.engines.cpu.weight_sync import load_from_disk

    path = Path(model_path)
    config = read_config(path)
    model = NativeQwen3ForCausalLM(config, _generation_eos(path)).to(dtype)
    model.inv_freq = inverse_frequencies(config, model.head_dim)  # `.to(dtype)` cast it: RoPE stays float32
    load_from_disk(model, str(path), require_all=True)
    return model.eval()
