"""`forge search RECIPE`: build every format the recipe's target offers for this machine, gate each with the
recipe's own validate section, measure the ones that pass with the project's bench, and name the fastest per metric.

A candidate (``Target.candidates``, pipeline/target_registry.py) is ``--set`` overrides on top of the searched recipe
and the user's ``--set``. Each is resolved like `forge build RECIPE --set ...`, planned (a candidate with a stage that
cannot run on this host is *skipped* with the plan's reason, nothing built) and built through :class:`BuildRun`, the
code path of `forge build`: every stage is cached, so a second search builds nothing. A candidate built under its own
name (``<recipe>.<candidate>``: its own cache index and report directory); one whose resolved recipe is the searched
recipe itself keeps the recipe's name, so it is the very build `forge build RECIPE` makes. Search builds are not nights:
the run history and its regression rules (which compare with the recipe's last night, of another format) are not used.

The gate is the recipe's validate stage: a candidate that fails it (or any stage) is in the table as *failed* with the
reason and is never a winner. The speed figures come from ``python -m bench.run --engine LABEL=DIR ...`` (the
code `make bench` runs: each engine in its own process, medians after a warm-up), run from this checkout; pipeline/
never imports bench/ (tests/foundation/test_layering.py), so the bench is a subprocess. Tests pass their own
``measure``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape

from .errors import ForgeError, RecipeError, UsageError
from .host.files import atomic_write
from .status import Status

# what the winner of each metric is chosen on: (key in the bench's flat figures, label); higher is faster
METRICS = {
    "prefill": ("prefill_b1", "prefill tok/s (1x256)"),
    "decode": ("decode_b1", "decode tok/s (batch 1)"),
    "batch": ("decode_b8", "decode tok/s (batch 8)"),
    "served": ("served_tok_s", "served output tok/s (tritonserver, HTTP)"),     # with --serve only
}
CHECKOUT = Path(__file__).resolve().parents[1]
BENCH = CHECKOUT / "bench" / "run.py"

# status of a candidate in the table
PASSED, FAILED, SKIPPED, INVALID = "passed", "failed", "skipped", "invalid"


@dataclass
class Row:
    """One candidate's outcome."""
    name: str
    summary: str
    overrides: list[str]
    status: str = ""                   # passed | failed | skipped | invalid
    reason: str = ""
    recipe: str = ""                   # the name it was built under
    recipe_hash: str | None = None
    stages: dict = field(default_factory=dict)      # stage -> status of this run (hit / built / failed ...)
    gates: dict = field(default_factory=dict)       # ppl_delta_pct, top1_agreement (pooled), per_set, the gate list
    engine: str | None = None          # the build stage's payload
    report: str | None = None
    speed: dict = field(default_factory=dict)       # the bench's flat figures, or {"error": ...}
    resolved: dict | None = None       # the resolved recipe (display form), for --apply
    sets: list[str] = field(default_factory=list)   # every --set it was built with (its own, the user's, its name)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("resolved", "sets")}

    @property
    def built(self) -> list[str]:
        return [s for s, st in self.stages.items() if st == Status.BUILT]


class NoHistory:
    """BuildRun's history hooks for search builds: no regression check, nothing recorded (a search is not a night)."""

    def check(self, recipe, results) -> list:
        return []

    def record(self, recipe, report, report_path) -> None:
        return None


def target_candidates(target) -> dict:
    return {c.name: c for c in target.candidates}


def pick(target, names: list[str] | None) -> list:
    """The candidates to build: all of the target's, or those named (unknown names: UsageError listing them)."""
    known = target_candidates(target)
    if not known:
        raise UsageError(f"build.target {target.name} declares no search candidates (Target.candidates in "
                         f"pipeline/targets/{target.name}.py); build its recipes with `forge build`")
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise UsageError(f"--candidate {', '.join(unknown)}: not a candidate of build.target {target.name}; "
                         f"choose from {', '.join(known)}")
    return [known[n] for n in dict.fromkeys(names)] if names else list(known.values())


def _same_recipe(a, b) -> bool:
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d.pop("name"), d.pop("description")
    return da == db


