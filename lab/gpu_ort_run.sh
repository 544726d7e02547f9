#!/usr/bin/env bash
# Issue 17 on the GPU machine: puts the carried wheels (/tmp/fsite/site-packages) on the path, then runs
# lab/gpu_ort_run.py.
#   lab/gpu_ort_run.sh --phase receive|setup|test|build|diag|serve|bench [--dry-run]
#   lab/gpu_ort_run.sh --exec CMD ...      any command in that same environment
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${FORGE_SITE:-/tmp/fsite/site-packages}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# no LD_LIBRARY_PATH: forge loads the NVIDIA wheels' CUDA libraries itself (pipeline.host.cuda.preload_cuda, issue 26)
export FORGE_HOME=${FORGE_HOME:-/tmp/fh} FORGE_CACHE=${FORGE_CACHE:-/tmp/fh/artifacts} FORGE_PROGRESS=0
export OUT=${OUT:-$PWD/out-gpu}
if [ "${1:-}" = "--exec" ]; then shift; exec "$@"; fi
exec "$PY" lab/gpu_ort_run.py "$@"
