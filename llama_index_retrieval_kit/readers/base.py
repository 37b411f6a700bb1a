"""What every reader of this package shares: document metadata and error reporting.

Document metadata (inherited by chunk parsers, see ``docs/architecture.md``):

* ``doc_id`` - the document id (also ``Document.id_``): by default the file name for a file
  read directly, and the path relative to the folder (POSIX ``/``) for a file found in a folder
  (:func:`folder_doc_id`), so two ``terms.md`` in different sub-folders never share an id;
  ``doc_id_func=`` sets your own;
* ``source`` - the path the document was read from, as given; ``file_name``;
* ``file_path`` - the absolute path of the file (bookkeeping: ``HybridIndex.upsert`` uses it
  to refuse replacing one file's document with another file's);
* ``page_starts`` - character offset in ``Document.text`` where each page starts
  (page ``i`` spans ``[page_starts[i], page_starts[i + 1])``, pages numbered from 1 in chunks);
* ``outline`` - PDF bookmarks as ``{"title", "level", "page"}`` (page 0-based), when present.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from llama_index.core.readers.base import BasePydanticReader
from llama_index.core.schema import Document

from ..retrievers.node_copy import copy_metadata

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]

#: Document metadata keys that describe the whole document, not a chunk; parsers drop them.
DOCUMENT_ONLY_KEYS = ("page_starts", "outline", "num_pages")


@dataclass(frozen=True)
class ReadFailure:
    """One file that could not be read, and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class DocumentReadError(Exception):
    """Raised when files cannot be read; ``documents`` holds the ones that could.

    One bad file never loses the others: catch this and use ``err.documents``.
    """

    def __init__(self, failures: Sequence[ReadFailure], documents: Sequence[Document] = ()) -> None:
        self.failures = list(failures)
        self.documents = list(documents)
        lines = "\n".join(f"  - {f}" for f in self.failures)
        super().__init__(
            f"could not read {len(self.failures)} file(s)"
            + (f" ({len(self.documents)} other file(s) were read)" if self.documents else "")
            + f":\n{lines}"
        )


class FileReadError(ValueError):
    """A single file cannot be read; the message names the file and the reason."""

    def __init__(self, path: PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


def default_doc_id(path: Path) -> str:
    """The file name, for a file read directly: stable across machines and folders."""
    return path.name


def folder_doc_id(folder: Path) -> Callable[[Path], str]:
    """Ids for the files found under ``folder``: their path relative to it, with ``/``.

    ``contracts/clientA/terms.md`` read from ``contracts`` is ``clientA/terms.md``; a file
    directly in the folder keeps its bare name (the id older versions gave every file).
    """
    root = Path(folder)

    def doc_id(path: Path) -> str:
        try:
            return Path(path).relative_to(root).as_posix()
        except ValueError:
            return Path(path).name

    return doc_id


def absolute_path(path: Path) -> str:
    """``path`` made absolute (symlinks resolved where possible), as a string."""
    try:
        return str(Path(path).expanduser().resolve())
    except (OSError, RuntimeError):
        return str(Path(path).absolute())


class FileReader(BasePydanticReader):
    """Base for readers that turn one file into one Document with page offsets."""

    is_remote: bool = False

    def _read_file(self, path: Path) -> Document:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_data(
        self,
        file: Union[PathLike, Iterable[PathLike]],
        extra_info: Optional[Dict[str, Any]] = None,
        *,
        skip_errors: bool = False,
        doc_id_func: Callable[[Path], str] | None = None,
        fs: Any = None,
    ) -> List[Document]:
        """Read one file or many; one Document per file.

        LlamaIndex's reader contract: ``extra_info`` is metadata added to every Document (this
        reader's own keys - ``doc_id``, ``source``, ``file_name``, ``file_path``, pages - win on a
        clash), so ``SimpleDirectoryReader(file_extractor={".pdf": PagedPDFReader()})`` works.
        Only local files are read: a non-local ``fs`` is refused.

        A file that cannot be read raises :class:`DocumentReadError` naming every bad file,
        after all the others were read (they are in ``err.documents``). With
        ``skip_errors=True`` bad files are logged as warnings and skipped instead.
        """
        if extra_info is not None and not isinstance(extra_info, dict):
            raise ValueError(f"extra_info must be a dict of metadata or None, got {type(extra_info).__name__}")
        if fs is not None and type(fs).__name__ != "LocalFileSystem":
            raise ValueError(
                f"{self.class_name()} reads local files only; got fs={type(fs).__name__}: copy the files locally first"
            )
        paths = [Path(file)] if isinstance(file, (str, Path)) else [Path(p) for p in file]
        id_func = doc_id_func or default_doc_id
        documents: list[Document] = []
        failures: list[ReadFailure] = []
        for path in paths:
            try:
                doc = self._read_checked(path)
            except FileReadError as exc:
                failures.append(ReadFailure(str(path), exc.reason))
                continue
            except (KeyboardInterrupt, SystemExit, MemoryError):
                raise
            except Exception as exc:  # a reader bug or a library's surprise: never lose the other files
                logger.debug("reading %s failed", path, exc_info=True)
                failures.append(ReadFailure(str(path), f"could not be read ({type(exc).__name__}: {exc})"))
                continue
            doc_id = id_func(path)
            doc.id_ = doc_id
            # Each document its own copy of extra_info's values (lists, dicts): shared with neither
            # the caller nor the other documents.
            doc.metadata = {**copy_metadata(extra_info or {}), **doc.metadata}
            doc.metadata["doc_id"] = doc_id
            documents.append(doc)
        if failures:
            if not skip_errors:
                raise DocumentReadError(failures, documents)
            for f in failures:
                logger.warning("skipped %s", f)
        return documents

    def _read_checked(self, path: Path) -> Document:
        if not path.exists():
            raise FileReadError(path, "file does not exist")
        if path.is_dir():
            raise FileReadError(path, "is a folder, not a file (pass the files in it, or use read_folder)")
        if path.stat().st_size == 0:
            raise FileReadError(path, "file is empty (0 bytes)")
        return self._read_file(path)


def base_metadata(path: Path, page_starts: Sequence[int]) -> dict:
    return {
        "source": str(path),
        "file_name": path.name,
        "file_path": absolute_path(path),
        "page_starts": list(page_starts),
    }
