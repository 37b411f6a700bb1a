"""Readers that keep page numbers and character offsets."""

from .base import DocumentReadError, FileReadError, ReadFailure
from .pdf import PagedPDFReader
from .text import DocumentFolderReader, MarkdownReader, TextFileReader

__all__ = [
    "PagedPDFReader",
    "TextFileReader",
    "MarkdownReader",
    "DocumentFolderReader",
    "DocumentReadError",
    "FileReadError",
    "ReadFailure",
]
