"""Triton python-backend BLS model (``tensorrt_llm_bls`` / ``bls``): preprocessing -> engine -> postprocessing.

Same client interface as the ensemble (``text_input``, ``max_tokens`` [, sampling inputs] ->
``text_output``, ``output_ids``), written as business-logic scripting so it can stream: when this
model is decoupled and the request sets ``stream``, each engine response (new tokens) is decoded and
sent as it arrives. The engine model's name is the ``tensorrt_llm_model_name`` parameter
(``tensorrt_llm``, or ``onnxruntime_llm`` on CPU).

Every call goes through ``exec(decoupled=True)``: python_backend refuses a non-decoupled BLS call into a
decoupled model ("... is using the decoupled transaction policy ... use 'decoupled=True'",
python_backend r25.12 src/request_executor.cc RequestExecutor::Infer), and a decoupled call into a
non-decoupled model gets its one response, flagged final. The engine is called once per prompt row (the
tensorrtllm backend refuses batch > 1 unless decoupled, and then answers per row without saying which
row, triton_backend utils.cc createRequestsFromInputTensors); a non-streaming call collects every
response and joins their tokens, so it does not depend on how many responses the engine sends.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

_PRE_OUT = ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"]
_ENGINE_OUT = ["output_ids", "sequence_length"]


# each model.py stands alone in its Triton model directory (the stub imports it without forge), so this small
# reader is repeated in the python models rather than imported
def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


def _responses(model, inputs, outputs):
    """Yield the responses of one BLS call (decoupled or not); an error response raises."""
    req = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs, inputs=inputs)
    for res in req.exec(decoupled=True):
        if res.has_error():
            raise pb_utils.TritonModelException(f"{model}: {res.error().message()}")
        if res.output_tensors():   # a decoupled model may end with an empty, final-flagged response
            yield {n: pb_utils.get_output_tensor_by_name(res, n).as_numpy() for n in outputs}


def _single(model, inputs, outputs):
    got = list(_responses(model, inputs, outputs))
    if len(got) != 1:
        raise pb_utils.TritonModelException(f"{model}: expected one response, got {len(got)}")
    return got[0]


def _tokens(out):
    """Generated tokens of one engine response for one row: list per beam."""
    ids = out["output_ids"].reshape(-1, out["output_ids"].shape[-1])        # [beams, n]
    lens = out["sequence_length"].reshape(-1)                              # [beams]
    return [ids[k, : int(lens[k])].tolist() for k in range(ids.shape[0])]


def _padded(rows):
    """rows[b][beam] = token list -> output_ids [b, beams, n] (-1 padded), sequence_length [b, beams]."""
    beams = max(len(r) for r in rows)
    width = max(1, max(len(t) for r in rows for t in r))
    ids = np.full((len(rows), beams, width), -1, np.int32)
    lens = np.zeros((len(rows), beams), np.int32)
    for b, r in enumerate(rows):
        for k, t in enumerate(r):
            ids[b, k, : len(t)] = t
            lens[b, k] = len(t)
    return ids, lens


class TritonPythonModel:
    def initialize(self, args):
        self.cfg = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.cfg)
        self.engine = _param(self.cfg, "tensorrt_llm_model_name", "tensorrt_llm")
        self.pre = _param(self.cfg, "preprocessing_model_name", "preprocessing")
        self.post = _param(self.cfg, "postprocessing_model_name", "postprocessing")
        # client input -> preprocessing / engine input, written by forge (pipeline/triton/templates.py forwards):
        # one table for the ensemble, this model and the configs that must declare those inputs
        self.to_pre = json.loads(_param(self.cfg, "preprocessing_inputs"))
        self.to_engine = json.loads(_param(self.cfg, "engine_inputs"))

    def _engine_inputs(self, request, pre, row):
        eng_in = [pb_utils.Tensor("input_ids", pre["INPUT_ID"][row:row + 1, : int(pre["REQUEST_INPUT_LEN"][row, 0])]),
                  pb_utils.Tensor("input_lengths", pre["REQUEST_INPUT_LEN"][row:row + 1]),
                  pb_utils.Tensor("request_output_len", pre["REQUEST_OUTPUT_LEN"][row:row + 1]),
                  pb_utils.Tensor("end_id", pre["OUT_END_ID"][row:row + 1]),
                  pb_utils.Tensor("pad_id", pre["OUT_PAD_ID"][row:row + 1])]
        for src, dst in self.to_engine.items():   # "stream" -> "streaming" among them
            t = pb_utils.get_input_tensor_by_name(request, src)
            if t is not None:
                a = t.as_numpy()
                eng_in.append(pb_utils.Tensor(dst, a.reshape(a.shape[0], -1)[row:row + 1] if a.shape[0] > 1 else a))
        return eng_in

    def _run(self, request, send):
        pre_in = [pb_utils.Tensor(dst, t.as_numpy()) for src, dst in self.to_pre.items()
                  if (t := pb_utils.get_input_tensor_by_name(request, src)) is not None]
        pre = _single(self.pre, pre_in, _PRE_OUT)
        rows = pre["INPUT_ID"].shape[0]
        stream_t = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = bool(stream_t is not None and stream_t.as_numpy().reshape(-1)[0])
        if stream and not self.decoupled:
            raise pb_utils.TritonModelException("stream=true needs the decoupled BLS model (package.triton.decoupled: true)")
        if stream:
            if rows != 1:
                raise pb_utils.TritonModelException("stream=true takes one text_input per request")
            for out in _responses(self.engine, self._engine_inputs(request, pre, 0), _ENGINE_OUT):
                send(self._decode(*_padded([_tokens(out)])))
            return
        per_row = []
        for row in range(rows):
            beams = None
            for out in _responses(self.engine, self._engine_inputs(request, pre, row), _ENGINE_OUT):
                got = _tokens(out)
                beams = got if beams is None else [a + b for a, b in zip(beams, got)]
            if beams is None:
                raise pb_utils.TritonModelException(f"{self.engine}: no response with output tokens")
            per_row.append(beams)
        send(self._decode(*_padded(per_row)))

    def _decode(self, ids, lens):
        post = _single(self.post, [pb_utils.Tensor("TOKENS_BATCH", ids), pb_utils.Tensor("SEQUENCE_LENGTH", lens)],
                       ["OUTPUT", "OUTPUT_IDS"])
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", post["OUTPUT"]), pb_utils.Tensor("output_ids", post["OUTPUT_IDS"])])

    def execute(self, requests):
        if self.decoupled:
            # a decoupled python model answers through its response sender and returns None (pb_stub.cc)
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
