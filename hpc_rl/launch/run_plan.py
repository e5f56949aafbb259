"""The run's plan in its run dir: `topology.json`, planned once at submit, read by the driver and the executors.

Owns: writing a `JobTopology` as JSON next to `config.resolved.yaml`, and reading it back validated (another
format version, a missing or unknown field, a value of the wrong type: a `TopologyFileError` naming the file
and the field); the fingerprint of the config sections the topology is planned from (`cluster` and
`rollout.rollout_external_engine_addrs`), so a topology.json that no longer matches its run dir's
config.resolved.yaml is refused, not used; and `load_run_plan`, the resolved config and its topology read
once for a whole driver process (all its attempts). Not here: the placement arithmetic (`topology`).

A run dir written by an hpc_rl from before topology.json (a job Slurm requeues across an upgrade, a driver
started by an older sbatch script) has none: it is planned from config.resolved.yaml once, the file is
written, and the plan's `notes` say so (the driver logs them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.config import RunConfig, load_resolved_config
from hpc_rl.config.loading import RESOLVED_CONFIG_NAME, config_to_dict
from hpc_rl.launch.topology import JobTopology, plan_run_topology

TOPOLOGY_FILE_NAME = "topology.json"
TOPOLOGY_FORMAT = 1
"""The version of topology.json's layout; a reader refuses any other."""


class TopologyFileError(ValueError):
    """topology.json cannot be used (the message names the file, the field and what to do)."""


@dataclass(frozen=True)
class RunPlan:
    """What every attempt of a run starts from: the resolved config and the topology planned at submit."""

    config: RunConfig
    topology: JobTopology
    notes: tuple[str, ...] = ()
    """Lines for the run's log (a topology planned here because an older hpc_rl wrote the run dir)."""


def planned_from(config: RunConfig) -> str:
    """A fingerprint of the config sections `plan_run_topology` reads."""
    inputs = {"cluster": config_to_dict(config)["cluster"],
              "rollout_external_engine_addrs": list(config.rollout.rollout_external_engine_addrs)}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def write_topology(run_dir: str | Path, config: RunConfig, topology: JobTopology) -> Path:
    """Write `<run_dir>/topology.json` (replacing one there); returns its path."""
    path = Path(run_dir) / TOPOLOGY_FILE_NAME
    document = {"format": TOPOLOGY_FORMAT, "planned_from": planned_from(config),
                "topology": dataclasses.asdict(topology)}
    temporary = path.with_name(f".{TOPOLOGY_FILE_NAME}.tmp")
    temporary.write_text(json.dumps(document, indent=1) + "\n")
    temporary.replace(path)
    return path


def read_topology(run_dir: str | Path, config: RunConfig) -> JobTopology:
    """The topology in `<run_dir>/topology.json`, checked field by field and against `config`'s sections."""
    path = Path(run_dir) / TOPOLOGY_FILE_NAME
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise TopologyFileError(f"{path}: cannot be read ({error.strerror or error}); submit again with the same "
                                "--run-dir to plan it again") from None
    except ValueError as error:
        raise TopologyFileError(f"{path}: not JSON ({error}); submit again with the same --run-dir to plan it "
                                "again") from None
    if not isinstance(document, dict) or document.get("format") != TOPOLOGY_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise TopologyFileError(f"{path}: format {found!r}, this hpc_rl reads format {TOPOLOGY_FORMAT}; submit again "
                                "with the same --run-dir (with this hpc_rl) to plan it again")
    if document.get("planned_from") != planned_from(config):
        raise TopologyFileError(
            f"{path} was planned from other `cluster` settings (or external engines) than "
            f"{Path(run_dir) / RESOLVED_CONFIG_NAME} holds now (was that file edited?): submit again with the same "
            f"--run-dir, which plans both again, or delete {path} to have the driver plan it from {RESOLVED_CONFIG_NAME}")
    return _typed(JobTopology, document.get("topology"), "topology", path)


def run_topology(run_dir: str | Path, config: RunConfig) -> tuple[JobTopology, str | None]:
    """The run dir's topology, and a note when it had none (an older hpc_rl wrote the run dir): then it is
    planned from `config` and written, once."""
    if (Path(run_dir) / TOPOLOGY_FILE_NAME).exists():
        return read_topology(run_dir, config), None
    topology = plan_run_topology(config)
    path = write_topology(run_dir, config, topology)
    return topology, (f"{path} was missing (this run dir was written by an hpc_rl from before the topology was "
                      f"planned at submit; a job requeued across an upgrade?): planned it from "
                      f"{RESOLVED_CONFIG_NAME} and wrote it")


def load_run_plan(run_dir: str | Path) -> RunPlan:
    """config.resolved.yaml and topology.json of `run_dir` (ConfigError / TopologyFileError when unusable)."""
    config = load_resolved_config(run_dir)
    topology, note = run_topology(run_dir, config)
    return RunPlan(config, topology, notes=(note,) if note else ())


def _typed(kind: Any, value: Any, where: str, path: Path) -> Any:
    """`value` (parsed JSON) as `kind` (a type hint of the topology's dataclasses), or TopologyFileError."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _typed(next(arg for arg in args if arg is not type(None)), value, where, path)
    if dataclasses.is_dataclass(kind):
        return _dataclass(kind, value, where, path)
    if origin is tuple:
        items = _expect(value, list, "a list", where, path)
        return tuple(_typed(args[0], item, f"{where}[{i}]", path) for i, item in enumerate(items))
    if origin is dict:
        entries = _expect(value, dict, "an object", where, path)
        return {_typed(args[0], key, f"{where} key", path): _typed(args[1], item, f"{where}.{key}", path)
                for key, item in entries.items()}
    if kind is bool:
        return _expect(value, bool, "true or false", where, path)
    if kind is int and isinstance(value, bool):
        raise TopologyFileError(f"{path}: {where} must be an integer, not {value!r}")
    return _expect(value, kind, {int: "an integer", str: "a string"}.get(kind, kind.__name__), where, path)


def _dataclass(kind: Any, value: Any, where: str, path: Path) -> Any:
    entries = _expect(value, dict, "an object", where, path)
    fields = {f.name: f for f in dataclasses.fields(kind)}
    if unknown := sorted(set(entries) - set(fields)):
        raise TopologyFileError(f"{path}: {where} has unknown field(s) {unknown} (written by another hpc_rl?); "
                                "submit again with the same --run-dir to plan it again")
    hints = typing.get_type_hints(kind)
    missing = [name for name, f in fields.items() if name not in entries
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise TopologyFileError(f"{path}: {where} lacks {missing}; submit again with the same --run-dir to plan it "
                                "again")
    return kind(**{name: _typed(hints[name], item, f"{where}.{name}", path) for name, item in entries.items()})


def _expect(value: Any, kind: type, wanted: str, where: str, path: Path) -> Any:
    if not isinstance(value, kind):
        raise TopologyFileError(f"{path}: {where} must be {wanted}, not {json.dumps(value)[:60]}")
    return value
