"""vime's `--vllm-*` options (vLLM's engine arguments with a `vllm_` prefix) on hpc_rl's SGLang engines.

Owns: the table from vLLM engine-argument names (and vime's own `--vllm-*` extras) to the SGLang server
option or hpc_rl field that means the same, the options hpc_rl accepts because it always does what they
ask, and the reason (with what to use instead) for every one without an equivalent. vime
(vllm-project/vime, slime on vLLM) passes vLLM's `AsyncEngineArgs` as `--vllm-<name>` and reads
`--rollout-num-gpus-per-engine` as vLLM's tensor_parallel_size, which is hpc_rl's engine TP already.
Each mapping logs one line (`hpc_rl.submit` prints it), so a vime user sees what their engine gets.
Knows nothing about argv parsing (`settings_sources` routes `vllm_*` names here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_rl.config.sections.rollout import ROUTER_POLICIES
from hpc_rl.config.typing_rules import ConfigError

log = logging.getLogger(__name__)

VLLM_PREFIX = "vllm_"
SGLANG_OPTION = "sglang.extra_args."


@dataclass(frozen=True)
class VllmMapping:
    """One vLLM option: what its value sets (field path -> value; empty: nothing to set) and a note."""

    settings: Callable[[Any], dict[str, Any]]
    note: str = ""


def _option(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {SGLANG_OPTION + name: convert(value)}


def _field(path: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {path: value}


def _chunked_prefill(value: Any) -> dict[str, Any]:
    return {} if value else {SGLANG_OPTION + "chunked_prefill_size": -1}


KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
"""vLLM's --kv-cache-dtype -> SGLang's (vLLM's plain fp8 is e4m3)."""


def _kv_cache_dtype(value: Any) -> dict[str, Any]:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{value!r} has no SGLang KV-cache dtype; use one of {', '.join(KV_CACHE_DTYPES)} "
                         f"or --sglang-kv-cache-dtype")
    return {SGLANG_OPTION + "kv_cache_dtype": KV_CACHE_DTYPES[value]}


def _schedule_policy(value: Any) -> dict[str, Any]:
    if value != "fcfs":
        raise ValueError(f"{value!r}: SGLang has no request priorities here; use fcfs or --sglang-schedule-policy")
    return {SGLANG_OPTION + "schedule_policy": "fcfs"}


def _router_policy(value: Any) -> dict[str, Any]:
    if value not in ROUTER_POLICIES:
        raise ValueError(f"{value!r} is not a policy of sglang-router 0.3.2 (vime's consistent_hash keeps a "
                         f"sample's turns on one engine); use one of {', '.join(ROUTER_POLICIES)}")
    return {"sglang.router_policy": value}


VLLM_TO_SGLANG: dict[str, VllmMapping] = {
    "gpu_memory_utilization": VllmMapping(_field("sglang.mem_fraction_static"),
                                          "the share of GPU memory for the engine's weights and KV cache"),
    "max_num_seqs": VllmMapping(_option("max_running_requests")),
    "max_num_batched_tokens": VllmMapping(_option("chunked_prefill_size"), "tokens per prefill chunk"),
    "enforce_eager": VllmMapping(_option("disable_cuda_graph")),
    "max_model_len": VllmMapping(_option("context_length")),
    "enable_prefix_caching": VllmMapping(_option("disable_radix_cache", lambda v: not v),
                                         "SGLang's radix cache is its prefix cache"),
    "enable_chunked_prefill": VllmMapping(_chunked_prefill, "SGLang chunks prefills unless chunked_prefill_size is -1"),
    "kv_cache_dtype": VllmMapping(_kv_cache_dtype),
    "block_size": VllmMapping(_option("page_size"), "tokens per KV-cache page"),
    "quantization": VllmMapping(_option("quantization")),
    "load_format": VllmMapping(_option("load_format")),
    "dtype": VllmMapping(_option("dtype")),
    "revision": VllmMapping(_option("revision")),
    "download_dir": VllmMapping(_option("download_dir")),
    "trust_remote_code": VllmMapping(_option("trust_remote_code")),
    "cpu_offload_gb": VllmMapping(_option("cpu_offload_gb")),
    "disable_custom_all_reduce": VllmMapping(_option("disable_custom_all_reduce")),
    "cuda_graph_sizes": VllmMapping(lambda v: {"sglang.cuda_graph_bs": v if isinstance(v, list) else [v]},
                                    "batch sizes of the captured decode graphs"),
    "scheduling_policy": VllmMapping(_schedule_policy),
    # vime's own --vllm-* extras (not vLLM engine arguments)
    "server_concurrency": VllmMapping(_field("sglang.server_concurrency"), "requests in flight per engine"),
    "router_policy": VllmMapping(_router_policy),
    "enable_deterministic_inference": VllmMapping(_option("enable_deterministic_inference")),
}
"""vLLM name (without the prefix) -> what it sets on hpc_rl's SGLang engines (names checked against the pinned
SGLang's option list by tests/unit/test_vllm_flags.py)."""

