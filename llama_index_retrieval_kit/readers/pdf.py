"""PDF reader on pypdf: one Document per file, with exact page offsets and the PDF outline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, List, Optional

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import Document

from .base import FileReader, FileReadError, base_metadata
from .cleanup import dehyphenate, normalize_whitespace, remove_repeated_lines, removed_share, unhyphenated_words

logger = logging.getLogger(__name__)

#: Pages are joined with a blank line, so a page never glues onto the next one's first word.
PAGE_SEPARATOR = "\n\n"


#: Where ``remove_headers_footers=False`` goes, named in the clean-up warnings.
KEEP_LINES_HOW = (
    "PagedPDFReader or DocumentFolderReader, `rkit index --keep-headers-footers`, "
    "or `reader: {remove_headers_footers: false}` in a pipeline config"
)


class PagedPDFReader(FileReader):
    """Read a PDF into one Document whose metadata maps characters to pages.

    ``metadata["page_starts"][i]`` is the offset in ``Document.text`` where page ``i + 1``
    starts, exact against the stored (cleaned) text: clean-up runs page by page before the
    pages are joined. The outline (bookmarks), when present, is kept as
    ``metadata["outline"]`` for section detection.

    Bad files raise errors that name the file: encrypted (pass ``password``; AES needs the
    ``cryptography`` package, a dependency), corrupt, no text layer (a scan: run OCR first),
    empty. Any pypdf failure while opening, decrypting or extracting becomes such an error, so
    one bad file never stops a batch.
    """

    dehyphenate: bool = Field(
        default=True,
        description="Join words hyphenated across line ends when the joined word is known (written closed in "
        "the document, or in the packaged MiniLM vocabulary) and not better read as a compound; other "
        "hyphens stay (well-known).",
    )
    remove_headers_footers: bool = Field(
        default=True,
        description="Drop running headers/footers (the same short line at the same page edge place on at least 3 "
        "pages and header_footer_min_share of them) and page numbers; lines that read like content (over 60 "
        "characters, or ending with . ! ?) and keyword headings (ARTICLE 3) are always kept.",
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
    cleanup_warning_share: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="Log a warning naming the file when clean-up removes more than this share of its "
        "non-whitespace characters.",
    )
    password: Optional[str] = Field(default=None, description="Password for encrypted PDFs.", exclude=True)

    @classmethod
    def class_name(cls) -> str:
        return "PagedPDFReader"

    def _read_file(self, path: Path) -> Document:
        pages, outline = self._extract(path)
        pages = self._clean(path, pages)
        text, page_starts = join_pages(pages)
        metadata = base_metadata(path, page_starts)
        metadata["num_pages"] = len(pages)
        if outline:
            metadata["outline"] = outline
        return Document(text=text, metadata=metadata)

    def _clean(self, path: Path, raw: List[str]) -> List[str]:
        """The clean-up steps this reader is set to run, with a warning when they take much text."""
        pages = raw
        if self.remove_headers_footers:
            pages = remove_repeated_lines(raw, min_share=self.header_footer_min_share)
            if not any(p.strip() for p in pages):
                logger.warning(
                    "%s: header/footer removal would leave no text; keeping the pages as extracted "
                    "(keep every line with remove_headers_footers=False: %s)",
                    path,
                    KEEP_LINES_HOW,
                )
                pages = raw
        if self.dehyphenate:
            closed = unhyphenated_words(pages)
            pages = [dehyphenate(p, document_words=closed) for p in pages]
        if self.normalize_whitespace:
            pages = [normalize_whitespace(p) for p in pages]
        share = removed_share(raw, pages)
        if share > self.cleanup_warning_share:
            logger.warning(
                "%s: clean-up removed %.0f%% of the text's characters (headers/footers, page numbers); "
                "check the result, or keep every line with remove_headers_footers=False (%s)",
                path,
                100 * share,
                KEEP_LINES_HOW,
            )
        return pages

    def _extract(self, path: Path) -> tuple[List[str], List[dict]]:
        """Page texts and outline; every pypdf failure becomes a :class:`FileReadError`."""
        reader = _open_pdf(path)
        if _is_encrypted(reader, path):
            _decrypt(reader, path, self.password)
        pages = _page_texts(reader, path)
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


_PASSWORD_HINT = "encrypted PDF: pass password=... to PagedPDFReader"
_CRYPTO_HINT = (
    "encrypted PDF needs the 'cryptography' package to decrypt (AES): "
    "pip install 'pypdf[crypto]' (it is a dependency of this package; reinstall it)"
)


def _failure(path: Path, what: str, exc: BaseException) -> FileReadError:
    """A FileReadError for a pypdf failure: missing crypto package, password, or damage."""
    from pypdf.errors import DependencyError, FileNotDecryptedError

    if isinstance(exc, DependencyError):
        return FileReadError(path, f"{_CRYPTO_HINT} ({exc})")
    if isinstance(exc, FileNotDecryptedError):
        return FileReadError(path, _PASSWORD_HINT)
    return FileReadError(path, f"{what} ({type(exc).__name__}: {exc})")


def _open_pdf(path: Path) -> Any:
    """A pypdf reader for ``path`` (not yet decrypted)."""
    from pypdf import PdfReader

    try:
        return PdfReader(str(path), strict=False)
    except Exception as exc:  # pypdf raises many types (and DependencyError) on damaged/AES files
        raise _failure(path, "not a readable PDF", exc) from exc


def _is_encrypted(reader: Any, path: Path) -> bool:
    try:
        return bool(reader.is_encrypted)
    except Exception as exc:  # a damaged trailer
        raise _failure(path, "not a readable PDF", exc) from exc


def _decrypt(reader: Any, path: Path, password: Optional[str]) -> None:
    """Decrypt with ``password`` (or the empty user password); errors name what to do."""
    try:
        ok = reader.decrypt(password or "")
    except Exception as exc:
        raise _failure(path, "encrypted PDF could not be decrypted", exc) from exc
    if not ok:
        hint = "the password given is wrong" if password else "pass password=... to PagedPDFReader"
        raise FileReadError(path, f"encrypted PDF: {hint}")


def _page_texts(reader: Any, path: Path) -> List[str]:
    """The extracted text of every page."""
    try:
        return [page.extract_text() or "" for page in reader.pages]
    except Exception as exc:  # pypdf raises many types on damaged content streams
        raise _failure(path, "corrupt PDF, text extraction failed", exc) from exc


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
