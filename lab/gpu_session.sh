#!/usr/bin/env bash
# The GPU session of issues 13, 17 and 18 on one H200 (device tool), after the carried parts were received
# (lab/gpu_carry.sh, one `lab/gpu_ort_run.sh --phase receive` per .carry/partNN; .whl copied to /tmp/whl):
#   lab/gpu_session.sh build   setup, the 7B streaming reference (issue 13) in the background, the gpu tests and
#                                  both CUDA recipes built, evaluated on the GPU and packaged (issue 17)
#   lab/gpu_session.sh serve   tritonserver on the GPU answers generate, the GPU bench (issue 17), then the
#                                  single-GPU smoke of the distributed reference (issue 18)
#   lab/gpu_session.sh all     build + serve + bench in one call (the 7B reference on CUDA only), one archive back
#   lab/gpu_session.sh ort-build / ort-serve   issue 17 alone (no 7B reference, no .whl needed): tests, build,
#                                  the CUDA-vs-CPU diagnosis (lab/gpu_diag.py); then serve and bench
#   lab/gpu_session.sh ort-quick   the fp16 engine built to `build` and benched beside PyTorch eager, one call
# Each step stays under the device tool's 10-minute call limit; results land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT/i13" "$OUT/i18"
ref_env() { PYTHONPATH=/tmp/site:/tmp/fsite/site-packages:$PWD FORGE_PROGRESS=0 "$@"; }
# the last part received, the bundle set up, the extra wheels installed; then the 7B reference (issue 13) started in
# the background with its time limit and any further gpu_run.py flags: its pid in $bg
# the last part received, the bundle set up (onnxruntime-gpu, model, texts) and the extra wheels installed
prepare() {
  lab/gpu_ort_run.sh --phase receive >/dev/null 2>&1
  timeout "$1" lab/gpu_ort_run.sh --phase setup >/dev/null 2>&1
  # .carry/extra: older carries only (lab/gpu_carry.sh now bundles those wheels)
  if ls .carry/extra/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fsite/site-packages --upgrade .carry/extra/*.whl; fi
}
pack() { tar -C "$OUT" -czf /tmp/all.tgz --exclude='*.onnx*' . && rm -rf "${OUT:?}"/* && mv /tmp/all.tgz "$OUT/"; }
prepare_and_start_reference() {
  local setup_s=$1 ref_s=$2; shift 2
  prepare "$setup_s"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/whl/*.whl
  ref_env timeout "$ref_s" python3 lab/gpu_run.py --home /tmp --out "$OUT/i13" --work /tmp/forge-gpu --skip-smol \
    --samples 64 --batch 16 --stream-ref "$@" >"$OUT/i13/log.txt" 2>&1 &
  bg=$!
}
case "${1:-}" in
build)
  prepare_and_start_reference 150 470
  timeout 60 lab/gpu_ort_run.sh --phase test >/dev/null 2>&1; tail -3 "$OUT/test.log"
  timeout 330 lab/gpu_ort_run.sh --phase build >/dev/null 2>&1
  python3 lab/gpu_session_summary.py "$OUT"
  wait $bg; echo "7B reference rc=$?"; tail -5 "$OUT/i13/log.txt"
  ;;
serve)
  timeout 150 lab/gpu_ort_run.sh --phase serve 2>&1 | grep -E '"answer"|seconds_to_answer|server_rc' | head
  timeout 300 lab/gpu_ort_run.sh --phase bench >/dev/null 2>&1; tail -30 "$OUT/bench.log"
  ref_env timeout 90 python3 lab/tp_memory.py --out "$OUT/i18/mem1" --tp 1 --layers 2 --work /tmp/tpmem \
    --samples 2 --seq-len 128 --compare >"$OUT/i18/log.txt" 2>&1; echo "tp_memory rc=$?"
  ref_env timeout 60 python3 -m pytest -q -m "gpu and not integration" tests/trtllm/test_distributed.py \
    -p no:cacheprovider >>"$OUT/i18/log.txt" 2>&1; tail -3 "$OUT/i18/log.txt"
  ;;
all)
  # one call: setup, the 7B reference on CUDA only (background), both CUDA recipes, serve, bench; one archive back
  prepare_and_start_reference 120 180 --ref-cuda-only
  timeout 170 lab/gpu_ort_run.sh --phase build >/dev/null 2>&1
  python3 lab/gpu_session_summary.py "$OUT"
  wait $bg; echo "7B reference rc=$?"
  timeout 70 lab/gpu_ort_run.sh --phase serve 2>&1 | grep -E '"answer"|seconds_to_answer|server_rc' | head
  timeout 150 lab/gpu_ort_run.sh --phase bench >/dev/null 2>&1; tail -40 "$OUT/bench.log"
  pack
  ;;
ort-build)
  # issue 17 alone: the gpu tests, both CUDA recipes built, evaluated and packaged, the CUDA-vs-CPU diagnosis
  prepare 150
  timeout 90 lab/gpu_ort_run.sh --phase test >/dev/null 2>&1; tail -3 "$OUT/test.log"
  timeout 300 lab/gpu_ort_run.sh --phase build >/dev/null 2>&1
  python3 lab/gpu_session_summary.py "$OUT"
  timeout 150 lab/gpu_ort_run.sh --phase diag >/dev/null 2>&1; tail -30 "$OUT/diag.log"
  pack
  ;;
ort-serve)
  # issue 17 alone, after ort-build on the same machine: tritonserver on the GPU answers generate, the GPU bench
  timeout 150 lab/gpu_ort_run.sh --phase serve 2>&1 | grep -E '"answer"|seconds_to_answer|server_rc' | head
  timeout 380 lab/gpu_ort_run.sh --phase bench >/dev/null 2>&1; tail -40 "$OUT/bench.log"
  pack
  ;;
ort-quick)
  # the fp16 engine alone, built and benched (with CUDA graphs, PyTorch eager fp16 beside it): a short device session
  prepare 150
  timeout 150 lab/gpu_ort_run.sh --exec python3 -m pipeline.cli build smollm2-135m-cuda-fp16 --until build \
    --report-dir "$OUT/build" >/dev/null 2>&1
  hf=$(dirname "$(ls /tmp/fh/models/*/config.json | head -1)")
  timeout 120 lab/gpu_ort_run.sh --exec python3 -m bench.gpu \
    --engine fp16="$(readlink -f "$OUT/build/smollm2-135m-cuda-fp16/engine")" \
    --hf-dir "$hf" --no-oga --reps 3 --out "$OUT/bench" 2>&1 | grep -v onnxruntime | tail -20
  pack
  ;;
