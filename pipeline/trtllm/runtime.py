"""GPU-only: run a built TensorRT-LLM engine with TensorRT-LLM's runtime and compare it to FP32.

Uses ``tensorrt_llm.runtime.ModelRunnerCpp`` (TensorRT-LLM 1.2.x). Context logits need an engine built with
``--gather_context_logits`` (recipe key ``build.tensorrt_llm.gather_context_logits: true``). Results are
labelled "engine (TensorRT-LLM runtime)" -- only code here ever produces that label.

One runner per evaluation. :class:`EngineSession` loads the engine once and feeds every chunk and prompt
through it; what this relies on, in TensorRT-LLM 1.2's own code:
- ``ModelRunnerCpp.from_dir`` with no ``max_batch_size`` / ``max_input_len`` / ``max_output_len`` takes the
  engine's own limits, so one runner covers any request the engine accepts; ``generate`` enqueues requests on
  the runner's ``Executor`` and awaits their responses, so it can be called again and again
  (tensorrt_llm/runtime/model_runner_cpp.py, the Executor-based 1.x version: ``from_dir`` "if max_batch_size is
  None: max_batch_size = model_config.max_batch_size", ``generate`` -> ``self.session.enqueue_requests`` ->
  ``_initialize_and_fill_output`` -> ``self.session.await_responses()``).
- TensorRT-LLM's own evaluation does exactly that: examples/summarize.py @ 2340c776 builds the runner once
  (``runner = runner_cls.from_dir(**runner_kwargs)``) and calls ``runner.generate`` for every batch of its
  ``while data_point_idx < len(dataset)`` loop, on every MPI rank.
- A multi-rank engine (tp * pp > 1) needs one process per rank under MPI (``WorldConfig.mpi``). Here that is ONE
  long-lived ``mpirun -n <world_size> python -m pipeline.trtllm.runtime serve ENGINE_DIR CHANNEL_DIR`` per
  evaluation: every rank loads its engine file once. Rank 0 is the executor's leader
  (``Executor.can_enqueue_requests()``; ``generate`` returns [] on the other ranks: "If we are in a multi-gpu
  scenario, only rank 0 continues") and serves requests written into CHANNEL_DIR as files. The other ranks
  call ``Executor.shutdown()``, which on a non-leader rank only joins the execution thread, and that thread
  ends when the leader's shutdown sends the terminate request (cpp/tensorrt_llm/executor/executorImpl.cpp
  @ b35ac1b6, ``Executor::Impl::shutdown``, ``fetchNewRequests``: ``reqWithId.id == mTerminateReqId``).
  ``shutdown`` is bound in Python (cpp/tensorrt_llm/nanobind/executor/executor.cpp: ``.def("shutdown", ...)``,
  ``.def("can_enqueue_requests", ...)``).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CannotRunHere, StageFailed

LABEL = "engine (TensorRT-LLM runtime)"
RUNNER = "pipeline.trtllm.runtime:load_runner"   # what `serve` builds, as module:callable
POLL_S = 0.005


def _require():
    import importlib.util
    if importlib.util.find_spec("tensorrt_llm") is None or not torch.cuda.is_available():
        raise CannotRunHere("tensorrt_llm and an NVIDIA GPU",
                            "forge build <recipe> --from evaluate on a GPU machine with tensorrt-llm 1.2.x installed "
                            "(sharing FORGE_CACHE)")


def mapping(engine_dir: str | Path) -> dict:
    return json.loads((Path(engine_dir) / "config.json").read_text())["pretrained_config"]["mapping"]


def world_size(engine_dir: str | Path) -> int:
    return int(mapping(engine_dir).get("world_size", 1))


class Runner:
    """One rank's loaded engine: ``ModelRunnerCpp`` with the two calls evaluation needs."""

    def __init__(self, model_runner):
        self.runner = model_runner
        self.leader = bool(model_runner.session.can_enqueue_requests())

    def context_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, vocab] context logits (float32 on CPU, vocab padding cut)."""
        rows = [r.to(torch.int32) for r in torch.as_tensor(ids)]
        out = self.runner.generate(batch_input_ids=rows, max_new_tokens=1, end_id=-1, pad_id=0, temperature=1.0,
                                   top_k=1, output_sequence_lengths=True, return_dict=True)
        cl = out.get("context_logits")
        if cl is None:
            raise CannotRunHere("context logits from the engine", "rebuild with build.tensorrt_llm.gather_context_logits: true")
        if isinstance(cl, list):   # 1.x: one [T_i, vocab] tensor per row (model_runner.py ModelRunnerMixin._prepare_outputs)
            cl = torch.stack(cl)
        return cl[..., : self.runner.vocab_size].float().cpu()

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation: the new tokens only (the runner returns prompt + new tokens)."""
        out = self.runner.generate(batch_input_ids=[torch.tensor(prompt_ids, dtype=torch.int32)],
                                   max_new_tokens=max_new_tokens, end_id=-1, pad_id=0, temperature=1.0, top_k=1,
                                   output_sequence_lengths=True, return_dict=True)
        seq = out["output_ids"][0, 0].cpu()
        return [int(t) for t in seq[len(prompt_ids):len(prompt_ids) + max_new_tokens]]

    def shutdown(self) -> None:
        """Leader: stop the executor (and with it the other ranks). Other ranks: wait for the leader's stop."""
        self.runner.session.shutdown()


