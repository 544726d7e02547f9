"""The recipe's ground types: the base of every section (the schema's and each build target's ``build.<name>``),
the bounds on counts, and what a recipe name may be. Imports nothing of forge, so a target's section model and the
schema both stand on it."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

MAX_NAME_CHARS = 128
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_RULE = "letters, digits, '.', '-' and '_', starting with a letter or digit"


# Upper bounds on counts: a typo like 10^40 samples is an error at resolve time, not an hour of work.
MAX_SAMPLES = 4096
MAX_SEQ_LEN = 131072
MAX_BATCH = 4096
MAX_SEED = 2**32 - 1          # numpy's seed range
MAX_THREADS = 1024
MAX_GPUS = 64


class Section(BaseModel):
    # NaN/inf are never meaningful in a recipe (a NaN threshold passes or fails every gate silently); strict: no
    # silent coercion ("64" is not 64, "yes" is not true) -- YAML and --set already give typed values
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)
