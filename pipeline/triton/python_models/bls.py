"""Triton python-backend BLS model (``tensorrt_llm_bls``): preprocessing -> engine -> postprocessing.

Same client interface as the ensemble (``text_input``, ``max_tokens`` [, sampling inputs] ->
``text_output``, ``output_ids``), written as business-logic scripting so it can stream: when this
model is decoupled and the request sets ``stream``, the engine model is called decoupled and each
engine response (new tokens) is decoded and sent as it arrives. The engine model's name is the
``tensorrt_llm_model_name`` parameter (``tensorrt_llm``, or ``onnxruntime_llm`` on CPU).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

# ensemble input -> (preprocessing input | engine input)
_PRE = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN", "end_id": "END_ID", "pad_id": "PAD_ID"}
_ENGINE = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature", "seed": "seed"}


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


def _call(model, inputs, outputs, decoupled=False):
    req = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs, inputs=inputs)
    res = req.exec(decoupled=decoupled)
    if decoupled:
        return res
    if res.has_error():
        raise pb_utils.TritonModelException(f"{model}: {res.error().message()}")
    return {n: pb_utils.get_output_tensor_by_name(res, n).as_numpy() for n in outputs}


class TritonPythonModel:
    def initialize(self, args):
        self.cfg = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.cfg)
        self.engine = _param(self.cfg, "tensorrt_llm_model_name", "tensorrt_llm")
        self.pre = _param(self.cfg, "preprocessing_model_name", "preprocessing")
        self.post = _param(self.cfg, "postprocessing_model_name", "postprocessing")

    def _run(self, request, send):
        pre_in = [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in _PRE.items()
                  if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]
        pre = _call(self.pre, pre_in, ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"])
        eng_in = [pb_utils.Tensor("input_ids", pre["INPUT_ID"]), pb_utils.Tensor("input_lengths", pre["REQUEST_INPUT_LEN"]),
                  pb_utils.Tensor("request_output_len", pre["REQUEST_OUTPUT_LEN"]),
                  pb_utils.Tensor("end_id", pre["OUT_END_ID"]), pb_utils.Tensor("pad_id", pre["OUT_PAD_ID"])]
        eng_in += [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in _ENGINE.items()
                   if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]
        stream_t = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = bool(stream_t is not None and stream_t.as_numpy().reshape(-1)[0])
        if stream and not self.decoupled:
            raise pb_utils.TritonModelException("stream=true needs the decoupled BLS model (package.triton.decoupled: true)")
        outs = ["output_ids", "sequence_length"]
        if stream:
            eng_in.append(pb_utils.Tensor("streaming", np.array([[True]])))
            for res in _call(self.engine, eng_in, outs, decoupled=True):
                if res.has_error():
                    raise pb_utils.TritonModelException(f"{self.engine}: {res.error().message()}")
                if not res.output_tensors():
                    continue  # final empty response
                ids = pb_utils.get_output_tensor_by_name(res, "output_ids").as_numpy()
                lens = pb_utils.get_output_tensor_by_name(res, "sequence_length").as_numpy()
                send(self._decode(ids, lens))
        else:
            eng = _call(self.engine, eng_in, outs)
            send(self._decode(eng["output_ids"], eng["sequence_length"]))

    def _decode(self, ids, lens):
        post = _call(self.post, [pb_utils.Tensor("TOKENS_BATCH", ids), pb_utils.Tensor("SEQUENCE_LENGTH", lens)],
                     ["OUTPUT", "OUTPUT_IDS"])
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", post["OUTPUT"]), pb_utils.Tensor("output_ids", post["OUTPUT_IDS"])])

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                sender = request.get_response_sender()
                try:
                    self._run(request, sender.send)
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception as e:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        responses = []
        for request in requests:
            got = []
            try:
                self._run(request, got.append)
                responses.append(got[-1])
            except Exception as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses
