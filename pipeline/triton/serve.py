"""Start and stop the real ``tritonserver`` shipped in the ``nvidia-pytriton`` wheel (python backend).

The wheel carries ``pytriton/tritonserver/bin/tritonserver`` (Triton 2.51), the python backend
(``backends/python``) and one ``triton_python_backend_stub`` per Python minor version. We assemble a
backend directory (``python/`` = backend library + utils + the stub for *this* interpreter), put the
wheel's ``nvidia_pytriton.libs`` on ``LD_LIBRARY_PATH`` and point the stub at this interpreter's
stdlib (PYTHONHOME = sys.base_prefix, its libpython first on LD_LIBRARY_PATH) and site-packages
(PYTHONPATH), so python-backend models import numpy / onnxruntime / tokenizers from our venv.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.host.files import publish_dir
from pipeline.host.paths import forge_home
from pipeline.errors import ForgeError
from pipeline.hashing import sha256_json

INSTALL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0"
# Backends the wheel's server has; models needing another backend are skipped by serve.
AVAILABLE_BACKENDS = ("python",)


def _pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_tritonserver() -> Path:
    """Path of the wheel's tritonserver binary; ForgeError with the install command otherwise."""
    env = os.environ.get("FORGE_TRITONSERVER")
    if env:
        p = Path(env)
        if p.is_file() and os.access(p, os.X_OK):
            return p
        raise ForgeError(f"FORGE_TRITONSERVER={env} is not an executable file; unset it or point it at tritonserver")
    root = _pytriton_root()
    binary = root / "tritonserver" / "bin" / "tritonserver" if root else None
    if binary is None or not binary.is_file():
        raise ForgeError("tritonserver not found: it ships in the nvidia-pytriton wheel; install it with "
                         f"`{INSTALL_HINT}` (--no-deps: we only need its server binary, and its deps would downgrade numpy)")
    return binary


def _libs_dir(binary: Path) -> Path:
    # <site>/pytriton/tritonserver/bin/tritonserver -> <site>/nvidia_pytriton.libs
    return binary.parents[3] / "nvidia_pytriton.libs"


def backend_directory(binary: Path | None = None) -> Path:
    """A backend dir with ``python/`` holding the backend library, utils and this interpreter's stub."""
    binary = binary or find_tritonserver()
    dist = binary.parents[1]  # pytriton/tritonserver
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (dist / "python_backend_stubs").iterdir()) if (dist / "python_backend_stubs").is_dir() else []
        raise ForgeError(f"nvidia-pytriton has no python backend stub for Python {ver} (it has {have}); "
                         "run forge with one of those Python versions")
    home = forge_home()
    out = home / "triton-backends" / f"{dist.stat().st_ino}-py{ver}"
    pdir = out / "python"
    want = {"libtriton_python.so": dist / "backends" / "python" / "libtriton_python.so",
            "triton_python_backend_utils.py": dist / "backends" / "python" / "triton_python_backend_utils.py",
            "triton_python_backend_stub": stub}
    if not all((pdir / k).exists() and (pdir / k).stat().st_size == v.stat().st_size for k, v in want.items()):
        tmp = Path(tempfile.mkdtemp(dir=home, prefix=".backends-"))
        (tmp / "python").mkdir()
        for k, v in want.items():
            shutil.copy2(v, tmp / "python" / k)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        publish_dir(tmp, out)   # another process may win the race; its copy is identical
    return out


STUB_NUMPY = "numpy==1.26.4"


def stub_environment() -> Path:
    """A small venv whose ``python3`` the python-backend stub adopts as its environment.

    The stub (pybind11, built against numpy 1.x) runs isolated (it ignores PYTHONPATH) and takes its
    prefix from the ``python3`` first on PATH. With numpy 2 it reads and writes tensor buffers wrongly
    (measured: an INT32 input [1,2,3] arrived as [1,1,1], outputs failed with "output tensor shape
    does not match size"). So the stub gets its own venv (same base interpreter) holding numpy 1.26.4,
    with a ``.pth`` that appends this environment's site-packages (onnxruntime, tokenizers) after it.
    Built once per interpreter under FORGE_HOME; needs the numpy wheel (pip cache or index) once.
    """
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    home = forge_home()
    main_site = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    key = sha256_json({"base": sys.base_prefix, "ver": sys.version, "site": main_site, "numpy": STUB_NUMPY, "layout": 2})[:16]
    env_dir = home / "triton-stub-env" / f"py{ver}-{key}"
    if (env_dir / ".complete").exists():
        return env_dir
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=env_dir.parent, prefix=".stub-env-"))
    try:
        base_python = Path(sys.base_prefix) / "bin" / f"python{ver}"
        if not base_python.exists():
            base_python = Path(sys.executable)
        # the venv is created in place at its final path (venv scripts embed it), inside tmp first
        subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(tmp)], check=True,
                       capture_output=True, text=True)
        site = tmp / "lib" / f"python{ver}" / "site-packages"
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), STUB_NUMPY],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ForgeError(f"could not install {STUB_NUMPY} for the Triton python-backend stub (its pybind11 needs numpy<2): "
                             f"{r.stderr.strip()[-500:]}; on an offline machine run `pip download {STUB_NUMPY}` where "
                             "there is network and install it with PIP_FIND_LINKS pointing at that folder")
        (site / "forge-main-env.pth").write_text("".join(p + "\n" for p in main_site))
        # model.py files are imported from the repository; keep their bytecode out of it (a packaged
        # repository is a content-addressed artifact with a manifest of its files)
        (site / "sitecustomize.py").write_text(
            "import sys\nsys.pycache_prefix = " + repr(str(home / "triton-pycache")) + "\n")
        (tmp / ".complete").write_text(STUB_NUMPY + "\n")
        publish_dir(tmp, env_dir)   # a concurrent run may have finished first: theirs is kept
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return env_dir