def runner_options(engine_dir: str | Path, kv_cache_free_gpu_mem_fraction: float | None = None) -> dict:
    """``ModelRunnerCpp.from_dir`` keywords beyond engine_dir / rank, from the engine's own config.json.

    No KV-cache reuse (every window is new text). Sliding windows (Mistral, Gemma 3) are a runtime setting:
    ``max_attention_window_size`` is a per-layer ``list[int]`` in the Executor-based ``from_dir`` (TensorRT-LLM
    1.x tensorrt_llm/runtime/model_runner_cpp.py: ``max_attention_window_size: Optional[list[int]] = None`` ->
    ``trtllm.KvCacheConfig(max_attention_window=max_attention_window_size, ...)``; NVIDIA's own stored copy of that
    file is the 0.x GptSession one, so read from the upstream file as carried by ymweiss/TensorRT-LLM @ 31dda7bb and
    anand-nv/TensorRT-LLM @ 2d11190d), bound as ``std::optional<std::vector<SizeType32>>`` (NVIDIA/TensorRT-LLM
    cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp @ c40f1157, ``nb::arg("max_attention_window")``).
    Without it the engine attends to the whole context and differs from HF beyond the window.

    The KV-cache limits the memory plan assumes (docs/trtllm-memory.md): ``max_tokens_in_paged_kv_cache`` caps the
    pool at what the engine's worst case needs, so the buffers the runtime allocates per step after the pool
    (the context logits of an evaluation engine) get the rest; ``kv_cache_free_gpu_mem_fraction`` is the recipe's
    (``package.triton.kv_cache_free_gpu_mem_fraction``). Same file: ``max_tokens_in_paged_kv_cache: int | None`` and
    ``kv_cache_free_gpu_memory_fraction`` -> ``trtllm.KvCacheConfig(free_gpu_memory_fraction=..., max_tokens=...)``.
    """
    from .families import engine_attention_windows
    from .memory import engine_kv_cache_max_tokens
    cfg = json.loads((Path(engine_dir) / "config.json").read_text())
    opts: dict = {"kv_cache_enable_block_reuse": False}
    windows = engine_attention_windows(cfg)
    if windows:
        opts["max_attention_window_size"] = windows
    cap = engine_kv_cache_max_tokens(cfg)
    if cap is not None:
        opts["max_tokens_in_paged_kv_cache"] = cap
    if kv_cache_free_gpu_mem_fraction is not None:
        opts["kv_cache_free_gpu_memory_fraction"] = float(kv_cache_free_gpu_mem_fraction)
    return opts


def load_runner(engine_dir: str | Path, kv_cache_free_gpu_mem_fraction: float | None = None) -> Runner:
    """Load this MPI rank's engine once (engine limits; :func:`runner_options`)."""
    _require()
    import tensorrt_llm
    from tensorrt_llm.runtime import ModelRunnerCpp
    return Runner(ModelRunnerCpp.from_dir(engine_dir=str(engine_dir), rank=tensorrt_llm.mpi_rank(),
                                          **runner_options(engine_dir, kv_cache_free_gpu_mem_fraction)))


