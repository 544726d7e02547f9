"""bench.gpu (issues 17, 26, 38), the parts that run without a GPU: the tables, ratios and bound arithmetic, the
plan (which entries, in which order, --only/--skip), the budget (skip what will not fit, stop what overruns and
keep its figures), a failing entry recorded while the others go on (real worker processes), ORT GenAI's builder
wrapper and its CUDA-graph switch."""

import json
import struct
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from bench import bound, gpu, gpu_report

ROOT = Path(__file__).resolve().parents[2]
QWEN7B = ROOT / "pipeline/model_configs/Qwen--Qwen2.5-7B-Instruct.json"


def _res(prefill, b1, b8, ttft, key="4x256", kind="ours"):
    return {"kind": kind, "prefill": {key: {"tokens_per_s": prefill}},
            "decode": {"1": {"tokens_per_s": b1}, "8": {"tokens_per_s": b8}},
            "ttft": {"median_s": ttft, "prompt_tokens": 256}}


def test_markdown_ratios_compare_the_named_engines():
    results = {"gpu": "NVIDIA H200 (sm_90)", "engines": {
        "fp16": _res(40000, 160, 1600, 0.010), "fp16+graph": _res(44000, 660, 4200, 0.011),
        "int4+graph": _res(40000, 540, 3500, 0.012), "oga-int4": _res(130000, 300, 2300, 0.010),
        "torch-fp16": _res(30000, 30, 280, 0.040), "fp32": {"error": "boom"}}}
    md = gpu_report.markdown(results)
    assert "GPU: NVIDIA H200 (sm_90)" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| INT4 CUDA graph / ORT GenAI INT4 |"))
    assert row == "| INT4 CUDA graph / ORT GenAI INT4 | 0.31x | 1.80x | 1.52x | 0.83x |"
    row = next(ln for ln in md.splitlines() if ln.startswith("| INT4 CUDA graph / FP16 CUDA graph |"))
    assert "| 0.82x |" in row
    assert not any(ln.startswith("| FP16 / FP32 |") for ln in md.splitlines())   # fp32 failed: no ratio
    assert "- fp32: boom" in md


# ------------------------------------------------------------------------------------------------ bound arithmetic
def test_qwen25_7b_decode_step_reads_14_14_gb_in_fp16():
    s = bound.step_weights(QWEN7B)
    assert s["source"] == "config" and s["params_total"] == 7_615_616_512
    assert s["embedding_params"] == 152_064 * 3_584 and s["step_params"] == 7_070_619_136
    assert s["step_bytes"] == 14_141_238_272 and f"{s['step_bytes'] / 1e9:.2f}" == "14.14"
    # the H100 figures: 2,934 GB/s copy -> decode b1 bound ~207 tok/s; PyTorch's 164.4 tok/s is 79 %
    assert round(bound.bound_tok_s(2934e9, s["step_bytes"], 1)) == 207
    results = {"engines": {"bandwidth": {"copy": {"bytes_per_s": 2934e9}}}, "bound": {"step": s}}
    assert round(gpu_report.pct_of_bound(results, 164.4, 1)) == 79
    assert round(gpu_report.pct_of_bound(results, 1296, 8)) == 78
    assert bound.bound_tok_s(None, s["step_bytes"], 1) is None


def test_config_count_equals_transformers_and_the_stored_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = json.loads(QWEN7B.read_text())
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**cfg))
    assert bound.config_param_counts(cfg)["layers"] + 2 * 152_064 * 3_584 + 3_584 == \
        sum(p.numel() for p in m.parameters())
    for tied, conf in ((False, transformers.Qwen2Config), (True, transformers.LlamaConfig)):
        c = conf(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied,
                 **({"attention_bias": True} if conf is transformers.LlamaConfig else {}))
        d = tmp_path / f"m{tied}"
        transformers.AutoModelForCausalLM.from_config(c).save_pretrained(d)
        from_files = bound.step_weights(d)
        (d / "model.safetensors").rename(d / "hidden")
        from_config = bound.step_weights(d)
        assert from_files["source"] == "safetensors" and from_config["source"] == "config"
        assert from_files["step_params"] == from_config["step_params"], tied
        assert from_files["tied_embedding"] is tied
        # a tied lm_head reads the embedding table each step: it counts then
        assert (from_files["step_params"] == from_files["params_total"]) is tied


