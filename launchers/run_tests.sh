#!/usr/bin/env bash
# Runs the whole test suite (unit, gloo multi-process, one-node Slurm). GPU-marked tests skip on CPU.
# Exits non-zero on any failure and also when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[tests] pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
