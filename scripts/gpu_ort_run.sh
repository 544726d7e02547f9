#!/usr/bin/env bash
# Issue 17 on the GPU machine: puts the carried onnxruntime-gpu and wheels (/tmp/fsite/site-packages) on the path and PyTorch's
# NVIDIA libraries (libcublas.so.13, libcublasLt.so.13, libcudart.so.13, libcurand.so.10) on LD_LIBRARY_PATH --
# before Python starts, which is when the dynamic loader reads it -- then runs scripts/gpu_ort_run.py.
#   scripts/gpu_ort_run.sh --phase receive|setup|test|build|diag|serve|bench [--dry-run]
#   scripts/gpu_ort_run.sh --exec CMD ...      any command in that same environment
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${FORGE_SITE:-/tmp/fsite/site-packages}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
libs=$(env -u PYTHONPATH PYTHONPATH="$PWD" "$PY" -c "from pipeline.env import nvidia_lib_dirs; print(':'.join(nvidia_lib_dirs()))" 2>/dev/null)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FORGE_HOME=${FORGE_HOME:-/tmp/fh} FORGE_CACHE=${FORGE_CACHE:-/tmp/fh/artifacts} FORGE_PROGRESS=0
export OUT=${OUT:-$PWD/out-gpu}
if [ "${1:-}" = "--exec" ]; then shift; exec "$@"; fi
exec "$PY" scripts/gpu_ort_run.py "$@"
