"""Recipe schema, loading, `extends:` inheritance and dotted `--set` overrides.

Every problem is collected and reported at once, each naming the file, the key path and
what is allowed, so a user fixes a recipe in one pass instead of one error per run.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_serializer,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from .errors import MAX_PROBLEMS_SHOWN, RecipeError
from .hashing import sha256_json
from . import target_registry as registry

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = "smollm2-135m-int8"
MAX_NAME_CHARS = 128
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_RULE = "letters, digits, '.', '-' and '_', starting with a letter or digit"


# Upper bounds on counts: a typo like 10^40 samples is an error at resolve time, not an hour of work.
MAX_SAMPLES = 4096
MAX_SEQ_LEN = 131072
MAX_BATCH = 4096
MAX_SEED = 2**32 - 1          # numpy's seed range
MAX_THREADS = 1024
MAX_GPUS = 64


class Section(BaseModel):
    # NaN/inf are never meaningful in a recipe (a NaN threshold passes or fails every gate silently); strict: no
    # silent coercion ("64" is not 64, "yes" is not true) -- YAML and --set already give typed values
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)


# ---------------------------------------------------------------- model / data
class ModelSection(Section):
    source: str = Field("builtin:smollm2-135m-instruct", min_length=1, max_length=4096,
                        description="builtin:<name>, a local HF directory, or a hub id found in the local HF cache")
    config: Optional[str] = Field(None, min_length=1, max_length=512,
                                  description="bundled public config used for plan-time checks before weights exist")


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
def _not_one_of(choices) -> PydanticCustomError:
    """The error pydantic gives a Literal, for choices the registry knows at run time: "Input should be 'a', 'b'
    or 'c'" (so every message about a choice reads the same)."""
    q = [f"'{c}'" for c in choices]
    return PydanticCustomError("literal_error", "Input should be {expected}",
                               {"expected": q[0] if len(q) == 1 else f"{', '.join(q[:-1])} or {q[-1]}"})


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
        "SmoothQuant migration strength (tensorrt_llm int8_sq: default 1.0, ModelOpt's; int8_sq_per_token: default "
        "0.5, TensorRT-LLM's; onnxruntime int8: "
        "quantize.options.smoothquant_alpha)"))
    block_size: Optional[int] = Field(None, gt=0, le=65536, description=(
        "weights per scale (tensorrt_llm int4: default 128 where it divides every width; onnxruntime int8 "
        "blockwise / int4_wo: default 32, a power of two >= 16, its options model's block_size)"))
    kv_cache: Literal["none", "int8", "fp8"] = Field("none", description="tensorrt_llm: quantized KV cache")
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "the quantizer's options: one schema per build.target and algo (the target's quantizers, pipeline/targets; "
        "the models: pipeline/recipe_options.py)"))
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    qat: QatSection = Field(default_factory=QatSection)

    @field_validator("algo")
    @classmethod
    def _offered(cls, v):
        algos = registry.quantization_algos()      # every registered target's; the target's own: quantize_problems
        if v not in algos:
            raise _not_one_of(algos)
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
            raise _not_one_of(names)
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
            errors.append(InitErrorDetails(type=_not_one_of(names), loc=("target",), input=data["target"]))
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


# ---------------------------------------------------------------- loading
# A recipe is a few hundred bytes; these bounds keep a hostile or broken file from taking minutes or memory.
MAX_RECIPE_BYTES = 256 * 1024
MAX_RECIPE_VALUES = 5000          # mappings + sequences + scalars, after expanding YAML aliases
MAX_RECIPE_DEPTH = 16             # the schema is 5 levels deep
MAX_KEY_PARTS = 16                # --set a.b.c...


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def list_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.yaml") if p.is_file())


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def _is_path(spec: str) -> bool:
    """A recipe given as a file (ends in .yaml/.yml or names a directory part); anything else is a name."""
    return spec.endswith((".yaml", ".yml")) or "/" in spec or "\\" in spec


