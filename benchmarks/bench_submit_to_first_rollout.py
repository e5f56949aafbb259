"""Submit-to-first-rollout time of the tiny run on the local Slurm cluster, split into phases.

    tools/local_slurm.sh up
    python benchmarks/bench_submit_to_first_rollout.py [configs/tiny_cpu.yaml] [--flag value ...]

Phases, from timestamps the run leaves in its run dir (no instrumentation of the code under test):
  queue          submit -> the batch step starts (submitit's "Starting with" line in the driver log)
  process start  batch step -> the first engine step is launched (its log file appears)
  model load     engine step launched -> engine 0 healthy and registered with the controller (controller.log)
  registration   engine registered -> every trainer rank registered too (models built and loaded)
  first rollout  everyone registered -> the first rollout generated
The job is cancelled once the first rollout is seen (or after --timeout seconds).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.launch.slurm_submit import submit_job

STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
DRIVER_START = re.compile(STAMP + r".*Starting with")
ENGINE_REGISTERED = re.compile(STAMP + r".*engine 0 registered at")
ALL_REGISTERED = re.compile(STAMP + r".*all components registered")
FIRST_ROLLOUT = re.compile(STAMP + r".*rollout 0 generated")


def _first(path: Path, pattern: re.Pattern[str]) -> float | None:
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        match = pattern.search(line)
        if match:
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def main(argv: list[str]) -> int:
    timeout = 900.0
    if "--timeout" in argv:
        at = argv.index("--timeout")
        timeout = float(argv[at + 1])
        del argv[at:at + 2]
    config_file = argv[0] if argv and not argv[0].startswith("-") else "configs/tiny_cpu.yaml"
    flags = argv[1:] if argv and not argv[0].startswith("-") else argv
    run_dir = REPO / "runs" / f"bench-first-rollout-{time.strftime('%Y%m%d-%H%M%S')}"
    config = load_config([REPO / config_file], ["--actor-num-nodes", "2", *flags, "--set", f"run_dir={run_dir}"])
    write_resolved_config(config, run_dir)
    submitted = time.time()
    job = submit_job(config)
    driver_log = Path(job.paths.stdout)  # submitit's "Starting with ..." line goes to the .out file
    controller_log = run_dir / "logs" / "controller.log"
    engine_log = run_dir / "logs" / "engine-0.log"
    marks: dict[str, float | None] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            marks = {
                "driver": _first(driver_log, DRIVER_START),
                "engine_step": engine_log.stat().st_ctime if engine_log.exists() else None,
                "registered": _first(controller_log, ENGINE_REGISTERED),
                "all_registered": _first(controller_log, ALL_REGISTERED),
                "first_rollout": _first(controller_log, FIRST_ROLLOUT),
            }
            if marks["first_rollout"] is not None or job.done():
                break
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job.job_id], check=False)
    order = [("queue", submitted, marks.get("driver")), ("process start", marks.get("driver"), marks.get("engine_step")),
             ("model load", marks.get("engine_step"), marks.get("registered")),
             ("registration", marks.get("registered"), marks.get("all_registered")),
             ("first rollout", marks.get("all_registered"), marks.get("first_rollout"))]
    print(f"submit-to-first-rollout on the local cluster (job {job.job_id}, run dir {run_dir}):")
    for name, begin, end in order:
        value = f"{end - begin:7.2f} s" if begin is not None and end is not None else "    n/a"
        print(f"  {name:<14}{value}")
    total = marks.get("first_rollout")
    print(f"  {'total':<14}{total - submitted:7.2f} s" if total is not None else f"  {'total':<14}    n/a "
          f"(no first rollout seen; see {controller_log})")
    return 0 if total is not None else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
