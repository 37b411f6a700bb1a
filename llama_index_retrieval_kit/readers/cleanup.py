"""Text clean-up for extracted PDF pages: pure functions, one page (or all pages) at a time.

Clean-up happens *before* pages are joined, so the page offsets recorded afterwards are exact
against the stored text.

Running headers and footers are found conservatively, because a false positive deletes body
text without a trace:

* only lines within ``edge_lines`` non-empty lines of the top or bottom of a page are
  candidates, never lines in the middle of a page;
* a candidate is a running line when the same line, digits aside, sits at a page edge on at
  least ``min_share`` of the pages *and* its numbers behave like a header's: each number is
  the same on every page, follows the page number ("Page 3 of 9", "- 4 -"), or is a counter
  that rarely changes ("Chapter 2"). Body lines that differ only in digits ("Slide 3: revenue
  grew 12%", table rows) have numbers that vary freely and are kept;
* a line that is only a page number ("12", "Page 3 of 9", "- 4 -", "iv") is removed at a page
  edge when its number follows the page number on another page too (front matter numbered
  "i, ii, iii" qualifies), and on a document too short to judge (one page) only as its
  first or last line.

:func:`removed_share` measures how much text clean-up took, for a warning.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "dehyphenate",
    "normalize_whitespace",
    "remove_repeated_lines",
    "is_page_number_line",
    "page_number_value",
    "removed_share",
]

_HYPHEN_BREAK = re.compile(r"([A-Za-z\u00C0-\u024F]{2,})-[ \t]*\n[ \t]*([a-z\u00DF-\u024F]{2,})")
_ROMAN = r"(?=[ivxl])(?:x{0,3}|xl|l)(?:ix|iv|v?i{0,3})"  # 1..49: front-matter page numbers
_PAGE_NUMBER = re.compile(
    r"^\s*(?:page\s+)?(?P<num>\d{1,4}|" + _ROMAN + r")(?:\s*(?:of|/)\s*\d{1,4})?\s*$"
    r"|^\s*[-\u2013\u2014]\s*(?P<dash>\d{1,4})\s*[-\u2013\u2014]\s*$",
    re.IGNORECASE,
)
_DIGITS = re.compile(r"\d+")
_ROMAN_VALUES = {"i": 1, "v": 5, "x": 10, "l": 50}
#: Numbers longer than this are compared as text only (never as page numbers).
_MAX_NUMBER_DIGITS = 9


def dehyphenate(text: str) -> str:
    """Join words split by a hyphen at a line end ("inter-\\nest" -> "interest\\n").

    Only lower-case continuations are joined, so "Anglo-\\nSaxon" and list dashes stay. The
    line break moves after the joined word so the line structure is kept.
    """
    return _HYPHEN_BREAK.sub(lambda m: m.group(1) + m.group(2) + "\n", text)


def normalize_whitespace(text: str) -> str:
    """Collapse runs of spaces/tabs, strip line ends, and keep at most one blank line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
    text = re.sub(r"[ \t\f\v]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _roman_value(numeral: str) -> int:
    total = 0
    values = [_ROMAN_VALUES[c] for c in numeral.lower()]
    for i, v in enumerate(values):
        total += -v if i + 1 < len(values) and values[i + 1] > v else v
    return total


def page_number_value(line: str) -> Optional[int]:
    """The number of a line that is only a page number ("12", "Page 3 of 9", "- 4 -", "iv"),
    else None. Roman numerals count up to 49 (front matter), so words like "mix" are text."""
    m = _PAGE_NUMBER.match(line)
    if not m:
        return None
    num = m.group("num") or m.group("dash")
    return int(num) if num.isdigit() else _roman_value(num)


def is_page_number_line(line: str) -> bool:
    """A line that is only a page number ("12", "Page 3 of 9", "- 4 -", "iv")."""
    return page_number_value(line) is not None


@dataclass(frozen=True)
class _EdgeLine:
    """A non-empty line near the top or bottom of a page."""

    page: int
    index: int  # line index in the page
    outermost: bool  # the first or last non-empty line of the page
    key: str  # the stripped line with every number replaced by '#'
    numbers: tuple[str, ...]


def _edge_lines(pages: Sequence[Sequence[str]], edge: int) -> list[_EdgeLine]:
    """The non-empty lines within ``edge`` lines of the top or bottom of each page."""
    out = []
    for page, lines in enumerate(pages):
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        picked = sorted(set(nonempty[:edge]) | set(nonempty[-edge:])) if edge > 0 else []
        for i in picked:
            text = " ".join(lines[i].split())
            outermost = i in (nonempty[0], nonempty[-1])
            out.append(_EdgeLine(page, i, outermost, _DIGITS.sub("#", text), tuple(_DIGITS.findall(text))))
    return out


def _as_int(number: str) -> Optional[int]:
    return int(number) if len(number) <= _MAX_NUMBER_DIGITS else None


def is_running_number(pages: Sequence[int], values: Sequence[str]) -> bool:
    """Whether a number of a repeated line behaves as in a header or footer.

    ``values[i]`` was seen on page ``pages[i]`` (in page order). True when it is the same on
    every page, follows the page number (value - page is constant), or only ever grows and
    changes on at most a third of the steps (a chapter or section counter).
    """
    if len(set(values)) <= 1:
        return True
    ints = [_as_int(v) for v in values]
    if any(v is None for v in ints):
        return False
    if len({v - p for v, p in zip(ints, pages)}) == 1:  # type: ignore[operator]
        return True
    steps = [b - a for a, b in zip(ints, ints[1:])]  # type: ignore[operator]
    return all(s >= 0 for s in steps) and sum(s > 0 for s in steps) <= len(steps) // 3


def _running_keys(edges: Sequence[_EdgeLine], threshold: int) -> set[str]:
    """Keys of the lines that are running headers/footers (see the module docstring)."""
    groups: dict[str, list[_EdgeLine]] = defaultdict(list)
    for e in edges:
        groups[e.key].append(e)
    running = set()
    for key, group in groups.items():
        if len({e.page for e in group}) < threshold:
            continue
        group = sorted(group, key=lambda e: (e.page, e.index))
        pages = [e.page for e in group]
        fields = zip(*(e.numbers for e in group))
        if all(is_running_number(pages, values) for values in fields):
            running.add(key)
    return running


def _page_number_lines(edges: Sequence[_EdgeLine], lines: Sequence[Sequence[str]], judge: bool) -> set[tuple[int, int]]:
    """``(page, index)`` of edge lines that are page numbers (see the module docstring)."""
    found = []
    for e in edges:
        value = page_number_value(lines[e.page][e.index])
        if value is not None:
            found.append((e, value - e.page))
    if not judge:
        return {(e.page, e.index) for e, _ in found if e.outermost}
    pages_per_offset: dict[int, set[int]] = defaultdict(set)
    for e, offset in found:
        pages_per_offset[offset].add(e.page)
    return {(e.page, e.index) for e, offset in found if len(pages_per_offset[offset]) >= 2}


def remove_repeated_lines(
    pages: Sequence[str], min_share: float = 0.5, edge_lines: int = 3, min_pages: int = 2
) -> list[str]:
    """Drop running headers/footers and page numbers from the top and bottom of pages.

    Only the first and last ``edge_lines`` non-empty lines of a page are candidates; a
    candidate goes when the same line (digits aside) is at a page edge on at least
    ``min_share`` of the pages and its numbers are constant, the page number, or a slow
    counter; page-number-only lines go when they follow the page numbering. Fewer than
    ``min_pages`` pages: only a page-number line that opens or closes the page goes. Details
    in the module docstring.
    """
    if not 0 < min_share <= 1:
        raise ValueError(f"min_share must be in (0, 1], got {min_share}")
    split = [page.split("\n") for page in pages]
    edges = _edge_lines(split, edge_lines)
    judge = len(pages) >= min_pages
    running = _running_keys(edges, max(2, math.ceil(min_share * len(pages)))) if judge else set()
    drop = {(e.page, e.index) for e in edges if e.key in running}
    drop |= _page_number_lines(edges, split, judge)
    return [
        "\n".join(line for i, line in enumerate(lines) if (page, i) not in drop) for page, lines in enumerate(split)
    ]


def _visible_chars(text: str) -> int:
    return len(text) - sum(text.count(c) for c in " \t\n\r\f\v\u00a0")


def removed_share(before: Sequence[str], after: Sequence[str]) -> float:
    """Share (0..1) of the non-whitespace characters of ``before`` missing from ``after``."""
    total = sum(_visible_chars(p) for p in before)
    if total == 0:
        return 0.0
    kept = sum(_visible_chars(p) for p in after)
    return max(0.0, (total - kept) / total)
