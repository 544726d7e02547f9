"""`make bench` on a GPU machine (issues 17, 26, 38): our CUDA engines and their peers on the same GPU, in one run,
each in its own process, every figure written as it is measured.

Parts, in the order they run (the ones the issue's summary needs first, so a budget cut loses the least):

* ``bandwidth``: the card's device-to-device copy bandwidth (torch, bytes read + written); with the bytes one decode
  step reads (every weight but the embedding table, from the HF safetensors / config; bench.bound) it gives the
  decode bound, B * bandwidth / step bytes, and every decode figure is also shown as a % of it.
* ``ours``: forge's CUDA engines (``--engine NAME=DIR``), CUDA graphs on (``NAME+graph``; these run right after
  ``bandwidth``) and off (``NAME``; after the peers):
  prefill ``--prefill`` shapes, TTFT on a ``--ttft-tokens`` prompt, decode ``--decode`` batches.
* ``oga``: ORT GenAI's model builder + runtime on the HF weights (``-p fp16 -e cuda`` and ``-p int4 -e cuda`` with
  RTN symmetric block 32): builder wall time and peak host RSS, then decode b1/b8 with CUDA graphs
  (``oga-fp16+graph``: a failing b8 is recorded, not fatal) and prefill, TTFT and decode b1/b8 without.
* ``torch``: a plain PyTorch decoder with a static KV cache whose decode step is compiled with
  ``torch.compile(mode="reduce-overhead")`` (a CUDA graph): fp16 and INT4 (``_weight_int4pack_mm``, group 128);
  prefill eager (bench/torch_decoder.py).
* ``torch-eager``: transformers' eager ``generate`` in fp16 (``torch-fp16``, the issue 17 baseline).

``--only`` / ``--skip`` take names or globs matched against each entry's name and part (``bandwidth``, ``ours``,
``ours-graph``, ``ours-nograph``, ``oga``, ``oga-build``, ``oga-fp16``, ``oga-int4``, ``torch``, ``torch-eager``,
or an entry name such as ``fp16+graph``). ``--budget-s`` keeps the whole run inside a wall time: an entry whose
estimate does not fit in what is left is skipped and says so; a running one is stopped at the budget and keeps
what it had measured. Results: ``--out``/results.json (every sample, min/max), results.md (tables, ratios, the
summary against issue 38's goals); ``python -m bench.gpu --render OUT`` redraws them from what is on disk.

    python -m bench.gpu --engine fp16=DIR --engine int4=DIR --hf-dir HF --out bench/out-gpu \\
        --prefill 1x2048 --ttft-tokens 2048 --decode 1,8,32 --budget-s 560
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .measure import measure_adapter

# issue 26: a figure is the median of >= 5 samples of >= 100 ms each (one 4-6 ms prefill step was noise)
MIN_SAMPLE_S = 0.1
RESERVE_S = 5.0            # of --budget-s, kept for writing the tables after the last entry


def gpu_memory_mb() -> float | None:
    """This process's GPU memory (MiB) by NVML; None when NVML cannot tell."""
    from pipeline.host.gpu import nvml_handles
    try:
        import pynvml as nvml
        with nvml_handles(nvml) as handles:
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handles[0]):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    return p.usedGpuMemory / 2**20
    except Exception:  # noqa: BLE001
        return None
    return None


class OrtCudaAdapter:
    supports_batch_prefill = True

    def __init__(self, name: str, model_dir: str, cuda_graph: bool):
        import onnxruntime as ort
        from pipeline.ort.engine import OrtEngine
        self.name = name
        self.engine = OrtEngine(model_dir, providers=["CUDAExecutionProvider"], device="cuda", cuda_graph=cuda_graph)
        self.what = (f"forge ONNX Runtime engine ({name}), onnxruntime {ort.__version__} CUDAExecutionProvider, "
                     f"KV on the GPU, CUDA graph {'on' if cuda_graph else 'off'}")
        self.generate_batch = lambda ids, n: self.engine.generate_batch([list(map(int, r)) for r in ids], n)

    def prefill(self, ids):
        return self.engine.prefill(ids)

    def generate(self, ids, n):
        return self.engine.generate([int(x) for x in np.asarray(ids).reshape(-1)], n)


