"""Ingestion job: files -> Documents -> section-aware chunks, with a JSONL and a summary."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Literal, Sequence

from llama_index.core.schema import BaseNode, Document

from .node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from .readers import DocumentReadError, ReadFailure
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
    reader = DocumentFolderReader()
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        out.extend(reader.files_in(p) if p.is_dir() else [p])
    return out


def read_documents(paths: Sequence[str | Path], show_progress: bool = False) -> tuple[list[Document], list[ReadFailure]]:
    """Read every file; bad files are reported, never fatal for the others."""
    files = expand_paths(paths)
    reader = DocumentFolderReader()
    documents: list[Document] = []
    failures: list[ReadFailure] = []
    iterable: Iterable[Path] = files
    if show_progress:
        from tqdm.auto import tqdm

        iterable = tqdm(files, desc="Reading", unit="file")
    for f in iterable:
        try:
            documents.extend(reader.load_data(f))
        except DocumentReadError as err:
            failures.extend(err.failures)
    for failure in failures:
        logger.warning("could not read %s", failure)
    return documents, failures


def ingest(
    paths: Sequence[str | Path],
    parser: SectionWindowNodeParser | SectionHierarchyNodeParser | None = None,
    show_progress: bool = False,
) -> IngestResult:
    """Read ``paths`` (files or folders) and chunk them."""
    parser = parser or SectionWindowNodeParser()
    documents, failures = read_documents(paths, show_progress=show_progress)
    nodes = parser.get_nodes_from_documents(documents, show_progress=show_progress)
    return IngestResult(documents, nodes, failures)


def write_chunks_jsonl(nodes: Sequence[BaseNode], path: str | Path) -> Path:
    """One JSON object per chunk: id, text and metadata (for inspection and diffing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for n in nodes:
            meta = {k: v for k, v in n.metadata.items() if k != "parent_text"}
            fh.write(json.dumps({"id": n.node_id, "text": n.get_content(), "metadata": meta}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
