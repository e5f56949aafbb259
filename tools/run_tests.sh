#!/usr/bin/env bash
# The test command of README.md: fast unit tests first, then the slow integration tests
# (real controller, router, CPU engines, torchrun ranks), then the Slurm tests when a cluster is up.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

run() {  # pytest, with "no tests collected" (exit 5) not counted as a failure
  local code=0
  python -m pytest "$@" || code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then exit "$code"; fi
}

echo "== unit tests"
run -q -m "not slow and not slurm" tests --timeout=300
echo "== integration tests (slow: real processes)"
run -q -m "slow and not slurm" tests --timeout=900
if [ "${HPC_RL_SLURM_TESTS:-auto}" != "0" ] && command -v sinfo >/dev/null 2>&1 && sinfo -h >/dev/null 2>&1; then
  echo "== Slurm tests (local cluster)"
  run -q -m slurm tests --timeout=1200
else
  echo "== Slurm tests skipped: no reachable Slurm cluster (tools/local_slurm.sh up starts one)"
fi
