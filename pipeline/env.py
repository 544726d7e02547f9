"""Facts about this machine and environment, each defined once.

Cache keys, manifests, reports and `forge doctor` read these functions so they always agree:
where forge keeps its files (``forge_home``, ``cache_root``) and what of the CPU changes numbers
(``cpu_isa_class``).
"""

from __future__ import annotations

import os
import platform
import shutil
from functools import lru_cache
from pathlib import Path


def forge_home() -> Path:
    """``$FORGE_HOME`` (an empty value counts as unset), else ``~/.cache/forge``; always absolute."""
    raw = os.environ.get("FORGE_HOME", "").strip()
    home = Path(raw).expanduser() if raw else Path.home() / ".cache" / "forge"
    return home.absolute()


def remote_cache_url() -> str | None:
    """``$FORGE_CACHE`` when it is an object-store URL (``s3://bucket/prefix``, ``gs://...``, ``az://...``): the
    shared cache many machines build into; None when the cache is a local directory."""
    raw = os.environ.get("FORGE_CACHE", "").strip()
    return raw if "://" in raw else None


def cache_root() -> Path:
    """The local artifact cache: ``$FORGE_CACHE`` (an empty value counts as unset), else ``forge_home()/artifacts``.
    With a remote ``FORGE_CACHE`` (:func:`remote_cache_url`) it is ``forge_home()/artifacts``, the read-through
    layer in front of the shared store."""
    raw = os.environ.get("FORGE_CACHE", "").strip()
    if not raw or "://" in raw:
        return forge_home() / "artifacts"
    return Path(raw).expanduser().absolute()


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """CPU feature flags as the kernel reports them (x86 ``flags``, Arm ``Features``)."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def free_bytes(path: Path) -> int | None:
    """Free space for an unprivileged writer on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None
