"""`python -m hpc_rl.submit CONFIG.yaml [...] [options] [slime flags...]`: validate, then run or submit.

Owns: the command of the login node (its argv is split by `launch.submit_args`). Loads the config (defaults < YAML files < CLI flags),
validates all of it (exit code 2 with every problem listed), plans the job's topology (once: the driver
and the executors read it back), creates the run directory with `config.resolved.yaml`, `topology.json` and
a 0600 secret, then hands over to the local executor (this machine) or
the Slurm executor (a heterogeneous job through submitit). `--dry-run` stops after printing the
resolved config, the job topology, the trainer's parallel layout and the per-GPU memory plan.
"""

from __future__ import annotations

import logging
import shlex
import sys

import yaml

from hpc_rl.config import ConfigError, load_config, write_resolved_config
from hpc_rl.config.typing_rules import ConfigErrors
from hpc_rl.config.loading import config_to_dict
from hpc_rl.config.memory_plan import plan_summary
from hpc_rl.config.model_checks import run_architecture
from hpc_rl.config.validation import ValidationFailed, validate
from hpc_rl.launch.submit_args import EXIT_INVALID, assign_run_dir, default_executor, parse_submit_args
from hpc_rl.launch.run_plan import write_topology
from hpc_rl.launch.topology import plan_run_topology
from hpc_rl.protocol.secret import keep_or_create_secret, secret_path

__all__ = ["EXIT_INVALID", "main"]


class _StderrNotes(logging.Handler):
    """Prints the config loader's notes (e.g. a slime plug-in path mapped to hpc_rl's) on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"hpc_rl.submit: {record.getMessage()}", file=sys.stderr)


def _show_config_notes() -> None:
    notes = logging.getLogger("hpc_rl.config")
    if not any(isinstance(h, _StderrNotes) for h in notes.handlers):
        notes.addHandler(_StderrNotes())
        notes.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _show_config_notes()
    try:
        options = parse_submit_args(argv)
        if options.engines_for is not None:
            from hpc_rl.launch.engine_job import submit_engines_for

            return submit_engines_for(options)
        config = load_config(options.config_files, options.config_flags)
        validate(config, check_files=options.check_files)
        topology = plan_run_topology(config)
    except ConfigErrors as errors:
        print(f"hpc_rl.submit: the config has {len(errors.messages)} problem(s); nothing was submitted:", file=sys.stderr)
        print("\n".join(f"  - {m}" for m in errors.messages), file=sys.stderr)
        return EXIT_INVALID
    except ValidationFailed as failure:
        print(f"hpc_rl.submit: the config has {len(failure.problems)} problem(s); nothing was submitted:",
              file=sys.stderr)
        print(str(failure), file=sys.stderr)
        return EXIT_INVALID
    except (ConfigError, ValueError) as error:
        print(f"hpc_rl.submit: {error}", file=sys.stderr)
        return EXIT_INVALID
    executor = options.executor or default_executor(config)
    if options.dry_run:
        print("# resolved config")
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False), end="")
        print(f"# executor: {executor}")
        print(topology.describe())
        print(plan_summary(config, run_architecture(config)))
        if executor == "slurm":
            from hpc_rl.launch.slurm_submit import render_slurm_dry_run

            print(render_slurm_dry_run(assign_run_dir(config)))
        print("dry run: the config is valid; nothing was started or submitted.")
        return 0
    config = assign_run_dir(config)
    from hpc_rl.launch.run_attempts import check_resume, finished_already, keep_previous_config
    from hpc_rl.launch.run_lock import RunDirLocked, acquire

    try:  # before anything is written: a live run's secret and config stay as they are
        lock = acquire(config.run_dir, role="submit")
    except RunDirLocked as busy:
        print(f"hpc_rl.submit: {busy}; nothing was started", file=sys.stderr)
        return EXIT_INVALID
    try:
        if lock.taken_over is not None and lock.taken_over[0].pid != lock.holder.pid:
            print(f"hpc_rl.submit: taking over {config.run_dir} from a run that is gone "
                  f"({lock.taken_over[0].describe()}; {lock.taken_over[1]})", file=sys.stderr)
        _, refusal = check_resume(config, "python -m hpc_rl.submit " + shlex.join(argv))
        if refusal is not None:  # checkpoints, none whole: never a silent start from rollout 0
            print(f"hpc_rl.submit: {refusal}", file=sys.stderr, flush=True)
            return EXIT_INVALID
        done = finished_already(config)
        if done is not None:
            print(f"hpc_rl: {done}", flush=True)
            return 0
        changes = keep_previous_config(config.run_dir, config)
        if changes:
            print(f"hpc_rl.submit: {changes}", file=sys.stderr, flush=True)
        write_resolved_config(config, config.run_dir)
        write_topology(config.run_dir, config, topology)
        keep_or_create_secret(secret_path(config.run_dir))  # a resubmit keeps it: engine jobs hold its key
        if executor == "local":
            from hpc_rl.launch.local import run_local

            return run_local(config)
        from hpc_rl.launch.slurm_submit import submit_slurm

        return submit_slurm(config, wait=options.wait, lock=lock)
    finally:
        lock.release()  # no-op once the driver (same process) or the queued job holds it


if __name__ == "__main__":
    raise SystemExit(main())