def _load(spec: str, engine_dir: str, kv_cache_free_gpu_mem_fraction: float | None):
    """The runner factory of ``spec`` on ``engine_dir``; the fraction is passed only when set."""
    kw = {} if kv_cache_free_gpu_mem_fraction is None else {"kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction}
    return _factory(spec)(engine_dir, **kw)


def run_request(runner, req: dict) -> dict:
    """One request of the session protocol against a loaded runner."""
    if req["op"] == "logits":
        return {"logits": runner.context_logits(req["ids"])}
    if req["op"] == "generate":
        return {"tokens": runner.generate(list(req["prompt"]), int(req["max_new_tokens"]))}
    raise ValueError(f"unknown request {req['op']!r}")


def _factory(spec: str) -> Callable[[str], Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------- multi-rank worker
def _save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)     # the reader never sees a half-written file


def serve(engine_dir: str, channel: str | Path, runner_spec: str = RUNNER,
          kv_cache_free_gpu_mem_fraction: float | None = None) -> None:
    """The program each rank runs under mpirun: load once, then (rank 0) answer ``req-N.pt`` with ``res-N.pt``
    until ``stop`` appears; the other ranks wait in the executor's shutdown until rank 0 stops."""
    channel = Path(channel)
    runner = _load(runner_spec, engine_dir, kv_cache_free_gpu_mem_fraction)
    if not runner.leader:
        runner.shutdown()
        return
    n = 0
    try:
        while True:
            req = channel / f"req-{n:06d}.pt"
            if req.exists():
                try:
                    res = run_request(runner, torch.load(req))
                except Exception as e:   # answered, and the worker keeps serving
                    res = {"error": f"{type(e).__name__}: {e}"}
                req.unlink()
                _save(res, channel / f"res-{n:06d}.pt")
                n += 1
            elif (channel / "stop").exists():
                break
            else:
                time.sleep(POLL_S)
    finally:
        runner.shutdown()


def mpi_command(n: int) -> list[str]:
    if shutil.which("mpirun") is None:
        raise CannotRunHere(f"mpirun (a {n}-rank engine needs one process per rank)",
                            "install Open MPI (TensorRT-LLM's containers have it) and rerun")
    return ["mpirun", "--allow-run-as-root", "-n", str(n)]


class MpiWorker:
    """One ``mpirun`` for the whole evaluation; requests and answers are files in a private directory."""

    def __init__(self, engine_dir: str | Path, n: int, *, runner_spec: str = RUNNER, timeout_s: float = 3600.0,
                 launch: Callable[[int], list[str]] | None = None,
                 kv_cache_free_gpu_mem_fraction: float | None = None):
        self.channel = Path(tempfile.mkdtemp(prefix="forge-trtllm-"))
        self.timeout_s = timeout_s
        self.n = 0
        cmd = (launch or mpi_command)(n) + [sys.executable, "-m", "pipeline.trtllm.runtime", "serve", str(engine_dir),
                                            str(self.channel), "--runner", runner_spec]
        if kv_cache_free_gpu_mem_fraction is not None:
            cmd += ["--kv-fraction", repr(float(kv_cache_free_gpu_mem_fraction))]
        self.log_path = self.channel / "worker.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def request(self, req: dict) -> dict:
        n, self.n = self.n, self.n + 1
        _save(req, self.channel / f"req-{n:06d}.pt")
        res_path = self.channel / f"res-{n:06d}.pt"
        deadline = time.monotonic() + self.timeout_s
        while not res_path.exists():
            if self.proc.poll() is not None:
                raise StageFailed(f"the TensorRT-LLM worker ({self.proc.args[0]}) exited with code "
                                  f"{self.proc.returncode}; its log:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise StageFailed(f"the TensorRT-LLM worker answered nothing in {self.timeout_s:.0f} s; its log:\n"
                                  f"{self._log_tail()}")
            time.sleep(POLL_S)
        res = torch.load(res_path)
        res_path.unlink()
        if "error" in res:
            raise StageFailed(f"the TensorRT-LLM worker failed a {req['op']} request: {res['error']}")
        return res

    def close(self, timeout_s: float = 120.0) -> None:
        try:
            if self.proc.poll() is None:
                (self.channel / "stop").touch()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        finally:
            shutil.rmtree(self.channel, ignore_errors=True)


class EngineSession:
    """The engine loaded once for a whole evaluation; ``with EngineSession(dir) as s: s.context_logits(ids)``.

    tp * pp == 1: the runner lives in this process. Otherwise one :class:`MpiWorker`. Nothing is loaded until
    the first request. ``runner_spec`` (``module:callable`` returning a :class:`Runner`-like object) exists so
    tests can count how often an engine is loaded.
    """

    def __init__(self, engine_dir: str | Path, *, runner_spec: str = RUNNER, launch=None,
                 kv_cache_free_gpu_mem_fraction: float | None = None):
        self.engine_dir = Path(engine_dir)
        self.runner_spec = runner_spec
        self.launch = launch
        self.kv_fraction = kv_cache_free_gpu_mem_fraction   # the recipe's package.triton.kv_cache_free_gpu_mem_fraction
        self._runner = None
        self._worker: MpiWorker | None = None

    def _call(self, req: dict) -> dict:
        if self._runner is None and self._worker is None:
            n = world_size(self.engine_dir)
            if int(mapping(self.engine_dir).get("pp_size", 1)) > 1:
                # ModelRunnerMixin._prepare_outputs (tensorrt_llm/runtime/model_runner.py, 1.x) has rank 0 wait for
                # the last pipeline rank to send the context logits, but only the leader runs generate() with the
                # Executor: that receive would never complete.
                raise StageFailed(f"{self.engine_dir}: context logits of a pipeline-parallel engine (pp_size > 1) "
                                  "cannot be read through ModelRunnerCpp; evaluate a build with build.tensorrt_llm.pp: 1")
            if n == 1:
                self._runner = _load(self.runner_spec, str(self.engine_dir), self.kv_fraction)
            else:
                self._worker = MpiWorker(self.engine_dir, n, runner_spec=self.runner_spec, launch=self.launch,
                                         kv_cache_free_gpu_mem_fraction=self.kv_fraction)
        if self._runner is not None:
            return run_request(self._runner, req)
        return self._worker.request(req)

    def context_logits(self, ids) -> torch.Tensor:
        return self._call({"op": "logits", "ids": torch.as_tensor(ids, dtype=torch.long)})["logits"]

    def generate(self, prompt_ids, max_new_tokens: int) -> list[int]:
        return self._call({"op": "generate", "prompt": [int(t) for t in prompt_ids],
                           "max_new_tokens": int(max_new_tokens)})["tokens"]

    def close(self) -> None:
        runner, worker, self._runner, self._worker = self._runner, self._worker, None, None
        if runner is not None:
            runner.shutdown()
        if worker is not None:
            worker.close()

    def __enter__(self) -> "EngineSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_outputs(engine_dir: str | Path, input_ids: Any) -> dict:
    """Context logits ``[B, T, V]`` of ``input_ids`` from the engine (one session, one load)."""
    _require()
    with EngineSession(engine_dir) as s:
        return {"context_logits": s.context_logits(input_ids)}


def validate_engine(engine_dir: str | Path, fp32_logits: torch.Tensor, input_ids: Any) -> dict:
    """Compare the engine's context logits with FP32 logits (pipeline.eval.metrics), labelled as an engine run."""
    from ..eval.metrics import compare_logits
    res = engine_outputs(engine_dir, input_ids)
    metrics = compare_logits(fp32_logits, res["context_logits"][..., :fp32_logits.shape[-1]], input_ids)
    return {"label": LABEL, **metrics}


if __name__ == "__main__":  # mpirun entry: python -m pipeline.trtllm.runtime serve ENGINE CHANNEL [--runner M:F] [--kv-fraction F]
    args, opts = sys.argv[1:4], sys.argv[4:]
    usage = "usage: python -m pipeline.trtllm.runtime serve ENGINE_DIR CHANNEL_DIR [--runner MODULE:CALLABLE] [--kv-fraction F]"
    if len(args) != 3 or args[0] != "serve" or len(opts) % 2 or any(k not in ("--runner", "--kv-fraction")
                                                                    for k in opts[::2]):
        sys.exit(usage)
    kv = dict(zip(opts[::2], opts[1::2]))
    serve(args[1], args[2], kv.get("--runner", RUNNER),
          float(kv["--kv-fraction"]) if "--kv-fraction" in kv else None)
