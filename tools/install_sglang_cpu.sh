#!/usr/bin/env bash
# Install real SGLang 0.5.23 into its own venv on a CPU-only machine, so the conformance tests
# (pytest -m sglang_cpu) can run hpc_rl's protocol checks against it. ~4 min, ~3.4 GB.
#
#   bash tools/install_sglang_cpu.sh [VENV_DIR]     (default: $HPC_RL_SGLANG_VENV, else
#                                                    ~/.cache/hpc_rl/sglang-cpu-venv)
#
# Why not `pip install sglang`: its wheel pins CUDA torch and the CUDA kernel stack. So: CPU torch
# first, sglang with --no-deps, then the runtime dependencies it needs on CPU, all under
# tools/sglang_cpu_constraints.txt so nothing upgrades torch. Two imports fail on CPU and get
# stand-in modules (written below into VENV/hpc_rl_stubs, put on sys.path by a .pth file):
#   torchvision  - the registry's wheels are CUDA builds whose _C does not load against CPU torch;
#                  SGLang imports it from its multimodal processors, text models never call it.
#   vllm._custom_ops.rotary_embedding - imported by SGLang's rotary code on non-CUDA devices; never
#                  called with the flags hpc_rl uses (--attention-backend torch_native).
# Where CPU torch 2.13.0 is not on your package index, set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel
# index first. Run the server as in hpc_rl.engines.sglang_launch (device cpu options).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${HPC_RL_SGLANG_VENV:-$HOME/.cache/hpc_rl/sglang-cpu-venv}}"
constraints="$here/sglang_cpu_constraints.txt"
python="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

echo "== venv $venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --constraint "$constraints")

echo "== torch (CPU) first"
"${pip[@]}" torch==2.13.0
echo "== sglang itself, without its CUDA dependencies"
"${pip[@]}" --no-deps sglang==0.5.23
echo "== timm without torchvision (its CUDA wheel would not load)"
"${pip[@]}" --no-deps timm==1.0.25
echo "== SGLang's runtime dependencies on CPU"
"${pip[@]}" \
  aiohttp fastapi uvicorn uvloop orjson pydantic pyzmq msgspec psutil setproctitle requests numpy scipy \
  pillow sentencepiece tiktoken tokenizers transformers xgrammar "llguidance<2" outlines interegular \
  partial_json_parser compressed-tensors gguf einops numba openai openai-harmony anthropic \
  mistral_common modelscope datasets prometheus-client python-multipart pybase64 blobfile soundfile \
  watchfiles xxhash zstandard nvidia-ml-py IPython easydict distro build ninja safetensors pyyaml \
  huggingface_hub regex tqdm packaging python-dateutil
"$venv/bin/python" -m pip uninstall -y torchvision >/dev/null 2>&1 || true

echo "== import stand-ins (torchvision, vllm._custom_ops)"
stubs="$venv/hpc_rl_stubs"
mkdir -p "$stubs/torchvision" "$stubs/vllm"
cat > "$stubs/torchvision/__init__.py" <<'PY'
"""Stand-in for torchvision on a CPU-only SGLang install (written by hpc_rl's install_sglang_cpu.sh).

Text-only models never call torchvision; SGLang imports it at start from its multimodal processors.
Every submodule and attribute exists as a placeholder that raises when it is used.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+hpc_rl.stub"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        return _Placeholder(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (hpc_rl CPU SGLang install)")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name):
    def __getattr__(attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Placeholder(f"{module_name}.{attribute}")
    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
__getattr__ = _module_getattr(__name__)
PY
cat > "$stubs/vllm/__init__.py" <<'PY'
"""Stand-in package for one vllm op SGLang imports on CPU (hpc_rl's install_sglang_cpu.sh)."""
PY
cat > "$stubs/vllm/_custom_ops.py" <<'PY'
"""Stand-in: SGLang imports rotary_embedding from here on non-CUDA devices; hpc_rl's flags never call it."""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("vllm._custom_ops.rotary_embedding is a stand-in (hpc_rl CPU SGLang install)")
PY
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$stubs" > "$site/hpc_rl_stubs.pth"

echo "== check"
"$venv/bin/python" -c "import torch, sglang, sglang.srt.server_args as s; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "installed: $venv (export HPC_RL_SGLANG_VENV=$venv for pytest -m sglang_cpu)"
