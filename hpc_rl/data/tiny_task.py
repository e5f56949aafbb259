"""The synthetic task of the embedded default run: "copy the digit".

Owns: the prompt rows (`{"prompt": [{"role": "user", "content": "copy 7"}], "label": "7"}`), the same task
as chats for SFT (`{"messages": [user "copy 7", assistant "7"]}`), their files under `data/`, and the rule reward (rm type `tiny_task`): 1.0 when the first digit in the
response equals the label, else 0.0. An untrained tiny policy (vocabulary of 24 words, 10 of them
digits) scores about 0.1, and only a policy that reads its prompt can score 1.0, so learning it
proves the sign of every loss term end to end.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

_FIRST_DIGIT = re.compile(r"\d")


def tiny_task_rows(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(count):
        digit = str(rng.randrange(10))
        rows.append({"prompt": [{"role": "user", "content": f"copy {digit}"}], "label": digit})
    return rows


def tiny_task_chats(count: int, seed: int) -> list[dict[str, Any]]:
    """The prompts of `tiny_task_rows(count, seed)` answered right, as chats (SFT data)."""
    return [{"messages": [*row["prompt"], {"role": "assistant", "content": row["label"]}]}
            for row in tiny_task_rows(count, seed)]


def write_tiny_task_data(path: str | Path, count: int, seed: int, *, chats: bool = False) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in (tiny_task_chats if chats else tiny_task_rows)(count, seed):
            handle.write(json.dumps(row) + "\n")
    return path


def tiny_task_reward(response: str, label: object) -> float:
    """1.0 if the first digit of `response` is `label`, else 0.0."""
    match = _FIRST_DIGIT.search(response)
    return 1.0 if match is not None and match.group(0) == str(label).strip() else 0.0


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2] / "data"
    print(write_tiny_task_data(root / "tiny_copy_train.jsonl", 512, seed=0))
    print(write_tiny_task_data(root / "tiny_copy_eval.jsonl", 64, seed=1))
    print(write_tiny_task_data(root / "tiny_copy_chat_train.jsonl", 512, seed=0, chats=True))
    print(write_tiny_task_data(root / "tiny_copy_chat_eval.jsonl", 64, seed=1, chats=True))
