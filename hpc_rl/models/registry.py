"""The model-family registry: one `ModelFamily` per supported HF model type, found in `hpc_rl/models/<family>/`.

Owns: the `ModelFamily` record (names, HF model types and architectures, flags, the defaults of the family's
transformers config class, and its hooks), `register`, the look-ups (`family`, `family_for_hf_model_type`,
`all_families`, `family_names`) and the discovery of family folders. Every package under `hpc_rl/models/` whose
`__init__.py` defines `FAMILY` (one `ModelFamily`) or `FAMILIES` (several sharing a folder, as deepseek_v3 and
glm4_moe_lite) is registered on the first look-up; nothing else has to name a new family.

Tiers (tests/unit/test_layers.py): this module and a family's pure modules (its `__init__`, config.json rules,
name rows, tiny checkpoint maker) are tier 0: they import no `hpc_rl.config` (config imports the registry), no
torch, transformers or Megatron at module level. A family's Megatron layers live in modules named `layers*.py`,
which are the trainer's tier (2) and may import `hpc_rl.training`; the family names those hooks by import path
(`lazy_hook("hpc_rl.models.<family>.layers:layer_spec")`), loaded on first call, so importing the registry (the
controller, config validation) loads none of them.

Hook signatures (arch: an `hpc_rl.config.model.ModelArchitecture`, not imported here; hf: a config.json dict):
  check_config(arch, hf) -> list[str]             the family's own config.json mismatches, one readable line each,
                                                   added to the shared ones (shape, attention, MoE, MLA)
  architecture_problem(arch) -> str | None        why `arch` cannot be built as this family (None: it can)
  hf_layer_rows(arch, layer) -> list[NameRow]     (Megatron suffix, [HF suffixes]) of decoder layer `layer`, in
                                                   export order; suffixes are under decoder.layers.<i>. and
                                                   model.layers.<i>.
  hf_extra_rows(arch, last_layer_rows) -> list[NameRow]   whole-name rows after the final norm/output (MTP layers)
  to_megatron(name, hf_tensors, arch) -> Tensor | None    a family-specific layout (None: the shared one)
  to_hf(name, full, arch) -> list[(hf name, Tensor)] | None   its inverse (None: the shared one)
  layer_spec(arch, layer, *, use_te, moe, moe_grouped_gemm) -> ModuleSpec   decoder layer `layer`'s Megatron spec
  make_tiny(output_dir, **spec_fields) -> Path    a tiny random HF checkpoint (config.json, safetensors, tokenizer)
  make_tiny(output_dir, spec=None, **spec_fields) -> Path   (the family's spec dataclass, or its fields)
  cpu_engine_loader(model_path, dtype) -> torch.nn.Module   the CPU engine's own forward for this family
                                                   (None in the field: transformers' AutoModelForCausalLM)
  cpu_engine_support(config) -> str | None        why the own forward does not compute this config.json exactly
                                                   (None: it does); asked before cpu_engine_loader
  fuse_for_engine (an object, not a function; `EngineFusion`): HF tensors a weight sync sends fused because the
                                                   engine reads them only so (gpt-oss's experts), used by
                                                   `hpc_rl.weights.engine_fusion`
  hf_reader(reader, hf) -> reader                 an HF checkpoint's tensors under the name map's names (gpt-oss:
                                                   fused experts per expert; a Qwen3.5 VLM release: its text tower
                                                   under the text model's names); `hpc_rl.weights.hf_import`
  hf_export(state, arch, reference_dir) -> state  the exported HF tensors (name map's names) as written to disk
                                                   next to `reference_dir`'s files (gpt-oss: experts fused as
                                                   released; a VLM release: its layout, the vision tower passed
                                                   through); the converter and --save-hf
  expert_hf_suffixes(expert, megatron_suffix) -> list[str] | None   a routed expert's HF suffixes when the
                                                   family's differ from the shared ones (gpt-oss: with biases)
  megatron_flags (an object, `FamilyFlags`): the family's own Megatron/slime model flags (`given`, `apply`)
  sglang_problems(options, hf) -> list[(option | None, message)]   SGLang engine options (by name; None: the
                                                   checkpoint itself) this family cannot be served with (hf: the
                                                   engines' config.json or None)
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

NameRow = tuple[str, list[str]]
"""(Megatron name or suffix, the HF names or suffixes it becomes, in order)."""
GPT_LAYER_SPEC = "hpc_rl.training.layer_specs:gpt_layer_spec"
"""Megatron's GPT layer (GQA attention, dense or MoE MLP, GLM4's sandwich norms): the shared layer-spec hook."""
GQA_LAYER_ROWS = "hpc_rl.models.name_rows:layer_rows"
"""The shared name rows of a GQA decoder layer (dense or MoE MLP): the default `hf_layer_rows` hook (named by
path: `name_rows` reads the registry, so the registry does not import it)."""
CPU_ENGINE_CACHES = ("batched", "batched_states", "per_request")
"""The values of `ModelFamily.cpu_engine_cache`."""


class LazyHook:
    """A hook named by import path ("package.module:function"), imported on its first call."""

    def __init__(self, path: str) -> None:
        module, _, name = path.partition(":")
        if not module or not name:
            raise ValueError(f"hook {path!r}: write it as 'package.module:function'")
        self.path = path
        self._function: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        if self._function is None:
            module, _, name = self.path.partition(":")
            self._function = getattr(importlib.import_module(module), name)
        return self._function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"lazy_hook({self.path!r})"


def lazy_hook(path: str) -> LazyHook:
    """A hook loaded from `path` ("package.module:function") on first call (for torch/Megatron/transformers code)."""
    return LazyHook(path)


class EngineFusion(Protocol):
    """A family's `fuse_for_engine` hook: groups of synced HF tensors the engines read as other (fused) tensors.

    group_of(hf_name) -> str | None            the group `hf_name` belongs to (None: sent as it is); a group's
                                               Megatron parameters must be adjacent in the name map's order
    fused_shapes(group, [(name, shape)]) -> [(name, shape)]   the fused tensors planned for a whole group
    fuse(group, [(name, tensor)]) -> [(name, tensor)]         them, from the group's gathered tensors
    largest_group_bytes(arch, itemsize) -> int                the largest group's fused bytes (memory plan)
    """

    def group_of(self, hf_name: str) -> str | None: ...

    def fused_shapes(self, group: str, entries: Sequence[tuple[str, Sequence[int]]]
                     ) -> list[tuple[str, tuple[int, ...]]]: ...

    def fuse(self, group: str, named: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]: ...

    def largest_group_bytes(self, arch: Any, itemsize: int) -> int: ...


class FamilyFlags(Protocol):
    """A family's own Megatron / slime model flags (`ModelFamily.megatron_flags`): gpt-oss's attention sinks, sliding
    windows, clamped GLU."""

    def given(self, flags: Mapping[str, Any]) -> list[str]:
        """The family's flags among `flags` (their Megatron names)."""
        ...

    def apply(self, flags: Mapping[str, Any], fields: dict[str, Any], problems: list[str],
              hf_config: Mapping[str, Any] | None) -> None:
        """Set the architecture `fields` the flags describe; append a readable line per problem."""
        ...


