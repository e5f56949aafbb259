"""sglang-router as a child process, and its run-time worker registry.

Owns: the `sglang_router.launch_router` command (bound to a given host, its own Prometheus port,
`--disable-retries` so the controller decides retries, warn logging, a policy), waiting on
`/readiness`, and adding/removing/listing workers through `POST|GET|DELETE /workers` (0.3.2's API;
`/add_worker` and friends are 404 there). Not routed by the router, so not here: abort, pause and
weight updates, which the controller sends to each engine directly. `add_workers` registers many
engines with one wait (O(N), not O(N^2)).

The job's engine key (`api_key`), as sglang-router 0.3.2 handles it (measured):
- `--api-key K` guards the router's own endpoints (`/generate`, `/workers`...: 401 without
  `Authorization: Bearer K`; `/liveness`, `/readiness`, `/health` stay open). It is NOT sent to workers.
- A worker added with `POST /workers {"url", "api_key": K}` gets `Authorization: Bearer K` on
  `/server_info`, `/model_info` (registration) and every routed `/generate`; `/health` goes unsigned.
  (Without it, the router forwards the client's own Authorization header on `/generate` only.)
- `--api-key` exists only on the command line, which `ps` shows: with a key, the router runs through
  `python -m hpc_rl.engines.router` (`main` below), which reads it from `API_KEY_ENV`.
- Open without the key (measured): `/v1/models` (the model path once a worker is registered),
  `/get_server_info`, `/get_model_info`, `/health_generate`, `/engine_metrics`, and the Prometheus
  port. No flag closes them, so the driver binds the router to 127.0.0.1 (its one client, the
  controller, runs in the same process): they answer the first node only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpc_rl.config.sections.rollout import ROUTER_POLICIES
from hpc_rl.engines import API_KEY_ENV
from hpc_rl.process.child_process import ChildProcess, ChildProcessFailed, http_ok, planned_port, wait_until
from hpc_rl.protocol.http_client import request_blocking


def build_router_command(*, host: str, port: int, prometheus_port: int, policy: str = "cache_aware",
                         worker_urls: Sequence[str] = (), request_timeout_secs: int | None = None,
                         extra_args: Sequence[str] = (), python: str = sys.executable,
                         key_from_env: bool = False) -> list[str]:
    """argv of `python -m sglang_router.launch_router` as hpc_rl runs it; with `key_from_env`, of
    `python -m hpc_rl.engines.router` (same flags, plus the api key read from `API_KEY_ENV`)."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r} is not one of {ROUTER_POLICIES}")
    module = "hpc_rl.engines.router" if key_from_env else "sglang_router.launch_router"
    command = [
        python, "-m", module, "--host", host, "--port", str(port),
        "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
        "--disable-retries", "--log-level", "warn",
    ]
    if worker_urls:
        command += ["--worker-urls", *worker_urls]
    if request_timeout_secs is not None:
        command += ["--request-timeout-secs", str(request_timeout_secs)]
    return command + list(extra_args)


