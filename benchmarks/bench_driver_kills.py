"""The driver SIGKILLed at random points of a checkpointing tiny run, N times: how many processes of the run are left
(issue 37, case 3: the checkpoint writer's Manager and resource tracker stayed behind with parent 1 in 5 of 14).

Half the kills land while a checkpoint is being written (the riskiest point: the writer's helpers are alive),
half at a random time after registration. Each trial is one local tiny run that saves after every rollout; what
is still alive 20 s after the kill is counted as left behind (and then ended). Prints one line per trial and the
total; exit 1 when anything was left.

    python benchmarks/bench_driver_kills.py [N=20] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.driver_kills import LEFT_AFTER_S, WATCHED_S, kill_driver  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trials", type=int, nargs="?", default=20)
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="driver-kills-"))
    left_total, gone = 0, []
    started = time.monotonic()
    try:
        for trial in range(args.trials):
            point = "save" if trial % 2 == 0 else "random"
            outcome = kill_driver(base / f"run-{trial}", point=point, rng=rng)
            left_total += len(outcome.left)
            if outcome.gone_s is not None:
                gone.append(outcome.gone_s)
            late = (f"gone by themselves {outcome.left_gone_s:.1f} s after the kill" if outcome.left_gone_s is not None
                    else f"still there after {WATCHED_S:.0f} s, ended")
            shown = f"all gone in {outcome.gone_s:.1f} s" if outcome.gone_s is not None else \
                f"{len(outcome.left)} left after {LEFT_AFTER_S:.0f} s ({late}): {outcome.left}"
            print(f"trial {trial + 1}/{args.trials}: killed {outcome.point}; {shown}", flush=True)
            shutil.rmtree(base / f"run-{trial}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    worst = f"{max(gone):.1f}" if gone else "-"
    print(f"{args.trials} kills in {time.monotonic() - started:.0f} s: {left_total} process(es) left behind; "
          f"every process gone within {worst} s in {len(gone)} of {args.trials}")
    return 1 if left_total else 0


if __name__ == "__main__":
    raise SystemExit(main())
