#!/usr/bin/env bash
# Prepare the one-GPU check for a bare GPU machine (notes/one-gpu-h200.md): run HERE, on a machine with a network
# (the login node), never on the GPU machine. It downloads megatron-core's wheel for the GPU machine's Python
# (cp312, manylinux x86_64; 2.6 MB, no dependencies to bring: torch, numpy and packaging are there) into .whl/
# (ignored by git: carry it with the checkout), then prints the one command line to run there.
#
#   bash tools/gpu_check_bundle.sh                 # .whl/megatron_core-0.16.1-...whl
#   HPC_RL_GPU_PYTHON=3.11 bash tools/gpu_check_bundle.sh   # another Python on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${HPC_RL_GPU_PYTHON:-3.12}
megatron=${HPC_RL_MEGATRON_SPEC:-megatron-core==0.16.1}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl "$megatron"
ls -l .whl >&2
cat <<'COMMAND'
# on the GPU machine, from the checkout's root (no network; at most ~8 minutes; the report lands in $OUT or .):
python3 -m pip install -q --no-index --no-deps --target /tmp/hpc_rl_site .whl/*.whl && PYTHONPATH=/tmp/hpc_rl_site:$PWD HF_HUB_OFFLINE=1 timeout 480 python3 tools/gpu_check.py --report "${OUT:-.}/gpu_check.json"; echo "gpu_check exit $?"
COMMAND
