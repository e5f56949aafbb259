"""Trainer checkpoints in Megatron's torch_dist format, saved atomically, reshardable on load.

Owns the layout (Megatron's conventions, so Megatron/slime tools find their way around)::

    <save>/latest_checkpointed_iteration.txt      "5"  (written last, by rename: the commit point)
    <save>/iter_0000005/                           torch_dist: model + Megatron's optimizer state (sharded
                                                   tensors, reshardable); without it with save_optim off; with the
                                                   reference model under `ref_model.` when it is updated
    <save>/iter_0000005/hpc_rl_state.json          rollout_id, optimizer steps, controller state
    <save>/iter_0000005/rng/rank_00000.pt          per-rank RNG states: torch's, CUDA's, Megatron's RNG tracker's

Every rank writes into `iter_XXXXXXX.tmp/`; after a barrier rank 0 writes its manifest
(`checkpoint_manifest`: every file and its size), renames it and then replaces the tracker file, so a
crash at any point leaves the previous checkpoint loadable; a load takes the newest whole iteration
(`checkpoint_manifest.usable_directory`), not blindly the tracker's. A save that fails (a full
disk, a quota) raises `CheckpointSaveFailed` on the ranks that saw it, saying "no space left on <path>"
when that is the cause (torch reports a full disk as "unexpected pos 704 vs 598", or as a
CheckpointException that is not even an Exception), after rank 0 removed the partial files. The iteration number
is the rollout id. A directory without `hpc_rl_state.json` (what the HF converter writes) holds
weights only: loading it starts a fresh run. `iteration=` loads a given iteration of a root instead of the
tracker's (slime's --ref-ckpt-step). Does not own HF loading (`hpc_rl.weights.hf_import`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.training.checkpoint_files import STATE_FILE, TRACKER, iteration_dir, latest_iteration
from hpc_rl.training.checkpoint_manifest import usable_directory, write_manifest
from hpc_rl.training.optimizer import ActorOptimizer

LOW_SPACE_BYTES = 16 << 20
"""A failed save with less than this free on the checkpoint's file system is reported as a full disk."""
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded")


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be saved; its partial files are gone and the previous checkpoint is kept."""


def free_bytes(path: str | Path) -> int | None:
    """Bytes available to this user on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _committed_iteration(root: Path) -> int | None:
    """The tracker's iteration, None when there is no readable tracker (never raises: used on error paths)."""
    try:
        return latest_iteration(root)
    except (OSError, ValueError):
        return None


