"""Triton ``config.pbtxt`` writing and parsing through Triton's own ``ModelConfig`` protobuf.

Model configs are built as plain dicts (our templates), converted with ``json_format.ParseDict``
into ``tritonclient.grpc.model_config_pb2.ModelConfig`` — an unknown field or a wrong type fails
right there — and written with ``text_format``. Parsing uses ``text_format.Parse`` (strict: unknown
fields are errors), so every file we ship is exactly what tritonserver will read.
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from pipeline.errors import ForgeError

ModelConfig = model_config_pb2.ModelConfig


def params(**kv) -> dict:
    """``parameters`` map in ModelConfig dict form: every value becomes a ``string_value``."""
    out = {}
    for k, v in kv.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        out[k] = {"string_value": str(v)}
    return out


def tensor(name: str, dtype: str, dims: list[int], *, optional: bool = False, reshape: list[int] | None = None) -> dict:
    """One ``input``/``output`` entry; ``dtype`` like ``TYPE_INT32``."""
    t: dict = {"name": name, "data_type": dtype, "dims": list(dims)}
    if optional:
        t["optional"] = True
    if reshape is not None:
        t["reshape"] = {"shape": list(reshape)}
    return t


def config_from_dict(cfg: dict) -> ModelConfig:
    """Dict → ModelConfig; raises ForgeError naming the model and the bad field."""
    try:
        return json_format.ParseDict(cfg, ModelConfig(), ignore_unknown_fields=False)
    except json_format.ParseError as e:
        raise ForgeError(f"model config for {cfg.get('name', '?')!r} is not a valid Triton ModelConfig: {e}") from e


def to_pbtxt(cfg: dict | ModelConfig) -> str:
    msg = cfg if isinstance(cfg, ModelConfig) else config_from_dict(cfg)
    return text_format.MessageToString(msg)


def write_config(model_dir: str | Path, cfg: dict | ModelConfig) -> Path:
    """Write ``<model_dir>/config.pbtxt`` and return its path."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(to_pbtxt(cfg))
    return path


def parse_config(path: str | Path) -> ModelConfig:
    """Parse one config.pbtxt strictly; ForgeError names the file and the line."""
    path = Path(path)
    try:
        return text_format.Parse(path.read_text(), ModelConfig())
    except text_format.ParseError as e:
        raise ForgeError(f"{path}: not a valid Triton ModelConfig ({e}); regenerate the repository with `forge build RECIPE --force package`") from e


def parse_all_configs(repo_dir: str | Path) -> dict[str, ModelConfig]:
    """Parse every ``<repo>/<model>/config.pbtxt``; all problems are reported at once.

    Checks beyond the protobuf schema: the config's ``name`` equals its folder, each model has a
    version folder, and every ensemble step names a model that exists in the repository with
    tensors the model declares; so does forge's BLS (the inputs it forwards, its ``*_inputs`` parameters).
    """
    repo_dir = Path(repo_dir)
    problems: list[str] = []
    configs: dict[str, ModelConfig] = {}
    model_dirs = sorted(p for p in repo_dir.iterdir() if p.is_dir() and (p / "config.pbtxt").exists()) if repo_dir.is_dir() else []
    if not model_dirs:
        raise ForgeError(f"{repo_dir}: no model folders with a config.pbtxt; is this a Triton model repository?")
    for d in model_dirs:
        try:
            cfg = parse_config(d / "config.pbtxt")
        except ForgeError as e:
            problems.append(str(e))
            continue
        if cfg.name and cfg.name != d.name:
            problems.append(f"{d / 'config.pbtxt'}: name {cfg.name!r} differs from its folder {d.name!r}")
        if not any(p.is_dir() and p.name.isdigit() for p in d.iterdir()):
            problems.append(f"{d}: no numeric version folder (e.g. {d}/1)")
        configs[d.name] = cfg
    for name, cfg in configs.items():
        if cfg.platform != "ensemble":
            problems += _bls_problems(name, cfg, configs, repo_dir)
            continue
        for step in cfg.ensemble_scheduling.step:
            target = configs.get(step.model_name)
            if target is None:
                problems.append(f"{name}: ensemble step uses model {step.model_name!r}, which is not in {repo_dir}")
                continue
            ins = {t.name for t in target.input}
            outs = {t.name for t in target.output}
            for k in step.input_map:
                if k not in ins:
                    problems.append(f"{name}: step {step.model_name!r} maps input {k!r}, which that model does not declare")
            for k in step.output_map:
                if k not in outs:
                    problems.append(f"{name}: step {step.model_name!r} maps output {k!r}, which that model does not declare")
    if problems:
        raise ForgeError("invalid Triton model repository:\n" + "\n".join(f"- {p}" for p in problems))
    return configs


def _bls_problems(name: str, cfg: ModelConfig, configs: dict[str, ModelConfig], repo_dir: Path) -> list[str]:
    """forge's BLS (python_models/bls.py) forwards client inputs as its ``preprocessing_inputs`` /
    ``engine_inputs`` parameters say; each target model must declare them (Triton answers 400 "unexpected
    inference input" otherwise, issue 28)."""
    # a BLS from before these parameters carries its own table in its model.py: nothing to check
    if "tensorrt_llm_model_name" not in cfg.parameters or "engine_inputs" not in cfg.parameters:
        return []
    problems = []
    for model_key, fwd_key in (("preprocessing_model_name", "preprocessing_inputs"), ("tensorrt_llm_model_name", "engine_inputs")):
        target = cfg.parameters[model_key].string_value if model_key in cfg.parameters else ""
        if target not in configs:
            problems.append(f"{name}: parameter {model_key} names {target!r}, which is not in {repo_dir}")
            continue
        try:   # `in` first: indexing a protobuf map adds the key
            fwd = json.loads(cfg.parameters[fwd_key].string_value) if fwd_key in cfg.parameters else None
        except ValueError:
            fwd = None
        if not isinstance(fwd, dict):
            problems.append(f"{name}: parameter {fwd_key} is missing or not a JSON object of client input -> {target} input")
            continue
        ins = {t.name for t in cfg.input}
        declared = {t.name for t in configs[target].input}
        for src, dst in sorted(fwd.items()):
            if src not in ins:
                problems.append(f"{name}: forwards input {src!r}, which it does not declare")
            if dst not in declared:
                problems.append(f"{name}: forwards {src!r} to {target} input {dst!r}, which {target} does not declare")
    return problems