def test_onnx_step_bytes_leave_out_only_a_table_that_is_only_gathered(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    def model(tied: bool):
        emb = numpy_helper.from_array(np.zeros((100, 8), np.float16), "embed")
        w = numpy_helper.from_array(np.zeros((8, 100), np.float16), "head")
        nodes = [helper.make_node("Gather", ["embed", "ids"], ["x"]),
                 helper.make_node("MatMul", ["x", "embed_t" if tied else "head"], ["logits"])]
        inits = [emb, w]
        if tied:
            nodes.insert(1, helper.make_node("Transpose", ["embed"], ["embed_t"]))
            inits = [emb]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, [1, 100])], inits)
        p = tmp_path / f"m{tied}.onnx"
        onnx.save(helper.make_model(g), str(p))
        return bound.onnx_step_bytes(p)
    untied, tied = model(False), model(True)
    assert untied["excluded"] == ["embed"] and untied["step_bytes"] == 8 * 100 * 2
    assert tied["excluded"] == [] and tied["step_bytes"] == 100 * 8 * 2


def test_copy_bandwidth_counts_read_plus_write():
    pytest.importorskip("torch")
    r = bound.copy_bandwidth("cpu", mib=4, reps=5, min_sample_s=0.01)
    assert r["buffer_bytes"] == 4 * 2**20 and r["bytes_per_s_spread"]["n"] == 5
    assert r["bytes_per_s"] == pytest.approx(2 * r["buffer_bytes"] / sorted(r["times_s"])[2])


