"""`forge search` for real, small: the default recipe on a 1-layer SmolLM2-shaped random model (the source stage makes
it), three of the onnxruntime target's candidates built through `forge build`'s code path, gated by the recipe's
validate section, the passing one measured by the real `python -m bench.run` (--quick, 1 repetition). About 20 s on a quiet
2-core machine (80 s while a CI run shared it). The fast cases (caching, winners, --apply, bad input) are tests/foundation/test_search.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forge_cli import run_cli  # noqa: E402  (tests/forge_cli.py)

TINY = ["model.source=random:HuggingFaceTB--SmolLM2-135M-Instruct", "model.layers=1",
        "validate.eval=[{set: wiki, split: eval, samples: 2, seq_len: 64}]", "validate.prompts.limit=2",
        "validate.prompts.max_new_tokens=4", "quantize.calibration.samples=4", "quantize.calibration.batch=2",
        "quantize.calibration.seq_len=64"]


@pytest.mark.integration
def test_forge_search_on_a_tiny_random_model_with_the_real_bench(tmp_path, monkeypatch, capsys):
    from pipeline.host.cpu import cpu_facts
    from pipeline.recipe import resolve
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    sets = [a for s in TINY for a in ("--set", s)]
    args = ["search", "smollm2-135m-int8", "--candidate", "fp32", "--candidate", "int4", "--candidate", "cuda-fp16",
            *sets, "--report-dir", tmp_path / "out"]
    code, out = run_cli(capsys, monkeypatch, *args, "--quick", "--reps", "1", "--apply", tmp_path / "fast.yaml")
    res = json.loads((tmp_path / "out/smollm2-135m-int8/search/search.json").read_text())
    assert code == 0, out
    rows = {c["name"]: c for c in res["candidates"]}
    assert {n: c["status"] for n, c in rows.items()} == {"fp32": "passed", "int4": "failed", "cuda-fp16": "skipped"}
    # the FP32 engine is the torch model's function; int4 on random weights misses the recipe's top-1 gate (0.85)
    assert abs(rows["fp32"]["gates"]["ppl_delta_pct"]) < 0.01 and rows["fp32"]["gates"]["top1_agreement"] > 0.99
    assert rows["int4"]["gates"]["top1_agreement"] < 0.85 and "top1_agreement_min" in rows["int4"]["reason"]
    assert "CUDAExecutionProvider" in rows["cuda-fp16"]["reason"]
    speed = rows["fp32"]["speed"]
    assert all(speed[k] > 0 for k in ("prefill_b1", "decode_b1", "decode_b8")), speed
    assert rows["int4"]["speed"] == {}                      # a failed candidate is not measured
    assert {m: (w or {}).get("candidate") for m, w in res["winners"].items()} == \
        {"prefill": "fp32", "decode": "fp32", "batch": "fp32", "served": None}     # served: --serve only
    assert res["machine"]["isa_class"] == cpu_facts()["isa_class"]
    assert Path(res["bench"]["results"]).is_file()          # the bench's own results.json, every sample
    # --apply: a recipe that resolves to the FP32 candidate's settings
    won, want = resolve(str(tmp_path / "fast.yaml")).to_dict(), resolve(
        "smollm2-135m-int8", [*rows["fp32"]["overrides"], *TINY]).to_dict()
    for d in (won, want):
        d.pop("name"), d.pop("description")
    assert won == want and won["quantize"]["algo"] == "none"

    # again, gates only: every stage of every built candidate is a cache hit
    code, out = run_cli(capsys, monkeypatch, *args, "--no-bench")
    again = json.loads((tmp_path / "out/smollm2-135m-int8/search/search.json").read_text())
    assert code == 0, out
    for c in again["candidates"]:
        assert not [s for s, st in c["stages"].items() if st == "built"], c
    assert {c["name"]: c["status"] for c in again["candidates"]} == \
        {"fp32": "passed", "int4": "failed", "cuda-fp16": "skipped"}