i26)
  # issue 26, after parts 01..06 were received: the last part, setup through `python -m pipeline.gpu_setup install`
  # (what make setup runs; the carried wheels stand in for the index), forge doctor, the gpu tests, the fp16 build
  lab/gpu_ort_run.sh --phase receive >/dev/null 2>&1
  timeout 240 lab/gpu_ort_run.sh --phase setup >"$OUT/setup.out" 2>&1; echo "setup rc=$?"
  grep -E "gpu_setup|NVIDIA GPU|gpu setup|onnxruntime|problem" "$OUT/setup.log" | grep -v "^ *$" | tail -12
  # a fallback only if forge's path failed (its log above says why), so the session still yields the rest
  python3 -c "import sys; sys.path[:0]=['/tmp/fsite/site-packages']; import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()" \
    || { echo "FALLBACK: plain wheel install"; python3 -m pip install -q --no-index --no-deps --force-reinstall /tmp/forge_carry/x/wheels/onnxruntime_gpu-*.whl; }
  timeout 150 lab/gpu_ort_run.sh --phase test >/dev/null 2>&1; tail -4 "$OUT/test.log"
  timeout 200 lab/gpu_ort_run.sh --exec python3 -m pipeline.cli build smollm2-135m-cuda-fp16 --until build \
    --report-dir "$OUT/build" >"$OUT/build.log" 2>&1; echo "build rc=$?"; tail -3 "$OUT/build.log"
  pack
  ;;
i26-bench)
  # issue 26: the same bench twice (fp16, fp16 + CUDA graph, PyTorch eager fp16 in that order, medians of 5 samples
  # of >= 100 ms), to quote only figures the second run reproduces
  for run in 1 2; do
    timeout 120 lab/gpu_ort_run.sh --exec python3 -m pipeline.cli build smollm2-135m-cuda-fp16 --until build \
      --report-dir "$OUT/build" >/dev/null 2>&1
    hf=$(dirname "$(ls /tmp/fh/models/*/config.json | head -1)")
    timeout 230 lab/gpu_ort_run.sh --exec python3 -m bench.gpu \
      --engine fp16="$(readlink -f "$OUT/build/smollm2-135m-cuda-fp16/engine")" \
      --hf-dir "$hf" --no-oga --out "$OUT/bench$run" 2>&1 | grep -v onnxruntime | tail -12
  done
  pack
  ;;
*) echo "usage: $0 build|serve|all|ort-build|ort-serve|ort-quick|i26|i26-bench" >&2; exit 2 ;;
esac
