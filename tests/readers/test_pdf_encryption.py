"""Encrypted and unreadable PDFs: AES-256, a missing crypto package, odd pypdf failures.

Every failure must become a ``FileReadError`` naming the file, so one bad file never loses a
batch (``load_data([...])``, ``skip_errors=True``, the folder reader).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pypdf import PdfWriter

from llama_index_retrieval_kit.readers import DocumentFolderReader, DocumentReadError, FileReadError, PagedPDFReader
from llama_index_retrieval_kit.samples.pdf_writer import write_pdf

BODY = "The annual fee is $95, charged on the first statement after the account is opened."


@pytest.fixture(scope="module")
def plain_pdf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("aes")
    return write_pdf([("h1", "1. Fees"), ("p", BODY)], folder / "plain.pdf", title="Fees")


def _encrypt(src: Path, dest: Path, user_password: str, owner_password: str = "owner-secret") -> Path:
    writer = PdfWriter(clone_from=str(src))
    writer.encrypt(user_password=user_password, owner_password=owner_password, algorithm="AES-256")
    with open(dest, "wb") as fh:
        writer.write(fh)
    return dest


@pytest.fixture(scope="module")
def owner_only_aes(plain_pdf: Path) -> Path:
    """AES-256 with only an owner password: any viewer opens it without asking."""
    return _encrypt(plain_pdf, plain_pdf.with_name("owner_only.pdf"), user_password="")


@pytest.fixture(scope="module")
def user_password_aes(plain_pdf: Path) -> Path:
    return _encrypt(plain_pdf, plain_pdf.with_name("user_pw.pdf"), user_password="s3cret")


@pytest.fixture()
def without_crypto_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """pypdf as it behaves when neither cryptography nor pycryptodome is installed."""
    import pypdf._encryption as enc
    from pypdf._crypt_providers import _fallback

    for name in ("CryptAES", "aes_cbc_decrypt", "aes_cbc_encrypt", "aes_ecb_decrypt", "aes_ecb_encrypt"):
        monkeypatch.setattr(enc, name, getattr(_fallback, name))


def test_owner_password_only_aes_reads_without_password(owner_only_aes: Path) -> None:
    doc = PagedPDFReader().load_data(owner_only_aes)[0]
    assert "annual fee is $95" in doc.text
    assert doc.metadata["num_pages"] == 1


def test_user_password_aes_asks_for_the_password(user_password_aes: Path) -> None:
    with pytest.raises(DocumentReadError, match=r"user_pw\.pdf: encrypted PDF: pass password="):
        PagedPDFReader().load_data(user_password_aes)
    with pytest.raises(DocumentReadError, match=r"user_pw\.pdf: encrypted PDF: the password given is wrong"):
        PagedPDFReader(password="nope").load_data(user_password_aes)
    assert "annual fee is $95" in PagedPDFReader(password="s3cret").load_data(user_password_aes)[0].text


def test_missing_crypto_package_is_a_file_error(owner_only_aes: Path, without_crypto_package: None) -> None:
    with pytest.raises(FileReadError, match=r"owner_only\.pdf: .*needs the 'cryptography' package"):
        PagedPDFReader()._read_checked(owner_only_aes)


def test_missing_crypto_package_does_not_lose_the_batch(
    plain_pdf: Path, owner_only_aes: Path, without_crypto_package: None, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(DocumentReadError) as info:
        PagedPDFReader().load_data([plain_pdf, owner_only_aes])
    assert [Path(f.path).name for f in info.value.failures] == ["owner_only.pdf"]
    assert [d.id_ for d in info.value.documents] == ["plain.pdf"]
    with caplog.at_level(logging.WARNING):
        docs = PagedPDFReader().load_data([owner_only_aes, plain_pdf], skip_errors=True)
    assert [d.id_ for d in docs] == ["plain.pdf"]
    assert "owner_only.pdf" in caplog.text and "cryptography" in caplog.text
    folder_docs = DocumentFolderReader().load_data([owner_only_aes, plain_pdf], skip_errors=True)
    assert [d.id_ for d in folder_docs] == ["plain.pdf"]


def test_unsupported_encryption_handler_is_a_file_error(plain_pdf: Path, owner_only_aes: Path, tmp_path: Path) -> None:
    # pypdf raises NotImplementedError from its constructor for a non-standard handler.
    odd = tmp_path / "odd_handler.pdf"
    odd.write_bytes(owner_only_aes.read_bytes().replace(b"/Filter /Standard", b"/Filter /Foobar12"))
    with pytest.raises(DocumentReadError, match=r"odd_handler\.pdf: not a readable PDF \(NotImplementedError"):
        PagedPDFReader().load_data(odd)
    docs = PagedPDFReader().load_data([odd, plain_pdf], skip_errors=True)
    assert [d.id_ for d in docs] == ["plain.pdf"]


@pytest.mark.parametrize("stage", ["open", "decrypt", "extract"])
def test_any_pypdf_exception_becomes_a_file_error(
    stage: str, plain_pdf: Path, owner_only_aes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pypdf

    def boom(*args: object, **kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded while parsing")

    target = {"open": (pypdf.PdfReader, "read"), "decrypt": (pypdf.PdfReader, "decrypt"),
              "extract": (pypdf.PageObject, "extract_text")}[stage]
    monkeypatch.setattr(*target, boom)
    path = owner_only_aes if stage == "decrypt" else plain_pdf
    with pytest.raises(DocumentReadError, match=rf"{path.name}: .*RecursionError"):
        PagedPDFReader().load_data(path)
    assert PagedPDFReader().load_data([path], skip_errors=True) == []
