#!/usr/bin/env bash
# The test command of README.md: set up what is missing (tools/setup_env.sh: torch's CPU wheel, then
# hpc_rl[test], into a venv it creates when none is active), then fast unit tests, then the slow
# integration tests (real controller, router, CPU engines, torchrun ranks), then the Slurm tests when a
# cluster is up (tools/local_slurm.sh up starts one; .ci/run does). `gpu` (not in the default stages) runs
# tests/gpu on this node's GPUs: every GPU-only path, each skipped with its reason where CUDA, a second GPU
# or the GPU environment (requirements/gpu.in) is missing, and a table of what ran.
set -euo pipefail
cd "$(dirname "$0")/.."
run_start=$SECONDS
source tools/setup_env.sh
hpc_rl_setup test || exit 1
echo "== Python set-up took $(( SECONDS - run_start )) s"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

run() {  # pytest, with "no tests collected" (exit 5) not counted as a failure
  local code=0
  python -m pytest "$@" || code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then stage_end "$stage (failed)"; exit "$code"; fi
}

stage_end() {  # each stage's wall time at its end (pass or fail), so CI's log shows where its minutes went
  echo "== stage $1 took $(( SECONDS - stage_start )) s (tests so far: $(( SECONDS - run_start )) s)"
}

stages=("$@")  # unit | slow | slurm | gpu, any of them (default: unit slow slurm, in that order)
[ "${#stages[@]}" -gt 0 ] || stages=(unit slow slurm)
for stage in "${stages[@]}"; do
  stage_start=$SECONDS
  case "$stage" in
    unit)
      echo "== unit tests"
      run -q -m "not slow and not slurm and not gpu" tests --timeout=300 --durations=25 ;;
    slow)
      echo "== integration tests (slow: real processes)"
      run -q -m "slow and not slurm and not gpu" tests --timeout=900 --durations=25 ;;
    slurm)
      if [ "${HPC_RL_SLURM_TESTS:-auto}" != "0" ] && command -v sinfo >/dev/null 2>&1 && sinfo -h >/dev/null 2>&1; then
        echo "== Slurm tests (local cluster)"
        run -q -m slurm tests --timeout=1200 --durations=25
      else
        echo "== Slurm tests skipped: no reachable Slurm cluster (tools/local_slurm.sh up starts one)"
      fi ;;
    gpu)
      echo "== GPU checks (tests/gpu; skipped without CUDA)"
      run -q -rs -m gpu tests/gpu --timeout=3600 ;;
    *) echo "usage: $0 [unit] [slow] [slurm] [gpu]" >&2; exit 2 ;;
  esac
  stage_end "$stage"
done
