"""Plain-text and Markdown readers with the same metadata as the PDF reader (one page)."""

from __future__ import annotations

from pathlib import Path

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import Document

from .base import FileReader, FileReadError, base_metadata
from .cleanup import normalize_whitespace


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


class DocumentFolderReader(FileReader):
    """Read every PDF, Markdown and text file of a folder, picking the reader by suffix."""

    recursive: bool = Field(default=True, description="Descend into sub-folders.")

    @classmethod
    def class_name(cls) -> str:
        return "DocumentFolderReader"

    def _read_file(self, path: Path) -> Document:
        from .pdf import PagedPDFReader

        suffix = path.suffix.lower()
        if suffix == ".pdf":
            return PagedPDFReader()._read_file(path)
        if suffix in (".md", ".markdown"):
            return MarkdownReader()._read_file(path)
        if suffix in (".txt", ".text", ""):
            return TextFileReader()._read_file(path)
        raise FileReadError(path, f"unsupported file type {suffix!r} (supported: .pdf, .md, .markdown, .txt)")

    def files_in(self, folder: str | Path) -> list[Path]:
        """The readable files of ``folder``, sorted, hidden files skipped."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FileReadError(folder, "is not a folder")
        pattern = "**/*" if self.recursive else "*"
        return sorted(
            p for p in folder.glob(pattern)
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
            and p.suffix.lower() in (".pdf", ".md", ".markdown", ".txt", ".text")
        )
