"""What every reader of this package shares: document metadata and error reporting.

Document metadata (inherited by chunk parsers, see ``docs/architecture.md``):

* ``doc_id`` - the document id (also ``Document.id_``): by default the file name for a file
  read directly, and the path relative to the folder (POSIX ``/``) for a file found in a folder
  (:func:`folder_doc_id`), so two ``terms.md`` in different sub-folders never share an id;
  ``doc_id_func=`` (on the reader, or on ``load_data``) sets your own. Under LlamaIndex's
  ``SimpleDirectoryReader`` every file is read by its own ``load_data`` call, so two
  ``terms.md`` would both get ``terms.md``: give the reader
  ``doc_id_func=folder_doc_id(folder)`` (the chunk parsers refuse the shared id otherwise,
  :mod:`~..retrievers.node_identity`);
* ``source`` - the path the document was read from, as given; ``file_name``;
* ``file_path`` - the absolute path of the file (bookkeeping: ``HybridIndex.upsert`` uses it
  to refuse replacing one file's document with another file's);
* ``page_starts`` - character offset in ``Document.text`` where each page starts
  (page ``i`` spans ``[page_starts[i], page_starts[i + 1])``, pages numbered from 1 in chunks);
* ``outline`` - PDF bookmarks as ``{"title", "level", "page"}`` (page 0-based), when present.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

from llama_index.core.bridge.pydantic import Field, model_validator
from llama_index.core.readers.base import BasePydanticReader
from llama_index.core.schema import Document

from .._options import unknown_options
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


@dataclass(frozen=True)
class FolderDocId:
    """Document id = path relative to ``folder`` (POSIX ``/``); the file name for a file outside it.

    A picklable callable (``SimpleDirectoryReader(num_workers=...)`` pickles its readers).
    """

    folder: Path

    def __call__(self, path: PathLike) -> str:
        file = Path(path)
        try:
            return file.relative_to(self.folder).as_posix()
        except ValueError:
            pass
        try:  # one of them spelt relative, the other absolute
            return Path(absolute_path(file)).relative_to(absolute_path(self.folder)).as_posix()
        except ValueError:
            return file.name


def folder_doc_id(folder: PathLike) -> Callable[[Path], str]:
    """Ids for the files found under ``folder``: their path relative to it, with ``/``.

    ``contracts/clientA/terms.md`` read from ``contracts`` is ``clientA/terms.md``; a file
    directly in the folder keeps its bare name (the id older versions gave every file).
    Also the remedy for ``SimpleDirectoryReader(recursive=True)``:
    ``MarkdownReader(doc_id_func=folder_doc_id("contracts"))``.
    """
    return FolderDocId(Path(folder))


def id_clashes(files: Sequence[tuple[Path, str]]) -> List[tuple[str, List[Path]]]:
    """``(id, paths)`` for every id given to more than one distinct file (the same file twice is no clash)."""
    by_id: Dict[str, List[Path]] = {}
    for path, doc_id in files:
        same = by_id.setdefault(doc_id, [])
        if all(absolute_path(path) != absolute_path(q) for q in same):
            same.append(path)
    return [(doc_id, ps) for doc_id, ps in by_id.items() if len(ps) > 1]


def absolute_path(path: Path) -> str:
    """``path`` made absolute (symlinks resolved where possible), as a string."""
    try:
        return str(Path(path).expanduser().resolve())
    except (OSError, RuntimeError):
        return str(Path(path).absolute())


#: Keys a reader's constructor accepts beyond its fields: LlamaIndex's ``to_dict()`` adds it.
SERIALISATION_KEYS = ("class_name",)


class StrictOptions:
    """Mixin for pydantic readers: a constructor keyword that is not a field is refused
    (``TypeError`` naming the allowed ones), never silently ignored (pydantic's default).
    ``class_name`` (written by ``to_dict()``) is accepted and ignored. The readers' form of
    :class:`llama_index_retrieval_kit._options.StrictOptions` (same detection, :func:`unknown_options`;
    the message lists a reader's own options first)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields  # type: ignore[attr-defined]
            unknown = unknown_options(data, [*fields, *SERIALISATION_KEYS])
            if unknown:
                raise TypeError(
                    f"{cls.__name__} got unknown option(s) {', '.join(map(repr, unknown))}; "
                    f"allowed: {', '.join(_option_names(fields))}"
                )
            data = {k: v for k, v in data.items() if k not in SERIALISATION_KEYS}
        return data


def _option_names(fields: Dict[str, Any]) -> List[str]:
    """A reader's options, its own first, then the shared ``doc_id_func`` (``is_remote`` is internal)."""
    shared = ("is_remote", "doc_id_func")
    return [name for name in fields if name not in shared] + [name for name in shared[1:] if name in fields]


class FileReader(StrictOptions, BasePydanticReader):
    """Base for readers that turn one file into one Document with page offsets."""

    is_remote: bool = False
    doc_id_func: Optional[Callable[[Path], str]] = Field(
        default=None,
        exclude=True,
        description="Document id of each file (path -> id); None: the file name. Needed under "
        "SimpleDirectoryReader(recursive=True) when two sub-folders hold files of one name: "
        "folder_doc_id(folder) gives paths relative to the folder. Not serialised (a function): "
        "pass it again after from_dict.",
    )

    def __getstate__(self) -> Dict[str, Any]:
        """Pickle state (LlamaIndex's ``SimpleDirectoryReader(...).load_data(num_workers=N)`` pickles
        readers into worker processes). LlamaIndex's own ``__getstate__`` drops an attribute it cannot
        pickle with a log line: a lambda ``doc_id_func`` would then be gone in the workers and every
        document would silently get the default id (ids that differ from a run without workers, so an
        upsert would keep both). Refused instead, saying what to pass."""
        func = self.doc_id_func
        if func is not None:
            try:
                pickle.dumps(func)
            except Exception as exc:
                raise pickle.PicklingError(
                    f"{type(self).__name__}.doc_id_func ({getattr(func, '__qualname__', func)!r}) cannot be pickled "
                    f"({type(exc).__name__}: {exc}); SimpleDirectoryReader(...).load_data(num_workers=N) pickles readers "
                    "into worker processes, where the documents would silently get the default ids. Define the "
                    "function at module level (def doc_id(path): ...), use folder_doc_id(folder), or load without "
                    "num_workers"
                ) from None
        return super().__getstate__()

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
        """Read one file or many; one Document per file (collected from :meth:`lazy_load_data`).

        LlamaIndex's reader contract: ``extra_info`` is metadata added to every Document (this
        reader's own keys - ``doc_id``, ``source``, ``file_name``, ``file_path``, pages - win on a
        clash), so ``SimpleDirectoryReader(file_extractor={".pdf": PagedPDFReader()})`` works.
        Only local files are read: a non-local ``fs`` is refused.

        A file that cannot be read raises :class:`DocumentReadError` naming every bad file,
        after all the others were read (they are in ``err.documents``). With
        ``skip_errors=True`` bad files are logged as warnings and skipped instead.

        Two different files that would get one document id (``a/terms.pdf`` and ``b/terms.pdf``
        under the default id, the file name) raise ``ValueError`` naming both before anything is
        read, as :func:`~..ingest.read_documents` does: chunks and citations of two documents under
        one id would be mixed up.
        """
        documents: list[Document] = []
        try:
            for doc in self.lazy_load_data(file, extra_info, skip_errors=skip_errors, doc_id_func=doc_id_func, fs=fs):
                documents.append(doc)
        except DocumentReadError as err:
            raise DocumentReadError(err.failures, documents) from None
        return documents

    def lazy_load_data(
        self,
        file: Union[PathLike, Iterable[PathLike]],
        extra_info: Optional[Dict[str, Any]] = None,
        *,
        skip_errors: bool = False,
        doc_id_func: Callable[[Path], str] | None = None,
        fs: Any = None,
    ) -> Iterator[Document]:
        """:meth:`load_data` one Document at a time, each yielded as soon as its file is read.

        Arguments are checked (and clashing ids refused) when this is called, before anything is
        read. A file that cannot be read does not stop the iteration: the other files are still
        yielded, then :class:`DocumentReadError` naming every bad file is raised at the end (its
        ``documents`` is empty: they were yielded already). ``skip_errors=True`` logs them instead.
        """
        if extra_info is not None and not isinstance(extra_info, dict):
            raise ValueError(f"extra_info must be a dict of metadata or None, got {type(extra_info).__name__}")
        if fs is not None and type(fs).__name__ != "LocalFileSystem":
            raise ValueError(
                f"{self.class_name()} reads local files only; got fs={type(fs).__name__}: copy the files locally first"
            )
        paths = [Path(file)] if isinstance(file, (str, Path)) else [Path(p) for p in file]
        id_func = doc_id_func or self.doc_id_func or default_doc_id
        clashes = id_clashes([(path, id_func(path)) for path in paths])
        if clashes:
            raise ValueError(
                "these files would get the same document id in one load_data call, and their chunks and "
                "citations would be mixed up: "
                + "; ".join(f"{doc_id!r}: {', '.join(str(p) for p in ps)}" for doc_id, ps in clashes[:5])
                + ". Pass doc_id_func= (path -> id), e.g. doc_id_func=lambda p: p.parent.name + '/' + p.name, "
                "read their common parent folder with read_documents (ids are paths relative to it), or read "
                "them in separate calls and give each its own id"
            )
        return self._documents(paths, id_func, extra_info, skip_errors)

    def _documents(
        self,
        paths: Sequence[Path],
        id_func: Callable[[Path], str],
        extra_info: Optional[Dict[str, Any]],
        skip_errors: bool,
    ) -> Iterator[Document]:
        """Read ``paths`` in order, yielding each Document; bad files are reported after the last."""
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
            yield doc
        if failures:
            if not skip_errors:
                raise DocumentReadError(failures)
            for f in failures:
                logger.warning("skipped %s", f)

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
