"""Benchmark: the control plane's weight and start-up (issue 11: < 150 MiB together, up in < 1 s).

    python benchmarks/bench_control_plane.py [configs/tiny_cpu.yaml] [--repeats 3]

Per repeat, in a fresh Python process (as the driver runs them; no engine, no trainer):
  import        importing the controller (`hpc_rl.controller.app`)
  router up     sglang-router started -> listening
  controller up Controller.start() -> listening
  rollout stack listening -> Controller.ready() (tokenizer, prompts, scheduler: built in the background
                while engines and trainers start)
  RSS           of that process (the controller lives in the driver) and of the router process,
                after start, in MiB; and which heavy modules the controller process holds.
Then `python -m hpc_rl.status RUN_DIR` is timed against the live controller (wall clock of the
whole command). Prints the median of each and whether the issue's targets hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("torch", "transformers", "megatron", "sympy", "tensorboard")
TARGET_RSS_MIB, TARGET_UP_S, TARGET_STATUS_S = 150.0, 1.0, 1.0


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def child(run_dir: str) -> None:
    """One measurement: print a JSON line, keep the controller up until stdin closes."""
    started = time.perf_counter()
    from hpc_rl.config import load_resolved_config
    from hpc_rl.controller.app import Controller
    from hpc_rl.process.child_process import free_port
    from hpc_rl.engines.router import RouterProcess
    from hpc_rl.protocol.secret import engine_api_key, load_secret, secret_path

    imported = time.perf_counter()
    config = load_resolved_config(Path(run_dir))
    secret = load_secret(secret_path(Path(run_dir)))

    async def main() -> None:
        key = engine_api_key(secret)
        router = RouterProcess(log_path=Path(run_dir) / "router.log", host="127.0.0.1", port=free_port(),
                               prometheus_port=free_port(), policy="round_robin", api_key=key)
        t0 = time.perf_counter()
        router.start()
        await asyncio.to_thread(router.wait_listening, 60.0)
        t1 = time.perf_counter()
        controller = Controller(config, secret=secret, router=router, router_url=router.url, api_key=key)
        await controller.start()
        t2 = time.perf_counter()
        await controller.ready()
        t3 = time.perf_counter()
        router_pid = router.process.pid
        assert router_pid is not None
        print(json.dumps({
            "import_s": imported - started, "router_up_s": t1 - t0, "controller_up_s": t2 - t1,
            "rollout_stack_s": t3 - t2,
            "controller_rss_mib": _rss_mib(os.getpid()),
            "router_rss_mib": _rss_mib(router_pid),
            "heavy_modules": [m for m in HEAVY_MODULES if m in sys.modules],
        }), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # the parent times `hpc_rl.status` meanwhile
        await controller.close()
        await asyncio.to_thread(router.stop)

    asyncio.run(main())


def one_repeat(config_file: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "hpc_rl.launch.prepare_run", config_file, "--run-dir", str(run_dir)],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        process = subprocess.Popen([sys.executable, __file__, "--child", str(run_dir)], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None and process.stdin is not None
        result = json.loads(process.stdout.readline())
        t0 = time.perf_counter()
        status = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir), "--json"], cwd=REPO,
                                capture_output=True, text=True)
        result["status_s"] = time.perf_counter() - t0
        result["status_live"] = '"controller (live)"' in status.stdout
        process.stdin.close()
        process.wait(60)
        return result


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(argv[1])
        return 0
    repeats = 3
    if "--repeats" in argv:
        at = argv.index("--repeats")
        repeats = int(argv[at + 1])
        del argv[at:at + 2]
    config_file = argv[0] if argv else "configs/tiny_cpu.yaml"
    results = [one_repeat(config_file) for _ in range(repeats)]
    print(f"control plane of {config_file}, {repeats} repeat(s), median (min..max):")
    for key in ("import_s", "router_up_s", "controller_up_s", "rollout_stack_s", "status_s", "controller_rss_mib", "router_rss_mib"):
        values = [float(r[key]) for r in results]  # type: ignore[arg-type]
        print(f"  {key:20s} {statistics.median(values):8.3f}  ({min(values):.3f}..{max(values):.3f})")
    rss = statistics.median(float(r["controller_rss_mib"]) + float(r["router_rss_mib"]) for r in results)  # type: ignore[arg-type]
    up = statistics.median(float(r["router_up_s"]) + float(r["controller_up_s"]) for r in results)  # type: ignore[arg-type]
    status = statistics.median(float(r["status_s"]) for r in results)  # type: ignore[arg-type]
    print(f"  heavy modules in the controller process: {results[0]['heavy_modules'] or 'none'}; "
          f"status answered live: {all(r['status_live'] for r in results)}")
    print(f"  controller + router RSS {rss:.1f} MiB (target < {TARGET_RSS_MIB:.0f}): "
          f"{'ok' if rss < TARGET_RSS_MIB else 'MISSED'}")
    print(f"  router + controller up {up:.3f} s (target < {TARGET_UP_S:.0f}): {'ok' if up < TARGET_UP_S else 'MISSED'}")
    print(f"  hpc_rl.status {status:.3f} s (target < {TARGET_STATUS_S:.0f}): "
          f"{'ok' if status < TARGET_STATUS_S else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main(sys.argv[1:]))
