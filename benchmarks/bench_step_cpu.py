"""CPU time of one step of the tiny run, per process: the load-insensitive view of where a step goes.

    python benchmarks/bench_step_cpu.py                     # sync mode, 60 rollouts
    python benchmarks/bench_step_cpu.py --mode async --rollouts 80 --runs 3

Runs `python -m hpc_rl.submit configs/tiny_cpu.yaml --executor local` (eval off, as bench_vs_trl runs it), reads
every process of the run from /proc every 50 ms (utime + stime; the role from its command line and parent:
controller = the driver process, router, engine, torchrun agent, trainer rank), and takes the CPU each spent between
the progress lines of rollout `--skip` and the last one but `--skip`: CPU ms per step per process, the steady state
without start-up and shutdown. Also prints the wall time per step and the controller's per-phase medians from
rollouts.jsonl (generation, train, weight sync). On a loaded machine the wall times move with the load, the CPU
milliseconds much less (cache and frequency effects remain): compare A/B runs by CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"^rollout (\d+)/\d+ \||^bench_vs_trl step \{\"step\": (\d+),")
MODES = {"sync": ["--set", "rollout.async_rollout=false", "--set", "cluster.colocate=false"],
         "async": ["--train-async", "--set", "cluster.colocate=false"],
         "colocated": ["--colocate", "--set", "rollout.async_rollout=false"]}
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, user CPU-seconds, system CPU-seconds) of `pid`, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[11]) / TICK, int(fields[12]) / TICK


def _role(pid: int, ppid: int, root: int, roles: dict[int, str]) -> str:
    if pid == root:
        return "controller"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "bound_torchrun" in cmdline or "torchrun" in cmdline:
        return "trainer rank" if roles.get(ppid) == "torchrun agent" else "torchrun agent"
    if "hpc_rl.training" in cmdline:
        return "trainer rank"
    if "router" in cmdline:
        return "router"
    if "engines.cpu" in cmdline or "sglang.launch_server" in cmdline or "engines.serve" in cmdline:
        return "engine"
    return roles.get(ppid, "other")


class Sampler(threading.Thread):
    """CPU-seconds per role of the tree under `root`, sampled every 50 ms; `at(t)` interpolates."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.done = root, threading.Event()
        self.roles: dict[int, str] = {root: "controller"}
        self.cpu: dict[int, tuple[float, float]] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []

    def run(self) -> None:
        while not self.done.is_set():
            parents: dict[int, int] = {}
            for name in os.listdir("/proc"):
                if name.isdigit():
                    stat = _stat(int(name))
                    if stat:
                        parents[int(name)] = stat[0]
            tree, todo = [], [self.root]
            while todo:  # breadth first, so a parent's role is known before its children's
                pid = todo.pop(0)
                tree.append(pid)
                todo.extend(sorted(p for p, pp in parents.items() if pp == pid))
            for pid in tree:
                stat = _stat(pid)
                if stat is None:
                    continue
                if pid not in self.roles:
                    self.roles[pid] = _role(pid, stat[0], self.root, self.roles)
                self.cpu[pid] = stat[1:]
            per_role: dict[str, float] = {}
            for pid, (user, system) in self.cpu.items():
                for role in (self.roles[pid], f"{self.roles[pid]} (system)"):
                    per_role[role] = per_role.get(role, 0.0) + (user + system if "(" not in role else system)
            self.samples.append((time.perf_counter(), per_role))
            self.done.wait(0.05)

    def at(self, when: float) -> dict[str, float]:
        before = [s for s in self.samples if s[0] <= when][-1]
        after = next((s for s in self.samples if s[0] >= when), before)
        if after[0] == before[0]:
            return dict(before[1])
        share = (when - before[0]) / (after[0] - before[0])
        return {role: before[1].get(role, 0.0) + (after[1].get(role, 0.0) - before[1].get(role, 0.0)) * share
                for role in after[1]}


def one_run(mode: str, rollouts: int, skip: int, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local",
                "--run-dir", str(run_dir), "--num-rollout", str(rollouts), "--eval-interval", "null",
                *MODES[mode], *extra] if mode != "trl" else [
                sys.executable, str(REPO / "benchmarks" / "bench_vs_trl.py"), "--trl-child", "--steps", str(rollouts)]
        load_start = float(Path("/proc/loadavg").read_text().split()[0])
        spawned = time.perf_counter()
        process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(process.pid)
        sampler.start()
        stamps: dict[int, float] = {}
        tail: list[str] = []
        assert process.stdout is not None
        for line in process.stdout:
            tail = (tail + [line])[-30:]
            match = PROGRESS.match(line.strip())
            if match:
                stamps[int(match.group(1) or match.group(2))] = time.perf_counter()
        code = process.wait()
        sampler.done.set()
        sampler.join()
        if code != 0:
            raise SystemExit(f"run failed ({code}):\n" + "".join(tail))
        rollouts_file = run_dir / "rollouts.jsonl"
        rows = [json.loads(line)["metrics"] for line in rollouts_file.read_text().splitlines()] \
            if rollouts_file.exists() else []
    first, last = skip, rollouts - skip
    steps = last - first
    begin, end = sampler.at(stamps[first]), sampler.at(stamps[last])
    result = {f"cpu_ms/{role}": (end.get(role, 0.0) - begin.get(role, 0.0)) * 1000 / steps for role in end}
    result["cpu_ms/all"] = sum(v for k, v in result.items() if "(" not in k)
    result["wall_ms/step"] = (stamps[last] - stamps[first]) * 1000 / steps
    steady = rows[first:last]
    for key in ("time/rollout", "time/train", "time/weight_sync", "time/step") if steady else ():
        result[f"median_ms/{key[5:]}"] = statistics.median(r.get(key, 0.0) for r in steady) * 1000
    result["startup_s"] = stamps[min(stamps)] - spawned
    result["cpu_s/startup"] = sum(v for k, v in sampler.at(stamps[min(stamps)]).items() if "(" not in k)
    result["loadavg"] = load_start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=[*sorted(MODES), "trl"], default="sync",
                        help="an hpc_rl mode, or trl: bench_vs_trl's TRL run (same task and settings)")
    parser.add_argument("--rollouts", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="steps left out at each end")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more hpc_rl.submit arguments (after --)")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    results = [one_run(args.mode, args.rollouts, args.skip, args.extra) for _ in range(args.runs)]
    keys = sorted({k for r in results for k in r})
    print(f"{args.mode}, {args.rollouts} rollouts, steps {args.skip + 1}..{args.rollouts - args.skip}, "
          f"{args.runs} run(s); per step:")
    for key in keys:
        values = [r.get(key, 0.0) for r in results]
        print(f"  {key:28s} median {statistics.median(values):8.1f}   runs " + " ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
