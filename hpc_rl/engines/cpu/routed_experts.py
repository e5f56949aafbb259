"""The CPU engine's twin of SGLang's `--enable-return-routed-experts`: each token's routed experts.

Owns: `RoutedExpertsCapture`, forward hooks on the MoE routers of the engine's transformers model
that keep the top-k expert ids of the last forward call, and `encode_routed_experts`, the answer's
`meta_info["routed_experts"]`. Which rows a request keeps is the scheduler's (one per token it ran
through the model); the request fields are `requests.GenerationRequest`'s.

The routers are transformers' own: `model.layers.N.mlp.gate` of `Qwen3MoeForCausalLM` and
`Glm4MoeForCausalLM`, whose forward takes the layer's hidden states flattened to [rows x time, hidden]
and returns (router logits, weights, top-k indices). A hook reads the indices, so the ids are exactly
the experts the engine's forward used.

SGLang 0.5.23's answer, reproduced (srt/state_capturer/routed_experts.py, detokenizer_manager.py):
base64 of little-endian int32 [seqlen - 1 - routed_experts_start_len, num_hidden_layers, topk]
(`num_experts_per_tok`), rows of the tokens run through the model (the last sampled token never is),
zeros in the slot of a dense layer; only when the server was started with the flag and the request
asked (`return_routed_experts`), else no field. A `routed_experts_start_len` outside [0, prompt
tokens] is refused (SGLang aborts the request with 400). A server started with the flag on a model
without MoE routers fails at start (SGLang's capturer reads `num_experts_per_tok` from the config).
"""

from __future__ import annotations

import base64
import re

import torch

GATE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class RoutedExpertsCapture:
    """Hooks on every MoE router of `model`; `take(rows, length)` returns the last forward's ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.topk = int(getattr(config, "num_experts_per_tok", 0) or 0)
        gates = [(int(match.group(1)), module) for name, module in model.named_modules()
                 if (match := GATE_NAME.search(name))]
        if not gates or self.topk < 1:
            raise ValueError(f"--enable-return-routed-experts: the model ({type(model).__name__}) has no MoE "
                             "routers (mlp.gate) or no num_experts_per_tok in its config; serve a MoE checkpoint")
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [gate.register_forward_hook(self._hook(layer)) for layer, gate in gates]

    def _hook(self, layer: int):
        def keep(module: torch.nn.Module, inputs: object, output: object) -> None:
            indices = output[-1] if isinstance(output, tuple) else output
            self._captured[layer] = indices.detach()

        return keep

    def take(self, rows: int, length: int) -> torch.Tensor:
        """[rows, length, num_layers, topk] int32 ids of the last forward over [rows, length] tokens
        (zeros where a layer has no router), and forget them."""
        ids = torch.zeros(rows, length, self.num_layers, self.topk, dtype=torch.int32)
        for layer, indices in self._captured.items():
            ids[:, :, layer] = indices.reshape(rows, length, self.topk).to(torch.int32)
        self._captured.clear()
        return ids

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def encode_routed_experts(rows: torch.Tensor) -> str:
    """SGLang's field: base64 of the int32 ids, little-endian, C order."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().astype("<i4", copy=False).tobytes()).decode(
        "ascii")
