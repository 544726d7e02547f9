"""The package's layering, read from the code's own imports (every `import` statement, at module level or inside
a function): no import loop among pipeline's modules, nothing in pipeline imports the bench, the lab notebooks or
the scripts, and no module imports another module's private (underscore) name. Built-in targets are found by
name (target_registry.BUILTIN, importlib): that is plug-in discovery, not an import, and is not an arrow here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "pipeline"
# python_models/ run inside tritonserver's python backend, as files copied into a model repository
EXCLUDED = {"triton/python_models"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        if any(str(p.relative_to(PKG)).startswith(x) for x in EXCLUDED):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = p
    return out


def _imports(mod: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement of the file."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for target, names, _ in _imports(m, p):
            for cand in [f"{target}.{n}" for n in names] + [target]:
                if cand in mods and cand != m:
                    g[m].add(cand)
                    break
    return g


def test_the_check_reads_the_package():
    g = _graph()
    assert len(g) > 80 and sum(map(len, g.values())) > 150, "the import graph is (nearly) empty: the reader broke"
    assert "pipeline.runner" in g["pipeline.build_run"]


def test_no_import_loop_in_pipeline():
    g = _graph()
    index, low, stack, on, loops = {}, {}, [], set(), []

    def visit(v):               # Tarjan: every strongly connected set of more than one module is a loop
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    assert loops == []


def test_pipeline_imports_no_bench_lab_or_scripts():
    bad = [(m, t, line) for m, p in _modules().items() for t, _, line in _imports(m, p)
           if t.split(".")[0] in ("bench", "lab", "scripts")]
    assert bad == []


def test_no_module_imports_another_modules_private_name():
    mods = _modules()
    bad = [(m, f"{t}.{n}", line) for m, p in mods.items() for t, names, line in _imports(m, p)
           for n in names if n.startswith("_") and not n.startswith("__") and t in mods and t != m]
    assert bad == []


# the ground floor: facts and schemas every layer uses; target code sits above it
GROUND = ("pipeline.errors", "pipeline.status", "pipeline.console", "pipeline.hardware", "pipeline.recipe_options",
          "pipeline.host", "pipeline.hashing", "pipeline.modelinfo", "pipeline.target_registry", "pipeline.stage_walk",
          "pipeline.progress")
TARGET_CODE = ("pipeline.targets", "pipeline.stages", "pipeline.ort", "pipeline.trtllm", "pipeline.tensorrt",
               "pipeline.triton", "pipeline.quant")


def test_the_ground_floor_imports_no_target_code():
    under = lambda m, roots: any(m == r or m.startswith(r + ".") for r in roots)  # noqa: E731
    bad = sorted((m, t) for m, ts in _graph().items() if under(m, GROUND) for t in ts if under(t, TARGET_CODE))
    assert bad == []
