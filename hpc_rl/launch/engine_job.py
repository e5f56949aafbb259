"""Engines as their own Slurm job, attached to a running run (`python -m hpc_rl.submit CONFIG --engines-for RUN_DIR`).

Owns both halves of an engine job (docs/engine-jobs.md):
- submitting it: the sbatch script (`render_engine_job_script`: the run's slurm section's partition (its
  rollout_partition first), account, qos, time, constraint, setup lines; `--signal=B:USR1@<requeue_signal_seconds>`
  so the engines leave before the time limit; one task per node) handed to `sbatch --parsable`; the job id is
  recorded in `<run_dir>/engine_jobs/<job id>.json` (what `python -m hpc_rl.status` lists);
- what runs in it (`python -m hpc_rl.launch.engine_job RUN_DIR --engines-per-node K`): on each node, K engines
  started with the run's own engine command (`step_plan.engine_command`: the CPU engine on CPU, SGLang on GPU, each
  on its free port and its TP GPUs), each with an `EngineAgent` that registers it with the run's controller; on
  SIGTERM/USR1/SIGINT every agent leaves (the controller drains its engine), then the engines stop. The job ends
  when every agent ended (left, or no controller for rollout.rollout_cleanup_timeout).
The run's config comes from `<run_dir>/config.resolved.yaml` (what the trainer's job runs with), so the engines
serve the same checkpoint with the same options. Not here: the controller's side (controller.engine_membership).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpc_rl.config import RunConfig
from hpc_rl.config.sglang_options import engine_kind
from hpc_rl.engines import API_KEY_ENV
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_ENV, build_sglang_env, write_api_key_file
from hpc_rl.launch.engine_agent import AgentOutcome, EngineAgent
from hpc_rl.launch.sbatch_render import sbatch_line
from hpc_rl.launch.submit_args import SubmitOptions
from hpc_rl.launch.step_plan import asks_slurm_for_gpus, engine_command, sglang_api_key_path, step_python
from hpc_rl.launch.topology import EnginePlacement
from hpc_rl.process.child_process import free_port, http_ok, log_tail, start_process_group, stop_process_group
from hpc_rl.protocol.secret import engine_api_key, load_secret, secret_path

log = logging.getLogger("hpc_rl.engine_job")

ENGINE_JOBS_DIR = "engine_jobs"
"""In the run dir: one `<job id>.json` per engine job submitted for the run."""
LEAVE_SIGNAL = "USR1"
"""What Slurm sends the batch shell `requeue_signal_seconds` before the time limit (and an operator with
`scancel --signal=USR1 --batch`): the engines leave."""
HEALTH_WAIT_S = 600.0


# -- submitting ----------------------------------------------------------------------------------------------
def engines_per_node(config: RunConfig, rollout_num_gpus: int) -> tuple[int, int]:
    """(nodes, engines per node) for `rollout_num_gpus` GPUs of engines with the run's TP size
    (cluster.rollout_num_gpus_per_engine) and cluster.num_gpus_per_node GPUs per node."""
    tp = config.cluster.rollout_num_gpus_per_engine
    if rollout_num_gpus < tp or rollout_num_gpus % tp:
        raise ValueError(f"--rollout-num-gpus {rollout_num_gpus}: a multiple of the run's engine TP size "
                         f"(cluster.rollout_num_gpus_per_engine = {tp}) is needed")
    per_node_gpus = max(tp, config.cluster.num_gpus_per_node)
    per_node = max(1, per_node_gpus // tp)
    engines = rollout_num_gpus // tp
    nodes = math.ceil(engines / per_node)
    return nodes, min(per_node, engines)


def render_engine_job_script(config: RunConfig, run_dir: Path, *, rollout_num_gpus: int, python: str) -> str:
    """The engine job's sbatch script (pure: golden-tested)."""
    slurm = config.slurm
    nodes, per_node = engines_per_node(config, rollout_num_gpus)
    options: dict[str, str | int | bool] = {
        "job-name": f"{config.logging.run_name}-engines", "nodes": nodes, "ntasks-per-node": 1,
        "output": str(run_dir / "logs" / "engine-job-%j.log"), "open-mode": "append",
        "signal": f"B:{LEAVE_SIGNAL}@{slurm.requeue_signal_seconds}", "time": slurm.time}
    partition = slurm.rollout_partition or slurm.partition
    for key, value in (("partition", partition), ("account", slurm.account), ("qos", slurm.qos),
                       ("constraint", slurm.constraint), ("mem", slurm.mem)):
        if value:
            options[key] = value
    if asks_slurm_for_gpus(config):
        options["gpus-per-node"] = per_node * config.cluster.rollout_num_gpus_per_engine
    lines = ["#!/bin/bash", *(sbatch_line(k, v) for k, v in options.items()), *slurm.setup,
             f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {python} -m hpc_rl.launch.engine_job "
             f"{run_dir} --engines-per-node {per_node}"]
    return "\n".join(lines) + "\n"


