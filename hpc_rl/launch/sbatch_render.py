"""What Slurm is asked for: per-component sbatch options and the exact het-job batch script.

Owns the pure translation of (`SlurmConfig`, `JobTopology`) into Slurm options: one option set per
het component (nodes, ntasks-per-node, gpus-per-node, cpus-per-task, partition, account, qos, time,
constraint, mem, extra lines), the parameters handed to submitit's Slurm executor, and the batch
script text. submitit 1.5.4 has no het jobs (notes/slurm.md), so its own parameters describe
component 0 and the `#SBATCH hetjob` separator with the other components' options go first in its
`setup` lines (sbatch keeps reading `#SBATCH` lines through comments). The script text comes from
submitit's own renderer, so `--dry-run` prints byte for byte what is submitted. No processes here.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from hpc_rl.config.schema import RunConfig
from hpc_rl.launch.step_plan import asks_slurm_for_gpus
from hpc_rl.launch.topology import HetGroup, JobTopology

SUBMITIT_DIR_NAME = "submitit"
PREEMPT_SIGNAL = "USR2"

OptionValue = str | int | bool


@dataclass(frozen=True, kw_only=True)
class ComponentOptions:
    """The sbatch options of one het component, in the order they are rendered."""

    het_group: int
    role: str
    options: dict[str, OptionValue]


def time_to_minutes(value: str | int) -> int:
    """Slurm time ('MM', 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM', 'D-HH:MM:SS') -> whole minutes (rounded up)."""
    text = str(value).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ValueError(f"slurm.time: {value!r} is not a Slurm time (e.g. 30, 04:00:00, 1-12:00:00)")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        total = int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    elif third is not None:  # HH:MM:SS
        total = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:  # MM:SS
        total = int(first) * 60 + int(second)
    else:  # MM
        total = int(first) * 60
    return max(1, math.ceil(total / 60))


def parse_extra_sbatch(lines: list[str]) -> dict[str, OptionValue]:
    """['--exclusive', '--reservation=rl', '--mail-type END'] -> {'exclusive': True, 'reservation': 'rl', ...}."""
    parsed: dict[str, OptionValue] = {}
    for raw in lines:
        line = raw.strip()
        if line.startswith("#SBATCH"):
            line = line[len("#SBATCH"):].strip()
        if not line.startswith("--"):
            raise ValueError(f"slurm.extra_sbatch: {raw!r} must be a long option such as '--reservation=rl'")
        key, sep, value = line[2:].partition("=")
        if not sep:
            key, _, value = line[2:].partition(" ")
        key, value = key.strip(), value.strip()
        parsed[key] = value if value else True
    return parsed


def _rollout_tasks_per_node(topology: JobTopology, group: HetGroup) -> int:
    """Tasks a rollout node needs: the most engines placed on any one of its nodes."""
    per_node: dict[int, int] = {}
    for engine in topology.engines:
        if engine.het_group == group.index:
            per_node[engine.node_index] = per_node.get(engine.node_index, 0) + 1
    return max(per_node.values(), default=1)


def component_cpus_per_task(config: RunConfig, group: HetGroup) -> int | None:
    """--cpus-per-task of one component: slurm.cpus_per_task if set; on GPU runs cpus_per_gpu per GPU
    of a task (a trainer rank has one, an engine rollout_num_gpus_per_engine); None (Slurm's 1) on CPU
    runs. The srun steps of that component should pass the same value (srun does not always inherit it)."""
    slurm, cluster = config.slurm, config.cluster
    if slurm.cpus_per_task:
        return slurm.cpus_per_task
    if cluster.device != "cuda":
        return None
    gpus_per_task = {"rollout": min(cluster.rollout_num_gpus_per_engine, group.gpus_per_node),
                     "teacher": cluster.opd_teacher_num_gpus}.get(group.role, 1)
    return slurm.cpus_per_gpu * gpus_per_task


def engine_cpus_per_task(config: RunConfig, topology: JobTopology) -> int | None:
    """--cpus-per-task of an engine's srun step (pinned with --exact, so it gets only what it asks for):
    the CPUs its component gives each task."""
    group = next((g for g in topology.groups if g.role == "rollout"), topology.groups[0])
    return component_cpus_per_task(config, group)


def component_options(config: RunConfig, topology: JobTopology) -> list[ComponentOptions]:
    """One option set per het component (group 0 = trainer [+ colocated engines], 1 = rollout)."""
    slurm = config.slurm
    use_gpus = asks_slurm_for_gpus(config)
    components = []
    for group in topology.groups:
        options: dict[str, OptionValue] = {}
        partition = slurm.partition
        if group.role == "rollout" and slurm.rollout_partition:
            partition = slurm.rollout_partition
        if partition:
            options["partition"] = partition
        options["nodes"] = group.num_nodes
        tasks = _rollout_tasks_per_node(topology, group) if group.role == "rollout" else group.tasks_per_node
        options["ntasks-per-node"] = max(1, tasks)
        cpus = component_cpus_per_task(config, group)
        if cpus:
            options["cpus-per-task"] = cpus
        if use_gpus and group.gpus_per_node:
            options["gpus-per-node"] = group.gpus_per_node
        if slurm.mem:
            options["mem"] = slurm.mem
        options["time"] = time_to_minutes(slurm.time)
        for key in ("account", "qos", "constraint"):
            value = getattr(slurm, key)
            if value:
                options[key] = value
        options.update(parse_extra_sbatch(slurm.extra_sbatch))
        components.append(ComponentOptions(het_group=group.index, role=group.role, options=options))
    return components


def sbatch_line(key: str, value: OptionValue) -> str:
    """The `#SBATCH` line of one option (the same spelling as submitit's)."""
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(str(value))}"


