"""DocumentFolderReader: PDF options reach the PDF reader, unknown options are refused, and
files of unsupported types are named, never skipped silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pypdf import PdfWriter

from llama_index_retrieval_kit.components import component_from_dict, component_to_dict
from llama_index_retrieval_kit.ingest import read_documents
from llama_index_retrieval_kit.pipeline import PipelineConfig, PipelineConfigError, make_reader
from llama_index_retrieval_kit.readers import DocumentFolderReader, PagedPDFReader, TextFileReader
from llama_index_retrieval_kit.readers.base import FileReader
from llama_index_retrieval_kit.readers.text import PDF_OPTIONS
from llama_index_retrieval_kit.samples.pdf_writer import write_pdf

HEADER = "Northwind Bank Running Header"
BODY = "The annual fee is $95, charged on the first statement after the account is opened. " * 3


def _pdf_with_running_header(path: Path) -> Path:
    blocks = [("h1", "1. Fees"), ("p", BODY), ("pagebreak", ""), ("h1", "2. Interest"), ("p", BODY),
              ("pagebreak", ""), ("h1", "3. Disputes"), ("p", BODY)]
    return write_pdf(blocks, path, header=HEADER, title="Terms")


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PDF with a running header on each page, a Markdown file and a text file."""
    folder = tmp_path_factory.mktemp("mixed")
    _pdf_with_running_header(folder / "terms.pdf")
    (folder / "faq.md").write_text("# FAQ\nFees are charged yearly.\n", encoding="utf-8")
    (folder / "notes.txt").write_text("Late payments cost $40.\n", encoding="utf-8")
    return folder


def _by_id(docs) -> dict:
    return {d.id_: d for d in docs}


def test_pdf_options_reach_the_pdf_reader_and_other_files_are_still_read(mixed_folder: Path) -> None:
    docs, failures = read_documents([mixed_folder], reader=DocumentFolderReader(remove_headers_footers=False))
    assert failures == []
    docs = _by_id(docs)
    assert set(docs) == {"terms.pdf", "faq.md", "notes.txt"}
    assert docs["terms.pdf"].text.count(HEADER) == docs["terms.pdf"].metadata["num_pages"] == 3
    assert "Fees are charged yearly." in docs["faq.md"].text and "Late payments cost $40." in docs["notes.txt"].text
    # Each option gives what PagedPDFReader gives with it; the defaults remove the header.
    for options in ({}, {"remove_headers_footers": False}, {"dehyphenate": False, "normalize_whitespace": False}):
        folder_doc = DocumentFolderReader(**options).load_data(mixed_folder / "terms.pdf")[0]
        assert folder_doc.text == PagedPDFReader(**options).load_data(mixed_folder / "terms.pdf")[0].text, options
    assert HEADER not in DocumentFolderReader().load_data(mixed_folder / "terms.pdf")[0].text


def test_password_reaches_the_pdf_reader_and_is_not_serialised(tmp_path: Path) -> None:
    plain = _pdf_with_running_header(tmp_path / "plain.pdf")
    writer = PdfWriter(clone_from=str(plain))
    writer.encrypt(user_password="s3cret", owner_password="owner", algorithm="AES-256")
    locked = tmp_path / "locked.pdf"
    with open(locked, "wb") as fh:
        writer.write(fh)
    assert "annual fee is $95" in DocumentFolderReader(password="s3cret").load_data(locked)[0].text
    _, failures = read_documents([locked], reader=DocumentFolderReader())
    assert [f.reason for f in failures] == ["encrypted PDF: pass password=... to PagedPDFReader"]
    reader = DocumentFolderReader(password="s3cret", remove_headers_footers=False)
    assert "password" not in reader.to_dict() and "password" not in component_to_dict(reader)


def test_folder_reader_mirrors_every_pdf_option() -> None:
    """The folder reader has each PagedPDFReader option, with the same type, default and constraints."""
    pdf_options = [name for name in PagedPDFReader.model_fields if name not in FileReader.model_fields]
    assert sorted(PDF_OPTIONS) == sorted(pdf_options), "a PagedPDFReader option is missing from DocumentFolderReader"
    for name in pdf_options:
        ours, theirs = DocumentFolderReader.model_fields[name], PagedPDFReader.model_fields[name]
        assert (ours.annotation, ours.default, ours.metadata, ours.exclude) == (
            theirs.annotation, theirs.default, theirs.metadata, theirs.exclude
        ), name
        assert ours.description == f"PDF files: {theirs.description}"


