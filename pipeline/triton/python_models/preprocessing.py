"""Triton python-backend model: text -> token ids (forge's own `preprocessing`, both targets).

Copied to ``<repo>/preprocessing/1/model.py`` at package time; the tokenizer files are copied next
to it (``tokenizer/``), so the repository is self-contained. Needs only ``numpy`` and ``tokenizers``.

Inputs (batch dim first, max_batch_size > 0): QUERY BYTES [1], REQUEST_OUTPUT_LEN INT32 [1],
END_ID / PAD_ID INT32 [1] (optional).  Outputs: INPUT_ID INT32 [-1] (right-padded with the pad id
within one request), REQUEST_INPUT_LEN INT32 [1], REQUEST_OUTPUT_LEN INT32 [1], OUT_END_ID,
OUT_PAD_ID INT32 [1].
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


# each model.py stands alone in its Triton model directory (the stub imports it without forge), so this small
# reader is repeated in the python models rather than imported
def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key, {}).get("string_value")
    return default if v is None or v.startswith("${") else v


def _flag(v):
    return str(v).strip().lower() in ("1", "true", "yes")


def special_ids(tok_dir):
    """(end_id, pad_id) from generation_config.json / config.json / tokenizer_config.json."""
    end_id = pad_id = None
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(tok_dir, name)
        if os.path.exists(p):
            with open(p) as f:
                c = json.load(f)
            if end_id is None and c.get("eos_token_id") is not None:
                e = c["eos_token_id"]
                end_id = int(e[0] if isinstance(e, list) else e)
            if pad_id is None and c.get("pad_token_id") is not None:
                pad_id = int(c["pad_token_id"])
    tc = os.path.join(tok_dir, "tokenizer_config.json")
    if (end_id is None or pad_id is None) and os.path.exists(tc):
        with open(tc) as f:
            c = json.load(f)
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        for key in ("eos_token", "pad_token"):
            t = c.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            if t and tok.token_to_id(t) is not None:
                if key == "eos_token" and end_id is None:
                    end_id = tok.token_to_id(t)
                if key == "pad_token" and pad_id is None:
                    pad_id = tok.token_to_id(t)
    if end_id is None:
        end_id = -1
    if pad_id is None:
        pad_id = end_id if end_id >= 0 else 0
    return end_id, pad_id


def tokenizer_path(args, cfg):
    d = _param(cfg, "tokenizer_dir", "tokenizer")
    if not os.path.isabs(d):
        d = os.path.join(args["model_repository"], args["model_version"], d)
    return d


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.tok_dir = tokenizer_path(args, cfg)
        self.tokenizer = Tokenizer.from_file(os.path.join(self.tok_dir, "tokenizer.json"))
        self.add_special_tokens = _flag(_param(cfg, "add_special_tokens", "true"))
        self.end_id, self.pad_id = special_ids(self.tok_dir)

    def _scalar(self, request, name, default, dtype):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        return t.as_numpy().reshape(-1).astype(dtype)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
                batch = query.shape[0]
                texts = [q.decode("utf-8") if isinstance(q, bytes) else str(q) for q in query.reshape(batch, -1)[:, 0]]
                out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy().reshape(batch, -1)[:, :1].astype(np.int32)
                end = self._scalar(request, "END_ID", self.end_id, np.int32)
                pad = self._scalar(request, "PAD_ID", self.pad_id, np.int32)
                end = np.full((batch, 1), self.end_id, np.int32) if end is None else end.reshape(batch, 1)
                pad = np.full((batch, 1), self.pad_id, np.int32) if pad is None else pad.reshape(batch, 1)
                ids = [self.tokenizer.encode(t, add_special_tokens=self.add_special_tokens).ids for t in texts]
                if any(len(x) == 0 for x in ids):
                    raise pb_utils.TritonModelException("text_input tokenizes to zero tokens; send a non-empty prompt")
                width = max(len(x) for x in ids)
                input_id = np.empty((batch, width), np.int32)
                for i, x in enumerate(ids):
                    input_id[i, :] = pad[i, 0]
                    input_id[i, : len(x)] = x
                lens = np.array([[len(x)] for x in ids], np.int32)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("INPUT_ID", input_id),
                    pb_utils.Tensor("REQUEST_INPUT_LEN", lens),
                    pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len),
                    pb_utils.Tensor("OUT_END_ID", end),
                    pb_utils.Tensor("OUT_PAD_ID", pad),
                ]))
            except Exception as e:  # one bad request must not fail the others in the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses
