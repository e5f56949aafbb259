"""The CPU engine's memory tags (`/release_memory_occupation`, `/resume_memory_occupation`), as SGLang.

Owns: which tags are released, and what releasing `weights` does to the model. SGLang 0.5.23
(scheduler_components/weight_updater.py): with `--enable-memory-saver`, releasing `weights` stashes
the model's static state (buffers), then hands the parameters' GPU memory back to the driver
(torch_memory_saver pause); resuming re-maps memory with undefined contents and restores the stashed
buffers. The parameters hold garbage until a weight update fills them. Without the memory saver
nothing is freed and the weights survive.

The twin: with `memory_saver`, release fills every parameter with NaN (buffers are kept, as SGLang's
stash keeps them), and generation is refused with a clear error while any parameter still holds NaN
after a resume (SGLang would serve garbage; a refusal makes the mistake visible in a test). Releasing
a released tag, resuming a tag that is not released, and releasing while requests run are refused:
SGLang crashes on them.

`--enable-weights-cpu-backup` (SGLang's; miles turns it on for colocated LoRA, --lora-base-cpu-backup): the
memory saver copies the weights to host memory on release and back on resume, so they survive without a reload.
The twin keeps a copy of every parameter on release and restores it on resume.
"""

from __future__ import annotations

import torch

ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryTagError(RuntimeError):
    """A release/resume call SGLang would crash on."""


class WeightsNotLoaded(RuntimeError):
    """Generation asked for while the weights are discarded (released, resumed, not reloaded)."""


class MemoryOccupation:
    """Released tags of one engine and the state of its weights (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, memory_saver: bool, weights_cpu_backup: bool = False) -> None:
        self.model = model
        self.memory_saver = memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self._backup: list[torch.Tensor] | None = None
        """The parameters' values at the last release of `weights` (weights_cpu_backup)."""
        self.released_tags: set[str] = set()
        self._check_reload = False
        """Set by a resume of discarded weights: generation checks they were all reloaded first."""

    def release(self, tags: list[str], *, requests_running: bool) -> None:
        unknown = sorted(set(tags) - set(ALL_MEMORY_TAGS))
        if unknown:
            raise MemoryTagError(f"unknown memory tags {unknown}: use {list(ALL_MEMORY_TAGS)}")
        if requests_running:
            raise MemoryTagError("release_memory_occupation while requests are running (SGLang crashes here): "
                                 "call /pause_generation first")
        already = sorted(set(tags) & self.released_tags)
        if already:
            raise MemoryTagError(f"memory tags {already} are already released")
        if "weights" in tags and self.memory_saver:
            if self.weights_cpu_backup:
                with torch.no_grad():
                    self._backup = [p.detach().clone() for p in self.model.parameters()]
            self._discard_parameters()
        self.released_tags |= set(tags)

    def resume(self, tags: list[str]) -> None:
        missing = sorted(set(tags) - self.released_tags)
        if missing:
            raise MemoryTagError(
                f"resume_memory_occupation of tags {missing} that were not released (SGLang crashes here)")
        self.released_tags -= set(tags)
        if "weights" in tags and self.memory_saver and self._backup is not None:
            with torch.no_grad():
                for parameter, saved in zip(self.model.parameters(), self._backup):
                    parameter.copy_(saved)
            self._backup = None
        elif "weights" in tags and self.memory_saver:
            self._check_reload = True

    def generation_refusal(self) -> str | None:
        """Why generation must not run now (None: it may). Only after a resume of discarded weights does
        this look at the parameters, until every one of them was reloaded."""
        if not self._check_reload:
            return None
        stale = self.discarded_parameters()
        if not stale:
            self._check_reload = False
            return None
        return (f"the weights were released with the memory saver and resumed without a reload: {len(stale)} "
                f"parameter(s) hold no data (first: {stale[0]}); update the weights "
                "(/update_weights_from_tensor or /update_weights_from_distributed) before generating")

    def discarded_parameters(self) -> list[str]:
        with torch.no_grad():
            return [name for name, p in self.model.named_parameters() if torch.isnan(p).any()]

    @torch.no_grad()
    def _discard_parameters(self) -> None:
        for parameter in self.model.parameters():
            parameter.fill_(float("nan"))
