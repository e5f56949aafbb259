"""`python -m hpc_rl.rewards`: score a JSONL file of `{response, label}` rows and print the mean.

Owns: the command line, reading and checking the rows (errors name file:line), writing each row
back with a `reward` field, and the exit status (0 ok, 1 a reward failed, 2 bad input or flags).
Rows may also carry `prompt`, `metadata` (e.g. a per-row `rm_type`), `id` and, for `--group-rm`,
`group_index` (consecutive rows with the same value form one group). Scoring is `reward_group`,
so the CLI grades exactly what a training run would.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.data.samples import Sample
from hpc_rl.rewards.group import RewardError, RewardSpec, reward_group
from hpc_rl.rewards.remote import REMOTE_RM_RETRY
from hpc_rl.rewards.scoring import RM_TYPES

_BATCH = 64
"""Rows scored concurrently when not in group mode (bounds open remote_rm requests)."""


class InputError(ValueError):
    """A row of the input file that cannot be scored; the message starts with file:line."""


@dataclass
class Row:
    line: int
    data: dict[str, Any]
    sample: Sample


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_rl.rewards",
        description="Score JSONL rows {response, label} with a reward and print the mean.",
    )
    parser.add_argument("--rm-type", help=f"one of {', '.join(RM_TYPES)} (rule types also as boxed_<type>)")
    parser.add_argument(
        "--input", required=True, type=Path, help="JSONL file, one {response, label} per line"
    )
    parser.add_argument("--output", required=True, type=Path, help="JSONL file: the input rows plus 'reward'")
    parser.add_argument("--custom-rm-path", help="pkg.module.fn or path/to/file.py:fn (async)")
    parser.add_argument("--group-rm", action="store_true", help="call the custom function once per group")
    parser.add_argument("--rm-url", help="reward server URL for remote_rm")
    parser.add_argument("--reward-key", help="key of the reward when a function or server returns an object")
    parser.add_argument("--max-retries", type=int, default=10, help="remote_rm attempts per sample")
    return parser.parse_args(argv)


def _read_rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    with path.open(encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
            if not isinstance(data, dict):
                raise InputError(
                    f"{where}: expected a JSON object with 'response' and 'label', got {type(data).__name__}"
                )
            if not isinstance(data.get("response"), str):
                raise InputError(f"{where}: 'response' must be a string (got {data.get('response')!r})")
            if "label" not in data:
                raise InputError(f"{where}: missing 'label'")
            metadata = data.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise InputError(f"{where}: 'metadata' must be an object")
            group_index = data.get("group_index", line_number)
            sample = Sample(
                index=line_number,
                group_index=group_index if isinstance(group_index, int) else hash(group_index),
                prompt=data.get("prompt", ""),
                prompt_token_ids=[],
                label=data["label"],
                metadata=metadata,
                response_text=data["response"],
            )
            rows.append(Row(line=line_number, data=data, sample=sample))
    if not rows:
        raise InputError(f"{path}: no rows to score")
    return rows


def _batches(rows: list[Row], group_rm: bool) -> list[list[Row]]:
    if not group_rm:
        return [rows[i : i + _BATCH] for i in range(0, len(rows), _BATCH)]
    groups: list[list[Row]] = []
    for row in rows:
        if groups and groups[-1][-1].sample.group_index == row.sample.group_index:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


async def _score_rows(spec: RewardSpec, rows: list[Row]) -> list[float]:
    rewards: list[float] = []
    for batch in _batches(rows, spec.group_rm):
        rewards.extend(await reward_group(spec, [row.sample for row in batch]))
    return rewards


def _describe_failure(error: RewardError, path: Path, rows: list[Row]) -> str:
    by_index = {row.sample.index: row for row in rows}
    places = []
    for index in error.indices:
        row = by_index.get(index)
        if row is not None:
            row_id = f" (id {row.data['id']!r})" if "id" in row.data else ""
            places.append(f"{path}:{row.line}{row_id}")
    return f"{', '.join(places)}: {error}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        spec = RewardSpec(
            rm_type=args.rm_type,
            custom_rm_path=args.custom_rm_path,
            rm_url=args.rm_url,
            group_rm=args.group_rm,
            reward_key=args.reward_key,
            retry=dataclasses.replace(REMOTE_RM_RETRY, max_transport_retries=args.max_retries - 1),
            args=args,
        )
        spec.validate()
        rows = _read_rows(args.input)
    except (ValueError, OSError) as error:  # InputError, PluginError, UnknownRewardType, bad flags
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        rewards = asyncio.run(_score_rows(spec, rows))
    except RewardError as error:
        print(f"error: {_describe_failure(error, args.input, rows)}", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as out:
        for row, reward in zip(rows, rewards, strict=True):
            out.write(json.dumps({**row.data, "reward": reward}, ensure_ascii=False) + "\n")
    mean = sum(rewards) / len(rewards)
    print(f"mean reward {mean:.6f} over {len(rewards)} samples ({spec.label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
