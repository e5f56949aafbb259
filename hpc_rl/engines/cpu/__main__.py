"""Command line of the CPU engine: parse flags, load the model, serve until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping

import torch

from hpc_rl.engines import API_KEY_ENV
from hpc_rl.process.child_process import exit_without_teardown


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_rl.engines.cpu",
                                     description="SGLang-compatible HTTP engine on torch CPU")
    parser.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None,
                        help=f"Bearer key required on every endpoint but /health*; prefer ${API_KEY_ENV}, "
                             "which `ps` does not show (default: that variable, else no key)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--context-length", type=int, default=None,
                        help="default: the model's max_position_embeddings")
    parser.add_argument("--weight-version", default="default", help="initial weight version label")
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads (1 on shared cores)")
    parser.add_argument("--attn-implementation", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="auto: the engine's own Qwen3 forward where it applies (no transformers import), "
                             "else transformers")
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="as SGLang's flag: releasing the `weights` tag discards them (colocated mode)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="as SGLang's flag: with the memory saver, released weights are kept in host memory and "
                             "restored on resume (colocated LoRA, --lora-base-cpu-backup)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="as SGLang's flag: answers carry each token's routed experts when a request asks "
                             "(return_routed_experts); needs a MoE model")
    parser.add_argument("--base-gpu-id", type=int, default=0,
                        help="as SGLang's flag: position of the engine's first GPU in its step's GPU list (the CPU "
                             "engine computes on CPU; its device identity, checked against colocated shares, "
                             "comes from it: hpc_rl.engines.gpu_step)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                        help="as SGLang's flag: the weights' and activations' dtype (auto: float32, the trainer's "
                             "on CPU); the driver passes the dtype the trainer exports")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="as SGLang's flag: nodes the engine spans (node-rank 0 serves the API; "
                             "hpc_rl.engines.cpu.node_group)")
    parser.add_argument("--node-rank", type=int, default=0, help="as SGLang's flag: this process's node")
    parser.add_argument("--dist-init-addr", default=None,
                        help="as SGLang's flag: HOST:PORT where the node-ranks meet (node-rank 0's address)")
    parser.add_argument("--enable-lora", action="store_true", help="as SGLang's: serve LoRA adapters loaded at run "
                        "time (/load_lora_adapter) on the base model, chosen per request by lora_path")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="as SGLang's: the largest rank an adapter "
                        "loaded later may have (default: any)")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, help="as SGLang's: the projections an "
                        "adapter loaded later may adapt (default: any)")
    parser.add_argument("--log-level", default="warning")
    return parser


def model_dtype(name: str) -> torch.dtype:
    """SGLang's --dtype names: auto (float32 here), float/float32, bfloat16, half/float16."""
    return {"auto": torch.float32, "float": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "half": torch.float16, "float16": torch.float16}[name]


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str | None:
    """`--api-key`, else `$HPC_RL_ENGINE_API_KEY` (how the driver hands it over), else no key."""
    return args.api_key or environ.get(API_KEY_ENV) or None


