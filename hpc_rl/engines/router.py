"""sglang-router as a child process, and its run-time worker registry.

Owns: the `sglang_router.launch_router` command (bound to a given host, its own Prometheus port,
`--disable-retries` so the controller decides retries, warn logging, a policy), waiting on
`/readiness`, and adding/removing/listing workers through `POST|GET|DELETE /workers` (0.3.2's API;
`/add_worker` and friends are 404 there). Not routed by the router, so not here: abort, pause and
weight updates, which the controller sends to each engine directly.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_rl.engines.child_process import ChildProcess, ChildProcessFailed, free_port, http_ok, wait_until

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def build_router_command(*, host: str, port: int, prometheus_port: int, policy: str = "cache_aware",
                         worker_urls: Sequence[str] = (), request_timeout_secs: int | None = None,
                         extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """argv of `python -m sglang_router.launch_router` as hpc_rl runs it."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r} is not one of {ROUTER_POLICIES}")
    command = [
        python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
        "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
        "--disable-retries", "--log-level", "warn",
    ]
    if worker_urls:
        command += ["--worker-urls", *worker_urls]
    if request_timeout_secs is not None:
        command += ["--request-timeout-secs", str(request_timeout_secs)]
    return command + list(extra_args)


def _request(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


class RouterProcess:
    """One sglang-router: start/stop, and workers added or removed at run time."""

    def __init__(self, *, log_path: str | Path, host: str = "127.0.0.1", port: int | None = None,
                 prometheus_port: int | None = None, policy: str = "cache_aware",
                 worker_urls: Sequence[str] = (), request_timeout_secs: int | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.prometheus_port = prometheus_port or free_port(host)
        command = build_router_command(
            host=host, port=self.port, prometheus_port=self.prometheus_port, policy=policy,
            worker_urls=worker_urls, request_timeout_secs=request_timeout_secs, extra_args=extra_args,
        )
        environment = dict(os.environ if env is None else env)
        environment["HF_HUB_OFFLINE"] = "1"  # it loads each worker's tokenizer from model_path
        self.process = ChildProcess(command, log_path=log_path, env=environment, name="sglang-router")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.process.start()

    def wait_listening(self, timeout: float = 30.0) -> None:
        """Until the router answers HTTP at all (it listens before any worker is healthy)."""
        wait_until(lambda: http_ok(f"{self.url}/workers") or http_ok(f"{self.url}/liveness"),
                   process=self.process, timeout=timeout, what=f"listening at {self.url}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until `GET /readiness` is 200 (a healthy worker exists)."""
        wait_until(lambda: http_ok(f"{self.url}/readiness"), process=self.process, timeout=timeout,
                   what=f"ready at {self.url}/readiness")

    def stop(self) -> None:
        self.process.stop()

    def list_workers(self) -> list[dict]:
        """The registered workers as the router reports them (dicts with at least `url`)."""
        status, body = _request("GET", f"{self.url}/workers")
        if status != 200:
            raise self.process.failure(f"answered {status} to GET /workers: {body}")
        workers = body.get("workers", []) if isinstance(body, dict) else body
        return list(workers or [])

    def worker_urls(self) -> list[str]:
        return [worker.get("url", "") for worker in self.list_workers()]

    def add_worker(self, url: str, *, wait: bool = True, timeout: float = 60.0) -> None:
        """Register an engine (202, asynchronous); with `wait`, until it is listed."""
        status, body = _request("POST", f"{self.url}/workers", {"url": url})
        if status not in (200, 201, 202):
            raise self.process.failure(f"refused worker {url} ({status}: {body})")
        if wait:
            self._wait_for(lambda: url in self.worker_urls(), timeout, f"listing worker {url}")

    def remove_worker(self, url: str, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Deregister an engine by URL (the router's DELETE takes its worker id)."""
        for worker in self.list_workers():
            if worker.get("url") == url:
                worker_id = worker.get("id") or worker.get("worker_id") or url
                quoted = urllib.parse.quote(str(worker_id), safe="")
                status, body = _request("DELETE", f"{self.url}/workers/{quoted}")
                if status not in (200, 202, 204):
                    raise self.process.failure(f"refused to remove worker {url} ({status}: {body})")
                break
        else:
            raise ValueError(f"worker {url} is not registered with the router at {self.url}")
        if wait:
            self._wait_for(lambda: url not in self.worker_urls(), timeout, f"dropping worker {url}")

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if not self.process.alive():
                raise self.process.failure(f"died while {what}")
            time.sleep(0.2)
        raise ChildProcessFailed(f"sglang-router at {self.url} was not {what} after {timeout:.0f} s")

    def __enter__(self) -> RouterProcess:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
