# Set-up shared by README's two commands (tools/run_default.sh, tools/run_tests.sh).
#
#   source tools/setup_env.sh && hpc_rl_setup [EXTRA ...]   # e.g. `test`: also the test requirements
#   bash tools/setup_env.sh [EXTRA ...]                     # only install (a venv it makes stays in ./.venv)
#
# Installs only what is missing, then leaves `python` (on PATH) ready to run hpc_rl from this checkout:
#   1. a quick check of setup.cfg's requirements against the interpreter's installed metadata
#      (tools/missing_requirements.py, ~0.2 s, imports nothing heavy); nothing missing -> done, no venv;
#   2. something missing and no venv active -> create (or reuse) ./.venv and activate it. It is made with
#      --system-site-packages, so whatever the machine's Python already has is used, not installed twice;
#   3. torch first, as the CPU wheel (`pip install torch==2.13.0`; anything newer pulls in CUDA) —
#      HPC_RL_TORCH_SPEC overrides it, e.g. your site's CUDA build on GPU nodes; a torch already
#      installed is kept;
#   4. then `pip install -e ".[EXTRAS]"` for the rest.
# This checkout's package wins over any other installed copy (PYTHONPATH starts with the repo).
# HPC_RL_SKIP_SETUP=1 skips all of it (use the interpreter as it is).

HPC_RL_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

hpc_rl_setup_log() { echo "setup: $*" >&2; }

hpc_rl_missing() {  # hpc_rl_missing EXTRA...: unmet requirements, one per line
  python "$HPC_RL_REPO/tools/missing_requirements.py" "$@"
}

hpc_rl_use_venv() {  # activate ./.venv, creating it first when there is none
  local venv="$HPC_RL_REPO/.venv" base_python
  if [ ! -x "$venv/bin/python" ]; then
    base_python=$(command -v python3 || command -v python) || { hpc_rl_setup_log "no python3 on PATH"; return 1; }
    hpc_rl_setup_log "no virtual environment is active: creating $venv (with $base_python, reusing its packages)"
    "$base_python" -m venv --system-site-packages "$venv" || {
      hpc_rl_setup_log "'$base_python -m venv' failed: install your Python's venv module (Debian: apt-get install python3-venv) or activate a venv first"
      return 1
    }
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
}

hpc_rl_setup() {  # hpc_rl_setup EXTRA...
  local missing
  export PYTHONPATH="$HPC_RL_REPO${PYTHONPATH:+:$PYTHONPATH}"
  [ "${HPC_RL_SKIP_SETUP:-0}" = 1 ] && return 0
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$HPC_RL_REPO/.venv/bin/python" ]; then
    source "$HPC_RL_REPO/.venv/bin/activate"  # made by an earlier run: keep using it
  fi
  command -v python >/dev/null 2>&1 || hpc_rl_use_venv || return 1
  missing=$(hpc_rl_missing "$@") || return 1
  [ -z "$missing" ] && return 0
  hpc_rl_setup_log "missing: $(echo "$missing" | tr '\n' ' ')"
  if [ -z "${VIRTUAL_ENV:-}" ]; then
    hpc_rl_use_venv || return 1
    missing=$(hpc_rl_missing "$@") || return 1
    [ -z "$missing" ] && return 0
  fi
  if echo "$missing" | grep -q '^torch\b'; then
    hpc_rl_setup_log "installing torch first: ${HPC_RL_TORCH_SPEC:-torch==2.13.0}"
    python -m pip install "${HPC_RL_TORCH_SPEC:-torch==2.13.0}" || return 1
  fi
  local extras
  extras=$(IFS=,; echo "$*")
  hpc_rl_setup_log "installing hpc_rl${extras:+[$extras]} (editable) and its requirements into $(python -c 'import sys; print(sys.prefix)')"
  python -m pip install -e "$HPC_RL_REPO${extras:+[$extras]}" || return 1
  missing=$(hpc_rl_missing "$@") || return 1
  if [ -n "$missing" ]; then
    hpc_rl_setup_log "still missing after installing: $(echo "$missing" | tr '\n' ' ')"
    return 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # executed, not sourced
  set -euo pipefail
  hpc_rl_setup "$@"
fi