def het_setup_lines(config: RunConfig, components: list[ComponentOptions]) -> list[str]:
    """Lines submitit puts after component 0's options: the other components, then the env setup."""
    lines: list[str] = []
    for component in components[1:]:
        lines.append("#SBATCH hetjob")
        lines.append(f"# het component {component.het_group}: {component.role}")
        lines.extend(sbatch_line(key, value) for key, value in component.options.items())
    lines.append("# environment setup (slurm.setup in the config)")
    lines.extend(config.slurm.setup)
    lines.append("export PYTHONUNBUFFERED=1")
    return lines


def submitit_folder(run_dir: str | Path) -> Path:
    """Where submitit keeps its pickles, batch script copies and the driver's logs: inside the run dir."""
    return Path(run_dir) / SUBMITIT_DIR_NAME


def submitit_parameters(config: RunConfig, topology: JobTopology) -> dict[str, Any]:
    """Parameters for submitit's `SlurmExecutor.update_parameters` describing the whole het job.

    Fix 1 of notes/slurm.md: submitit is told `nodes=1` (else `result()` waits for one result file per
    node); the real node count, like every other component-0 option, goes through
    `additional_parameters`. Fix 3: the preemption/timeout signal goes to the batch shell (`B:`), which
    `exec`s the driver's Python, so the driver itself receives USR2.
    """
    components = component_options(config, topology)
    first = dict(components[0].options)
    minutes = int(first.pop("time"))
    additional: dict[str, OptionValue] = dict(first)
    additional["signal"] = f"B:{PREEMPT_SIGNAL}@{config.slurm.requeue_signal_seconds}"
    return {
        "job_name": config.logging.run_name,
        "time": minutes,
        "nodes": 1,
        "use_srun": False,
        "setup": het_setup_lines(config, components),
        "additional_parameters": additional,
    }


def render_batch_script(config: RunConfig, topology: JobTopology, *, folder: str | Path, python: str) -> str:
    """The batch script submitit writes for this run (`python` is the `exec <python>` prefix)."""
    parameters = submitit_parameters(config, topology)
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return submitit_sbatch_text(command=command, folder=folder, parameters=parameters)


SUBMITIT_RENDERER_VERSIONS = ("1.5.",)
"""submitit releases whose private sbatch renderer hpc_rl has checked (golden tests)."""


def submitit_sbatch_text(*, command: str, folder: str | Path, parameters: dict[str, Any]) -> str:
    """submitit's own sbatch text, so `--dry-run` prints what is submitted. submitit has no public
    renderer (its executor writes the file itself), so this is the one place that calls the private
    `submitit.slurm.slurm._make_sbatch_string`, and only on the versions checked."""
    version = submitit.__version__
    if not version.startswith(SUBMITIT_RENDERER_VERSIONS):
        raise RuntimeError(f"submitit {version} is not one hpc_rl renders sbatch scripts with "
                           f"({', '.join(v + '*' for v in SUBMITIT_RENDERER_VERSIONS)}): install one of those "
                           "(pip install 'submitit>=1.5,<1.6'), or check its _make_sbatch_string and add it")
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=command, folder=folder, **parameters)


