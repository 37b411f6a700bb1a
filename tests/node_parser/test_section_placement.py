"""Where sections start: PDF outline entries at their heading line (not a later line repeating
the title), and section spans cut at the same line breaks the heading detection uses."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index_retrieval_kit import SectionHierarchyNodeParser, SectionWindowNodeParser
from llama_index_retrieval_kit.node_parser import detect_headings, split_sections
from llama_index_retrieval_kit.node_parser.sections import headings_from_outline
from llama_index_retrieval_kit.readers import PagedPDFReader

SECTIONS = ("Introduction", "Fees", "Termination")


@pytest.fixture(scope="module")
def outline_pdf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One section per page, each a bookmark; words say their page (``p2w3x1`` is on page 2).
    The "Fees" section's body has a table whose one-word column header is "Fees"."""
    from fpdf import FPDF

    pdf = FPDF(format="A4")
    pdf.set_auto_page_break(auto=False)
    for page, title in enumerate(SECTIONS, 1):
        pdf.add_page()
        pdf.set_font("Helvetica", size=11)
        pdf.start_section(title, level=0)
        pdf.cell(0, 7, title, new_x="LMARGIN", new_y="NEXT")
        for i in range(14):
            pdf.cell(0, 7, " ".join(f"p{page}w{i}x{j}" for j in range(6)) + ".", new_x="LMARGIN", new_y="NEXT")
        if title == "Fees":
            pdf.cell(0, 7, "Fees", new_x="LMARGIN", new_y="NEXT")
            pdf.cell(0, 7, f"Annual p{page}w99x0 late p{page}w99x1", new_x="LMARGIN", new_y="NEXT")
    path = tmp_path_factory.mktemp("outline") / "outline.pdf"
    pdf.output(str(path))
    return path


def test_outline_heading_is_the_first_matching_line_on_its_page(outline_pdf: Path) -> None:
    doc = PagedPDFReader().load_data(outline_pdf)[0]
    text, starts = doc.text, doc.metadata["page_starts"]
    assert [e["title"] for e in doc.metadata["outline"]] == list(SECTIONS)
    heads = headings_from_outline(text, doc.metadata["outline"], starts)
    assert [h.title for h in heads] == list(SECTIONS)
    fees = heads[1]
    assert fees.start == text.index("Fees", starts[1])  # the heading, not the table column "Fees" below it
    assert text.count("\nFees\n", starts[1]) == 1  # (the column header is there, on its own line)


@pytest.mark.parametrize(
    "parser",
    [SectionWindowNodeParser(chunk_size=40, chunk_overlap=8), SectionHierarchyNodeParser(parent_chunk_size=120, child_chunk_size=30, child_chunk_overlap=5)],
    ids=["window", "hierarchy"],
)
def test_every_chunk_is_cited_under_the_section_of_its_page(outline_pdf: Path, parser) -> None:
    doc = PagedPDFReader().load_data(outline_pdf)[0]
    nodes = parser.get_nodes_from_documents([doc])
    checked = 0
    for node in nodes:
        pages = sorted({int(w[1]) for w in node.get_content().split() if w[:1] == "p" and "w" in w and w[1].isdigit()})
        if not pages:
            continue
        checked += 1
        assert len(pages) == 1, node.get_content()  # sections never cross a page here
        assert node.metadata["section_path"] == [SECTIONS[pages[0] - 1]], node.get_content()[:60]
        assert node.metadata["page_start"] == node.metadata["page_end"] == pages[0]
    assert checked >= 10


def test_a_title_repeated_before_its_page_and_in_its_body_is_placed_at_the_heading() -> None:
    pages = ["Introduction\nFees\nsee the fees below.", "Fees\nthe table:\nFees\n$95\nmore text.", "Termination\nend."]
    text = "\n\n".join(pages)
    starts = [0, len(pages[0]) + 2, len(pages[0]) + len(pages[1]) + 4]
    outline = [{"title": t, "level": 1, "page": i} for i, t in enumerate(SECTIONS)]
    heads = headings_from_outline(text, outline, starts)
    assert [h.start for h in heads] == [0, starts[1], starts[2]]


def test_an_entry_without_its_title_in_range_is_skipped_and_the_others_stay_in_order() -> None:
    text = "Alpha\nbody a\n\nGamma\nbody g\n"
    outline = [{"title": "Alpha", "level": 1, "page": 0}, {"title": "Beta", "level": 1, "page": 0},
               {"title": "Gamma", "level": 2, "page": 0}]
    heads = headings_from_outline(text, outline, [0])
    assert [(h.title, h.level, h.start) for h in heads] == [("Alpha", 1, 0), ("Gamma", 2, text.index("Gamma"))]


# ------------------------------------------------------------------ line breaks
#: What ``str.splitlines`` breaks lines at (the heading detection's line cut).
SEPARATORS = ["\n", "\r\n", "\r", "\f", "\v", "\u2028", "\u2029", "\x85", "\x1c"]
WORD = st.text(alphabet="abcdefghij", min_size=1, max_size=6)
TITLE = st.lists(WORD, min_size=1, max_size=3).map(lambda ws: " ".join(w.capitalize() for w in ws))
SEPARATOR = st.sampled_from(SEPARATORS)
BODY_LINE = st.lists(WORD, min_size=1, max_size=5).map(" ".join)


@st.composite
def block(draw) -> tuple[str, str, str]:
    """(title, heading line with its line break, body text with its line breaks)."""
    title = draw(TITLE)
    level = draw(st.integers(1, 3))
    heading = "#" * level + " " + title + draw(SEPARATOR)
    lines = draw(st.lists(BODY_LINE, max_size=3))
    body = "".join(line + draw(SEPARATOR) for line in lines)
    return title, heading, body


@settings(max_examples=300, deadline=None)
@given(preamble=st.lists(BODY_LINE, max_size=2), blocks=st.lists(block(), min_size=1, max_size=5), seps=st.data())
def test_each_section_spans_its_heading_and_the_text_up_to_the_next(preamble, blocks, seps) -> None:
    pre = "".join(line + seps.draw(SEPARATOR) for line in preamble)
    text = pre + "".join(heading + body for _, heading, body in blocks)
    headings = detect_headings(text)
    assert [h.title for h in headings] == [title for title, _, _ in blocks]
    sections = split_sections(text, headings)
    if pre:
        assert (sections[0].title, text[sections[0].start : sections[0].end]) == ("", pre)
        sections = sections[1:]
    pos = len(pre)
    for section, (title, heading, body) in zip(sections, blocks, strict=True):
        assert section.title == title
        assert (section.start, section.end) == (pos, pos + len(heading) + len(body))
        assert text[section.start : section.heading_end].rstrip("".join(SEPARATORS)) == heading.rstrip("".join(SEPARATORS))
        assert text[section.heading_end : section.end].lstrip("".join(SEPARATORS)) == body.lstrip("".join(SEPARATORS))
        pos = section.end
    assert pos == len(text)
