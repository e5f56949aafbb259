"""`python -m hpc_rl.rewards` on temporary files: once as a real subprocess, the rest in-process
through `main(argv)` (same code path, without paying the sympy/aiohttp import per case)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.rewards.__main__ import main

ROWS = [
    {"id": "a", "response": "<think>hmm</think> so \\boxed{\\frac{1}{2}}", "label": "0.5"},
    {"id": "b", "response": "<think>hmm</think> so \\boxed{3}", "label": "\\boxed{3}"},
    {"id": "c", "response": "I think \\boxed{3}", "label": "3"},  # no </think>
    {"id": "d", "response": "<think>x</think> \\boxed{(1, 2]}", "label": "(1,2]"},
]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_rl.rewards", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_scores_file_and_prints_mean(tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out" / "scored.jsonl"
    write_jsonl(source, ROWS)
    result = run_cli("--rm-type", "deepscaler", "--input", str(source), "--output", str(target))
    assert result.returncode == 0, result.stderr
    assert "mean reward 0.750000 over 4 samples" in result.stdout
    scored = [json.loads(line) for line in target.read_text().splitlines()]
    assert [row["reward"] for row in scored] == [1.0, 1.0, 0.0, 1.0]
    assert [row["id"] for row in scored] == ["a", "b", "c", "d"]
    assert scored[0]["response"] == ROWS[0]["response"]


def test_dapo_scores_are_plus_minus_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, [{"response": "Answer: 34", "label": "34"}, {"response": "no idea", "label": "34"}])
    code, out, err = run_main(capsys, "--rm-type", "dapo", "--input", str(source), "--output", str(target))
    assert code == 0, err
    assert "mean reward 0.000000 over 2 samples" in out
    assert [json.loads(line)["reward"] for line in target.read_text().splitlines()] == [1.0, -1.0]


def test_bad_line_is_reported_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    code, _, err = run_main(
        capsys, "--rm-type", "math", "--input", str(source), "--output", str(tmp_path / "o.jsonl")
    )
    assert code == 2
    assert f"{source}:3: not valid JSON" in err


def test_row_without_label(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, [{"response": "x"}])
    code, _, err = run_main(
        capsys, "--rm-type", "math", "--input", str(source), "--output", str(tmp_path / "o.jsonl")
    )
    assert code == 2 and f"{source}:1: missing 'label'" in err


def test_failing_reward_names_the_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, [{"id": "ok", "response": "Answer: 1", "label": "1"},
                         {"id": "bad", "response": "Answer: 1", "label": "one"}])  # fmt: skip
    code, _, err = run_main(
        capsys, "--rm-type", "dapo", "--input", str(source), "--output", str(tmp_path / "o.jsonl")
    )
    assert code == 1
    assert f"{source}:2 (id 'bad')" in err and "dapo compares against integer labels" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_unknown_rm_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, ROWS)
    code, _, err = run_main(
        capsys, "--rm-type", "maths", "--input", str(source), "--output", str(tmp_path / "o.jsonl")
    )
    assert code == 2
    assert "unknown rm_type 'maths'; valid types: deepscaler, dapo, math, f1, remote_rm, tiny_task" in err


def test_custom_group_reward_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plugin = tmp_path / "judge.py"
    plugin.write_text("async def judge(args, samples):\n    return [float(len(samples))] * len(samples)\n")
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"response": "x", "label": "", "group_index": g} for g in (1, 1, 1, 2)]
    write_jsonl(source, rows)
    flags = [
        "--custom-rm-path",
        f"{plugin}:judge",
        "--group-rm",
        "--input",
        str(source),
        "--output",
        str(target),
    ]
    code, out, err = run_main(capsys, *flags)
    assert code == 0, err
    assert "mean reward 2.500000 over 4 samples" in out
    assert [json.loads(line)["reward"] for line in target.read_text().splitlines()] == [3.0, 3.0, 3.0, 1.0]
