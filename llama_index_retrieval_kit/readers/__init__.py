"""Readers that keep page numbers and character offsets."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "DocumentReadError": ".base",
    "FileReadError": ".base",
    "ReadFailure": ".base",
    "folder_doc_id": ".base",
    "PagedPDFReader": ".pdf",
    "DocumentFolderReader": ".text",
    "MarkdownReader": ".text",
    "TextFileReader": ".text",
}

__all__ = [
    "PagedPDFReader",
    "TextFileReader",
    "MarkdownReader",
    "DocumentFolderReader",
    "DocumentReadError",
    "FileReadError",
    "ReadFailure",
    "folder_doc_id",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .base import DocumentReadError, FileReadError, ReadFailure, folder_doc_id
    from .pdf import PagedPDFReader
    from .text import DocumentFolderReader, MarkdownReader, TextFileReader
