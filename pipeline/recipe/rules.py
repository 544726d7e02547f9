"""Rules across a recipe's sections that need no model facts (those are the stages' plan_problems): the quantize
section against its target's quantizers, thresholds only another target produces, the target's own ``checks``, the
data sets a recipe names, and what ``export.attention: auto`` means for its target."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import target_registry as registry
from .messages import section_problems

if TYPE_CHECKING:
    from .schema import Recipe


def quantize_problems(q: dict, target: str) -> list[str]:
    """The quantize section's rules for ``target``, each message starting with its key: algo and method fit the
    target, alpha / block_size only where the quantizer reads them, QAT warm-up inside the run, and
    ``quantize.options`` against the quantizer's options schema (pipeline/recipe_options.py). ``q`` is the
    section as a dict (defaults filled in); values of the wrong type are left to the schema."""
    t = registry.get(target)
    p = []
    method, algo, kv = q.get("method"), q.get("algo"), q.get("kv_cache", "none")
    allowed = t.algos
    if isinstance(algo, str) and algo not in allowed:
        hint = f"; {t.algo_hints[algo]}" if algo in t.algo_hints else ""
        p.append(f"quantize.algo: '{algo}' is not available for build.target '{target}' "
                 f"(allowed: {', '.join(sorted(allowed))}){hint}")
    kv_targets = [x.name for x in registry.all_targets() if x.kv_cache]
    if kv != "none" and not t.kv_cache:
        p.append(f"quantize.kv_cache: '{kv}' is a {' / '.join(kv_targets)} setting (a quantized KV cache); "
                 f"build.target '{target}' keeps it in the model dtype: remove it")
    quantizes = algo != "none" or (kv != "none" and t.kv_cache)
    if method == "none" and algo != "none":
        p.append(f"quantize.method is 'none' but quantize.algo is '{algo}': set quantize.method to ptq or qat")
    if method in ("ptq", "qat") and not quantizes:
        what = f"pick an algo (or, for {target}, a kv_cache)" if t.kv_cache else "pick an algo"
        p.append(f"quantize.method is '{method}' but quantize.algo is 'none' (nothing is quantized): {what} or set "
                 "method: none")
    if method == "qat" and not t.qat:
        qat = " / ".join(f"'{x.name}'" for x in registry.all_targets() if x.qat)
        p.append(f"quantize.method 'qat' needs build.target {qat} (ModelOpt fake-quant models do not "
                 f"export to ONNX); use method: ptq for '{target}'")
    qz = t.quantizers.get(algo) if isinstance(algo, str) else None
    for key in ("alpha", "block_size"):
        moved = t.moved_section_keys.get(key)
        if q.get(key) is not None and moved:
            opt = moved.rsplit(".", 1)[1]
            if qz is not None and opt in qz.options.model_fields:
                p.append(f"quantize.{key}: build.target '{target}' reads this as {moved} (one spelling per option); "
                         f"did you mean '{moved}'?")
            else:
                users = sorted(f"{target} {a}" for a, z in t.quantizers.items() if opt in z.options.model_fields)
                p.append(f"quantize.{key}: not read by build.target '{target}' with algo '{algo}' (read by: "
                         f"{', '.join(users)}, as {moved}); remove it")
        elif q.get(key) is not None and qz is not None and key not in qz.section_keys:
            users = sorted(f"{target} {a}" for a, z in t.quantizers.items() if key in z.section_keys)
            p.append(f"quantize.{key}: not read by build.target '{target}' with algo '{algo}' (read by: "
                     f"{', '.join(users) or 'no algo of this target'}); remove it")
    if method == "qat" and isinstance(q.get("qat"), dict):
        qat = q["qat"]
        ints = [qat.get(k) for k in ("epochs", "samples", "batch", "warmup_steps")]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in ints) and qat["batch"] > 0:
            steps = qat["epochs"] * -(-qat["samples"] // qat["batch"])
            if not 0 <= qat["warmup_steps"] < steps:
                p.append(f"quantize.qat.warmup_steps: must be in [0, {steps}) (the run has {steps} steps), "
                         f"got {qat['warmup_steps']!r}")
    if qz is not None and isinstance(q.get("options"), dict):
        opts, renamed = dict(q["options"]), {}
        # an option a section key stands for (any of the target's quantizers) is written as that key
        moved = {opt: f"quantize.{key}" for z in t.quantizers.values() for key, opt in z.section_keys.items()}
        moved |= t.moved_options
        for opt in [o for o in opts if o in moved]:
            p.append(f"quantize.options.{opt}: build.target '{target}' reads this as {moved[opt]} "
                     f"(one spelling per option); did you mean '{moved[opt]}'?")
            del opts[opt]
        # a section key that stands for an option is validated by the option's model, named as the recipe wrote it
        for key, opt in qz.section_keys.items():
            if q.get(key) is not None:
                opts[opt] = q[key]
                renamed[f"quantize.options.{opt}:"] = f"quantize.{key}:"
        for m in section_problems(qz.options, opts, ("quantize", "options"), hidden=set(moved)):
            head, _, rest = m.partition(" ")
            p.append(renamed.get(head, head) + " " + rest)
    return p


def semantic_problems(recipe: Recipe, source: str) -> list[str]:
    """Cross-field rules that need no model facts (those run at plan time, see stages)."""
    target = recipe.build.target
    p = [f"{source}: {m}" for m in quantize_problems(recipe.quantize.model_dump(), target)]
    t = recipe.validate_.thresholds
    own = registry.get(target)
    for key in sorted({k for x in registry.all_targets() for k in x.thresholds} - set(own.thresholds)):
        if getattr(t, key) is not None:
            producers = sorted(x.name for x in registry.all_targets() if key in x.thresholds)
            p.append(f"{source}: validate.thresholds.{key} gates a metric only build.target "
                     f"{' / '.join(producers)} produces; remove it for '{target}'")
    if own.checks is not None:
        p += [f"{source}: {m}" for m in own.checks(recipe)]
    p += data_set_problems(recipe, source)
    p += [f"{source}: {m}" for m in model_problems(recipe.model)]
    v = recipe.validate_
    if v.reference == "simulated" and not own.simulated_reference:
        offers = " / ".join(sorted(x.name for x in registry.all_targets() if x.simulated_reference)) or "no target"
        p.append(f"{source}: validate.reference: 'simulated' is offered by build.target {offers}; "
                 f"'{target}' is gated against fp32: remove it")
    if v.fp32_thresholds is not None and v.reference != "simulated":
        p.append(f"{source}: validate.fp32_thresholds: read only with validate.reference: simulated (with fp32 the "
                 "thresholds already gate the FP32 figures): move them to validate.thresholds")
    return p


def model_problems(m) -> list[str]:
    """A random source names a bundled config and fits model.layers; seed / layers only for a random source."""
    from .. import random_weights
    return random_weights.model_problems(m.source, m.seed, m.layers)


def data_set_problems(recipe: Recipe, source: str) -> list[str]:
    """Every data set / split the recipe names exists in calibration_data/manifest.yaml (before any stage runs)."""
    from .. import data as datasets
    from ..errors import ForgeError
    q = recipe.quantize
    named = [(f"validate.eval.{i}", e.set, e.split) for i, e in enumerate(recipe.validate_.eval)]
    named.append(("quantize.calibration", q.calibration.set, q.calibration.split))
    if q.method == "qat":
        named.append(("quantize.qat", q.qat.set, q.qat.split))
    out = []
    for key, set_name, split in named:
        try:
            datasets.set_digest(set_name, split)
        except ForgeError as e:
            out.append(f"{source}: {key}: {e}")
    return out


def export_attention(recipe: Recipe) -> str:
    """export.attention with ``auto`` resolved: what the target reads (gqa for onnxruntime, standard for tensorrt)."""
    a = recipe.export.attention
    return registry.get(recipe.build.target).onnx_attention if a == "auto" else a
