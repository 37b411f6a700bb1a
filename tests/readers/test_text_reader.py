"""TextFileReader: newline normalisation without needless copies, clear encoding errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llama_index_retrieval_kit.readers import DocumentReadError, TextFileReader
from llama_index_retrieval_kit.readers.text import normalize_newlines


@given(st.text(alphabet="ab\r\n\ufeff ", max_size=60))
def test_normalize_newlines_matches_the_plain_replacements(text: str) -> None:
    expected = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    assert normalize_newlines(text) == expected


def test_unchanged_text_is_not_copied() -> None:
    text = "line one\nline two\n" * 1000
    assert normalize_newlines(text) is text


def test_crlf_file_is_read_with_lf(tmp_path: Path) -> None:
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"\xef\xbb\xbfFirst line\r\nSecond line\rThird")
    assert TextFileReader().load_data(path)[0].text == "First line\nSecond line\nThird"


def test_unknown_encoding_is_a_file_error_not_a_crash(tmp_path: Path) -> None:
    good, other = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("alpha")
    other.write_text("beta")
    with pytest.raises(DocumentReadError, match=r"a\.txt: unknown encoding 'utf-99'; pass a Python codec name"):
        TextFileReader(encoding="utf-99").load_data([good, other])
    assert TextFileReader(encoding="utf-99").load_data([good, other], skip_errors=True) == []


def test_an_unexpected_reader_error_never_loses_the_other_files(tmp_path, monkeypatch) -> None:
    """A reader bug on one file becomes that file's failure; the other files are still read."""
    from llama_index_retrieval_kit.readers import DocumentReadError, TextFileReader
    from llama_index_retrieval_kit.readers.text import TextFileReader as Reader

    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("Fees apply.", encoding="utf-8")
    bad.write_text("Boom.", encoding="utf-8")
    original = Reader._read_file

    def flaky(self, path):
        if path.name == "bad.txt":
            raise KeyError("surprise")
        return original(self, path)

    monkeypatch.setattr(Reader, "_read_file", flaky)
    with pytest.raises(DocumentReadError) as err:
        TextFileReader().load_data([good, bad])
    assert [d.metadata["file_name"] for d in err.value.documents] == ["good.txt"]
    assert "bad.txt" in str(err.value) and "KeyError" in str(err.value)
    assert [d.metadata["file_name"] for d in TextFileReader().load_data([good, bad], skip_errors=True)] == ["good.txt"]


def test_extra_info_values_are_copied_into_each_document(tmp_path: Path) -> None:
    """``extra_info``'s list/dict values: each document gets its own copy, so that editing one
    document's ``tags`` changes neither the caller's mapping nor the other documents."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(f"Text of {name}.")
    extra = {"tenant": "A", "tags": ["x"], "acl": {"groups": ["g1"]}}
    docs = TextFileReader().load_data([tmp_path / "a.txt", tmp_path / "b.txt"], extra_info=extra)
    docs[0].metadata["tags"].append("only-a")
    docs[0].metadata["acl"]["groups"].append("everyone")
    assert extra == {"tenant": "A", "tags": ["x"], "acl": {"groups": ["g1"]}}
    assert docs[1].metadata["tags"] == ["x"] and docs[1].metadata["acl"] == {"groups": ["g1"]}
    assert docs[0].metadata["tenant"] == docs[1].metadata["tenant"] == "A"
