"""evaluate: run the built artifact and the FP32 torch reference side by side on held-out text.

What is compared is named in the metrics (`subject`): an ONNX Runtime engine, a TensorRT-LLM
checkpoint through reference numerics, or a TensorRT-LLM engine through its runtime.
Gates are applied by the separate, cheap `validate` stage, so changing a threshold re-runs
only that.
"""

from __future__ import annotations

import json

from .. import data as datasets
from ..progress import progress_bar
from .base import Stage, StageContext
from .common import eval_sets, model_dir, set_digests, tokenizer, windows

CHUNK = 2  # windows per forward: bounds memory (2 x 256 x 49152 fp32 logits = 100 MB per side)


def greedy_by_recompute(cand, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding for candidates that only expose full-sequence logits (no KV cache)."""
    import torch
    ids = list(prompt_ids)
    for _ in range(n):
        logits = cand.logits(torch.tensor([ids], dtype=torch.long))
        ids.append(int(torch.as_tensor(logits)[0, -1].argmax()))
    return ids[len(prompt_ids):]


class EvaluateBase(Stage):
    version = "1"
    tools = ("torch", "transformers")
    subject = ""

    def config(self, r):
        return {"eval": [e.model_dump() for e in r.validate_.eval],
                "prompts": r.validate_.prompts.model_dump()}

    def data(self, r, home):
        return set_digests(r, eval_sets(r) + [("prompts", "all")])

    def measured_on(self) -> dict | None:
        """Machine facts recorded with the metrics when they depend on this machine's CPU (None: they do not)."""
        return None

    def reference_device(self, r) -> str:
        """Where the FP32 torch reference runs: the CPU, unless the candidate runs on a GPU."""
        return "cpu"

    def candidate(self, ctx: StageContext):
        """An object with .logits(input_ids[B,T]) -> [B,T,V] and .generate(prompt_ids, n, greedy=True); a .close(),
        if it has one, is called once when the evaluation ends."""
        raise NotImplementedError

    def run(self, ctx: StageContext) -> dict:
        cand = self.candidate(ctx)
        try:
            return self._evaluate(ctx, cand)
        finally:   # a candidate that holds an engine (a runner, an mpirun worker) releases it once, here
            close = getattr(cand, "close", None)
            if close is not None:
                close()

    def _evaluate(self, ctx: StageContext, cand) -> dict:
        # torch is imported when a stage runs, not when the flow is declared (the recipe schema reads the targets)
        from ..eval.metrics import LogitsComparer, greedy_match
        from ..eval.reference import TorchReference
        mdir = model_dir(ctx)
        ref = TorchReference(mdir, device=self.reference_device(ctx.recipe))
        per_set = {}
        total = LogitsComparer()
        for e in ctx.recipe.validate_.eval:
            ids = windows(ctx, e.set, e.split, e.samples, e.seq_len, e.seed)
            cmp = LogitsComparer()
            with progress_bar(f"evaluate {e.set}/{e.split}", ids.shape[0]) as advance:
                for s in range(0, ids.shape[0], CHUNK):
                    chunk = ids[s:s + CHUNK]
                    r_l = ref.logits(chunk, desc="fp32 reference")
                    c_l = cand.logits(chunk)
                    cmp.update(r_l, c_l, chunk)
                    total.update(r_l, c_l, chunk)
                    advance(chunk.shape[0])
            per_set[f"{e.set}/{e.split}"] = cmp.result()

        p = ctx.recipe.validate_.prompts
        tok = tokenizer(str(mdir))
        prompts = datasets.load_prompts()[: p.limit] if p.limit else datasets.load_prompts()
        ref_out, cand_out = [], []
        with progress_bar("greedy generation", len(prompts)) as advance:
            for text in prompts:
                ids = tok(text, add_special_tokens=False)["input_ids"]
                ref_out.append(ref.generate_greedy(ids, p.max_new_tokens))
                gen = getattr(cand, "generate", None)
                out = gen(ids, p.max_new_tokens, greedy=True) if gen else greedy_by_recompute(cand, ids, p.max_new_tokens)
                cand_out.append(list(map(int, out)))
                advance()
        gm = greedy_match(ref_out, cand_out)
        generations = [{"prompt": t, "reference": r, "candidate": c, "reference_text": tok.decode(r),
                        "candidate_text": tok.decode(c)} for t, r, c in zip(prompts, ref_out, cand_out)]
        (ctx.out / "generations.json").write_text(json.dumps(generations, indent=2))
        overall = total.result()
        metrics = {"subject": self.subject, **{k: overall[k] for k in (
            "ref_ppl", "ppl", "ppl_delta_pct", "top1_agreement", "logits_cosine", "logits_max_abs", "tokens")},
            "greedy_exact_match": gm["exact_match"], "greedy_prefix_ratio": gm["prefix_ratio"],
            "per_set": per_set}
        if (machine := self.measured_on()) is not None:
            metrics["measured_on"] = machine
        (ctx.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics
