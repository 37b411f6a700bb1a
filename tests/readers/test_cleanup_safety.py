"""Header/footer removal never deletes body text: real PDFs (fpdf2) and properties."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Optional, Sequence

import pytest
from fpdf import FPDF
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index_retrieval_kit.readers import PagedPDFReader
from llama_index_retrieval_kit.readers.cleanup import (
    is_page_number_line,
    page_number_value,
    remove_repeated_lines,
    removed_share,
)


def write_pages(
    path: Path, pages: Sequence[Sequence[str]], header: Optional[str] = None, footer: Optional[str] = None
) -> Path:
    """A PDF with one line per entry; ``footer`` may hold ``{page}`` and ``{pages}``."""
    pdf = FPDF(format="A4")
    pdf.set_auto_page_break(auto=False)
    for number, lines in enumerate(pages, start=1):
        pdf.add_page()
        pdf.set_font("Helvetica", size=11)
        if header:
            pdf.cell(0, 8, header, new_x="LMARGIN", new_y="NEXT")
        for line in lines:
            pdf.cell(0, 8, line, new_x="LMARGIN", new_y="NEXT")
        if footer:
            pdf.set_y(-20)
            pdf.cell(0, 8, footer.format(page=number, pages=len(pages)), new_x="LMARGIN", new_y="NEXT")
    pdf.output(str(path))
    return path


def slide_deck(pages: int = 8, lines: int = 4, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    return [
        [f"Slide {p}: revenue in region {k} grew {rng.randint(2, 40)}% to {rng.randint(10, 99)} million"
         for k in range(1, lines + 1)]
        for p in range(1, pages + 1)
    ]


def table_pages(pages: int = 3, rows: int = 3, seed: int = 1) -> list[list[str]]:
    rng = random.Random(seed)
    return [
        [f"Row {p * 10 + r} | {rng.randint(10, 99)} | {rng.randint(100, 999)}.{rng.randint(0, 9)}" for r in range(rows)]
        for p in range(pages)
    ]


def _visible(text: str) -> int:
    return len("".join(text.split()))


def test_slide_deck_body_lines_are_kept(tmp_path: Path) -> None:
    deck = slide_deck()
    path = write_pages(tmp_path / "deck.pdf", deck, header="Northwind Quarterly Review", footer="Page {page} of {pages}")
    doc = PagedPDFReader().load_data(path)[0]
    for lines in deck:
        for line in lines:
            assert line in doc.text
    assert "Northwind Quarterly Review" not in doc.text
    assert "Page 3 of 8" not in doc.text
    # Only the header and footer went: what was removed is exactly their share.
    body = sum(_visible(line) for lines in deck for line in lines)
    assert _visible(doc.text) == body


def test_table_rows_that_differ_in_digits_are_kept(tmp_path: Path) -> None:
    rows = table_pages()
    doc = PagedPDFReader().load_data(write_pages(tmp_path / "table.pdf", rows, footer="- {page} -"))[0]
    body = "\n".join(line for page in rows for line in page)
    assert _visible(doc.text) == _visible(body)
    assert "- 2 -" not in doc.text


def test_running_header_with_chapter_counter_is_removed(tmp_path: Path) -> None:
    chapters = [1, 1, 1, 2, 2, 2]
    pages = [[f"Paragraph {chr(65 + i)} is about topic {chr(75 + i)}.", f"Its second line has {3 * i + 5} words."]
             for i in range(6)]
    pdf = FPDF(format="A4")
    for chapter, lines in zip(chapters, pages):
        pdf.add_page()
        pdf.set_font("Helvetica", size=11)
        pdf.cell(0, 8, f"Annual Report - Chapter {chapter}", new_x="LMARGIN", new_y="NEXT")
        for line in lines:
            pdf.cell(0, 8, line, new_x="LMARGIN", new_y="NEXT")
    path = tmp_path / "report.pdf"
    pdf.output(str(path))
    doc = PagedPDFReader().load_data(path)[0]
    assert "Annual Report" not in doc.text
    assert all(line in doc.text for page in pages for line in page)


def test_warning_names_the_file_when_cleanup_takes_much_text(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A header under 60 characters: longer lines read like content and are always kept.
    banner = "Northwind Bank - internal draft - do not distribute"
    pages = [[f"Short note {name}."] for name in ("one", "two", "three", "four")]
    path = write_pages(tmp_path / "banner.pdf", pages, header=banner)
    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.readers.pdf"):
        doc = PagedPDFReader().load_data(path)[0]
    assert banner not in doc.text and "Short note three." in doc.text
    assert "banner.pdf" in caplog.text and "clean-up removed" in caplog.text


def test_pdf_never_loses_all_its_text(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pages = [["Quarterly figures follow on the next pages"] for _ in range(3)]
    path = write_pages(tmp_path / "same.pdf", pages, footer="Page {page} of {pages}")
    with caplog.at_level(logging.WARNING):
        doc = PagedPDFReader().load_data(path)[0]
    assert "Quarterly figures follow" in doc.text
    assert "same.pdf" in caplog.text and "would leave no text" in caplog.text


# ---- pure functions ----------------------------------------------------------------------

def test_lines_in_the_middle_of_pages_are_never_removed() -> None:
    # Ten pages whose middle line is identical: repeated, but not at an edge.
    pages = [f"Top {i} words\nA\nB\nC\nRepeated middle line\nD\nE\nF\nBottom {i * 7}" for i in range(10)]
    out = remove_repeated_lines(pages)
    assert all("Repeated middle line" in p for p in out)


def test_page_numbers_and_headers_go() -> None:
    pages = ["ACME Corp manual\nBody one\n1", "ACME Corp manual\nBody two\n2", "ACME Corp manual\nBody three\n3"]
    assert remove_repeated_lines(pages) == ["Body one", "Body two", "Body three"]
    names = ["first", "second", "third", "fourth"]
    roman = [f"The {name} preface page\n{numeral}" for name, numeral in zip(names, ["i", "ii", "iii", "iv"])]
    assert remove_repeated_lines(roman) == [f"The {name} preface page" for name in names]


def test_one_page_keeps_words_that_look_like_numerals() -> None:
    assert remove_repeated_lines(["Mix\nThe body of the page.\nCivil"]) == ["Mix\nThe body of the page.\nCivil"]
    assert remove_repeated_lines(["The body of the page.\nPage 1"]) == ["The body of the page."]
    assert page_number_value("Page 3 of 9") == 3 and page_number_value("- 4 -") == 4
    assert page_number_value("xiv") == 14 and not is_page_number_line("mix")


def test_numbers_that_do_not_follow_the_pages_are_kept() -> None:
    # A bare number at the bottom of each page that is not the page number: a table total.
    pages = [f"Total for region {name}\n{total}" for name, total in zip("NESW", [512, 87, 1033, 9])]
    assert remove_repeated_lines(pages) == pages


def test_removed_share() -> None:
    assert removed_share(["ab cd", "ef"], ["ab", "ef"]) == pytest.approx(2 / 6)
    assert removed_share(["  "], [""]) == 0.0


def test_bad_min_share_is_named() -> None:
    with pytest.raises(ValueError, match=r"min_share must be in \(0, 1\], got 0"):
        remove_repeated_lines(["a"], min_share=0)


LINE = st.text(alphabet="abcdefgh 0123456789%:", min_size=1, max_size=30).filter(lambda s: s.strip())


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(st.lists(LINE, min_size=0, max_size=12), min_size=1, max_size=8), edge=st.integers(1, 4))
def test_only_edge_lines_are_removed(pages: list[list[str]], edge: int) -> None:
    # A letter per position keeps lines unique within a page (and equal across pages).
    pages = [[f"{line} {'qrstuvwxyz'[j % 10] * (1 + j // 10)}" for j, line in enumerate(lines)] for lines in pages]
    texts = ["\n".join(lines) for lines in pages]
    out = remove_repeated_lines(texts, edge_lines=edge)
    for lines, cleaned in zip(pages, out):
        kept = cleaned.split("\n") if cleaned else []
        # Kept lines are the page's lines in order, minus some of the first/last `edge`.
        it = iter(enumerate(lines))
        removed = []
        for line in kept:
            for i, original in it:
                if original == line:
                    break
                removed.append(i)
            else:  # pragma: no cover - a kept line that was not in the page
                pytest.fail(f"line {line!r} not in page {lines!r}")
        removed.extend(i for i, _ in it)
        for i in removed:
            assert i < edge or i >= len(lines) - edge, (i, lines, kept)