def _drop_http2_probe(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return "PRI/Upgrade" not in str(error)


def exit_on_scheduler_death(error: BaseException) -> None:
    """A dead scheduler ends the process (exit 1), as SGLang's does: /health must not stay 200 while
    every request would hang. The router and the controller then see a dead engine and act on it."""
    logging.getLogger("hpc_rl.engines.cpu").critical("scheduler died (%r): exiting", error)
    logging.shutdown()
    os._exit(1)


def load_model(model_path: str, model_impl: str, attn_implementation: str,
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The engine's model, in `dtype`: its family's own forward (`native`, the family's `cpu_engine_loader` in
    `hpc_rl.models`: Qwen3's; `auto` picks it where it applies and eager attention is asked for) or transformers'
    (SGLang's `--model-impl transformers` likewise)."""
    from hpc_rl.engines.cpu.native_qwen3 import read_config
    from hpc_rl.models.registry import all_families, family_for_hf_model_type
    from hpc_rl.config.fp8_scheme import read_fp8_blocks

    config = read_config(model_path)
    found = family_for_hf_model_type(config.get("model_type"))
    loader = found.cpu_engine_loader if found is not None else None
    if loader is None:
        native = sorted(t for f in all_families() if f.cpu_engine_loader is not None for t in f.hf_model_types)
        reason = f"model_type {config.get('model_type')!r} is not {' or '.join(repr(t) for t in native)}"
    else:
        reason = found.cpu_engine_support(config) if found.cpu_engine_support is not None else None
    if model_impl == "native" and reason is not None:
        raise SystemExit(f"--model-impl native: {model_path}: {reason}; use --model-impl transformers")
    if model_impl == "native" or (model_impl == "auto" and reason is None and attn_implementation == "eager"):
        return loader(model_path, dtype)
    from transformers import AutoModelForCausalLM

    from hpc_rl.engines.cpu.nextn_draft import attach_draft

    if read_fp8_blocks(model_path) is not None:  # transformers' FP8 loader wants a GPU: dequantize as SGLang's blocks
        model = _dequantized_transformers_model(model_path, dtype, attn_implementation)
    elif found is not None and found.serves_images:  # Qwen3-VL: transformers' own class, with its vision tower
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype,
                                                            attn_implementation=attn_implementation).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                     attn_implementation=attn_implementation).eval()
    attach_draft(model, model_path, dtype)  # DeepSeek-V3 / GLM-4.7-Flash MTP layers: where SGLang's draft keeps them
    return model


def _dequantized_transformers_model(model_path: str, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    """A block-FP8 checkpoint as transformers' model in `dtype`: built from its config without the quantization,
    every weight loaded by name, e4m3 weights dequantized with their weight_scale_inv (`load_from_disk`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpc_rl.engines.cpu.weight_sync import load_from_disk

    config = AutoConfig.from_pretrained(model_path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    load_from_disk(model, model_path, require_all=True)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    api_key = resolve_api_key(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # sglang-router probes each worker for HTTP/2 once at registration; aiohttp logs that as an error.
    logging.getLogger("aiohttp.server").addFilter(_drop_http2_probe)
    torch.set_num_threads(args.num_threads)
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)

    from aiohttp import web

    from hpc_rl.engines.cpu.engine_tokenizer import load_engine_tokenizer
    from hpc_rl.engines.cpu.scheduler import Scheduler
    from hpc_rl.engines.cpu.server import EngineServer, ServerInfo
    from hpc_rl.process.startup_gc import freeze_startup_objects

    nodes = None
    if args.nnodes > 1:  # as SGLang: the node-ranks meet before loading (node-rank 0 waits for every node)
        from hpc_rl.engines.cpu.node_group import EngineNodes
        from hpc_rl.weights.device_identity import own_device_identity

        if not args.dist_init_addr:
            raise SystemExit("--nnodes > 1 needs --dist-init-addr HOST:PORT (node-rank 0's address)")
        nodes = EngineNodes(nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                            device_id=own_device_identity())
    model = load_model(args.model_path, args.model_impl, args.attn_implementation, model_dtype(args.dtype))
    if nodes is not None and args.node_rank > 0:
        from hpc_rl.engines.cpu.follower import serve_follower

        serve_follower(model, nodes, host=args.host, port=args.port, memory_saver=args.enable_memory_saver)
        return
    tokenizer = load_engine_tokenizer(args.model_path)
    text_config = getattr(model.config, "text_config", model.config)  # a VL config keeps the text model's sizes there
    context_length = args.context_length or int(getattr(text_config, "max_position_embeddings", 4096))
    routed_experts = None
    if args.enable_return_routed_experts:
        from hpc_rl.engines.cpu.routed_experts import RoutedExpertsCapture

        try:
            routed_experts = RoutedExpertsCapture(model)
        except ValueError as error:
            raise SystemExit(f"{args.model_path}: {error}") from None
    lora = None
    if args.enable_lora:
        from hpc_rl.engines.cpu.lora_serving import EngineLoraAdapters

        lora = EngineLoraAdapters(model, max_lora_rank=args.max_lora_rank, target_modules=args.lora_target_modules)
    images = None
    from hpc_rl.engines.cpu.vision import EngineImages, sees_images

    if sees_images(model):
        try:
            images = EngineImages(args.model_path, model.config)
        except ValueError as error:
            raise SystemExit(f"{args.model_path}: {error}") from None
    try:
        scheduler = Scheduler(model, tokenizer, max_running_requests=args.max_running_requests,
                              context_length=context_length, weight_version=args.weight_version,
                              on_fatal=exit_on_scheduler_death, memory_saver=args.enable_memory_saver,
                              routed_experts=routed_experts, lora=lora, images=images,
                              weights_cpu_backup=args.enable_weights_cpu_backup)
    except ValueError as error:
        raise SystemExit(f"{args.model_path}: {error}") from None
    info = ServerInfo(model_path=args.model_path, host=args.host, port=args.port, api_key=api_key,
                      max_running_requests=args.max_running_requests, context_length=context_length,
                      architectures=list(model.config.architectures or []), model_type=model.config.model_type,
                      dtype=str(model_dtype(args.dtype)).removeprefix("torch."), base_gpu_id=args.base_gpu_id,
                      weight_version=args.weight_version)
    freeze_startup_objects()  # a full GC no longer walks the model and the libraries (process.startup_gc)
    scheduler.start()
    app = EngineServer(scheduler, info, nodes=nodes).build_app()
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=1.0)
    exit_without_teardown(0)  # stopped (SIGTERM), the scheduler has ended: skip seconds of teardown


if __name__ == "__main__":
    main()
