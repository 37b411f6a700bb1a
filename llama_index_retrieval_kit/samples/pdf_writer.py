"""Write simple structured PDFs (headings, paragraphs, running header/footer, outline).

Used to build the bundled sample PDF from its Markdown source and by the tests to make real
PDFs with known structure. Writing needs fpdf2 (``pip install 'llama-index-retrieval-kit[samples]'``);
reading PDFs (``PagedPDFReader``, pypdf) does not. fpdf2's core fonts are Latin-1, so other characters are mapped to
close ASCII equivalents first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

from .._files import write_bytes_atomic
from ..node_parser.sections import detect_headings

_ASCII = {
    "\u2014": "-", "\u2013": "-", "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
    "\u2026": "...", "\u2022": "-", "\u2265": ">=", "\u2264": "<=", "\u00a0": " ", "\u2212": "-",
}

Block = tuple[str, str]  # (kind, text): kind in h1, h2, h3, p, pagebreak


def latin1(text: str) -> str:
    """Text fpdf2's core fonts can draw."""
    text = "".join(_ASCII.get(c, c) for c in text)
    return text.encode("latin-1", "replace").decode("latin-1")


def write_pdf(
    blocks: Sequence[Block],
    path: str | Path,
    header: Optional[str] = None,
    page_numbers: bool = True,
    outline: bool = True,
    title: str = "",
    page_format: str | tuple[float, float] = "A4",
) -> Path:
    """Render ``blocks`` to ``path``; headings become outline entries when ``outline``.

    ``page_format``: an fpdf2 page format ("A3", "A4", "A5", "letter", "legal") or ``(width, height)``
    in millimetres; small pages make sections run over several pages.
    Needs fpdf2, the ``samples`` extra (:class:`~llama_index_retrieval_kit._extras.MissingExtraError` without it).
    """
    from .._extras import import_extra

    FPDF = import_extra("samples", "fpdf", "writing PDFs (samples.pdf_writer, sample_pdf, rkit demo)").FPDF

    class _PDF(FPDF):
        def header(self) -> None:  # noqa: D401 - fpdf hook
            if header:
                self.set_font("Helvetica", "I", 8)
                self.cell(0, 6, latin1(header), align="C", new_x="LMARGIN", new_y="NEXT")
                self.ln(2)

        def footer(self) -> None:
            if page_numbers:
                self.set_y(-12)
                self.set_font("Helvetica", "I", 8)
                self.cell(0, 6, f"Page {self.page_no()} of {{nb}}", align="C")

    pdf = _PDF(format=page_format)
    pdf.set_title(latin1(title))
    pdf.alias_nb_pages()
    pdf.set_auto_page_break(auto=True, margin=18)
    pdf.add_page()
    sizes = {"h1": 14, "h2": 12, "h3": 11}
    for kind, text in blocks:
        if kind == "pagebreak":
            pdf.add_page()
            continue
        if kind in sizes:
            level = int(kind[1]) - 1
            pdf.ln(2)
            if outline:
                pdf.start_section(latin1(text), level=level)
            pdf.set_font("Helvetica", "B", sizes[kind])
            pdf.multi_cell(0, 7, latin1(text), new_x="LMARGIN", new_y="NEXT")
            pdf.ln(1)
        elif kind == "p":
            pdf.set_font("Helvetica", "", 10)
            pdf.multi_cell(0, 5, latin1(text), new_x="LMARGIN", new_y="NEXT")
            pdf.ln(2)
        else:
            raise ValueError(f"unknown block kind {kind!r}; allowed: h1, h2, h3, p, pagebreak")
    out = Path(path)
    return write_bytes_atomic(out, bytes(pdf.output()))  # whole or not at all: a cut PDF would be reused


def text_to_blocks(text: str) -> list[Block]:
    """Blocks for a structured text: detected headings become h1-h3, the rest paragraphs."""
    headings = detect_headings(text)
    blocks: list[Block] = []
    pos = 0
    for h in headings:
        blocks.extend(_paragraphs(text[pos : h.start]))
        blocks.append((f"h{min(max(h.level, 1), 3)}", h.title))
        pos = h.end
    blocks.extend(_paragraphs(text[pos:]))
    return blocks


def _paragraphs(text: str) -> Iterable[Block]:
    for para in text.split("\n\n"):
        lines = [line.strip() for line in para.strip().splitlines() if line.strip()]
        if not lines:
            continue
        # Keep list items and table rows on their own lines.
        yield ("p", "\n".join(lines))
