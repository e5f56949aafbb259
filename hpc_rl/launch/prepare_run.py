"""`python -m hpc_rl.launch.prepare_run CONFIG.yaml [flags] --run-dir DIR`: the run dir for `sbatch` users.

Owns what `slurm/*.sbatch` does before starting the driver: load + validate the config exactly as
`hpc_rl.submit` does, write `<run_dir>/config.resolved.yaml`, its `topology.json` and the 0600 secret. A run dir that
already holds a resolved config is left as it is (a requeued job resumes), so this is idempotent; one that
a live run holds (`run_lock`) is refused before anything is written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpc_rl.config import ConfigError, RunConfig, load_config, write_resolved_config
from hpc_rl.config.loading import RESOLVED_CONFIG_NAME
from hpc_rl.config.validation import ValidationFailed, validate
from hpc_rl.launch.run_lock import RunDirLocked, acquire
from hpc_rl.launch.submit_args import EXIT_INVALID, assign_run_dir, parse_submit_args
from hpc_rl.launch.run_plan import write_topology
from hpc_rl.launch.topology import plan_run_topology
from hpc_rl.protocol.secret import create_secret, secret_path


def prepare_run(argv: list[str]) -> Path:
    """Validate and write the run dir; returns it. Raises ConfigError / ValidationFailed / ValueError."""
    options = parse_submit_args(argv)
    config = load_config(options.config_files, options.config_flags)
    if not config.run_dir:
        raise ConfigError("--run-dir is required (a directory every node of the job can read)")
    run_dir = Path(config.run_dir).resolve()
    job_id = os.environ.get("SLURM_JOB_ID") or None
    lock = acquire(run_dir, role="prepare_run", job_id=job_id)  # RunDirLocked: a live run holds it
    try:
        _prepare(run_dir, config, options.check_files)
    finally:
        if job_id:
            lock.hand_to_job(job_id)  # this job's driver takes it over
        lock.release()
    return run_dir


def _prepare(run_dir: Path, config: RunConfig, check_files: bool) -> None:
    if (run_dir / RESOLVED_CONFIG_NAME).exists():
        print(f"hpc_rl.prepare_run: resuming {run_dir} (its config.resolved.yaml is kept)", file=sys.stderr)
    else:
        validate(config, check_files=check_files)
        topology = plan_run_topology(config)
        config = assign_run_dir(config)
        write_resolved_config(config, config.run_dir)
        write_topology(config.run_dir, config, topology)
    if not secret_path(run_dir).exists():
        create_secret(secret_path(run_dir))


def main(argv: list[str] | None = None) -> int:
    try:
        run_dir = prepare_run(list(sys.argv[1:] if argv is None else argv))
    except ValidationFailed as failure:
        print(f"hpc_rl.prepare_run: the config has {len(failure.problems)} problem(s):\n{failure}", file=sys.stderr)
        return EXIT_INVALID
    except (ConfigError, ValueError, RunDirLocked) as error:
        print(f"hpc_rl.prepare_run: {error}", file=sys.stderr)
        return EXIT_INVALID
    print(run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