class TorchEagerAdapter:
    """transformers eager ``generate`` in fp16 on the GPU (greedy, KV cache): the issue 17 PyTorch baseline."""
    supports_batch_prefill = True

    def __init__(self, name: str, hf_dir: str, device: str = "cuda"):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        self.torch, self.name, self.device = torch, name, device
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float16).to(device).eval()
        self.what = f"PyTorch {torch.__version__} eager fp16 generate (transformers {transformers.__version__})"
        self.generate_batch = self._gen

    def prefill(self, ids):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.as_tensor(ids, device=self.device), use_cache=False).logits
            if self.device != "cpu":
                self.torch.cuda.synchronize()
            return out

    def _gen(self, ids, n):
        with self.torch.inference_mode():
            t = self.torch.as_tensor(np.asarray(ids), device=self.device)
            out = self.model.generate(t, attention_mask=self.torch.ones_like(t), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
            return out[:, t.shape[1]:].cpu().numpy()

    def generate(self, ids, n):
        return self._gen(np.asarray(ids).reshape(1, -1), n)[0].tolist()


# ------------------------------------------------------------------------------------------------- the worker side
def write_json(path: Path, obj) -> None:
    """Atomic: a reader (or a run cut short) sees the previous complete file or the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _base_ids(tokenizer_dir: str | None) -> list[int] | None:
    tok = Path(tokenizer_dir or "") / "tokenizer.json"
    if not tok.is_file():
        return None
    from tokenizers import Tokenizer
    from pipeline.data import load_prompts
    return Tokenizer.from_file(str(tok)).encode(" ".join(load_prompts() * 8), add_special_tokens=False).ids


def _onnx_bytes(path: str) -> dict:
    from .bound import engine_model_file, onnx_step_bytes
    f = engine_model_file(Path(path))
    return {"weights_step_bytes": onnx_step_bytes(f)["step_bytes"]} if f and f.is_file() else {}


def one(spec: dict) -> dict:
    """Measure one entry in this process (the parent starts one process per entry); the result file is rewritten
    after every figure, so a worker stopped at the budget keeps what it measured."""
    kind, result = spec["kind"], Path(spec["result"])
    res: dict = {"name": spec["name"], "kind": kind}
    if kind == "bandwidth":
        from .bound import copy_bandwidth
        res["copy"] = copy_bandwidth(spec.get("device", "cuda"), int(spec.get("copy_mib", 1024)),
                                     int(spec.get("reps", 5)), float(spec.get("min_sample_s", MIN_SAMPLE_S)))
        return res
    if kind == "oga-build":
        from .peers import build_oga
        res["build"] = build_oga(Path(spec["hf_dir"]), Path(spec["path"]), spec["precision"], "cuda",
                                 tuple(spec.get("extra_options", ())))
        write_json(result, res)
        with _noted(res, "weights_error"):
            res.update(_onnx_bytes(spec["path"]))
        return res
    extra: dict = {}
    if kind == "ours":
        with _noted(extra, "weights_error"):
            extra.update(_onnx_bytes(spec["path"]))
        a = OrtCudaAdapter(spec["name"], spec["path"], spec.get("cuda_graph", False))
    elif kind == "oga":
        from .peers import OgaAdapter
        if not (Path(spec["path"]) / "genai_config.json").is_file():
            raise FileNotFoundError(f"{spec['path']}: no genai_config.json (its model builder entry did not run or "
                                    "failed)")
        with _noted(extra, "weights_error"):
            extra.update(_onnx_bytes(spec["path"]))
        a = OgaAdapter(spec["name"], spec["path"], 0, spec.get("note", "model builder"),
                       cuda_graph=bool(spec.get("cuda_graph")))
    elif kind == "torch-static":
        from .torch_decoder import TorchStaticAdapter
        dec = int(spec.get("decode_prompt", 32)) + int(spec.get("decode_new", 64))
        need = max([int(t) for _, t in spec["prefill"]] + [int(spec.get("ttft", 256)) + 1, dec])
        a = TorchStaticAdapter(spec["name"], spec["path"], spec["quant"], spec.get("device", "cuda"), max_seq=need)
    elif kind == "torch":
        a = TorchEagerAdapter(spec["name"], spec["path"], spec.get("device", "cuda"))
    else:
        raise ValueError(f"unknown entry kind {kind!r}")
    res = measure_adapter(a, vocab_size=int(spec.get("vocab", 49152)), base_ids=_base_ids(spec.get("tokenizer")),
                          reps=int(spec.get("reps", 5)), prefill_shapes=[tuple(s) for s in spec["prefill"]],
                          ttft_len=int(spec.get("ttft", 256)), decode_batches=tuple(spec["decode"]),
                          decode_prompt=int(spec.get("decode_prompt", 32)), decode_new=int(spec.get("decode_new", 64)),
                          min_sample_s=float(spec.get("min_sample_s", MIN_SAMPLE_S)), keep_going=True,
                          checkpoint=lambda r: write_json(result, {**r, "kind": kind, **extra, "partial": True}))
    res.update(kind=kind, **extra)
    if hasattr(a, "facts"):
        res.update(a.facts())
    res["gpu_memory_mb"] = gpu_memory_mb()
    return res


class _noted:
    """``with _noted(d, key):`` records an exception under d[key] instead of raising (a figure that is only a
    decoration of the others, such as the engine's weight bytes)."""

    def __init__(self, d: dict, key: str):
        self.d, self.key = d, key

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if e is not None and isinstance(e, Exception):
            self.d[self.key] = f"{type(e).__name__}: {e}"
            return True
        return False


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        res = one(spec)
    except Exception as e:  # noqa: BLE001 - recorded per entry, the run goes on
        import traceback
        prev = {}
        if Path(spec["result"]).is_file():     # figures written before the failure stay
            prev = json.loads(Path(spec["result"]).read_text())
        res = {**prev, "name": spec["name"], "kind": spec.get("kind"),
               "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
    res.pop("partial", None)
    write_json(Path(spec["result"]), res)
    return 0


# ------------------------------------------------------------------------------------------------- the parent side
def worker_cmd(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "bench.gpu", "--one", str(spec_path)]


def run_worker(spec: dict, out: Path, timeout: float | None) -> dict:
    """One entry in its own process (its own session: a stop at the budget ends its compile workers too)."""
    sp = out / f"{spec['name']}.spec.json"
    write_json(sp, spec)
    result = Path(spec["result"])
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    p = subprocess.Popen(worker_cmd(sp), env={**os.environ, **spec.get("env", {})}, start_new_session=True)
    stopped = None
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stopped = time.monotonic() - t0
        _stop_group(p)
    res = json.loads(result.read_text()) if result.is_file() else {}
    res.setdefault("name", spec["name"])
    res["wall_s"] = time.monotonic() - t0
    if stopped is not None:
        res["error"] = (f"stopped after {stopped:.0f} s: the --budget-s budget ran out"
                        + (" (the figures above were measured before)" if res.get("partial") else ""))
    elif not result.is_file():
        res["error"] = f"worker exited with rc {p.returncode} and wrote no result"
    elif res.get("partial") or (p.returncode and "error" not in res):     # died between figures (a crash)
        res["error"] = (f"worker exited with rc {p.returncode} before it finished"
                        + (" (the figures above were written before)" if res.get("partial") else ""))
    return res


def _stop_group(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# rough wall-time guesses per entry kind: (seconds, seconds per GB of fp16 decode-step weights). They only decide
# what is skipped under --budget-s (a running entry is stopped at the budget anyway); --estimate overrides them.
# The two builder rows follow issue 38's H100 measurement (37 s fp16, 79 s INT4 at 14.1 GB); the others are
# process start + loading the weights + the figures, guessed from the 4-layer runs in docs/gpu-runs.md.
ESTIMATES = {"bandwidth": (20, 0.0), "ours": (35, 3.0), "oga-build-fp16": (15, 3.0), "oga-build-int4": (15, 5.5),
             "oga": (25, 3.0), "torch-static": (90, 3.0), "torch": (20, 2.0)}


def tags(spec: dict) -> set[str]:
    return {spec["name"], *spec.get("tags", ())}


def selected(spec: dict, only: list[str], skip: list[str]) -> str | None:
    """None if the entry runs, else why not."""
    t = tags(spec)
    if only and not any(fnmatch.fnmatch(x, pat) for x in t for pat in only):
        return f"not in --only {','.join(only)}"
    hit = [pat for pat in skip for x in t if fnmatch.fnmatch(x, pat)]
    return f"--skip {hit[0]}" if hit else None


def estimate_s(spec: dict, step_gb: float, overrides: dict[str, float]) -> float:
    for pat, s in overrides.items():
        if any(fnmatch.fnmatch(x, pat) for x in tags(spec)):
            return s
    base, per_gb = ESTIMATES[spec["est"]]
    return base + per_gb * step_gb


def complete(r: dict | None) -> bool:
    """An entry that ran to its end (a figure that failed inside it is a finding, not a reason to run it again)."""
    return bool(r) and not r.get("error") and not isinstance(r.get("skipped"), str) and not r.get("running") \
        and not r.get("partial")


def _unbuilt(s: dict, eng: dict) -> str | None:
    """Why a GenAI runtime entry has no model to run: its builder entry failed or was skipped, and no earlier
    build is on disk."""
    dep = eng.get(s.get("after", ""), {})
    if not s.get("after") or (Path(s.get("path", "")) / "genai_config.json").is_file():
        return None
    if "error" in dep or isinstance(dep.get("skipped"), str):
        return (f"no model: its builder entry {s['after']} did not make one "
                f"({(dep.get('error') or dep.get('skipped'))[:200]})")
    return None


def run_plan(specs: list[dict], out: Path, results: dict, *, budget_s: float | None, overrides: dict[str, float],
             step_gb: float, runner=None, clock=time.monotonic, render=None, earlier: dict | None = None) -> dict:
    """Run the entries in order inside the budget; results.json (and results.md through ``render``) are rewritten
    after each, and before each (``running``), so a run cut from outside still says where it was. ``earlier``:
    the entries of an earlier run on this card (--resume); the complete ones are kept, not measured again."""
    runner = runner or run_worker
    t0 = clock()
    eng = results.setdefault("engines", {})

    def save():
        write_json(out / "results.json", results)
        if render:
            render(results)
    for s in specs:
        if complete((earlier or {}).get(s["name"])):
            eng[s["name"]] = {**earlier[s["name"]], "kept_from": earlier[s["name"]].get("run_started")}
            print(f"== {s['name']}: kept from the earlier run (--resume)", flush=True)
            save()
            continue
        left = None if budget_s is None else budget_s - RESERVE_S - (clock() - t0)
        est = estimate_s(s, step_gb, overrides)
        why = s.get("skip") or _unbuilt(s, eng) or (
            None if left is None or est <= left else
            f"needs ~{est:.0f} s by estimate, {max(left, 0):.0f} s left of --budget-s {budget_s:.0f} "
            f"(--estimate {s['name']}=SECONDS to change the estimate)")
        if why:
            eng[s["name"]] = {"skipped": why}
            print(f"== {s['name']}: skipped ({why})", flush=True)
            save()
            continue
        print(f"== {s['name']} (~{est:.0f} s by estimate" + (f", {left:.0f} s left)" if left is not None else ")"),
              flush=True)
        eng[s["name"]] = {"running": True, "started": time.strftime("%H:%M:%S")}
        save()
        try:
            eng[s["name"]] = runner(s, out, left)
        except Exception as e:  # noqa: BLE001 - the parent's own failure with one entry stops only that entry
            eng[s["name"]] = {"error": f"{type(e).__name__}: {e}"}
        eng[s["name"]]["run_started"] = results.get("started")
        save()
    results["wall_s"] = clock() - t0
    save()
    return results


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        b, _, t = part.partition("x")
        if not (b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
            raise ValueError(f"{part!r}: expected BATCHxTOKENS, e.g. 1x2048")
        out.append((int(b), int(t)))
    return out


def parse_ints(text: str, what: str) -> list[int]:
    vals = [p.strip() for p in text.split(",") if p.strip()]
    if not vals or not all(v.isdigit() and int(v) > 0 for v in vals):
        raise ValueError(f"{what} {text!r}: comma-separated positive integers, e.g. 1,8,32")
    return [int(v) for v in vals]


def plan(a, engines: dict[str, str], out: Path, vocab: int) -> list[dict]:
    """Every entry of the run in its order, with its shapes; deselected ones carry ``skip``."""
    from .peers import OGA_INT4_RTN_SYM_B32
    tok = a.hf_dir if a.hf_dir and (Path(a.hf_dir) / "tokenizer.json").is_file() else next(iter(engines.values()), None)
    common = {"reps": a.reps, "min_sample_s": a.min_sample_s, "vocab": vocab, "tokenizer": tok, "device": a.device,
              "decode_prompt": a.decode_prompt, "decode_new": a.decode_new}
    full = {"prefill": a.prefill, "ttft": a.ttft_tokens, "decode": a.decode}
    peer = {"prefill": a.prefill, "ttft": a.ttft_tokens, "decode": a.peer_decode}
    specs: list[dict] = [{"name": "bandwidth", "kind": "bandwidth", "est": "bandwidth", "tags": ["bandwidth"],
                          "copy_mib": a.copy_mib}]
    graph = [] if a.no_graphs else [n for n in engines if n != "fp32"]   # fp32: standard attention, no graph
    for n in graph:
        specs.append({"name": f"{n}+graph", "kind": "ours", "path": engines[n], "cuda_graph": True, "est": "ours",
                      "tags": ["ours", "ours-graph"], **full})
    hf = a.hf_dir
    oga = {}
    for prec, extra in (("fp16", ()), ("int4", OGA_INT4_RTN_SYM_B32)):
        d = out / f"oga-{prec}"
        t = ["oga", f"oga-{prec}"]
        oga[prec] = [
            {"name": f"oga-{prec}-build", "kind": "oga-build", "precision": prec, "extra_options": list(extra),
             "path": str(d), "hf_dir": hf, "est": f"oga-build-{prec}", "tags": [*t, "oga-build"]},
            {"name": f"oga-{prec}+graph", "kind": "oga", "path": str(d), "cuda_graph": True, "est": "oga",
             "after": f"oga-{prec}-build",
             "note": f"model builder -p {prec} -e cuda {' '.join(extra)}".rstrip(), "tags": t,
             "prefill": [], "ttft": 0, "decode": a.peer_decode},
            {"name": f"oga-{prec}", "kind": "oga", "path": str(d), "cuda_graph": False, "est": "oga",
             "after": f"oga-{prec}-build",
             "note": f"model builder -p {prec} -e cuda {' '.join(extra)}".rstrip(), "tags": t, **peer}]
    torch_static = {q: {"name": f"torch-static-{q}", "kind": "torch-static", "quant": q, "path": hf,
                        "est": "torch-static", "tags": ["torch", f"torch-{q}"], **peer} for q in ("fp16", "int4")}
    specs += oga["fp16"] + [torch_static["fp16"]] + oga["int4"] + [torch_static["int4"]]
    for n in engines:
        specs.append({"name": n, "kind": "ours", "path": engines[n], "cuda_graph": False, "est": "ours",
                      "tags": ["ours", "ours-nograph"], **full})
    for v in a.env_variant:
        label, _, assigns = v.partition(":")
        if "fp16" in engines:
            specs.append({"name": f"fp16+graph+{label}", "kind": "ours", "path": engines["fp16"], "cuda_graph": True,
                          "env": dict(x.split("=", 1) for x in assigns.split(",")), "est": "ours",
                          "tags": ["ours", "ours-graph", "env-variant"], **full})
    specs.append({"name": "torch-fp16", "kind": "torch", "path": hf, "est": "torch", "tags": ["torch-eager"], **peer})
    only, skip = a.only, list(a.skip)
    if a.no_peers:
        skip += ["oga", "torch", "torch-eager"]
    if a.no_oga:
        skip.append("oga")
    for s in specs:
        s.update(common, result=str(out / f"{s['name']}.json"))
        why = selected(s, only, skip)
        if why is None and s["kind"] in ("oga-build", "torch-static", "torch") and not hf:
            why = "no --hf-dir (the peers read the HF weights)"
        if why:
            s["skip"] = why
    return specs


def _bound_facts(a, engines: dict[str, str]) -> dict:
    """The fp16 decode-step bytes (bench.bound) from --hf-dir, else from the first engine's config.json."""
    from .bound import step_weights
    src = a.hf_dir or next((d for d in engines.values() if (Path(d) / "config.json").is_file()), None)
    if not src:
        return {"error": "no --hf-dir and no engine config.json: the decode-step bytes are unknown"}
    try:
        return {"step": step_weights(Path(src)), "from": str(src)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def render_dir(out: Path) -> dict:
    """results.json of ``out`` with each entry's own file merged where the run stopped before collecting it."""
    from .gpu_report import markdown
    results = json.loads((out / "results.json").read_text())
    for name, r in list(results.get("engines", {}).items()):
        f = out / f"{name}.json"
        if r.get("running") and f.is_file():
            results["engines"][name] = {**json.loads(f.read_text()),
                                        "error": "the run stopped during this entry (figures as last written)"}
    (out / "results.md").write_text(markdown(results))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="append", default=[], help="NAME=DIR of a forge CUDA engine (fp32, fp16, int4, int8wo)")
    ap.add_argument("--hf-dir", help="HF dir (safetensors + config + tokenizer): the peers read it, and it gives the "
                    "decode-step bytes")
    ap.add_argument("--from-reports", metavar="DIR", help="the engines (labelled fp16/int4/... by the recipe name's "
                    "suffix) and the HF dir of `forge build --report-dir DIR`, beside any --engine/--hf-dir")
    ap.add_argument("--out", default="bench/out-gpu")
    ap.add_argument("--reps", type=int, default=5, help="samples per figure (>= 5: the median, min and max kept)")
    ap.add_argument("--min-sample-s", type=float, default=MIN_SAMPLE_S,
                    help="each sample loops the step until it lasts this long (a 4 ms prefill alone is noise)")
    ap.add_argument("--prefill", default="1x256,4x256", help="prefill shapes BATCHxTOKENS (default 1x256,4x256)")
    ap.add_argument("--ttft-tokens", type=int, default=256, help="prompt length of the time to first token")
    ap.add_argument("--decode", default="1,8", help="decode batches of our engines (default 1,8)")
    ap.add_argument("--peer-decode", default="1,8", help="decode batches of the peers (default 1,8)")
    ap.add_argument("--decode-prompt", type=int, default=32)
    ap.add_argument("--decode-new", type=int, default=64)
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer of the copy-bandwidth measurement")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the copy bandwidth and the "
                    "PyTorch peers run (cpu: a smoke test of the plumbing; its figures mean nothing for a GPU)")
    ap.add_argument("--only", action="append", default=[], metavar="PART", help="run only these entries or parts "
                    "(names or globs, comma-separated or repeated)")
    ap.add_argument("--skip", action="append", default=[], metavar="PART", help="skip these entries or parts")
    ap.add_argument("--budget-s", type=float, help="keep the whole run inside this many seconds of wall time")
    ap.add_argument("--estimate", action="append", default=[], metavar="NAME=SECONDS",
                    help="the wall-time estimate of matching entries (name or glob), for --budget-s")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph runs of our engines")
    ap.add_argument("--no-peers", action="store_true", help="same as --skip oga,torch,torch-eager")
    ap.add_argument("--no-oga", action="store_true", help="same as --skip oga")
    ap.add_argument("--env-variant", action="append", default=[], metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
                    help="also measure fp16 with CUDA graphs under these environment variables (ONNX Runtime's "
                         "attention-kernel switches, e.g. cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0)")
    ap.add_argument("--resume", action="store_true", help="keep the complete entries of the run already in --out "
                    "(same GPU) and measure the rest: a run longer than one command's time limit, in several")
    ap.add_argument("--render", metavar="OUT", help="only redraw OUT/results.md from the files of a run")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        return worker_main(a.one)
    if a.render:
        if not (Path(a.render) / "results.json").is_file():
            ap.error(f"--render {a.render}: no results.json there")
        render_dir(Path(a.render))
        print((Path(a.render) / "results.md").read_text())
        return 0
    try:
        a.prefill = parse_shapes(a.prefill)
        a.decode = parse_ints(a.decode, "--decode")
        a.peer_decode = parse_ints(a.peer_decode, "--peer-decode")
        overrides = {}
        for e in a.estimate:
            k, _, v = e.partition("=")
            overrides[k] = float(v)
    except ValueError as e:
        ap.error(str(e) if "could not convert" not in str(e) else f"--estimate: NAME=SECONDS ({e})")
    a.only = [x for v in a.only for x in v.split(",") if x]
    a.skip = [x for v in a.skip for x in v.split(",") if x]
    for v in a.env_variant:
        label, _, assigns = v.partition(":")
        pairs = [x.split("=", 1) for x in assigns.split(",")]
        if not label or not assigns or any(len(p) != 2 or not p[0] for p in pairs):
            ap.error(f"--env-variant {v!r}: expected LABEL:VAR=VALUE[,VAR=VALUE], "
                     "e.g. cudnn-off:ORT_ENABLE_CUDNN_FLASH_ATTENTION=0")
    if a.ttft_tokens < 1 or a.reps < 1 or (a.budget_s is not None and a.budget_s <= 0):
        ap.error("--ttft-tokens, --reps and --budget-s must be positive")
    engines = {}
    if a.from_reports:
        from .run import engines_from_reports, hf_dir_from_report
        engines, reports = engines_from_reports(Path(a.from_reports))
        if not reports:
            ap.error(f"--from-reports {a.from_reports}: no */report.json there (forge build --report-dir writes them)")
        a.hf_dir = a.hf_dir or next((d for d in (hf_dir_from_report(json.loads(p.read_text()))
                                                 for p in reports.values()) if d), None)
    for e in a.engine:
        name, sep, d = e.partition("=")
        if not sep or not name or not d:
            ap.error(f"--engine {e!r}: expected NAME=DIR, e.g. fp16=out/qwen2.5-7b-cuda-fp16/engine")
        engines[name] = d
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from pipeline.host.gpu import cuda_device

    from .gpu_report import markdown
    bound = _bound_facts(a, engines)
    cfg_src = a.hf_dir or next(iter(engines.values()), None)
    vocab = 49152
    if cfg_src and (Path(cfg_src) / "config.json").is_file():
        vocab = int(json.loads((Path(cfg_src) / "config.json").read_text()).get("vocab_size", vocab))
    specs = plan(a, engines, out, vocab)
    dev = cuda_device()
    gpu_name = f"{dev['name']} (sm_{dev['sm']})" if dev else "no GPU"
    earlier, runs = None, []
    if a.resume and (out / "results.json").is_file():
        prev = json.loads((out / "results.json").read_text())
        if prev.get("gpu") != gpu_name:
            ap.error(f"--resume: {out}/results.json was measured on {prev.get('gpu')}, this is {gpu_name}; ratios "
                     "hold only within one card (use another --out)")
        earlier, runs = prev.get("engines", {}), prev.get("runs") or [prev.get("started")]
    results = {"gpu": gpu_name,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "settings": {"prefill": a.prefill, "ttft_tokens": a.ttft_tokens, "decode": a.decode,
                            "peer_decode": a.peer_decode, "decode_prompt": a.decode_prompt, "decode_new": a.decode_new,
                            "reps": a.reps, "min_sample_s": a.min_sample_s, "budget_s": a.budget_s},
               "bound": bound, "engines": {}}
    step_gb = (bound.get("step") or {}).get("step_bytes", 1e9) / 1e9
    results["runs"] = [*runs, results["started"]]
    run_plan(specs, out, results, budget_s=a.budget_s, overrides=overrides, step_gb=step_gb,
             render=lambda r: (out / "results.md").write_text(markdown(r)), earlier=earlier)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
