"""What changed between two nights: recipe keys, stage key components, tool versions, machine, commit.

Stage key components are the cache's own (``StageResult.components``): a change of config, data digest,
tool version, implementation version or hardware is a cause; a changed upstream digest is only the
consequence of a cause further up, and is reported only when the upstream stage's own key did not change
(then the upstream stage produced a different output from identical inputs: a non-deterministic build, or
the cache was cleared and it was rebuilt).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..cache import diff_components
from .store import Run

_HEX = re.compile(r"^[0-9a-f]{40,64}$")


@dataclass
class Change:
    kind: str            # recipe | component | output | tools | machine | commit
    path: str            # dotted: quantize.calibration.samples, tools.onnxruntime, data.sotu/calib, ...
    old: object
    new: object
    stages: list[str] = field(default_factory=list)

    def text(self) -> str:
        where = f" [{', '.join(self.stages)}]" if self.stages else ""
        if self.kind == "output":
            return f"{self.path}: output differs from identical key components{where}"
        return f"{self.path}: {short(self.old)} -> {short(self.new)}{where}"


def short(v) -> str:
    if v is None:
        return "(none)"
    if isinstance(v, str) and _HEX.match(v):
        return v[:12]
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _at(obj, path: str):
    for part in path.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return obj


def _leaves(obj, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_leaves(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def _recipe_leaves(run: Run) -> dict[str, object]:
    """The night's resolved recipe, of build.* only the section of the target it built: nights recorded before
    issue 25 hold every target's section, which would read as changes of targets neither night built."""
    return {k: v for k, v in _leaves(run.recipe_dict).items()
            if not run.target or not k.startswith("build.") or k.split(".")[1] in ("target", run.target)}


def recipe_changes(a: Run, b: Run) -> list[Change]:
    la, lb = _recipe_leaves(a), _recipe_leaves(b)
    return [Change("recipe", k, la.get(k), lb.get(k)) for k in sorted(set(la) | set(lb))
            if la.get(k) != lb.get(k) and k != "name"]


def component_changes(a: Run, b: Run) -> list[Change]:
    """Causes among the stages' key components, each listed once with the stages it touched."""
    grouped: dict[tuple, Change] = {}
    keys_a = {s["name"]: s.get("key") for s in a.stages}
    keys_b = {s["name"]: s.get("key") for s in b.stages}
    for sb in b.stages:
        sa = a.stage(sb["name"])
        ca, cb = (sa or {}).get("components"), sb.get("components")
        if not ca or not cb or sa.get("key") == sb.get("key"):
            continue
        for path in diff_components(ca, cb):
            head, _, rest = path.partition(".")
            if head == "upstream":
                up = rest.split(".")[0]
                if keys_a.get(up) and keys_a.get(up) == keys_b.get(up):
                    ch = grouped.setdefault(("output", up), Change("output", up, None, None))
                    ch.stages.append(sb["name"])
                continue
            old, new = _at(ca, path), _at(cb, path)
            # config.* reads best with the stage in front; tools/data/hardware are shared across stages
            label = f"{sb['name']}.{rest}" if head == "config" else path
            ch = grouped.setdefault((label, repr(old), repr(new)), Change("component", label, old, new))
            ch.stages.append(sb["name"])
    out = list(grouped.values())
    for ch in out:
        if ch.kind == "component" and ch.path.split(".")[0] == ch.stages[0] and len(ch.stages) == 1:
            ch.stages = []   # already named in the path
    return out


def machine_changes(a: Run, b: Run, skip_dists: set[str] = frozenset()) -> list[Change]:
    """Machine facts and tool versions; a tool already reported through a stage key is not repeated."""
    from ..host.tools import TOOLS   # version label -> its distribution names
    out = []
    for k in ("cpu_model", "cpu_isa", "gpus", "gpu_driver", "cuda_driver"):
        if a.machine.get(k) != b.machine.get(k):
            out.append(Change("machine", k, a.machine.get(k), b.machine.get(k)))
    ta, tb = a.machine.get("tools") or {}, b.machine.get("tools") or {}
    for k in sorted(set(ta) | set(tb)):
        if ta.get(k) != tb.get(k) and not ({k, *TOOLS.get(k, ())} & skip_dists):
            out.append(Change("tools", f"tools.{k}", ta.get(k), tb.get(k)))
    return out


def changes(a: Run, b: Run) -> list[Change]:
    """Everything that differs from night ``a`` to night ``b``: causes first, most specific first."""
    comps = component_changes(a, b)
    seen_tools = {c.path.split(".", 1)[1] for c in comps if c.path.startswith("tools.")}
    out = comps + machine_changes(a, b, seen_tools)
    if a.git_commit != b.git_commit or a.git_dirty != b.git_dirty:
        out.append(Change("commit", "forge commit", _commit(a), _commit(b)))
    return out


def _commit(r: Run) -> str:
    return f"{(r.git_commit or 'unknown')[:12]}{'+dirty' if r.git_dirty else ''}"


def brief(chs: list[Change], limit: int = 4) -> str:
    """One line for a JUnit message or a table cell."""
    if not chs:
        return "no key component, tool version or machine fact changed"
    text = "; ".join(c.text() for c in chs[:limit])
    return text + (f"; +{len(chs) - limit} more" if len(chs) > limit else "")
