"""How much code one rollout passes through in the controller: the functions (and files) of hpc_rl that
run while the real run loop does one sync-mode rollout with a weight sync, an eval and a save.

    python benchmarks/loop_reading_path.py [--list]

The loop is the real one (built the way the controller builds it); the scheduler, the trainer rank, the
engines' admin calls and eval are fakes, so what is counted is the controller's own path: from the
loop's `run` to the calls that leave the process (a generation, a trainer command, an engine's admin
call). Counted: every function defined under hpc_rl/ that Python enters (sys.setprofile 'call'
events), each once, lambdas and comprehensions left out; and the deepest chain of hpc_rl frames on one
stack. Prints numbers; asserts nothing. The fakes are tests/unit/test_run_loop_order.py's (their
recordings are ignored here).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_rl.config import load_config  # noqa: E402
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry, TrainerInfo  # noqa: E402
from hpc_rl.controller.rollout_stack import assemble_loop  # noqa: E402
from hpc_rl.controller.trainer_channel import TrainerChannel  # noqa: E402
from hpc_rl.telemetry.recorder import RunRecorder  # noqa: E402
from hpc_rl.telemetry.scalars import ScalarLog  # noqa: E402
from tests.unit.test_run_loop_order import FakeFleet, FakeScheduler, recording_trainer_rank  # noqa: E402

PACKAGE = str(REPO / "hpc_rl")
SKIPPED = {"<lambda>", "<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"}


async def fake_eval(weight_version: int) -> dict[str, float]:
    return {"eval/tiny/reward_mean": 1.0}


def build_loop(run_dir: Path) -> tuple[Any, TrainerChannel]:
    """The loop as the controller assembles it, over the fakes, for one rollout with a save and an eval."""
    config = load_config([REPO / "configs/tiny_cpu.yaml"], ["--set", f"run_dir={run_dir}"])
    config.checkpoint.save_interval = 1
    config.eval.eval_interval = 1
    config.eval.skip_eval_before_train = True
    registry = Registry(trainer_world_size=1, num_engines=1)
    registry.add_trainer(TrainerInfo(rank=0, world_size=1, host="h", pid=1, info={"dp_rank": 0, "dp_size": 1}))
    registry.add_engine(EngineInfo(engine_index=0, url="http://127.0.0.1:9", state=EngineState.SERVING))
    channel, ignored = TrainerChannel(1), []
    recorder = RunRecorder(run_dir, ScalarLog(None), num_rollout=1, print_fn=lambda line: None)
    return assemble_loop(config, scheduler=FakeScheduler(ignored), registry=registry, channel=channel,  # type: ignore[arg-type]
                         fleet=FakeFleet(ignored), recorder=recorder, evaluate=fake_eval, num_rollout=1), channel


def hpc_rl_depth(frame: FrameType | None) -> int:
    depth = 0
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            depth += 1
        frame = frame.f_back
    return depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every function counted")
    args = parser.parse_args()
    entered: dict[tuple[str, str], int] = {}
    deepest = [0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(PACKAGE) or code.co_name in SKIPPED:
            return
        key = (str(Path(code.co_filename).relative_to(REPO)), code.co_qualname)
        entered.setdefault(key, len(entered))
        deepest[0] = max(deepest[0], hpc_rl_depth(frame))

    async def scenario(run_dir: Path) -> None:
        loop, channel = build_loop(run_dir)
        trainer = asyncio.create_task(recording_trainer_rank(channel, []))
        sys.setprofile(profile)
        try:
            await loop.run(resumed=False)
        finally:
            sys.setprofile(None)
            trainer.cancel()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp)))
    files = Counter(path for path, _ in entered)
    print(f"one rollout (sync mode, weight sync, eval, save): {len(entered)} hpc_rl functions entered, "
          f"in {len(files)} files; deepest hpc_rl call chain {deepest[0]}")
    for path, count in sorted(files.items()):
        print(f"  {count:3d}  {path}")
    if args.list:
        for (path, name), order in sorted(entered.items(), key=lambda item: item[1]):
            print(f"  {order:3d}  {path}:{name}")


if __name__ == "__main__":
    main()