def _no_problem(arch: Any) -> str | None:
    return None


def _no_mismatches(arch: Any, hf: Mapping[str, Any]) -> list[str]:
    return []


def _no_rows(arch: Any, last_layer_rows: list[NameRow]) -> list[NameRow]:
    return []


def _shared_layout(*args: Any) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family: what hpc_rl needs to check, build, map, sync and serve it (hooks: the module docstring)."""

    name: str
    """The `family` field of a model file (`configs/models/*.yaml`), e.g. qwen3_moe."""
    hf_model_types: tuple[str, ...]
    """config.json `model_type` values this family reads (the first is the one its tiny checkpoint writes)."""
    hf_architectures: tuple[str, ...]
    """config.json `architectures` (transformers / SGLang class names), e.g. ("Qwen3MoeForCausalLM",)."""
    moe: bool = False
    """Routed experts in (some of) its layers: the model file must set num_moe_experts."""
    mla: bool = False
    """Multi-latent attention: the model file must set multi_latent_attention."""
    description: str = ""
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    """What the family's transformers config class assumes when config.json leaves a key out (read by the
    shared config.json check): use_qk_norm, partial_rotary_factor, scoring_func, e_score_correction_bias,
    norm_topk_prob, n_shared_experts, first_k_dense_replace, and for MoE: whether dense layers follow
    mlp_only_layers/decoder_sparse_step (`sparse_step_layers`)."""
    slime_spec: tuple[str, ...] | None = None
    """slime's `--spec MODULE FUNCTION` naming this family's layers in a Megatron launch line (GLM4:
    ("slime_plugins.models.glm4", "get_glm_spec")); None: Megatron's GPT spec, no --spec."""
    fused_gate_up: bool = False
    """The dense MLP's gate and up projections are one HF tensor (`mlp.gate_up_proj`: GLM4)."""
    check_config: Callable[[Any, Mapping[str, Any]], list[str]] = _no_mismatches
    architecture_problem: Callable[[Any], str | None] = _no_problem
    hf_layer_rows: Callable[[Any, int], list[NameRow]] = field(default_factory=lambda: lazy_hook(GQA_LAYER_ROWS))
    hf_extra_rows: Callable[[Any, list[NameRow]], list[NameRow]] = _no_rows
    to_megatron: Callable[..., Any] = _shared_layout
    to_hf: Callable[..., Any] = _shared_layout
    layer_spec: Callable[..., Any] = field(default_factory=lambda: lazy_hook(GPT_LAYER_SPEC))
    make_tiny: Callable[..., Path] | None = None
    cpu_engine_loader: Callable[..., Any] | None = None
    cpu_engine_support: Callable[[Mapping[str, Any]], str | None] | None = None
    cpu_engine_cache: str = "batched"
    """How the CPU engine holds this family's cache on transformers' model: "batched" (`kv_batch`: one key and one
    value tensor per layer, left-padded rows), "batched_states" (`state_batch`: transformers' own cache for the whole
    batch, for caches that are not keys/values alone: Gated DeltaNet's conv and recurrent states, one row per request,
    DSA's index keys beside the keys) or "per_request" (`row_caches`: the model's own cache per request, one request
    per forward call; 30-57x slower on the tiny models, kept for a cache `state_batch` cannot move)."""
    hf_reader: Callable[[Any, Mapping[str, Any]], Any] | None = None
    hf_export: Callable[[dict[str, Any], Any, Path | None], dict[str, Any]] | None = None
    expert_hf_suffixes: Callable[[int, str], list[str] | None] | None = None
    yarn_on_gqa: bool = False
    """YaRN applies to grouped-query attention (GPTModel's yarn rotary: gpt-oss); elsewhere only inside MLA."""
    megatron_flags: FamilyFlags | None = None
    sglang_problems: (Callable[[Mapping[str, Any], Mapping[str, Any] | None], list[tuple[str | None, str]]]
                      | None) = None
    model_class: Callable[[Any], Any] | None = None
    """model_class(arch) -> the GPTModel subclass (or a partial of one) `build_gpt_model` builds for this family
    (Qwen3-VL: the vision tower, M-RoPE and deepstack around Megatron's GPT); None: GPTModel."""
    serves_images: bool = False
    """The CPU engine serves it with its vision tower (transformers' image-text-to-text class, `/generate` takes
    image_data: Qwen3-VL); False for a text family whose release carries a tower it does not train (Qwen3.5)."""
    hf_text_prefix: str = "model."
    """Where the language model's tensors sit in the HF checkpoint (Qwen3-VL: "model.language_model."): the shared
    name rows' `model.embed_tokens` / `model.layers.<i>` / `model.norm` are under it."""
    fuse_for_engine: EngineFusion | None = None
    """HF tensors a weight sync (broadcast, colocated) sends fused, one group at a time, because the engine's
    loader reads them only fused (gpt-oss: each layer's experts); None: every tensor under its mapped name."""

    def __post_init__(self) -> None:
        if not self.name or not self.hf_model_types:
            raise ValueError(f"ModelFamily {self.name!r}: give a name and at least one hf_model_type")
        if self.cpu_engine_cache not in CPU_ENGINE_CACHES:
            raise ValueError(f"ModelFamily {self.name!r}: cpu_engine_cache {self.cpu_engine_cache!r} is not one of "
                             f"{', '.join(CPU_ENGINE_CACHES)}")


