"""Recipes: what to build, as validated YAML. One module per job; ``from pipeline.recipe import X`` finds them all.

- ground: ``Section`` (the base of every section, a target's ``build.<name>`` included), count bounds, name rule
- schema: the section models and the resolved ``Recipe`` (its hash)
- reading: finding recipe files, reading them safely (size, UTF-8, invisible characters, YAML limits)
- extends: the ``extends:`` chain, ``--set`` overrides, build.<target> sections set for another target
- messages: how a problem is worded (file, key, value, what is allowed, did-you-mean)
- rules: rules across sections (the quantize section against the target's quantizers, the target's checks, ...)
- resolving: ``resolve`` (all of the above, every problem at once)
"""

# ruff: noqa: F401 -- the package's names, re-exported
from .ground import (MAX_BATCH, MAX_GPUS, MAX_NAME_CHARS, MAX_SAMPLES, MAX_SEED, MAX_SEQ_LEN, MAX_THREADS, NAME_RE,
                     NAME_RULE, Section)
from .extends import (MAX_KEY_PARTS, apply_overrides, deep_merge, foreign_build_problems, inherited_build_problems,
                      parse_value)
from .messages import not_one_of, section_problems
from .reading import (DEFAULT_RECIPE, MAX_RECIPE_BYTES, MAX_RECIPE_DEPTH, MAX_RECIPE_VALUES, RECIPES_DIR,
                      invisible_problems, list_recipes, parse_yaml, read_recipe_text, recipe_path)
from .resolving import resolve
from .rules import data_set_problems, export_attention, quantize_problems, semantic_problems
from .schema import (NOT_IN_ARTIFACTS, BuildSection, CalibrationSection, DistillSection, ExportSection, ModelSection,
                     PackageSection, PromptsSection, QatSection, QuantizeSection, Recipe, RegressionRule,
                     RegressionRules, TextSet, Thresholds, Tolerance, TritonSection, ValidateSection)
