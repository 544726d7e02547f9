"""The recipe schema: one pydantic model per section, each key with its type, default, bounds and meaning, and the
resolved :class:`Recipe` with its hash. ``build.<target>`` and ``quantize.options`` are the registered targets'
(pipeline/target_registry.py): the schema asks the registry and imports no target code."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_serializer,
                      model_validator)
from pydantic_core import InitErrorDetails

from ..hashing import sha256_json
from .. import target_registry as registry
from .ground import MAX_BATCH, MAX_GPUS, MAX_NAME_CHARS, MAX_SAMPLES, MAX_SEED, MAX_SEQ_LEN, NAME_RULE, Section
from .messages import not_one_of


# ---------------------------------------------------------------- model / data
class ModelSection(Section):
    source: str = Field("builtin:smollm2-135m-instruct", min_length=1, max_length=4096,
                        description="builtin:<name>, random:<bundled config> (seeded random weights in that model's "
                                    "shape), a local HF directory, or a hub id found in the local HF cache")
    config: Optional[str] = Field(None, min_length=1, max_length=512,
                                  description="bundled public config used for plan-time checks before weights exist")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="random:<config> only: the weights' seed")
    layers: Optional[int] = Field(None, ge=1, le=1024, description=(
        "random:<config> only: decoder layers kept at full width (default: the config's depth)"))

    @model_serializer(mode="wrap")
    def _random_keys_for_random_sources(self, handler):
        """seed and layers are dumped (hashed) for a random source only, so every other recipe's hash, and the
        package keys that record it, stay as they were before these keys existed."""
        d = handler(self)
        if not str(self.source).strip().startswith("random:"):
            d.pop("seed", None)
            d.pop("layers", None)
        return d


class TextSet(Section):
    set: str = Field(description="a set from calibration_data/manifest.yaml")
    split: str
    samples: int = Field(gt=0, le=MAX_SAMPLES)
    seq_len: int = Field(gt=1, le=MAX_SEQ_LEN)
    seed: int = Field(0, ge=0, le=MAX_SEED)


class CalibrationSection(Section):
    set: str = "sotu"
    split: str = "calib"
    samples: int = Field(32, gt=0, le=MAX_SAMPLES)
    seq_len: int = Field(256, ge=8, le=MAX_SEQ_LEN, description="also at most the model's max_position_embeddings")
    batch: int = Field(4, gt=0, le=256)
    seed: int = Field(0, ge=0, le=MAX_SEED)


# ---------------------------------------------------------------- export
class Tolerance(Section):
    atol: float = Field(gt=0)
    rtol: float = Field(ge=0)


class ExportSection(Section):
    opset: int = Field(18, ge=14, le=23)
    attention: Literal["auto", "gqa", "standard"] = Field(
        "auto", description="gqa: ONNX Runtime GroupQueryAttention with an in-place KV cache (onnxruntime target); "
                            "standard: plain ONNX attention (what TensorRT reads); auto picks by build.target")
    max_seq_len: int = Field(4096, ge=16, le=131072,
                             description="positions the exported graph serves (prompt + generated tokens)")
    parity: dict[Literal["fp32", "fp16", "bf16"], Tolerance] = Field(
        default_factory=lambda: {"fp32": Tolerance(atol=1e-3, rtol=1e-3)})


# ---------------------------------------------------------------- quantize
class DistillSection(Section):
    enabled: bool = False
    temperature: float = Field(2.0, gt=0, le=20)
    alpha: float = Field(1.0, ge=0, le=1, description="loss = alpha * T^2 * KL(teacher || student) + (1 - alpha) * "
                                                       "cross-entropy")


class QatSection(Section):
    epochs: int = Field(1, ge=1, le=3)
    lr: float = Field(1e-5, gt=0, le=1e-2)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0, le=10**6, description="fewer than the run's steps, epochs x ceil(samples / batch)")
    batch: int = Field(4, gt=0, le=256)
    samples: int = Field(64, gt=0, le=100000)
    seq_len: int = Field(256, ge=8, le=MAX_SEQ_LEN, description="also at most the model's max_position_embeddings")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    set: str = "sotu"
    split: str = "train"
    distill: DistillSection = Field(default_factory=DistillSection)


class QuantizeSection(Section):
    method: Literal["ptq", "qat", "none"] = "ptq"
    algo: str = Field("none", description="the quantization algorithm: one the build target's quantizers offer "
                                          "(pipeline/targets)")
    alpha: Optional[float] = Field(None, ge=0, le=1, description=(
        "SmoothQuant migration strength, for the quantizers that read it here (tensorrt_llm int8_sq / "
        "int8_sq_per_token: their options model's alpha, with its default; onnxruntime / tensorrt: "
        "quantize.options.smoothquant_alpha)"))
    block_size: Optional[int] = Field(None, gt=0, le=65536, description=(
        "weights per scale, for the quantizers that read it here (their options model's block_size, with its "
        "default and rules: pipeline/recipe_options.py)"))
    kv_cache: Literal["none", "int8", "fp8"] = Field("none", description="tensorrt_llm: quantized KV cache")
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "the quantizer's options: one schema per build.target and algo (the target's quantizers, "
        "pipeline/quantizer.py; the models: pipeline/recipe_options.py)"))
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    qat: QatSection = Field(default_factory=QatSection)

    @field_validator("algo")
    @classmethod
    def _offered(cls, v):
        algos = registry.quantization_algos()      # every registered target's; the target's own: quantize_problems
        if v not in algos:
            raise not_one_of(algos)
        return v


# ---------------------------------------------------------------- build
class BuildSection(Section):
    """``target`` and one section per registered target (pipeline/targets: each declares its ``build.<name>``
    model). Every target's section can be read, with its defaults, whichever target the recipe builds; only the
    section of the target it builds is dumped (its resolved form, its hash, report.json, a package's manifest), so
    registering a target or changing another target's defaults changes no recipe's hash (issue 25)."""
    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False, strict=True)
    target: str = Field(registry.DEFAULT, description="the build target (pipeline/targets): " + ", ".join(
        registry.BUILTIN) + " or a registered plug-in")

    @field_validator("target")
    @classmethod
    def _registered(cls, v):
        names = registry.names()
        if v not in names:
            raise not_one_of(names)
        return v

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data):
        """Each registered target's section validated by its model; every problem of the build section at once."""
        if not isinstance(data, dict):
            return data
        data, errors = dict(data), []
        names = registry.names()
        errors += [InitErrorDetails(type="extra_forbidden", loc=(k,), input=data[k])
                   for k in data if k != "target" and k not in names]
        if isinstance(data.get("target"), str) and data["target"] not in names:
            errors.append(InitErrorDetails(type=not_one_of(names), loc=("target",), input=data["target"]))
        for t in registry.all_targets():
            given = data.get(t.name, {})
            if isinstance(given, t.section):
                continue
            try:
                data[t.name] = t.section.model_validate(given)
            except ValidationError as e:      # located under build.<name> (a validator's own errors lose the key)
                errors += [InitErrorDetails(type=x["type"], loc=(t.name, *x["loc"]), input=x["input"],
                                            ctx=x.get("ctx", {})) for x in e.errors()]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_serializer(mode="wrap")
    def _own_section_only(self, handler):
        return {k: v for k, v in handler(self).items() if k in ("target", self.target)}

    def __setattr__(self, name, value):       # a target's section assigned whole is validated like the rest
        if name != "target" and name in registry.names() and not isinstance(value, registry.get(name).section):
            value = registry.get(name).section.model_validate(value)
        super().__setattr__(name, value)

    def section(self, name: str) -> BaseModel:
        """The ``build.<name>`` section of a registered target."""
        return getattr(self, name)

    @classmethod
    def keyed_sections(cls) -> dict[str, type[BaseModel]]:
        """The keys this section allows beyond its fields, with their models (each registered target's
        ``build.<name>``): what messages list and walk into."""
        return {t.name: t.section for t in registry.all_targets()}


# ---------------------------------------------------------------- validate
class Thresholds(Section):
    ppl_delta_pct_max: float = Field(5.0, ge=0, description="max perplexity increase vs FP32, in %")
    top1_agreement_min: float = Field(0.85, ge=0, le=1)
    logits_cosine_min: Optional[float] = Field(None, ge=-1, le=1)
    logits_max_abs_max: Optional[float] = Field(None, gt=0)
    greedy_match_min: Optional[float] = Field(None, ge=0, le=1, description="fraction of prompts whose greedy output equals FP32's")
    simulated_ppl_gap_max: Optional[float] = Field(
        None, gt=0, description="tensorrt_llm: max |checkpoint reference-numerics ppl - quantize stage's simulated ppl| "
                                "on the first eval set, in perplexity points")


class PromptsSection(Section):
    max_new_tokens: int = Field(24, ge=1, le=4096)
    limit: Optional[int] = Field(None, ge=1, le=10000, description="use only the first N prompts")


_RULE_TEXT = re.compile(r"^\s*([+-])?\s*(\d+(?:\.\d*)?|\.\d+)\s*(%)?\s*$")


class RegressionRule(Section):
    """How much worse than the last good night a metric may get: exactly one of ``abs`` or ``pct``.

    In a recipe either the mapping or the short form: ``0.5`` / ``"+0.5"`` (absolute, in the metric's
    own units) or ``"-10%"`` (relative to the last good night's value). A sign, when written, must point
    the way the metric gets worse (``-`` for speeds and agreement, ``+`` for perplexity and sizes).
    """
    abs: Optional[float] = Field(None, ge=0, description="allowed worsening in the metric's own units")
    pct: Optional[float] = Field(None, ge=0, description="allowed worsening in % of the last good night's value "
                                                         "(of its magnitude)")

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.abs is None) == (self.pct is None):
            raise ValueError("give exactly one of abs (metric units) or pct (% of the last good night), "
                             "e.g. {abs: 0.5} or '-10%'")
        return self

    def allowed(self, baseline: float) -> float:
        """The allowed worsening from ``baseline``, in the metric's units."""
        return self.abs if self.abs is not None else abs(baseline) * self.pct / 100.0

    def text(self, worse: str) -> str:
        sign = "+" if worse == "higher" else "-"
        return f"{sign}{self.abs:g}" if self.abs is not None else f"{sign}{self.pct:g}%"


