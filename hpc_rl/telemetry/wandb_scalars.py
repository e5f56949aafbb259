"""Weights & Biases logging of a run (slime's `--use-wandb` flags), an optional extra beside TensorBoard.

Owns: opening the run's W&B run in the controller (the one process that sees every rollout's numbers:
rollout/*, train/* of the rollout's last optimizer step, eval/*, time/*), choosing online or offline,
and logging each rollout's scalars against `rollout/step`. The trainer does not log to W&B (its
per-optimizer-step train/* scalars stay in TensorBoard), so one run has one writer: no shared-mode
processes, and the offline run dir holds the whole run.

Mode: `logging.wandb_mode` if given, else $WANDB_MODE, else online when this node opens a TCP connection
to the W&B host within 3 s (name lookup included) and offline when it cannot (compute nodes often have
no outside network; a run never waits on, or fails for, an unreachable server). An offline run is uploaded afterwards with
`wandb sync <wandb_dir>/wandb/offline-run-*`. The run id is `logging.wandb_run_id` or derived from the
run dir, so a requeued or restarted run (same run dir) continues the same W&B run (`resume="allow"`).

`wandb` is imported only here and only when `use_wandb` is set (`pip install 'hpc_rl[wandb]'`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hpc_rl.config.schema import RunConfig

log = logging.getLogger(__name__)

DEFAULT_HOST = "https://api.wandb.ai"
STEP_METRIC = "rollout/step"
PROBE_TIMEOUT_S = 3.0


def host_reachable(host_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the W&B server opens from this node within `timeout_s`, name lookup
    included (a node without network may wait on DNS far longer than the connect timeout)."""
    parsed = urlparse(host_url if "://" in host_url else f"https://{host_url}")
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    answer: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
                answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, name="wandb host probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answer and answer[0])


def choose_mode(configured: str | None, host_url: str) -> tuple[str, str]:
    """(mode, why): the configured mode, $WANDB_MODE, or online/offline by whether the host answers."""
    if configured:
        return configured, "logging.wandb_mode"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "$WANDB_MODE"
    if host_reachable(host_url):
        return "online", f"{host_url} is reachable"
    return "offline", f"{host_url} is not reachable from {socket.gethostname()}"


def run_id_for(run_dir: str | Path) -> str:
    """A W&B run id of the run dir: the same on every process and after a requeue."""
    return "hpcrl-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def loggable_config(config: RunConfig) -> dict[str, Any]:
    """The resolved config as W&B's run config, without the API key."""
    values = dataclasses.asdict(config)
    values["logging"].pop("wandb_key", None)
    return values


class WandbScalars:
    """One W&B run: `log(metrics, step)` records every finite number against rollout/step."""

    def __init__(self, run: Any, *, mode: str) -> None:
        self.run, self.mode = run, mode

    @classmethod
    def open(cls, config: RunConfig, run_dir: str | Path) -> WandbScalars:
        import wandb

        settings = config.logging
        host = settings.wandb_host or os.environ.get("WANDB_BASE_URL") or DEFAULT_HOST
        mode, why = choose_mode(settings.wandb_mode, host)
        directory = Path(settings.wandb_dir or Path(run_dir) / "wandb")
        directory.mkdir(parents=True, exist_ok=True)
        if mode == "online" and settings.wandb_key:
            wandb.login(key=settings.wandb_key, host=settings.wandb_host, prompt=False)
        run = wandb.init(
            project=settings.wandb_project, entity=settings.wandb_team, group=settings.wandb_group or settings.run_name,
            name=settings.run_name, id=settings.wandb_run_id or run_id_for(run_dir), resume="allow",
            dir=str(directory), config=loggable_config(config), mode=mode,
            settings=wandb.Settings(silent=True, **({"base_url": settings.wandb_host} if settings.wandb_host else {})))
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        where = f"{directory}/wandb/offline-run-*-{run.id}"
        log.info("W&B run %s %s (%s)%s", run.id, mode, why,
                 f"; upload it later with `wandb sync {where}`" if mode == "offline" else "")
        return cls(run, mode=mode)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = {name: float(value) for name, value in metrics.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
        self.run.log({**values, STEP_METRIC: step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # wandb 0.31 writes an offline run's file when its service stops (7 bytes after finish())