def test_safetensors_header_is_read_without_the_data(tmp_path):
    header = json.dumps({"a": {"dtype": "F16", "shape": [3, 4], "data_offsets": [0, 24]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 24)
    assert bound.safetensors_shapes(tmp_path) == {"a": (3, 4)}


# ------------------------------------------------------------------------------------------------ plan, budget
def _args(tmp_path, *extra, hf=True):
    argv = ["--engine", f"fp16={tmp_path}", "--engine", f"int4={tmp_path}", "--out", str(tmp_path / "out"),
            *(["--hf-dir", str(tmp_path)] if hf else []), *extra]
    return argv


def _fake_main(monkeypatch, argv, runner):
    monkeypatch.setattr(gpu, "run_worker", runner)
    monkeypatch.setattr("pipeline.host.gpu.cuda_device", lambda: None)
    gpu.main(argv)
    return json.loads((Path(argv[argv.index("--out") + 1]) / "results.json").read_text())


def test_plan_order_puts_the_summary_figures_first_and_only_skip_select(tmp_path, monkeypatch):
    ran = []
    res = _fake_main(monkeypatch, _args(tmp_path), lambda s, out, left: ran.append(s["name"]) or {"kind": s["kind"]})
    assert ran == ["bandwidth", "fp16+graph", "int4+graph", "oga-fp16-build", "oga-fp16+graph", "oga-fp16",
                   "torch-static-fp16", "oga-int4-build", "oga-int4+graph", "oga-int4", "torch-static-int4",
                   "fp16", "int4", "torch-fp16"]
    assert list(res["engines"]) == ran
    ran.clear()
    _fake_main(monkeypatch, _args(tmp_path, "--only", "bandwidth,ours-graph", "--only", "oga-fp16*"),
               lambda s, out, left: ran.append(s["name"]) or {})
    assert ran == ["bandwidth", "fp16+graph", "int4+graph", "oga-fp16-build", "oga-fp16+graph", "oga-fp16"]
    ran.clear()
    res = _fake_main(monkeypatch, _args(tmp_path, "--skip", "torch*", "--skip", "oga-build", "--no-graphs"),
                     lambda s, out, left: ran.append(s["name"]) or {})
    assert "torch-static-fp16" not in ran and "torch-fp16" not in ran and "fp16+graph" not in ran
    assert res["engines"]["torch-static-int4"]["skipped"] == "--skip torch*"
    # the GenAI runtime entries run on a model their (skipped) build entry would have made: none here
    assert "oga-fp16" not in ran and "did not make one" in res["engines"]["oga-fp16"]["skipped"]
    ran.clear()
    res = _fake_main(monkeypatch, _args(tmp_path, hf=False), lambda s, out, left: ran.append(s["name"]) or {})
    assert res["engines"]["torch-static-fp16"]["skipped"].startswith("no --hf-dir")


def test_shapes_reach_the_entries(tmp_path, monkeypatch):
    specs = {}
    _fake_main(monkeypatch, _args(tmp_path, "--prefill", "1x2048", "--ttft-tokens", "2048", "--decode", "1,8,32"),
               lambda s, out, left: specs.setdefault(s["name"], s) and {})
    assert [list(x) for x in specs["fp16+graph"]["prefill"]] == [[1, 2048]]
    assert specs["fp16+graph"]["decode"] == [1, 8, 32]
    assert specs["fp16+graph"]["ttft"] == 2048
    assert specs["torch-static-int4"]["decode"] == [1, 8] and specs["torch-static-int4"]["quant"] == "int4"
    assert specs["oga-fp16+graph"]["prefill"] == [] and specs["oga-fp16+graph"]["ttft"] == 0   # graphs off: TTFT
    assert specs["oga-int4-build"]["extra_options"] == ["block_size=32", "is_symmetric=true"]
    assert specs["oga-fp16-build"]["extra_options"] == []


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_budget_skips_what_would_not_fit_and_says_so(tmp_path):
    clock, got = _Clock(), []
    specs = [{"name": n, "kind": "ours", "est": "ours", "result": str(tmp_path / f"{n}.json")} for n in "abcd"]

    def runner(s, out, left):
        got.append((s["name"], left))
        clock.t += {"a": 30, "b": 40, "c": 0, "d": 0}[s["name"]]
        return {"kind": "ours"}
    res = gpu.run_plan(specs, tmp_path, {}, budget_s=100, overrides={"a": 20, "b": 50, "c": 30, "d": 20},
                       step_gb=14.1, runner=runner, clock=clock)
    # a: 95 s left; b: 65 left; c needs 30 with 25 left -> skipped; d needs 20 -> runs with 25 s as its limit
    assert got == [("a", 95.0), ("b", 65.0), ("d", 25.0)]
    why = res["engines"]["c"]["skipped"]
    assert "needs ~30 s by estimate, 25 s left of --budget-s 100" in why and "--estimate c=SECONDS" in why
    assert "- c: skipped: needs ~30 s" in gpu_report.markdown(res)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["engines"]["c"]["skipped"] == why and on_disk["wall_s"] == 70


def test_default_estimates_scale_with_the_weights():
    s = {"name": "oga-int4-build", "est": "oga-build-int4", "tags": ["oga"]}
    assert gpu.estimate_s(s, 14.14, {}) == pytest.approx(15 + 5.5 * 14.14)
    assert gpu.estimate_s(s, 14.14, {"oga-*": 7}) == 7


def test_a_peer_that_raises_is_recorded_and_the_rest_continue(tmp_path):
    specs = [{"name": n, "kind": "ours", "est": "ours", "result": str(tmp_path / f"{n}.json")}
             for n in ("first", "broken", "last")]

    def runner(s, out, left):
        if s["name"] == "broken":
            raise OSError("cannot start the worker")
        return _res(1000, 100, 700, 0.01)
    res = gpu.run_plan(specs, tmp_path, {}, budget_s=None, overrides={}, step_gb=1, runner=runner)
    assert res["engines"]["broken"]["error"] == "OSError: cannot start the worker"
    assert res["engines"]["last"]["decode"]["1"]["tokens_per_s"] == 100


def test_real_workers_that_fail_are_recorded_with_their_reason(tmp_path):
    """Two entries whose worker processes raise (a GenAI dir without a model, an unknown kind) and one that
    exits without a result: each is recorded, and the run reaches the end."""
    out = tmp_path / "out"
    out.mkdir()
    specs = [{"name": "oga-x", "kind": "oga", "path": str(tmp_path / "nothing"), "est": "oga", "prefill": [],
              "ttft": 0, "decode": [1]},
             {"name": "odd", "kind": "odd", "est": "ours"}]
    for s in specs:
        s["result"] = str(out / f"{s['name']}.json")
    res = gpu.run_plan(specs, out, {"gpu": "none"}, budget_s=300, overrides={}, step_gb=1,
                       render=lambda r: (out / "results.md").write_text(gpu_report.markdown(r)))
    err = res["engines"]["oga-x"]["error"]
    assert "FileNotFoundError" in err and "genai_config.json" in err
    assert "unknown entry kind 'odd'" in res["engines"]["odd"]["error"]
    md = (out / "results.md").read_text()
    assert "- oga-x: FileNotFoundError" in md and "- odd: ValueError" in md


def _fake_worker(monkeypatch, kind: str, tok_s: float, ending: str):
    """A real worker process that writes one figure as a partial result, then ends with ``ending``."""
    script = textwrap.dedent(f"""
        import json, os, sys, time
        spec = json.load(open(sys.argv[1]))
        json.dump({{"name": spec["name"], "kind": "{kind}", "partial": True,
                   "decode": {{"1": {{"tokens_per_s": {tok_s}}}}}}}, open(spec["result"], "w"))
        {ending}
    """)
    monkeypatch.setattr(gpu, "worker_cmd", lambda sp: [sys.executable, "-c", script, str(sp)])


def test_an_entry_stopped_at_the_budget_keeps_its_figures(tmp_path, monkeypatch):
    """The worker hangs after one figure: the parent stops its process group at the budget and the figure stays
    in results.json beside the reason."""
    _fake_worker(monkeypatch, "ours", 123.0, "time.sleep(600)")
    spec = {"name": "slow", "kind": "ours", "est": "ours", "result": str(tmp_path / "slow.json")}
    res = gpu.run_plan([spec], tmp_path, {}, budget_s=gpu.RESERVE_S + 4, overrides={"slow": 1}, step_gb=1)
    r = res["engines"]["slow"]
    assert r["decode"]["1"]["tokens_per_s"] == 123.0
    assert r["error"].startswith("stopped after") and "budget" in r["error"] and "measured before" in r["error"]
    assert r["wall_s"] < 60


def test_a_worker_that_dies_between_figures_is_an_error_with_its_figures(tmp_path, monkeypatch):
    _fake_worker(monkeypatch, "oga", 99.0, "os._exit(139)")
    spec = {"name": "crash", "kind": "oga", "est": "oga", "result": str(tmp_path / "crash.json")}
    r = gpu.run_plan([spec], tmp_path, {}, budget_s=None, overrides={}, step_gb=1)["engines"]["crash"]
    assert r["decode"]["1"]["tokens_per_s"] == 99.0
    assert r["error"] == "worker exited with rc 139 before it finished (the figures above were written before)"
    assert not gpu.complete(r)                            # --resume measures it again


def test_render_collects_an_entry_the_parent_did_not(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"gpu": "x", "engines": {"fp16+graph": {"running": True}}}))
    (out / "fp16+graph.json").write_text(json.dumps({**_res(1, 2, 3, 0.1), "partial": True}))
    assert gpu.main(["--render", str(out)]) == 0
    md = (out / "results.md").read_text()
    assert "| decode b1 tok/s | 2 |" in md and "the run stopped during this entry" in md
    with pytest.raises(SystemExit) as e:
        gpu.main(["--render", str(tmp_path / "nope")])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, msg", [(["--prefill", "2048"], "BATCHxTOKENS"), (["--decode", "1,x"], "--decode"),
                                       (["--budget-s", "0"], "positive"), (["--estimate", "a=b"], "NAME=SECONDS")])
