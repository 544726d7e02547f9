"""``manifest.json`` of a packaged repository, and ``verify-deploy`` against the current environment.

The manifest records what the repository was built from and for: recipe (+hash), model /
calibration / eval digests, tool versions, target (``cpu`` or the GPU SM), build args, validation
metrics, and a digest of every file in the repository. ``verify_deploy`` refuses a repository whose
files were changed after packaging, or whose engine needs another TensorRT / TensorRT-LLM version
or another GPU architecture than this machine has (engines are not portable across either).
``deploy_warnings`` says when a CPU engine was validated on another ISA class than this CPU's.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from pipeline.host.cpu import cpu_facts, cpu_isa_class
from pipeline.host.gpu import gpus
from pipeline.host.tools import tool_label, tool_versions
from pipeline.errors import ForgeError
from pipeline.hashing import empty_dirs, file_digest, sha256_json, tree_files

MANIFEST = "manifest.json"
SCHEMA = 1
# tools that make an engine (pipeline.host.tools.TOOLS labels): a manifest records each, null when absent
BUILD_TOOLS = ("torch", "transformers", "modelopt", "onnx", "onnxruntime", "tensorrt", "tensorrt_llm")
# tools this machine reports for verify-deploy: the build tools and the serving side
TOOLS = BUILD_TOOLS + ("tritonclient", "pytriton", "forge")
# tools whose version an engine is bound to, per target
ENGINE_BOUND = {"tensorrt_llm": ("tensorrt", "tensorrt_llm"), "tensorrt": ("tensorrt",), "onnxruntime": ()}


def current_env() -> dict:
    """Tool versions, GPUs (SM) and platform of this machine."""
    from pipeline import __version__

    tools = tool_versions(TOOLS)
    tools["forge"] = tools["forge"] or __version__
    try:   # the onnxruntime that is imported (onnxruntime-gpu and the CPU wheel may both be installed, one module)
        import onnxruntime
        tools["onnxruntime"] = onnxruntime.__version__
    except Exception:  # noqa: BLE001 - absent or broken: as the distributions say
        pass
    found = gpus()
    return {"tools": tools, "gpus": found, "gpu_sms": sorted({g["sm"] for g in found}),
            "python": platform.python_version(), "machine": platform.machine(), "system": platform.system(),
            "cpu_isa_class": cpu_isa_class()}


def repo_file_digests(repo_dir: Path, use_stat_cache: bool = True) -> dict[str, str]:
    out = {}
    for p in tree_files(repo_dir):
        rel = p.relative_to(repo_dir)
        if rel.as_posix() == MANIFEST or "__pycache__" in rel.parts or p.suffix == ".pyc":
            continue  # bytecode a python backend may write next to model.py is not content
        out[rel.as_posix()] = file_digest(p, use_stat_cache)
    return out


def repo_empty_dirs(repo_dir: Path) -> list[str]:
    return [d for d in empty_dirs(repo_dir) if "__pycache__" not in Path(d).parts]


def file_problems(repo_dir, manifest: dict) -> list[str]:
    """Files changed, missing or added since packaging, by full content digests (every byte is read: a
    repository is about to be deployed, and a change that kept size and mtime must be caught), and recorded
    empty folders that are gone (a copy through an object store drops them; Triton then finds no version)."""
    repo = Path(repo_dir)
    problems: list[str] = []
    fix = rebuild_hint(manifest)
    dirs = manifest.get("dirs") if isinstance(manifest.get("dirs"), list) else []
    for d in sorted(str(d) for d in dirs):
        if not (repo / d).is_dir():
            problems.append(f"{d}/: empty folder listed in manifest.json but missing (Triton needs it); {fix}")
    recorded = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    actual = repo_file_digests(repo, use_stat_cache=False)
    for f in sorted(set(recorded) | set(actual)):
        if f not in actual:
            problems.append(f"{f}: listed in manifest.json but missing; {fix}")
        elif f not in recorded:
            problems.append(f"{f}: not listed in manifest.json (added after packaging); remove it or {fix}")
        elif recorded[f] != actual[f]:
            problems.append(f"{f}: content differs from manifest.json (modified after packaging); {fix}")
    return problems


def _engine_kind(repo: Path) -> str:
    if (repo / "tensorrt_llm" / "config.pbtxt").exists():
        return "tensorrt_llm"
    if (repo / "onnxruntime_llm" / "config.pbtxt").exists():
        return "onnxruntime"
    return "tensorrt"


def _sm_from(target, gpu_sm) -> int | None:
    if gpu_sm is not None:
        return int(gpu_sm)
    if isinstance(target, str) and target.lower().startswith("sm") and target[2:].isdigit():
        return int(target[2:])
    return None


def write_manifest(repo_dir, info: dict) -> Path:
    """Write ``<repo>/manifest.json``: every key of ``info`` plus what verify-deploy needs.

    ``info`` (the package stage's, see pipeline/stages/package.py): ``target`` ("cpu", "sm90", or a
    target name), ``recipe`` (resolved dict, or {name, hash, resolved}), ``model`` / ``calibration`` /
    ``evaluation_data`` digests, ``tools`` (dist name -> version; defaults to this environment),
    ``build`` args, ``metrics``; optional ``gpu_sm`` (int) and ``engine`` (onnxruntime | tensorrt_llm |
    tensorrt; read from the repository's models when absent). Added: ``engine``, ``hardware``
    (cpu + machine, or gpu + SM), normalised ``tools``, ``recipe_hash``, ``files`` (sha256 of every file),
    ``dirs`` (every empty folder: Triton needs a model's version folder ``<model>/1/`` even when it is empty).
    """
    repo = Path(repo_dir)
    info = dict(info)
    engine = info.pop("engine", None) or _engine_kind(repo)
    if engine not in ENGINE_BOUND:
        raise ForgeError(f"manifest engine {engine!r} is not one of {sorted(ENGINE_BOUND)}")
    env = current_env()
    target = info.get("target")
    if engine == "onnxruntime" and isinstance(target, str) and target.startswith("cuda:"):
        # build.onnxruntime.provider: cuda -- "cuda:sm_90:NVIDIA H200" (pipeline.host.gpu.cuda_hardware)
        _, sm, name = (target.split(":", 2) + ["", ""])[:3]
        hardware = {"kind": "gpu", "provider": "cuda", "machine": env["machine"], "gpu": name,
                    "sm": int(sm[3:]) if sm[3:].isdigit() else None}
    elif engine == "onnxruntime":
        # the CPU the engine's evaluation (and so its validation) was measured on; this machine's when not recorded
        measured = (info.get("metrics") or {}).get("measured_on") or cpu_facts()
        hardware = {"kind": "cpu", "machine": env["machine"], "validated_isa_class": measured["isa_class"],
                    "validated_cpu_model": measured.get("cpu_model"), "validated_isa_flags": measured.get("isa_flags")}
    else:
        sm = _sm_from(info.get("target"), info.get("gpu_sm"))
        if sm is None:
            raise ForgeError(f"manifest for a {engine} engine needs the GPU SM it was built for: set "
                             "build.tensorrt_llm.gpu_sm (e.g. 90) or build on the GPU; an engine only runs on that architecture")
        hardware = {"kind": "gpu", "sm": sm}
    tools = info.get("tools") or env["tools"]
    tools = {tool_label(k): (None if v == "absent" else v) for k, v in tools.items()}
    for k in BUILD_TOOLS:
        tools.setdefault(k, None)  # recorded as absent (null), not omitted
    recipe = info.get("recipe")
    rhash = info.get("recipe_hash") or (recipe.get("hash") if isinstance(recipe, dict) else None) \
        or (sha256_json(recipe) if recipe is not None else None)
    # no timestamp: the same inputs give the same manifest (and package digest) on any machine or FORGE_HOME;
    # when it was built is in the cache entry's meta.json and the build report
    manifest = {**info, "schema": SCHEMA, "engine": engine, "hardware": hardware, "tools": tools, "recipe_hash": rhash,
                "files": repo_file_digests(repo), "dirs": repo_empty_dirs(repo)}
    path = repo / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_manifest(repo_dir) -> dict:
    path = Path(repo_dir) / MANIFEST
    if not path.exists():
        raise ForgeError(f"{path} not found: a repository forge packaged has one; build it with `forge build RECIPE` "
                         "(its package stage writes the manifest; the repository is out/RECIPE/triton_repo)")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ForgeError(f"{path} is not valid JSON ({e}); {rebuild_hint({})}") from None
    if not isinstance(m, dict):
        raise ForgeError(f"{path} is not a manifest (a JSON object); {rebuild_hint({})}")
    return m


def _obj(x) -> dict:
    return x if isinstance(x, dict) else {}


def rebuild_hint(manifest: dict) -> str:
    """The command that packages the repository again (the recipe named in the manifest, where it says)."""
    name = _obj(manifest.get("recipe")).get("name") if isinstance(manifest, dict) else None
    return f"rebuild it with `forge build {name if isinstance(name, str) else 'RECIPE'} --force package`"
def deploy_warnings(repo_dir, env: dict | None = None) -> list[str]:
    """What deploying this repository here may change without making it unfit ([] = nothing known).

    A CPU engine validated on another ISA class runs here, but ONNX Runtime's int8 kernels may compute other
    numbers (pipeline/host/cpu.py); the warning says whether the engine's quantization is known to lose accuracy here.
    """
    m = read_manifest(repo_dir)
    env = env or current_env()
    hw = _obj(m.get("hardware"))
    if m.get("engine") != "onnxruntime" or hw.get("kind") != "cpu":
        return []
    built, here = hw.get("validated_isa_class"), env.get("cpu_isa_class")
    rname = _obj(m.get("recipe")).get("name", "RECIPE")
    if not built:
        return [f"manifest.json does not record the CPU ISA class the engine was validated on (packaged before forge "
                f"recorded it); this CPU is {here}: run `forge build {rname}` here to validate it on this CPU"]
    if built == here:
        return []
    from pipeline.ort.quantize import isa_accuracy_risk
    quant = _obj(m.get("quantization")) or _obj(_obj(_obj(m.get("recipe")).get("resolved")).get("quantize"))
    risk = isa_accuracy_risk(quant, here)
    why = (f"its int8 method is known to lose accuracy here: {risk}" if risk else
           "its int8 method is not known to lose accuracy here, but its numbers were not measured on this class")
    return [f"the engine was validated on {built} ({hw.get('validated_cpu_model') or 'unknown CPU'}), this CPU is "
            f"{here}: ONNX Runtime's int8 kernels differ between the two, {why}; run `forge build {rname}` here "
            f"to evaluate and validate it on this CPU"]


def verify_deploy(repo_dir, env: dict | None = None) -> list[str]:
    """Problems that make this repository unfit for this environment ([] = deployable).

    Checks: the manifest's file digests (a changed, missing or added file), and for GPU targets the
    TensorRT / TensorRT-LLM versions and the GPU SM the engine was built for.
    """
    repo = Path(repo_dir)
    m = read_manifest(repo)
    env = env or current_env()
    problems = file_problems(repo, m)
    target = m.get("engine")
    if not isinstance(target, str) or target not in ENGINE_BOUND:
        problems.append(f"manifest.json: unknown engine {target!r}; {rebuild_hint(m)}")
        return problems
    rname = _obj(m.get("recipe")).get("name", "RECIPE")
    tools_now = env.get("tools", {})
    for tool in ENGINE_BOUND[target]:
        built, now = _obj(m.get("tools")).get(tool), tools_now.get(tool)
        if built is None:
            problems.append(f"manifest.json records no {tool} version for a {target} engine; rebuild with "
                            f"`forge build {rname} --force build` where {tool} is installed")
        elif now is None:
            problems.append(f"{tool} is not installed here but the engine was built with {tool} {built}; "
                            f"install {tool}=={built} or rebuild the engine here (`forge build {rname} --force build`)")
        elif now != built:
            problems.append(f"{tool} {now} here, but the engine was built with {tool} {built} (engines are bound to the "
                            f"exact version); rebuild the engine with {tool} {now} (`forge build {rname} --force build`) "
                            f"or deploy with {tool}=={built}")
    if target == "onnxruntime":
        # an ORT-optimised graph (level extended/all) is bound to the ORT release and CPU architecture
        built, now = _obj(m.get("tools")).get("onnxruntime"), tools_now.get("onnxruntime")
        if isinstance(built, str) and isinstance(now, str) and built.split(".")[:2] != now.split(".")[:2]:
            problems.append(f"onnxruntime {now} here, but the engine was optimised with onnxruntime {built}; install "
                            f"onnxruntime=={built} or rebuild (`forge build {rname} --force build`)")
        arch = _obj(m.get("hardware")).get("machine")
        if arch and env.get("machine") and arch != env["machine"]:
            problems.append(f"the engine was built on {arch}, this machine is {env['machine']}; rebuild it here")
        if _obj(m.get("hardware")).get("provider") == "cuda" and not env.get("gpu_sms"):
            problems.append("no NVIDIA GPU found here; the engine was built and validated for ONNX Runtime's CUDA "
                            f"provider on {_obj(m.get('hardware')).get('gpu') or 'a GPU'}: deploy it on a GPU machine "
                            "with onnxruntime-gpu")
    else:
        sm = _obj(m.get("hardware")).get("sm")
        sms = env.get("gpu_sms") or []
        if not sms:
            problems.append(f"no NVIDIA GPU found here; the {target} engine needs a GPU with SM {sm}")
        elif sm not in sms:
            problems.append(f"the engine was built for SM {sm}, this machine's GPUs are SM {sms}; rebuild it here with "
                            f"`forge build {rname} --set build.tensorrt_llm.gpu_sm={sms[0]}`")
    return problems