STANDALONE_TEMPLATE = """\
#!/bin/bash
# {run_name}: one heterogeneous Slurm job running hpc_rl's driver, for users who prefer `sbatch`.
# (`python -m hpc_rl.submit {config_path}` submits the same job through submitit.)
#
#   sbatch {script_path}        # from the repository root (the job's working directory)
#
# Rendered from {config_path} by `python -m hpc_rl.launch.sbatch_render {config_path}`. What to edit:
#   - the #SBATCH lines: partition/account/qos/time/constraint per component (or slurm.* in the config,
#     then re-render); component 0 is the {first_role} ({first_nodes} node(s)){second_note};
#   - SETUP below: module loads, a virtualenv, container variables;
#   - CONFIG / FLAGS: the recipe and any slime-style flag (e.g. FLAGS="--rollout-batch-size 64");
#   - RUN_DIR: on a filesystem every node sees. After a requeue (same job id) the run resumes from it.
{component_lines}

# ---- SETUP (slurm.setup in the config) ----
{setup_lines}export PYTHONUNBUFFERED=1

CONFIG=${{HPC_RL_CONFIG:-{config_path}}}
FLAGS=${{HPC_RL_FLAGS:-}}
RUN_DIR=${{HPC_RL_RUN_DIR:-runs/{run_name}-$SLURM_JOB_ID}}
MAX_REQUEUES={max_num_timeout}
EXIT_REQUEUE=3  # the driver saved (controller + trainer) after USR2 and wants to run again

# Validate and write $RUN_DIR/config.resolved.yaml + secret (kept as is when resuming).
python -m hpc_rl.launch.prepare_run "$CONFIG" $FLAGS --run-dir "$RUN_DIR" || exit 2

# The driver runs the controller + router here and starts the srun steps of both components.
python -m hpc_rl.launch.driver --run-dir "$RUN_DIR" --launcher srun &
driver=$!
# --signal=B:USR2 reaches this shell: pass it on so the driver checkpoints before the time limit.
trap 'kill -USR2 "$driver" 2>/dev/null' USR2
while :; do
  wait "$driver"; code=$?
  kill -0 "$driver" 2>/dev/null || break  # wait was only interrupted by the trap
done
if [ "$code" = "$EXIT_REQUEUE" ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt "$MAX_REQUEUES" ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""


def render_standalone_script(config: RunConfig, topology: JobTopology, *, config_path: str, script_path: str) -> str:
    """The hand-editable `slurm/<recipe>.sbatch`: prepare_run + the driver with the srun launcher."""
    components = component_options(config, topology)
    lines = [f"#SBATCH --job-name={shlex.quote(config.logging.run_name)}",
             "#SBATCH --output=%x-%j.out",
             "#SBATCH --open-mode=append",
             f"#SBATCH --signal=B:{PREEMPT_SIGNAL}@{config.slurm.requeue_signal_seconds}",
             "#SBATCH --requeue"]
    for index, component in enumerate(components):
        if index:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het component {component.het_group}: {component.role}")
        lines.extend(sbatch_line(key, value) for key, value in component.options.items())
    second = ""
    if len(components) > 1:
        second = f", component 1 the {components[1].role} ({components[1].options['nodes']} node(s))"
    return STANDALONE_TEMPLATE.format(
        run_name=config.logging.run_name, config_path=config_path, script_path=script_path,
        first_role=components[0].role, first_nodes=components[0].options["nodes"], second_note=second,
        component_lines="\n".join(lines),
        setup_lines="".join(f"{line}\n" for line in config.slurm.setup) or "# module load cuda/12.4\n",
        max_num_timeout=config.slurm.max_num_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m hpc_rl.launch.sbatch_render CONFIG.yaml [flags]`: print the standalone sbatch script."""
    import sys

    from hpc_rl.config import load_config
    from hpc_rl.launch.topology import plan_run_topology

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m hpc_rl.launch.sbatch_render CONFIG.yaml [--flag value ...] > slurm/NAME.sbatch")
        return 0 if args else 2
    config = load_config([args[0]], args[1:])
    script_path = f"slurm/{Path(args[0]).stem}.sbatch"
    print(render_standalone_script(config, plan_run_topology(config), config_path=args[0],
                                   script_path=script_path), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
