#!/usr/bin/env bash
# Issue 26 item 2, the serving half: the Qwen2.5-7B-shaped fp16 recipe (RANDOM weights) built with forge's own
# stages up to package, served by tritonserver (`forge serve`) and asked through tritonclient (HTTP + gRPC), in six
# device calls that overlap the carrying with the work (a session had ~6.5 min of device time for all of it).
#
#   here:   lab/gpu_7b_serve.sh pack DEST        -> DEST/c1..c6 (each <= 61 MiB; DEST ignored in the session checkout)
#   device: lab/gpu_7b_serve.sh start  DIR       call 1 (carry DIR=c1): unpack, start `bg` in its own session
#           lab/gpu_7b_serve.sh recv   DIR       calls 2..5: one more part
#           lab/gpu_7b_serve.sh finish DIR [S]   call 6: the last part, then wait up to S s for `bg`; results to $OUT
#           lab/gpu_7b_serve.sh wait - [S]       call 7 if needed, at once: wait again, collect again
#   bg (background, setsid): cp312 wheels -> /tmp/fsite; the pin's CPU onnxruntime wheel (onnxruntime 1.31.1) in
#   place of the image's 1.30; random weights (forge's source stage); forge build --until quantize (export/quantize run on the
#   CPU provider, and both ORT wheels of one pin give the same cache key: pipeline/host/tools.py TOOLS); once the GPU wheel
#   is whole, `python -m pipeline.gpu_setup install` swaps it in (as make setup does); forge build to package; then
#   python -m bench.serve (forge serve + tritonclient http,grpc vs the validated greedy tokens).
# The wheels carried are those the image lacks (docs/gpu-runs.md); transformers/tokenizers are the image's.
set -uo pipefail
. "$(dirname "$0")/late_stream.sh"
W=/tmp/h26; C=$W/carry; O=$W/o; S=$W/src
R=qwen2.5-7b-cuda-fp16
late_files() {   # the big wheels, carried as one byte stream cut into pieces (c1's spare room first)
  echo "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl numpy-1.26.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
}
case "${1:-}" in
pack)
  D=$2; WH=${WHEELS:-/tmp/h26s/wheels}; CAP=$((61 * 1024 * 1024))
  rm -rf "$D" && mkdir -p "$D/c1/w-small"
  # HEAD, with this checkout's lab/ on top (lab fixes not committed yet travel too; pipeline/ stays HEAD's)
  top=$(cd "$(dirname "$0")/.." && pwd); st=$(mktemp -d)
  git -C "$top" archive --format=tar HEAD | tar -C "$st" -xf - && cp -r "$top"/lab/. "$st/lab/" \
    && rm -rf "$st/lab/__pycache__" && tar -C "$st" -czf "$D/c1/src.tgz" . && rm -rf "$st"
  tok=$(ls -d "${FORGE_HOME:-/work/forge-home}"/models/smollm2-135m-instruct-*/ | head -1)
  tar -C "$tok" -czf "$D/c1/tok.tgz" tokenizer.json tokenizer_config.json chat_template.jinja
  tar -C "${FORGE_HOME:-/work/forge-home}/data" -czf "$D/c1/data.tgz" wiki
  for f in "$WH"/*.whl; do
    case " $(late_files) " in *" $(basename "$f") "*) ;; *) cp "$f" "$D/c1/w-small/";; esac
  done
  cp "${ORT_CPU:-/tmp/h26s/ortcpu}"/onnxruntime-1.31.1-*.whl "$D/c1/"
  late_pack "$D" "$WH" "$CAP" "$W-late.bin" 1 || exit 1
  du -sb "$D"/c*;;
start)
  mkdir -p $C $S $O && cp -r "$2"/* $C/ && tar -C $S -xzf $C/src.tgz && touch $C/"$(basename "$2")".ok
  df -h /tmp /dev/shm | tail -2; nproc; free -g | head -2
  setsid nohup bash $S/lab/gpu_7b_serve.sh bg > $W/bg.log 2>&1 < /dev/null &
  sleep 6; cat $W/bg.log;;
recv)
  cp -r "$2"/* $C/ && touch $C/"$(basename "$2")".ok; tail -4 $W/bg.log;;
finish|wait)
  # wait: a follow-up call that only waits and collects (the job can outlast one 600 s call)
  if [ "$1" = finish ]; then cp -r "$2"/* $C/ && touch $C/"$(basename "$2")".ok; fi
  end=$((SECONDS + ${3:-550}))
  collect() {
    cp $W/bg.log $O/*.json "$OUT/" 2>/dev/null
    # the logs and the serve JSON as plain files too: on 2026-12-06 the archive did not come back (files_left_out)
    cp $O/nbits.log $O/7b-*.log "$OUT/" 2>/dev/null; cp $O/serve/*.json $O/serve/*.log "$OUT/" 2>/dev/null
    tar -C $O -czf "$OUT/o7b.tgz" --exclude=engine --exclude='*.onnx*' . 2>/dev/null; }
  while [ ! -e $W/bg.done ] && [ $SECONDS -lt $end ]; do collect; sleep 5; done
  collect; tail -30 $W/bg.log;;
bg)
  t() { echo "[$(date +%T) +${SECONDS}s] $*"; }
  export FORGE_HOME=/tmp/fh FORGE_SITE=/tmp/fsite/site-packages OUT=$O FORGE_PROGRESS=0 PYTHONUNBUFFERED=1
  if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 60000000 ]; then export FORGE_CACHE=/dev/shm/fc
  else export FORGE_CACHE=/tmp/fh/artifacts; fi
  t "FORGE_CACHE=$FORGE_CACHE"; cd $S
  G="lab/gpu_ort_run.sh --exec python3 lab/gpu_7b.py"
  python3 -m pip install -q --no-index --no-deps --no-compile --target $FORGE_SITE --upgrade $C/w-small/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade $C/onnxruntime-1.31.1-*.whl
  mkdir -p $FORGE_HOME/data $W/tok && tar -C $FORGE_HOME/data -xzf $C/data.tgz && tar -C $W/tok -xzf $C/tok.tgz
  t "installed: $(python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())')"
  # the random model is the recipes' model.source random:... (forge's source stage, CPU generator); its tokenizer is
  # the builtin SmolLM2's, so the builtin's GGUF must be on the machine (lab/gpu_ort_run.py setup places it from
  # lab/gpu_carry.sh's bundle; this script's pack does NOT carry it yet: add it before the next run)
  $G weights --timeout 300; t weights
  $G forge --recipes $R --until quantize --tag a --timeout 500; t "forge a"
  carve() { late_carve "$1" $W/late $C; }
  mkdir -p $W/late
  until carve "$(late_files | cut -d' ' -f1)"; do sleep 2; done; t "ort-gpu wheel whole"
  # ONE --find-links (pipeline/gpu_setup.py takes one folder; a second replaced the first in the 2026-12-04 run and
  # pip found no onnxruntime-gpu): the GPU wheel's own needs (flatbuffers, numpy, packaging, protobuf, nvidia-*)
  # are the image's. A failed swap stops here: without onnxruntime the export key changes and export re-runs.
  if ! lab/gpu_ort_run.sh --exec python3 -m pipeline.gpu_setup install --no-index --find-links $W/late; then
    t "gpu_setup failed: stop"; touch $W/bg.done; exit 1; fi
  t "gpu_setup ok"
  lab/gpu_ort_run.sh --exec python3 -m pipeline.cli doctor --json > $O/doctor.json 2>&1
  $G forge --recipes $R --tag b --timeout 500; t "forge b"
  find $FORGE_CACHE -name generations.json -newer $S/lab -exec cp {} $O/ \;
  until carve "$(late_files | cut -d' ' -f2)" && carve "$(late_files | cut -d' ' -f3)"; do sleep 2; done
  python3 -m pip install -q --no-index --no-deps --no-compile --target $FORGE_SITE --upgrade $W/late/nvidia_pytriton-*.whl
  t "pytriton in"
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$W/late
  $G client --recipes $R --timeout 400; t "client"
  # MatMulNBits vs fp16 MatMul at M=1 on the 7B MLP shapes (the INT4 decode lever), once the GPU is free
  timeout 150 lab/gpu_ort_run.sh --exec python3 lab/nbits_kernel_bench.py --device cuda --out $O/nbits.json \
    > $O/nbits.log 2>&1; t "nbits rc $?"; tail -8 $O/nbits.log
  touch $W/bg.done;;
*) echo "usage: $0 pack DEST | start DIR | recv DIR | finish DIR [S] | wait - [S] | bg" >&2; exit 2;;
esac
