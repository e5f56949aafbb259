"""`python -m hpc_rl.submit CONFIG.yaml [...] [options] [slime flags...]`: validate, then run or submit.

Owns: the command line of the login node. Loads the config (defaults < YAML files < CLI flags),
validates all of it (exit code 2 with every problem listed), creates the run directory with
`config.resolved.yaml` and a 0600 secret, then hands over to the local executor (this machine) or
the Slurm executor (a heterogeneous job through submitit). `--dry-run` stops after printing the
resolved config and the job topology.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hpc_rl.config import ConfigError, RunConfig, load_config, write_resolved_config
from hpc_rl.config.typing_rules import ConfigErrors
from hpc_rl.config.loading import config_to_dict
from hpc_rl.config.validation import ValidationFailed, validate
from hpc_rl.launch.topology import plan_topology
from hpc_rl.protocol.secret import create_secret, secret_path

USAGE = """usage: python -m hpc_rl.submit [CONFIG.yaml ...] [options] [--flag value ...]

options:
  --dry-run            validate, print the resolved config and the job topology, submit nothing
  --no-check-files     skip only the file-existence checks (render a job away from the cluster's data)
  --executor E         slurm | local (default: slurm for a cuda config when `srun` is on PATH, else local)
  --wait               block until the job ends; exit with its status
  --run-dir DIR        where every artifact of the run goes (default: runs/<run_name>-<timestamp>)
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
        elif token == "--executor" or token.startswith("--executor="):
            value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in token else 1
            if value not in ("slurm", "local"):
                raise ConfigError(f"--executor: {value!r} must be slurm or local")
            options.executor = value
        else:
            options.config_flags.append(token)
        i += 1
    if not options.config_files and not options.config_flags:
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
        config = load_config(options.config_files, options.config_flags)
        validate(config, check_files=options.check_files)
        topology = plan_topology(config.cluster)
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
        if executor == "slurm":
            from hpc_rl.launch.slurm_submit import render_slurm_dry_run

            print(render_slurm_dry_run(assign_run_dir(config)))
        print("dry run: the config is valid; nothing was started or submitted.")
        return 0
    config = assign_run_dir(config)
    write_resolved_config(config, config.run_dir)
    create_secret(secret_path(config.run_dir), overwrite=True)
    if executor == "local":
        from hpc_rl.launch.local import run_local

        return run_local(config)
    from hpc_rl.launch.slurm_submit import submit_slurm

    return submit_slurm(config, wait=options.wait)


if __name__ == "__main__":
    raise SystemExit(main())
