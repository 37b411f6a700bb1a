"""Ingestion job: files -> Documents -> section-aware chunks, with a JSONL and a summary."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, List, Literal, Sequence

from llama_index.core.schema import BaseNode, Document

from ._files import atomic_writer, check_replaceable
from .node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from .readers import DocumentReadError, ReadFailure
from .readers.base import FileReader, absolute_path, default_doc_id, folder_doc_id, id_clashes
from .readers.text import DocumentFolderReader

logger = logging.getLogger(__name__)

ParserName = Literal["window", "hierarchy"]
PARSERS: tuple[str, ...] = ("window", "hierarchy")


@dataclass
class IngestResult:
    """What an ingestion produced: documents, chunks, and the files that failed."""

    documents: List[Document]
    nodes: List[BaseNode]
    failures: List[ReadFailure] = field(default_factory=list)

    def summary_rows(self) -> list[dict]:
        """One row per document: chunks, sections, pages, characters."""
        per_doc = Counter(n.metadata["doc_id"] for n in self.nodes)
        sections = {}
        for n in self.nodes:
            sections.setdefault(n.metadata["doc_id"], set()).add(tuple(n.metadata["section_path"]))
        return [
            {
                "doc_id": d.id_,
                "chars": len(d.text),
                "pages": len(d.metadata.get("page_starts") or [0]),
                "sections": len(sections.get(d.id_, ())),
                "chunks": per_doc.get(d.id_, 0),
            }
            for d in self.documents
        ]


def make_parser(name: str, chunk_size: int | None = None, chunk_overlap: int | None = None) -> SectionWindowNodeParser | SectionHierarchyNodeParser:
    """A parser by name, with optional sizes (children's sizes for ``hierarchy``)."""
    if name == "window":
        kwargs = {k: v for k, v in (("chunk_size", chunk_size), ("chunk_overlap", chunk_overlap)) if v is not None}
        return SectionWindowNodeParser(**kwargs)
    if name == "hierarchy":
        kwargs = {
            k: v for k, v in (("child_chunk_size", chunk_size), ("child_chunk_overlap", chunk_overlap)) if v is not None
        }
        return SectionHierarchyNodeParser(**kwargs)
    raise ValueError(f"unknown parser {name!r}; choose one of {', '.join(PARSERS)}")


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files named directly plus the readable files inside named folders."""
    return [path for path, _ in files_with_ids(paths)]


def files_with_ids(
    paths: Iterable[str | Path],
    doc_id_func: Callable[[Path], str] | None = None,
    folder_reader: DocumentFolderReader | None = None,
) -> list[tuple[Path, str]]:
    """Every file to read with its document id.

    Default ids (see ``readers.base``): a file named directly is its file name; a file found in
    a named folder is its path relative to that folder (``clientA/terms.md``). ``doc_id_func``
    (path -> id) replaces both. ``folder_reader`` lists the files of a folder (default:
    ``DocumentFolderReader()``, recursive).
    """
    reader = folder_reader or DocumentFolderReader()
    out: list[tuple[Path, str]] = []
    seen: set[tuple[str, str]] = set()
    for p in paths:
        p = Path(p)
        if p.is_dir():
            ids = doc_id_func or folder_doc_id(p)
            found = [(f, ids(f)) for f in reader.files_in(p)]
        else:
            found = [(p, (doc_id_func or default_doc_id)(p))]
        for f, doc_id in found:  # the same file named twice is read once
            key = (absolute_path(f), doc_id)
            if key not in seen:
                seen.add(key)
                out.append((f, doc_id))
    return out


def read_documents(
    paths: Sequence[str | Path],
    show_progress: bool = False,
    doc_id_func: Callable[[Path], str] | None = None,
    reader: FileReader | None = None,
) -> tuple[list[Document], list[ReadFailure]]:
    """Read every file; bad files are reported, never fatal for the others.

    Document ids: see :func:`files_with_ids`. Two files with one id are an error naming both
    (read their common parent folder instead, or pass ``doc_id_func``). ``reader`` reads each
    file (default: ``DocumentFolderReader()``, which picks the PDF, Markdown or text reader by
    suffix); a ``DocumentFolderReader`` given here also lists the folders' files (its
    ``recursive``), any other reader reads every file found in them.
    """
    reader = reader or DocumentFolderReader()
    folder_reader = reader if isinstance(reader, DocumentFolderReader) else None
    files = files_with_ids(paths, doc_id_func, folder_reader)
    clashes = id_clashes(files)
    if clashes:
        raise ValueError(
            "these files would get the same document id, and one would replace the other: "
            + "; ".join(f"{doc_id!r}: {', '.join(str(p) for p in ps)}" for doc_id, ps in clashes[:5])
            + ". Read their common parent folder (ids are paths relative to it) or pass doc_id_func=..."
        )
    documents: list[Document] = []
    failures: list[ReadFailure] = []
    iterable: Iterable[tuple[Path, str]] = files
    if show_progress:
        from tqdm.auto import tqdm

        iterable = tqdm(files, desc="Reading", unit="file")
    for f, doc_id in iterable:
        try:
            documents.extend(reader.load_data(f, doc_id_func=lambda _path, _id=doc_id: _id))
        except DocumentReadError as err:
            failures.extend(err.failures)
    for failure in failures:
        logger.warning("could not read %s", failure)
    return documents, failures


def ingest(
    paths: Sequence[str | Path],
    parser: SectionWindowNodeParser | SectionHierarchyNodeParser | None = None,
    show_progress: bool = False,
    reader: FileReader | None = None,
) -> IngestResult:
    """Read ``paths`` (files or folders) with ``reader`` (see :func:`read_documents`; e.g.
    ``DocumentFolderReader(remove_headers_footers=False)``) and chunk them."""
    parser = parser or SectionWindowNodeParser()
    documents, failures = read_documents(paths, show_progress=show_progress, reader=reader)
    nodes = parser.get_nodes_from_documents(documents, show_progress=show_progress)
    return IngestResult(documents, nodes, failures)


#: The keys of each line :func:`write_chunks_jsonl` writes.
CHUNK_LINE_KEYS = frozenset({"id", "text", "metadata"})
#: Characters of a file's first line read to tell whether it is a chunks file.
_CHUNK_LINE_MAX_CHARS = 1 << 24


def is_chunks_jsonl(path: str | Path) -> bool:
    """Whether ``path`` holds chunks written by :func:`write_chunks_jsonl`: its first line is a
    JSON object with exactly the keys ``id``, ``text`` and ``metadata``."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.readline(_CHUNK_LINE_MAX_CHARS))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and set(data) == CHUNK_LINE_KEYS


def check_chunks_target(path: str | Path, overwrite: bool = False) -> None:
    """Refuse (ValueError) a folder, or a path holding something other than a chunks file (a
    document, a dataset) unless ``overwrite``: :func:`write_chunks_jsonl` would replace it."""
    check_replaceable(path, is_chunks_jsonl, "a chunks file written by rkit ingest", "overwrite=True (rkit ingest --overwrite)",
                      overwrite)


def write_chunks_jsonl(nodes: Sequence[BaseNode], path: str | Path, overwrite: bool = False) -> Path:
    """One JSON object per chunk: id, text and metadata (for inspection and diffing).

    A chunks file written there before is replaced whole; any other existing file (e.g. one of
    the documents) is refused with a ValueError unless ``overwrite=True``."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
    path = Path(path)
    check_chunks_target(path, overwrite)
    with atomic_writer(path) as fh:  # replaced whole: a crash leaves the earlier file
        for n in nodes:
            meta = {k: v for k, v in n.metadata.items() if k != "parent_text"}
            fh.write(json.dumps({"id": n.node_id, "text": n.get_content(), "metadata": meta}, ensure_ascii=False) + "\n")
    return path
