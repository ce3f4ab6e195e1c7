"""A report table at the terminal's width: one rich table where its columns fit, else stacked tables that
each repeat the row's key columns, so that rich never crops a column and never cuts a word or a number.

Each column is at least as wide as its longest word (at most 40 cells); a table whose columns need more
than the width is split between column groups (a set's mean, low and high stay together). Only where the
key columns and a single group cannot fit even so are that part's cells folded inside words.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions
from rich.table import Table
from rich.text import Text

LONGEST_WORD = 40  # a column narrower than a longer word folds it rather than widen the table past it
CONTINUED = "(continued from above)"


def table_width(widths: Sequence[int]) -> int:
    """A rich table's width (the default box and padding) around columns of these widths."""
    return sum(widths) + 3 * len(widths) + 1


def word_widths(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    """Each column's longest word, header included, capped at LONGEST_WORD."""
    out = []
    for i, header in enumerate(headers):
        words = [w for cell in (header, *(row[i] for row in rows)) for w in cell.split()]
        out.append(min(max(map(cell_len, words), default=1), LONGEST_WORD))
    return out


def units(n_columns: int, keys: int, groups: Sequence[tuple[str, int]]) -> list[list[int]]:
    """The columns after the keys in the runs a split keeps together: a named group's, else one each."""
    named: dict[int, int] = {}
    first = 0
    for name, span in groups:
        for i in range(first, first + span):
            if name:
                named[i] = first
        first += span
    out: list[list[int]] = []
    for i in range(keys, n_columns):
        if out and i in named and named.get(out[-1][-1]) == named[i]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def split(widths: Sequence[int], keys: int, runs: Sequence[list[int]], width: int) -> list[list[int]]:
    """The columns of each stacked part: the keys, then as many runs as fit `width` (at least one)."""
    parts: list[list[int]] = []
    current: list[int] = []
    for run in runs:
        if current and table_width([widths[c] for c in [*range(keys), *current, *run]]) > width:
            parts.append(current)
            current = []
        current += run
    if current or not parts:
        parts.append(current)
    return [[*range(keys), *part] for part in parts]


def widen(least: Sequence[int], most: Sequence[int], width: int) -> list[int]:
    """Column widths from `least` towards `most` (a cell on one line), sharing out what `width` leaves over
    in proportion to what each column lacks."""
    spare = width - table_width(least)
    lacking = [max(m - n, 0) for n, m in zip(least, most, strict=True)]
    if spare <= 0 or not sum(lacking):
        return list(least)
    share = min(spare / sum(lacking), 1.0)
    return [n + int(share * lack) for n, lack in zip(least, lacking, strict=True)]


@dataclass(frozen=True)
class FittedTable:
    """A rich renderable: the table laid out at whatever width the console gives it."""

    title: str
    headers: tuple[str, ...]  # one per column
    rows: list[tuple[str, ...]]
    note: str
    numeric_from: int  # columns from here on are right-aligned
    keys: int  # the first columns, repeated in every part of a split table
    groups: tuple[tuple[str, int], ...] = ()

    def layout(self, width: int) -> list[tuple[list[int], list[int] | None]]:
        """Each stacked part's columns and their widths (None where even the longest words cannot fit: rich
        then folds the cells, and still crops no column)."""
        least = word_widths(self.headers, self.rows)
        most = [
            max(map(cell_len, (head, *(row[i] for row in self.rows)))) for i, head in enumerate(self.headers)
        ]
        out: list[tuple[list[int], list[int] | None]] = []
        for columns in split(least, self.keys, units(len(least), self.keys, self.groups), width):
            fits = table_width([least[c] for c in columns]) <= width
            out.append((columns, widen([least[c] for c in columns], [most[c] for c in columns], width) if fits
                        else None))  # fmt: skip
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Table | Text]:
        for n, (columns, widths) in enumerate(self.layout(options.max_width)):
            out = Table(title=Text(self.title if n == 0 else f"{self.title} {CONTINUED}"))
            for j, c in enumerate(columns):
                # each column as wide as its longest word at least, set here rather than left to rich's
                # collapsing (which squeezes columns below their words and then crops the table's edge)
                out.add_column(Text(self.headers[c]), justify="right" if c >= self.numeric_from else "left",
                               width=None if widths is None else widths[j], overflow="fold")  # fmt: skip
            for row in self.rows:
                out.add_row(*(Text(row[c]) for c in columns))  # Text, not markup: "[n/a]" is no rich tag
            yield out
        yield Text(self.note)
