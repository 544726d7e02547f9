"""Triton python-backend model: token ids -> text (forge's own `postprocessing`, both targets).

Copied to ``<repo>/postprocessing/1/model.py``; tokenizer files in ``tokenizer/`` next to it.
Inputs: TOKENS_BATCH INT32 [-1, -1] (beams x tokens, generated tokens only), SEQUENCE_LENGTH INT32
[-1] (per beam). Outputs: OUTPUT BYTES [-1] (one text per beam), OUTPUT_IDS INT32 [-1, -1] (the
tokens the text was decoded from, padded with -1), so clients can compare tokens exactly.
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


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        d = _param(cfg, "tokenizer_dir", "tokenizer")
        if not os.path.isabs(d):
            d = os.path.join(args["model_repository"], args["model_version"], d)
        self.tokenizer = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        self.skip_special_tokens = str(_param(cfg, "skip_special_tokens", "true")).lower() in ("1", "true", "yes")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lens = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
                if tokens.ndim == 2:  # no batch dim in front: one request row
                    tokens, lens = tokens[None], lens.reshape(1, -1)
                batch, beams = tokens.shape[0], tokens.shape[1]
                lens = lens.reshape(batch, beams)
                texts = np.empty((batch, beams), dtype=object)
                ids_out = np.full(tokens.shape, -1, np.int32)
                for b in range(batch):
                    for k in range(beams):
                        n = int(lens[b, k])
                        ids = tokens[b, k, :n].tolist()
                        ids_out[b, k, :n] = ids
                        texts[b, k] = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens).encode("utf-8")
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("OUTPUT", texts), pb_utils.Tensor("OUTPUT_IDS", ids_out)]))
            except Exception as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses
