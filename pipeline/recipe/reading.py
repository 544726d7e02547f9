"""Finding and reading recipe files safely: a name or a path to a file, at most MAX_RECIPE_BYTES of UTF-8 with no
invisible or control character, one YAML document without duplicate keys, bounded in depth and size (aliases
expanded). Every refusal names the file (and the line and key where it can)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml

from ..errors import RecipeError
from .ground import MAX_NAME_CHARS, NAME_RE, NAME_RULE


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "smollm2-135m-int8"

# A recipe is a few hundred bytes; these bounds keep a hostile or broken file from taking minutes or memory.
MAX_RECIPE_BYTES = 256 * 1024
MAX_RECIPE_VALUES = 5000          # mappings + sequences + scalars, after expanding YAML aliases
MAX_RECIPE_DEPTH = 16             # the schema is 5 levels deep


def list_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.yaml") if p.is_file())


def short_text(text: str, n: int = 60) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def _is_path(spec: str) -> bool:
    """A recipe given as a file (ends in .yaml/.yml or names a directory part); anything else is a name."""
    return spec.endswith((".yaml", ".yml")) or "/" in spec or "\\" in spec


def _check_file(p: Path, shown: str) -> Path:
    try:
        if p.is_dir():
            raise RecipeError([f"{shown}: is a directory, not a recipe file; give a .yaml file or a recipe name "
                               f"(`forge recipes list`)"])
        if not p.is_file():
            if p.is_symlink():      # is_file() follows links: a dangling link or a loop of links lands here
                raise RecipeError([f"{shown}: a symbolic link that leads to no file (dangling, or a loop of "
                                   "links); point it at a recipe file"])
            if p.exists():          # reading a FIFO would wait forever, a device never ends
                raise RecipeError([f"{shown}: not a regular file (a FIFO, socket or device); give a .yaml file"])
            raise RecipeError([f"{shown}: no such recipe file"])
    except OSError as e:            # e.g. a name too long for the file system
        raise RecipeError([f"{short_text(shown)}: cannot be opened as a recipe file ({e.strerror or e})"]) from None
    return p


def recipe_path(name_or_path: str, recipes_dir: Path = RECIPES_DIR, relative_to: Path | None = None) -> Path:
    """The file of a recipe: a path (``x.yaml``, ``dir/x.yaml``) as given, or a name looked up in ``recipes_dir``.

    A name never leaves ``recipes_dir`` (no ``/``, no ``..``); files elsewhere are given as paths.
    ``relative_to`` anchors relative paths (an ``extends:`` is relative to the file that says it).
    """
    spec = str(name_or_path)
    if not spec.strip():
        raise RecipeError(["a recipe name or path is required, got an empty string"])
    if _is_path(spec):
        p = Path(spec).expanduser()
        if relative_to is not None and not p.is_absolute():
            p = relative_to / p
        return _check_file(p, spec)
    if len(spec) > MAX_NAME_CHARS or not NAME_RE.match(spec):
        raise RecipeError([f"recipe name {short_text(spec)!r} is not valid: a name is at most {MAX_NAME_CHARS} "
                           f"{NAME_RULE} (a file elsewhere is given as a path ending in .yaml)"])
    p = recipes_dir / f"{spec}.yaml"
    if not p.exists():
        names = list_recipes(recipes_dir)
        close = difflib.get_close_matches(spec, names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise RecipeError([f"no recipe named '{spec}' in {recipes_dir}{hint} (available: {', '.join(names)})"])
    return _check_file(p, str(p))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader; the document is checked (size, depth, duplicate keys) before it is constructed."""


