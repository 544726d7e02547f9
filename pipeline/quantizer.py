"""A quantizer: one ``quantize.algo`` of one build target, in the spirit of Olive's passes.

It declares its typed options: one pydantic model (``options``) in which each option has its type, default, bounds
and meaning, in one place (pipeline/recipe_options.py). The recipe validates ``quantize.options`` (and the
``quantize.<key>`` that stand for an option, ``section_keys``) against that model once, at resolve
(pipeline/recipe/rules.py ``quantize_problems``); the target's quantize stage asks :meth:`Quantizer.options_of`
for the typed options, whose defaults are the model's, and runs the target's tool with them. A target's quantizers
are one table, ``Target.quantizers`` (algo -> quantizer, "none" included); a target whose tool needs more of an algo
(a checkpoint format, a calibration preset) subclasses this class there (pipeline/trtllm/quantizers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Quantizer:
    options: type                          # a pydantic model: the schema of quantize.options for this algo
    # quantize.<key> -> the option of ``options`` it stands for (quantize.block_size -> block_size): the recipe
    # writes it there, one spelling per option (quantize.options.<option> is refused with a did-you-mean)
    section_keys: Mapping[str, str] = field(default_factory=dict)
    # lowest GPU compute capability (89 = 8.9) an engine of this algo runs on; None: any (or no GPU)
    min_sm: int | None = None
    summary: str = ""

    def options_of(self, quantize):
        """The typed options of a recipe's quantize section (``quantize.options`` and the section keys that stand
        for an option), defaults filled by the model. The recipe has refused what does not validate."""
        opts = dict(quantize.options)
        for key, opt in self.section_keys.items():
            if getattr(quantize, key) is not None:
                opts[opt] = getattr(quantize, key)
        return self.options.model_validate(opts)
