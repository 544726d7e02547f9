"""The one place forge's rich consoles are made, so that no output depends on the terminal's width.

- Not a terminal (a pipe, a file, a CI log): lines are never wrapped or cut, whatever COLUMNS says; a log is read
  with `grep`, and a name cut at column 80 is not found.
- A terminal: text wraps at the terminal's width as usual, but a table is printed at least as wide as its
  ``no_wrap`` columns (declare names so: keys, paths, hardware classes such as ``cpu:x86_64-avx512vnni``) and the
  longest word of each other column, so no name is cut or ellipsised; the terminal folds the long line instead,
  leaving the name whole in the byte stream.
- Control characters from user input (an ESC in a file name, a bell, a bidi override) are shown escaped
  (``\x1b``), never passed to the terminal, wherever they occur in a message or a table cell.
- A table's title (often a path: the cache root) is printed as a line of its own: Rich wraps a title to the table's
  width, which cuts a long path however wide the console is.
"""

from __future__ import annotations

import copy
import re

from rich.console import Console, ConsoleDimensions
from rich.table import Table
from rich.text import Text

# "no limit" for a log: wide enough that no line forge writes reaches it; Rich pads nothing to this width
# (tables are not expanded, no rules or panels), so it costs nothing.
UNBOUNDED = 1 << 16


# C0/C1 controls except newline and tab, DEL, and the bidi overrides/isolates that reorder what a terminal shows
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape (``\\x1b``, ``\\u202e``)."""
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


class ForgeConsole(Console):
    """A rich Console whose width is UNBOUNDED off a terminal and whose tables never cut a word on one."""

    def __init__(self, **kwargs):
        explicit = kwargs.get("width")
        super().__init__(**kwargs)
        if explicit is None:
            self._width = None      # Rich freezes COLUMNS here; a terminal's width is read at each print instead

    @property
    def size(self) -> ConsoleDimensions:
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(UNBOUNDED, super().size.height)
        return super().size

    @size.setter
    def size(self, new_size) -> None:
        self._width, self._height = new_size

    def render_str(self, text: str, **kwargs):
        # every str a print or a table cell shows passes here (markup is parsed after, so escapes stay text)
        return super().render_str(visible(text), **kwargs)

    def print(self, *objects, **kwargs) -> None:
        titles = [x for o in objects if isinstance(o, Table) for x in _title_apart(o)[:-1]]
        objects = tuple(x for o in objects for x in _title_apart(o))
        need = max([self._table_min_width(o) for o in objects if isinstance(o, Table)]
                   + [t.cell_len for t in titles], default=0)
        if need <= self.width:
            return super().print(*objects, **kwargs)
        kept = self._width
        self._width = need          # Console.print caps its width at self.width, so widen the console itself
        try:
            super().print(*objects, **kwargs)
        finally:
            self._width = kept

    def _table_min_width(self, table: Table) -> int:
        """The narrowest width that cuts no name: a no_wrap column (keys, paths, hardware) whole, every other column
        its longest word. Rich shrinks only wrapping columns while the table is at least this wide."""
        opts = self.options.update(max_width=UNBOUNDED)
        widths = (table._measure_column(self, opts, c) for c in table.columns)
        return table._extra_width + sum(m.maximum if c.no_wrap else m.minimum for m, c in zip(widths, table.columns))


def _title_apart(obj) -> tuple:
    """(title line, the table without it) for a titled table; (obj,) for anything else."""
    if not isinstance(obj, Table) or not obj.title:
        return (obj,)
    untitled = copy.copy(obj)
    untitled.title = None
    title = obj.title if isinstance(obj.title, Text) else Text.from_markup(str(obj.title), style="table.title")
    title.no_wrap = True
    return title, untitled


def make_console(*, stderr: bool = False, **kwargs) -> ForgeConsole:
    """stdout (or stderr) console of every forge command; ``file=`` writes elsewhere (e.g. a report's text)."""
    return ForgeConsole(stderr=stderr, **kwargs)
