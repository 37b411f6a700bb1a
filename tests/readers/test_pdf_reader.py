"""PagedPDFReader on real PDFs written by the tests: pages, clean-up, outline, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from pypdf import PdfReader, PdfWriter

from llama_index_retrieval_kit import DocumentReadError, FileReadError, PagedPDFReader, TextFileReader
from llama_index_retrieval_kit.readers.cleanup import dehyphenate, normalize_whitespace, remove_repeated_lines
from llama_index_retrieval_kit.samples.pdf_writer import write_pdf


def _page_texts(doc) -> list[str]:
    starts = doc.metadata["page_starts"] + [len(doc.text)]
    return [doc.text[a:b] for a, b in zip(starts, starts[1:])]


def test_page_offsets_are_exact_and_cover_the_text(structured_pdf: Path) -> None:
    doc = PagedPDFReader().load_data(structured_pdf)[0]
    raw_pages = [p.extract_text() for p in PdfReader(str(structured_pdf)).pages]
    pages = _page_texts(doc)
    assert len(pages) == len(raw_pages) == doc.metadata["num_pages"] >= 3
    assert doc.metadata["page_starts"][0] == 0
    # Each stored page holds that page's words (and only its own first words).
    for stored, raw in zip(pages, raw_pages):
        body = "\n".join(raw.splitlines()[1:-1])  # without running header and footer
        body_words = [w for w in body.split() if w.isalpha() and len(w) > 3][-5:]
        assert body_words
        for w in body_words:
            assert w in stored
    # The "4. Disputes" section starts on page 3, as written.
    pos = doc.text.index("4. Disputes")
    assert doc.metadata["page_starts"][2] <= pos


def test_headers_footers_and_page_numbers_removed(structured_pdf: Path) -> None:
    doc = PagedPDFReader().load_data(structured_pdf)[0]
    assert "Example Bank - Cardholder Agreement" not in doc.text
    assert "Page 1 of" not in doc.text and "Page 2 of" not in doc.text
    kept = PagedPDFReader(remove_headers_footers=False).load_data(structured_pdf)[0]
    assert kept.text.count("Example Bank - Cardholder Agreement") == kept.metadata["num_pages"]


def test_outline_is_recorded(structured_pdf: Path) -> None:
    doc = PagedPDFReader().load_data(structured_pdf)[0]
    titles = [(e["title"], e["level"]) for e in doc.metadata["outline"]]
    assert ("2. Fees", 1) in titles and ("2.1 Annual Fee", 2) in titles
    disputes = next(e for e in doc.metadata["outline"] if e["title"] == "4. Disputes")
    assert disputes["page"] == 2


def test_doc_id_and_source(structured_pdf: Path) -> None:
    doc = PagedPDFReader().load_data(structured_pdf)[0]
    assert doc.id_ == doc.metadata["doc_id"] == "agreement.pdf"
    assert doc.metadata["source"] == str(structured_pdf)


def test_cleanup_functions() -> None:
    assert dehyphenate("the inter-\nest rate") == "the interest\n rate"
    assert dehyphenate("Anglo-\nSaxon") == "Anglo-\nSaxon"
    assert normalize_whitespace("a  b\t c \n\n\n\nd ") == "a b c\n\nd"
    pages = ["ACME Corp manual\nBody one\n1", "ACME Corp manual\nBody two\n2", "ACME Corp manual\nBody three\n3"]
    assert remove_repeated_lines(pages) == ["Body one", "Body two", "Body three"]


def test_dehyphenation_in_a_real_pdf(tmp_path: Path) -> None:
    path = write_pdf([("p", "The annual percentage rate applies to pur-\nchases made with the card.")], tmp_path / "h.pdf")
    assert "purchases" in PagedPDFReader().load_data(path)[0].text
    assert "pur-" in PagedPDFReader(dehyphenate=False).load_data(path)[0].text


# ---- bad input ---------------------------------------------------------------------------

def test_encrypted_pdf(structured_pdf: Path, tmp_path: Path) -> None:
    writer = PdfWriter(clone_from=str(structured_pdf))
    writer.encrypt(user_password="s3cret", algorithm="RC4-128")
    path = tmp_path / "locked.pdf"
    with open(path, "wb") as fh:
        writer.write(fh)
    with pytest.raises(DocumentReadError, match=r"locked\.pdf: encrypted PDF: pass password="):
        PagedPDFReader().load_data(path)
    with pytest.raises(DocumentReadError, match="password given is wrong"):
        PagedPDFReader(password="nope").load_data(path)
    doc = PagedPDFReader(password="s3cret").load_data(path)[0]
    assert "2.1 Annual Fee" in doc.text


def test_corrupt_pdf(tmp_path: Path) -> None:
    path = tmp_path / "broken.pdf"
    path.write_bytes(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj <<>> garbage without xref")
    with pytest.raises(DocumentReadError, match=r"broken\.pdf: (not a readable PDF|corrupt PDF|PDF has no pages)"):
        PagedPDFReader().load_data(path)


def test_scanned_pdf_without_text_layer(tmp_path: Path) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.rect(20, 20, 100, 150, style="F")  # an "image" of a page: no text
    path = tmp_path / "scan.pdf"
    pdf.output(str(path))
    with pytest.raises(DocumentReadError, match=r"scan\.pdf: no text layer .* run OCR"):
        PagedPDFReader().load_data(path)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pdf"
    empty.write_bytes(b"")
    with pytest.raises(DocumentReadError, match=r"empty\.pdf: file is empty"):
        PagedPDFReader().load_data(empty)
    with pytest.raises(DocumentReadError, match="does not exist"):
        PagedPDFReader().load_data(tmp_path / "nope.pdf")


def test_non_utf8_text(tmp_path: Path) -> None:
    path = tmp_path / "latin.txt"
    path.write_bytes("Caf\u00e9 terms".encode("latin-1"))
    with pytest.raises(DocumentReadError, match=r"latin\.txt: not valid utf-8 text .*encoding="):
        TextFileReader().load_data(path)
    assert TextFileReader(encoding="latin-1").load_data(path)[0].text == "Caf\u00e9 terms"


def test_one_bad_file_does_not_lose_the_others(structured_pdf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(b"not a pdf at all")
    with pytest.raises(DocumentReadError) as info:
        PagedPDFReader().load_data([structured_pdf, bad, structured_pdf.with_name("missing.pdf")])
    err = info.value
    assert [d.metadata["doc_id"] for d in err.documents] == ["agreement.pdf"]
    assert {Path(f.path).name for f in err.failures} == {"bad.pdf", "missing.pdf"}
    docs = PagedPDFReader().load_data([structured_pdf, bad], skip_errors=True)
    assert [d.id_ for d in docs] == ["agreement.pdf"]


def test_single_file_error_type_names_file(tmp_path: Path) -> None:
    err = FileReadError(tmp_path / "x.pdf", "why")
    assert "x.pdf" in str(err) and "why" in str(err)


def test_simple_directory_reader_uses_our_readers(structured_pdf: Path, tmp_path: Path) -> None:
    """LlamaIndex's reader contract: load_data(file, extra_info=...) - SimpleDirectoryReader must
    not skip our files, and its metadata joins ours without overriding it."""
    import shutil

    from llama_index.core import SimpleDirectoryReader

    from llama_index_retrieval_kit.readers import MarkdownReader

    folder = tmp_path / "docs"
    folder.mkdir()
    shutil.copy(structured_pdf, folder / "agreement.pdf")
    (folder / "notes.md").write_text("# Notes\n\nThe annual fee is $95.\n", encoding="utf-8")
    docs = SimpleDirectoryReader(
        str(folder), file_extractor={".pdf": PagedPDFReader(), ".md": MarkdownReader()}, raise_on_error=True
    ).load_data()
    by_name = {d.metadata["file_name"]: d for d in docs}
    assert set(by_name) == {"agreement.pdf", "notes.md"}
    pdf = by_name["agreement.pdf"]
    assert pdf.metadata["page_starts"][0] == 0 and "annual fee is $95" in pdf.text
    assert pdf.metadata["file_type"] == "application/pdf"  # SimpleDirectoryReader's extra_info kept
    assert pdf.metadata["file_path"] == str((folder / "agreement.pdf").resolve())  # ours wins
    with pytest.raises(ValueError, match="extra_info must be a dict"):
        PagedPDFReader().load_data(folder / "agreement.pdf", extra_info="nope")  # type: ignore[arg-type]
