#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU and a CUDA PyTorch:
#
#     bash loadtest/gpu/gpu_check.sh [LOG_DIR] [STAGE...]
#
# Stages, in this order unless named: env, kernels (the CUDA kernels' tests on the GPU), model (a
# random model of SmolLM2's sizes), greedy-f32, serve-f32 (serve --device cuda --attention-backend
# cuda: greedy against transformers, then loadtest.bench.throughput; serve-f32-torch: the same with the
# PyTorch reference attention), bench (python -m loadtest.kernels.attention on
# the GPU), ipc (the CUDA IPC all-reduce tests), greedy-bf16, serve-bf16 (the 16-bit kernels),
# profile (python -m loadtest.profile --device cuda: where a step's time goes). Each runs under its own
# time limit; stdout gets each stage's tail and exit code, LOG_DIR (default $OUT or /tmp/gpu-check)
# every log in logs.tgz. Reads:
#   .gpu/smollm2/  SmolLM2's config and tokenizer (python -m loadtest.gpu.check export-config --out
#                  .gpu/smollm2, made where the embedded model is installed)
#   .whl/*.whl     wheels of packages the machine lacks (pyzmq, structlog) or has in a version that
#                  fails (numpy 2.5 breaks numba-cuda 0.30.4), installed to /tmp/site, ahead of the rest
#   PYTHON         the interpreter (default python3)
#   DEVICE, F32_ATTENTION  cuda and cuda by default; cpu and numba try the script's plumbing on a CPU
#
#     bash loadtest/gpu/gpu_check.sh --prepare
#
# run here, before asking for a GPU, writes the two folders the run reads (git-ignored; a device
# call carries them: carry [".gpu", ".whl"]).
set -u
if [ "${1:-}" = "--prepare" ]; then
  set -e
  "${PYTHON:-.venv/bin/python}" -m loadtest.gpu.check export-config --out .gpu/smollm2
  # the versions that ran on the H200 of 2026-12-04 (Python 3.12 there); numpy below 2.5 for numba-cuda
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 structlog==26.1.0 numpy==2.4.6
  du -sh .gpu .whl
  exit 0
fi
LOG_DIR=${1:-${OUT:-/tmp/gpu-check}}
shift || true
STAGES=${*:-env kernels model greedy-f32 serve-f32 bench ipc greedy-bf16 serve-bf16 profile}
PY=${PYTHON:-python3}
LOGS=$(mktemp -d /tmp/gpu-check-logs.XXXX)
MODEL=/tmp/gpu-check-model
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda}
F32_ATTENTION=${F32_ATTENTION:-cuda}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PAGEDSERVE_LOG_FORMAT=json PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH#$PWD}"
fi
SECONDS=0

run() {  # run NAME LIMIT_S COMMAND...: the command's output to $LOGS/NAME.log, its tail here
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (limit ${limit} s, at ${SECONDS} s)"
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  grep -v -E '^\{"|Loading weights|it/s\]' "$LOGS/$name.log" | tail -n "${TAIL:-25}"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  # after every stage: a run cut short keeps what it did
  tar czf "$LOG_DIR/logs.tgz" --warning=no-file-ignored -C "$LOGS" .
  return $rc
}

serve_check() {  # serve_check NAME DTYPE FLAGS...: start serve, compare with transformers, measure
  local name=$1 dtype=$2 pid up=0
  shift 2
  echo "=== $name: serve $* (at ${SECONDS} s)"
  TMPDIR=$LOGS setsid $PY -m services.cli serve --model "$MODEL" --device "$DEVICE" --port "$PORT" "$@" \
    >"$LOGS/$name-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then up=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  grep -h -E '"event": "(device chosen|dtype chosen|model loaded|warmed up)"' "$LOGS/$name-serve.log" | cut -c1-400
  if [ $up = 1 ]; then
    echo "=== $name: ready after $((SECONDS)) s"
    run "$name-compare" 90 $PY -m loadtest.gpu.check compare --url "http://127.0.0.1:$PORT" --model "$MODEL" \
      --device "$DEVICE" --dtype "$dtype"
    run "$name-throughput" 120 $PY -m loadtest.bench.throughput --url "http://127.0.0.1:$PORT" --skip-hf \
      --num-requests 64 --warmup 8
  else
    echo "=== $name: serve did not become ready"; tail -n 30 "$LOGS/$name-serve.log" | cut -c1-600
  fi
  kill -TERM -- -$pid 2>/dev/null; sleep 3; kill -KILL -- -$pid 2>/dev/null
  grep -h -E '"level": "(error|critical)"|Traceback|Error' "$LOGS/$name-serve.log" | head -n 10 | cut -c1-600
}

for stage in $STAGES; do
  case $stage in
    env)
      nvidia-smi -L
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
      run env 60 $PY -c "
import sys, torch, numba, transformers
import numpy
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'numba', numba.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)
try:
    import importlib.metadata as md; print('numba-cuda', md.version('numba-cuda'))
except Exception as exc: print('numba-cuda: not installed', exc)
from numba import cuda
print('numba sees a GPU:', cuda.is_available()); cuda.detect()
from services.executor.device import device_summary, resolve_device
print(device_summary(resolve_device('auto')))
import zmq, structlog, msgpack, aiohttp, uvloop, prometheus_client; print('service packages import')
" ;;
    kernels)
      run kernels 120 $PY -m pytest -q --noconftest -p no:cacheprovider -o addopts= \
        tests/kernels/test_cuda.py tests/kernels/test_ptx.py tests/executor/test_device.py -rs ;;
    model)
      run model 60 $PY -m loadtest.gpu.check model --config .gpu/smollm2 --out "$MODEL" ;;
    greedy-f32)
      run greedy-f32 120 $PY -m loadtest.gpu.check greedy --model "$MODEL" --device "$DEVICE" --dtype float32 \
        --attention-backend "$F32_ATTENTION" ;;
    greedy-bf16)
      run greedy-bf16 120 $PY -m loadtest.gpu.check greedy --model "$MODEL" --device "$DEVICE" --dtype bfloat16 ;;
    serve-f32)
      serve_check serve-f32 float32 --dtype float32 --attention-backend "$F32_ATTENTION" --max-num-seqs 64 \
        --kv-cache-memory 4GiB ;;
    serve-f32-torch)  # the same with the PyTorch reference attention, for the kernels' worth
      serve_check serve-f32-torch float32 --dtype float32 --attention-backend torch --max-num-seqs 64 \
        --kv-cache-memory 4GiB ;;
    serve-bf16)
      serve_check serve-bf16 bfloat16 --dtype auto --max-num-seqs 64 --kv-cache-memory 4GiB ;;
    bench)
      run bench 120 $PY -m loadtest.kernels.attention --no-cpu --budget 0.3 ;;
    profile)  # where a step's time goes on the GPU (every region synchronized), in the default dtype
      run profile 150 $PY -m loadtest.profile --device "$DEVICE" --model "$MODEL" --steps 6 --prefill 512 ;;
    ipc)
      run ipc 150 $PY -m pytest -q --noconftest -p no:cacheprovider -o addopts= tests/executor/parallel/test_allreduce_cuda_ipc.py ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar czf "$LOG_DIR/logs.tgz" --warning=no-file-ignored -C "$LOGS" . \
  && echo "logs: $LOG_DIR/logs.tgz ($((SECONDS)) s in all)"
