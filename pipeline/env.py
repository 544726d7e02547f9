"""Facts about this machine and environment, each defined once.

Cache keys, manifests, reports and `forge doctor` read these functions so they always agree:
where forge keeps its files (``forge_home``, ``cache_root``, ``history_db``), which commit of forge runs
(``source_commit``) and what of the CPU changes numbers (``cpu_isa_class``).
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


def cache_root() -> Path:
    """The artifact cache: ``$FORGE_CACHE`` (an empty value counts as unset), else ``forge_home()/artifacts``."""
    raw = os.environ.get("FORGE_CACHE", "").strip()
    return Path(raw).expanduser().absolute() if raw else forge_home() / "artifacts"


def history_db() -> Path:
    """The run-history database: ``$FORGE_HISTORY`` (an empty value counts as unset), else
    ``forge_home()/history.sqlite``."""
    raw = os.environ.get("FORGE_HISTORY", "").strip()
    return Path(raw).expanduser().absolute() if raw else forge_home() / "history.sqlite"


def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the forge checkout this code runs from; (None, None) outside a git work tree."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


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
