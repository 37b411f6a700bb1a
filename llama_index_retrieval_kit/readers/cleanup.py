"""Text clean-up for extracted PDF pages: pure functions, one page (or all pages) at a time.

Clean-up happens *before* pages are joined, so the page offsets recorded afterwards are exact
against the stored text.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

__all__ = [
    "dehyphenate",
    "normalize_whitespace",
    "remove_repeated_lines",
    "is_page_number_line",
]

_HYPHEN_BREAK = re.compile(r"([A-Za-z\u00C0-\u024F]{2,})-[ \t]*\n[ \t]*([a-z\u00DF-\u024F]{2,})")
_PAGE_NUMBER = re.compile(
    r"^\s*(?:page\s+)?(?:\d{1,4}|[ivxlcdm]{1,6})(?:\s*(?:of|/)\s*\d{1,4})?\s*$|^\s*[-\u2013\u2014]\s*\d{1,4}\s*[-\u2013\u2014]\s*$",
    re.IGNORECASE,
)
_DIGITS = re.compile(r"\d+")


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


def is_page_number_line(line: str) -> bool:
    """A line that is only a page number ("12", "Page 3 of 9", "- 4 -", "iv")."""
    return bool(_PAGE_NUMBER.match(line))


def _edge_lines(lines: list[str], edge: int) -> list[tuple[int, str]]:
    """Indexes and texts of the first and last ``edge`` non-empty lines."""
    nonempty = [(i, line.strip()) for i, line in enumerate(lines) if line.strip()]
    picked = nonempty[:edge] + nonempty[-edge:] if len(nonempty) > edge else nonempty
    seen: set[int] = set()
    out = []
    for i, line in picked:
        if i not in seen:
            seen.add(i)
            out.append((i, line))
    return out


def remove_repeated_lines(
    pages: Sequence[str], min_share: float = 0.5, edge_lines: int = 2, min_pages: int = 2
) -> list[str]:
    """Drop running headers/footers and page numbers from the top and bottom of pages.

    A line near a page edge is a header/footer when the same line (digits ignored, so
    "Page 3" matches "Page 4") occurs near the edge of at least ``min_share`` of the pages.
    Needs ``min_pages`` pages to judge repetition; page-number-only lines at an edge are
    removed on any document.
    """
    split = [page.split("\n") for page in pages]
    counts: Counter[str] = Counter()
    for lines in split:
        keys = {_DIGITS.sub("#", line) for _, line in _edge_lines(lines, edge_lines)}
        counts.update(keys)
    repeated = set()
    if len(pages) >= min_pages:
        threshold = max(2, int(min_share * len(pages) + 0.999))
        repeated = {key for key, c in counts.items() if c >= threshold}
    cleaned = []
    for lines in split:
        drop = {
            i
            for i, line in _edge_lines(lines, edge_lines)
            if _DIGITS.sub("#", line) in repeated or is_page_number_line(line)
        }
        cleaned.append("\n".join(line for i, line in enumerate(lines) if i not in drop))
    return cleaned
