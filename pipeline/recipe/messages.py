"""How a recipe problem is worded: each validation error as one line naming the file, the dotted key, the value and
what is allowed there (the declared bounds, the choices, did-you-mean for an unknown key), so a user fixes a recipe
in one pass. Knows no section: it walks the models it is given."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from ..errors import MAX_PROBLEMS_SHOWN
from .ground import NAME_RULE


def not_one_of(choices) -> PydanticCustomError:
    """The error pydantic gives a Literal, for choices the registry knows at run time: "Input should be 'a', 'b'
    or 'c'" (so every message about a choice reads the same)."""
    q = [f"'{c}'" for c in choices]
    return PydanticCustomError("literal_error", "Input should be {expected}",
                               {"expected": q[0] if len(q) == 1 else f"{', '.join(q[:-1])} or {q[-1]}"})


def _keyed(model_cls) -> dict[str, type[BaseModel]]:
    """A model's keys beyond its fields (BuildSection: build.<target>), with their models."""
    keyed = getattr(model_cls, "keyed_sections", None)
    return keyed() if keyed is not None else {}


def _allowed_keys(model_cls: type[BaseModel], hidden=()) -> list[str]:
    keys = [f.alias or n for n, f in model_cls.model_fields.items()] + list(_keyed(model_cls))
    return [k for k in keys if k not in hidden]


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class that holds the last key of ``loc`` (walking from ``root``)."""
    cls: Any = root
    for part in loc[:-1]:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        fields = {(f.alias or n): f for n, f in cls.model_fields.items()}
        if part in (keyed := _keyed(cls)):
            cls = keyed[part]                       # build.<target>: the target's own section model
            continue
        if isinstance(part, int) or part not in fields:
            # list element: the model is the list's item type
            continue
        ann = fields[part].annotation
        args = getattr(ann, "__args__", ())
        cls = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if cls is None:
            for a in args:
                for b in getattr(a, "__args__", ()):
                    if isinstance(b, type) and issubclass(b, BaseModel):
                        cls = b
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _value(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


_NUMERIC_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "int_type", "int_parsing",
                   "float_type", "float_parsing", "finite_number", "int_from_float"}


def _range(cls: type[BaseModel] | None, name) -> str | None:
    """'an integer in [1, 4096]', 'a number in (0, 0.01]', 'a number >= 0': the declared bounds of a field."""
    field = cls.model_fields.get(name) if cls is not None and isinstance(name, str) else None
    if field is None:
        return None
    b = {type(m).__name__: getattr(m, type(m).__name__.lower()) for m in field.metadata
         if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}
    kind = "an integer" if int in (field.annotation, *getattr(field.annotation, "__args__", ())) else "a number"
    lo = f"[{b['Ge']}" if "Ge" in b else (f"({b['Gt']}" if "Gt" in b else None)
    hi = f"{b['Le']}]" if "Le" in b else (f"{b['Lt']})" if "Lt" in b else None)
    if lo and hi:
        return f"{kind} in {lo}, {hi}"
    if lo or hi:
        return f"{kind} {'>=' if 'Ge' in b else '>' if 'Gt' in b else '<=' if 'Le' in b else '<'} " \
               f"{b.get('Ge', b.get('Gt', b.get('Le', b.get('Lt'))))}"
    return None


def _describe(err: dict, source: str | None, root: type[BaseModel], prefix: tuple = (), hidden=()) -> str:
    """One validation error as a message naming the key path (from ``prefix``): with a ``source`` (the recipe
    file) as ``FILE: key = value: what is allowed``; without, as ``key: what is allowed`` (plan-time checks).
    ``hidden``: keys of the model that are written elsewhere, not offered as allowed here."""
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in prefix + loc)
    kind = err["type"]
    where = f"{source}: " if source else ""
    cls = _model_at(loc, root)
    if kind == "extra_forbidden":
        allowed = _allowed_keys(cls, hidden if cls is root else ()) if cls else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{'.'.join(str(p) for p in prefix + loc[:-1] + (close[0],))}'?" if close else ""
        here = f"allowed here: {', '.join(allowed)}" if allowed else "no key is allowed here"
        if source:
            return f"{source}: unknown key '{path}'{hint} ({here})"
        return f"{path}: unknown key{hint} ({here})"
    shown = f" = {_value(err.get('input'))}" if source else ""
    got = "" if source else f", got {_value(err.get('input'))}"
    if path == "name" and kind == "string_pattern_mismatch":
        return (f"{where}name{shown} is not a valid recipe name: use {NAME_RULE} "
                "(it names the report directory and the cache index; set `name:` in the recipe)")
    if kind in _NUMERIC_ERRORS and (bounds := _range(cls, loc[-1])):
        return f"{where}{path}{shown}: must be {bounds}{got}"
    if kind == "literal_error":
        if source:
            return f"{source}: {path}{shown} is not allowed: {err['msg']}"
        return f"{path}: {_value(err.get('input'))} is not allowed: {err['msg']}"
    if kind == "missing":
        return f"{where}{path} is required"
    return f"{where}{path}{shown}: {err['msg'].removeprefix('Value error, ')}{got}"


def section_problems(model: type[BaseModel], data, prefix: tuple, source: str | None = None, hidden=()) -> list[str]:
    """Schema problems of ``data`` validated as ``model`` (at most MAX_PROBLEMS_SHOWN described); ``hidden``: keys
    of ``model`` written elsewhere (an option a quantize-section key stands for), not offered as allowed."""
    try:
        model.model_validate(data)
        return []
    except ValidationError as e:
        errors = e.errors()
    shown = [_describe(err, source, model, prefix, hidden) for err in errors[:MAX_PROBLEMS_SHOWN]]
    return shown + [f"{source or '.'.join(prefix)}: ..."] * (len(errors) - len(shown))
