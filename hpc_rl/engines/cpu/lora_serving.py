"""LoRA adapters served by the CPU engine on its base model (issue 33), as SGLang 0.5.23 serves them with
`--enable-lora`: adapters loaded at run time by name, each request naming its adapter (or none: the base).

Owns: the engine's loaded adapters (`EngineLoraAdapters`: by name, from a PEFT directory as `/load_lora_adapter`
takes it, or from PEFT-named tensors and a PEFT config dict as `/load_lora_adapter_from_tensors` does; unloaded by
name), and their forward: a hook on each adapted projection of the model (transformers' or the engine's own Qwen3,
both with HF module names) adds `scaling * B(A(x))` to the rows of the batch whose request named that adapter, so
one batch mixes requests of several adapters and of the base, as SGLang's multi-LoRA batches do. The numerics are
PEFT's (no dropout at inference, scaling alpha / r). Does not own the HTTP routes, the request's `lora_path` field
or the batch's rows (the server and scheduler set `rows` before each forward).

Refusals (an SGLang engine refuses these too): a name already loaded, an unknown name, an adapter whose rank is over
`max_lora_rank` or whose modules the model does not have, a PEFT config other than plain LoRA (DoRA, rsLoRA,
modules_to_save).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
MATRIX_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoraAdapterError(ValueError):
    """A load, unload or request the engine refuses (HTTP 400 with this message)."""


@dataclass(frozen=True)
class ServedAdapter:
    """One loaded adapter: its matrices by the model's module path (A [r, in], B [out, r])."""

    name: str
    rank: int
    scaling: float
    matrices: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def _plain_lora(config: Mapping[str, Any], where: str) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora") \
            or config.get("modules_to_save"):
        raise LoraAdapterError(f"{where}: only plain LoRA adapters are served (no DoRA, rsLoRA or modules_to_save)")
    rank = int(config.get("r", 0))
    if rank <= 0:
        raise LoraAdapterError(f"{where}: adapter_config r={rank} must be > 0")
    return rank, float(config.get("lora_alpha", rank)) / rank


def _by_module(tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in MATRIX_SUFFIXES if key.endswith(s)), None)
        if suffix is None or not key.startswith(PEFT_PREFIX):
            raise LoraAdapterError(f"{where}: {key!r} is not a PEFT LoRA matrix name (base_model.model.<module>"
                                   ".lora_A.weight / .lora_B.weight)")
        modules.setdefault(key[len(PEFT_PREFIX):-len(suffix)], {})[suffix[1:7]] = tensor
    return modules


