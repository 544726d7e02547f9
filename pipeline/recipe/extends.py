"""A recipe's ``extends:`` chain and ``--set`` overrides: the chain merged parent first (a child that names another
build.target drops its parent's target sections), each build.<target> key's file remembered, dotted overrides
applied; and the refusals of a build.<target> section set for a target the recipe does not build, naming the file
(or --set) that set it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RecipeError
from .. import target_registry as registry
from .reading import INVISIBLE, MAX_RECIPE_DEPTH, parse_yaml, read_yaml, recipe_path, short_text

if TYPE_CHECKING:
    from .schema import Recipe


MAX_KEY_PARTS = 16                # --set a.b.c...


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def build_target(data: dict):
    build = data.get("build")
    return build.get("target", registry.DEFAULT) if isinstance(build, dict) else registry.DEFAULT


def retarget(parent: dict, target, origins: dict) -> dict:
    """``parent`` as a recipe of ``target`` extends it: where ``target`` is another target than the parent's, the
    parent's sections of targets other than ``target`` are dropped (with their ``origins``).

    Why drop rather than refuse: a recipe that names another build.target than its parent's says which target it
    builds, and the parent set those sections for the target it built, not for this one; there is no way to unset
    an inherited key, so refusing would leave no fix short of copying the parent. A child extends what its parent
    resolves to, which holds only its own target's section (BuildSection), so a grandchild that switches back
    gets that target's defaults, not its grandparent's. A foreign section inherited without such a switch is
    refused (inherited_build_problems): the file that wrote it set it for no target it builds."""
    if not isinstance(target, str) or target not in registry.names() or target == build_target(parent):
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


def load_chain(path: Path, seen: tuple[Path, ...] = (), origins: dict | None = None) -> dict:
    """The recipe at ``path`` with its ``extends`` chain merged in; ``origins`` (when given) receives the file
    each build.<target>.<key> comes from."""
    origins = {} if origins is None else origins
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.name for p in (*seen, path))
        raise RecipeError([f"{path}: 'extends' forms a cycle: {chain}"])
    if len(seen) >= MAX_RECIPE_DEPTH:
        raise RecipeError([f"{path}: more than {MAX_RECIPE_DEPTH} levels of 'extends'"])
    data = read_yaml(path)
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
    merged = load_chain(parent_path, (*seen, path), origins)
    if isinstance(data.get("build"), dict) and "target" in data["build"]:
        merged = retarget(merged, data["build"]["target"], origins)
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
        raise RecipeError([f"--set {short_text(item)!r}: '{part}' is not a position in a list of {len(node)} "
                           f"(use 0 to {len(node) - 1})"])
    i = int(part)
    if i >= len(node):
        raise RecipeError([f"--set {short_text(item)!r}: position {i} does not exist in a list of {len(node)} "
                           f"(use 0 to {len(node) - 1})"])
    return i


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {short_text(item)!r}: expected KEY.PATH=VALUE, e.g. --set quantize.calibration.samples=64")
            continue
        key, value = item.split("=", 1)
        bad = INVISIBLE.search(item)
        if bad:
            problems.append(f"--set {short_text(ascii(item))}: invisible or control character U+{ord(bad.group()):04X}; "
                            "remove it")
            continue
        parts = key.strip().split(".")
        if not all(parts) or len(parts) > MAX_KEY_PARTS:
            problems.append(f"--set {short_text(item)!r}: '{short_text(key)}' is not a key path like quantize.calibration.samples")
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
            problems.append(f"--set {short_text(item)!r}: '{short_text(key)}' goes inside a value that is not a section")
    if problems:
        raise RecipeError(problems)
    return data


def _section_defaults() -> dict[str, dict]:
    return {t.name: t.section.model_validate({}).model_dump(mode="json", by_alias=True)
            for t in registry.all_targets()}


def foreign_build_problems(path: Path, overrides: list[str], target: str) -> list[str]:
    """A build.<target> section another target reads, set by this recipe file or a --set, is refused (it would be
    accepted and ignored). Inherited sections: inherited_build_problems."""
    own = apply_overrides(read_yaml(path), [o for o in overrides if o.split("=", 1)[0].strip().startswith("build.")])
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
    another build.target (retarget), so what is left was written by a file for a target it does not build
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
