# Environment shared by every launcher (sourced): the project's Python and thread settings.
TRIROUTE_ROOT=${TRIROUTE_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
TRIROUTE_PYTHON=${TRIROUTE_PYTHON:-$TRIROUTE_ROOT/.venv/bin/python}
if [ ! -x "$TRIROUTE_PYTHON" ]; then
  echo "no Python at $TRIROUTE_PYTHON: run 'bash launchers/install.sh' first (or set TRIROUTE_PYTHON)" >&2
  exit 1
fi
# One thread per rank unless asked otherwise: ranks x threads must not exceed the cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
