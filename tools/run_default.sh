#!/usr/bin/env bash
# README's first command: set up what is missing (tools/setup_env.sh), then run the embedded default —
# a tiny GRPO run on this machine (no Slurm, no GPU). Extra arguments go to `python -m hpc_rl.submit`
# (e.g. --num-rollout 20, --run-dir DIR, --executor slurm to send it to a cluster instead).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
hpc_rl_setup || exit 1
executor=(--executor local)
for arg in "$@"; do [[ "$arg" == --executor* ]] && executor=(); done
exec python -m hpc_rl.submit configs/tiny_cpu.yaml "${executor[@]}" "$@"
