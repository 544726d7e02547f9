"""Test-only engine with OrtEngine's interface over a tiny ONNX graph (numpy + onnxruntime only).

It exists so the Triton plumbing (repository layout, python stub, ensemble, batching, concurrency)
is tested in seconds without the real exported model; it is NOT forge's engine and has no KV cache.
The graph is a real ONNX model run by ONNX Runtime: logits[b, s] = W[input_ids[b, s]], with W built
so the greedy next token after t is (7 * t + 3) % V.
"""

import os

import numpy as np
import onnxruntime as ort

VOCAB = 64


def next_token(t: int) -> int:
    return (7 * t + 3) % VOCAB


class OrtEngine:
    batch_invariant = True    # every row is computed on its own (no batch-wide scales), as OrtEngine says of FP32

    def __init__(self, model_dir, threads=0):
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = int(threads)
        self.sess = ort.InferenceSession(os.path.join(model_dir, "model.onnx"), so, providers=["CPUExecutionProvider"])

    def generate(self, prompt_ids, max_new_tokens, greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None):
        ids = list(prompt_ids)
        out = []
        rng = np.random.default_rng(seed)
        for _ in range(max_new_tokens):
            logits = self.sess.run(None, {"input_ids": np.array([ids], np.int64)})[0][0, -1]
            if greedy:
                t = int(np.argmax(logits))
            else:
                p = np.exp((logits - logits.max()) / max(temperature, 1e-5))
                t = int(rng.choice(len(p), p=p / p.sum()))
            out.append(t)
            ids.append(t)
            if eos_token_id is not None and t == eos_token_id:
                break
        return out

    def generate_batch(self, prompts, max_new_tokens, greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                       eos_token_id=None):
        """OrtEngine's batched API (per-row settings); the Triton model sends every row of a batch through it."""
        n = len(prompts)

        def row(v, i):
            return v[i] if isinstance(v, (list, tuple)) else v

        return [self.generate(prompts[i], row(max_new_tokens, i), greedy=row(greedy, i), temperature=row(temperature, i),
                              top_k=row(top_k, i), top_p=row(top_p, i), seed=row(seed, i),
                              eos_token_id=row(eos_token_id, i)) for i in range(n)]


# the tiny vocabulary's words and the greedy continuation the tests expect (here, not in conftest.py: two test
# directories' conftest modules share the name "conftest" when pytest collects both)
WORDS = [f"w{i}" for i in range(VOCAB)]
EOS = VOCAB - 1  # "w63" doubles as eos; next_token never reaches it from w0.. in the tests


def expected_tokens(prompt_ids, n, eos=EOS):
    out, t = [], prompt_ids[-1]
    for _ in range(n):
        t = next_token(t)
        out.append(t)
        if t == eos:
            break
    return out