def _rule(worse: Literal["higher", "lower"], source: str, description: str):
    """A regression-rule field; ``worse`` and ``source`` are read by pipeline/history (where the value is found)."""
    return Field(None, description=f"{description}; gets worse when {'higher' if worse == 'higher' else 'lower'}",
                 json_schema_extra={"worse": worse, "source": source})


class RegressionRules(Section):
    """Per metric, how much worse than the last good night (same recipe, same machine class) a night may be.

    Checked after every build, whether its stages were built or cached (pipeline/history/regression.py);
    a night beyond a rule fails with exit 1 even when every absolute gate passes.
    """
    ppl_delta_pct: Optional[RegressionRule] = _rule("higher", "evaluation:ppl_delta_pct",
                                                    "perplexity increase vs FP32, in % (abs: percentage points)")
    top1_agreement: Optional[RegressionRule] = _rule("lower", "evaluation:top1_agreement",
                                                     "top-1 token agreement with FP32, 0..1")
    logits_cosine: Optional[RegressionRule] = _rule("lower", "evaluation:logits_cosine", "logits cosine vs FP32")
    logits_max_abs: Optional[RegressionRule] = _rule("higher", "evaluation:logits_max_abs", "max |logit - FP32 logit|")
    greedy_exact_match: Optional[RegressionRule] = _rule("lower", "evaluation:greedy_exact_match",
                                                         "fraction of prompts whose greedy output equals FP32's")
    size_ratio: Optional[RegressionRule] = _rule("higher", "quantize:size_ratio", "quantized model bytes / FP32 bytes")
    stage_s: Optional[RegressionRule] = _rule("higher", "stage:duration_s",
                                              "seconds of each stage built tonight, vs the last good night that "
                                              "built it (cache hits are not timed)")
    peak_rss_mb: Optional[RegressionRule] = _rule("higher", "stage:peak_rss_mb",
                                                  "peak RSS (MB) of each stage built tonight, vs the last good night "
                                                  "that built it")
    prefill_tok_s: Optional[RegressionRule] = _rule("lower", "bench:prefill_b4",
                                                    "bench prefill tokens/s (4 x 256); from `forge history add-bench`")
    decode_tok_s: Optional[RegressionRule] = _rule("lower", "bench:decode_b1",
                                                   "bench decode tokens/s (batch 1); from `forge history add-bench`")
    ttft_s: Optional[RegressionRule] = _rule("higher", "bench:ttft_s",
                                             "bench time to first token, s; from `forge history add-bench`")

    @field_validator("*", mode="before")
    @classmethod
    def _short_form(cls, v, info):
        """'+0.5' / '-10%' / 0.5 -> {abs: 0.5} / {pct: 10}; a written sign must point the way the metric worsens."""
        if v is None or isinstance(v, (dict, RegressionRule)):
            return v
        worse = cls.model_fields[info.field_name].json_schema_extra["worse"]
        want = "+" if worse == "higher" else "-"
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"expected a number like {want}0.5, a percentage like '{want}10%', or {{abs: ..}} / {{pct: ..}}")
        if isinstance(v, str):
            m = _RULE_TEXT.match(v)
            if not m:
                raise ValueError(f"expected a number like {want}0.5 or a percentage like '{want}10%'")
            sign, mag, pct = m.group(1), float(m.group(2)), bool(m.group(3))
        else:
            sign, mag, pct = ("-" if v < 0 else None), float(abs(v)), False
        if sign and sign != want:
            raise ValueError(f"{info.field_name} gets worse when it is {worse}: write '{want}{mag:g}{'%' if pct else ''}' "
                             f"(the allowed change towards worse)")
        return {"pct": mag} if pct else {"abs": mag}

    def active(self) -> dict[str, RegressionRule]:
        return {k: v for k, v in self if v is not None}