def test_bad_options_exit_2_naming_the_option(argv, msg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--out", str(tmp_path / "o"), *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_env_variant_runs_fp16_with_cuda_graphs_under_the_given_environment(tmp_path, monkeypatch):
    runs = []
    _fake_main(monkeypatch, ["--engine", f"fp16={tmp_path}", "--out", str(tmp_path / "out"), "--no-peers",
                             "--env-variant", "cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0,ORT_X=1"],
               lambda s, out, left: runs.append(s) or {})
    names = [s["name"] for s in runs]
    assert names == ["bandwidth", "fp16+graph", "fp16", "fp16+graph+cudnn-off"]
    spec = runs[-1]
    assert spec["cuda_graph"] is True and spec["env"] == {"ORT_ENABLE_CUDNN_FLASH_ATTENTION": "0", "ORT_X": "1"}
    assert all("env" not in s for s in runs[:-1])       # only the variant runs under it


@pytest.mark.parametrize("bad", ["bad", "label:", ":X=1", "label:X", "label:=1", "label:X=1,Y"])
def test_env_variant_refuses_a_malformed_value_exit_2(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--engine", f"fp16={tmp_path}", "--out", str(tmp_path / "out"), "--env-variant", bad])
    assert e.value.code == 2
    assert "LABEL:VAR=VALUE" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the summary
def test_summary_against_the_goals():
    step = bound.step_weights(QWEN7B)
    e = {"bandwidth": {"copy": {"bytes_per_s": 2934e9}},
         "fp16+graph": {"decode": {"1": {"tokens_per_s": 170.0}, "8": {"tokens_per_s": 1300.0}}},
         "fp16": {"prefill": {"1x2048": {"tokens_per_s": 50000.0}}, "ttft": {"median_s": 0.04, "prompt_tokens": 2048}},
         "int4+graph": {"decode": {"1": {"tokens_per_s": 425.0}}},
         "oga-fp16+graph": {"decode": {"1": {"tokens_per_s": 166.5}}, "errors": {"decode batch 8": "RuntimeError: "
                            "batch_size must be 1 when sequence_length > 1 and past context is given"}},
         "oga-fp16": {"decode": {"1": {"tokens_per_s": 150.0}, "8": {"tokens_per_s": 1344.0}},
                      "ttft": {"median_s": 0.0535, "prompt_tokens": 2048}},
         "oga-int4+graph": {"decode": {"1": {"tokens_per_s": 325.0}}},
         "torch-static-fp16": {"kind": "torch-static", "compiled": True,
                               "prefill": {"1x2048": {"tokens_per_s": 32600.0}}}}
    rows = {r["figure"]: r for r in gpu_report.summary({"engines": e, "bound": {"step": step}})}
    r = rows["our fp16 decode b1 / ORT GenAI fp16"]
    assert r["from"] == "fp16+graph / oga-fp16+graph" and r["value"] == pytest.approx(170 / 166.5)
    assert r["verdict"] == "missed: 0.97 of the goal"
    r = rows["our fp16 decode b8 / ORT GenAI fp16"]             # GenAI's graph run failed at b8: graphs off
    assert r["from"] == "fp16+graph / oga-fp16" and r["value"] == pytest.approx(1300 / 1344)
    r = rows["our INT4 decode b1 / our fp16"]
    assert r["value"] == pytest.approx(2.5) and r["verdict"] == "met"
    assert rows["our INT4 decode b1 / ORT GenAI INT4"]["verdict"] == "met"           # 1.31x >= 1.25x
    r = rows["our fp16 prefill 1x2048 / PyTorch eager fp16"]
    assert r["value"] == pytest.approx(50000 / 32600) and r["verdict"] == "met"
    assert rows["our fp16 TTFT / ORT GenAI fp16 TTFT (lower is better)"]["value"] == pytest.approx(0.04 / 0.0535)
    b1 = rows["our fp16 decode b1 / fp16 bound"]
    assert b1["value"] == pytest.approx(100 * 170 / (2934e9 / step["step_bytes"])) and b1["verdict"] == "met"
    assert rows["our fp16 decode b8 / fp16 bound"]["verdict"].startswith("missed")    # 78 % < 80 %
    assert "our INT4 decode b8 / ORT GenAI INT4" not in rows                          # no figure, no row
    md = gpu_report.markdown({"engines": e, "bound": {"step": step}, "gpu": "H100"})
    assert "| our INT4 decode b1 / our fp16 | 2.50x | int4+graph / fp16+graph | >= 2.5x | met |" in md
    assert "- oga-fp16+graph, decode batch 8: RuntimeError: batch_size must be 1" in md
    assert "Decode bound: 207.5 tok/s at batch 1" in md


# ------------------------------------------------------------------------------------------------ ORT GenAI
def _fake_builder(tmp_path, monkeypatch, rc=0):
    pkg = tmp_path / "fake" / "onnxruntime_genai" / "models"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "builder.py").write_text(textwrap.dedent(f"""
        import json, sys, pathlib
        ballast = bytearray(300 * 2**20)            # the builder's peak RSS is what the wrapper reports
        ballast[::4096] = b"x" * len(ballast[::4096])
        out = pathlib.Path(sys.argv[sys.argv.index("-o") + 1])
        (out.parent / "argv.json").write_text(json.dumps(sys.argv[1:]))
        print("building", flush=True)
        if {rc}:
            sys.exit({rc})
        (out / "genai_config.json").write_text("{{}}")
    """))
    monkeypatch.setenv("PYTHONPATH", f"{pkg.parent.parent}:{ROOT}")


def test_build_oga_records_wall_time_peak_rss_and_reuses_by_stamp(tmp_path, monkeypatch):
    from bench import peers
    _fake_builder(tmp_path, monkeypatch)
    dst = tmp_path / "w" / "oga-int4"
    r = peers.build_oga(tmp_path, dst, "int4", "cuda", peers.OGA_INT4_RTN_SYM_B32)
    argv = json.loads((dst.parent / "argv.json").read_text())
    assert argv[argv.index("-p") + 1] == "int4" and argv[argv.index("-e") + 1] == "cuda"
    assert argv[argv.index("--extra_options") + 1:argv.index("--extra_options") + 3] == ["block_size=32",
                                                                                          "is_symmetric=true"]
    assert r["reused"] is False and r["build_s"] > 0 and r["peak_rss_bytes"] > 300 * 2**20
    assert "building" in Path(r["log"]).read_text()
    assert peers.build_oga(tmp_path, dst, "int4", "cuda", peers.OGA_INT4_RTN_SYM_B32)["reused"] is True
    assert peers.build_oga(tmp_path, dst, "int4", "cuda", ("block_size=128",))["reused"] is False   # new args


def test_build_oga_failure_names_the_arguments_and_leaves_no_model(tmp_path, monkeypatch):
    from bench import peers
    _fake_builder(tmp_path, monkeypatch, rc=3)
    dst = tmp_path / "w" / "oga-fp16"
    dst.mkdir(parents=True)
    (dst / "genai_config.json").write_text("{}")         # from an older build
    with pytest.raises(RuntimeError, match=r"-p fp16 -e cuda failed \(3\).*building"):
        peers.build_oga(tmp_path, dst, "fp16", "cuda")
    assert not (dst / "genai_config.json").exists()


def test_oga_adapter_switches_cuda_graphs_through_genai_config(tmp_path, monkeypatch):
    import types

    from bench import peers
    calls = []

    class Config:
        def __init__(self, path):
            calls.append(("Config", path))

        def clear_providers(self):
            calls.append(("clear_providers",))

        def append_provider(self, p):
            calls.append(("append_provider", p))

        def set_provider_option(self, p, k, v):
            calls.append(("set_provider_option", p, k, v))

    og = types.SimpleNamespace(Config=Config, Model=lambda cfg: calls.append(("Model", type(cfg).__name__)))
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", og)
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {}}}))
    for on in (True, False):
        calls.clear()
        a = peers.OgaAdapter("oga", str(tmp_path), 0, "model builder -p fp16 -e cuda", cuda_graph=on)
        assert ("set_provider_option", "cuda", "enable_cuda_graph", "1" if on else "0") in calls
        assert calls[-1] == ("Model", "Config") and f"CUDA graph {'on' if on else 'off'}" in a.what