def _text(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - torch's CheckpointException.__str__ can itself fail
        return repr(error.args)[:300]


def _looks_like_full_disk(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNOS:
            return True
        if any(words in _text(current) for words in _DISK_FULL_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


def describe_save_failure(root: Path, iteration: int, error: BaseException) -> str:
    """What went wrong, in the user's terms: a full disk by name, and what is left to resume from."""
    free = free_bytes(root)
    previous = _committed_iteration(root)
    kept = (f"the previous checkpoint {iteration_dir(root, previous)} is kept and loadable" if previous is not None
            else "there is no earlier checkpoint")
    free_text = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    if _looks_like_full_disk(error) or (free is not None and free < LOW_SPACE_BYTES):
        return (f"no space left on {root} ({free_text}) while saving checkpoint {iteration_dir(root, iteration).name}; "
                f"its partial files were removed and {kept}. Free space there (or set checkpoint.save to a "
                "larger file system) and resume the run.")
    first_line = (_text(error).strip().splitlines() or [""])[0][:300]
    return (f"saving checkpoint {iteration_dir(root, iteration).name} in {root} failed ({type(error).__name__}: "
            f"{first_line}; {free_text}); its partial files were removed and {kept}")


def resolve_checkpoint_dir(path: str | Path, iteration: int | None = None) -> Path:
    """A torch_dist directory from a checkpoint root (via the tracker, or `iteration`), an iter dir, or a plain dir."""
    path = Path(path)
    if iteration is not None:
        directory = iteration_dir(path, iteration)
        if not directory.is_dir():
            raise FileNotFoundError(f"{path}: no iteration {iteration} ({directory.name}) to load")
        return directory
    directory = usable_directory(path)  # the newest whole iteration (checkpoint_manifest), not blindly the tracker's
    if directory is not None:
        return directory
    if (path / ".metadata").exists() or (path / "metadata.json").exists():
        return path
    raise FileNotFoundError(f"{path}: no {TRACKER} and not a torch_dist checkpoint directory")


@dataclass(kw_only=True)
class TrainerState:
    """The JSON part of a checkpoint."""

    rollout_id: int
    optimizer_steps: int = 0
    controller_state: dict[str, Any] = field(default_factory=dict)
    has_optimizer: bool = True
    """False: saved with checkpoint.save_optim off (the weights and position only)."""
    has_ref_model: bool = False
    """True: the reference model's weights are saved too (algorithm.ref_update_interval)."""


def _sharded(model: torch.nn.Module, optimizer: ActorOptimizer | None, *, is_loading: bool = False) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state(model_sd, is_loading=is_loading)
    return state


REF_PREFIX = "ref_model."


def _ref_sharded(ref_model: torch.nn.Module) -> dict[str, Any]:
    return ref_model.sharded_state_dict(prefix=REF_PREFIX)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def _save_atomically(root: Path, iteration: int, sharded: dict[str, Any],
                     write_extras: Callable[[Path], None] | None = None) -> Path:
    """Collective: torch_dist save into iter_X.tmp, then (rank 0) rename + tracker replace. A failure is
    a CheckpointSaveFailed (partial files removed by rank 0, the tracker still on the previous one)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        return _write_and_commit(root, iteration, sharded, write_extras)
    except (Exception, CheckpointException) as error:
        message = describe_save_failure(root, iteration, error)
        if dist.get_rank() == 0:
            final = iteration_dir(root, iteration)
            shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)
            (root / (TRACKER + ".tmp")).unlink(missing_ok=True)
            if _committed_iteration(root) != iteration:  # renamed but not committed: not a checkpoint
                shutil.rmtree(final, ignore_errors=True)
        raise CheckpointSaveFailed(message) from error


def _write_and_commit(root: Path, iteration: int, sharded: dict[str, Any],
                      write_extras: Callable[[Path], None] | None) -> Path:
    from megatron.core import dist_checkpointing

    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash during an earlier save
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded, str(tmp))
    if write_extras is not None:
        write_extras(tmp)
    dist.barrier()
    if rank == 0:
        write_manifest(tmp)  # every rank's files are written (the barrier): their sizes are the commit's record
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        tracker_tmp = root / (TRACKER + ".tmp")
        tracker_tmp.write_text(str(iteration))
        os.replace(tracker_tmp, root / TRACKER)
    dist.barrier()
    return final


def save_checkpoint(root: str | Path, model: torch.nn.Module, optimizer: ActorOptimizer,
                    state: TrainerState, *, save_optim: bool = True,
                    ref_model: torch.nn.Module | None = None) -> Path:
    """Collective: every trainer rank calls it. Returns the committed iteration directory. `save_optim`
    False leaves the optimizer state out; a `ref_model` is saved beside the actor (an updated reference)."""
    rank = dist.get_rank()
    state.optimizer_steps = optimizer.steps_done
    state.has_optimizer, state.has_ref_model = save_optim, ref_model is not None
    sharded = _sharded(_unwrap(model), optimizer if save_optim else None)
    if ref_model is not None:
        sharded["ref_model"] = _ref_sharded(ref_model)

    def extras(tmp: Path) -> None:
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            (tmp / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1, sort_keys=True))

    return _save_atomically(Path(root), state.rollout_id, sharded, extras)


def save_model_weights(root: str | Path, model: torch.nn.Module, iteration: int = 0) -> Path:
    """Collective: weights only (what the HF converter writes; loading it starts a fresh run)."""
    return _save_atomically(Path(root), iteration, _sharded(_unwrap(model), None))


def _load_model_state(model: torch.nn.Module, state: dict[str, Any], directory: Path) -> None:
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"{directory}: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_model_weights(path: str | Path, model: torch.nn.Module, iteration: int | None = None) -> Path:
    """Load model weights only (the reference model, or a converted checkpoint) at any TP size."""
    from megatron.core import dist_checkpointing

    directory = resolve_checkpoint_dir(path, iteration)
    inner = _unwrap(model)
    loaded = dist_checkpointing.load({"model": inner.sharded_state_dict()}, str(directory))
    _load_model_state(inner, loaded["model"], directory)
    return directory


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: ActorOptimizer) -> TrainerState | None:
    """Resume: weights, optimizer state and trainer state (RNG: `restore_rng_state`). Weights-only dirs return None;
    without optimizer state the loaded weights become the optimizer's fp32 main copies (`reload_model_params`)."""
    from megatron.core import dist_checkpointing

    directory = resolve_checkpoint_dir(path)
    state_file = directory / STATE_FILE
    if not state_file.is_file():
        load_model_weights(directory, model)
        optimizer.reload_model_params()
        return None
    state = TrainerState(**json.loads(state_file.read_text()))
    inner = _unwrap(model)
    loaded = dist_checkpointing.load(_sharded(inner, optimizer if state.has_optimizer else None, is_loading=True),
                                     str(directory))
    _load_model_state(inner, loaded["model"], directory)
    if state.has_optimizer:
        optimizer.restore(loaded["optimizer"], state.optimizer_steps)
    else:
        optimizer.restore_steps(state.optimizer_steps)  # fresh moments, the schedule where it was
    return state


def load_ref_model(path: str | Path, ref_model: torch.nn.Module) -> Path:
    """The reference model a checkpoint saved beside the actor (`TrainerState.has_ref_model`)."""
    from megatron.core import dist_checkpointing

    directory = resolve_checkpoint_dir(path)
    loaded = dist_checkpointing.load({"ref_model": _ref_sharded(ref_model)}, str(directory))
    state = {key.removeprefix(REF_PREFIX): value for key, value in loaded["ref_model"].items()}
    _load_model_state(ref_model, state, directory)
    return directory


def rng_state() -> dict[str, Any]:
    """This rank's random state: torch's CPU generator, CUDA's (when there is a GPU) and Megatron's tensor-parallel
    RNG tracker's named states (the forked streams its dropout and init draw from; none on CPU, where the tracker is
    the inference one)."""
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    state["tracker"] = {name: value for name, value in tracker.items() if isinstance(value, torch.Tensor)}
    return state


def restore_rng_state(path: str | Path) -> None:
    """Set this rank's RNGs (`rng_state`) to the saved ones; call it after every model is built (init draws)."""
    from megatron.core import tensor_parallel

    rng_file = resolve_checkpoint_dir(path) / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if not rng_file.is_file():
        return
    state = torch.load(rng_file)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
