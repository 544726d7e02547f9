"""Tests of the lab's own scripts (lab/README.md): `make lab-test`, never part of `make test`. The lab's modules are
imported by file name, as the scripts import each other."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(LAB))
os.environ.setdefault("FORGE_PROGRESS", "0")