VLLM_ACCEPTED: dict[str, str] = {
    "enable_sleep_mode": "colocated SGLang engines always start with the memory saver and release/resume their "
                         "memory around each train step (decoupled engines keep it)",
    "weight_sync_packed": "hpc_rl always sends weights in buckets of --update-weight-buffer-size",
}
"""vLLM/vime switches that ask for what hpc_rl always does (accepted as given, with one line)."""

VLLM_REFUSED: dict[str, str] = {
    "tensor_parallel_size": "an engine's tensor-parallel size is --rollout-num-gpus-per-engine (vime ignores this "
                            "option too)",
    "pipeline_parallel_size": "hpc_rl's engines are tensor-parallel over --rollout-num-gpus-per-engine GPUs; engine "
                              "pipeline parallelism is not offered",
    "data_parallel_size": "hpc_rl runs one engine per --rollout-num-gpus-per-engine GPUs; for more replicas give "
                          "more --rollout-num-gpus",
    "seed": "sampling is seeded by --rollout-seed; SGLang's server seed is --sglang-random-seed",
    "model": "the engines serve --hf-checkpoint",
    "tokenizer": "the engines use --hf-checkpoint's tokenizer",
    "served_model_name": "the engines serve --hf-checkpoint under its path",
    "host": "hpc_rl's launcher picks each engine's address",
    "port": "hpc_rl's launcher picks each engine's port",
    "swap_space": "SGLang has no CPU swap space for preempted sequences (it retracts and recomputes them); drop it",
    "attention_backend": "vLLM's backend names are not SGLang's: use --sglang-attention-backend (fa3, flashinfer, "
                         "triton, ...)",
    "speculative_config": "speculative decoding is configured with SGLang's --sglang-speculative-* options",
    "compilation_config": "torch.compile in SGLang is --sglang-enable-torch-compile",
    "max_logprobs": "hpc_rl asks the engine for the sampled token's log-prob only; drop it",
    "disable_log_stats": "SGLang's statistics are its log lines and --sglang-enable-metrics; drop it",
    "enable_return_routed_experts": "set by --use-rollout-routing-replay",
    "router_ip": "hpc_rl starts its own sglang-router beside the controller; an external router is not offered",
    "router_port": "hpc_rl starts its own sglang-router beside the controller; an external router is not offered",
    "config": "vime's --vllm-config (several models, prefill/decode groups) is not offered: one model, "
              "--rollout-num-gpus GPUs in engines of --rollout-num-gpus-per-engine",
    "weight_transfer_timeout_sec": "weight-update calls time out after controller.engine_request_timeout "
                                   "(--set controller.engine_request_timeout=S)",
}
"""vLLM/vime option -> why hpc_rl has no equivalent and what to use instead."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


HPC_RL_FIELDS = ("sglang.server_concurrency", "sglang.router_policy")
"""Targets that are hpc_rl's settings (controller, router) rather than options of the SGLang server."""


def _target(path: str) -> str:
    return path if path in HPC_RL_FIELDS else _flag(path.rsplit(".", 1)[1])


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def vllm_settings(name: str, value: Any, where: str) -> dict[str, Any]:
    """Field path -> value for one `vllm_*` option name (with its prefix), logging one line for it.
    Raises ConfigError for an option with no SGLang equivalent (the reason says what to use)."""
    option = name[len(VLLM_PREFIX):]
    flag = _flag(name)
    if option.startswith("no_") and option[3:] in {**VLLM_TO_SGLANG, **VLLM_ACCEPTED}:
        option, value = option[3:], False  # vLLM's BooleanOptionalAction: --vllm-no-enable-prefix-caching
    if option in VLLM_REFUSED:
        raise ConfigError(f"{where}: {flag} is refused: {VLLM_REFUSED[option]}")
    if option in VLLM_ACCEPTED:
        log.info("%s is vLLM's; accepted: %s", flag, VLLM_ACCEPTED[option])
        return {}
    mapping = VLLM_TO_SGLANG.get(option)
    if mapping is None:
        raise ConfigError(f"{where}: {flag} is refused: vLLM's {_flag(option)} has no SGLang equivalent in hpc_rl's "
                          f"table (hpc_rl/config/vllm_flags.py); hpc_rl's engines are SGLang: give SGLang's own "
                          f"option as --sglang-<name>, or drop it")
    try:
        settings = mapping.settings(value)
    except ValueError as error:
        raise ConfigError(f"{where}: {flag} is refused: {error}") from error
    shown = ", ".join(f"{_target(path)} {_shown(v)}" for path, v in settings.items()) or "nothing to set"
    note = f" ({mapping.note})" if mapping.note else ""
    log.info("%s %s is vLLM's; hpc_rl's SGLang engines get %s%s", flag, _shown(value), shown, note)
    return settings
