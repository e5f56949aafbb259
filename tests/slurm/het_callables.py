"""Small drivers for the Slurm tests: same signature as `hpc_rl.launch.driver.run_driver`, no model.

Each one exercises the het-job mechanics the real driver relies on (srun steps in both components,
node names, stopping steps) in seconds instead of minutes.
"""

from __future__ import annotations

import time
from pathlib import Path

from hpc_rl.launch.steps import StepLauncher, StepSpec


def where_driver(run_dir: str, launcher: StepLauncher, *, local: bool) -> int:
    """One step per component; each task writes the node it ran on. Returns 0."""
    out = Path(run_dir)
    steps = [
        launcher.start(StepSpec(name="probe-trainer", het_group=0, num_nodes=2, node_index=None,
                                argv=["bash", "-c", f'echo "$SLURMD_NODENAME" > {out}/trainer-$SLURM_PROCID.node'],
                                log_path=out / "logs" / "probe-trainer.log")),
        launcher.start(StepSpec(name="probe-engine", het_group=1, node_index=0,
                                argv=["bash", "-c", f'echo "$SLURMD_NODENAME" > {out}/engine.node'],
                                log_path=out / "logs" / "probe-engine.log")),
    ]
    codes = [step.wait(120) for step in steps]
    (out / "addresses").write_text(f"{launcher.node_address(0, 0)} {launcher.node_address(0, 1)} "
                                   f"{launcher.node_address(1, 0)}\n")
    return 0 if codes == [0, 0] else 1


def stopping_driver(run_dir: str, launcher: StepLauncher, *, local: bool) -> int:
    """Starts a step on each component, stops them with `stop()`; records what is left running."""
    import subprocess

    out = Path(run_dir)
    tag = f"hpcrl-stop-{out.name}"
    steps = [
        launcher.start(StepSpec(name="stop-trainer", het_group=0, num_nodes=2,
                                argv=["bash", "-c", f"exec -a {tag} sleep 600"])),
        launcher.start(StepSpec(name="stop-engine", het_group=1, node_index=0,
                                argv=["bash", "-c", f"trap '' TERM; exec -a {tag} sleep 600"])),
    ]

    def running() -> list[str]:
        listing = subprocess.run(["pgrep", "-f", f"^{tag}"], check=False, capture_output=True, text=True)
        return listing.stdout.split()

    deadline = time.monotonic() + 60
    while len(running()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    before = len(running())
    codes = [step.stop(3.0) for step in steps]
    deadline = time.monotonic() + 30  # the step's scancel --signal=KILL reaches the tasks through slurmctld and
    while running() and time.monotonic() < deadline:  # slurmd: seconds on a loaded machine, not a fixed 2 s
        time.sleep(0.2)
    (out / "stopped").write_text(f"{before} {len(running())} {codes}\n")
    return 0
