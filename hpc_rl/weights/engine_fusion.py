"""HF tensors a weight sync sends fused because the engine reads them only so, through the family's hook.

Owns applying a model family's `fuse_for_engine` hook (`hpc_rl.models.registry.EngineFusion`; gpt-oss: each
layer's experts, `hpc_rl.models.gpt_oss.engine_sync`) to the two sides of a sync (broadcast `sender`, colocated
`colocated_sender`):

  planning  `group_plan_entries`: the plan's entries (one per Megatron parameter, with its mapped HF names and
            shapes) whose HF names fall in one group become a single entry (all the group's Megatron parameters,
            the fused names and shapes): `sender._plan` never splits an entry, so a group is always in one bucket.
  sending   `fuse_named`: a bucket's gathered HF tensors with each group's replaced by its fused tensors (one
            group, i.e. one layer's experts, alive twice at a time: the hook frees nothing itself; the caller drops
            the per-expert list).

A family without the hook (every other one) passes through unchanged. The disk transport and --save-hf write
fused tensors their own way (`hpc_rl.training.hf_save`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.registry import EngineFusion, family

PlanEntry = tuple[list[str], list[tuple[str, tuple[int, ...]]]]
"""(the Megatron parameters, the HF (name, shape)s the sync sends for them)."""


def fusion_of(arch: ModelArchitecture) -> EngineFusion | None:
    """The family's `fuse_for_engine` hook (None: the sync sends every HF tensor as mapped)."""
    return family(arch.family).fuse_for_engine


def group_plan_entries(entries: Sequence[tuple[str, Sequence[tuple[str, Sequence[int]]]]],
                       fusion: EngineFusion | None) -> list[PlanEntry]:
    """`entries` (Megatron name, its HF (name, shape)s) in name-map order, each group of the hook merged into one
    entry with the fused names and shapes. A group's parameters must be adjacent (ValueError otherwise: a name
    map that interleaves two layers' experts cannot be fused one layer at a time)."""
    out: list[PlanEntry] = []
    if fusion is None:
        return [([name], [(hf, tuple(shape)) for hf, shape in hf_entries]) for name, hf_entries in entries]
    done: set[str] = set()
    current: str | None = None
    sources: list[str] = []
    members: list[tuple[str, Sequence[int]]] = []

    def close() -> None:
        nonlocal current
        if current is not None:
            out.append((list(sources), fusion.fused_shapes(current, members)))
            done.add(current)
        current = None
        sources.clear()
        members.clear()

    for name, hf_entries in entries:
        groups = {fusion.group_of(hf) for hf, _ in hf_entries}
        if len(groups) > 1:
            raise ValueError(f"{name}: its HF tensors fall in different fusion groups {sorted(map(str, groups))}")
        group = groups.pop() if groups else None
        if group != current:
            close()
        if group is None:
            out.append(([name], [(hf, tuple(shape)) for hf, shape in hf_entries]))
            continue
        if group in done:
            raise ValueError(f"{name}: fusion group {group} is not adjacent in the name map (its parameters must "
                             f"follow each other to be gathered and fused together)")
        current = group
        sources.append(name)
        members.extend(hf_entries)
    close()
    return out


def fuse_named(named: list[tuple[str, Any]], fusion: EngineFusion | None) -> list[tuple[str, Any]]:
    """A bucket's HF tensors with each fusion group's replaced by its fused tensors (at the group's first place)."""
    if fusion is None:
        return named
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in named:
        group = fusion.group_of(name)
        if group is not None:
            groups.setdefault(group, []).append((name, tensor))
    if not groups:
        return named
    out: list[tuple[str, Any]] = []
    for name, tensor in named:
        group = fusion.group_of(name)
        if group is None:
            out.append((name, tensor))
        elif group in groups:
            out.extend(fusion.fuse(group, groups.pop(group)))
    return out
