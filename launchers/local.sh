#!/usr/bin/env bash
# Local launcher: torchrun on one machine (CPU or GPU).
#   NPROC=2 bash launchers/local.sh --recipe tiny [key=value ...]
# NPROC defaults to the number of GPUs, or 1 on a CPU machine. torchrun's agent stops every rank
# when one dies (exit non-zero), so a crashed rank never leaves the others hanging.
set -euo pipefail
cd "$(dirname "$0")/.."
source launchers/common.sh
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$TRIROUTE_PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
exec "$TRIROUTE_PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m megatron_triroute.train "$@"
