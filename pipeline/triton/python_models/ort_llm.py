"""Triton python-backend model: the KV-cache generate loop over forge's ONNX Runtime engine.

Copied to ``<repo>/onnxruntime_llm/1/model.py``; forge's engine module (``pipeline/ort/engine.py``,
numpy + onnxruntime only) is copied next to it as ``forge_ort_engine.py`` — one source of truth,
copied at package time. The engine files live in the plain onnxruntime graph model's version folder
(``parameters.engine_dir``, relative to this model's folder), so the ONNX weights exist once.

Tensor interface = the subset of TensorRT-LLM's ``tensorrt_llm`` model that forge's ensemble uses,
so the same ensemble / preprocessing / postprocessing / BLS serve both targets:
inputs  input_ids INT32 [-1], input_lengths INT32 [1], request_output_len INT32 [1],
        end_id, pad_id, runtime_top_k INT32 [1], runtime_top_p, temperature FP32 [1], seed UINT64 [1],
        streaming BOOL [1] (all optional except the first three);
outputs output_ids INT32 [-1, -1] (beam x generated tokens, input excluded), sequence_length INT32 [-1].
Greedy unless runtime_top_k > 1 or runtime_top_p > 0 (TensorRT-LLM's convention: both 0 = greedy).
Responses as the tensorrtllm backend sends them: one per request with every new token, or, with
``streaming`` true (which needs the decoupled model, package.triton.decoupled: true, and one row per
request), one per new token and then a final flag-only response.
"""

import importlib
import json
import os
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


