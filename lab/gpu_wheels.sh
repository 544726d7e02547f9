#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch 2.11+cu130 on Python 3.12 and reaches no package index), for
# lab/gpu_run.py, the `forge` CLI (typer) and pytest (issue 18's gpu tests): downloaded here into .whl/
# (gitignored), carried with `run(carry=[".whl"])` (< 64 MiB), installed there with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`. Issue 7's set (docs/gpu-runs.md) minus gguf,
# pinned to what forge's venv uses.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d .whl \
  nvidia-modelopt==0.47.0 transformers==5.24.0 huggingface-hub==2.4.0 hf-xet==1.8.0 tokenizers==0.23.3 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 omegaconf==2.4.0 \
  pulp==3.3.2 safetensors==0.8.0 psutil==7.2.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 pyyaml==6.0.4 regex==2026.11.19 filelock==4.3.1 truststore==0.10.5 \
  typer==0.29.2 click==8.5.1 shellingham==1.5.4 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
du -sh .whl
