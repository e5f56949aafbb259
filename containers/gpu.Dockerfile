# The GPU nodes' environment as an image: requirements/gpu.txt's pins (torch 2.14.1, sglang 0.5.23,
# sglang-router 0.3.2, megatron-core 0.16.1, transformer-engine 2.11.0 built for CUDA 13) on CPython 3.11,
# the interpreter the lock was resolved for. Every Slurm step runs in it with `slurm.container_image`
# (Pyxis: an enroot import of this image; Apptainer: containers/hpc_rl-gpu.def). Build from the repository root:
#
#   docker build -f containers/gpu.Dockerfile -t hpc_rl-gpu:0.1.0 .
#   enroot import -o hpc_rl-gpu.sqsh dockerd://hpc_rl-gpu:0.1.0          # Pyxis: slurm.container_image
#   apptainer build hpc_rl-gpu.sif containers/hpc_rl-gpu.def              # Apptainer
#
# Steps run the image's `python3` (this venv's) and import hpc_rl from the run's source checkout when it is
# mounted (hpc_rl.launch.step_plan puts it first on PYTHONPATH); the copy installed here serves the rest.
# Not built in CI (no Docker there); tests/unit/test_gpu_environment.py checks it installs exactly the lock.
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common ca-certificates git \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
 && rm -rf /var/lib/apt/lists/*

RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    NCCL_CUMEM_ENABLE=0 \
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0

WORKDIR /opt/hpc_rl
COPY requirements/ requirements/
# torch first (transformer-engine's torch extension builds against it), then everything, both at the lock's pins.
RUN python3 -m pip install --upgrade pip \
 && python3 -m pip install -c requirements/gpu.txt torch \
 && NVTE_FRAMEWORK=pytorch MAX_JOBS=8 python3 -m pip install --no-build-isolation -c requirements/gpu.txt -r requirements/gpu.in

COPY setup.cfg setup.py pyproject.toml README.md ./
COPY hpc_rl/ hpc_rl/
# Every module of the installed copy imports (from /, so the source tree here does not stand in for it).
RUN python3 -m pip install --no-deps . \
 && cd / && python3 -m hpc_rl.launch.install_check \
 && python3 -c "import sglang, megatron.core, transformer_engine"