def test_bad_values_and_unknown_options_are_refused() -> None:
    with pytest.raises(TypeError, match=r"DocumentFolderReader got unknown option\(s\) 'remove_header'; allowed: recursive, .*remove_headers_footers"):
        DocumentFolderReader(remove_header=False)
    with pytest.raises(TypeError, match=r"TextFileReader got unknown option\(s\) 'remove_headers_footers'; allowed: encoding, normalize_whitespace"):
        TextFileReader(remove_headers_footers=False)
    with pytest.raises(ValueError, match="header_footer_min_share"):
        DocumentFolderReader(header_footer_min_share=1.5)


def test_round_trips_through_dicts_and_a_pipeline_config(mixed_folder: Path) -> None:
    reader = DocumentFolderReader(recursive=False, remove_headers_footers=False, dehyphenate=False)
    assert DocumentFolderReader.from_dict(reader.to_dict()) == reader
    data = component_to_dict(reader)
    assert data["component"] == "document_folder" and data["remove_headers_footers"] is False
    assert component_from_dict(data) == reader

    config = PipelineConfig.from_dict({"reader": {"component": "document_folder", "remove_headers_footers": False}})
    built = make_reader(config)
    assert isinstance(built, DocumentFolderReader) and built.remove_headers_footers is False
    assert PipelineConfig.from_dict(config.to_dict()).reader.options == {"remove_headers_footers": False}
    docs, _ = read_documents([mixed_folder], reader=built)
    assert HEADER in _by_id(docs)["terms.pdf"].text
    with pytest.raises(PipelineConfigError, match=r"unknown option 'keep_headers' .*allowed: .*remove_headers_footers"):
        PipelineConfig.from_dict({"reader": {"component": "document_folder", "keep_headers": True}})


@pytest.fixture()
def odd_folder(tmp_path: Path) -> Path:
    """Files of every kind a folder holds: supported, extensionless text, other types, hidden."""
    (tmp_path / "README").write_text("Read me: the late fee is $40.\n", encoding="utf-8")
    (tmp_path / "LICENSE").write_bytes("Copyright \u00a9 Northwind\n".encode("utf-8"))
    (tmp_path / "logo").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "latin").write_bytes("Caf\u00e9 prices".encode("latin-1"))
    (tmp_path / "guide.rst").write_text("Guide\n=====\n", encoding="utf-8")
    (tmp_path / "terms.MD").write_text("# Terms\nBody.\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "table.csv").write_text("a,b\n", encoding="utf-8")
    (tmp_path / "sub" / "notes.txt").write_text("Notes.\n", encoding="utf-8")
    (tmp_path / ".env").write_text("SECRET=1\n", encoding="utf-8")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "old.md").write_text("# Old\n", encoding="utf-8")
    return tmp_path


def test_unsupported_files_are_listed_and_extensionless_text_is_read(odd_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    listing = DocumentFolderReader().list_folder(odd_folder)
    rel = lambda paths: [p.relative_to(odd_folder).as_posix() for p in paths]  # noqa: E731
    assert rel(listing.files) == ["LICENSE", "README", "sub/notes.txt", "terms.MD"]
    assert rel(listing.unsupported) == ["guide.rst", "latin", "logo", "sub/table.csv"]
    assert rel(DocumentFolderReader(recursive=False).list_folder(odd_folder).unsupported) == ["guide.rst", "latin", "logo"]

    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.readers.text"):
        docs, failures = read_documents([odd_folder])
    assert failures == []
    assert sorted(d.id_ for d in docs) == ["LICENSE", "README", "sub/notes.txt", "terms.MD"]
    assert "late fee is $40" in _by_id(docs)["README"].text
    warned = [r.getMessage() for r in caplog.records if "unsupported types" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].endswith("skipped 4 file(s) of unsupported types (read: .pdf, .md, .markdown, .txt, .text, "
                              "and UTF-8 text without a suffix): guide.rst, latin, logo, sub/table.csv")


def test_a_folder_without_unsupported_files_logs_nothing(mixed_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.readers.text"):
        files = DocumentFolderReader().files_in(mixed_folder)
    assert [p.name for p in files] == ["faq.md", "notes.txt", "terms.pdf"]
    assert not [r for r in caplog.records if "unsupported" in r.getMessage()]


def test_ingest_takes_the_folder_reader(mixed_folder: Path) -> None:
    from llama_index_retrieval_kit.ingest import ingest

    kept = ingest([mixed_folder], reader=DocumentFolderReader(remove_headers_footers=False))
    assert any(HEADER in n.get_content() for n in kept.nodes if n.metadata["doc_id"] == "terms.pdf")
    assert not any(HEADER in n.get_content() for n in ingest([mixed_folder]).nodes)