class ValidateSection(Section):
    eval: list[TextSet] = Field(default_factory=lambda: [TextSet(set="wiki", split="eval", samples=8, seq_len=256)],
                                min_length=1, max_length=16, description="held-out text sets; at least one")
    prompts: PromptsSection = Field(default_factory=PromptsSection)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    regression: RegressionRules = Field(default_factory=RegressionRules,
                                        description="how much worse than the last good night each metric may get")
    reference: Literal["fp32", "simulated"] = Field("fp32", description=(
        "what evaluate compares the engine with and the thresholds gate: fp32 (the FP32 torch model) or simulated "
        "(the same torch model with its weights fake-quantized on the engine's grid: onnxruntime weight-only "
        "int4_wo rtn / int8 blockwise; the FP32 figures are reported beside it)"))
    fp32_thresholds: Optional[Thresholds] = Field(None, description=(
        "reference simulated only: gates on the FP32 figures reported beside the simulation's (accuracy gates of a "
        "real model; leave out for random weights, whose FP32 figures measure nothing)"))

    @model_serializer(mode="wrap")
    def _reference_when_set(self, handler):
        """reference / fp32_thresholds are dumped only when they differ from the default: every recipe that does
        not ask for a simulation keeps its hash and its package key."""
        d = handler(self)
        if d.get("reference") == "fp32":
            d.pop("reference", None)
        if d.get("fp32_thresholds") is None:
            d.pop("fp32_thresholds", None)
        return d