_FAMILIES: dict[str, ModelFamily] = {}
_BY_HF_TYPE: dict[str, ModelFamily] = {}
_discovered = False


def register(new: ModelFamily) -> ModelFamily:
    """Add a family (its name and HF model types must be new); returns it. Family folders are registered by
    discovery; call this for a family defined elsewhere (a test, a plug-in)."""
    old = _FAMILIES.get(new.name)
    if old is not None:
        if old is new:
            return new
        raise ValueError(f"model family {new.name!r} is registered twice")
    taken = [t for t in new.hf_model_types if t in _BY_HF_TYPE]
    if taken:
        raise ValueError(f"model family {new.name!r}: HF model_type {taken[0]!r} is family "
                         f"{_BY_HF_TYPE[taken[0]].name!r}'s already")
    _FAMILIES[new.name] = new
    for model_type in new.hf_model_types:
        _BY_HF_TYPE[model_type] = new
    return new


def _discover() -> None:
    """Import every family package under hpc_rl/models/ once and register its FAMILY / FAMILIES."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = Path(__file__).resolve().parent
    for info in sorted(pkgutil.iter_modules([str(package)]), key=lambda i: i.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        found = list(getattr(module, "FAMILIES", ()))
        if hasattr(module, "FAMILY"):
            found.insert(0, module.FAMILY)
        for one in found:
            register(one)


def all_families() -> list[ModelFamily]:
    """Every registered family, in name order."""
    _discover()
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def family_names() -> tuple[str, ...]:
    """The names a model file's `family` may take, in name order."""
    return tuple(f.name for f in all_families())


def family(name: str) -> ModelFamily:
    """The family called `name`; KeyError naming the known ones otherwise."""
    _discover()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"model family {name!r} is not one of {', '.join(sorted(_FAMILIES))}") from None


def family_for_slime_spec(spec: tuple[str, ...] | list[str] | None) -> ModelFamily | None:
    """The family whose `slime_spec` is `spec` (slime's --spec module and function; None: no family)."""
    _discover()
    wanted = tuple(str(part) for part in spec) if spec is not None else None
    return next((f for f in _FAMILIES.values() if f.slime_spec is not None and f.slime_spec == wanted), None)


def family_for_hf_model_type(model_type: str | None) -> ModelFamily | None:
    """The family reading config.json's `model_type` (None: no family does)."""
    _discover()
    return _BY_HF_TYPE.get(model_type or "")