@pytest.mark.integration
def test_cpu_smoke_run_of_the_real_workers(tmp_path):
    """The whole command, workers and all, on CPU (--device cpu) with a tiny random Qwen2: the copy bandwidth,
    the PyTorch static-KV peer in fp16 and INT4 (eager here), results.json/md with % of the bound."""
    import subprocess
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--hf-dir", str(tmp_path / "hf"),
                        "--out", str(out), "--only", "bandwidth,torch-static-*", "--prefill", "1x32",
                        "--ttft-tokens", "32", "--decode", "1", "--peer-decode", "1,2", "--decode-new", "4",
                        "--reps", "2", "--min-sample-s", "0", "--copy-mib", "4", "--budget-s", "300"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["engines"]["bandwidth"]["copy"]["bytes_per_s"] > 0
    for q in ("fp16", "int4"):
        e = res["engines"][f"torch-static-{q}"]
        assert "error" not in e and not e.get("errors"), e
        assert e["compiled"] is False and set(e["decode"]) == {"1", "2"} and e["prefill"]["1x32"]["tokens_per_s"] > 0
        assert e["ttft"]["prompt_tokens"] == 32
    e = res["engines"]
    assert e["torch-static-int4"]["weights_step_bytes"] < e["torch-static-fp16"]["weights_step_bytes"]
    assert res["engines"]["oga-fp16"]["skipped"].startswith("not in --only")
    md = (out / "results.md").read_text()
    assert "decode b1 % of fp16 bound" in md and "- torch-static-fp16: decode ran EAGER" in md


