"""One thing wrong with a run's config, as validation reports it: where (a field or file:line), what, what to do.

Owns: the `Problem` type every rule module of `hpc_rl.config` returns (`validation` collects them and raises
`ValidationFailed` with all of them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the config: where, what, and what to do."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"
