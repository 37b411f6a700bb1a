"""PDF reader on pypdf: one Document per file, with exact page offsets and the PDF outline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, List, Optional

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import Document

from .base import FileReader, FileReadError, base_metadata
from .cleanup import dehyphenate, normalize_whitespace, remove_repeated_lines

logger = logging.getLogger(__name__)

#: Pages are joined with a blank line, so a page never glues onto the next one's first word.
PAGE_SEPARATOR = "\n\n"


class PagedPDFReader(FileReader):
    """Read a PDF into one Document whose metadata maps characters to pages.

    ``metadata["page_starts"][i]`` is the offset in ``Document.text`` where page ``i + 1``
    starts, exact against the stored (cleaned) text: clean-up runs page by page before the
    pages are joined. The outline (bookmarks), when present, is kept as
    ``metadata["outline"]`` for section detection.

    Bad files raise errors that name the file: encrypted (pass ``password``), corrupt, no
    text layer (a scan: run OCR first), empty.
    """

    dehyphenate: bool = Field(default=True, description="Join words hyphenated across line ends.")
    remove_headers_footers: bool = Field(
        default=True, description="Drop running headers/footers and page numbers repeated on page edges."
    )
    header_footer_min_share: float = Field(
        default=0.5, gt=0.0, le=1.0, description="Share of pages a line must repeat on to count as header/footer."
    )
    normalize_whitespace: bool = Field(default=True, description="Collapse spaces, strip lines, limit blank lines.")
    min_chars_per_page: float = Field(
        default=5.0,
        ge=0.0,
        description="Below this average of extracted characters per page the PDF is treated as scanned "
        "(no text layer) and rejected.",
    )
    password: Optional[str] = Field(default=None, description="Password for encrypted PDFs.", exclude=True)

    @classmethod
    def class_name(cls) -> str:
        return "PagedPDFReader"

    def _read_file(self, path: Path) -> Document:
        pages, outline = self._extract(path)
        if self.remove_headers_footers:
            pages = remove_repeated_lines(pages, min_share=self.header_footer_min_share)
        if self.dehyphenate:
            pages = [dehyphenate(p) for p in pages]
        if self.normalize_whitespace:
            pages = [normalize_whitespace(p) for p in pages]
        text, page_starts = join_pages(pages)
        metadata = base_metadata(path, page_starts)
        metadata["num_pages"] = len(pages)
        if outline:
            metadata["outline"] = outline
        return Document(text=text, metadata=metadata)

    def _extract(self, path: Path) -> tuple[List[str], List[dict]]:
        from pypdf import PdfReader
        from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

        try:
            reader = PdfReader(str(path), strict=False)
        except (PdfReadError, ValueError, OSError, KeyError, TypeError) as exc:
            raise FileReadError(path, f"not a readable PDF ({type(exc).__name__}: {exc})") from exc
        if reader.is_encrypted:
            try:
                ok = reader.decrypt(self.password or "")
            except DependencyError as exc:
                raise FileReadError(path, f"encrypted PDF needs an extra package to decrypt: {exc}") from exc
            if not ok:
                hint = "the password given is wrong" if self.password else "pass password=... to PagedPDFReader"
                raise FileReadError(path, f"encrypted PDF: {hint}")
        try:
            pages = [page.extract_text() or "" for page in reader.pages]
        except FileNotDecryptedError as exc:
            raise FileReadError(path, "encrypted PDF: pass password=... to PagedPDFReader") from exc
        except Exception as exc:  # pypdf raises many types on damaged content streams
            raise FileReadError(path, f"corrupt PDF, text extraction failed ({type(exc).__name__}: {exc})") from exc
        if not pages:
            raise FileReadError(path, "PDF has no pages")
        chars = sum(len(p.strip()) for p in pages)
        if chars < self.min_chars_per_page * len(pages):
            raise FileReadError(
                path,
                f"no text layer ({chars} characters on {len(pages)} page(s)): probably a scan; "
                "run OCR first (e.g. `ocrmypdf in.pdf out.pdf`) and read the result",
            )
        return pages, _outline(reader)


def join_pages(pages: List[str]) -> tuple[str, List[int]]:
    """Join page texts; returns the text and the offset where each page starts."""
    starts: List[int] = []
    parts: List[str] = []
    pos = 0
    for i, page in enumerate(pages):
        if i:
            parts.append(PAGE_SEPARATOR)
            pos += len(PAGE_SEPARATOR)
        starts.append(pos)
        parts.append(page)
        pos += len(page)
    return "".join(parts), starts


def _outline(reader: Any) -> List[dict]:
    """Flatten the PDF outline to ``{"title", "level", "page"}`` (page 0-based)."""
    entries: List[dict] = []

    def walk(items: Any, level: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, level + 1)
                continue
            try:
                page = reader.get_destination_page_number(item)
            except Exception:  # a bookmark pointing nowhere is skipped, not fatal
                continue
            title = str(getattr(item, "title", "") or "").strip()
            if title and page is not None and page >= 0:
                entries.append({"title": title, "level": level, "page": int(page)})

    try:
        walk(reader.outline, 1)
    except Exception as exc:  # damaged outline: the text is still useful
        logger.warning("ignoring unreadable PDF outline: %s", exc)
        return []
    return entries
