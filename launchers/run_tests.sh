#!/usr/bin/env bash
# Runs the whole test suite (unit, gloo multi-process, one-node Slurm). GPU-marked tests skip on CPU.
# Exits non-zero on any failure and also when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two pytest-xdist workers by default (TRIROUTE_TEST_WORKERS=0: one process); a file's tests stay on
# one worker and every Slurm test on one worker (tests/conftest.py).
workers=${TRIROUTE_TEST_WORKERS:-2}
if [ "$workers" -gt 0 ]; then
  set -- -n "$workers" --dist loadgroup "$@"
fi
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[tests] pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
