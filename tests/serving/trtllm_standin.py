"""TEST FIXTURE, NOT AN ENGINE: a decoupled python-backend stand-in for the ``tensorrt_llm`` model.

The serving tests swap the generated ``tensorrt_llm`` model's backend from ``tensorrtllm`` (not in the
nvidia-pytriton server) to ``python`` and put this file in as its ``model.py``. Everything else -- the
ensemble, preprocessing, postprocessing and the BLS model -- is forge's generated repository, unchanged,
running in the real tritonserver. The stand-in produces no language-model output: its "next token" is the
fixed rule of tests/serving/tiny_engine.py, (7 * t + 3) % 64, so the tests know every expected token.

What it enforces, as the tensorrtllm backend of the 1.2 line does (sources in trtllm_backend_contract.py):
- at load: the model is decoupled (the TensorRT-LLM recipes deploy it so), and its ``parameters`` pass
  ``check_parameters`` -- a missing required key fails the load like "Cannot find parameter with name";
  ``gpt_model_path`` must exist.
- per request: ``input_ids`` / ``input_lengths`` / ``request_output_len`` must be there (utils.cc
  createRequestsFromInputTensors; streaming and batch > 1 are allowed because the model is decoupled).
- responses (model_instance_state.cc WaitForResponse): non-streaming -> one response per row with all new
  tokens; streaming -> one response per new token; the final flag rides on the last data response.
  ``exclude_input_in_output`` (parameter, or per-request input) drops the prompt from ``output_ids``.
The python backend itself enforces the caller's side: a BLS ``exec(decoupled=False)`` into this decoupled
model is refused (python_backend src/request_executor.cc).
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

VOCAB = 64


def next_token(t: int) -> int:
    return (7 * t + 3) % VOCAB


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        if here not in sys.path:
            sys.path.insert(0, here)
        import trtllm_backend_contract as contract

        cfg = json.loads(args["model_config"])
        params = contract.model_parameters(cfg)
        problems = contract.check_parameters(params)
        if not pb_utils.using_decoupled_model_transaction_policy(cfg):
            problems.append("model_transaction_policy.decoupled: false; this stand-in covers the decoupled deployment "
                            "(package.triton.decoupled: true, as the TensorRT-LLM recipes set)")
        path = params.get("gpt_model_path", "")
        if path and not os.path.exists(path):
            problems.append(f"Decoder (GPT) model path at {path} does not exist.")
        if problems:
            raise pb_utils.TritonModelException("tensorrt_llm stand-in refuses this config: " + "; ".join(problems))
        self.exclude_input = contract.as_bool(params.get("exclude_input_in_output", "false"))

    @staticmethod
    def _input(request, name, required=False):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None and required:
            raise ValueError(f"{name} is not present in the request")
        return None if t is None else t.as_numpy()

    def _rows(self, request):
        ids = self._input(request, "input_ids", True)
        ids = ids.reshape(ids.shape[0], -1)
        n = ids.shape[0]
        lens = self._input(request, "input_lengths", True).reshape(n, -1)[:, 0]
        out_len = self._input(request, "request_output_len", True).reshape(n, -1)[:, 0]
        end = self._input(request, "end_id")
        end = np.full(n, -1) if end is None else end.reshape(n, -1)[:, 0]
        excl = self._input(request, "exclude_input_in_output")
        excl = self.exclude_input if excl is None else bool(excl.reshape(-1)[0])
        for b in range(n):
            prompt = [int(t) for t in ids[b, : int(lens[b])]]
            gen, t = [], prompt[-1]
            for _ in range(int(out_len[b])):
                t = next_token(t)
                gen.append(t)
                if t == int(end[b]):
                    break
            yield prompt, gen, excl

    @staticmethod
    def _response(tokens):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", np.array([[tokens]], np.int32).reshape(1, 1, -1)),
            pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], np.int32))])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                streaming = self._input(request, "streaming")
                streaming = bool(streaming is not None and streaming.reshape(-1)[0])
                rows = list(self._rows(request))
                if streaming and len(rows) > 1:
                    raise ValueError("the stand-in streams one row per request")
                out = []
                for prompt, gen, excl in rows:
                    if streaming:   # the executor streams new tokens only
                        out += [[t] for t in gen]
                    else:
                        out.append(gen if excl else prompt + gen)
                for i, tokens in enumerate(out):
                    sender.send(self._response(tokens),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == len(out) - 1 else 0)
                if not out:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as e:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
