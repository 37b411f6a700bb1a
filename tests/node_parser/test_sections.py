"""Section detection on the structures real documents have, and where a naive regex fails."""

from __future__ import annotations

import re

import pytest

from llama_index_retrieval_kit.node_parser import detect_headings, split_sections
from llama_index_retrieval_kit.node_parser.sections import HeadingRules, compile_patterns, headings_from_outline

AGREEMENT = """CARDHOLDER AGREEMENT

Contents
1. Definitions ........ 1
2. Fees ........ 2
3. Interest ........ 3

1. Definitions
In this agreement, you means the cardholder. You must:
1. Keep your card safe
2. Pay on time

2. Fees
2.1 Annual Fee
The annual fee is $95. Fees are reviewed every
12 months and disclosed in advance.
2 tablespoons of text that is not a heading.
2.2 Late Fee
A late fee of $40 applies as described in
Section 4.

3. Interest
Interest accrues daily.
"""


def _titles(text: str, **rules) -> list[tuple[int, str]]:
    return [(h.level, h.title) for h in detect_headings(text, HeadingRules(**rules) if rules else None)]


def naive_sections(text: str) -> list[str]:
    """The seed's approach: a regex for "N. Title" accepting only the next expected number."""
    expected, found = 1, []
    for line in text.splitlines():
        m = re.match(r"^(\d+)\.\s+(.+)$", line.strip())
        if m and int(m.group(1)) == expected:
            found.append(line.strip())
            expected += 1
    return found


def test_toc_lists_and_body_numbers_are_not_headings() -> None:
    assert _titles(AGREEMENT) == [
        (1, "CARDHOLDER AGREEMENT"),
        (1, "1. Definitions"),
        (1, "2. Fees"),
        (2, "2.1 Annual Fee"),
        (2, "2.2 Late Fee"),
        (1, "3. Interest"),
    ]


def test_naive_next_number_regex_fails_where_we_succeed() -> None:
    naive = naive_sections(AGREEMENT)
    # The naive approach takes the table of contents as the sections, then a list item.
    assert naive[:3] == ["1. Definitions ........ 1", "2. Fees ........ 2", "3. Interest ........ 3"]
    ours = [t for _, t in _titles(AGREEMENT) if t[0].isdigit() and "." not in t.split()[0][:-1]]
    assert ours == ["1. Definitions", "2. Fees", "3. Interest"]


def test_toc_without_dot_leaders_is_detected_by_repetition() -> None:
    text = "Table of Contents\n1 Definitions\n2 Fees\n3 Interest\n\n1 Definitions\nBody one.\n2 Fees\nBody two.\n3 Interest\nBody three.\n"
    sections = split_sections(text, detect_headings(text))
    assert [s.title for s in sections] == ["", "1 Definitions", "2 Fees", "3 Interest"]
    assert "Table of Contents" in text[sections[0].start : sections[0].end]


def test_list_restarting_inside_a_later_section_is_not_a_heading() -> None:
    text = "1. Scope\nBody.\n\n2. Duties\nThe supplier shall:\n\n1. Deliver the Goods\n\nand then\n\n3. Payment\nBody.\n"
    assert [t for _, t in _titles(text)] == ["1. Scope", "2. Duties", "3. Payment"]


def test_keyword_headings_and_levels() -> None:
    text = (
        "ARTICLE I - DEFINITIONS\nTerms.\n1.1 Scope\nThe scope.\n1.2 Term\nThe term.\n"
        "ARTICLE II - PAYMENT\nText.\n2.1 Invoices\nInvoices are due.\nSchedule A\nPrice list.\nAppendix B: Forms\nForms.\n"
    )
    assert _titles(text) == [
        (1, "ARTICLE I - DEFINITIONS"),
        (2, "1.1 Scope"),
        (2, "1.2 Term"),
        (1, "ARTICLE II - PAYMENT"),
        (2, "2.1 Invoices"),
        (1, "Schedule A"),
        (1, "Appendix B: Forms"),
    ]


def test_section_keyword_and_caps_headings() -> None:
    text = "Section 1. Scope\nText here.\nSection 2 Fees\nMore text.\nIMPORTANT NOTICE\nRead this.\n"
    assert _titles(text) == [(2, "Section 1. Scope"), (2, "Section 2 Fees"), (3, "IMPORTANT NOTICE")]


def test_markdown_headings_ignore_code_fences() -> None:
    text = "# Manual\nIntro.\n## Setup\n```\n# not a heading\n```\n### Step 1\nDo it.\n"
    assert _titles(text) == [(1, "Manual"), (2, "Setup"), (3, "Step 1")]


def test_custom_patterns_take_precedence() -> None:
    text = "Clause A1 - Parties\nThe parties.\nClause A2 - Term\nThe term.\n"
    rules = dict(custom_patterns=(r"^Clause (?P<number>A\d+) - (?P<title>.+)$",), keywords=False)
    assert _titles(text, **rules) == [(1, "Parties"), (1, "Term")]


def test_bad_custom_pattern_names_itself() -> None:
    with pytest.raises(ValueError, match=r"heading pattern '\(unclosed' is not a valid regular expression"):
        compile_patterns(["(unclosed"])


def test_sections_tile_the_text() -> None:
    sections = split_sections(AGREEMENT, detect_headings(AGREEMENT))
    assert sections[0].start == 0 and sections[-1].end == len(AGREEMENT)
    for a, b in zip(sections, sections[1:]):
        assert a.end == b.start
    fees = next(s for s in sections if s.title == "2.1 Annual Fee")
    assert fees.path == ("2. Fees", "2.1 Annual Fee")


def test_outline_skips_table_of_contents_copies() -> None:
    text = "Contents\nFees\nInterest\n\nFees\nBody about fees.\n\nInterest\nBody about interest.\n"
    outline = [{"title": "Fees", "level": 1, "page": 0}, {"title": "Interest", "level": 1, "page": 0}]
    heads = headings_from_outline(text, outline, [0])
    assert [text[h.start : h.end] for h in heads] == ["Fees", "Interest"]
    assert heads[0].start == text.index("Fees\nBody")
