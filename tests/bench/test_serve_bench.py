"""bench/serve.py's bookkeeping around the load it drives: the served night's payloads are read from its report,
every level's figures land in the result, and the engine's batch-invariance fact is read from that night's build.
The server and the client are replaced (the real-tritonserver run is tests/serving)."""

import json

import bench.serve as serve


def _night(tmp_path, recipe="smollm2-135m-int8"):
    pay = {}
    for stage in ("build", "evaluate", "package"):
        d = tmp_path / "cache" / stage
        d.mkdir(parents=True)
        pay[stage] = str(d)
    (tmp_path / "cache" / "evaluate" / "generations.json").write_text(json.dumps([{"prompt": "p", "ids": [1, 2]}]))
    (tmp_path / "cache" / "build" / "forge_ort.json").write_text(
        json.dumps({"batch_invariant": True, "quantization": {"algo": "int8"}}))
    rep = tmp_path / "out" / recipe
    rep.mkdir(parents=True)
    (rep / "report.json").write_text(json.dumps(
        {"stages": [{"name": n, "status": "hit", "payload": p} for n, p in pay.items()]}))
    return tmp_path / "out"


def test_bench_recipe_reads_the_night_it_serves(tmp_path, monkeypatch):
    reports = _night(tmp_path)
    calls = []
    monkeypatch.setattr(serve, "serve_process", lambda repo, port, log: calls.append(("serve", str(repo))) or object())
    monkeypatch.setattr(serve, "stop", lambda p: calls.append(("stop",)))

    def drive(http, grpc, proto, gens, n_new, c, n):
        calls.append(("drive", proto, c, n))
        return {"req_s": 2.0 * c if c > 1 else 2.0, "output_tok_s": 1.0, "p50_s": 0.1, "p99_s": 0.2,
                "errors": 0, "mismatches": 0}
    monkeypatch.setattr(serve, "drive", drive)
    res = serve.bench_recipe("smollm2-135m-int8", [1, 4], 8, ["http"], tmp_path / "bench", 18000, reports)
    assert "error" not in res
    s = res["serve"]
    assert s["batch_invariant"] is True and s["quantization"] == "int8"     # from the night's build payload
    assert s["ratios"] == {"http": {"c4/c1": 4.0}} and s["errors"] == 0 and s["mismatches"] == 0
    assert res["package"] == str(tmp_path / "cache" / "package")
    assert ("drive", "http", 4, 8) in calls and calls[-1] == ("stop",)


def test_bench_recipe_without_a_night_says_which_build_to_run(tmp_path):
    res = serve.bench_recipe("smollm2-135m-int8", [1], 2, ["http"], tmp_path, 18000, tmp_path / "none")
    assert "forge build smollm2-135m-int8 --report-dir" in res["error"]