def _figures(report: dict) -> tuple[dict, dict]:
    """(gate figures, stage statuses) of one candidate's report.json."""
    stages = {s["name"]: s for s in report.get("stages", [])}
    ev = (stages.get("evaluate") or {}).get("metrics") or {}
    val = (stages.get("validate") or {}).get("metrics") or {}
    gates = {k: ev.get(k) for k in ("ppl_delta_pct", "top1_agreement") if k in ev}
    if ev.get("per_set"):
        gates["per_set"] = {s: {k: m.get(k) for k in ("ppl_delta_pct", "top1_agreement")}
                            for s, m in ev["per_set"].items()}
    if val.get("gates"):
        gates["gates"] = val["gates"]
        gates["passed"] = val.get("passed")
    return gates, {n: s["status"] for n, s in stages.items()}


def _failure(report: dict) -> str:
    """Why a candidate's build failed: the gates its validate stage failed, else the first failed or
    cannot-run-here stage and its message (the whole message is in its report.json and log)."""
    for s in report.get("stages", []):
        if s["status"] not in (Status.FAILED, Status.CANNOT_RUN_HERE):
            continue
        missed = [g for g in (s.get("metrics") or {}).get("gates", []) if not g.get("passed")]
        if missed:
            return f"{s['name']}: " + "; ".join(
                f"{g['name']} = {g['value']:.4g} (needs {g['op']} {g['threshold']}, {g['key']})"
                if isinstance(g.get("value"), (int, float)) else f"{g['name']} not produced (needs {g['key']})"
                for g in missed)
        return f"{s['name']}: {s.get('message') or s['status']}"
    return str(report.get("status"))


# ----------------------------------------------------------------------------------------------- measuring
Measure = Callable[[dict, Path], dict]


def require_bench() -> None:
    """The bench is run from this checkout (pipeline/ never imports bench/): say so when it is not here."""
    if not BENCH.is_file():
        raise ForgeError(f"no {BENCH.relative_to(CHECKOUT)} next to pipeline/ ({CHECKOUT}): forge search measures "
                         "with the checkout's bench; run it from a forge checkout, or pass --no-bench")


def _checkout_env() -> dict:
    """The environment of a bench subprocess: this checkout first on the path, no progress bars."""
    return dict(os.environ, FORGE_PROGRESS="0",
                PYTHONPATH=os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH", "")) if p))


def bench_measure(quick: bool = True, reps: int | None = None, threads: int | None = None) -> Measure:
    """``measure({label: engine dir}, work dir) -> {"machine": {...}, "settings": {...}, "engines": {label: flat
    figures or {"error"}}}`` by ``python -m bench.run --engine LABEL=DIR ...`` (make bench's code) in this checkout."""
    def measure(engines: dict, work: Path) -> dict:
        from .history.bench import flat
        require_bench()
        out = Path(work).resolve()       # the bench runs in the checkout
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "bench.run", "--out", str(out), "--no-warm-rerun",
               *(["--quick"] if quick else []), *(["--reps", str(reps)] if reps else []),
               *(["--threads", str(threads)] if threads else []),
               *[a for label, d in engines.items() for a in ("--engine", f"{label}={d}")]]
        env = _checkout_env()
        res_path = out / "results.json"
        res_path.unlink(missing_ok=True)
        tail: list[str] = []
        # the bench's progress goes on to stderr as it comes (a real search measures for minutes); its tables
        # (stdout) are in results.md
        with subprocess.Popen(cmd, cwd=str(CHECKOUT), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) as proc:
            for line in proc.stderr:
                sys.stderr.write(line)
                tail = (tail + [line.rstrip()])[-3:]
        if proc.returncode != 0 or not res_path.is_file():
            raise ForgeError(f"python -m bench.run exited {proc.returncode} and wrote no {res_path.name}: "
                             f"{' / '.join(tail)[-600:]}")
        res = json.loads(res_path.read_text())
        figs = {label: ({"error": e["error"]} if "error" in e else flat(e)) for label, e in res["engines"].items()}
        return {"machine": res.get("machine", {}), "settings": res.get("settings", {}), "engines": figs,
                "results": str(res_path)}
    return measure