# each model.py stands alone in its Triton model directory (the stub imports it without forge), so this small
# reader is repeated in the python models rather than imported
def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        here = os.path.join(args["model_repository"], args["model_version"])
        if here not in sys.path:
            sys.path.insert(0, here)
        module = importlib.import_module(_param(cfg, "engine_module", "forge_ort_engine"))
        engine_cls = getattr(module, _param(cfg, "engine_class", "OrtEngine"))
        engine_dir = _param(cfg, "engine_dir", "engine")
        if not os.path.isabs(engine_dir):
            engine_dir = os.path.normpath(os.path.join(args["model_repository"], engine_dir))
        threads = int(_param(cfg, "intra_op_threads", "0"))
        if _param(cfg, "provider", "cpu") == "cuda":   # a package built for the CUDA provider (manifest records it)
            gpu = int(args.get("model_instance_device_id") or 0)   # KIND_GPU: the instance's GPU
            self.engine = engine_cls(engine_dir, threads, providers=["CUDAExecutionProvider"], device="cuda",
                                     device_id=gpu, cuda_graph=_param(cfg, "cuda_graph", "0") == "1")
        else:
            self.engine = engine_cls(engine_dir, threads)
        self.max_new_tokens_cap = int(_param(cfg, "max_new_tokens", "4096"))
        # rows of different requests share graph calls only when the engine says its rows are independent of
        # their batch-mates (forge_ort.json batch_invariant); a quantized engine that does not say so runs one
        # request at a time, as its greedy tokens were validated. Unquantized (FP32/FP16) graphs have no
        # batch-wide scales: tests/ort/test_batcher.py measures their batched tokens equal to each prompt alone.
        self.batcher_module = importlib.import_module(_param(cfg, "batcher_module", "forge_batcher"))
        # OrtEngine.batch_invariant is the one reading of forge_ort.json; an engine class without it is not batched
        batched = bool(getattr(self.engine, "batch_invariant", False))
        self.decoupled = bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))
        self.batcher = self.batcher_module.ContinuousBatcher(
            self.engine, max_batch=int(cfg.get("max_batch_size") or 1), max_queue=int(_param(cfg, "max_queue_size", "64")),
            batched=batched).start()

    @staticmethod
    def _opt(request, name, batch, default, dtype):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return np.full(batch, default, dtype)
        return t.as_numpy().reshape(batch, -1)[:, 0].astype(dtype)

    def _parse(self, request):
        """One request -> its rows: (prompt ids, settings) each."""
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
        ids = ids.reshape(ids.shape[0], -1)
        batch = ids.shape[0]
        in_len = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().reshape(batch, -1)[:, 0]
        out_len = pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(batch, -1)[:, 0]
        end_id = self._opt(request, "end_id", batch, -1, np.int64)
        top_k = self._opt(request, "runtime_top_k", batch, 0, np.int64)
        top_p = self._opt(request, "runtime_top_p", batch, 0.0, np.float64)
        temp = self._opt(request, "temperature", batch, 1.0, np.float64)
        seed = self._opt(request, "seed", batch, 0, np.uint64)
        rows = []
        for b in range(batch):
            n_new = int(out_len[b])
            if n_new < 1 or n_new > self.max_new_tokens_cap:
                raise ValueError(f"max_tokens must be in [1, {self.max_new_tokens_cap}], got {n_new}")
            eos = int(end_id[b])
            rows.append(([int(t) for t in ids[b, : int(in_len[b])]],
                         {"max_new_tokens": n_new, "greedy": int(top_k[b]) <= 1 and float(top_p[b]) <= 0.0,
                          "temperature": float(temp[b]), "top_k": int(top_k[b]),
                          "top_p": float(top_p[b]) if top_p[b] > 0 else 1.0, "seed": int(seed[b]),
                          "eos_token_id": eos if eos >= 0 else None}))
        return rows

    def _streaming(self, request, rows):
        t = pb_utils.get_input_tensor_by_name(request, "streaming")
        if t is None or not t.as_numpy().any():
            return False
        # a non-decoupled python model sends one response (the tensorrtllm backend refuses this case too);
        # a token response says no row, so a streamed request has one
        if not self.decoupled:
            raise ValueError("streaming=true needs the decoupled model (package.triton.decoupled: true)")
        if len(rows) != 1:
            raise ValueError(f"streaming=true takes one row per request, got {len(rows)}")
        return True

    def execute(self, requests):
        """Hand each request's rows to the continuous batcher and return at once (None): the batcher thread
        answers through each request's response sender (python_backend README "Default Mode": since 24.06 a
        non-decoupled model may send its one response with InferenceResponseSender and the
        TRITONSERVER_RESPONSE_COMPLETE_FINAL flag; src/pb_stub.cc ProcessReturnedResponses accepts a None return;
        triton-inference-server/python_backend@f9088ff6). Triton then hands the next requests to execute while
        earlier ones decode, and they join the running batch between decode steps."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                rows = self._parse(request)
                stream = self._streaming(request, rows)
            except Exception as e:
                sender.send(self._error(e), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            answer = _Answer(sender, len(rows), stream)
            jobs = [self.batcher_module.Job(p, o["max_new_tokens"], **{k: v for k, v in o.items() if k != "max_new_tokens"},
                                            on_done=answer.done(b), on_token=answer.token(b) if stream else None,
                                            cancelled=sender.is_cancelled)
                    for b, (p, o) in enumerate(rows)]
            try:
                self.batcher.submit(jobs)
            except self.batcher_module.QueueFull as e:
                sender.send(self._error(e, pb_utils.TritonError.UNAVAILABLE),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as e:
                sender.send(self._error(e), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    @staticmethod
    def _error(e, code=None):
        msg = f"{type(e).__name__}: {e}"
        err = pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=err)

    def finalize(self):
        self.batcher.stop()
        self.engine = None


def _tensors(gens):
    width = max(1, max(len(g) for g in gens))
    output_ids = np.full((len(gens), 1, width), -1, np.int32)
    seq_len = np.zeros((len(gens), 1), np.int32)
    for b, g in enumerate(gens):
        output_ids[b, 0, : len(g)] = g
        seq_len[b, 0] = len(g)
    return [pb_utils.Tensor("output_ids", output_ids), pb_utils.Tensor("sequence_length", seq_len)]


class _Answer:
    """One request's rows (usually one): the final response once every row is done. Streaming (one row, decoupled
    model): each new token is sent as it is picked, then a final flag-only response."""

    def __init__(self, sender, rows, stream):
        self.sender, self.gens, self.left, self.error = sender, [None] * rows, rows, None
        self.stream = stream
        self.lock = threading.Lock()

    def token(self, b):
        def on_token(job, tok):
            if self.stream:
                self.sender.send(pb_utils.InferenceResponse(output_tensors=_tensors([[tok]])))
        return on_token

    def done(self, b):
        def on_done(job, error):
            with self.lock:
                self.gens[b] = job.tokens
                self.error = self.error or error
                self.left -= 1
                if self.left:
                    return
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if self.error is not None:
                self.sender.send(TritonPythonModel._error(self.error), flags=final)
            elif self.stream:
                self.sender.send(flags=final)
            else:
                self.sender.send(pb_utils.InferenceResponse(output_tensors=_tensors(self.gens)), flags=final)
        return on_done
