"""Section detection: find the headings of a structured document and the spans they own.

Pure functions, no LlamaIndex types. A document is cut into :class:`Section` spans that
tile the text exactly (every character belongs to exactly one section; text before the
first heading is a preamble section with an empty title and path).

Headings are found line by line from several signals, then checked against each other:

* Markdown headings (``#`` .. ``######``), outside fenced code blocks;
* numbered headings (``1.``, ``2 Fees``, ``3.1.2 Late fees``) that must continue the
  numbering seen so far (``3.1`` only inside ``3``; a list that restarts at ``1.`` inside
  section 4 is a list, not a heading);
* keyword headings (``Section 4``, ``ARTICLE IV``, ``Schedule A``, ``Appendix B``, ``Part II``);
* short ALL-CAPS lines (``DEFINITIONS``);
* user patterns (regular expressions, one per heading kind);
* the PDF outline (bookmarks), when the reader recorded one, which then takes precedence.

Lines that look like headings but are not are rejected with reasons that real documents
need: table-of-contents entries (dot leaders, trailing page numbers, runs of heading-like
lines with no body between them), list items (sentence punctuation, lowercase start, long
lines, runs of consecutive numbers), and numbers in body text (``2 tablespoons of ...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = [
    "Heading",
    "Section",
    "HeadingRules",
    "detect_headings",
    "split_sections",
    "headings_from_outline",
]


@dataclass(frozen=True)
class Heading:
    """A heading line: its text, its nesting level (1 = top) and where its line starts/ends."""

    title: str
    level: int
    start: int
    end: int
    kind: str = "numbered"
    number: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Section:
    """A span of the document owned by one heading (``title`` is "" for the preamble)."""

    title: str
    path: tuple[str, ...]
    level: int
    start: int
    end: int
    heading_end: int

    @property
    def has_body(self) -> bool:
        """Whether the section holds more than its heading line."""
        return self.heading_end < self.end


@dataclass(frozen=True)
class HeadingRules:
    """Knobs for heading detection (all optional; defaults suit contracts, manuals, papers)."""

    markdown: bool = True
    numbered: bool = True
    keywords: bool = True
    all_caps: bool = True
    custom_patterns: tuple[str, ...] = ()
    max_heading_chars: int = 90
    max_heading_words: int = 12
    max_first_number: int = 20
    max_number_gap: int = 2
    min_toc_run: int = 3


_MD_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_NUMBERED = re.compile(r"^(?P<num>\d{1,3}(?:\.\d{1,3}){0,5})(?P<dot>\.?)\)?[ \t]+(?P<title>\S.*)$")
_ROMAN = r"[IVXLCDM]+"
_KEYWORD = re.compile(
    r"^(?P<kw>section|article|part|chapter|schedule|appendix|annex|exhibit|clause)"
    r"[ \t]+(?P<num>\d{1,3}(?:\.\d{1,3})*|" + _ROMAN + r"|[A-Z])\b\.?"
    r"(?:[ \t]*[-:\u2013\u2014.][ \t]*|[ \t]+)?(?P<title>.*)$",
    re.IGNORECASE,
)
_KEYWORD_LEVEL = {
    "part": 1,
    "chapter": 1,
    "article": 1,
    "schedule": 1,
    "appendix": 1,
    "annex": 1,
    "exhibit": 1,
    "section": 2,
    "clause": 2,
}
_DOT_LEADER = re.compile(r"(\.\s?){3,}|\u2026|_{3,}|\t\s*\d+\s*$")
_TRAILING_PAGE_NUMBER = re.compile(r"\S\s{2,}\d{1,4}\s*$|\s\.+\s*\d{1,4}\s*$")
_SENTENCE_END = re.compile(r"[.;,:!?]\s*$")
_OPEN_LINE_END = re.compile(r"[a-z,]\s*$")


_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on
_LINE = re.compile(r"[^%s]*(?:\r\n|[%s])?" % (_LINE_BREAKS, _LINE_BREAKS))


def _lines(text: str) -> Iterable[tuple[int, int, str]]:
    """Yield (start, end, line) for every line, as ``str.splitlines`` cuts them, one at a
    time (a 50 MB text is never held as a list of lines); ``end`` excludes the newline."""
    n = len(text)
    for m in _LINE.finditer(text):
        pos, raw = m.start(), m.group()
        if not raw:
            if pos >= n:
                return
            continue
        line = raw.rstrip("\r\n")
        yield pos, pos + len(line), line


def _line_start(text: str, pos: int) -> int:
    """Where the line holding ``text[pos]`` starts, lines cut as ``str.splitlines`` cuts them
    (the offset after the last line break before ``pos``; 0 on the first line)."""
    start = pos
    while start > 0 and text[start - 1] not in _LINE_BREAKS:
        start -= 1
    return start


def _title_like(title: str, rules: HeadingRules) -> bool:
    """A heading title: short, starts upper-case, not a sentence."""
    title = title.strip()
    if not title or len(title) > rules.max_heading_chars:
        return False
    if len(title.split()) > rules.max_heading_words:
        return False
    first = title[0]
    if not (first.isupper() or first.isdigit() or first in "\"'(\u201c"):
        return False
    if _SENTENCE_END.search(title) and not title.endswith("."):
        return False
    # A period at the end is allowed for "1. DEFINITIONS." but not for a sentence.
    if title.endswith(".") and len(title.split()) > 4:
        return False
    return True


def _is_toc_line(line: str) -> bool:
    return bool(_DOT_LEADER.search(line) or _TRAILING_PAGE_NUMBER.search(line))


def _roman_to_int(s: str) -> int | None:
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    s = s.upper()
    if not s or any(c not in values for c in s):
        return None
    total = 0
    for i, c in enumerate(s):
        v = values[c]
        if i + 1 < len(s) and values[s[i + 1]] > v:
            total -= v
        else:
            total += v
    return total


def _is_all_caps_heading(line: str, rules: HeadingRules) -> bool:
    s = line.strip()
    if not s or len(s) > min(rules.max_heading_chars, 70):
        return False
    letters = [c for c in s if c.isalpha()]
    if len(letters) < 3 or any(c.islower() for c in letters):
        return False
    words = s.split()
    if len(words) > 8 or not any(len(w.strip(".,:;()&")) >= 3 for w in words):
        return False
    if s.endswith((".", ",", ";")):
        return False
    # Mostly letters: not a code, a table row of numbers or an id.
    return len(letters) >= 0.6 * len(s.replace(" ", ""))


@dataclass
class _Candidate:
    heading: Heading
    line_index: int
    toc_like: bool = False
    prev_line_open: bool = False


@dataclass
class _NumberingState:
    """The numbering seen so far: the accepted number at each depth."""

    current: tuple[int, ...] = ()
    seen_any: bool = False
    accepted: list[tuple[int, ...]] = field(default_factory=list)

    def fits(self, number: tuple[int, ...], rules: HeadingRules) -> bool:
        """Whether ``number`` can follow the current one: a next sibling at some depth
        (within ``max_number_gap``) or a first child, with any deeper parts starting at 0/1.
        "1.3" -> "2.1" is fine (the heading "2" may be an ARTICLE line); "3" -> "1" is not."""
        if not self.seen_any:
            return all(part <= rules.max_first_number for part in number) and all(p <= 1 for p in number[1:])
        cur = self.current
        d = 0
        while d < len(number) and d < len(cur) and number[d] == cur[d]:
            d += 1
        if d == len(number):
            return False  # a repeat of the current heading or of one of its ancestors
        if d == len(cur):
            step_ok = number[d] in (0, 1)
        else:
            step_ok = 1 <= number[d] - cur[d] <= rules.max_number_gap
        return step_ok and all(p in (0, 1) for p in number[d + 1 :])

    def accept(self, number: tuple[int, ...]) -> None:
        self.current = number
        self.seen_any = True
        self.accepted.append(number)


def _custom_heading(line: str, patterns: Sequence[re.Pattern[str]]) -> tuple[str, int] | None:
    for pattern in patterns:
        m = pattern.match(line.strip())
        if not m:
            continue
        groups = m.groupdict()
        title = (groups.get("title") or line).strip()
        level = 1
        if groups.get("level"):
            level = int(groups["level"])
        elif groups.get("number"):
            level = groups["number"].count(".") + 1
        return title, level
    return None


def compile_patterns(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    """Compile user heading patterns, naming the one that is not a valid regex."""
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ValueError(f"heading pattern {p!r} is not a valid regular expression: {exc}") from exc
    return compiled


def detect_headings(text: str, rules: HeadingRules | None = None) -> list[Heading]:
    """Return the headings of ``text`` in order, with levels; see the module docstring."""
    rules = rules or HeadingRules()
    custom = compile_patterns(rules.custom_patterns)
    blank = bytearray()  # one byte per line: 1 when the line is blank
    candidates: list[_Candidate] = []
    in_fence = False
    prev_line = ""
    for i, (start, end, line) in enumerate(_lines(text)):
        previous, prev_line = prev_line, line
        blank.append(not line.strip())
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence or blank[i]:
            continue
        prev_open = i > 0 and bool(_OPEN_LINE_END.search(previous))
        stripped = line.strip()
        lead = len(line) - len(line.lstrip())
        h_start, h_end = start + lead, start + lead + len(stripped)
        if custom:
            found = _custom_heading(stripped, custom)
            if found:
                h = Heading(found[0], found[1], h_start, h_end, "custom")
                candidates.append(_Candidate(h, i, prev_line_open=prev_open))
                continue
        if rules.markdown:
            m = _MD_HEADING.match(stripped)
            if m:
                title = m.group(2).strip()
                h = Heading(title, len(m.group(1)), h_start, h_end, "markdown")
                candidates.append(_Candidate(h, i, prev_line_open=prev_open))
                continue
        if len(stripped) > 2 * rules.max_heading_chars:
            continue  # a paragraph, not a heading (keeps the regexes below off long lines)
        toc_like = _is_toc_line(stripped)
        if rules.numbered:
            m = _NUMBERED.match(stripped)
            if m and _title_like(m.group("title"), rules):
                number = tuple(int(x) for x in m.group("num").split("."))
                level = len(number)
                # "2 Fees" without a dot is a heading; a bare "12 months" is body text.
                if level > 1 or m.group("dot") or m.group("title")[0].isupper():
                    h = Heading(stripped, level, h_start, h_end, "numbered", number)
                    candidates.append(_Candidate(h, i, toc_like, prev_open))
                    continue
        if rules.keywords:
            m = _KEYWORD.match(stripped)
            if m:
                kw = m.group("kw")
                title = m.group("title").strip()
                kw_ok = kw[0].isupper()
                if kw_ok and (not title or _title_like(title, rules)) and len(stripped) <= rules.max_heading_chars:
                    level = _KEYWORD_LEVEL[kw.lower()]
                    h = Heading(stripped, level, h_start, h_end, "keyword")
                    candidates.append(_Candidate(h, i, toc_like, prev_open))
                    continue
        if rules.all_caps and _is_all_caps_heading(stripped, rules):
            candidates.append(_Candidate(Heading(stripped, 1, h_start, h_end, "caps"), i, toc_like, prev_open))
    return _filter_candidates(candidates, blank, rules)


def _filter_candidates(candidates: list[_Candidate], blank: Sequence[int], rules: HeadingRules) -> list[Heading]:
    """Drop table-of-contents entries, list items and out-of-sequence numbers; set levels."""
    if not candidates:
        return []
    rejected: set[int] = {j for j, cand in enumerate(candidates) if cand.toc_like}
    # 1. A table of contents: a run of heading-like lines with no body between them whose
    #    titles come back later in the document (markdown/custom headings are trusted).
    titles_after: dict[str, int] = {}
    for j, cand in enumerate(candidates):
        titles_after[_norm_title(cand.heading.title)] = j  # last occurrence
    for run in _runs_without_body(candidates, blank, rejected):
        if any(candidates[j].heading.kind in ("markdown", "custom") for j in run):
            continue
        if len(run) >= rules.min_toc_run:
            repeated = [j for j in run if titles_after[_norm_title(candidates[j].heading.title)] > run[-1]]
            if len(repeated) >= len(run) // 2:
                rejected.update(run[:-1] if run[-1] not in repeated else run)
                continue
        # 2. List items: consecutive numbers at one level with nothing between them.
        for a, b in zip(run, run[1:]):
            ha, hb = candidates[a].heading, candidates[b].heading
            if ha.kind == hb.kind == "numbered" and ha.number and hb.number and len(ha.number) == len(hb.number):
                if ha.number[:-1] == hb.number[:-1] and hb.number[-1] == ha.number[-1] + 1:
                    rejected.update((a, b))
    # 3. A wrapped sentence: "... as described in\nSection 4." is body text.
    for j, cand in enumerate(candidates):
        prev = cand.line_index - 1
        if cand.heading.title.endswith(".") and prev >= 0 and not blank[prev] and cand.prev_line_open:
            rejected.add(j)

    # 4. Numbered headings must continue the numbering; ALL-CAPS lines nest under the last
    #    structural heading.
    state = _NumberingState()
    headings: list[Heading] = []
    structural_level = 0
    for j, cand in enumerate(candidates):
        if j in rejected:
            continue
        h = cand.heading
        if h.kind == "numbered":
            if h.number is None or not state.fits(h.number, rules):
                continue
            state.accept(h.number)
        if h.kind == "caps":
            h = Heading(h.title, structural_level + 1, h.start, h.end, h.kind, h.number)
        else:
            structural_level = h.level
        headings.append(h)
    return headings


def _norm_title(title: str) -> str:
    return " ".join(title.lower().split())


def _runs_without_body(candidates: list[_Candidate], blank: Sequence[int], skip: set[int]) -> list[list[int]]:
    """Group candidate indexes whose lines have only blank (or skipped) lines between them."""
    runs: list[list[int]] = []
    prev_line = None
    skip_lines = {candidates[j].line_index for j in skip}
    for j, cand in enumerate(candidates):
        if j in skip:
            continue
        cur = cand.line_index
        if prev_line is not None and all(blank[k] or k in skip_lines for k in range(prev_line + 1, cur)):
            runs[-1].append(j)
        else:
            runs.append([j])
        prev_line = cur
    return [r for r in runs if len(r) >= 2]


def headings_from_outline(text: str, outline: Sequence[dict], page_starts: Sequence[int]) -> list[Heading]:
    """Place PDF outline entries (``{"title", "level", "page"}``, page 0-based) in the text.

    Entries are placed in outline order, each at the *first* line matching its title (alone on
    its line, or after a short number such as ``2.`` or ``IV``) that starts on or after its
    page and after the previous entry's heading, and no later than the end of the next entry's
    page: a line that merely repeats the title further on (a table column "Fees" inside the
    section "Fees") is not mistaken for the heading. A matching line is passed over as a
    table-of-contents copy when the title comes back later in the range and the next non-blank
    line is another entry's title that also comes back later (a list of titles with no body).
    Entries that cannot be found are skipped.
    """
    entries = []
    for entry in outline:
        title = str(entry.get("title", "")).strip()
        if title:
            entries.append((title, int(entry.get("level", 1)), _outline_page(entry, page_starts)))
    patterns = {title: _title_patterns(title) for title, _, _ in entries}
    by_norm_title = {_norm_title(title): pats for title, pats in patterns.items()}
    placed: list[Heading] = []
    lo_floor = 0
    n = len(text)
    for k, (title, level, page) in enumerate(entries):
        lo = max(_page_start(page_starts, page, n), lo_floor)
        next_page = entries[k + 1][2] if k + 1 < len(entries) else None
        hi = n if next_page is None else max(lo, _page_end(page_starts, max(page, next_page), n))
        matches = _title_lines(text, patterns[title], lo, hi)
        if not matches:
            continue
        start, end = next(
            (m for i, m in enumerate(matches) if not (i + 1 < len(matches) and _is_toc_copy(text, m[1], by_norm_title))),
            matches[-1],
        )
        placed.append(Heading(text[start:end].strip(), level, start, end, "outline"))
        lo_floor = end
    return placed


def _outline_page(entry: dict, page_starts: Sequence[int]) -> int:
    page = int(entry.get("page", 0) or 0)
    return page if 0 <= page < len(page_starts) else 0


def _page_start(page_starts: Sequence[int], page: int, n: int) -> int:
    return min(page_starts[page], n) if 0 <= page < len(page_starts) else 0


def _page_end(page_starts: Sequence[int], page: int, n: int) -> int:
    return min(page_starts[page + 1], n) if page + 1 < len(page_starts) else n


def _title_patterns(title: str) -> tuple[re.Pattern[str], ...]:
    """Lines that are ``title`` (whitespace-insensitive, any case), then ``title`` after a short
    token such as a number; the first pattern with a match wins."""
    body = r"\s+".join(re.escape(w) for w in title.split())
    return (
        re.compile(r"(?im)^[ \t]*(" + body + r")[ \t]*$"),
        re.compile(r"(?im)^[ \t]*(\S{1,12}[ \t]+" + body + r")[ \t]*$"),
    )


def _title_lines(text: str, patterns: Sequence[re.Pattern[str]], lo: int, hi: int) -> list[tuple[int, int]]:
    """(start, end) of the title in every line of ``text[lo:hi]`` the first matching pattern finds."""
    for pattern in patterns:
        found = [(m.start(1), m.end(1)) for m in pattern.finditer(text, lo, hi)]
        if found:
            return found
    return []


_NEXT_LINE = re.compile(r"[^\S\r\n]*(?:\r\n|[\r\n])\s*([^\r\n]*)")


def _is_toc_copy(text: str, end: int, by_norm_title: dict[str, tuple[re.Pattern[str], ...]]) -> bool:
    """Whether the title line ending at ``end`` is followed (blank lines aside) by another
    outline title's line that comes back later in the text: a table of contents lists titles
    with no body between them."""
    m = _NEXT_LINE.match(text, end)
    if not m:
        return False
    line = m.group(1).strip()
    parts = line.split(None, 1)
    for candidate in (line, parts[1] if len(parts) == 2 else ""):  # the title, or a number then the title
        patterns = by_norm_title.get(_norm_title(candidate))
        if patterns is not None:
            return any(p.search(text, m.end(1)) for p in patterns)
    return False


def split_sections(text: str, headings: Sequence[Heading]) -> list[Section]:
    """Tile ``text`` into sections, one per heading plus a preamble when text precedes it.

    A section runs from the start of its heading line to the start of the next heading line
    (so sub-sections are separate spans; the path records nesting). Lines are cut as
    :func:`detect_headings` cuts them (``str.splitlines``: ``\\n``, ``\\r``, ``\\f``, ``\\u2028``, ...),
    so the text before a heading's line always stays with the previous section. The heading's
    own line break (and blank lines right after it) belong to the heading. Empty text gives [].
    """
    if not text:
        return []
    sections: list[Section] = []
    ordered = sorted(headings, key=lambda h: h.start)
    first_start = ordered[0].start if ordered else len(text)
    # Start each heading's span at the beginning of its line.
    line_starts = [_line_start(text, h.start) for h in ordered]
    if ordered:
        first_start = line_starts[0]
    if first_start > 0:
        sections.append(Section("", (), 0, 0, first_start, 0))
    stack: list[tuple[int, str]] = []
    for idx, h in enumerate(ordered):
        while stack and stack[-1][0] >= h.level:
            stack.pop()
        stack.append((h.level, h.title))
        start = line_starts[idx]
        end = line_starts[idx + 1] if idx + 1 < len(ordered) else len(text)
        heading_end = min(end, h.end)
        # The heading line's own line break belongs to the heading.
        while heading_end < end and text[heading_end] in _LINE_BREAKS:
            heading_end += 1
        sections.append(Section(h.title, tuple(t for _, t in stack), h.level, start, end, heading_end))
    return sections
