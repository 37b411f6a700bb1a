"""``rkit index FOLDER``: every file is read or named (unsupported types, documents without
chunks), and ``--keep-headers-footers`` reaches the PDF reader, with or without ``--config``."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from llama_index.core.schema import Document

from llama_index_retrieval_kit.cli import EXIT_OK, EXIT_USAGE, main
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.samples.pdf_writer import write_pdf

HEADER = "Northwind Bank Running Header"
BODY = "The annual fee is $95, charged on the first statement after the account is opened. " * 3


def _run(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["-q", *argv])
    return code, buf.getvalue()


@pytest.fixture()
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    blocks = [("h1", "1. Fees"), ("p", BODY), ("pagebreak", ""), ("h1", "2. Interest"), ("p", BODY),
              ("pagebreak", ""), ("h1", "3. Disputes"), ("p", BODY)]
    write_pdf(blocks, folder / "terms.pdf", header=HEADER, title="Terms")
    (folder / "README").write_text("Read me first: late payments cost $40.\n", encoding="utf-8")
    (folder / "guide.rst").write_text("Guide\n=====\n\nInstall it.\n", encoding="utf-8")
    (folder / "logo").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (folder / ".notes.md").write_text("# Private\n", encoding="utf-8")
    return folder


def _chunk_texts(storage: Path) -> list[str]:
    with HybridIndex.load(storage) as index:
        return [n.get_content() for n in index.docstore.docs.values()]


def _doc_ids(storage: Path) -> list[str]:
    with HybridIndex.load(storage) as index:
        return index.doc_ids()


def test_index_names_skipped_files_and_keeps_headers_on_request(docs: Path, tmp_path: Path) -> None:
    storage = tmp_path / "index"
    code, out = _run("index", str(docs), "--storage", str(storage), "--keep-headers-footers")
    assert code == EXIT_OK, out
    assert f"skipped 2 file(s) of unsupported types: {docs / 'guide.rst'}, {docs / 'logo'}\n" in out
    assert _doc_ids(storage) == ["README", "terms.pdf"]
    assert any(HEADER in t for t in _chunk_texts(storage))

    rebuilt = tmp_path / "default"
    code, out = _run("index", str(docs), "--storage", str(rebuilt))
    assert code == EXIT_OK, out
    assert not any(HEADER in t for t in _chunk_texts(rebuilt))


def test_keep_headers_footers_with_a_config(docs: Path, tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text(f"reader: {{component: document_folder, paths: [{docs}]}}\nindex: {{storage_dir: {tmp_path / 'index'}}}\n", encoding="utf-8")
    code, out = _run("index", "--config", str(config), "--keep-headers-footers")
    assert code == EXIT_OK, out
    assert any(HEADER in t for t in _chunk_texts(tmp_path / "index"))

    text_only = tmp_path / "text.yaml"
    text_only.write_text(f"reader: {{component: text_file}}\nindex: {{storage_dir: {tmp_path / 'other'}}}\n", encoding="utf-8")
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        code = main(["-q", "index", str(docs / "README"), "--config", str(text_only), "--keep-headers-footers"])
    assert code == EXIT_USAGE
    assert "has no remove_headers_footers option" in buf.getvalue()


def test_index_names_documents_that_gave_no_chunks(docs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A document without indexable text (here a no-break-space-only one, which the readers
    would refuse, so it is added to what they read) is named on a build and on an update."""
    from llama_index_retrieval_kit import ingest

    read = ingest.read_documents

    def with_a_blank_document(*args, **kwargs):
        documents, failures = read(*args, **kwargs)
        return [*documents, Document(text="\u00a0\n\u00a0", id_="blank.txt")], failures

    monkeypatch.setattr(ingest, "read_documents", with_a_blank_document)
    storage = tmp_path / "index"
    for _ in ("build", "update"):
        code, out = _run("index", str(docs), "--storage", str(storage))
        assert code == EXIT_OK, out
        assert "1 document(s) gave no chunks (no text to index) and are not in the index: blank.txt\n" in out
        assert _doc_ids(storage) == ["README", "terms.pdf"]