def _node_problems(root: yaml.Node, path: Path) -> list[str]:
    """Duplicate keys (any level), nesting depth and size (aliases expanded) of a composed YAML document."""
    problems: list[str] = []
    sizes: dict[int, int] = {}
    # iterative post-order walk: a deeply nested or alias-heavy file cannot exhaust the stack or the clock
    stack: list[tuple[yaml.Node, str, int, bool]] = [(root, "", 0, False)]
    while stack:
        node, where, depth, done = stack.pop()
        if depth > MAX_RECIPE_DEPTH:
            return [f"{path}: nested more than {MAX_RECIPE_DEPTH} levels deep at '{where}'; a recipe is a few "
                    "levels of sections (see recipes/*.yaml)"]
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        if isinstance(node, yaml.MappingNode):
            children = [(v, f"{where}.{k.value}" if where else str(k.value)) for k, v in node.value]
        else:
            children = [(v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(node.value)]
        if done:
            sizes[id(node)] = 1 + sum(sizes.get(id(c), 1) for c, _ in children)
            continue
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":
                    key = f"{where}.{k.value}" if where else str(k.value)
                    if k.value in first:
                        problems.append(f"{path}: duplicate key '{key}' at line {k.start_mark.line + 1} (first at "
                                        f"line {first[k.value]}); YAML keeps only the last, remove one")
                    else:
                        first[k.value] = k.start_mark.line + 1
        stack.append((node, where, depth, True))
        stack.extend((c, w, depth + 1, False) for c, w in children if id(c) not in sizes)
    if sizes.get(id(root), 0) > MAX_RECIPE_VALUES:
        problems.append(f"{path}: {sizes[id(root)]} values (aliases expanded); a recipe has at most "
                        f"{MAX_RECIPE_VALUES}")
    return problems


def _yaml_error(e: yaml.YAMLError, where: str, text: str = "") -> str:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    if isinstance(e, yaml.reader.ReaderError):      # a character YAML forbids; it knows only the offset
        line = text.count("\n", 0, e.position) + 1
        key = _key_at(text, line)
        return (f"{where}: character U+{e.character:04X} at line {line}" + (f" (key '{short_text(key)}')" if key else "")
                + ": YAML does not allow it in a document; remove it")
    key = _key_at(text, mark.line + 1) if mark and text else ""
    return f"{where}: YAML syntax error{at}{f' (key {short_text(key)!r})' if key else ''}: " \
           f"{getattr(e, 'problem', None) or e}"


_KEY_LINE = re.compile(r"^(\s*)(?:-\s+)?([^\s#:'\"][^:#]*?|'[^']*'|\"[^\"]*\"):(?:\s|$)")


def _key_at(text: str, line: int) -> str:
    """The dotted key a line of a block-style YAML text belongs to ('' when it cannot tell): the line's own key,
    under the keys of the less indented lines above it. For messages about text YAML cannot parse."""
    path: list[tuple[int, str]] = []
    for ln in text.splitlines()[:line]:
        m = _KEY_LINE.match(ln)
        if not m:
            continue
        indent = len(m.group(1))
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, m.group(2).strip("'\"")))
    return ".".join(k for _, k in path)


# Characters that make a recipe read differently than it runs (Trojan Source, CVE-2021-42574) or that no editor
# shows: C0/C1 controls but tab and newlines, format characters (zero-width, bidi overrides, soft hyphen) and
# the Unicode line/paragraph separators. A byte-order mark is accepted as the file's first character only.
INVISIBLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                        "\u2060-\u206f\ufeff\ufff9-\ufffb]")


def invisible_problems(text: str, where: str) -> list[str]:
    """Each control, zero-width or bidi character of ``text`` (up to 5), by line, column and key."""
    import unicodedata
    out = []
    for m in INVISIBLE.finditer(text, 1 if text.startswith("\ufeff") else 0):
        if len(out) == 5:
            out.append(f"{where}: more such characters follow")
            break
        line = text.count("\n", 0, m.start()) + 1
        col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
        key = _key_at(text, line)
        ch = m.group()
        out.append(f"{where}: invisible or control character U+{ord(ch):04X} "
                   f"({unicodedata.name(ch, 'control character')}) at line {line}, column {col}"
                   + (f" (key '{key}')" if key else "") + "; it makes the recipe read differently than it runs: "
                   "remove it (write it as an escape such as \\u200b inside a double-quoted string if you mean it)")
    return out


def parse_yaml(text: str, where: str):
    """One YAML document, checked for duplicate keys, depth and size; RecipeError names ``where``."""
    loader = None
    try:
        loader = _Loader(text)      # its reader rejects characters YAML forbids: a YAMLError too
        node = loader.get_single_node()
        if node is None:
            return None
        problems = _node_problems(node, where)
        if problems:
            raise RecipeError(problems)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise RecipeError([_yaml_error(e, where, text)]) from None
    except RecursionError:
        raise RecipeError([f"{where}: nested too deeply to read; a recipe is a few levels of sections"]) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_recipe_text(path: Path) -> str:
    """The text of a recipe file: at most MAX_RECIPE_BYTES of UTF-8 (RecipeError names the file otherwise)."""
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise RecipeError([f"{path}: {size} bytes; a recipe file is at most {MAX_RECIPE_BYTES // 1024} KiB "
                               "(is this the right file?)"])
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError([f"{path}: cannot be read ({e.strerror or e})"]) from None
    if b"\0" in raw:
        raise RecipeError([f"{path}: a binary file, not a YAML recipe"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        key = _key_at(raw.decode("utf-8", "replace"), line)
        raise RecipeError([f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}, line {line}"
                           + (f", key '{short_text(key)}'" if key else "") + "); save the recipe as UTF-8"]) from None
    problems = invisible_problems(text, str(path))
    if problems:
        raise RecipeError(problems)
    return text.removeprefix("\ufeff")


def read_yaml(path: Path) -> dict:
    text = read_recipe_text(path)
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise RecipeError([f"{path}: empty recipe file; a recipe sets at least one section "
                           "(see recipes/smollm2-135m-int8.yaml)"])
    data = parse_yaml(text, str(path))
    if data is None:
        raise RecipeError([f"{path}: empty recipe file; a recipe sets at least one section "
                           "(see recipes/smollm2-135m-int8.yaml)"])
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}"])
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise RecipeError([f"{path}: section names must be text, got {bad[0]!r}"])
    return data
