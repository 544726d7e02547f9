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
from .common import eval_sets, model_dir, set_digests, source_note, tokenizer, windows

CHUNK = 2  # windows per forward: bounds memory (2 x 256 x 49152 fp32 logits = 100 MB per side)


def greedy_by_recompute(cand, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding for candidates that only expose full-sequence logits (no KV cache)."""
    import torch
    ids = list(prompt_ids)
    for _ in range(n):
        logits = cand.logits(torch.tensor([ids], dtype=torch.long))
        ids.append(int(torch.as_tensor(logits)[0, -1].argmax()))
    return ids[len(prompt_ids):]


def score_logits(ref, cand_logits, sets, label: str, *, keep: dict | None = None,
                 kept: dict | None = None) -> tuple[dict, dict]:
    """A candidate's logits against the reference's on every eval set: (figures per set, figures pooled over all
    sets). ``sets``: [(name, ids [N, T])]; ``cand_logits(ids) -> [B, T, V]``. ``keep``: store the candidate's
    logits per chunk; ``kept``: take them from there instead of running the candidate again. The bench scores its
    peers with this too (bench/gates.py), so a peer is judged on exactly what gates our engines."""
    from ..eval.metrics import LogitsComparer
    per_set = {}
    total = LogitsComparer()
    for name, ids in sets:
        cmp = LogitsComparer()
        with progress_bar(f"evaluate {name} ({label})", ids.shape[0]) as advance:
            for s in range(0, ids.shape[0], CHUNK):
                chunk = ids[s:s + CHUNK]
                r_l = ref.logits(chunk, desc=label)
                c_l = kept.pop((name, s)) if kept is not None else cand_logits(chunk)
                if keep is not None:
                    keep[(name, s)] = c_l
                cmp.update(r_l, c_l, chunk)
                total.update(r_l, c_l, chunk)
                advance(chunk.shape[0])
        per_set[name] = cmp.result()
    return per_set, total.result()


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

    def simulation(self, ctx: StageContext, model_config) -> dict | None:
        """``validate.reference: simulated``: the grid spec the reference's weights are put on
        (pipeline/eval/fake_quant.py), or None to compare with the FP32 model (the default)."""
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
        """The candidate against the reference on every eval set (logits) and the prompts (greedy). With a
        simulated reference the FP32 model is scored first (the figures reported beside, ``fp32``), the candidate's
        logits kept on the CPU, then the same model's weights are put on the engine's grid and scored against the
        same candidate logits: one torch model in memory, the candidate run once."""
        # torch is imported when a stage runs, not when the flow is declared (the recipe schema reads the targets)
        from ..eval.reference import TorchReference
        mdir = model_dir(ctx)
        ref = TorchReference(mdir, device=self.reference_device(ctx.recipe))
        spec = self.simulation(ctx, ref.config)
        sets = [(f"{e.set}/{e.split}", windows(ctx, e.set, e.split, e.samples, e.seq_len, e.seed))
                for e in ctx.recipe.validate_.eval]
        p = ctx.recipe.validate_.prompts
        tok = tokenizer(str(mdir))
        prompts = datasets.load_prompts()[: p.limit] if p.limit else datasets.load_prompts()
        prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in prompts]
        n_new = p.max_new_tokens

        kept: dict | None = {} if spec is not None else None
        fp32 = self._score(ref, cand, sets, prompt_ids, n_new, "fp32 reference", keep=kept)
        if spec is None:
            scored, reference = fp32, None
        else:
            done = ref.simulate(spec)
            scored = self._score(ref, cand, sets, prompt_ids, n_new, "simulated reference", kept=kept,
                                 cand_greedy=fp32["cand_greedy"])
            reference = {"kind": "simulated", "grid": {k: v for k, v in spec.items() if k != "expect_quantized"},
                         "quantized": done, "ppl": scored["total"]["ref_ppl"],
                         "ppl_vs_fp32_pct": 100.0 * (scored["total"]["ref_ppl"] / fp32["total"]["ref_ppl"] - 1.0)}

        generations = [{"prompt": t, "reference": r, "candidate": c, "reference_text": tok.decode(r),
                        "candidate_text": tok.decode(c)}
                       for t, r, c in zip(prompts, scored["ref_greedy"], scored["cand_greedy"])]
        (ctx.out / "generations.json").write_text(json.dumps(generations, indent=2))
        metrics = {"subject": self.subject, **self._figures(scored)}
        if spec is not None:   # fp32 evaluations keep their payload (and the keys downstream) as before
            metrics["reference"] = reference
            metrics["fp32"] = self._figures(fp32)
        if (note := source_note(ctx)) is not None:
            metrics["note"] = note
        if (machine := self.measured_on()) is not None:
            metrics["measured_on"] = machine
        (ctx.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics

    @staticmethod
    def _figures(scored: dict) -> dict:
        overall, gm = scored["total"], scored["greedy"]
        return {**{k: overall[k] for k in (
            "ref_ppl", "ppl", "ppl_delta_pct", "top1_agreement", "logits_cosine", "logits_max_abs", "tokens")},
            "greedy_exact_match": gm["exact_match"], "greedy_prefix_ratio": gm["prefix_ratio"],
            "per_set": scored["per_set"]}

    def _score(self, ref, cand, sets, prompt_ids, max_new_tokens: int, label: str, *, keep: dict | None = None,
               kept: dict | None = None, cand_greedy: list | None = None) -> dict:
        """One reference against the candidate: logits per set and pooled, greedy continuations of the prompts.
        ``keep``: store the candidate's logits per chunk; ``kept``: take them from there instead of running the
        candidate again (``cand_greedy`` likewise for its greedy tokens)."""
        from ..eval.metrics import greedy_match
        per_set, total = score_logits(ref, cand.logits, sets, label, keep=keep, kept=kept)
        ref_out, cand_out = [], []
        with progress_bar(f"greedy generation ({label})", len(prompt_ids)) as advance:
            for i, ids in enumerate(prompt_ids):
                ref_out.append(ref.generate_greedy(ids, max_new_tokens))
                if cand_greedy is not None:
                    cand_out.append(cand_greedy[i])
                else:
                    gen = getattr(cand, "generate", None)
                    out = gen(ids, max_new_tokens, greedy=True) if gen else \
                        greedy_by_recompute(cand, ids, max_new_tokens)
                    cand_out.append(list(map(int, out)))
                advance()
        return {"per_set": per_set, "total": total, "greedy": greedy_match(ref_out, cand_out),
                "ref_greedy": ref_out, "cand_greedy": cand_out}