def serve_measure(levels: tuple[int, ...] = (1, 4), requests: int = 8):
    """``serve(recipe, sets, reports dir, work dir) -> {"served_tok_s", "served_req_s", "served_levels", ...} or
    {"error"}``: ``python -m bench.serve`` (make bench-serve's code: `forge serve` of the candidate's package driven
    by tritonclient over HTTP) at ``levels``; the figure is output tok/s at the highest level."""
    def serve(recipe: str, sets: list[str], reports: Path, work: Path) -> dict:
        out = Path(work).resolve()
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve.json").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.serve", recipe, *[a for x in sets for a in ("--set", x)],
               "--from-reports", str(Path(reports).resolve()), "--levels", ",".join(map(str, levels)),
               "--requests", str(requests), "--protocols", "http", "--out", str(out)]
        env = _checkout_env()
        r = subprocess.run(cmd, cwd=str(CHECKOUT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        try:
            (eng,) = json.loads((out / "serve.json").read_text())["engines"].values()
        except (OSError, ValueError) as e:
            return {"error": f"python -m bench.serve exited {r.returncode}, no serve.json ({e}): {r.stdout[-400:]}"}
        if "error" in eng:
            return {"error": eng["error"][-600:]}
        per = eng["serve"]["protocols"]["http"]
        top = per[str(max(levels))]
        return {"served_tok_s": top["output_tok_s"], "served_req_s": top["req_s"], "served_p50_s": top["p50_s"],
                "served_levels": {c: {k: m[k] for k in ("req_s", "output_tok_s", "p50_s", "p99_s", "errors",
                                                        "mismatches")} for c, m in per.items()},
                "served_errors": eng["serve"]["errors"], "served_mismatches": eng["serve"]["mismatches"]}
    return serve


# ----------------------------------------------------------------------------------------------- the search
@dataclass
class Search:
    recipe: str
    overrides: list[str]
    out: Path
    candidates: list[str] | None = None
    measure: Measure | None = None     # None: gates only (--no-bench)
    cache: Callable | None = None      # () -> ArtifactCache
    err: object = None                 # a rich console for progress
    serve: Callable | None = None      # serve_measure(): served throughput per passing candidate (--serve)
    rows: list[Row] = field(default_factory=list)

    def _cache(self):
        if self.cache is None:
            from .cache import open_cache
            opened = open_cache()
            self.cache = lambda: opened
        return self.cache()

    def _say(self, msg: str) -> None:
        if self.err is not None:
            self.err.print(msg, highlight=False)

    def run(self) -> dict:
        from .recipe import resolve
        from .target_registry import get as target
        base = resolve(self.recipe, self.overrides)     # a bad recipe or --set: RecipeError (exit 2), nothing built
        chosen = pick(target(base.build.target), self.candidates)
        t0 = time.perf_counter()
        self.rows = [self._candidate(base, c) for c in chosen]
        speed_info: dict = {}
        passed = {r.name: r for r in self.rows if r.status == PASSED and r.engine}
        if self.measure is not None and passed:
            self._say(f"[bold]measuring[/] {', '.join(passed)} with the bench")
            try:
                speed_info = self.measure({n: r.engine for n, r in passed.items()}, self.out / "bench")
            except ForgeError as e:
                speed_info = {"error": str(e)}
            for n, r in passed.items():
                r.speed = (speed_info.get("engines") or {}).get(n) or {"error": speed_info.get("error", "not measured")}
        if self.serve is not None:
            for n, r in passed.items():
                self._say(f"[bold]serving[/] {n} with tritonserver (bench.serve)")
                served = self.serve(self.recipe, r.sets, self.out / "builds", self.out / "serve" / n)
                r.speed.update(served if "error" not in served else {"serve_error": served["error"]})
        from .host.cpu import cpu_facts
        result = {
            "recipe": base.name, "recipe_path": base.path, "recipe_hash": base.hash, "target": base.build.target,
            "overrides": self.overrides,
            "machine": {**cpu_facts(), **{k: v for k, v in (speed_info.get("machine") or {}).items()
                                          if k in ("cpu_model", "usable_cpus", "threads", "load_avg_at_start", "date")}},
            "bench": {k: speed_info[k] for k in ("settings", "results", "error") if k in speed_info}
            if self.measure is not None else {"skipped": "--no-bench: gates only"},
            "metrics": {m: label for m, (_, label) in METRICS.items()},
            "candidates": [r.to_json() for r in self.rows],
            "winners": winners(self.rows),
            "served": self.serve is not None,
            "wall_s": round(time.perf_counter() - t0, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / "search.json", json.dumps(result, indent=1, default=str))
        atomic_write(self.out / "search.md", markdown(result))
        return result

    def _candidate(self, base, cand) -> Row:
        from .build_run import BuildRun
        from .recipe import resolve
        from .runner import Runner
        row = Row(cand.name, cand.summary, list(cand.overrides))
        sets = [*cand.overrides, *self.overrides]
        try:
            r = resolve(self.recipe, sets)
            if not _same_recipe(r, base):       # the recipe itself keeps its name (the build `forge build` makes)
                sets.append(f"name={base.name}.{cand.name}")
                r = resolve(self.recipe, sets)
        except RecipeError as e:
            row.status, row.reason = INVALID, "; ".join(e.problems)
            self._say(f"[yellow]{cand.name}: invalid for this recipe:[/] {escape(row.reason)}")
            return row
        row.recipe, row.recipe_hash, row.resolved, row.sets = r.name, r.hash, r.display_dict(), list(sets)
        runner = Runner(r, self._cache())
        problems = runner.plan_problems()
        if problems:
            row.status, row.reason = INVALID, "; ".join(problems)
            self._say(f"[yellow]{cand.name}: invalid for this recipe:[/] {escape(row.reason)}")
            return row
        cannot = [p for p in runner.plan() if p.status == Status.CANNOT_RUN_HERE]
        if cannot:
            row.status = SKIPPED
            row.reason = f"cannot run here: {cannot[0].name}: {cannot[0].reason}"
            self._say(f"[yellow]{cand.name}: skipped[/] ({escape(row.reason)})")
            return row
        self._say(f"[bold]candidate {cand.name}[/] ({escape(r.name)})")
        builds = self.out / "builds"
        run = BuildRun(overrides=sets, from_stage=None, until=None, force=None, keep_going=False, report_dir=builds,
                       cache=self._cache, verify=False, out=Console(quiet=True), err=self.err or Console(quiet=True),
                       nightly=NoHistory())   # quiet out: no per-candidate summary table
        run.local([self.recipe])
        rp = builds / r.name / "report.json"
        try:
            report = json.loads(rp.read_text())
        except (OSError, ValueError) as e:
            row.status, row.reason = FAILED, f"no report ({e})"
            return row
        row.report = str(rp)
        row.gates, row.stages = _figures(report)
        status = run.statuses.get(r.name)
        if status == Status.PASSED:
            row.status = PASSED
            build = next((s for s in report["stages"] if s["name"] == "build"), None)
            row.engine = build and build.get("payload")
        elif status == Status.INCOMPLETE:
            row.status, row.reason = SKIPPED, "cannot run here: " + _failure(report)
        else:
            row.status, row.reason = FAILED, _failure(report)
        return row


def winners(rows: list[Row]) -> dict:
    """metric -> {candidate, value} of the fastest *passing* candidate with that figure (None: no such candidate)."""
    out = {}
    for metric, (key, _) in METRICS.items():
        best = max(((r.speed.get(key), r.name) for r in rows if r.status == PASSED and r.speed.get(key)),
                   default=None)
        out[metric] = {"candidate": best[1], "value": best[0]} if best else None
    return out


# ----------------------------------------------------------------------------------------------- output
def _num(v, fmt="{:,.1f}") -> str:
    return "" if v is None else fmt.format(v)


COLUMN = {"prefill": "prefill tok/s", "decode": "decode b1 tok/s", "batch": "decode b8 tok/s",
          "served": "served tok/s"}


def shown_metrics(result: dict) -> list[str]:
    """The metrics of the table: served only where a search measured it (--serve)."""
    return [m for m in METRICS if m != "served" or result.get("served")]


def headers(result: dict) -> list[str]:
    return ["candidate", "status", "ppl Δ %", "top-1", *(COLUMN[m] for m in shown_metrics(result)), "fastest for",
            "why"]


def table_rows(result: dict) -> list[list[str]]:
    """The table's cells per candidate (``headers``): name, status, ppl delta %, top-1, each metric's figure, the
    metrics it is fastest for, why it failed or was skipped (shared by the terminal table and search.md)."""
    wins = {}
    for metric, w in result["winners"].items():
        if w:
            wins.setdefault(w["candidate"], []).append(metric)
    out = []
    for c in result["candidates"]:
        g, s = c["gates"], c["speed"]
        why = c["reason"] or "; ".join(f"{what}: {s[k]}" for k, what in (("error", "bench"), ("serve_error", "serve"))
                                       if k in s)
        out.append([c["name"], c["status"], _num(g.get("ppl_delta_pct"), "{:+.2f}"),
                    _num(g.get("top1_agreement"), "{:.3f}"),
                    *(_num(s.get(METRICS[m][0])) for m in shown_metrics(result)),
                    ", ".join(wins.get(c["name"], [])), why])
    return out


def machine_line(result: dict) -> str:
    m = result["machine"]
    extra = f", {m['usable_cpus']} usable CPUs, {m['threads']} threads" if m.get("usable_cpus") else ""
    return f"{m.get('cpu_model', '?')} (ISA class {m.get('isa_class', '?')}){extra}"


def markdown(result: dict) -> str:
    lines = [f"# forge search {result['recipe']}", "",
             f"Machine: {machine_line(result)}; {result['finished']}.",
             f"Every candidate is gated by {result['recipe']}'s validate section "
             f"(--set {' '.join(result['overrides']) or 'none'}); ppl Δ and top-1 are pooled over its eval sets "
             "vs FP32. Speed: `python -m bench.run` medians" +
             (f" ({json.dumps(result['bench'].get('settings', {}))})." if result["bench"].get("settings") else
              f" — {result['bench'].get('error') or result['bench'].get('skipped', 'not run')}.") +
             (" Served: `python -m bench.serve` (`forge serve` of the candidate's package, tritonclient over HTTP), "
              "output tok/s at the highest concurrency." if result.get("served") else ""), "",
             "| " + " | ".join(headers(result)) + " |", "|" + "---|" * len(headers(result))]
    for cells in table_rows(result):
        lines.append("| " + " | ".join(x.replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
    lines += ["", "Winners (fastest passing candidate):", ""]
    for metric, w in ((m, result["winners"][m]) for m in shown_metrics(result)):
        label = result["metrics"][metric]
        lines.append(f"- {metric} ({label}): " + (f"**{w['candidate']}** {w['value']:,.1f}" if w else "none"))
    lines += ["", "Overrides per candidate:", ""]
    for c in result["candidates"]:
        lines.append(f"- {c['name']}: `{' '.join(c['overrides'])}`")
    return "\n".join(lines) + "\n"


def render(result: dict, console) -> None:
    from rich.table import Table
    t = Table(title=escape(f"forge search {result['recipe']} — {machine_line(result)}"))
    colors = {PASSED: "green", FAILED: "red", SKIPPED: "yellow", INVALID: "red"}
    for h in headers(result):
        t.add_column(h, no_wrap=h != "why", justify="right" if "tok/s" in h or h in ("ppl Δ %", "top-1") else "left")
    for cells in table_rows(result):
        cells = [escape(x) for x in cells]
        cells[1] = f"[{colors.get(cells[1], 'white')}]{cells[1]}"
        t.add_row(*cells)
    console.print(t)
    for metric, w in ((m, result["winners"][m]) for m in shown_metrics(result)):
        label = result["metrics"][metric]
        console.print(f"fastest for {metric} ({escape(label)}): " + (f"[bold]{escape(w['candidate'])}[/] "
                                                                     f"{w['value']:,.1f}" if w else "none"),
                      highlight=False)


# ----------------------------------------------------------------------------------------------- --apply
def check_apply(metric: str, dest: Path | None) -> None:
    """--metric and --apply as given: UsageError (exit 2) before anything is built."""
    if metric not in METRICS:
        raise UsageError(f"--metric {metric}: choose {', '.join(METRICS)}")
    if dest is not None and Path(dest).suffix not in (".yaml", ".yml"):
        raise UsageError(f"--apply {dest}: give a recipe file ending in .yaml")


def _diff(base, want, where: str = ""):
    """What a child recipe writes so that deep-merging it onto ``base`` gives ``want``; raises KeyError(path) when
    ``want`` lacks a key ``base`` has (an ``extends`` cannot unset a key)."""
    if isinstance(base, dict) and isinstance(want, dict):
        gone = [k for k in base if k not in want]
        if gone:
            raise KeyError(f"{where}{gone[0]}")
        out = {}
        for k, v in want.items():
            if k not in base:
                out[k] = v
            elif v != base[k]:
                out[k] = _diff(base[k], v, f"{where}{k}.") if isinstance(v, dict) and isinstance(base[k], dict) else v
        return out
    return want


def _chain(path: Path) -> list[Path]:
    """The recipe file and the files its ``extends`` chain names, child first."""
    from .recipe.reading import read_yaml, recipe_path
    out, p = [], path.resolve()
    while p not in out:
        out.append(p)
        parent = read_yaml(p).get("extends")
        if not isinstance(parent, str):
            break
        p = recipe_path(parent, p.parent, relative_to=p.parent).resolve()
    return out


def apply(result: dict, metric: str, dest: Path) -> tuple[Path, str]:
    """Write ``dest``: a recipe that extends the searched recipe (or, where the winner must drop a key the searched
    recipe sets, the nearest recipe of its ``extends`` chain that does not) with the settings of ``metric``'s winner.
    It is resolved again and must give the winner's recipe (but its name and description); returns (path, the
    recipe it extends)."""
    import yaml

    from .recipe import recipe_path, resolve
    check_apply(metric, dest)
    w = result["winners"].get(metric)
    if not w:
        raise ForgeError(f"no passing candidate has a {METRICS[metric][1]} figure: nothing to apply (see the table)")
    row = next(c for c in result["candidates"] if c["name"] == w["candidate"])
    want = resolve(result["recipe_path"], [*row["overrides"], *result["overrides"]]).display_dict()
    dest = Path(dest)
    for parent in _chain(recipe_path(result["recipe_path"])):
        base = resolve(str(parent)).display_dict()
        try:
            body = _diff({k: v for k, v in base.items() if k not in ("name", "description")},
                         {k: v for k, v in want.items() if k not in ("name", "description")})
        except KeyError:
            continue
        break
    else:
        raise ForgeError(f"the winner {w['candidate']} cannot be written as a child of {result['recipe']} or its "
                         f"parents (each sets a key the winner does not have); build it with --set: "
                         f"forge build {result['recipe']} " + " ".join(f"--set {s}" for s in row["overrides"]))
    dest.parent.mkdir(parents=True, exist_ok=True)
    ext = parent.stem if parent.parent == dest.resolve().parent else os.path.relpath(parent, dest.resolve().parent)
    label = METRICS[metric][1]
    doc = {"extends": ext,
           "description": f"{want.get('description', '')} -- forge search winner for {metric}: {w['candidate']}".strip(),
           **body}
    header = (f"# Written by `forge search {result['recipe']} --apply {dest.name} --metric {metric}` on "
              f"{result['finished']}:\n# the fastest candidate that passed the gates for {label}: {w['candidate']} "
              f"({w['value']:,.1f}) on {machine_line(result)}.\n")
    atomic_write(dest, header + yaml.safe_dump(doc, sort_keys=False))
    got = resolve(str(dest)).display_dict()
    same = all(got.get(k) == want.get(k) for k in want if k not in ("name", "description"))
    if not same:        # a bug of _diff: say so rather than leave a recipe that builds something else
        dest.unlink()
        raise ForgeError(f"--apply: the written recipe did not resolve to the winner's settings; build the winner "
                         f"with: forge build {result['recipe']} " + " ".join(f"--set {s}" for s in row["overrides"]))
    return dest, str(ext)