def _request(method: str, url: str, body: dict | None = None, timeout: float = 10.0,
             api_key: str | None = None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    status, raw = request_blocking(method, url, data, api_key=api_key, timeout_s=timeout)
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


class RouterProcess:
    """One sglang-router: start/stop, and workers added or removed at run time.

    With `api_key` (the job's engine key), the router demands it from its clients and presents it to
    every worker added through `add_worker` (see the module docstring)."""

    def __init__(self, *, log_path: str | Path, host: str = "127.0.0.1", port: int | None = None,
                 prometheus_port: int | None = None, policy: str = "cache_aware",
                 worker_urls: Sequence[str] = (), request_timeout_secs: int | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 api_key: str | None = None) -> None:
        self.host = host
        self.port = port or planned_port(host)
        self.prometheus_port = prometheus_port or planned_port(host)
        self.api_key = api_key
        command = build_router_command(
            host=host, port=self.port, prometheus_port=self.prometheus_port, policy=policy,
            worker_urls=worker_urls, request_timeout_secs=request_timeout_secs, extra_args=extra_args,
            key_from_env=bool(api_key),
        )
        environment = dict(os.environ if env is None else env)
        environment["HF_HUB_OFFLINE"] = "1"  # it loads each worker's tokenizer from model_path
        environment.pop(API_KEY_ENV, None)
        if api_key:
            environment[API_KEY_ENV] = api_key
        self.process = ChildProcess(command, log_path=log_path, env=environment, name="sglang-router")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.process.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.process.log_path, "a") as log:  # at warn level a healthy router logs nothing at all
            log.write(f"hpc_rl: sglang-router at {self.url} (prometheus {self.host}:{self.prometheus_port}), "
                      f"policy and flags: {' '.join(self.process.command[3:])}; "
                      f"{'clients and workers need the job key' if self.api_key else 'no api key'}; "
                      "log level warn: only its problems follow\n")
        self.process.start()

    def wait_listening(self, timeout: float = 30.0) -> None:
        """Until the router answers HTTP at all (it listens before any worker is healthy)."""
        wait_until(lambda: http_ok(f"{self.url}/liveness") or http_ok(f"{self.url}/workers"),
                   process=self.process, timeout=timeout, what=f"listening at {self.url}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until `GET /readiness` is 200 (a healthy worker exists)."""
        wait_until(lambda: http_ok(f"{self.url}/readiness"), process=self.process, timeout=timeout,
                   what=f"ready at {self.url}/readiness")

    def stop(self) -> None:
        self.process.stop()

    def exit_code(self) -> int | None:
        """The router's exit code once it has exited (reaped: no zombie is left), None while it runs or before
        it was started."""
        popen = self.process.popen
        return popen.poll() if popen is not None else None

    def list_workers(self) -> list[dict]:
        """The registered workers as the router reports them (dicts with at least `url`)."""
        status, body = _request("GET", f"{self.url}/workers", api_key=self.api_key)
        if status != 200:
            raise self.process.failure(f"answered {status} to GET /workers: {body}")
        workers = body.get("workers", []) if isinstance(body, dict) else body
        return list(workers or [])

    def worker_urls(self) -> list[str]:
        return [worker.get("url", "") for worker in self.list_workers()]

    def add_worker(self, url: str, *, wait: bool = True, timeout: float = 60.0) -> None:
        """Register an engine (202, asynchronous; with the router's key for that worker); with `wait`,
        until it is listed."""
        self.add_workers([url], wait=wait, timeout=timeout)

    def add_workers(self, urls: Sequence[str], *, wait: bool = True, timeout: float | None = None) -> None:
        """Register engines: every POST first (each is answered 202 at once; the router probes the worker
        in the background), then, with `wait`, one `GET /workers` per poll until all are listed. Adding
        N engines one by one, each waiting for the full list, costs O(N^2) (measured: 13 s for 256, 415
        of 1,024 after 80 s); this is N POSTs plus a few lists. `timeout` defaults to 60 s + 0.25 s per
        engine (the router's own registration probes each worker: HTTP/2, /server_info, /model_info)."""
        urls = list(urls)
        for url in urls:
            request = {"url": url, "api_key": self.api_key} if self.api_key else {"url": url}
            status, body = _request("POST", f"{self.url}/workers", request, api_key=self.api_key)
            if status not in (200, 201, 202):
                raise self.process.failure(f"refused worker {url} ({status}: {body})")
        if wait and urls:
            missing = set(urls)

            def all_listed() -> bool:
                missing.difference_update(self.worker_urls())
                return not missing

            self._wait_for(all_listed, 60.0 + 0.25 * len(urls) if timeout is None else timeout,
                           lambda: f"listing {len(missing)} of {len(urls)} added worker(s) (e.g. {min(missing)})")

    def remove_worker(self, url: str, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Deregister an engine by URL (the router's DELETE takes its worker id)."""
        for worker in self.list_workers():
            if worker.get("url") == url:
                worker_id = worker.get("id") or worker.get("worker_id") or url
                quoted = urllib.parse.quote(str(worker_id), safe="")
                status, body = _request("DELETE", f"{self.url}/workers/{quoted}", api_key=self.api_key)
                if status not in (200, 202, 204):
                    raise self.process.failure(f"refused to remove worker {url} ({status}: {body})")
                break
        else:
            raise ValueError(f"worker {url} is not registered with the router at {self.url}")
        if wait:
            self._wait_for(lambda: url not in self.worker_urls(), timeout, lambda: f"dropping worker {url}")

    def _wait_for(self, condition: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if not self.process.alive():
                raise self.process.failure(f"died while {what()}")
            time.sleep(0.2)
        raise ChildProcessFailed(f"sglang-router at {self.url} was not {what()} after {timeout:.0f} s")

    def __enter__(self) -> RouterProcess:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m hpc_rl.engines.router ARGS`: sglang-router with `launch_router`'s ARGS, guarded by the
    key in `API_KEY_ENV` (so the key is in no command line). The Rust router is started through its
    public `Router.from_args`, not `launch_router`, whose module also imports the Python mini load
    balancer (fastapi, uvicorn: 40 MB more resident in a process that only forwards requests)."""
    import argparse

    from sglang_router.router import Router  # type: ignore[import-untyped]
    from sglang_router.router_args import RouterArgs  # type: ignore[import-untyped]

    parser = argparse.ArgumentParser(prog="python -m hpc_rl.engines.router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    router_args = RouterArgs.from_cli_args(parser.parse_args(list(sys.argv[1:] if argv is None else argv)),
                                           use_router_prefix=False)
    router_args.api_key = os.environ.get(API_KEY_ENV) or None
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()
