"""Node ids two documents would share: found before a write and refused, saying what to change.

This package's parsers name a chunk ``uuid5(doc_id|kind|start|end)`` (deterministic from the
document id and the span, so that indexing a document again replaces its chunks), where
``doc_id`` is ``metadata["doc_id"]``, else the Document id. Two Documents with different ids but
one ``metadata["doc_id"]`` (one Document per page of a report, say) therefore give their chunks
with equal spans the same id. Every store replaces nodes by id, so writing the second document
would silently replace the first one's chunk: the parsers, :class:`~.bm25.BM25Retriever` and
``HybridIndex`` refuse such a write with :class:`ChunkIdConflictError` instead.

Likewise two nodes with one id and one ref doc id whose ``metadata["file_path"]`` differ: two
files read under one document id. LlamaIndex's ``SimpleDirectoryReader(recursive=True)`` calls a
reader once per file, so this package's readers give ``a/terms.md`` and ``b/terms.md`` the same id
(the file name) unless the reader has ``doc_id_func=`` (``folder_doc_id(folder)``).

A node without a ref doc id belongs to no document: it conflicts with nothing and replaces the
node with its id (LlamaIndex's convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence

from llama_index.core.schema import BaseNode

#: Conflicts named in an error message (the error's ``conflicts`` holds them all).
SHOWN_CONFLICTS = 10


@dataclass(frozen=True)
class ChunkIdConflict:
    """One node id claimed by two documents."""

    chunk_id: str
    indexed_doc: str  # the document that holds the id (or gave it first in the same batch)
    incoming_doc: str  # the document whose node would take it over
    metadata_doc_id: Optional[str] = None  # metadata["doc_id"] of the incoming node, when it has one
    indexed_file: Optional[str] = None  # metadata["file_path"] of the first node, when known
    incoming_file: Optional[str] = None  # metadata["file_path"] of the incoming node, when it has one

    @property
    def two_files(self) -> bool:
        """Whether the two nodes were read from two different files."""
        return self.indexed_file is not None and self.incoming_file is not None and self.indexed_file != self.incoming_file


class ChunkIdConflictError(ValueError):
    """A write would give one node id to two documents, silently replacing one document's chunk."""

    def __init__(self, conflicts: Sequence[ChunkIdConflict]) -> None:
        self.conflicts = list(conflicts)
        lines = "\n".join(_describe(c) for c in self.conflicts[:SHOWN_CONFLICTS])
        more = f"\n  ... and {len(self.conflicts) - SHOWN_CONFLICTS} more" if len(self.conflicts) > SHOWN_CONFLICTS else ""
        hint = TWO_FILES_HINT if any(c.two_files for c in self.conflicts) else ""
        super().__init__(
            f"{len(self.conflicts)} chunk id(s) would belong to two documents, and writing them would silently "
            f"replace one document's chunk with the other's; nothing was written:\n{lines}{more}\n"
            "Chunk ids derive from metadata['doc_id'] (the Document id when it has none) and the chunk's span: "
            "give each Document its own metadata['doc_id'], or drop metadata['doc_id'] so that the Document id "
            f"is used (nodes made another way: give them distinct node ids){hint}"
        )


#: What to do when two files were read under one document id (the usual cause: SimpleDirectoryReader).
TWO_FILES_HINT = (
    ".\nTwo files were read under one document id. LlamaIndex's SimpleDirectoryReader reads each file "
    "with its own load_data call, so this package's readers give same-named files in different folders "
    "the same id (the file name), and SimpleDirectoryReader(filename_as_id=True) changes only Document.id_ "
    "after the reader ran, not metadata['doc_id']. Give the reader doc_id_func= (path -> id), e.g. "
    "ids relative to the folder: MarkdownReader(doc_id_func=folder_doc_id('docs')) with "
    "`from llama_index_retrieval_kit.readers import folder_doc_id`, or read the folder with "
    "read_documents / DocumentFolderReader (ids are paths relative to the folder)"
)


def _describe(conflict: ChunkIdConflict) -> str:
    shared = f" (both with metadata['doc_id']={conflict.metadata_doc_id!r})" if conflict.metadata_doc_id is not None else ""
    if conflict.two_files:
        return (
            f"  - chunk id {conflict.chunk_id!r}: of document {conflict.indexed_doc!r} read from {conflict.indexed_file} "
            f"and of document {conflict.incoming_doc!r} read from {conflict.incoming_file}{shared}"
        )
    return f"  - chunk id {conflict.chunk_id!r}: of document {conflict.indexed_doc!r} and of document {conflict.incoming_doc!r}{shared}"


def _no_owner(node_id: str) -> Optional[str]:
    return None


def chunk_id_conflicts(
    incoming: Iterable[BaseNode],
    owner_of: Callable[[str], Optional[str]] = _no_owner,
    replaced_docs: Collection[str] = (),
) -> List[ChunkIdConflict]:
    """Every node id of ``incoming`` that two documents would share.

    (a) Nodes of two different ref docs in ``incoming`` with one id, or of one ref doc but read
    from two files (their ``metadata["file_path"]`` differ); (b) an incoming node whose id
    is already held by another document: ``owner_of(node_id)`` is the ref doc id of the indexed
    node with that id (None: not indexed, or a node of no document), unless that document is in
    ``replaced_docs`` (the write removes all its nodes). Nodes without a ref doc id are skipped.
    """
    first: Dict[str, tuple[str, Optional[str]]] = {}
    conflicts: List[ChunkIdConflict] = []
    for node in incoming:
        ref = node.ref_doc_id
        if ref is None:
            continue
        node_id = node.node_id
        file = _file_path(node)
        earlier = first.get(node_id)
        if earlier is not None:
            earlier_ref, earlier_file = earlier
            conflict = ChunkIdConflict(node_id, earlier_ref, ref, _metadata_doc_id(node), earlier_file, file)
            if earlier_ref != ref or conflict.two_files:
                conflicts.append(conflict)
            elif earlier_file is None and file is not None:  # the first file named for this id
                first[node_id] = (ref, file)
            continue
        first[node_id] = (ref, file)
        owner = owner_of(node_id)
        if owner is not None and owner != ref and owner not in replaced_docs:
            conflicts.append(ChunkIdConflict(node_id, owner, ref, _metadata_doc_id(node)))
    return conflicts


def check_chunk_ids(
    incoming: Iterable[BaseNode],
    owner_of: Callable[[str], Optional[str]] = _no_owner,
    replaced_docs: Collection[str] = (),
) -> None:
    """Raise :class:`ChunkIdConflictError` when :func:`chunk_id_conflicts` finds any."""
    conflicts = chunk_id_conflicts(incoming, owner_of, replaced_docs)
    if conflicts:
        raise ChunkIdConflictError(conflicts)


def _metadata_doc_id(node: BaseNode) -> Optional[str]:
    value = node.metadata.get("doc_id")
    return value if isinstance(value, str) else None


def _file_path(node: BaseNode) -> Optional[str]:
    value = node.metadata.get("file_path")
    return value if isinstance(value, str) and value else None
