"""Checkpoints verified before they are trusted, and no process left when the driver dies while one is written
(issue 37, cases 1, 2 and 3), on whole local tiny runs. Each case is timed (printed: docs/faults.md quotes these
numbers)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from hpc_rl.training.checkpoint_files import STATE_FILE, TRACKER, iteration_dir
from hpc_rl.telemetry.run_files import REDONE_RECORDS
from tests.integration.driver_kills import kill_driver
from tests.integration.run_helpers import records, run_to_end

pytestmark = pytest.mark.slow

FLAGS = ("--save-interval", "2", "--set", "eval.eval_interval=null")


def ids(run_dir: Path) -> list[int]:
    return [r["rollout_id"] for r in records(run_dir)]


def test_a_damaged_checkpoint_is_skipped_by_name_and_none_whole_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    first = run_to_end(run_dir, *FLAGS, "--num-rollout", "6")
    assert first.returncode == 0, first.stderr[-3000:]
    assert ids(run_dir) == list(range(6))

    (iteration_dir(checkpoints, 5) / STATE_FILE).unlink()  # case 1: old, a silent restart at rollout 1, exit 0
    started = time.monotonic()
    second = run_to_end(run_dir, *FLAGS, "--num-rollout", "8")
    skip_s = time.monotonic() - started
    assert second.returncode == 0, second.stderr[-3000:]
    said = [line for line in second.stderr.splitlines() if "skipped" in line]
    assert len(said) == 1 and f"resuming from {iteration_dir(checkpoints, 3)}; skipped iter_0000005: " \
        f"{STATE_FILE} is missing" in said[0], second.stderr[-3000:]
    assert ids(run_dir) == list(range(8))  # 4 and 5 redone; 0..3 kept
    assert [json.loads(line)["rollout_id"] for line in (run_dir / REDONE_RECORDS).read_text().splitlines()] == [4, 5]

    cut = iteration_dir(checkpoints, 7) / "__0_0.distcp"  # case 2: old, ~140 lines of tracebacks, exit 1
    cut.write_bytes(cut.read_bytes()[:100])
    (checkpoints / TRACKER).write_text("")
    for iteration in (1, 3, 5):
        (iteration_dir(checkpoints, iteration) / ".metadata").unlink()
    trainer_log = (run_dir / "logs" / "trainer.log").stat().st_size
    started = time.monotonic()
    refused = run_to_end(run_dir, *FLAGS, "--num-rollout", "10", timeout_s=120)
    refuse_s = time.monotonic() - started
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert f"no usable checkpoint in {checkpoints}; nothing was started:" in refused.stderr
    assert f"{TRACKER}: {TRACKER} holds '', not an iteration number" in refused.stderr
    assert "iter_0000007: __0_0.distcp has 100 bytes, the manifest says" in refused.stderr
    assert "iter_0000005: .metadata is missing" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) < 15
    assert (run_dir / "logs" / "trainer.log").stat().st_size == trainer_log  # no trainer (no process) started
    assert ids(run_dir) == list(range(8))
    print(f"\ncase 1: resumed past a checkpoint without {STATE_FILE} and finished in {skip_s:.1f} s; "
          f"case 2: none whole refused (exit 2) in {refuse_s:.1f} s")


def test_the_driver_killed_while_a_checkpoint_is_written_leaves_no_process(tmp_path: Path) -> None:
    """The riskiest point of case 3: Megatron's checkpoint writer's Manager and resource tracker are alive."""
    rng = random.Random(3)
    outcomes = [kill_driver(tmp_path / f"kill-{i}", point="save", rng=rng) for i in range(3)]
    for outcome in outcomes:
        assert outcome.left == [], f"killed {outcome.point}: left behind {outcome.left}"
    print("\n" + "; ".join(f"killed {o.point}: all gone in {o.gone_s:.1f} s" for o in outcomes))
