"""The evaluation engine and the deploy engine: one checkpoint, two trtllm-build runs that differ only in
``--gather_context_logits`` (issue 27). ``engines_record`` is what the manifest keeps of both and proves they
differ in nothing else; ``greedy_agreement`` runs both engines on the same prompts (GPU with tensorrt_llm) and
compares their greedy tokens, so the engine that is served is held to the engine that was validated."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import StageFailed

# Keys of the engine's config.json build_config allowed to differ: the flag itself, and each build's own
# timing-cache paths (BuildConfig.input_timing_cache / output_timing_cache point into its own output dir).
MAY_DIFFER = ("gather_context_logits", "input_timing_cache", "output_timing_cache")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: d}


def engines_record(eval_config: dict, deploy_config: dict) -> dict:
    """{"evaluation": ..., "deploy": ..., "differ_in": {key: [evaluation, deploy]}} from the two engines'
    config.json; StageFailed when they differ in anything but :data:`MAY_DIFFER` or the flag is not the
    evaluation engine's alone."""
    e = _flat(eval_config.get("build_config", {}))
    d = _flat(deploy_config.get("build_config", {}))
    diff = {k: [e.get(k), d.get(k)] for k in sorted(set(e) | set(d)) if e.get(k) != d.get(k)}
    bad = [k for k in diff if k.split(".")[-1] not in MAY_DIFFER]
    if bad:
        raise StageFailed("the deploy engine (build_deploy) and the evaluation engine (build) differ in "
                          + ", ".join(f"{k}: {diff[k][0]!r} vs {diff[k][1]!r}" for k in bad)
                          + "; they must come from one checkpoint and one build section: rebuild both "
                            "(forge build <recipe> --from build)")
    if e.get("gather_context_logits") is not True or d.get("gather_context_logits"):
        raise StageFailed(f"gather_context_logits is {e.get('gather_context_logits')!r} in the evaluation engine and "
                          f"{d.get('gather_context_logits')!r} in the deploy engine; expected true / false")
    return {"evaluation": {"stage": "build", "gather_context_logits": True, "role": "validated (context logits)"},
            "deploy": {"stage": "build_deploy", "gather_context_logits": False, "role": "packaged for Triton"},
            "differ_in": {k: v for k, v in diff.items() if k.endswith("gather_context_logits")}}


def greedy_tokens(engine_dir, prompts: list[list[int]], max_new_tokens: int, *, runner_spec: str | None = None,
                  kv_cache_free_gpu_mem_fraction: float | None = None):
    """One engine's greedy tokens for every prompt, through one :class:`~pipeline.trtllm.runtime.EngineSession`
    (loaded once, closed before the other engine is loaded: the two never share the GPU)."""
    from .runtime import RUNNER, EngineSession
    with EngineSession(engine_dir, runner_spec=runner_spec or RUNNER,
                       kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction) as s:
        return [list(s.generate(p, max_new_tokens)) for p in prompts]


def greedy_agreement(eval_tokens: list[list[int]], deploy_tokens: list[list[int]], min_agreement: float) -> dict:
    """Compares the two engines' greedy tokens prompt by prompt, position by position up to the first
    divergence (after it the two continue from different text, so later positions say nothing). Fails below
    ``min_agreement`` of the positions."""
    if not eval_tokens or len(eval_tokens) != len(deploy_tokens):
        raise ValueError(f"greedy_agreement needs the same non-zero number of outputs from both engines, got "
                         f"{len(eval_tokens)} and {len(deploy_tokens)}")
    same = total = 0
    first = []
    for a, b in zip(eval_tokens, deploy_tokens):
        n = max(len(a), len(b))
        k = next((i for i in range(n) if i >= len(a) or i >= len(b) or a[i] != b[i]), n)
        same += k
        total += n
        first.append(None if k == n else k)
    frac = same / total if total else 0.0
    res = {"prompts": len(eval_tokens), "positions": total, "agreeing": same, "agreement": frac,
           "first_divergence": first, "min_agreement": min_agreement}
    if frac < min_agreement:
        raise StageFailed(f"the deploy engine's greedy tokens agree with the validated engine's at {frac:.3f} of "
                          f"{total} positions (needs >= {min_agreement}, validate.thresholds.top1_agreement_min); "
                          f"first divergence per prompt: {first}")
    return res