# ---------------------------------------------------------------- package
class TritonSection(Section):
    max_batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    decoupled: bool = False
    instance_count: int = Field(1, ge=1, le=256)
    max_queue_delay_microseconds: int = Field(0, ge=0, le=60_000_000)
    max_queue_size: int = Field(64, ge=1, le=100_000, description="onnxruntime target: requests that may wait for a "
                                "free batch row; beyond it the server answers UNAVAILABLE (HTTP 503)")
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, lt=1, description="fraction of free GPU memory for the paged "
                                                  "KV cache; TensorRT-LLM's executor requires 0 < f < 1")
    enable_kv_cache_reuse: bool = False
    max_beam_width: Optional[int] = Field(None, ge=1, le=64, description="defaults to the engine's")
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    cuda_graph_mode: bool = False
    gpu_device_ids: Optional[list[Annotated[int, Field(ge=0, lt=MAX_GPUS)]]] = Field(None, max_length=MAX_GPUS)
    default_max_tokens: int = Field(64, ge=1, le=MAX_SEQ_LEN)


class PackageSection(Section):
    triton: TritonSection = Field(default_factory=TritonSection)


# recipe keys that change no artifact's bytes: the regression rules are checked after every build against the run
# history (never cached), a description is prose. A package's manifest records the rest (Recipe.package_dict).
NOT_IN_ARTIFACTS = (("validate", "regression"), ("description",))


class Recipe(Section):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="names the report directory and the cache index: " + NAME_RULE)
    description: str = Field("", max_length=4000)
    model: ModelSection = Field(default_factory=ModelSection)
    export: ExportSection = Field(default_factory=ExportSection)
    quantize: QuantizeSection = Field(default_factory=QuantizeSection)
    build: BuildSection = Field(default_factory=BuildSection)
    validate_: ValidateSection = Field(default_factory=ValidateSection, alias="validate")
    package: PackageSection = Field(default_factory=PackageSection)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)
    _path: str = PrivateAttr("")      # the file it came from, for error messages

    @property
    def path(self) -> str:
        return self._path or self.name

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def display_dict(self) -> dict:
        """``to_dict`` as a recipe writes it, for people: each regression rule in its short, signed form
        ('-0.01', '+10%'), which says which way is worse (``{abs: 0.01}`` does not). Not hashed."""
        d = self.to_dict()
        rules = self.validate_.regression
        for name, field in type(rules).model_fields.items():
            rule = getattr(rules, name)
            if rule is not None:
                d["validate"]["regression"][field.alias or name] = rule.text(field.json_schema_extra["worse"])
        return d

    @property
    def hash(self) -> str:
        return sha256_json(self.to_dict())

    def package_dict(self) -> dict:
        """The resolved recipe as a package records it: without :data:`NOT_IN_ARTIFACTS` (changing those re-runs
        no stage, the package included)."""
        d = self.to_dict()
        for *parents, last in NOT_IN_ARTIFACTS:
            node = d
            for p in parents:
                node = node.get(p, {})
            node.pop(last, None)
        return d

    @property
    def package_hash(self) -> str:
        return sha256_json(self.package_dict())
