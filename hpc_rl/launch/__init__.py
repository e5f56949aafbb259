"""Launch: from a resolved config to running processes (local, sbatch, submitit het jobs), the driver that
restarts failed attempts, and the checks of a node before and after a run. The top layer: nothing imports it."""