def server_env(binary: Path) -> dict[str, str]:
    """Environment for tritonserver: the wheel's libs and the stub's python environment on PATH."""
    env = os.environ.copy()
    libdirs = [str(_libs_dir(binary))]
    pylib = sysconfig.get_config_var("LIBDIR")
    if pylib and any(Path(pylib).glob(f"libpython{sys.version_info.major}.{sys.version_info.minor}*.so*")):
        libdirs.append(pylib)  # the stub embeds libpython: prefer this interpreter's build
    if env.get("LD_LIBRARY_PATH"):
        libdirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libdirs)
    env["PATH"] = f"{stub_environment() / 'bin'}:{env.get('PATH', '')}"
    for k in ("PYTHONHOME", "PYTHONPATH"):
        env.pop(k, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


LOWEST_PICKED_PORT = 20_000   # above Ray's default worker ports (10002-19999)
_HANDED_OUT: set[int] = set()  # ports free_port gave this process: random picks must not repeat before they are bound


def _ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for the local ports of outgoing connections (Linux), or None where it cannot be read."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return None


def free_port(span: int = 1) -> int:
    """A port P with P .. P+span-1 all free on 127.0.0.1 (``forge serve --port P`` takes P, P+1 and P+2).

    Chosen below the kernel's ephemeral range where it can be read: a port from ``bind(0)`` lies inside that range,
    and any outgoing connection made before the server binds (``forge serve`` fetching a package from S3, say) may
    take it -- a test once lost its serve port that way. Above 20000: Ray hands its workers 10002-19999 by default
    (``ray start --min-worker-port/--max-worker-port``) and refuses to start when a component's port falls there.
    Elsewhere, ``bind(0)`` ports, checked for the whole span."""
    import random

    rng = random.SystemRandom()
    eph = _ephemeral_range()
    if eph and eph[0] > LOWEST_PICKED_PORT + span:
        for _ in range(500):
            p = rng.randrange(LOWEST_PICKED_PORT, eph[0] - span)
            ports = set(range(p, p + span))
            if not ports & _HANDED_OUT and not any(port_in_use(q) for q in ports):
                _HANDED_OUT.update(ports)
                return p
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + span <= 65536 and not any(port_in_use(p + i) for i in range(1, span)):
            return p
    raise RuntimeError(f"no {span} consecutive free ports on 127.0.0.1")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def servable_models(repo_dir: Path) -> tuple[list[str], list[str]]:
    """(models this server can load, models skipped because their backend is not in the wheel)."""
    from pipeline.triton.pbtxt import parse_all_configs

    load, skip = [], []
    for name, cfg in parse_all_configs(repo_dir).items():
        ok = cfg.platform == "ensemble" or cfg.backend in AVAILABLE_BACKENDS
        (load if ok else skip).append(name)
    return load, skip


def front_models(repo_dir: Path) -> dict[str, bool]:
    """Client-facing models of a repository (the ensemble and BLS models) -> whether Triton treats them as
    decoupled. An ensemble is decoupled when any model it steps through is (Triton's rule), so a decoupled
    ``tensorrt_llm`` makes ``ensemble`` decoupled."""
    from pipeline.triton.pbtxt import parse_all_configs

    cfgs = parse_all_configs(repo_dir)
    out = {}
    for name, cfg in sorted(cfgs.items()):
        if cfg.platform == "ensemble":
            out[name] = any(cfgs[s.model_name].model_transaction_policy.decoupled
                            for s in cfg.ensemble_scheduling.step if s.model_name in cfgs)
        elif "tensorrt_llm_model_name" in cfg.parameters:   # forge's BLS (pipeline/triton/templates.py bls)
            out[name] = cfg.model_transaction_policy.decoupled
    return out


def endpoints(repo_dir: str | Path, url: str, grpc_url: str) -> list[str]:
    """What each client-facing model serves, as lines for `forge serve`.

    Decoupled models answer Triton's generate extension (``/generate``: one response; ``/generate_stream``:
    server-sent events) and gRPC streaming; Triton refuses the KServe ``/infer`` and unary gRPC calls for
    them. Non-decoupled models serve ``/generate``, ``/infer`` and unary gRPC, and do not stream.
    """
    body = '{"text_input": "The capital of France is", "max_tokens": 16}'
    lines = []
    for name, decoupled in front_models(Path(repo_dir)).items():
        base = f"{url}/v2/models/{name}"
        lines.append(f"  {name} ({'decoupled' if decoupled else 'not decoupled'}):")
        lines.append(f"    generate : curl -s -X POST {base}/generate -d '{body}'")
        if decoupled:
            lines.append(f"    stream   : curl -s -N -X POST {base}/generate_stream -d '{body[:-1]}, \"stream\": true}}'")
            lines.append(f"    gRPC     : {grpc_url} streaming (ModelStreamInfer) only")
            lines.append(f"    not served: {base}/infer and unary gRPC (Triton refuses them for decoupled models)")
        else:
            lines.append(f"    KServe   : POST {base}/infer (HTTP), {grpc_url} ModelInfer (gRPC); no streaming")
    return lines


class TritonServer:
    """``with TritonServer(repo) as srv: srv.url`` — a real tritonserver on loopback.

    Loads every model whose backend the wheel's server has (explicit model control); others (e.g.
    the plain ``backend: "onnxruntime"`` graph model, meant for a full Triton image) are listed in
    ``.skipped``. Start waits for ``/v2/health/ready`` and raises ForgeError with the log tail on
    timeout or early exit. Stop sends SIGINT, then SIGTERM, then SIGKILL, and waits for the ports.
    """

    def __init__(self, repo_dir: str | Path, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, *, host: str = "127.0.0.1", ready_timeout_s: float = 120.0,
                 log_path: str | Path | None = None, log_verbose: int = 0, extra_args: list[str] | None = None):
        self.repo_dir = Path(repo_dir).resolve()
        self.host = host
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args or [])
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.loaded: list[str] = []
        self.skipped: list[str] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def command(self) -> list[str]:
        binary = find_tritonserver()
        args = [str(binary), f"--model-repository={self.repo_dir}",
                f"--backend-directory={backend_directory(binary)}",
                "--model-control-mode=explicit",
                *(f"--load-model={m}" for m in self.loaded),
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-gpu-metrics=false", "--exit-timeout-secs=10",
                f"--log-verbose={self.log_verbose}", *self.extra_args]
        return args

    def start(self) -> "TritonServer":
        self.loaded, self.skipped = servable_models(self.repo_dir)
        for p in (self.http_port, self.grpc_port, self.metrics_port):
            if port_in_use(p, self.host):
                raise ForgeError(f"port {p} on {self.host} is in use; pick another with --port or stop what holds it")
        cmd = self.command()
        binary = Path(cmd[0])
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(binary),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    rc = self.proc.returncode
                    self.proc = None
                    raise ForgeError(f"tritonserver exited with code {rc} before it was ready; log {self.log_path}:\n{self.log_tail()}")
                if self._ready():
                    return self
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise ForgeError(f"tritonserver not ready after {self.ready_timeout_s:.0f} s; log tail:\n{tail}")
                time.sleep(0.25)
        except BaseException:
            self.stop()   # interrupted while starting (Ctrl-C, SIGTERM): never leave a server behind
            raise

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL (to the server's process group); wait for the ports to free."""
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if proc.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait)
            rc = proc.poll()
            # python-backend stubs live in the server's process group; make sure none is left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(port_in_use(p, self.host) for p in (self.http_port, self.grpc_port, self.metrics_port)):
            time.sleep(0.1)
        if self._own_log and rc == 0:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
        return rc

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """Block until the server exits (for `forge serve`); Ctrl-C stops it cleanly."""
        assert self.proc is not None
        try:
            return self.proc.wait()
        except KeyboardInterrupt:
            self.stop()
            return 0


