"""Megatron's `--moe-layer-freq`: which layers have a mixture-of-experts MLP, in any of its spellings.

Owns: turning `1`, `"2"`, `[0, 1, 1]`, `"[1,1,1]"` or `"[0]*1+[1]*45"` into one 0/1 entry per layer, as
Megatron's `moe_freq_type` and its layer specs read them: an int N means every N-th layer from layer 0 is
MoE (`i % N == 0`); a pattern is a Python list expression of 0/1 lists joined by `+` and repeated with
`*`. Megatron `eval`s the pattern after a character check; here it is walked as a syntax tree, so
nothing is executed. Spaces are accepted (slime's scripts write none; a YAML file may).
"""

from __future__ import annotations

import ast
from typing import Any

LayerFreq = int | list[int]


class LayerFreqError(ValueError):
    """A `--moe-layer-freq` value that is neither an int nor a 0/1 list expression."""


def _evaluate(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(item) for item in node.elts]
        if not all(isinstance(item, int) for item in items):
            raise LayerFreqError("a list may hold only 0 and 1")
        return items  # type: ignore[return-value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) and isinstance(right, list):
                return left + right
            raise LayerFreqError("`+` joins two lists")
        if isinstance(left, list) and isinstance(right, int):
            return left * right
        if isinstance(left, int) and isinstance(right, list):
            return right * left
        raise LayerFreqError("`*` repeats a list an int number of times")
    raise LayerFreqError(f"unexpected {ast.unparse(node)!r}")


def parse_layer_freq(value: Any) -> LayerFreq:
    """An int N (every N-th layer is MoE) or the explicit 0/1 list. Raises LayerFreqError."""
    if isinstance(value, bool):
        raise LayerFreqError(f"{value!r} is neither an int nor a list of 0/1")
    if isinstance(value, int):
        freq: LayerFreq = value
    elif isinstance(value, list):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise LayerFreqError(f"{value!r}: a list may hold only 0 and 1")
        freq = list(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as error:
            raise LayerFreqError(f"{value!r} is not an int or a list expression such as [0]*1+[1]*45") from error
        try:
            freq = _evaluate(tree.body)
        except LayerFreqError as error:
            raise LayerFreqError(f"{value!r}: {error} (e.g. [0]*1+[1]*45 or [0,1,1])") from error
    else:
        raise LayerFreqError(f"{value!r} is neither an int nor a list of 0/1")
    if isinstance(freq, int) and freq < 1:
        raise LayerFreqError(f"{value!r}: an int frequency must be >= 1")
    if isinstance(freq, list) and any(v not in (0, 1) for v in freq):
        raise LayerFreqError(f"{value!r}: every entry must be 0 (dense MLP) or 1 (MoE)")
    return freq


def expand_layer_freq(value: Any, num_layers: int) -> list[int]:
    """One 0/1 entry per layer (Megatron: layer i is MoE when `i % N == 0` for an int N).
    Raises LayerFreqError, also when a list's length is not `num_layers`."""
    freq = parse_layer_freq(value)
    if isinstance(freq, int):
        return [1 if layer % freq == 0 else 0 for layer in range(num_layers)]
    if len(freq) != num_layers:
        raise LayerFreqError(f"{len(freq)} entries for {num_layers} layers: give one 0/1 per layer")
    return freq
