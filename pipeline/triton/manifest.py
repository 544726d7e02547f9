"""``manifest.json`` of a packaged repository, and ``verify-deploy`` against the current environment.

The manifest records what the repository was built from and for: recipe (+hash), model /
calibration / eval digests, tool versions, the engine (the build target that made it), the hardware it needs,
build args, validation metrics, and a digest of every file in the repository. ``verify_deploy`` refuses a
repository whose files were changed after packaging, whose engine is bound to another version of a tool than this
machine has, or that this host cannot serve; ``deploy_warnings`` says what may differ here without making it unfit.
What an engine is bound to and needs is its target's (``Target.deploy``, pipeline/deploy.py): this module names no
target.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from pipeline import target_registry as registry
from pipeline.deploy import Deploy, obj as _obj, rebuild_hint
from pipeline.host.cpu import cpu_isa_class
from pipeline.host.gpu import gpus
from pipeline.host.tools import tool_label, tool_versions
from pipeline.errors import ForgeError
from pipeline.hashing import empty_dirs, file_digest, sha256_json, tree_files

MANIFEST = "manifest.json"
SCHEMA = 1
# tools that make an engine (pipeline.host.tools.TOOLS labels): a manifest records each, null when absent
BUILD_TOOLS = ("torch", "transformers", "modelopt", "onnx", "onnxruntime", "tensorrt", "tensorrt_llm")
# tools this machine reports for verify-deploy: the build tools and the serving side (and every registered target's
# bound tools: current_env)
TOOLS = BUILD_TOOLS + ("tritonclient", "pytriton", "forge")


def engine_deploy(engine) -> Deploy | None:
    """What the engine a manifest names (its build target) needs where it is deployed; None when no registered
    target has that name."""
    return registry.get(engine).deploy if isinstance(engine, str) and engine in registry.names() else None


def current_env() -> dict:
    """Tool versions, GPUs (SM), platform and CPUs of this machine: what a target's deploy checks read."""
    from pipeline import __version__

    bound = tuple(t for x in registry.all_targets() for t in x.deploy.bound_tools)
    tools = tool_versions(tuple(dict.fromkeys(TOOLS + bound)))
    tools["forge"] = tools["forge"] or __version__
    try:   # the onnxruntime that is imported (onnxruntime-gpu and the CPU wheel may both be installed, one module)
        import onnxruntime
        tools["onnxruntime"] = onnxruntime.__version__
    except Exception:  # noqa: BLE001 - absent or broken: as the distributions say
        pass
    found = gpus()
    return {"tools": tools, "gpus": found, "gpu_sms": sorted({g["sm"] for g in found}),
            "python": platform.python_version(), "machine": platform.machine(), "system": platform.system(),
            "cpu_isa_class": cpu_isa_class(), "logical_cpus": os.cpu_count()}


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


def write_manifest(repo_dir, info: dict) -> Path:
    """Write ``<repo>/manifest.json``: every key of ``info`` plus what verify-deploy needs.

    ``info`` (the package stage's, see pipeline/stages/package.py): ``engine`` (the build target that made it),
    ``target`` ("cpu", "sm90", or the CUDA hardware text), ``recipe`` (resolved dict, or {name, hash, resolved}),
    ``model`` / ``calibration`` / ``evaluation_data`` digests, ``tools`` (dist name -> version; defaults to this
    environment), ``build`` args, ``metrics``; optional ``gpu_sm`` (int). Added: ``hardware`` (what the engine's
    target records it needs: ``Target.deploy.hardware``), normalised ``tools``, ``recipe_hash``, ``files`` (sha256
    of every file), ``dirs`` (every empty folder: Triton needs a model's version folder ``<model>/1/`` even when it
    is empty).
    """
    repo = Path(repo_dir)
    info = dict(info)
    engine = info.pop("engine", None)
    deploy = engine_deploy(engine)
    if deploy is None:
        raise ForgeError(f"manifest engine {engine!r}: not a registered build target (targets: "
                         f"{', '.join(registry.names())}); the package stage names the target that built the engine")
    env = current_env()
    hardware = deploy.hardware(info, env)
    tools = info.get("tools") or env["tools"]
    tools = {tool_label(k): (None if v == "absent" else v) for k, v in tools.items()}
    for k in BUILD_TOOLS + deploy.bound_tools:
        tools.setdefault(tool_label(k), None)  # recorded as absent (null), not omitted
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


def deploy_warnings(repo_dir, env: dict | None = None) -> list[str]:
    """What deploying this repository here may change without making it unfit ([] = nothing known): its engine's
    target says (``Target.deploy.warnings``; a CPU engine validated on another ISA class, say)."""
    m = read_manifest(repo_dir)
    deploy = engine_deploy(m.get("engine"))
    return deploy.warnings(m, env or current_env()) if deploy is not None else []


def verify_deploy(repo_dir, env: dict | None = None) -> list[str]:
    """Problems that make this repository unfit for this environment ([] = deployable).

    Checks: the manifest's file digests (a changed, missing or added file), the versions of the tools the engine
    is bound to, and what its target says this host must have (``Target.deploy``: a GPU of the SM it was built
    for, the CPU architecture, ...).
    """
    repo = Path(repo_dir)
    m = read_manifest(repo)
    env = env or current_env()
    problems = file_problems(repo, m)
    engine = m.get("engine")
    deploy = engine_deploy(engine)
    if deploy is None:
        problems.append(f"manifest.json: unknown engine {engine!r} (targets: {', '.join(registry.names())}); "
                        f"{rebuild_hint(m)}")
        return problems
    rname = _obj(m.get("recipe")).get("name", "RECIPE")
    tools_now = env.get("tools", {})
    for tool in deploy.bound_tools:
        built, now = _obj(m.get("tools")).get(tool), tools_now.get(tool)
        if built is None:
            problems.append(f"manifest.json records no {tool} version for a {engine} engine; rebuild with "
                            f"`forge build {rname} --force build` where {tool} is installed")
        elif now is None:
            problems.append(f"{tool} is not installed here but the engine was built with {tool} {built}; "
                            f"install {tool}=={built} or rebuild the engine here (`forge build {rname} --force build`)")
        elif now != built:
            problems.append(f"{tool} {now} here, but the engine was built with {tool} {built} (engines are bound to the "
                            f"exact version); rebuild the engine with {tool} {now} (`forge build {rname} --force build`) "
                            f"or deploy with {tool}=={built}")
    return problems + deploy.problems(m, env)