class EngineLoraAdapters:
    """The adapters an engine serves on `model`, and which adapter each row of the next forward uses."""

    def __init__(self, model: torch.nn.Module, *, max_lora_rank: int | None = None,
                 target_modules: list[str] | None = None) -> None:
        self.model, self.max_lora_rank = model, max_lora_rank
        self.target_modules = set(target_modules) if target_modules else None
        """SGLang's --lora-target-modules: the projections an adapter loaded later may adapt (None: any)."""
        self.loaded: dict[str, ServedAdapter] = {}
        self.rows: list[str | None] = []
        """The adapter of each batch row of the next forward (None: the base); empty: every row the base."""
        self._hooked: dict[str, Any] = {}
        self.in_use: Any = None
        self.paths: dict[str, str] = {}
        """Each loaded adapter's source: its directory, or SGLang's "__tensor__" for tensors."""
        """`fn(name) -> bool`: whether a queued or running request names the adapter (set by the scheduler)."""

    # ------------------------------------------------------------------ loading

    def load_dir(self, name: str, path: str | Path) -> ServedAdapter:
        """`/load_lora_adapter {lora_name, lora_path}`: a PEFT adapter directory."""
        directory = Path(path)
        config_file = directory / "adapter_config.json"
        if not config_file.is_file():
            raise LoraAdapterError(f"lora_path {directory}: no adapter_config.json (a PEFT adapter directory)")
        weights = directory / "adapter_model.safetensors"
        if weights.is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(weights))
        elif (directory / "adapter_model.bin").is_file():
            tensors = torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True)
        else:
            raise LoraAdapterError(f"lora_path {directory}: no adapter_model.safetensors")
        adapter = self.load_tensors(name, json.loads(config_file.read_text()), tensors, where=f"lora_path {directory}")
        self.paths[name] = str(directory)
        return adapter

    def load_tensors(self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
                     where: str = "/load_lora_adapter_from_tensors") -> ServedAdapter:
        """An adapter from PEFT-named tensors and its PEFT config dict."""
        if not name:
            raise LoraAdapterError(f"{where}: lora_name is empty")
        if name in self.loaded:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded: unload it first (/unload_lora_adapter)")
        rank, scaling = _plain_lora(config, where)
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise LoraAdapterError(f"{where}: rank {rank} is over the engine's --max-lora-rank {self.max_lora_rank}")
        matrices = {}
        for module_path, pair in _by_module(tensors, where).items():
            try:
                module = self.model.get_submodule(module_path)
            except AttributeError:
                raise LoraAdapterError(f"{where}: the model has no module {module_path}") from None
            if self.target_modules is not None and module_path.rsplit(".", 1)[-1] not in self.target_modules:
                raise LoraAdapterError(f"{where}: {module_path} is not in the engine's --lora-target-modules "
                                       f"{sorted(self.target_modules)}")
            if set(pair) != {"lora_A", "lora_B"}:
                raise LoraAdapterError(f"{where}: {module_path} has only {sorted(pair)}")
            weight = module.weight
            a, b = (pair[k].to(device=weight.device, dtype=weight.dtype) for k in ("lora_A", "lora_B"))
            if a.shape != (rank, weight.shape[1]) or b.shape != (weight.shape[0], rank):
                raise LoraAdapterError(f"{where}: {module_path} A {tuple(a.shape)} / B {tuple(b.shape)} do not fit its "
                                       f"weight {tuple(weight.shape)} at r={rank}")
            matrices[module_path] = (a, b)
        adapter = ServedAdapter(name=name, rank=rank, scaling=scaling, matrices=matrices)
        for module_path in matrices:
            if module_path not in self._hooked:
                module = self.model.get_submodule(module_path)
                self._hooked[module_path] = module.register_forward_hook(self._hook_for(module_path))
        self.loaded[name] = adapter
        self.paths[name] = "__tensor__"
        return adapter

    def unload(self, name: str) -> None:
        """`/unload_lora_adapter {lora_name}`."""
        if self.in_use is not None and self.in_use(name):
            raise LoraAdapterError(f"LoRA adapter {name!r} is in use by running or waiting requests: unload it "
                                   "after they finish")
        if self.loaded.pop(name, None) is None:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.loaded) or 'none'})")
        self.paths.pop(name, None)

    def check_request(self, lora_path: str | None) -> None:
        """A `/generate` request's adapter must be loaded (SGLang answers 400 otherwise)."""
        if lora_path is not None and lora_path not in self.loaded:
            raise LoraAdapterError(f"lora_path {lora_path!r} is not a loaded LoRA adapter (loaded: "
                                   f"{sorted(self.loaded) or 'none'}): load it with /load_lora_adapter first")

    # ------------------------------------------------------------------ forward

    @contextlib.contextmanager
    def rows_of(self, names: list[str | None]) -> Iterator[None]:
        """Run the forward inside this: row i of the batch uses adapter names[i] (None: the base)."""
        for name in names:
            self.check_request(name)
        previous, self.rows = self.rows, list(names)
        try:
            yield
        finally:
            self.rows = previous

    def _hook_for(self, module_path: str):  # noqa: ANN202 - a torch forward hook
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if not any(self.rows):
                return output
            x = args[0]
            if len(self.rows) != x.shape[0]:
                raise LoraAdapterError(f"LoRA: {len(self.rows)} row adapters for a batch of {x.shape[0]} rows")
            output = output.clone()
            for name in {n for n in self.rows if n is not None}:
                adapter = self.loaded[name]
                if module_path not in adapter.matrices:
                    continue
                a, b = adapter.matrices[module_path]
                index = torch.tensor([i for i, n in enumerate(self.rows) if n == name], device=x.device)
                rows = x.index_select(0, index)
                output.index_add_(0, index, (rows @ a.t() @ b.t()) * adapter.scaling)
            return output

        return hook
