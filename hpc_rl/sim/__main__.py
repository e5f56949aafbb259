"""`python -m hpc_rl.sim --params FILE --count N --urls-file PATH`: N simulated engines in this process.

Owns the command line: read the parameters (YAML, with `--set field=value` overrides), take the
job's engine key from `HPC_RL_ENGINE_API_KEY` (never argv), listen on N ports, write their URLs (one
per line) to `--urls-file` once every port listens, and serve until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from hpc_rl.engines import API_KEY_ENV
from hpc_rl.sim.model import EngineModel, SimConfigError
from hpc_rl.sim.server import SimFleetServer


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SimConfigError(f"--set {item!r}: expected field=value")
        overrides[key.strip()] = value.strip()
    return overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_rl.sim", description="simulated SGLang engines")
    parser.add_argument("--params", required=True, help="engine model YAML (e.g. configs/sim/qwen3_4b_h100_tp2.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a parameter")
    parser.add_argument("--count", type=int, required=True, help="engines in this process")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--urls-file", required=True, help="written (one URL per line) once all listen")
    parser.add_argument("--model-path", default="sim-model", help="what /server_info reports (the router loads "
                                                                    "its tokenizer from there)")
    return parser


async def serve(args: argparse.Namespace, model: EngineModel) -> None:
    server = SimFleetServer(model, count=args.count, host=args.host, api_key=os.environ.get(API_KEY_ENV) or None,
                            model_path=args.model_path)
    urls = await server.start()
    path = Path(args.urls_file)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{url}\n" for url in urls))
    tmp.replace(path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def _drop_http2_probe(record: logging.LogRecord) -> bool:
    """sglang-router probes each worker for HTTP/2 at registration; aiohttp logs that as an error."""
    error = record.exc_info[1] if record.exc_info else None
    return "PRI/Upgrade" not in str(error)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_drop_http2_probe)
    model = EngineModel.from_yaml(args.params, **parse_overrides(args.set))
    asyncio.run(serve(args, model))


if __name__ == "__main__":
    main()
