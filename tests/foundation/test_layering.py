"""The package's layering, read from the code's own imports (every `import` statement, at module level or inside
a function): no import loop among pipeline's modules, nothing in pipeline imports the bench, the lab notebooks or
the scripts, no product test imports or runs lab code, and no module imports another module's private (underscore)
name. Built-in targets are found by
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


LAB = ROOT / "lab"
TESTS = ROOT / "tests"


def _lab_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) where a test file imports a lab module (by package or, with lab/ on sys.path, by file name) or
    names a path into lab/ in code (a sys.path entry, a file to load or to run). Docstrings may mention the lab."""
    lab_modules = {p.stem for p in LAB.glob("*.py")}
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if a.name.split(".")[0] in lab_modules | {"lab"}]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in lab_modules | {"lab"}:
                out.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            v = node.value.replace("\\", "/")
            if v == "lab" or v.startswith("lab/") or "/lab/" in v or v.endswith("/lab"):
                out.append((node.lineno, repr(node.value)))
    return sorted(out)


def test_the_lab_check_finds_what_it_looks_for(tmp_path):
    p = tmp_path / "t.py"
    p.write_text('"""lab/x.py is mentioned here: fine."""\nimport sys\nfrom pathlib import Path\n'
                 'sys.path.insert(0, str(Path(__file__).parents[2] / "lab"))\nimport quant_table\n'
                 'import subprocess\nsubprocess.run(["python", "lab/gpu_ort_run.py"])\n')
    assert [line for line, _ in _lab_uses(p)] == [4, 5, 7]


def test_no_product_test_imports_or_runs_lab_code():
    """Lab and product apart: `make test` depends on no lab script (lab/README.md). A lab script's tests live in
    lab/tests (`make lab-test`); what a product test needs lives in pipeline/."""
    files = [p for p in sorted(TESTS.rglob("*.py")) if p != Path(__file__).resolve()]     # this file names lab/
    bad = [(str(p.relative_to(ROOT)), line, what) for p in files for line, what in _lab_uses(p)]
    assert bad == []


def test_no_module_imports_another_modules_private_name():
    mods = _modules()
    bad = [(m, f"{t}.{n}", line) for m, p in mods.items() for t, names, line in _imports(m, p)
           for n in names if n.startswith("_") and not n.startswith("__") and t in mods and t != m]
    assert bad == []


# The floors of pipeline/, bottom up: a module imports only from its own floor or below (docs/architecture.md prints
# this table; test_the_docs_floor_table_is_this_one holds it). A module is on the floor of the longest entry it is
# under ("pipeline" itself: the package's __init__ only). A new module is placed here, or the test names it.
FLOORS = (
    ("ground", ("pipeline", "pipeline.errors", "pipeline.status", "pipeline.console", "pipeline.progress",
                "pipeline.hardware", "pipeline.host", "pipeline.modelinfo", "pipeline.gpus", "pipeline.recipe.ground",
                "pipeline.recipe_options", "pipeline.quantizer", "pipeline.deploy", "pipeline.stage_walk")),
    ("facts", ("pipeline.hashing", "pipeline.diskspace", "pipeline.gpu_topology", "pipeline.gpu_setup", "pipeline.weights", "pipeline.eval",
               "pipeline.target_registry")),
    ("targets' tools", ("pipeline.ort", "pipeline.tensorrt", "pipeline.trtllm", "pipeline.quant", "pipeline.data",
                        "pipeline.source", "pipeline.random_weights")),
    ("schema, cache, hand-off", ("pipeline.recipe", "pipeline.cache", "pipeline.remote_cache", "pipeline.triton")),
    ("stages and checks", ("pipeline.stages", "pipeline.doctor", "pipeline.report")),
    ("targets", ("pipeline.targets",)),
    ("orchestration and history", ("pipeline.runner", "pipeline.ray_executor", "pipeline.build_run", "pipeline.history",
                                   "pipeline.search")),
    ("CLI", ("pipeline.cli",)),
)


def floor_of(module: str) -> int | None:
    """The index in FLOORS of ``module``'s floor (None: on no floor)."""
    best = None
    for i, (_, roots) in enumerate(FLOORS):
        for r in roots:
            if module == r or (r != "pipeline" and module.startswith(r + ".")):
                if best is None or len(r) > len(best[1]):
                    best = (i, r)
    return best[0] if best else None


def test_every_module_is_on_a_floor_and_imports_none_above_it():
    g = _graph()
    assert [m for m in sorted(g) if floor_of(m) is None] == []
    up = sorted((FLOORS[floor_of(m)][0], m, FLOORS[floor_of(t)][0], t) for m, ts in g.items() for t in ts
                if floor_of(t) > floor_of(m))
    assert up == []


def _doc_name(module: str) -> str:
    """How docs/architecture.md names a module: ``x.py`` or ``x/`` (a package), relative to pipeline/."""
    if module == "pipeline":
        return "__init__.py"
    rel = module.removeprefix("pipeline.").replace(".", "/")
    return f"{rel}/" if (PKG / rel).is_dir() else f"{rel}.py"


def test_the_docs_floor_table_is_this_one():
    import re
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) (.+?) \| (.+?) \| .+ \|$", text, re.M)
    assert [(int(n), name, re.findall(r"`([^`]+)`", mods)) for n, name, mods in rows] == \
        [(i + 1, name, [_doc_name(m) for m in roots]) for i, (name, roots) in enumerate(FLOORS)]


# the ground floors: facts and schemas every layer uses; target code sits above them
GROUND = FLOORS[0][1] + FLOORS[1][1]
TARGET_CODE = ("pipeline.targets", "pipeline.stages", "pipeline.ort", "pipeline.trtllm", "pipeline.tensorrt",
               "pipeline.triton", "pipeline.quant")


def test_the_ground_floor_imports_no_target_code():
    under = lambda m, roots: any(m == r or (r != "pipeline" and m.startswith(r + ".")) for r in roots)  # noqa: E731
    bad = sorted((m, t) for m, ts in _graph().items() if under(m, GROUND) for t in ts if under(t, TARGET_CODE))
    assert bad == []