def test_from_reports_takes_the_engines_and_the_hf_dir_of_a_forge_build(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(QWEN7B.read_text())
    for r in ("qwen2.5-7b-cuda-fp16", "qwen2.5-7b-cuda-int4"):
        (tmp_path / "rep" / r / "engine").mkdir(parents=True)
        (tmp_path / "rep" / r / "report.json").write_text(json.dumps(
            {"recipe": r, "stages": [{"name": "source", "metrics": {"model_dir": str(hf)}}]}))
    specs = {}
    res = _fake_main(monkeypatch, ["--from-reports", str(tmp_path / "rep"), "--out", str(tmp_path / "out"),
                                   "--only", "ours-graph,torch-static-fp16"],
                     lambda s, out, left: specs.setdefault(s["name"], s) and {})
    assert set(specs) == {"fp16+graph", "int4+graph", "torch-static-fp16"}
    assert specs["fp16+graph"]["path"].endswith("qwen2.5-7b-cuda-fp16/engine")
    assert specs["torch-static-fp16"]["path"] == str(hf)
    assert res["bound"]["step"]["step_bytes"] == 14_141_238_272          # from the HF dir's config
    with pytest.raises(SystemExit) as e:
        gpu.main(["--from-reports", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2


def test_resume_keeps_complete_entries_and_measures_the_rest(tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = _args(tmp_path, "--only", "bandwidth,ours-graph", "--out", str(out))
    first = {"bandwidth": {"copy": {"bytes_per_s": 3e12}}, "fp16+graph": _res(1, 160, 1300, 0.05),
             "int4+graph": {**_res(1, 2, 3, 0.1), "error": "stopped after 80 s: the --budget-s budget ran out"}}
    _fake_main(monkeypatch, argv, lambda s, o, left: dict(first[s["name"]]))
    ran = []
    res = _fake_main(monkeypatch, argv + ["--resume"], lambda s, o, left: ran.append(s["name"]) or _res(1, 400, 2000, 0.1))
    assert ran == ["int4+graph"]                         # the stopped one again; the complete ones kept
    assert res["engines"]["fp16+graph"]["decode"]["1"]["tokens_per_s"] == 160
    assert res["engines"]["bandwidth"]["kept_from"] == res["runs"][0] and len(res["runs"]) == 2
    monkeypatch.setattr("pipeline.host.gpu.cuda_device", lambda: {"name": "NVIDIA H200", "sm": 90})
    monkeypatch.setattr(gpu, "run_worker", lambda s, o, left: {})
    with pytest.raises(SystemExit) as e:                  # another card: no mixing
        gpu.main(argv + ["--resume"])
    assert e.value.code == 2
