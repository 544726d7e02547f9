"""Where forge keeps its files (``forge_home``, ``cache_root``, ``history_db``, ``remote_cache_url``) and which commit
of forge runs (``source_commit``)."""

from __future__ import annotations

import os
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


def history_db() -> Path:
    """The run-history database: ``$FORGE_HISTORY`` (an empty value counts as unset), else
    ``forge_home()/history.sqlite``."""
    raw = os.environ.get("FORGE_HISTORY", "").strip()
    return Path(raw).expanduser().absolute() if raw else forge_home() / "history.sqlite"


def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the forge checkout this code runs from; (None, None) outside a git work tree."""
    import subprocess
    root = Path(__file__).resolve().parents[2]     # the checkout holding pipeline/
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
