"""Plain-text and Markdown readers with the same metadata as the PDF reader (one page), and
the folder reader that picks one of them, or the PDF reader, by file type."""

from __future__ import annotations

import codecs
import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import Document

from .base import FileReader, FileReadError, base_metadata
from .cleanup import normalize_whitespace
from .pdf import PagedPDFReader

logger = logging.getLogger(__name__)


class TextFileReader(FileReader):
    """Read a UTF-8 text file into one Document (a text file is one page)."""

    encoding: str = Field(default="utf-8", description="Text encoding of the files.")
    normalize_whitespace: bool = Field(
        default=False, description="Collapse spaces and blank lines (off: text is stored as in the file)."
    )

    @classmethod
    def class_name(cls) -> str:
        return "TextFileReader"

    def _read_file(self, path: Path) -> Document:
        text = normalize_newlines(self._decode(path, path.read_bytes()))
        if self.normalize_whitespace:
            text = normalize_whitespace(text)
        if not text.strip():
            raise FileReadError(path, "file has no text (only whitespace)")
        return Document(text=text, metadata=base_metadata(path, [0]))

    def _decode(self, path: Path, raw: bytes) -> str:
        """``raw`` as text, naming the first bad byte and what to pass instead."""
        try:
            return raw.decode(self.encoding)
        except UnicodeDecodeError as exc:
            raise FileReadError(
                path,
                f"not valid {self.encoding} text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                f"pass encoding=... (e.g. 'latin-1' or 'cp1252') to {self.class_name()}",
            ) from exc
        except LookupError as exc:
            raise FileReadError(
                path, f"unknown encoding {self.encoding!r}; pass a Python codec name such as 'utf-8' or 'latin-1'"
            ) from exc


def normalize_newlines(text: str) -> str:
    """Drop a leading byte-order mark and turn CRLF/CR into LF, copying the text only when
    something changes (a large file is not duplicated for nothing)."""
    if text.startswith("\ufeff"):
        text = text.lstrip("\ufeff")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


class MarkdownReader(TextFileReader):
    """Read a Markdown file as text; '#' headings become sections in the node parsers."""

    @classmethod
    def class_name(cls) -> str:
        return "MarkdownReader"


#: Suffixes (lower case) a folder reader reads, and the kind of file each is.
PDF_SUFFIXES = (".pdf",)
MARKDOWN_SUFFIXES = (".md", ".markdown")
TEXT_SUFFIXES = (".txt", ".text")
SUPPORTED_SUFFIXES = PDF_SUFFIXES + MARKDOWN_SUFFIXES + TEXT_SUFFIXES

#: PagedPDFReader's options, mirrored by DocumentFolderReader (same names, defaults, constraints).
PDF_OPTIONS = (
    "dehyphenate",
    "remove_headers_footers",
    "header_footer_min_share",
    "normalize_whitespace",
    "min_chars_per_page",
    "cleanup_warning_share",
    "password",
)

#: Bytes of an extensionless file checked for being UTF-8 text when a folder is listed.
TEXT_SNIFF_BYTES = 64 * 1024


def _pdf_option(name: str) -> Any:
    """PagedPDFReader's field ``name`` (default, constraints, exclusion) for the folder reader,
    its description marked as applying to PDF files: one definition of each PDF option."""
    info = copy.copy(PagedPDFReader.model_fields[name])
    info.description = f"PDF files: {info.description}"
    return info


