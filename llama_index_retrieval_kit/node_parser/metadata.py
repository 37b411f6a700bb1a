"""The chunk metadata contract (see docs/architecture.md) and deterministic node ids."""

from __future__ import annotations

import bisect
import uuid
from typing import Any, Sequence

from ..readers.base import DOCUMENT_ONLY_KEYS
from ..retrievers.node_copy import copy_metadata

#: Namespace for chunk ids: uuid5(namespace, "doc_id|kind|start|end").
CHUNK_ID_NAMESPACE = uuid.UUID("6f1c8a52-3f0e-4c1b-9a55-5f3f1d6c2b10")

#: Keys that are bookkeeping: never embedded, never shown to the LLM.
BOOKKEEPING_KEYS = (
    "doc_id",
    "chunk_id",
    "chunk_index",
    "char_start",
    "char_end",
    "section_path",
    "node_kind",
    "parent_id",
    "parent_char_start",
    "parent_char_end",
    "parent_page_start",
    "parent_page_end",
    "page_breaks",
    "parent_page_breaks",
    "parent_text",
    "file_name",
    "file_path",
)
#: Keys shown to the LLM (for citations) but not embedded.
CITATION_KEYS = ("source", "section_title", "page_start", "page_end")
#: The contextual header: embedded only when the parser is asked to.
SECTION_HEADER_KEY = "section_header"


def chunk_id(doc_id: str, kind: str, start: int, end: int) -> str:
    """Deterministic node id from the document id and the character span."""
    return str(uuid.uuid5(CHUNK_ID_NAMESPACE, f"{doc_id}|{kind}|{start}|{end}"))


def page_of(page_starts: Sequence[int], offset: int) -> int:
    """1-based page number holding character ``offset`` (1 when there are no page offsets)."""
    if not page_starts:
        return 1
    return max(1, bisect.bisect_right(page_starts, offset))


def chunk_metadata(
    doc_metadata: dict[str, Any],
    doc_id: str,
    kind: str,
    chunk_index: int,
    start: int,
    end: int,
    section_title: str,
    section_path: Sequence[str],
) -> dict[str, Any]:
    """Metadata for one chunk: the document's own keys (minus page tables) plus the contract.

    Each value is the chunk's own copy (``copy_metadata``: lists and dicts at every depth), so
    that editing one chunk's ``tags`` changes neither the document nor its other chunks."""
    page_starts = doc_metadata.get("page_starts") or []
    meta = {k: copy_metadata(v) for k, v in doc_metadata.items() if k not in DOCUMENT_ONLY_KEYS}
    meta.update(
        {
            "doc_id": doc_id,
            "chunk_id": chunk_id(doc_id, kind, start, end),
            "chunk_index": chunk_index,
            "node_kind": kind,
            "section_title": section_title,
            "section_path": list(section_path),
            SECTION_HEADER_KEY: " > ".join(section_path),
            "char_start": start,
            "char_end": end,
            "page_start": page_of(page_starts, start),
            "page_end": page_of(page_starts, max(start, end - 1)),
            "source": doc_metadata.get("source", doc_id),
        }
    )
    breaks = page_breaks(page_starts, start, end)
    if breaks:
        meta["page_breaks"] = breaks
    return meta


def page_breaks(page_starts: Sequence[int], start: int, end: int) -> list[int]:
    """The document offsets in ``(start, end)`` where a new page starts: with ``page_start``
    they give the page of any offset ``o`` of the chunk, ``page_start + #{b <= o}`` (so a chunk
    cut to a part of it cites that part's pages). Empty for a chunk on one page."""
    return [int(p) for p in page_starts if start < p < end]


def excluded_keys(metadata: dict[str, Any], doc_excluded_embed: Sequence[str], doc_excluded_llm: Sequence[str], contextual_header: bool) -> tuple[list[str], list[str]]:
    """(excluded_embed, excluded_llm) for a chunk: bookkeeping hidden everywhere; the section
    header embedded only when ``contextual_header``; user keys follow the document's lists."""
    ours = set(BOOKKEEPING_KEYS) | set(CITATION_KEYS) | {SECTION_HEADER_KEY}
    embed = [k for k in metadata if k in ours and not (contextual_header and k == SECTION_HEADER_KEY)]
    embed += [k for k in doc_excluded_embed if k in metadata and k not in embed]
    llm = [k for k in metadata if k in BOOKKEEPING_KEYS or k == SECTION_HEADER_KEY]
    llm += [k for k in doc_excluded_llm if k in metadata and k not in llm]
    return embed, llm


def record_document_ids(nodes: Sequence[Any]) -> int:
    """Give each node whose metadata lacks ``doc_id`` its document's id (``node.ref_doc_id``), as
    bookkeeping: never embedded, never shown to the LLM. For chunks of parsers that do not follow
    the metadata contract (LlamaIndex's ``SentenceSplitter``, ``Settings.node_parser``), so that a
    ``doc_id`` filter selects them as it selects this package's chunks (and as LlamaIndex's vector
    stores do) instead of treating the key as missing (``doc_id NIN [...]`` kept every chunk).
    Changes ``nodes`` in place (the caller's parser made them); returns how many it changed."""
    changed = 0
    for node in nodes:
        metadata = node.metadata
        doc_id = node.ref_doc_id
        if metadata.get("doc_id") is not None or doc_id is None:
            continue
        metadata["doc_id"] = doc_id
        for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
            if "doc_id" not in excluded:
                excluded.append("doc_id")
        changed += 1
    return changed
