"""Every stage failure is a failed result with a report (issue 12): any exception, a full disk, a killed
writer's temp dir, bit rot that kept size and mtime, and keys that do not depend on where forge lives."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cache import ArtifactCache
from pipeline.errors import StageFailed
from pipeline.recipe import Recipe
from pipeline.report import build_report, write_reports
from pipeline.runner import Runner
from pipeline.stages.base import Stage

REPO = Path(__file__).resolve().parents[2]
MB = 2**20


def recipe(**thresholds) -> Recipe:
    return Recipe.model_validate({"name": "fake", "quantize": {"calibration": {"samples": 8, "seq_len": 16}},
                                  "validate": {"thresholds": {"ppl_delta_pct_max": 100.0, **thresholds}}})


class Produce(Stage):
    name = "produce"
    size = MB

    def config(self, r):
        return {"samples": r.quantize.calibration.samples}

    def run(self, ctx):
        (ctx.out / "big.bin").write_bytes(bytes(range(256)) * (self.size // 256))
        return {"bytes": self.size}


class Package(Stage):
    """Copies its input out like a package stage does; its payload leaves the cache."""
    name = "package"
    needs = ("produce",)
    hands_off = True
    runs = 0

    def config(self, r):
        return {"threshold": r.validate_.thresholds.ppl_delta_pct_max}

    def run(self, ctx):
        type(self).runs += 1
        shutil.copy2(ctx.inputs["produce"] / "big.bin", ctx.out / "big.bin")
        return {}


def raising(exc: BaseException, name: str = "produce"):
    class Raises(Produce):
        def run(self, ctx):
            (ctx.out / "partial").write_text("half")
            raise exc
    Raises.name = name
    return Raises


def runner(cache: Path, stages, r: Recipe | None = None, home: Path | None = None) -> Runner:
    return Runner(r or recipe(), ArtifactCache(cache), home=home or cache / "home", stages=stages,
                  log_dir=cache.parent / "logs")


@pytest.mark.parametrize("exc, kind, text", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "RuntimeError", "CUDA out of memory"),
    (subprocess.CalledProcessError(1, ["trtllm-build", "--checkpoint_dir", "x"]), "CalledProcessError",
     "returned non-zero exit status 1"),
    (KeyError("logits"), "KeyError", "KeyError: 'logits'"),
    (ValueError(), "ValueError", "ValueError"),
    (StageFailed("parity 0.3 above 0.001", {"max_abs_err": 0.3}), "StageFailed", "parity 0.3 above 0.001"),
])
def test_any_stage_exception_is_a_failed_result_with_log_and_report(tmp_path, exc, kind, text):
    r = runner(tmp_path / "cache", [raising(exc)(), Package()])
    res = r.build()
    assert [x.status for x in res] == ["failed", "skipped"]
    failed = res[0]
    assert failed.error_type == kind and text in failed.message
    log = Path(failed.log).read_text()
    assert kind in log and "Traceback" in log and f"key: {failed.key}" in log
    assert not list((tmp_path / "cache" / "tmp").iterdir())          # the half-written payload is gone
    assert r.cache.get(failed.key) is None                            # failures are never cached
    rep = build_report(r.recipe, res, 1.0)
    write_reports(rep, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["status"] == "failed" and written["stages"][0]["error_type"] == kind
    assert written["stages"][0]["log"] == failed.log
    assert kind in (tmp_path / "out" / "junit.xml").read_text() or kind == "StageFailed"
    if kind == "StageFailed":
        assert failed.metrics == {"max_abs_err": 0.3}


def test_interrupt_is_not_swallowed(tmp_path):
    r = runner(tmp_path / "cache", [raising(KeyboardInterrupt())()])
    with pytest.raises(KeyboardInterrupt):
        r.build()
    assert not list((tmp_path / "cache" / "tmp").iterdir())


def test_enospc_is_said_plainly(tmp_path):
    err = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "tmp" / "x" / "model.onnx.data"))
    res = runner(tmp_path / "cache", [raising(err)()]).build()
    msg = res[0].message
    assert res[0].status == "failed" and res[0].error_type == "OSError"
    assert msg.startswith(f"no space left on FORGE_CACHE at {tmp_path / 'cache'}: ") and " GB free" in msg
    assert "forge cache gc --keep" in msg


def test_enospc_wrapped_by_a_library_is_recognised(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("problem writing element 'data/0'") from inner
    except RuntimeError as e:
        wrapped = e
    res = runner(tmp_path / "cache", [raising(wrapped)()]).build()
    assert res[0].message.startswith("no space left on FORGE_CACHE")


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (we run as root in CI); skipped with the reason where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}): needs root or CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_fails_the_stage_with_free_space_and_need(tmp_path, small_disk):
    class Big(Produce):
        size = 8 * MB           # more than the disk holds; its need is not declared, so the write hits ENOSPC

    r = runner(small_disk / "cache", [Big(), Package()])
    res = r.build()
    assert [x.status for x in res] == ["failed", "skipped"]
    msg = res[0].message
    assert msg.startswith(f"no space left on FORGE_CACHE at {small_disk / 'cache'}: "), msg
    assert "GB free" in msg and "need is not known beforehand" in msg
    assert not list((small_disk / "cache" / "tmp").iterdir())        # the partial payload is removed
    assert not list((small_disk / "cache" / "entries").rglob("meta.json"))
    write_reports(build_report(r.recipe, res, 1.0), tmp_path / "out")    # the report goes elsewhere, and is written
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "failed"

    class Declared(Big):
        ran = False

        def output_bytes(self, r, info, inputs):
            return self.size

        def run(self, ctx):
            type(self).ran = True
            return super().run(ctx)

    res = runner(small_disk / "cache", [Declared()]).build()
    assert not Declared.ran                                           # refused before it wrote anything
    assert res[0].error_type == "DiskFull"
    assert "not enough space on FORGE_CACHE" in res[0].message and "needs about 0.01 GB" in res[0].message

    ok = runner(small_disk / "cache", [Produce(), Package()]).build()   # the same cache still works
    assert [x.status for x in ok] == ["built", "built"]


def _flip_keep_stat(path: Path, offset: int = 1000) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_bit_rot_that_kept_size_and_mtime_is_caught_before_packaging(tmp_path):
    cache = tmp_path / "cache"
    first = runner(cache, [Produce(), Package()]).build()
    assert [x.status for x in first] == ["built", "built"]
    produced = Path(first[0].payload) / "big.bin"
    good = produced.read_bytes()
    assert ArtifactCache(cache).get(first[0].key) is not None         # a lookup: the stat cache knows the file
    _flip_keep_stat(produced)
    assert ArtifactCache(cache).get(first[0].key) is not None         # the stat cache cannot see it
    Package.runs = 0
    # a new package (another threshold) hands the entry off: it is re-hashed in full, set aside and rebuilt
    res = runner(cache, [Produce(), Package()], recipe(ppl_delta_pct_max=50.0)).build()
    assert [x.status for x in res] == ["built", "built"], [(x.name, x.status, x.message) for x in res]
    assert res[0].key == first[0].key and Package.runs == 1
    assert (Path(res[1].payload) / "big.bin").read_bytes() == good      # what was packaged is the good content
    assert any(p.name.startswith("corrupt-") for p in (cache / "tmp").iterdir())


def test_served_entry_is_checked_in_full(tmp_path):
    cache = ArtifactCache(tmp_path / "cache")
    res = runner(tmp_path / "cache", [Produce(), Package()]).build()
    assert cache.get(res[1].key) is not None
    _flip_keep_stat(Path(res[1].payload) / "big.bin")
    assert cache.get(res[1].key) is not None                          # stat cache: looks fine
    assert cache.get(res[1].key, use_stat_cache=False) is None        # every byte: caught and set aside
    assert cache.get(res[1].key) is None


def test_repository_changed_after_packaging_is_refused(tmp_path):
    from pipeline.triton.manifest import file_problems, read_manifest, write_manifest
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "onnxruntime"\n')
    (repo / "m" / "1" / "model.onnx.data").write_bytes(os.urandom(2 * MB))
    write_manifest(repo, {"target": "cpu", "engine": "onnxruntime", "recipe": {"name": "fake"}})
    assert file_problems(repo, read_manifest(repo)) == []
    from pipeline.hashing import file_digest
    file_digest(repo / "m" / "1" / "model.onnx.data")                # warm the stat cache
    _flip_keep_stat(repo / "m" / "1" / "model.onnx.data")
    assert file_problems(repo, read_manifest(repo)) == [
        "m/1/model.onnx.data: content differs from manifest.json (modified after packaging); rebuild it with "
        "`forge build fake --force package`"]
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--port", "18999"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="300"))
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 1 and "does not match its manifest.json; not serving it" in out and "Traceback" not in out


def test_temp_dir_of_a_killed_writer_is_removed_at_the_next_run(tmp_path):
    cache = tmp_path / "cache"
    script = (f"import os, sys; sys.path.insert(0, {str(REPO)!r})\n"
              "from pipeline.cache import ArtifactCache\n"
              f"c = ArtifactCache({str(cache)!r})\n"
              "with c.writer('f' * 64) as out:\n"
              "    (out / 'half.bin').write_bytes(b'x' * 1000)\n"
              "    os._exit(9)\n")                  # dies holding the temp dir, as SIGKILL would leave it
    subprocess.run([sys.executable, "-c", script], timeout=60)
    left = [p for p in (cache / "tmp").iterdir() if not p.name.endswith(".lock")]
    assert len(left) == 1 and (left[0] / "payload" / "half.bin").exists()
    live = ArtifactCache(cache)
    with live.writer("e" * 64) as mine:             # a writer alive in this process is left alone
        res = runner(cache, [Produce()]).build()
        assert res[0].status == "built"
        assert not left[0].exists() and mine.exists()
    assert not list((cache / "tmp").iterdir())        # a writer that ends without committing leaves nothing


def test_keys_and_payloads_do_not_depend_on_forge_home(tmp_path, monkeypatch):
    """The source stage of a local model under two FORGE_HOMEs (and two caches): same keys, same digests."""
    from pipeline.stages.source import SourceStage
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(REPO / "pipeline" / "model_configs" / "smollm2-135m-instruct.json", model / "config.json")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "tokenizer.json").write_text("{}")
    r = Recipe.model_validate({"name": "loc", "model": {"source": str(model)}})
    out = []
    for home in ("homeA", "elsewhere/homeB"):
        monkeypatch.setenv("FORGE_HOME", str(tmp_path / home))
        res = Runner(r, ArtifactCache(tmp_path / home / "artifacts"), home=tmp_path / home,
                     stages=[SourceStage()]).build()
        assert res[0].status == "built", res[0].message
        entry = ArtifactCache(tmp_path / home / "artifacts").get(res[0].key)
        out.append((res[0].key, entry.meta["payload_digest"], (entry.payload / "source.json").read_text()))
    assert out[0] == out[1]
    assert "homeA" not in out[0][2] and json.loads(out[0][2])["spec"] == str(model)   # the recipe's own words


def test_keep_going_after_a_stage_exception_writes_every_report(tmp_path, monkeypatch, capsys):
    """forge build a b --keep-going: a's stage raises (not a ForgeError), b still builds; both reports and
    summary.json are written and the exit code is 1."""
    from pipeline import cli

    class MaybeRaises(Produce):
        def run(self, ctx):
            if ctx.recipe.name == "a":
                raise MemoryError("CUDA out of memory")
            return super().run(ctx)

    monkeypatch.setattr("pipeline.runner.flow_for", lambda target: [MaybeRaises(), Package()])
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\nquantize: {{method: none}}\n")
    monkeypatch.setattr(sys, "argv", ["forge", "build", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"),
                                      "--keep-going", "--report-dir", str(tmp_path / "nightly")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1
    assert "Traceback" not in capsys.readouterr().err
    assert json.loads((tmp_path / "nightly" / "summary.json").read_text()) == {"a": "failed", "b": "passed"}
    a = json.loads((tmp_path / "nightly" / "a" / "report.json").read_text())
    assert a["stages"][0]["error_type"] == "MemoryError" and "CUDA out of memory" in a["stages"][0]["message"]
    assert Path(a["stages"][0]["log"]).is_file() and (tmp_path / "nightly" / "a" / "junit.xml").is_file()
    assert json.loads((tmp_path / "nightly" / "b" / "report.json").read_text())["status"] == "passed"


def test_sigterm_during_a_build_cleans_up_and_exits_130(tmp_path):
    import signal
    import time
    mark = tmp_path / "started"
    (tmp_path / "r.yaml").write_text("name: r\nquantize: {method: none}\n")
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from pipeline.stages.base import Stage

class Slow(Stage):
    name = "slow"
    def run(self, ctx):
        (ctx.out / "half.bin").write_bytes(b"x" * 1000)
        Path({str(mark)!r}).write_text("go")
        time.sleep(60)

import pipeline.runner
pipeline.runner.flow_for = lambda target: [Slow()]
from pipeline import cli
sys.argv = ["forge", "build", {str(tmp_path / "r.yaml")!r}, "--report-dir", {str(tmp_path / "out")!r}]
cli.main()
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, FORGE_CACHE=str(tmp_path / "cache"), FORGE_PROGRESS="0"))
    t0 = time.time()
    while not mark.exists():
        assert time.time() - t0 < 60 and p.poll() is None, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not [x for x in (tmp_path / "cache" / "tmp").iterdir()]


@pytest.mark.integration
def test_builtin_source_under_two_forge_homes_gives_identical_keys_and_digests(tmp_path, monkeypatch):
    """The default model (a builtin converted under FORGE_HOME/models) from two homes: the source stage's key
    and payload digest agree, so every key downstream agrees and one cache serves both (issue 12)."""
    from pipeline.host.paths import forge_home
    from pipeline.recipe import resolve
    from pipeline.source import DEFAULT_SOURCE, resolve_source
    from pipeline.stages.source import SourceStage
    converted = resolve_source(DEFAULT_SOURCE, forge_home()).path      # converted once by conftest
    got = []
    for home in (tmp_path / "a", tmp_path / "deeper" / "b"):
        (home / "models").mkdir(parents=True)
        (home / "models" / converted.name).symlink_to(converted)   # as if converted there
        monkeypatch.setenv("FORGE_HOME", str(home))
        r = resolve("smollm2-135m-int8")
        res = Runner(r, ArtifactCache(home / "artifacts"), home=home, stages=[SourceStage()]).build()
        assert res[0].status == "built", res[0].message
        meta = ArtifactCache(home / "artifacts").get(res[0].key).meta
        got.append((res[0].key, meta["payload_digest"]))
    assert got[0] == got[1]
