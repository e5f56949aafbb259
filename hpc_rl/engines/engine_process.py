"""Engine processes for tests, benchmarks and examples: start(), url, wait_healthy(timeout), stop().

Owns: the CPU engine's command line (`python -m hpc_rl.engines.cpu`, also the driver's engine step),
launching it or real SGLang (`sglang.launch_server`) as a child process, and waiting until its
`/health` answers 200, with the engine's log tail in the error when it does not. (In a run the
driver starts engines as steps.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_rl.engines import API_KEY_ENV
from hpc_rl.process.child_process import ChildProcess, http_ok, planned_port, wait_until
from hpc_rl.engines.sglang_launch import SglangLaunchSpec, build_sglang_command, build_sglang_env


def cpu_engine_command(model_path: str | Path, *, host: str, port: int, max_running_requests: int = 64,
                       weight_version: str = "default", num_threads: int = 1,
                       extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """argv of `python -m hpc_rl.engines.cpu` (the driver's engine steps and CpuEngineProcess). The api
    key is not on it: it travels in the environment (`API_KEY_ENV`)."""
    return [
        python, "-m", "hpc_rl.engines.cpu", "--model-path", str(model_path),
        "--host", host, "--port", str(port), "--max-running-requests", str(max_running_requests),
        "--weight-version", weight_version, "--num-threads", str(num_threads), *extra_args,
    ]


class _HttpEngineProcess:
    def __init__(self, command: list[str], *, host: str, port: int, log_path: str | Path,
                 env: Mapping[str, str], name: str) -> None:
        self.host, self.port = host, port
        self.process = ChildProcess(command, log_path=log_path, env=env, name=name)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.process.start()

    def wait_healthy(self, timeout: float) -> None:
        """Block until GET /health is 200; ChildProcessFailed (with the log tail) otherwise."""
        wait_until(lambda: http_ok(f"{self.url}/health"), process=self.process, timeout=timeout,
                   what=f"healthy at {self.url}/health")

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class CpuEngineProcess(_HttpEngineProcess):
    """hpc_rl's CPU engine serving `model_path` (tests, laptops, CI)."""

    def __init__(self, model_path: str | Path, *, log_path: str | Path, host: str = "127.0.0.1",
                 port: int | None = None, api_key: str | None = None, max_running_requests: int = 64,
                 weight_version: str = "default", num_threads: int = 1, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        port = port or planned_port(host)
        command = cpu_engine_command(model_path, host=host, port=port, max_running_requests=max_running_requests,
                                     weight_version=weight_version, num_threads=num_threads, extra_args=extra_args)
        environment = build_sglang_env(os.environ if env is None else env)
        environment.pop(API_KEY_ENV, None)
        if api_key:
            environment[API_KEY_ENV] = api_key
        super().__init__(command, host=host, port=port, log_path=log_path, env=environment, name="CPU engine")


class SglangEngineProcess(_HttpEngineProcess):
    """A real SGLang server (`sglang.launch_server`): the conformance tests run it on CPU."""

    def __init__(self, spec: SglangLaunchSpec, *, log_path: str | Path,
                 env: Mapping[str, str] | None = None) -> None:
        environment = build_sglang_env(os.environ, env)
        super().__init__(build_sglang_command(spec), host=spec.host, port=spec.port, log_path=log_path,
                         env=environment, name="SGLang engine")
