#!/usr/bin/env bash
# Installs everything megatron-triroute needs on a fresh Debian/Ubuntu machine into ./.venv:
# system packages (g++ for the JIT-built C++ CPU decode kernels; OpenMPI for mpi4py/mpirun; Slurm + munge
# for the one-node test cluster),
# then the Python packages at the exact versions in constraints.txt (with the `test`, `eval`, `analysis` and `hf` extras).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null 2>&1; then
  need=()
  for pkg in g++ libopenmpi-dev openmpi-bin slurmctld slurmd slurm-client munge; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    echo "[install] apt packages: ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test,eval,analysis,hf]'
echo "[install] done: $(.venv/bin/python -c 'import torch, megatron.core, deepspeed; print("torch", torch.__version__, "megatron-core", megatron.core.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null | tail -1)"