def looks_like_utf8_text(path: Path, limit: int = TEXT_SNIFF_BYTES) -> bool:
    """Whether the first ``limit`` bytes of ``path`` are UTF-8 text: they decode (a character cut
    at ``limit`` is allowed) and hold no NUL byte (binary files do). An empty file counts as
    text (reading it then reports it as empty); an unreadable one does not."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(limit)
    except OSError:
        return False
    if b"\x00" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


@dataclass(frozen=True)
class FolderListing:
    """The files of a folder: those a :class:`DocumentFolderReader` reads, sorted, and those
    it skips because their type is not supported (hidden files are in neither)."""

    files: List[Path]
    unsupported: List[Path]


class DocumentFolderReader(FileReader):
    """Read every PDF, Markdown and text file of a folder, picking the reader by suffix.

    Suffixes (any case): ``.pdf`` (:class:`~.pdf.PagedPDFReader`, with this reader's PDF
    options), ``.md``/``.markdown`` (:class:`MarkdownReader`), ``.txt``/``.text`` and files
    without a suffix that are UTF-8 text (``README``, ``LICENSE``; :class:`TextFileReader`).
    Other files (``guide.rst``, ``logo.png``, a binary without suffix) are skipped with a
    warning naming them (:meth:`list_folder` returns them). Hidden files and folders (names
    starting with ``.``: ``.git``, ``.env``) are skipped without a word.

    The PDF options are :class:`~.pdf.PagedPDFReader`'s own (same names and defaults), e.g.
    ``DocumentFolderReader(remove_headers_footers=False)`` keeps running headers and footers;
    in a pipeline config ``reader: {component: document_folder, remove_headers_footers: false}``;
    on the command line ``rkit index --keep-headers-footers``. An option this reader does not
    have is refused (``TypeError`` naming the allowed ones).
    """

    recursive: bool = Field(default=True, description="Descend into sub-folders.")
    dehyphenate: bool = _pdf_option("dehyphenate")
    remove_headers_footers: bool = _pdf_option("remove_headers_footers")
    header_footer_min_share: float = _pdf_option("header_footer_min_share")
    normalize_whitespace: bool = _pdf_option("normalize_whitespace")
    min_chars_per_page: float = _pdf_option("min_chars_per_page")
    cleanup_warning_share: float = _pdf_option("cleanup_warning_share")
    password: Optional[str] = _pdf_option("password")

    @classmethod
    def class_name(cls) -> str:
        return "DocumentFolderReader"

    def pdf_reader(self) -> PagedPDFReader:
        """The PDF reader with this reader's PDF options."""
        return PagedPDFReader(**{name: getattr(self, name) for name in PDF_OPTIONS})

    def _read_file(self, path: Path) -> Document:
        suffix = path.suffix.lower()
        if suffix in PDF_SUFFIXES:
            return self.pdf_reader()._read_file(path)
        if suffix in MARKDOWN_SUFFIXES:
            return MarkdownReader()._read_file(path)
        if suffix in TEXT_SUFFIXES or suffix == "":
            return TextFileReader()._read_file(path)
        raise FileReadError(
            path, f"unsupported file type {suffix!r} (supported: {', '.join(SUPPORTED_SUFFIXES)}, and UTF-8 text without a suffix)"
        )

    def is_supported(self, path: Path) -> bool:
        """Whether a file found in a folder is read: a supported suffix, or no suffix and UTF-8 text."""
        suffix = path.suffix.lower()
        return suffix in SUPPORTED_SUFFIXES or (suffix == "" and looks_like_utf8_text(path))

    def list_folder(self, folder: str | Path) -> FolderListing:
        """The files of ``folder`` this reader reads and the ones it skips (unsupported types),
        both sorted; hidden files and folders (dot-names) are in neither."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FileReadError(folder, "is not a folder")
        pattern = "**/*" if self.recursive else "*"
        files: List[Path] = []
        unsupported: List[Path] = []
        for p in sorted(folder.glob(pattern)):
            if not p.is_file() or any(part.startswith(".") for part in p.relative_to(folder).parts):
                continue
            (files if self.is_supported(p) else unsupported).append(p)
        return FolderListing(files, unsupported)

    def files_in(self, folder: str | Path) -> list[Path]:
        """The readable files of ``folder``, sorted; unsupported ones are logged as a warning
        (see :meth:`list_folder`), hidden files and folders skipped."""
        folder = Path(folder)
        listing = self.list_folder(folder)
        if listing.unsupported:
            logger.warning(
                "%s: skipped %d file(s) of unsupported types (read: %s, and UTF-8 text without a suffix): %s",
                folder,
                len(listing.unsupported),
                ", ".join(SUPPORTED_SUFFIXES),
                ", ".join(p.relative_to(folder).as_posix() for p in listing.unsupported),
            )
        return listing.files