def serve(repo_dir: str | Path, http_port: int = 8000, grpc_port: int | None = None, metrics_port: int | None = None,
          *, echo=print, host: str = "127.0.0.1") -> int:
    """Blocking `forge serve`: start, print the endpoints, run until Ctrl-C / SIGTERM, stop cleanly.

    ``grpc_port`` / ``metrics_port`` default to ``http_port + 1`` / ``+ 2``. Returns the exit code.
    """
    repo_dir = Path(repo_dir)
    srv = TritonServer(repo_dir, http_port, grpc_port or http_port + 1, metrics_port or http_port + 2, host=host,
                       log_path=repo_dir.parent / f"{repo_dir.name}.tritonserver.log" if os.access(repo_dir.parent, os.W_OK) else None)
    prev = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        srv.start()
        echo(f"tritonserver ready (models: {', '.join(srv.loaded)})")
        if srv.skipped:
            echo(f"not loaded (their backend is not in the nvidia-pytriton server): {', '.join(srv.skipped)}")
        for line in endpoints(repo_dir, srv.url, srv.grpc_url):
            echo(line)
        echo(f"  metrics  : {srv.metrics_url}")
        echo(f"  log      : {srv.log_path}")
        echo("Ctrl-C stops the server")
        rc = srv.wait()
        if srv.proc is None:
            return 0
        return rc
    except KeyboardInterrupt:
        srv.stop()
        return 0
    finally:
        signal.signal(signal.SIGTERM, prev)
        if srv.proc is not None:
            srv.stop()
