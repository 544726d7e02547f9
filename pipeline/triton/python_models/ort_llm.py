"""Triton python-backend model: the KV-cache generate loop over forge's ONNX Runtime engine.

Copied to ``<repo>/onnxruntime_llm/1/model.py``; forge's engine module (``pipeline/ort/engine.py``,
numpy + onnxruntime only) is copied next to it as ``forge_ort_engine.py`` — one source of truth,
copied at package time. The engine files live in the plain onnxruntime graph model's version folder
(``parameters.engine_dir``, relative to this model's folder), so the ONNX weights exist once.

Tensor interface = the subset of TensorRT-LLM's ``tensorrt_llm`` model that forge's ensemble uses,
so the same ensemble / preprocessing / postprocessing / BLS serve both targets:
inputs  input_ids INT32 [-1], input_lengths INT32 [1], request_output_len INT32 [1],
        end_id, pad_id, runtime_top_k INT32 [1], runtime_top_p, temperature FP32 [1], seed UINT64 [1]
        (all optional except the first three);
outputs output_ids INT32 [-1, -1] (beam x generated tokens, input excluded), sequence_length INT32 [-1].
Greedy unless runtime_top_k > 1 or runtime_top_p > 0 (TensorRT-LLM's convention: both 0 = greedy).
"""

import importlib
import json
import os
import sys

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

    def _generate(self, rows):
        """All rows of all requests Triton batched together go through the engine as ONE batch (prompts of
        different lengths, each with its own settings); engines without generate_batch, or whose numbers depend on
        the batch (dynamic INT8: one activation scale per tensor), run row by row, as they were validated."""
        if hasattr(self.engine, "generate_batch") and len(rows) > 1 and getattr(self.engine, "batch_invariant", True):
            keys = ("max_new_tokens", "greedy", "temperature", "top_k", "top_p", "seed", "eos_token_id")
            return self.engine.generate_batch([p for p, _ in rows], **{k: [o[k] for _, o in rows] for k in keys})
        return [self.engine.generate(p, o["max_new_tokens"], **{k: v for k, v in o.items() if k != "max_new_tokens"})
                for p, o in rows]

    def execute(self, requests):
        responses = [None] * len(requests)
        parsed = []
        for i, request in enumerate(requests):
            try:
                parsed.append((i, self._parse(request)))
            except Exception as e:
                responses[i] = self._error(e)
        rows = [r for _, rs in parsed for r in rs]
        try:
            outs = self._generate(rows) if rows else []
        except Exception as e:
            for i, _ in parsed:
                responses[i] = self._error(e)
            return responses
        k = 0
        for i, rs in parsed:
            gens, k = outs[k:k + len(rs)], k + len(rs)
            width = max(1, max(len(g) for g in gens))
            output_ids = np.full((len(gens), 1, width), -1, np.int32)
            seq_len = np.zeros((len(gens), 1), np.int32)
            for b, g in enumerate(gens):
                output_ids[b, 0, : len(g)] = g
                seq_len[b, 0] = len(g)
            responses[i] = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("output_ids", output_ids), pb_utils.Tensor("sequence_length", seq_len)])
        return responses

    @staticmethod
    def _error(e):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))

    def finalize(self):
        self.engine = None
