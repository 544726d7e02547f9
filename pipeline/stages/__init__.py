"""Stage flows per build target: each target declares its own (pipeline/targets)."""

from __future__ import annotations

from .base import Stage


def flow_for(target: str) -> list[Stage]:
    """The stages of ``target`` in run order (a KeyError names the registered targets)."""
    from .. import target_registry as registry
    return registry.get(target).stages()