def submit_engine_job(config: RunConfig, run_dir: Path, *, rollout_num_gpus: int) -> str:
    """sbatch the engine job for `run_dir`; returns its job id (recorded in `<run_dir>/engine_jobs/`)."""
    script = render_engine_job_script(config, run_dir, rollout_num_gpus=rollout_num_gpus,
                                      python=step_python(config))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["sbatch", "--parsable"], input=script, text=True, capture_output=True, timeout=60,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused the engine job: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    record_engine_job(run_dir, job_id, rollout_num_gpus=rollout_num_gpus)
    return job_id


def record_engine_job(run_dir: Path, job_id: str, **details: object) -> Path:
    path = run_dir / ENGINE_JOBS_DIR / f"{job_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"job_id": job_id, "submitted_at": time.time(), **details}) + "\n")
    return path


def recorded_engine_jobs(run_dir: Path) -> list[dict[str, object]]:
    """The engine jobs submitted for the run, oldest first."""
    jobs = []
    for path in sorted((run_dir / ENGINE_JOBS_DIR).glob("*.json")):
        try:
            jobs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(jobs, key=lambda job: float(job.get("submitted_at", 0)))  # type: ignore[arg-type]


def submit_engines_for(options: SubmitOptions) -> int:
    """`python -m hpc_rl.submit [CONFIG] --engines-for RUN_DIR [flags]`: the run's resolved config, then CONFIG and
    the flags on top (slurm options; --rollout-num-gpus sizes the job, default: the run's own); Slurm: sbatch the
    engine job; --executor local: run it here, in the foreground (Ctrl-C: the engines leave)."""
    from hpc_rl.config import ConfigError, load_config
    from hpc_rl.config.loading import RESOLVED_CONFIG_NAME

    run_dir = Path(str(options.engines_for)).resolve()
    resolved = run_dir / RESOLVED_CONFIG_NAME
    if not resolved.is_file() or not secret_path(run_dir).is_file():
        print(f"hpc_rl.submit: --engines-for {run_dir}: no {RESOLVED_CONFIG_NAME} and secret there; give the run "
              "directory of a run submitted with python -m hpc_rl.submit", file=sys.stderr)
        return 2
    try:
        config = load_config([str(resolved), *options.config_files], options.config_flags)
        gpus = config.cluster.rollout_num_gpus
        engines_per_node(config, gpus)
    except (ConfigError, ValueError) as error:
        print(f"hpc_rl.submit: --engines-for {run_dir}: {error}", file=sys.stderr)
        return 2
    executor = options.executor or ("slurm" if shutil.which("sbatch") else "local")
    if executor == "local":
        return main([str(run_dir), "--engines-per-node", str(gpus // config.cluster.rollout_num_gpus_per_engine)])
    try:
        job_id = submit_engine_job(config, run_dir, rollout_num_gpus=gpus)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"hpc_rl.submit: {error}", file=sys.stderr)
        return 1
    print(f"hpc_rl: engine job {job_id} submitted for {run_dir} ({gpus} GPU(s) of engines); "
          f"python -m hpc_rl.status {run_dir} lists it", flush=True)
    return 0


# -- in the job -------------------------------------------------------------------------------------------------
def _engine_env(config: RunConfig, key: str, log_path: Path) -> dict[str, str]:
    env = build_sglang_env(dict(os.environ), {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    env[API_KEY_ENV] = key
    if engine_kind(config.rollout.engine, config.cluster.device) == "sglang":
        env.update(SGLANG_ON_CPU_ENV if config.cluster.device == "cpu" else {})
        if not sglang_api_key_path(config).exists():
            write_api_key_file(sglang_api_key_path(config), key)
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    return env


def start_engine(config: RunConfig, run_dir: Path, *, position: int, host: str, key: str,
                 name: str) -> tuple[subprocess.Popen, str, Path]:
    """Start the engine at `position` on this node (its GPUs: position*TP ..); returns (process, url, log)."""
    tp = config.cluster.rollout_num_gpus_per_engine
    port = free_port(host)
    placement = EnginePlacement(engine_index=position, het_group=0, node_index=0,
                                gpu_ids=tuple(range(position * tp, (position + 1) * tp)), port=port,
                                weight_group_rank_offset=0)
    log_path = run_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = _engine_env(config, key, log_path)
    argv = engine_command(config, placement, host, port, base_gpu_id=position * tp, local=True)
    process = start_process_group(argv, env=env, log_path=log_path)
    return process, f"http://{host}:{port}", log_path


def wait_healthy(process: subprocess.Popen, url: str, key: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not http_ok(f"{url}/health", timeout=2.0, api_key=key):
        if process.poll() is not None:
            raise RuntimeError(f"the engine at {url} exited with code {process.poll()}; {log_path}:\n"
                               f"{log_tail(log_path, 20)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine at {url} did not answer /health in {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.2)


def run_engine_job(run_dir: Path, *, engines: int, host: str, job_id: str, poll_s: float = 1.0) -> list[AgentOutcome]:
    """Start `engines` engines here, register each through its agent, and stop them when their agents end."""
    from hpc_rl.config.loading import load_resolved_config

    config = load_resolved_config(run_dir)
    key = engine_api_key(load_secret(secret_path(run_dir)))
    node = os.environ.get("SLURMD_NODENAME") or host
    started: list[tuple[subprocess.Popen, str, Path, str]] = []
    agents: list[EngineAgent] = []

    def leave(signum: int, _frame: object) -> None:
        log.info("signal %s: the engines leave", signal.Signals(signum).name)
        for agent in agents:
            agent.stop_reason = f"engine job {job_id} got {signal.Signals(signum).name}"
            agent.stop.set()

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, leave)
    try:
        for position in range(engines):
            name = f"engine-job-{job_id}-{node}-{position}"
            process, url, log_path = start_engine(config, run_dir, position=position, host=host, key=key, name=name)
            started.append((process, url, log_path, name))
        for process, url, log_path, name in started:
            wait_healthy(process, url, key, log_path, HEALTH_WAIT_S)
            agents.append(EngineAgent(run_dir, url=url, tp_size=config.cluster.rollout_num_gpus_per_engine,
                                      job_id=job_id, name=name, poll_s=poll_s,
                                      cleanup_timeout_s=config.rollout.rollout_cleanup_timeout))
        outcomes: list[AgentOutcome] = [AgentOutcome(reason="not run")] * len(agents)

        def run_one(i: int) -> None:
            outcomes[i] = agents[i].run()

        threads = [threading.Thread(target=run_one, args=(i,), name=agents[i].name) for i in range(len(agents))]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # (signals reach the main thread between joins)
        for agent, outcome in zip(agents, outcomes):
            print(f"hpc_rl.engine_job: {agent.name}: {outcome.reason}; joins {outcome.joins}"
                  + (f"; left: {outcome.left.requeued} request(s) requeued in {outcome.left.drain_s:.3f} s"
                     if outcome.left else ""), flush=True)
        return outcomes
    finally:
        for process, _, _, _ in started:
            stop_process_group(process, 10.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_rl.launch.engine_job",
                                     description="Run this node's engines of an engine job (see the module docstring).")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--engines-per-node", type=int, default=1)
    parser.add_argument("--host", default=None, help="address the engines bind and the controller reaches them at "
                        "(default: this Slurm node's name, 127.0.0.1 outside Slurm)")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between the agents' checks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = args.host or os.environ.get("SLURMD_NODENAME") or "127.0.0.1"
    job_id = os.environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"
    run_engine_job(args.run_dir.resolve(), engines=args.engines_per_node, host=host, job_id=job_id, poll_s=args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
