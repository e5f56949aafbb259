"""Prompt loading speed: a 100k-line JSONL in slime's format (rows like dapo-math-17k's).

Prints seconds per 10k lines for loading + validating every row, and for a full-epoch draw through
the shuffled cursor. Target (issue 2): well under a second per 10k lines.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from hpc_rl.data.prompts import DataKeys, PromptDataset, PromptSource

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
LINES = 100_000


def main() -> None:
    rows = [json.loads(line) for line in (SHARED_DATA / "dapo_math_17k_sample.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        with open(path, "w") as handle:
            for i in range(LINES):
                handle.write(json.dumps(rows[i % len(rows)]) + "\n")
        size_mb = path.stat().st_size / 1e6
        start = time.perf_counter()
        dataset = PromptDataset.load(path, DataKeys())
        load_seconds = time.perf_counter() - start
        source = PromptSource(dataset, shuffle=True, seed=0)
        start = time.perf_counter()
        source.next_records(LINES)
        draw_seconds = time.perf_counter() - start
    print(f"file: {LINES} lines, {size_mb:.1f} MB")
    print(f"load+validate: {load_seconds:.2f} s total, {load_seconds / (LINES / 10_000):.3f} s per 10k lines")
    print(f"shuffled full-epoch draw: {draw_seconds:.3f} s total")


if __name__ == "__main__":
    main()