def _check_file(p: Path, shown: str) -> Path:
    try:
        if p.is_dir():
            raise RecipeError([f"{shown}: is a directory, not a recipe file; give a .yaml file or a recipe name "
                               f"(`forge recipes list`)"])
        if not p.is_file():
            if p.is_symlink():      # is_file() follows links: a dangling link or a loop of links lands here
                raise RecipeError([f"{shown}: a symbolic link that leads to no file (dangling, or a loop of "
                                   "links); point it at a recipe file"])
            if p.exists():          # reading a FIFO would wait forever, a device never ends
                raise RecipeError([f"{shown}: not a regular file (a FIFO, socket or device); give a .yaml file"])
            raise RecipeError([f"{shown}: no such recipe file"])
    except OSError as e:            # e.g. a name too long for the file system
        raise RecipeError([f"{_short(shown)}: cannot be opened as a recipe file ({e.strerror or e})"]) from None
    return p


def recipe_path(name_or_path: str, recipes_dir: Path = RECIPES_DIR, relative_to: Path | None = None) -> Path:
    """The file of a recipe: a path (``x.yaml``, ``dir/x.yaml``) as given, or a name looked up in ``recipes_dir``.

    A name never leaves ``recipes_dir`` (no ``/``, no ``..``); files elsewhere are given as paths.
    ``relative_to`` anchors relative paths (an ``extends:`` is relative to the file that says it).
    """
    spec = str(name_or_path)
    if not spec.strip():
        raise RecipeError(["a recipe name or path is required, got an empty string"])
    if _is_path(spec):
        p = Path(spec).expanduser()
        if relative_to is not None and not p.is_absolute():
            p = relative_to / p
        return _check_file(p, spec)
    if len(spec) > MAX_NAME_CHARS or not NAME_RE.match(spec):
        raise RecipeError([f"recipe name {_short(spec)!r} is not valid: a name is at most {MAX_NAME_CHARS} "
                           f"{NAME_RULE} (a file elsewhere is given as a path ending in .yaml)"])
    p = recipes_dir / f"{spec}.yaml"
    if not p.exists():
        names = list_recipes(recipes_dir)
        close = difflib.get_close_matches(spec, names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise RecipeError([f"no recipe named '{spec}' in {recipes_dir}{hint} (available: {', '.join(names)})"])
    return _check_file(p, str(p))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader; the document is checked (size, depth, duplicate keys) before it is constructed."""


def _node_problems(root: yaml.Node, path: Path) -> list[str]:
    """Duplicate keys (any level), nesting depth and size (aliases expanded) of a composed YAML document."""
    problems: list[str] = []
    sizes: dict[int, int] = {}
    # iterative post-order walk: a deeply nested or alias-heavy file cannot exhaust the stack or the clock
    stack: list[tuple[yaml.Node, str, int, bool]] = [(root, "", 0, False)]
    while stack:
        node, where, depth, done = stack.pop()
        if depth > MAX_RECIPE_DEPTH:
            return [f"{path}: nested more than {MAX_RECIPE_DEPTH} levels deep at '{where}'; a recipe is a few "
                    "levels of sections (see recipes/*.yaml)"]
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        if isinstance(node, yaml.MappingNode):
            children = [(v, f"{where}.{k.value}" if where else str(k.value)) for k, v in node.value]
        else:
            children = [(v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(node.value)]
        if done:
            sizes[id(node)] = 1 + sum(sizes.get(id(c), 1) for c, _ in children)
            continue
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":
                    key = f"{where}.{k.value}" if where else str(k.value)
                    if k.value in first:
                        problems.append(f"{path}: duplicate key '{key}' at line {k.start_mark.line + 1} (first at "
                                        f"line {first[k.value]}); YAML keeps only the last, remove one")
                    else:
                        first[k.value] = k.start_mark.line + 1
        stack.append((node, where, depth, True))
        stack.extend((c, w, depth + 1, False) for c, w in children if id(c) not in sizes)
    if sizes.get(id(root), 0) > MAX_RECIPE_VALUES:
        problems.append(f"{path}: {sizes[id(root)]} values (aliases expanded); a recipe has at most "
                        f"{MAX_RECIPE_VALUES}")
    return problems


def _yaml_error(e: yaml.YAMLError, where: str, text: str = "") -> str:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    if isinstance(e, yaml.reader.ReaderError):      # a character YAML forbids; it knows only the offset
        line = text.count("\n", 0, e.position) + 1
        key = _key_at(text, line)
        return (f"{where}: character U+{e.character:04X} at line {line}" + (f" (key '{_short(key)}')" if key else "")
                + ": YAML does not allow it in a document; remove it")
    key = _key_at(text, mark.line + 1) if mark and text else ""
    return f"{where}: YAML syntax error{at}{f' (key {_short(key)!r})' if key else ''}: " \
           f"{getattr(e, 'problem', None) or e}"


_KEY_LINE = re.compile(r"^(\s*)(?:-\s+)?([^\s#:'\"][^:#]*?|'[^']*'|\"[^\"]*\"):(?:\s|$)")


def _key_at(text: str, line: int) -> str:
    """The dotted key a line of a block-style YAML text belongs to ('' when it cannot tell): the line's own key,
    under the keys of the less indented lines above it. For messages about text YAML cannot parse."""
    path: list[tuple[int, str]] = []
    for ln in text.splitlines()[:line]:
        m = _KEY_LINE.match(ln)
        if not m:
            continue
        indent = len(m.group(1))
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, m.group(2).strip("'\"")))
    return ".".join(k for _, k in path)


# Characters that make a recipe read differently than it runs (Trojan Source, CVE-2021-42574) or that no editor
# shows: C0/C1 controls but tab and newlines, format characters (zero-width, bidi overrides, soft hyphen) and
# the Unicode line/paragraph separators. A byte-order mark is accepted as the file's first character only.
_INVISIBLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                        "\u2060-\u206f\ufeff\ufff9-\ufffb]")


def invisible_problems(text: str, where: str) -> list[str]:
    """Each control, zero-width or bidi character of ``text`` (up to 5), by line, column and key."""
    import unicodedata
    out = []
    for m in _INVISIBLE.finditer(text, 1 if text.startswith("\ufeff") else 0):
        if len(out) == 5:
            out.append(f"{where}: more such characters follow")
            break
        line = text.count("\n", 0, m.start()) + 1
        col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
        key = _key_at(text, line)
        ch = m.group()
        out.append(f"{where}: invisible or control character U+{ord(ch):04X} "
                   f"({unicodedata.name(ch, 'control character')}) at line {line}, column {col}"
                   + (f" (key '{key}')" if key else "") + "; it makes the recipe read differently than it runs: "
                   "remove it (write it as an escape such as \\u200b inside a double-quoted string if you mean it)")
    return out


def parse_yaml(text: str, where: str):
    """One YAML document, checked for duplicate keys, depth and size; RecipeError names ``where``."""
    loader = None
    try:
        loader = _Loader(text)      # its reader rejects characters YAML forbids: a YAMLError too
        node = loader.get_single_node()
        if node is None:
            return None
        problems = _node_problems(node, where)
        if problems:
            raise RecipeError(problems)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise RecipeError([_yaml_error(e, where, text)]) from None
    except RecursionError:
        raise RecipeError([f"{where}: nested too deeply to read; a recipe is a few levels of sections"]) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_recipe_text(path: Path) -> str:
    """The text of a recipe file: at most MAX_RECIPE_BYTES of UTF-8 (RecipeError names the file otherwise)."""
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise RecipeError([f"{path}: {size} bytes; a recipe file is at most {MAX_RECIPE_BYTES // 1024} KiB "
                               "(is this the right file?)"])
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError([f"{path}: cannot be read ({e.strerror or e})"]) from None
    if b"\0" in raw:
        raise RecipeError([f"{path}: a binary file, not a YAML recipe"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        key = _key_at(raw.decode("utf-8", "replace"), line)
        raise RecipeError([f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}, line {line}"
                           + (f", key '{_short(key)}'" if key else "") + "); save the recipe as UTF-8"]) from None
    problems = invisible_problems(text, str(path))
    if problems:
        raise RecipeError(problems)
    return text.removeprefix("\ufeff")


def _read_yaml(path: Path) -> dict:
    text = read_recipe_text(path)
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise RecipeError([f"{path}: empty recipe file; a recipe sets at least one section "
                           "(see recipes/smollm2-135m-int8.yaml)"])
    data = parse_yaml(text, str(path))
    if data is None:
        raise RecipeError([f"{path}: empty recipe file; a recipe sets at least one section "
                           "(see recipes/smollm2-135m-int8.yaml)"])
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}"])
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise RecipeError([f"{path}: section names must be text, got {bad[0]!r}"])
    return data


def _build_target(data: dict):
    build = data.get("build")
    return build.get("target", registry.DEFAULT) if isinstance(build, dict) else registry.DEFAULT


def _retarget(parent: dict, target, origins: dict) -> dict:
    """``parent`` as a recipe of ``target`` extends it: where ``target`` is another target than the parent's, the
    parent's sections of targets other than ``target`` are dropped (with their ``origins``).

    Why drop rather than refuse: a recipe that names another build.target than its parent's says which target it
    builds, and the parent set those sections for the target it built, not for this one; there is no way to unset
    an inherited key, so refusing would leave no fix short of copying the parent. A child extends what its parent
    resolves to, which holds only its own target's section (BuildSection), so a grandchild that switches back
    gets that target's defaults, not its grandparent's. A foreign section inherited without such a switch is
    refused (inherited_build_problems): the file that wrote it set it for no target it builds."""
    if not isinstance(target, str) or target not in registry.names() or target == _build_target(parent):
        return parent
    parent = copy.deepcopy(parent)
    build = parent["build"] if isinstance(parent.get("build"), dict) else {}
    for s in [k for k in build if k != "target" and k != target and k in registry.names()]:
        del build[s]
        for key in [k for k in origins if k[0] == s]:
            del origins[key]
    return parent


def _note_origins(data: dict, path: Path, origins: dict) -> None:
    """``origins[(section, key)] = path`` for each build.<target>.<key> this file sets."""
    build = data.get("build")
    for s, v in (build.items() if isinstance(build, dict) else ()):
        if s != "target" and isinstance(v, dict):
            origins.update({(s, k): path for k in v})


def _load_raw(path: Path, seen: tuple[Path, ...] = (), origins: dict | None = None) -> dict:
    """The recipe at ``path`` with its ``extends`` chain merged in; ``origins`` (when given) receives the file
    each build.<target>.<key> comes from."""
    origins = {} if origins is None else origins
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.name for p in (*seen, path))
        raise RecipeError([f"{path}: 'extends' forms a cycle: {chain}"])
    if len(seen) >= MAX_RECIPE_DEPTH:
        raise RecipeError([f"{path}: more than {MAX_RECIPE_DEPTH} levels of 'extends'"])
    data = _read_yaml(path)
    if "extends" not in data:
        _note_origins(data, path, origins)
        return data
    parent = data.pop("extends")
    if not isinstance(parent, str) or not parent.strip():
        raise RecipeError([f"{path}: key 'extends' must name a recipe (e.g. extends: smollm2-135m-fp32), "
                           f"got {parent!r}"])
    # a name is looked up beside this file; a path is relative to it
    try:
        parent_path = recipe_path(parent, path.parent, relative_to=path.parent)
    except RecipeError as e:
        raise RecipeError([f"{path}: extends: {m}" for m in e.problems]) from None
    merged = _load_raw(parent_path, (*seen, path), origins)
    if isinstance(data.get("build"), dict) and "target" in data["build"]:
        merged = _retarget(merged, data["build"]["target"], origins)
    _note_origins(data, path, origins)
    return deep_merge(merged, data)


def parse_value(text: str):
    """A --set value as YAML (numbers, booleans, lists), else the text itself."""
    try:
        return parse_yaml(text, "--set value")
    except RecipeError:
        return text


def _index(part: str, node: list, item: str) -> int:
    if not part.isdigit():   # no negative positions: -1 silently editing the last element is a trap
        raise RecipeError([f"--set {_short(item)!r}: '{part}' is not a position in a list of {len(node)} "
                           f"(use 0 to {len(node) - 1})"])
    i = int(part)
    if i >= len(node):
        raise RecipeError([f"--set {_short(item)!r}: position {i} does not exist in a list of {len(node)} "
                           f"(use 0 to {len(node) - 1})"])
    return i


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {_short(item)!r}: expected KEY.PATH=VALUE, e.g. --set quantize.calibration.samples=64")
            continue
        key, value = item.split("=", 1)
        bad = _INVISIBLE.search(item)
        if bad:
            problems.append(f"--set {_short(ascii(item))}: invisible or control character U+{ord(bad.group()):04X}; "
                            "remove it")
            continue
        parts = key.strip().split(".")
        if not all(parts) or len(parts) > MAX_KEY_PARTS:
            problems.append(f"--set {_short(item)!r}: '{_short(key)}' is not a key path like quantize.calibration.samples")
            continue
        try:
            node = data
            for part in parts[:-1]:
                if isinstance(node, list):          # list element by index: validate.eval.0.samples=4
                    node = node[_index(part, node, item)]
                    continue
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]
            if isinstance(node, list):
                node[_index(parts[-1], node, item)] = parse_value(value)
            else:
                node[parts[-1]] = parse_value(value)
        except RecipeError as e:
            problems += e.problems
        except (AttributeError, TypeError):
            problems.append(f"--set {_short(item)!r}: '{_short(key)}' goes inside a value that is not a section")
    if problems:
        raise RecipeError(problems)
    return data


# ---------------------------------------------------------------- messages
def _allowed_keys(model_cls: type[BaseModel]) -> list[str]:
    keys = [f.alias or n for n, f in model_cls.model_fields.items()]
    return keys + list(registry.names()) if model_cls is BuildSection else keys


def _model_at(loc: tuple, root: type[BaseModel] = None) -> type[BaseModel] | None:
    """The model class that holds the last key of ``loc`` (walking from ``root``, the Recipe by default)."""
    cls: Any = root or Recipe
    for part in loc[:-1]:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        fields = {(f.alias or n): f for n, f in cls.model_fields.items()}
        if cls is BuildSection and part in registry.names():
            cls = registry.get(part).section        # build.<target>: the target's own section model
            continue
        if isinstance(part, int) or part not in fields:
            # list element: the model is the list's item type
            continue
        ann = fields[part].annotation
        args = getattr(ann, "__args__", ())
        cls = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if cls is None:
            for a in args:
                for b in getattr(a, "__args__", ()):
                    if isinstance(b, type) and issubclass(b, BaseModel):
                        cls = b
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _value(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


_NUMERIC_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "int_type", "int_parsing",
                   "float_type", "float_parsing", "finite_number", "int_from_float"}


def _range(cls: type[BaseModel] | None, name) -> str | None:
    """'an integer in [1, 4096]', 'a number in (0, 0.01]', 'a number >= 0': the declared bounds of a field."""
    field = cls.model_fields.get(name) if cls is not None and isinstance(name, str) else None
    if field is None:
        return None
    b = {type(m).__name__: getattr(m, type(m).__name__.lower()) for m in field.metadata
         if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}
    kind = "an integer" if int in (field.annotation, *getattr(field.annotation, "__args__", ())) else "a number"
    lo = f"[{b['Ge']}" if "Ge" in b else (f"({b['Gt']}" if "Gt" in b else None)
    hi = f"{b['Le']}]" if "Le" in b else (f"{b['Lt']})" if "Lt" in b else None)
    if lo and hi:
        return f"{kind} in {lo}, {hi}"
    if lo or hi:
        return f"{kind} {'>=' if 'Ge' in b else '>' if 'Gt' in b else '<=' if 'Le' in b else '<'} " \
               f"{b.get('Ge', b.get('Gt', b.get('Le', b.get('Lt'))))}"
    return None


def _describe(err: dict, source: str | None, root: type[BaseModel] | None = None, prefix: tuple = ()) -> str:
    """One validation error as a message naming the key path (from ``prefix``): with a ``source`` (the recipe
    file) as ``FILE: key = value: what is allowed``; without, as ``key: what is allowed`` (plan-time checks)."""
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in prefix + loc)
    kind = err["type"]
    where = f"{source}: " if source else ""
    cls = _model_at(loc, root)
    if kind == "extra_forbidden":
        allowed = _allowed_keys(cls) if cls else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{'.'.join(str(p) for p in prefix + loc[:-1] + (close[0],))}'?" if close else ""
        here = f"allowed here: {', '.join(allowed)}" if allowed else "no key is allowed here"
        if source:
            return f"{source}: unknown key '{path}'{hint} ({here})"
        return f"{path}: unknown key{hint} ({here})"
    shown = f" = {_value(err.get('input'))}" if source else ""
    got = "" if source else f", got {_value(err.get('input'))}"
    if path == "name" and kind == "string_pattern_mismatch":
        return (f"{where}name{shown} is not a valid recipe name: use {NAME_RULE} "
                "(it names the report directory and the cache index; set `name:` in the recipe)")
    if kind in _NUMERIC_ERRORS and (bounds := _range(cls, loc[-1])):
        return f"{where}{path}{shown}: must be {bounds}{got}"
    if kind == "literal_error":
        if source:
            return f"{source}: {path}{shown} is not allowed: {err['msg']}"
        return f"{path}: {_value(err.get('input'))} is not allowed: {err['msg']}"
    if kind == "missing":
        return f"{where}{path} is required"
    return f"{where}{path}{shown}: {err['msg'].removeprefix('Value error, ')}{got}"


def section_problems(model: type[BaseModel], data, prefix: tuple, source: str | None = None) -> list[str]:
    """Schema problems of ``data`` validated as ``model`` (at most MAX_PROBLEMS_SHOWN described)."""
    try:
        model.model_validate(data)
        return []
    except ValidationError as e:
        errors = e.errors()
    shown = [_describe(err, source, model, prefix) for err in errors[:MAX_PROBLEMS_SHOWN]]
    return shown + [f"{source or '.'.join(prefix)}: ..."] * (len(errors) - len(shown))


def resolve(name_or_path: str, overrides: list[str] | None = None, recipes_dir: Path = RECIPES_DIR) -> Recipe:
    """Load a recipe by name or path, apply `extends:` and `--set` overrides, validate everything."""
    path = recipe_path(name_or_path, recipes_dir)
    origins: dict = {}
    data = _load_raw(path, origins=origins)
    data.setdefault("name", path.stem)
    if overrides:       # a --set of build.target extends the file as a child that names another target does
        data = apply_overrides(_retarget(data, _build_target(apply_overrides(data, overrides)), origins), overrides)
    problems = section_problems(Recipe, data, (), str(path))
    if problems:
        raise RecipeError(problems)
    recipe = Recipe.model_validate(data)
    problems = semantic_problems(recipe, str(path)) + foreign_build_problems(path, overrides or [],
                                                                              recipe.build.target) \
        + inherited_build_problems(recipe, path, origins, overrides or [])
    if problems:
        raise RecipeError(problems)
    recipe._path = str(path)
    return recipe


def _section_defaults() -> dict[str, dict]:
    return {t.name: t.section.model_validate({}).model_dump(mode="json", by_alias=True)
            for t in registry.all_targets()}


def foreign_build_problems(path: Path, overrides: list[str], target: str) -> list[str]:
    """A build.<target> section another target reads, set by this recipe file or a --set, is refused (it would be
    accepted and ignored). Inherited sections: inherited_build_problems."""
    own = apply_overrides(_read_yaml(path), [o for o in overrides if o.split("=", 1)[0].strip().startswith("build.")])
    build = own.get("build") if isinstance(own.get("build"), dict) else {}
    defaults = _section_defaults()
    targets = registry.names()
    # a value equal to the default sets nothing: `forge recipes resolve` wrote every section before issue 25, read back
    sections = {s for s, v in build.items() if s in defaults and isinstance(v, dict)
                and any(defaults[s].get(k, object()) != x for k, x in v.items())}
    where = f"{path} (or --set)" if overrides else str(path)
    return [f"{where}: build.{s}: read only by build.target '{s}'; this recipe builds build.target '{target}', "
            f"which ignores it: remove build.{s} (or set build.target: {s})"
            for s in sorted(sections) if s in targets and s != target]


def inherited_build_problems(recipe: Recipe, path: Path, origins: dict, overrides: list[str]) -> list[str]:
    """A build.<target> section of another target than the recipe's, inherited through ``extends``, is refused
    naming the file that set it. Sections of the parent's target are dropped where the recipe (or a --set) names
    another build.target (_retarget), so what is left was written by a file for a target it does not build
    either (a parent that is refused on its own), or by a base file for the target its children name. A value
    equal to the default sets nothing (as in foreign_build_problems)."""
    target, resolved = recipe.build.target, path.resolve()
    set_ = [o.split("=", 1)[0].strip().split(".") for o in overrides]
    defaults, found = _section_defaults(), {}
    for (s, k), origin in origins.items():
        if s == target or s not in defaults or origin == resolved or ["build", s] in set_ or ["build", s, k] in set_:
            continue        # this file's own sections and the --set ones: foreign_build_problems
        if recipe.build.section(s).model_dump(mode="json", by_alias=True).get(k) != defaults[s].get(k, object()):
            found.setdefault((s, origin), []).append(k)
    return [f"{path}: {', '.join(f'build.{s}.{k}' for k in keys)}: inherited from {origin} (extends), read only by "
            f"build.target '{s}'; this recipe builds build.target '{target}', which ignores it: remove build.{s} "
            f"from {origin}, or set build.target: {s} in {path}" for (s, origin), keys in sorted(found.items())]


# ---------------------------------------------------------------- rules across fields (no model facts)
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
        hint = "; 'int8' is the onnxruntime target's format, use int8_sq_per_token, int8_sq or int8_wo here" \
            if target == "tensorrt_llm" and algo == "int8" else ""
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
        for opt in [o for o in opts if o in t.moved_options]:
            p.append(f"quantize.options.{opt}: build.target '{target}' reads this as {t.moved_options[opt]} "
                     f"(one spelling per option); did you mean '{t.moved_options[opt]}'?")
            del opts[opt]
        # a section key that stands for an option is validated by the option's model, named as the recipe wrote it
        for key, opt in t.section_options.items():
            if key in qz.section_keys and q.get(key) is not None:
                opts[opt] = q[key]
                renamed[f"quantize.options.{opt}:"] = f"quantize.{key}:"
        for m in section_problems(qz.options, opts, ("quantize", "options")):
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
    b = recipe.build.onnxruntime
    if b.provider != "cuda":
        for key, bad in (("precision", b.precision == "fp16"), ("cuda_graph", b.cuda_graph)):
            if bad:
                p.append(f"{source}: build.onnxruntime.{key} = {getattr(b, key)!r} needs build.onnxruntime.provider: "
                         "cuda (the CPU provider runs fp32 graphs and has no CUDA graphs)")
    if b.provider == "cuda" and target != "onnxruntime":
        p.append(f"{source}: build.onnxruntime.provider = 'cuda' applies to build.target 'onnxruntime' only; "
                 f"remove it for '{target}'")
    if own.checks is not None:
        p += [f"{source}: {m}" for m in own.checks(recipe)]
    p += data_set_problems(recipe, source)
    return p


def data_set_problems(recipe: Recipe, source: str) -> list[str]:
    """Every data set / split the recipe names exists in calibration_data/manifest.yaml (before any stage runs)."""
    from . import data as datasets
    from .errors import ForgeError
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
