"""The local executor: the whole run as real processes on this machine (the embedded default).

Owns: what `python -m hpc_rl.submit CONFIG --executor local` does after validation: read the run's plan
(config.resolved.yaml and the topology.json submit wrote: `run_plan`), print where the run lives, then run
the driver with the local step launcher in this process (controller in
process; router, engines and torchrun ranks as child process groups), and report how it ended. An engine
that spans nodes is refused here (it needs Slurm's nodes).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpc_rl.config.schema import RunConfig
from hpc_rl.launch.driver import EXIT_OK, run_driver
from hpc_rl.launch.steps import LocalStepLauncher
from hpc_rl.launch.run_plan import load_run_plan
from hpc_rl.telemetry.scalars import tensorboard_dir

EXIT_INVALID = 2


def run_local(config: RunConfig) -> int:
    plan = load_run_plan(config.run_dir)
    spanning = [e for e in plan.topology.engines if e.num_nodes > 1]
    if spanning:  # one machine: its node-ranks would all be one node (same GPU identities), which SGLang refuses
        print(f"hpc_rl: engines {[e.engine_index for e in spanning]} span {spanning[0].num_nodes} nodes each: a "
              "multi-node engine needs a Slurm allocation (--executor slurm); nothing was started",
              file=sys.stderr, flush=True)
        return EXIT_INVALID
    run_dir = Path(config.run_dir)
    tensorboard = tensorboard_dir(config, run_dir)
    print(f"hpc_rl: local run in {run_dir}", flush=True)
    print(f"  logs: {run_dir / 'logs'}/{{controller,router,engine-N,trainer}}.log", flush=True)
    print(f"  tensorboard --logdir {tensorboard}", flush=True)
    code = run_driver(run_dir, LocalStepLauncher(), local=True, plan=plan)
    print(f"hpc_rl: run {'finished' if code == EXIT_OK else f'ended with exit code {code}'}; "
          f"artifacts in {run_dir}", flush=True)
    return code
