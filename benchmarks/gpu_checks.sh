#!/usr/bin/env bash
# Every check that needs a GPU, in one command (docs/gpu.md records what it measured):
#   1. the gpu-marked tests (Triton kernels, the CUDA path against the CPU path for training and
#      for the inference engine, a decode step under CUDA's sync check; the Transformer Engine spec
#      where TE is installed);
#   2. benchmarks/bench_train_step.py at the 160m shape, bf16, micro-batches of 4 and 16 sequences:
#      Dense vs TriRoute step time, tokens/s, model TFLOP/s and MFU, a device profile and a host
#      profile of two steps of each; then micro-batch 16 with the experts on DeepSpeed's dispatch
#      (router.expert_compute=deepspeed) against the grouped matmuls the default takes, and with the
#      local mode as blockwise SDPA (router.local_attention=blocks) against FlexAttention, the GPU's default;
#   3. benchmarks/bench_paged_attention.py: one layer's decode attention over the mixed-precision
#      pools against SDPA over a dense float16 cache, CUDA-graph timed, batch 1 and 64 at 2,048 and
#      8,192 context; then the kernel's knobs not yet measured on a GPU (`--variants`: payload loads
#      beside the positions, the codes' domain, a register cap, two pages per block) at 8,192;
#   4. short end-to-end runs of the trainer (launchers/local.sh, one GPU, bf16 by default on CUDA)
#      for the 160m recipe, TriRoute and Dense, on an already-built dataset;
#   5. benchmarks/bench_decode.py --device cuda: the engine's whole decode step against the plain
#      decoder on the GPU, CUDA-graphed, batch 1 and 64 at 8,192 context (the decode issue's GPU
#      targets); it runs second, after the tests.
#
#   bash benchmarks/gpu_checks.sh OUTDIR [DATA=data/tiny] [STEPS=20]
#   STAGES="bench-decode-cuda bench-train-step-mb16" bash benchmarks/gpu_checks.sh OUTDIR   # only these
#
# STAGES (default: all) names the stages to run, each by its name or a prefix of it (the names are the
# "=== NAME" lines of checks.log: gpu-tests, bench-decode-cuda, bench-train-step-mbN,
# bench-train-step-deepspeed-experts, bench-train-step-blocks-local, bench-paged-attention,
# bench-paged-attention-variants, train-160m, train-160m-dense). Their time limits add up to about 31
# minutes, more than one lease of a GPU may hold: STAGES="bench-decode-cuda bench-train-step-mb16" (8
# minutes of limits) gives the decode and training issues' headline GPU figures first.
#
# OUTDIR gets checks.log (everything printed), bench-mbN.json per micro-batch size N in
# MICRO_BATCHES (default "4 16"), profile/{triroute,dense}_{ops,sources,host}.txt of the last,
# bench-mb16-deepspeed-experts.json, bench-mb16-blocks-local.json, paged-attention.json,
# paged-attention-variants.json, decode-cuda.json, and per training run train-NAME.log (its last line holds the run's
# summary); OUTDIR/all.tgz packs them all (for a runner that returns few files). Runs write their checkpoints under
# ${GPU_RUNS:-/tmp/gpu-runs}. Each stage has its own time limit; a failing stage does not stop the
# next, and the exit status is the number of stages that failed.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_checks.sh OUTDIR [DATA] [STEPS]}
DATA=${2:-data/tiny}
STEPS=${3:-20}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/profile"
export TRIROUTE_PYTHON=${TRIROUTE_PYTHON:-$(command -v python3)} PYTHONUNBUFFERED=1
PY=$TRIROUTE_PYTHON
RUNS=${GPU_RUNS:-/tmp/gpu-runs}
FAILS=$(mktemp)
STAGES=${STAGES:-all}
wanted() {  # wanted NAME: whether STAGES selects the stage NAME (all, or a name or prefix of it)
  [ "$STAGES" = all ] && return 0
  local s
  for s in $STAGES; do
    case "$1" in "$s"*) return 0 ;; esac
  done
  return 1
}
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, count failures
  local name=$1 limit=$2
  shift 2
  if ! wanted "$name"; then
    echo "=== $name: not in STAGES ($STAGES)"
    return 0
  fi
  echo "=== $name ($(date +%T), limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || echo "$name" >> "$FAILS"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, triton, megatron.core, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "megatron-core", megatron.core.__version__, "deepspeed", deepspeed.__version__)' 2>&1 | tail -1
  stage gpu-tests 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu.py tests/model/test_te_spec.py \
    tests/experts/test_grouped.py tests/model/test_mode_attention.py tests/routing/test_device_values.py \
    tests/inference/test_gpu.py tests/gpu \
    tests/benchmarks/test_bench_decode.py::test_quick_cells_on_cuda_time_synchronised_steps_that_read_nothing_back
  stage bench-decode-cuda 300 bash -c "\"$PY\" benchmarks/bench_decode.py --device cuda --contexts 8192 \
    --batches 1 64 --systems triroute --json > \"$OUT/decode-cuda.json\""
  for mb in ${MICRO_BATCHES:-4 16}; do  # the last one is profiled
    stage "bench-train-step-mb$mb" 180 "$PY" benchmarks/bench_train_step.py --recipe 160m --micro-batch "$mb" \
      --bf16 --warmup 3 --repeats 10 --profile "$OUT/profile" --host-profile "$OUT/profile" --out "$OUT/bench-mb$mb.json"
  done
  # the experts through DeepSpeed's dispatch, against the grouped matmuls the default takes on a GPU
  stage bench-train-step-deepspeed-experts 180 "$PY" benchmarks/bench_train_step.py --recipe 160m --micro-batch 16 \
    --bf16 --warmup 3 --repeats 10 triroute.router.expert_compute=deepspeed --out "$OUT/bench-mb16-deepspeed-experts.json"
  # the local mode as blockwise SDPA (router.local_attention=blocks) against FlexAttention, the default on a GPU
  stage bench-train-step-blocks-local 180 "$PY" benchmarks/bench_train_step.py --recipe 160m --micro-batch 16 \
    --bf16 --warmup 3 --repeats 10 triroute.router.local_attention=blocks --out "$OUT/bench-mb16-blocks-local.json"
  stage bench-paged-attention 150 bash -c "\"$PY\" benchmarks/bench_paged_attention.py --graph --json > \"$OUT/paged-attention.json\""
  stage bench-paged-attention-variants 200 bash -c "\"$PY\" benchmarks/bench_paged_attention.py --graph --json \
    --batches 64 1 --contexts 8192 --repeats 7 --variants early=1 codes=1 codes=1,early=1 maxnreg=128 \
    early=1,maxnreg=128 codes=1,early=1,maxnreg=128 early=1,pages_per_block=2 codes=1,early=1,pages_per_block=2 \
    > \"$OUT/paged-attention-variants.json\""
  for recipe in 160m 160m-dense; do
    rm -rf "$RUNS/$recipe"
    # the run's output to its own log (bash -c's $0), the stage's lines to checks.log
    stage "train-$recipe" 100 bash -c 'bash launchers/local.sh "$@" > "$0" 2>&1' "$OUT/train-$recipe.log" \
      --recipe "$recipe" data.path="$DATA" output_dir="$RUNS/$recipe" \
      train.steps="$STEPS" train.global_batch_size=16 train.micro_batch_size=4 optim.warmup_steps=5 \
      train.eval_interval="$STEPS" train.eval_batches=8 train.log_interval=5 train.peak_tflops=989
    [ -f "$OUT/train-$recipe.log" ] && grep -E "INFO (step|eval|budget|finished)" "$OUT/train-$recipe.log" | tail -4
  done
} 2>&1 | tee "$OUT/checks.log"
echo "stages failed: $(wc -l < "$FAILS") $(tr '\n' ' ' < "$FAILS")"
tar czf "$OUT/all.tgz" --exclude=all.tgz -C "$OUT" .
exit "$(wc -l < "$FAILS")"
