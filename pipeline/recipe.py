"""Recipe schema, loading, `extends:` inheritance and dotted `--set` overrides.

Every problem is collected and reported at once, each naming the file, the key path and
what is allowed, so a user fixes a recipe in one pass instead of one error per run.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from .errors import RecipeError
from .hashing import sha256_json

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = "smollm2-135m-int8"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------- model / data
class ModelSection(Section):
    source: str = Field("builtin:smollm2-135m-instruct",
                        description="builtin:<name>, a local HF directory, or a hub id found in the local HF cache")
    config: Optional[str] = Field(None, description="bundled public config used for plan-time checks before weights exist")


class TextSet(Section):
    set: str = Field(description="a set from calibration_data/manifest.yaml")
    split: str
    samples: int = Field(gt=0)
    seq_len: int = Field(gt=1)
    seed: int = 0


class CalibrationSection(Section):
    set: str = "sotu"
    split: str = "calib"
    samples: int = Field(32, gt=0)
    seq_len: int = Field(256, gt=1)
    batch: int = Field(4, gt=0)
    seed: int = 0


# ---------------------------------------------------------------- export
class Tolerance(Section):
    atol: float = Field(gt=0)
    rtol: float = Field(ge=0)


class ExportSection(Section):
    opset: int = Field(18, ge=14, le=23)
    parity: dict[Literal["fp32", "fp16", "bf16"], Tolerance] = Field(
        default_factory=lambda: {"fp32": Tolerance(atol=1e-3, rtol=1e-3)})


# ---------------------------------------------------------------- quantize
class DistillSection(Section):
    enabled: bool = False
    temperature: float = Field(2.0, gt=0)
    alpha: float = Field(1.0, ge=0, le=1, description="weight of the KL term vs the LM loss")


class QatSection(Section):
    epochs: int = Field(1, ge=1, le=3)
    lr: float = Field(1e-5, gt=0, lt=1)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    batch: int = Field(4, gt=0)
    samples: int = Field(64, gt=0)
    seq_len: int = Field(256, gt=1)
    seed: int = 0
    set: str = "sotu"
    split: str = "train"
    distill: DistillSection = Field(default_factory=DistillSection)


QuantAlgo = Literal["none", "int8", "int8_sq", "int8_wo", "int4_wo", "int4_awq", "fp8"]


class QuantizeSection(Section):
    method: Literal["ptq", "qat", "none"] = "ptq"
    algo: QuantAlgo = "none"
    alpha: Optional[float] = Field(None, ge=0, le=1, description="SmoothQuant migration strength")
    block_size: Optional[int] = Field(None, gt=0, description="group size for int4 (AWQ / weight-only)")
    kv_cache: Literal["none", "int8", "fp8"] = "none"
    options: dict[str, Any] = Field(default_factory=dict, description="target-specific quantizer options")
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    qat: QatSection = Field(default_factory=QatSection)


# ---------------------------------------------------------------- build
class OrtBuild(Section):
    opt_level: Literal["disable", "basic", "extended", "all"] = "extended"
    intra_op_threads: int = Field(0, ge=0, description="0 = ONNX Runtime's default (all cores)")


class TrtllmBuild(Section):
    dtype: Literal["float16", "bfloat16"] = "float16"
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    gpu_sm: Optional[int] = Field(None, description="compute capability the engine targets, e.g. 90; detected when a GPU is present")
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    max_beam_width: int = Field(1, ge=1)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    tokens_per_block: int = Field(32, ge=1)
    gemm_plugin: str = "auto"
    gpt_attention_plugin: str = "auto"
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    remove_input_padding: bool = True
    use_fused_mlp: bool = True
    reduce_fusion: bool = False
    user_buffer: bool = False
    multiple_profiles: bool = False
    workers: int = Field(1, ge=1)
    gather_context_logits: bool = Field(True, description="engine returns context logits: needed by validate's perplexity/top-1 "
                                        "(costs max_num_tokens x vocab x 2 bytes of GPU memory with logits_dtype float16, "
                                        "x 4 with float32); TensorRT-LLM turns KV-cache reuse off for such an engine")
    logits_dtype: Literal["float16", "float32"] = Field(
        "float16", description="trtllm-build --logits_dtype, always passed. The lm_head GEMM runs in the model dtype and "
                               "the engine (strongly typed) casts its output to logits_dtype, so float32 stores the same "
                               "rounded values in twice the memory")
    extra_args: list[str] = Field(default_factory=list)


class TensorrtBuild(Section):
    precision: Literal["fp32", "fp16", "int8", "fp8"] = "fp16"
    workspace_gib: float = Field(4.0, gt=0)
    max_batch_size: int = Field(4, ge=1)
    max_seq_len: int = Field(1024, ge=1)


class BuildSection(Section):
    target: Literal["onnxruntime", "tensorrt_llm", "tensorrt"] = "onnxruntime"
    onnxruntime: OrtBuild = Field(default_factory=OrtBuild)
    tensorrt_llm: TrtllmBuild = Field(default_factory=TrtllmBuild)
    tensorrt: TensorrtBuild = Field(default_factory=TensorrtBuild)


# ---------------------------------------------------------------- validate
class Thresholds(Section):
    ppl_delta_pct_max: float = Field(5.0, description="max perplexity increase vs FP32, in %")
    top1_agreement_min: float = Field(0.85, ge=0, le=1)
    logits_cosine_min: Optional[float] = Field(None, ge=-1, le=1)
    logits_max_abs_max: Optional[float] = Field(None, gt=0)
    greedy_match_min: Optional[float] = Field(None, ge=0, le=1, description="fraction of prompts whose greedy output equals FP32's")
    simulated_ppl_gap_max: Optional[float] = Field(
        None, gt=0, description="tensorrt_llm: max |checkpoint reference-numerics ppl - quantize stage's simulated ppl| "
                                "on the first eval set, in perplexity points")


class PromptsSection(Section):
    max_new_tokens: int = Field(24, ge=1)
    limit: Optional[int] = Field(None, ge=1, description="use only the first N prompts")


class ValidateSection(Section):
    eval: list[TextSet] = Field(default_factory=lambda: [TextSet(set="wiki", split="eval", samples=8, seq_len=256)])
    prompts: PromptsSection = Field(default_factory=PromptsSection)
    thresholds: Thresholds = Field(default_factory=Thresholds)


# ---------------------------------------------------------------- package
class TritonSection(Section):
    max_batch_size: int = Field(8, ge=1)
    decoupled: bool = False
    instance_count: int = Field(1, ge=1)
    max_queue_delay_microseconds: int = Field(0, ge=0)
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, lt=1, description="fraction of free GPU memory for the paged "
                                                  "KV cache; TensorRT-LLM's executor requires 0 < f < 1")
    enable_kv_cache_reuse: bool = False
    max_beam_width: Optional[int] = Field(None, ge=1, description="defaults to the engine's")
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    cuda_graph_mode: bool = False
    gpu_device_ids: Optional[list[int]] = None
    default_max_tokens: int = Field(64, ge=1)


class PackageSection(Section):
    triton: TritonSection = Field(default_factory=TritonSection)


class Recipe(Section):
    name: str
    description: str = ""
    model: ModelSection = Field(default_factory=ModelSection)
    export: ExportSection = Field(default_factory=ExportSection)
    quantize: QuantizeSection = Field(default_factory=QuantizeSection)
    build: BuildSection = Field(default_factory=BuildSection)
    validate_: ValidateSection = Field(default_factory=ValidateSection, alias="validate")
    package: PackageSection = Field(default_factory=PackageSection)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    _path: str = PrivateAttr("")      # the file it came from, for error messages

    @property
    def path(self) -> str:
        return self._path or self.name

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    @property
    def hash(self) -> str:
        return sha256_json(self.to_dict())


# ---------------------------------------------------------------- loading
def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def list_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def recipe_path(name_or_path: str, recipes_dir: Path = RECIPES_DIR) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise RecipeError([f"{p}: no such recipe file"])
        return p
    p = recipes_dir / f"{name_or_path}.yaml"
    if not p.exists():
        names = list_recipes(recipes_dir)
        close = difflib.get_close_matches(name_or_path, names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise RecipeError([f"no recipe named '{name_or_path}' in {recipes_dir}{hint} (available: {', '.join(names)})"])
    return p


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise RecipeError([f"{path}: YAML syntax error at {where}: {e.problem}"]) from None
    except yaml.YAMLError as e:
        raise RecipeError([f"{path}: YAML error: {e}"]) from None
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}"])
    return data


def _load_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.name for p in (*seen, path))
        raise RecipeError([f"{path}: 'extends' forms a cycle: {chain}"])
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise RecipeError([f"{path}: key 'extends' must be a recipe name, got {parent!r}"])
    parent_path = recipe_path(parent, path.parent) if not Path(parent).is_absolute() else Path(parent)
    return deep_merge(_load_raw(parent_path, (*seen, path)), data)


def parse_value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set quantize.calibration.samples=64")
            continue
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        try:
            for part in parts[:-1]:
                if isinstance(node, list):          # list element by index: validate.eval.0.samples=4
                    node = node[int(part)]
                    continue
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]
            if isinstance(node, list):
                node[int(parts[-1])] = parse_value(value)
            else:
                node[parts[-1]] = parse_value(value)
        except (ValueError, IndexError):
            problems.append(f"--set {item!r}: '{key}' indexes a list with a position that does not exist")
    if problems:
        raise RecipeError(problems)
    return data


def _allowed_keys(model_cls: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model_cls.model_fields.items()]


def _model_at(loc: tuple) -> type[BaseModel] | None:
    cls: Any = Recipe
    for part in loc[:-1]:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        fields = {(f.alias or n): f for n, f in cls.model_fields.items()}
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


def _describe(err: dict, source: str) -> str:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        cls = _model_at(loc)
        allowed = _allowed_keys(cls) if cls else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{'.'.join(str(p) for p in loc[:-1] + (close[0],))}'?" if close else ""
        return f"{source}: unknown key '{path}'{hint} (allowed here: {', '.join(allowed)})"
    if kind == "literal_error":
        return f"{source}: {path} = {err.get('input')!r} is not allowed: {err['msg']}"
    if kind == "missing":
        return f"{source}: {path} is required"
    return f"{source}: {path} = {err.get('input')!r}: {err['msg']}"


def resolve(name_or_path: str, overrides: list[str] | None = None, recipes_dir: Path = RECIPES_DIR) -> Recipe:
    """Load a recipe by name or path, apply `extends:` and `--set` overrides, validate everything."""
    path = recipe_path(name_or_path, recipes_dir)
    data = _load_raw(path)
    data.setdefault("name", path.stem)
    if overrides:
        data = apply_overrides(data, overrides)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError([_describe(err, str(path)) for err in e.errors()]) from None
    problems = semantic_problems(recipe, str(path))
    if problems:
        raise RecipeError(problems)
    recipe._path = str(path)
    return recipe


TARGET_ALGOS = {
    "onnxruntime": {"none", "int8", "int4_wo"},
    "tensorrt_llm": {"none", "int8_sq", "int8_wo", "int4_wo", "int4_awq", "fp8"},
    "tensorrt": {"none", "int8", "fp8"},
}


def semantic_problems(recipe: Recipe, source: str) -> list[str]:
    """Cross-field rules that need no model facts (those run at plan time, see stages)."""
    p = []
    target = recipe.build.target
    q = recipe.quantize
    allowed = TARGET_ALGOS[target]
    if q.algo not in allowed:
        p.append(f"{source}: quantize.algo = '{q.algo}' is not available for build.target '{target}' "
                 f"(allowed: {', '.join(sorted(allowed))})")
    if q.method == "none" and q.algo != "none":
        p.append(f"{source}: quantize.method is 'none' but quantize.algo is '{q.algo}': set quantize.method to ptq or qat")
    if q.method in ("ptq", "qat") and q.algo == "none":
        p.append(f"{source}: quantize.method is '{q.method}' but quantize.algo is 'none': pick an algo or set method: none")
    if q.method == "qat" and target != "tensorrt_llm":
        p.append(f"{source}: quantize.method 'qat' needs build.target 'tensorrt_llm' (ModelOpt fake-quant models do not "
                 f"export to ONNX); use method: ptq for '{target}'")
    return p
