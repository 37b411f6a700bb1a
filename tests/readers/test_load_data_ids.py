"""One load_data call never gives two different files one document id."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llama_index_retrieval_kit.readers import DocumentFolderReader, PagedPDFReader, TextFileReader


def test_two_files_with_one_id_in_one_call_are_refused(structured_pdf: Path, tmp_path: Path) -> None:
    pdfs = []
    for folder in ("pdf_a", "pdf_b"):
        (tmp_path / folder).mkdir()
        pdfs.append(Path(shutil.copy(structured_pdf, tmp_path / folder / "terms.pdf")))
        (tmp_path / folder / "terms.txt").write_text(f"Terms of {folder}.\n", encoding="utf-8")
    texts = [p.with_suffix(".txt") for p in pdfs]
    for reader, paths in ((PagedPDFReader(), pdfs), (TextFileReader(), texts), (DocumentFolderReader(), [pdfs[0], texts[0], pdfs[1]])):
        with pytest.raises(ValueError, match=r"same document id.*'terms.pdf'|same document id.*'terms.txt'") as err:
            reader.load_data(paths)
        message = str(err.value)
        assert str(paths[0]) in message and str(paths[-1]) in message and "doc_id_func" in message
        # the same file twice is no clash; distinct ids (doc_id_func) read both files
        assert [d.doc_id for d in reader.load_data([paths[0], paths[0]])] == [paths[0].name] * 2
        docs = reader.load_data(paths, doc_id_func=lambda p: f"{p.parent.name}/{p.name}")
        assert [d.doc_id for d in docs] == [f"{p.parent.name}/{p.name}" for p in paths]
        assert [d.metadata["file_path"] for d in docs] == [str(p.resolve()) for p in paths]
