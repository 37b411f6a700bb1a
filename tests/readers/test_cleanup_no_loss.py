"""PDF clean-up never loses body text: the audit's cases as real PDFs (fpdf2), and properties.

Each regression case is a layout where the earlier clean-up deleted every copy of a body line
(or glued a compound word); the properties pin the rules of ``readers.cleanup`` down.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Sequence

import pytest
from fpdf import FPDF
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pypdf import PdfReader

from llama_index_retrieval_kit import SectionWindowNodeParser
from llama_index_retrieval_kit.readers import PagedPDFReader
from llama_index_retrieval_kit.readers.cleanup import (
    MAX_HEADER_CHARS,
    MAX_PAGE_OFFSET,
    MIN_RUNNING_PAGES,
    dehyphenate,
    is_keyword_heading,
    packaged_vocabulary,
    page_number_value,
    reads_like_content,
    remove_repeated_lines,
    unhyphenated_words,
)

BODY = "the account terms describe fees, rates and duties in detail."


def filler(page: int, count: int) -> list[str]:
    return [f"Paragraph {page}.{i}: {BODY}" for i in range(count)]


def write_lines(path: Path, pages: Sequence[Sequence[str]]) -> Path:
    """A PDF with one text line per entry of each page (no automatic page breaks)."""
    pdf = FPDF(format="A4")
    pdf.set_auto_page_break(auto=False)
    for lines in pages:
        pdf.add_page()
        pdf.set_font("Helvetica", size=11)
        for line in lines:
            pdf.cell(0, 7, line, new_x="LMARGIN", new_y="NEXT")
    pdf.output(str(path))
    return path


def read_text(path: Path, **kwargs: object) -> str:
    return PagedPDFReader(**kwargs).load_data(path)[0].text


def lines_of(text: str) -> Counter[str]:
    return Counter(line for line in text.split("\n") if line)


def assert_every_line_kept(pages: Sequence[Sequence[str]], text: str) -> None:
    """Every input line is a line of ``text``, as often as it was written."""
    wanted = Counter(line for lines in pages for line in lines)
    got = lines_of(text)
    missing = {line: n - got[line] for line, n in wanted.items() if got[line] < n}
    assert not missing, f"lines lost by clean-up: {missing}"


# ---- the audit's cases, as real PDFs ---------------------------------------------------------

def test_table_header_repeated_atop_each_page_is_kept(tmp_path: Path) -> None:
    header = "Fee type | Amount | When it is charged"
    pages = [
        ["Schedule of charges", header, "Annual fee | $95 | each year on the account anniversary", *filler(1, 10)],
        [header, "Late payment fee | $40 | when the minimum is not paid by the due date", *filler(2, 10)],
        [header, "Foreign transaction fee | 3% | on every purchase made abroad", *filler(3, 10)],
    ]
    text = read_text(write_lines(tmp_path / "fees.pdf", pages))
    assert_every_line_kept(pages, text)


def test_clause_repeated_at_page_edges_is_kept(tmp_path: Path) -> None:
    clause = "The Customer may cancel this agreement at any time without penalty."
    pages = [filler(1, 12), [clause, *filler(2, 12)], [*filler(3, 12), clause]]
    text = read_text(write_lines(tmp_path / "clause.pdf", pages))
    assert text.count(clause) == 2
    assert_every_line_kept(pages, text)


def test_article_headings_one_per_page_are_kept_with_their_sections(tmp_path: Path) -> None:
    titles = ["Definitions", "Fees", "Termination", "Governing law"]
    pages = [[f"ARTICLE {n}", title, *filler(n, 8)] for n, title in enumerate(titles, 1)]
    path = write_lines(tmp_path / "articles.pdf", pages)
    doc = PagedPDFReader().load_data(path)[0]
    assert_every_line_kept(pages, doc.text)
    nodes = SectionWindowNodeParser(chunk_size=120, chunk_overlap=0).get_nodes_from_documents([doc])
    paths = {tuple(n.metadata["section_path"]) for n in nodes}
    assert {("ARTICLE 1",), ("ARTICLE 2",), ("ARTICLE 3",), ("ARTICLE 4",)} <= paths
    assert () not in paths  # no chunk lost its section


def test_year_per_page_and_numbers_following_the_page_are_kept(tmp_path: Path) -> None:
    years = (2019, 2020, 2021, 2022)
    pages = [[str(y), f"In {y} the bank opened {y - 2000} new branches.", *filler(y, 6)] for y in years]
    text = read_text(write_lines(tmp_path / "years.pdf", pages))
    assert_every_line_kept(pages, text)


def test_slide_titles_and_a_bullet_on_two_slides_are_kept(tmp_path: Path) -> None:
    bullet = "Customer churn fell to 3% after the new fee schedule"
    pages = [
        ["Q1 results", bullet, "Deposits grew strongly"],
        ["Q2 results", "New branches opened in Leeds", "Mortgage book stable"],
        ["Q3 results", bullet, "Card spend up in all regions"],
        ["Q4 results", "Outlook for next year", "Dividend maintained"],
    ]
    text = read_text(write_lines(tmp_path / "slides.pdf", pages))
    assert_every_line_kept(pages, text)


def test_one_invoice_per_page_keeps_its_number(tmp_path: Path) -> None:
    items = ["Plumbing repair at 4 Elm Street", "Annual boiler service", "Replacement of kitchen tap",
             "Drain unblocking"]
    pages = [
        [f"Invoice number 10{n:02d}", f"Description: {item}", "Payment within thirty days of the invoice date.",
         "Thank you for your business."]
        for n, item in enumerate(items, 1)
    ]
    text = read_text(write_lines(tmp_path / "invoices.pdf", pages))
    assert_every_line_kept(pages, text)


def test_monthly_statements_keep_their_period(tmp_path: Path) -> None:
    pages = [
        [f"Statement period: {m:02d}/2024", "Opening balance and card purchases for the month are listed below.",
         f"Purchases this month: groceries, fuel and travel ({m * 7} items)", "Closing balance carried forward."]
        for m in range(1, 13)
    ]
    text = read_text(write_lines(tmp_path / "statements.pdf", pages))
    assert_every_line_kept(pages, text)


@pytest.mark.parametrize(
    "lines",
    [
        ["Invoice 4411 for consulting services", "Hours worked: 12 at $95 per hour", "Total due in USD", "1140"],
        ["2024", "Annual statement of the savings account", "Interest paid this year was modest."],
        ["Recipe: butter scones", "Flour, sugar, butter and milk; cups of milk:", "1/2"],
        ["Shirt sizes in stock for the spring order", "Largest size available", "XL"],
    ],
    ids=["total", "year", "fraction", "roman-size"],
)
def test_one_page_keeps_a_bare_number_that_is_not_page_1(tmp_path: Path, lines: list[str]) -> None:
    text = read_text(write_lines(tmp_path / "one.pdf", [lines]))
    assert_every_line_kept([lines], text)


@pytest.mark.parametrize("footer", ["1", "Page 1", "1 of 1", "- 1 -", "i"])
def test_one_page_drops_its_page_1_line(tmp_path: Path, footer: str) -> None:
    body = ["Annual statement of the savings account", "Interest paid this year was modest."]
    text = read_text(write_lines(tmp_path / "one.pdf", [[*body, footer]]))
    assert text.split("\n") == body


def test_running_header_and_page_footer_still_go(tmp_path: Path) -> None:
    pages = [["Northwind Bank - Account Terms", *filler(p, 8), f"Page {p} of 4"] for p in range(1, 5)]
    text = read_text(write_lines(tmp_path / "terms.pdf", pages))
    assert "Northwind Bank - Account Terms" not in text and "Page 2 of 4" not in text
    assert_every_line_kept([filler(p, 8) for p in range(1, 5)], text)


def test_bundled_sample_pdf_loses_only_its_header_and_page_footers(sample_pdf: Path) -> None:
    raw = [page.extract_text() for page in PdfReader(str(sample_pdf)).pages]
    header = "Northwind Bank - Everyday Visa Cardholder Agreement"
    text = read_text(sample_pdf, dehyphenate=False)
    assert header not in text and "Page 2 of" not in text
    expected = [[line for line in page.split("\n")[1:-1] if line.strip()] for page in raw]
    assert all(page.split("\n")[0] == header and page.split("\n")[-1].startswith("Page ") for page in raw)
    assert lines_of(text) == Counter(" ".join(line.split()) for lines in expected for line in lines)


def test_hyphenated_compounds_at_line_ends_keep_their_hyphen(tmp_path: Path) -> None:
    lines = [
        "Cardholders who are self-", "employed must send a year-", "end statement; the well-", "known co-",
        "owner rule and the follow-", "up rule apply. Non-", "profit and state-of-the-",
        "art cases are exempt; the re-",
        "cover procedure and the pur-", "chases of the card-", "holder are listed; every cardholder is covered.",
    ]
    text = read_text(write_lines(tmp_path / "hyphens.pdf", [lines]))
    flat = " ".join(text.split())
    for compound in ["self-employed", "year-end", "well-known", "co-owner", "follow-up", "Non-profit",
                     "state-of-the-art", "re-cover"]:
        assert compound in flat, compound
    assert "purchases" in flat  # a known word, not a compound: joined
    assert "of the cardholder are" in flat  # not in the vocabulary, but written closed by the document
    assert "-" not in read_text(write_lines(tmp_path / "plain.pdf", [["the pur-", "chases"]]))


# ---- pure functions: examples ----------------------------------------------------------------

def test_line_classes() -> None:
    assert reads_like_content("The Customer may cancel.") and reads_like_content("Is it due?")
    assert reads_like_content('He said "stop!"') and reads_like_content("x" * (MAX_HEADER_CHARS + 1))
    assert not reads_like_content("Northwind Bank - Account Terms") and not reads_like_content("x" * MAX_HEADER_CHARS)
    assert is_keyword_heading("ARTICLE 3") and is_keyword_heading("Section 4.2 Fees") and is_keyword_heading("Part II")
    assert is_keyword_heading("Schedule A - Charges") and not is_keyword_heading("Part of the fee is refunded")
    assert not is_keyword_heading("Annual Report - Chapter 2")


def test_page_numbers_need_a_small_shared_offset() -> None:
    body = [f"Body text {w}" for w in ("one", "two", "three", "four")]
    front = [f"{b}\n{n + 7}" for n, b in enumerate(body)]  # printed page numbers 7, 8, 9, 10
    assert remove_repeated_lines(front) == body
    invoices = [f"{b}\n{n + 1001}" for n, b in enumerate(body)]  # numbers that follow the page, far off
    assert remove_repeated_lines(invoices) == invoices
    over_total = [f"{b}\nPage {n + 5} of 3" for n, b in enumerate(body)]  # a "page" beyond its total
    assert remove_repeated_lines(over_total) == over_total


def test_varying_numbers_must_stand_alone_at_a_line_end() -> None:
    body = [f"Body text {w}" for w in ("one", "two", "three", "four")]
    for template in ("Q{n} results", "Revenue in quarter {n} grew", "Statement period: {n:02d}/2024"):
        pages = [f"{template.format(n=n)}\n{b}" for n, b in enumerate(body, 1)]
        assert remove_repeated_lines(pages) == pages, template
    for template in ("Northwind Bank | {n}", "{n} | Northwind Bank", "Northwind Bank - Page {n} of 4"):
        pages = [f"{b}\n{template.format(n=n)}" for n, b in enumerate(body, 1)]
        assert remove_repeated_lines(pages) == body, template


def test_running_lines_need_three_pages_at_the_same_place() -> None:
    pages = ["Acme Corp manual\nBody one", "Acme Corp manual\nBody two"]
    assert remove_repeated_lines(pages) == pages  # two pages: never a running header
    moved = ["Acme Corp manual\nBody one\nMore\nEnd", "Body two\nAcme Corp manual\nMore\nEnd",
             "Body three\nAcme Corp manual\nMore\nEnd"]
    # Three pages, but first line on one and second line on two: a table header, not a running one.
    assert [p.split("\n")[:2] for p in remove_repeated_lines(moved, edge_lines=2)] == [
        p.split("\n")[:2] for p in moved
    ]
    same = ["Acme Corp manual\nBody one", "Acme Corp manual\nBody two", "Acme Corp manual\nBody three"]
    assert remove_repeated_lines(same) == ["Body one", "Body two", "Body three"]


def test_bad_edge_lines_is_named() -> None:
    with pytest.raises(ValueError, match="edge_lines must be >= 0, got -1"):
        remove_repeated_lines(["a"], edge_lines=-1)


def test_dehyphenate_rule() -> None:
    vocab = {"re": 1, "cover": 2, "recover": 3, "inter": 7, "est": 9, "interest": 4, "well": 5, "known": 6}
    assert dehyphenate("the inter-\nest rate", vocab) == "the interest\n rate"
    assert dehyphenate("the re-\ncover", vocab) == "the re-cover\n"  # both halves more common
    assert dehyphenate("the well-\nknown", vocab) == "the well-known\n"  # "wellknown" is unknown
    assert dehyphenate("the well-\nknown", vocab, document_words={"wellknown"}) == "the wellknown\n"
    assert dehyphenate("the inter-\nest rate", {}) == "the inter-est\n rate"  # no vocabulary: keep
    assert dehyphenate("Anglo-\nSaxon", vocab) == "Anglo-\nSaxon"
    # Words next to a hyphen (compounds, both halves of a line-end split) are no evidence.
    assert unhyphenated_words(["A Cardholder's well-known card-\nholder fee"]) == {"cardholder", "fee"}


def test_packaged_vocabulary_is_read_once_without_torch() -> None:
    assert packaged_vocabulary() is packaged_vocabulary()
    vocab = packaged_vocabulary()
    assert vocab["interest"] < vocab["recover"] and "wellknown" not in vocab
    code = (
        "import sys\n"
        "from llama_index_retrieval_kit.readers.cleanup import dehyphenate\n"
        "assert dehyphenate('the pur-\\nchases') == 'the purchases\\n'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- properties ------------------------------------------------------------------------------

WORD = st.sampled_from(["fee", "rate", "card", "Bank", "terms", "page", "total", "Q", "due", "of", "ARTICLE", "Page"])
NUMBER = st.integers(0, 2100).map(str)
TOKEN = st.one_of(WORD, WORD, NUMBER, st.sampled_from(["-", "|", "/", ":", "."]))
LINE = st.lists(TOKEN, min_size=1, max_size=9).map(" ".join)
#: Pages of short lines; the tests mix in lines from a small pool so that lines repeat across pages.
PAGES = st.lists(st.lists(LINE, min_size=1, max_size=6), min_size=1, max_size=7)


def _removed(pages: Sequence[str], out: Sequence[str]) -> list[tuple[int, str]]:
    """(page, line) of each line removed (pages keep their order, so a multiset difference)."""
    removed = []
    for page, (before, after) in enumerate(zip(pages, out)):
        left = Counter(after.split("\n"))
        for line in before.split("\n"):
            if left[line]:
                left[line] -= 1
            else:
                removed.append((page, line))
    return removed


def _key(line: str) -> str:
    """A line with spaces collapsed and every number replaced by '#' (digits aside, the same line)."""
    return re.sub(r"\d+", "#", " ".join(line.split()))


def _texts(draw_pages: list[list[str]]) -> list[str]:
    return ["\n".join(lines) for lines in draw_pages]


@settings(max_examples=300, deadline=None)
@given(pages=PAGES, pool=st.lists(LINE, min_size=1, max_size=4), data=st.data())
def test_property_content_and_headings_are_never_removed(pages: list[list[str]], pool: list[str], data) -> None:
    # Mix repeated pool lines in so that running lines exist; some end with '.' or are long.
    pages = [[data.draw(st.sampled_from(pool)) if data.draw(st.booleans()) else line for line in lines]
             for lines in pages]
    texts = _texts(pages)
    out = remove_repeated_lines(texts)
    for _, line in _removed(texts, out):
        assert not reads_like_content(line) and not is_keyword_heading(line), line
        assert len(" ".join(line.split())) <= MAX_HEADER_CHARS
        assert not line.rstrip().endswith((".", "!", "?"))


@settings(max_examples=300, deadline=None)
@given(pages=PAGES, pool=st.lists(LINE, min_size=1, max_size=4), share=st.sampled_from([0.3, 0.5, 0.8]), data=st.data())
def test_property_a_removed_line_is_a_page_number_or_on_enough_pages(
    pages: list[list[str]], pool: list[str], share: float, data
) -> None:
    pages = [[data.draw(st.sampled_from(pool)) if data.draw(st.booleans()) else line for line in lines]
             for lines in pages]
    texts = _texts(pages)
    out = remove_repeated_lines(texts, min_share=share)
    need = max(MIN_RUNNING_PAGES, math.ceil(share * len(texts)))
    for page, line in _removed(texts, out):
        value = page_number_value(line)
        if len(texts) == 1:
            assert value == 1, line  # one page: only "page 1" goes
            continue
        if value is not None and abs(value - page) <= MAX_PAGE_OFFSET:
            continue  # a page number
        key = _key(line)
        on_pages = {p for p, t in enumerate(texts) if any(_key(x) == key for x in t.split("\n"))}
        assert len(on_pages) >= need, (line, on_pages)


@settings(max_examples=200, deadline=None)
@given(pages=PAGES, line=LINE, where=st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=2))
def test_property_a_line_on_fewer_than_three_pages_is_never_a_running_header(
    pages: list[list[str]], line: str, where: list[tuple[int, bool]]
) -> None:
    assume(page_number_value(line) is None)
    assume(not any(_key(x) == _key(line) for lines in pages for x in lines))
    targets = {p % len(pages): top for p, top in where}
    assume(len(targets) <= 2)
    for p, top in targets.items():
        pages[p] = [line, *pages[p]] if top else [*pages[p], line]
    out = remove_repeated_lines(_texts(pages))
    for p in targets:
        assert line in out[p].split("\n")


WORDS_LINE = st.lists(WORD, min_size=1, max_size=6).map(" ".join)


@settings(max_examples=200, deadline=None)
@given(body=st.lists(st.lists(WORDS_LINE, min_size=1, max_size=4), min_size=2, max_size=8), offset=st.integers(0, 60))
def test_property_page_numbers_go_only_with_a_small_offset(body: list[list[str]], offset: int) -> None:
    texts = ["\n".join([*lines, str(page + offset)]) for page, lines in enumerate(body)]
    out = remove_repeated_lines(texts)
    kept = [str(page + offset) in t.split("\n") for page, t in enumerate(out)]
    assert kept == [offset > MAX_PAGE_OFFSET] * len(body)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("abcdeinorstuwy- \n\t")), max_size=80),
    vocab=st.dictionaries(st.text(alphabet="abcdeinorstuwy", min_size=2, max_size=8), st.integers(0, 50), max_size=20),
)
def test_property_dehyphenate_only_removes_hyphens_and_moves_line_breaks(text: str, vocab: dict[str, int]) -> None:
    out = dehyphenate(text, vocab)
    assert [c for c in out if c not in "- \t\n"] == [c for c in text if c not in "- \t\n"]
    assert out.count("\n") == text.count("\n") and out.count("-") <= text.count("-")
    assert dehyphenate(text, {}).count("-") == text.count("-")  # no vocabulary: every hyphen stays
