#!/usr/bin/env bash
# The test command of README.md: set up what is missing (tools/setup_env.sh: torch's CPU wheel, then
# hpc_rl[test], into a venv it creates when none is active), then fast unit tests, then the slow
# integration tests (real controller, router, CPU engines, torchrun ranks), then the Slurm tests when a
# cluster is up (tools/local_slurm.sh up starts one; .ci/run does). `gpu` (not in the default stages) runs
# tests/gpu on this node's GPUs: every GPU-only path, each skipped with its reason where CUDA, a second GPU
# or the GPU environment (requirements/gpu.in) is missing, and a table of what ran. It first runs the one-GPU
# check (tools/gpu_check.py: one process, a JSON report at $HPC_RL_GPU_CHECK_REPORT, default runs/gpu_check.json).
# `gpu` alone installs nothing (GPU machines may have no network): the interpreter as it is, this checkout first
# on PYTHONPATH (megatron-core carried as a wheel: tools/gpu_check_bundle.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
run_start=$SECONDS
stages=("$@")  # unit | slow | slurm | gpu, any of them (default: unit slow slurm, in that order)
[ "${#stages[@]}" -gt 0 ] || stages=(unit slow slurm)
source tools/setup_env.sh
if [ "${stages[*]}" = gpu ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  hpc_rl_setup test || exit 1
fi
echo "== Python set-up took $(( SECONDS - run_start )) s"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
PYTHON=$(command -v python || command -v python3)

run() {  # pytest, with "no tests collected" (exit 5) not counted as a failure
  local code=0
  "$PYTHON" -m pytest "$@" || code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then stage_end "$stage (failed)"; exit "$code"; fi
}

stage_end() {  # each stage's wall time at its end (pass or fail), so CI's log shows where its minutes went
  echo "== stage $1 took $(( SECONDS - stage_start )) s (tests so far: $(( SECONDS - run_start )) s)"
}

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
      echo "== the one-GPU check (tools/gpu_check.py; exit 2: no CUDA here, nothing ran)"
      check_code=0
      "$PYTHON" tools/gpu_check.py --report "${HPC_RL_GPU_CHECK_REPORT:-runs/gpu_check.json}" || check_code=$?
      echo "== GPU checks (tests/gpu; skipped without CUDA)"
      timeout_option=()  # pytest-timeout may be absent on a bare GPU machine
      "$PYTHON" -c "import pytest_timeout" 2>/dev/null && timeout_option=(--timeout=3600)
      run -q -rs -m gpu tests/gpu ${timeout_option[@]+"${timeout_option[@]}"}
      if [ "$check_code" -ne 0 ] && [ "$check_code" -ne 2 ]; then exit "$check_code"; fi ;;
    *) echo "usage: $0 [unit] [slow] [slurm] [gpu]" >&2; exit 2 ;;
  esac
  stage_end "$stage"
done
