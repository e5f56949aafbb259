"""The command line of `python -m hpc_rl.submit` (and of `hpc_rl.launch.prepare_run`, which takes the same).

Owns: splitting argv into config files, submit's own options (`--dry-run`, `--executor`, ...) and
config flags; the executor chosen without `--executor`; where a run's directory and checkpoints go
when the config does not say. Kept in launch so that `prepare_run` (for sbatch users) and `submit`
share it without importing each other. Not here: loading and validating the config (`hpc_rl.config`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc_rl.config import ConfigError, RunConfig

USAGE = """usage: python -m hpc_rl.submit [CONFIG.yaml ...] [options] [--flag value ...]

options:
  --dry-run            validate, print the resolved config and the job topology, submit nothing
  --no-check-files     skip only the file-existence checks (render a job away from the cluster's data)
  --executor E         slurm | local (default: slurm for a cuda config when `srun` is on PATH, else local)
  --wait               block until the job ends; exit with its status
  --run-dir DIR        where every artifact of the run goes (default: runs/<run_name>-<timestamp>)
  --engines-for DIR    submit a job of engines for the running run in DIR (its config, overridden by CONFIG
                       and flags; --rollout-num-gpus N sizes it): they join its controller, and leave at the
                       job's end (docs/engine-jobs.md)
  --config FILE        a YAML config file (also given as bare CONFIG.yaml arguments; optional)
  -h, --help           this text

Any other flag sets a config field with slime's name: --rollout-batch-size 32, --colocate,
--eval-prompt-data aime /path/aime.jsonl, --sglang-mem-fraction-static 0.7, --set section.key=value.
"""

EXIT_INVALID = 2


@dataclass
class SubmitOptions:
    """The submit command's own options (everything else is config)."""

    config_files: list[str] = field(default_factory=list)
    config_flags: list[str] = field(default_factory=list)
    dry_run: bool = False
    check_files: bool = True
    executor: str | None = None
    wait: bool = False
    engines_for: str | None = None
    """`--engines-for RUN_DIR`: an engine job for that run instead of a run (hpc_rl.launch.engine_job)."""


_VALUELESS_OPTIONS = ("--dry-run", "--no-check-files", "--wait")


def _is_config_file(token: str) -> bool:
    return not token.startswith("-")


def parse_submit_args(argv: list[str]) -> SubmitOptions:
    """Split argv into config files, the submit command's own options and config flags.

    A config file is any bare token at the start, after one of submit's valueless options
    (`--dry-run CONFIG` works), or after `--config`. Config files are optional: slime's flags alone
    are a complete config.
    """
    options = SubmitOptions()
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            from hpc_rl.config.help_text import submit_help

            print(submit_help(USAGE))
            raise SystemExit(0)
        if token == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config takes a YAML file")
            options.config_files.append(argv[i + 1])
            i += 2
            continue
        if _is_config_file(token) and (i == 0 or argv[i - 1] in _VALUELESS_OPTIONS
                                       or argv[i - 1] in options.config_files):
            options.config_files.append(token)
        elif token == "--dry-run":
            options.dry_run = True
        elif token == "--no-check-files":
            options.check_files = False
        elif token == "--wait":
            options.wait = True
        elif token == "--engines-for" or token.startswith("--engines-for="):
            value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in token else 1
            if not value:
                raise ConfigError("--engines-for takes the run directory of a running run")
            options.engines_for = value
        elif token == "--executor" or token.startswith("--executor="):
            value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in token else 1
            if value not in ("slurm", "local"):
                raise ConfigError(f"--executor: {value!r} must be slurm or local")
            options.executor = value
        else:
            options.config_flags.append(token)
        i += 1
    if not options.config_files and not options.config_flags and options.engines_for is None:
        raise ConfigError("no config given: a YAML file (e.g. python -m hpc_rl.submit configs/tiny_cpu.yaml), "
                          "slime's flags, or both")
    return options


def default_executor(config: RunConfig) -> str:
    """Without --executor: Slurm for a GPU config where `srun` exists, else this machine (a CPU config,
    such as the embedded default, runs locally even on a login node; `--executor slurm` sends it)."""
    return "slurm" if config.cluster.device == "cuda" and shutil.which("srun") else "local"


def assign_run_dir(config: RunConfig) -> RunConfig:
    if not config.run_dir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config.run_dir = str(Path("runs") / f"{config.logging.run_name}-{stamp}")
    config.run_dir = str(Path(config.run_dir).resolve())
    # As in slime recipes, the actor resumes from where it saves: a requeued or resubmitted job
    # continues from its latest checkpoint (an empty save dir means: start from ref_load/hf_checkpoint).
    if config.checkpoint.save is None:
        config.checkpoint.save = str(Path(config.run_dir) / "checkpoints")
    if config.checkpoint.load is None:
        config.checkpoint.load = config.checkpoint.save
    return config
