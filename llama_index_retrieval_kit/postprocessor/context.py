"""Context assembly: :class:`ContextAssembler`, a LlamaIndex node postprocessor.

It turns retrieved chunks into the context an LLM reads, within a token budget:

1. **deduplicate and merge** (:func:`merge_spans`): a node id seen twice is kept once; chunks of
   one document whose character spans overlap (window chunks overlap by design) or touch within
   one section (any sections with ``merge_sections``, the default: one hint then covers them,
   and the text keeps their headings) become one span. The span's text is rebuilt from the chunks' own texts and
   offsets (``text1 + text2[e1 - s2:]``), which is exact because every chunk of the metadata
   contract satisfies ``doc.text[char_start:char_end] == node.text``: no character of the
   source is repeated. A document is its id and, where known, its file (``file_path``: two
   files read under one id stay apart), and overlapping chunks merge only where their texts
   agree. Nodes of LlamaIndex's own parsers (no ``char_start``) use ``start_char_idx`` in their
   ``ref_doc_id`` document, checked against each other (:func:`drop_inconsistent_offsets`). A gap
   between chunks of the same parent is filled from ``parent_text``
   (hierarchy children) when it is at most ``max_gap_chars``; other gaps keep separate spans.
   ``expand_to_parent=True`` replaces each hierarchy child by its parent section, citing the
   parent's pages.
2. **fill the budget by relevance** (:meth:`ContextAssembler.select`): chunks best first, each
   costing what it adds to the merged context (an overlapping window pays only for its new
   text), so the budget is never spent twice on one source character; a chunk that does not
   fit whole is cut to the room left (``cut``, :class:`CutMode`): by default to the run of
   consecutive sentences (:func:`sentence_pieces`) that holds the most weight of the query's
   terms (:func:`best_run`: each distinct BM25 term once, weighted by its IDF over the
   candidates' sentences, :func:`query_idf`), else - no term matches, the run starts the chunk,
   no query string, or ``cut="prefix"`` - to its prefix at a sentence boundary
   (:func:`cut_at_sentence`'s rule; else a word boundary); either way the cut ends at a
   sentence boundary and stays an exact substring at its offsets. The room left after it goes
   to the next chunks the same way. A span's relevance is its best chunk's score. Tokens are counted with
   a real tokenizer on the text the LLM reads, each node's whole text (hint included) at once:
   the embedding model's by default (``tokenizer_name``), or any ``str -> list`` callable
   (``tokenizer=``, e.g. LlamaIndex's ``get_tokenizer()``: ``len(tokenizer(text))``), so the budget
   holds exactly for that tokenizer.
3. **order** (:func:`order_spans`, :class:`ContextOrder`): by relevance, in document order, or
   "bookends" - the most relevant spans at the start and the end of the context, because LLMs
   use information in the middle of a long context worst (Liu et al. 2024, "Lost in the
   Middle: How Language Models Use Long Contexts", TACL).

Each result is a new ``TextNode`` whose text starts with a citation hint
(:func:`citation_hints`; ``hint_style="full"``: ``[terms.pdf, 3. Fees > 3.2 Late payment, p. 4]``;
the default ``"compact"`` names the file when the document changes, the innermost section (its first
``hint_title_words`` words) unless the span starts with its heading, and the pages, e.g.
``[3.2 Late payment, p.4]``; the hints cost tokens of the budget) followed by the exact source span; its metadata (hidden from the LLM and the embedder) records the document,
section, pages, span offsets and the chunks it was built from with their scores. What was left
out (duplicates, over budget) is in the :class:`AssemblyReport` that
:meth:`ContextAssembler.assemble` returns with the nodes, and in
:attr:`ContextAssembler.last_report` (the last call of the reader's own thread or task).
Input nodes are never changed.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeRelationship, NodeWithScore, QueryBundle, RelatedNodeInfo, TextNode

from .._options import StrictOptions
from .._transient import LastValue, TransientState
from ..models import DEFAULT_EMBED_MODEL
from ..node_parser.metadata import chunk_id
from ..node_parser.tokenization import token_span_fn
from ..node_parser.tokenizer_identity import PicklesTokenizer, recorded_tokenizer
from ..tracing import trace_assembly, tracing_enabled
from .._enums import ChoiceEnum

logger = logging.getLogger(__name__)

__all__ = [
    "AssemblyReport",
    "Chunk",
    "ContextAssembler",
    "ContextOrder",
    "HintStyle",
    "LeftOut",
    "Span",
    "CutMode",
    "best_run",
    "chunk_from_result",
    "chunk_pieces",
    "citation_hints",
    "citation_text",
    "cut_at_sentence",
    "display_names",
    "drop_inconsistent_offsets",
    "cut_chunk",
    "merge_spans",
    "node_text",
    "order_spans",
    "page_text",
    "query_idf",
    "sentence_pieces",
]

#: Tokens a text may lose when it joins another at a span boundary (tokenizers that merge across
#: the join): the margin of the "cannot fit" shortcut in :meth:`ContextAssembler.select`.
_JOIN_SLACK_TOKENS = 2
#: Node kind used for the deterministic ids of assembled nodes (uuid5 of doc id + span).
CONTEXT_NODE_KIND = "context"
#: Unchecked offsets (LlamaIndex's ``start_char_idx``, see :attr:`Chunk.checked_offsets`) join a
#: span only on an overlap of at least this many agreeing characters (or the whole shorter text, or
#: any agreeing overlap between LlamaIndex neighbours): a chance agreement of offsets relative to
#: two different texts is that unlikely.
MIN_UNCHECKED_OVERLAP_CHARS = 16
#: Reasons recorded in :class:`AssemblyReport`.
OVER_BUDGET = "over budget"
DUPLICATE_OF = "duplicate of {}"
#: Metadata keys of assembled nodes (all hidden from the LLM: the hint in the text carries the citation).
CONTEXT_METADATA_KEYS = (
    "doc_id",
    "file_name",
    "file_path",
    "source",
    "section_path",
    "section_header",
    "page_start",
    "page_end",
    "char_start",
    "char_end",
    "citation",
    "hint_chars",
    "truncated",
    "source_node_ids",
    "source_scores",
    "source_details",
    "relevance",
)

_SENTENCE_END = re.compile(r"[.!?;:][\"'\u2019\u201d)\]]*(?=\s)|\n")
_WORD_END = re.compile(r"\S(?=\s)")
_PIECE_END = re.compile(r"[.!?][\"'\u2019\u201d)\]]*(?=\s)|\n")


class ContextOrder(ChoiceEnum):
    """How assembled spans are ordered in the context."""

    RELEVANCE = "relevance"  # best span first
    DOCUMENT = "document"  # documents by relevance, spans of a document in document order
    BOOKENDS = "bookends"  # best spans at the start and the end (Lost in the Middle, Liu et al. 2024)

class CutMode(ChoiceEnum):
    """Which part of a chunk the budget keeps when the chunk does not fit whole."""

    PREFIX = "prefix"  # its first sentences
    QUERY = "query"  # the run of consecutive sentences holding the most query-term weight (IDF)


class HintStyle(ChoiceEnum):
    """How much each citation hint says (every style but "none" keeps a citation on every span)."""

    FULL = "full"  # [terms.pdf, 3. Fees > 3.2 Late payment, p. 4] on every span
    COMPACT = "compact"  # file when it changes, innermost section unless the span starts with it: [3.2 Late payment, p.4]
    NONE = "none"  # no hint (file, section and pages stay in the node metadata only)

@dataclass(frozen=True)
class Chunk:
    """One retrieved chunk as context assembly sees it (a view of the metadata contract)."""

    node_id: str
    doc_id: str
    start: Optional[int]  # None: the node has no offsets (not from this package's parsers)
    end: Optional[int]
    text: str
    score: float
    rank: int  # position in the input list (0 = first)
    section_path: Tuple[str, ...] = ()
    page_start: Optional[int] = None
    page_end: Optional[int] = None
    file_name: Optional[str] = None
    source: Optional[str] = None
    parent_id: Optional[str] = None
    parent_start: Optional[int] = None
    parent_text: Optional[str] = None
    details: Dict[str, Any] = field(default_factory=dict, compare=False)
    truncated: bool = False  # cut by the token budget
    file_path: Optional[str] = None  # absolute path of the file read (tells apart two documents of one doc_id)
    parent_page_start: Optional[int] = None  # pages of the parent section (hierarchy children)
    parent_page_end: Optional[int] = None
    #: Document offsets inside the chunk where a new page starts (``page_breaks`` of the metadata
    #: contract; the parent's for a chunk widened to its parent): a cut part cites its own pages.
    page_breaks: Tuple[int, ...] = ()
    parent_page_breaks: Tuple[int, ...] = ()
    #: True: offsets of the metadata contract (``doc.text[char_start:char_end] == text``); False:
    #: LlamaIndex's ``start_char_idx``/``end_char_idx``, which a chain of parsers makes relative to an
    #: intermediate node: such chunks join only where their texts agree on a long enough overlap,
    #: or on any agreeing overlap when LlamaIndex links them as neighbours (:attr:`neighbour_ids`).
    checked_offsets: bool = True
    #: Node ids of the chunk's LlamaIndex ``PREVIOUS``/``NEXT`` relationships: consecutive splits of
    #: one text, whose (even short) agreeing overlap is the splitter's ``chunk_overlap``.
    neighbour_ids: Tuple[str, ...] = ()

    @property
    def has_offsets(self) -> bool:
        return self.start is not None and self.end is not None

    @property
    def doc_key(self) -> Tuple[str, str]:
        """The document's identity: its id and, where known, its file (two files may share an id)."""
        return (self.doc_id, self.file_path or "")


@dataclass
class Span:
    """A contiguous piece of one document built from one or more chunks."""

    doc_id: str
    start: Optional[int]
    end: Optional[int]
    text: str
    chunks: List[Chunk]
    section_path: Tuple[str, ...] = ()

    @property
    def truncated(self) -> bool:
        """True when a chunk of the span was cut by the budget."""
        return any(c.truncated for c in self.chunks)

    @property
    def best(self) -> Chunk:
        """The chunk with the highest score (earliest input rank on ties)."""
        return min(self.chunks, key=lambda c: (-c.score, c.rank))

    @property
    def score(self) -> float:
        return self.best.score

    @property
    def rank(self) -> int:
        return self.best.rank

    @property
    def page_start(self) -> Optional[int]:
        pages = [c.page_start for c in self.chunks if c.page_start is not None]
        return min(pages) if pages else None

    @property
    def page_end(self) -> Optional[int]:
        pages = [c.page_end for c in self.chunks if c.page_end is not None]
        return max(pages) if pages else None

    @property
    def doc_key(self) -> Tuple[str, str]:
        """:attr:`Chunk.doc_key` of its chunks (one document per span)."""
        return self.chunks[0].doc_key


@dataclass(frozen=True)
class LeftOut:
    """An input node whose text is not in the context, and why."""

    node_id: str
    reason: str  # "over budget" or "duplicate of <node id>"


@dataclass
class AssemblyReport:
    """What one :meth:`ContextAssembler.postprocess_nodes` call did."""

    max_tokens: int
    used_tokens: int = 0
    input_nodes: int = 0
    spans: int = 0  # after deduplication and merging
    assembled: int = 0  # spans in the context
    truncated: List[str] = field(default_factory=list)  # assembled node ids cut by the budget
    left_out: List[LeftOut] = field(default_factory=list)
    merged_into: Dict[str, str] = field(default_factory=dict)  # input node id -> assembled node id


# ------------------------------------------------------------------------------ pure functions
def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def chunk_from_result(result: NodeWithScore, rank: int) -> Chunk:
    """The :class:`Chunk` view of a retrieved result (its node is only read, never changed).

    Offsets come from the metadata contract (``char_start``/``char_end``); a node without them
    (LlamaIndex's own parsers: ``SentenceSplitter``, ...) uses ``start_char_idx``/``end_char_idx``
    in its ``ref_doc_id`` document, marked unchecked (:attr:`Chunk.checked_offsets`). Offsets whose
    length is not the text's are dropped (the chunk then joins others only by equal text).
    """
    node = result.node
    meta = node.metadata or {}
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    start, end = _int_or_none(meta.get("char_start")), _int_or_none(meta.get("char_end"))
    checked = True
    ref_doc_id = node.ref_doc_id
    if start is None and end is None and ref_doc_id is not None and meta.get("doc_id") in (None, ref_doc_id):
        start, end = _int_or_none(node.start_char_idx), _int_or_none(node.end_char_idx)
        checked = False
    if start is None or end is None or start < 0 or end - start != len(text):
        start = end = None
    details: Dict[str, Any] = {"score": result.score}
    if isinstance(meta.get("chunk_id"), str) and meta["chunk_id"] != node.node_id:
        details["chunk_id"] = meta["chunk_id"]  # a chunk id of its own (this package's parsers: the node id)
    for name in ("leg_scores", "leg_ranks", "pre_rerank_score", "pre_rerank_rank", "rerank_logit"):
        value = getattr(result, name, None)
        if value not in (None, {}):
            details[name] = dict(value) if isinstance(value, dict) else value
    parent_text = meta.get("parent_text")
    parent_start = _int_or_none(meta.get("parent_char_start"))
    parent_end = _int_or_none(meta.get("parent_char_end"))
    if not isinstance(parent_text, str) or parent_start is None or parent_end is None or parent_end - parent_start != len(parent_text):
        parent_text = parent_start = None
    path = meta.get("section_path")
    return Chunk(
        node_id=node.node_id,
        doc_id=str(meta.get("doc_id") or node.ref_doc_id or node.node_id),
        start=start,
        end=end,
        text=text,
        score=float(result.score) if result.score is not None else 0.0,
        rank=rank,
        section_path=tuple(str(p) for p in path) if isinstance(path, (list, tuple)) else (),
        page_start=_int_or_none(meta.get("page_start")),
        page_end=_int_or_none(meta.get("page_end")),
        file_name=meta.get("file_name") if isinstance(meta.get("file_name"), str) else None,
        source=meta.get("source") if isinstance(meta.get("source"), str) else None,
        parent_id=meta.get("parent_id") if isinstance(meta.get("parent_id"), str) else None,
        parent_start=parent_start,
        parent_text=parent_text,
        details=details,
        file_path=meta.get("file_path") if isinstance(meta.get("file_path"), str) else None,
        parent_page_start=_int_or_none(meta.get("parent_page_start")) if parent_text is not None else None,
        parent_page_end=_int_or_none(meta.get("parent_page_end")) if parent_text is not None else None,
        page_breaks=_offsets(meta.get("page_breaks")) if checked else (),
        parent_page_breaks=_offsets(meta.get("parent_page_breaks")) if parent_text is not None else (),
        checked_offsets=checked,
        neighbour_ids=_neighbour_ids(node),
    )


def _offsets(value: Any) -> Tuple[int, ...]:
    """A list of int offsets from metadata, sorted (anything else: none)."""
    if not isinstance(value, (list, tuple)):
        return ()
    ints = [_int_or_none(v) for v in value]
    return tuple(sorted(v for v in ints if v is not None))


def pages_of_part(chunk: Chunk, start: int, end: int) -> Tuple[Optional[int], Optional[int]]:
    """``(page_start, page_end)`` of the part ``[start, end)`` of ``chunk``: the chunk's first page
    plus the page breaks (:attr:`Chunk.page_breaks`) up to each end; without breaks known, the
    chunk's own pages (which hold the part)."""
    if chunk.page_start is None or not chunk.page_breaks or end <= start:
        return chunk.page_start, chunk.page_end
    first = chunk.page_start + bisect.bisect_right(chunk.page_breaks, start)
    last = chunk.page_start + bisect.bisect_right(chunk.page_breaks, end - 1)
    return first, last


def part_of_chunk(chunk: Chunk, start: int, text: str) -> Chunk:
    """The part of ``chunk`` at document offset ``start`` with ``text`` (``doc.text[start:start +
    len(text)]``), marked truncated, citing its own pages (:func:`pages_of_part`)."""
    end = start + len(text)
    page_start, page_end = pages_of_part(chunk, start, end)
    return Chunk(**{**chunk.__dict__, "start": start, "end": end, "text": text, "truncated": True,
                    "page_start": page_start, "page_end": page_end})


def _neighbour_ids(node: Any) -> Tuple[str, ...]:
    """Node ids of ``node``'s ``PREVIOUS``/``NEXT`` relationships (LlamaIndex's consecutive splits)."""
    ids = []
    for attr in ("prev_node", "next_node"):
        try:
            info = getattr(node, attr, None)
        except ValueError:  # a malformed relationship: no neighbour known
            info = None
        node_id = getattr(info, "node_id", None)
        if isinstance(node_id, str):
            ids.append(node_id)
    return tuple(ids)


def expand_chunk(chunk: Chunk) -> Chunk:
    """``chunk`` widened to its parent section when it carries ``parent_text`` (else unchanged).

    Pages become the parent's (``parent_page_start``/``parent_page_end``, written by
    :class:`~..node_parser.section_hierarchy.SectionHierarchyNodeParser`); children of older
    indexes without them keep their own pages.
    """
    if chunk.parent_text is None or chunk.parent_start is None:
        return chunk
    pages: Dict[str, Any] = {"page_breaks": ()}  # the child's breaks do not describe the parent
    if chunk.parent_page_start is not None and chunk.parent_page_end is not None:
        pages = {"page_start": chunk.parent_page_start, "page_end": chunk.parent_page_end, "page_breaks": chunk.parent_page_breaks}
    return Chunk(
        **{
            **chunk.__dict__,
            "start": chunk.parent_start,
            "end": chunk.parent_start + len(chunk.parent_text),
            "text": chunk.parent_text,
            **pages,
        }
    )


def drop_inconsistent_offsets(chunks: Sequence[Chunk]) -> List[Chunk]:
    """``chunks`` with the unchecked offsets (:attr:`Chunk.checked_offsets`) of a document dropped
    when two of its chunks overlap but disagree on the shared text: their offsets are then relative
    to different texts (LlamaIndex parsers chained, e.g. ``MarkdownNodeParser`` then
    ``SentenceSplitter``: ``start_char_idx`` counts in the intermediate node). Those chunks keep
    their text and join others only by equal text, as chunks without offsets do."""
    by_doc: Dict[Tuple[str, str], List[Chunk]] = {}
    for c in chunks:
        if c.has_offsets and not c.checked_offsets:
            by_doc.setdefault(c.doc_key, []).append(c)
    inconsistent = set()
    for key, group in by_doc.items():
        group.sort(key=lambda c: (c.start, c.end))
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if b.start >= a.end:  # type: ignore[operator]
                    break
                hi = min(a.end, b.end)  # type: ignore[type-var]
                if a.text[b.start - a.start : hi - a.start] != b.text[: hi - b.start]:  # type: ignore[operator]
                    inconsistent.add(key)
                    break
            if key in inconsistent:
                break
    if not inconsistent:
        return list(chunks)
    return [
        Chunk(**{**c.__dict__, "start": None, "end": None}) if not c.checked_offsets and c.doc_key in inconsistent else c
        for c in chunks
    ]


def _gap_text(a: Chunk, b: Chunk, start: int, end: int) -> Optional[str]:
    """``doc.text[start:end]`` cut from a parent text that one of the chunks carries, else None."""
    for c in (a, b):
        if c.parent_text is not None and c.parent_start is not None:
            if c.parent_start <= start and end <= c.parent_start + len(c.parent_text):
                return c.parent_text[start - c.parent_start : end - c.parent_start]
    return None


def merge_spans(
    chunks: Sequence[Chunk], max_gap_chars: int = 0, merge_sections: bool = False
) -> Tuple[List[Span], Dict[str, str]]:
    """Deduplicate ``chunks`` and merge them into spans; returns ``(spans, duplicates)``.

    ``duplicates`` maps a dropped chunk's node id to the node id it duplicates: the same node id
    seen earlier, or a chunk whose span (or, without offsets, whose text) another chunk holds
    whole. The duplicate's score still counts for the span that holds it. Chunks of one
    document (:attr:`Chunk.doc_key`: id and file) merge into one span when their spans overlap
    and the overlap's text agrees (``span.text[s2 - s1:] == text2[:e1 - s2]``; two files read
    under one id disagree, and are never spliced), or touch (``e1 == s2``) within one section (in
    any sections with ``merge_sections``: one hint then covers both), or - when a parent text
    covers the gap - lie at most ``max_gap_chars`` apart. Unchecked offsets
    (:attr:`Chunk.checked_offsets`) join only on an agreeing overlap of at least
    :data:`MIN_UNCHECKED_OVERLAP_CHARS` characters (or the whole shorter text, or any agreeing
    overlap with a chunk LlamaIndex links as its previous or next split). The merged text is
    ``text1 + text2[e1 - s2:]`` (exact: chunk texts are ``doc.text[s:e]``), so no source character
    is repeated. Spans come out by document then offset.
    """
    duplicates: Dict[str, str] = {}
    seen: Dict[str, Chunk] = {}
    unique: List[Chunk] = []
    for c in chunks:
        if c.node_id in seen:
            duplicates.setdefault(c.node_id, c.node_id)
            continue
        seen[c.node_id] = c
        unique.append(c)

    spans: List[Span] = []
    contained: set = set()
    by_text: Dict[Tuple[Tuple[str, str], str], Span] = {}
    by_doc: Dict[Tuple[str, str], List[Chunk]] = {}
    for c in unique:
        if c.has_offsets:
            by_doc.setdefault(c.doc_key, []).append(c)
            continue
        key = (c.doc_key, c.text)
        if key in by_text:  # the same text without offsets: one span
            by_text[key].chunks.append(c)
            duplicates[c.node_id] = by_text[key].chunks[0].node_id
            continue
        span = Span(c.doc_id, None, None, c.text, [c], c.section_path)
        by_text[key] = span
        spans.append(span)

    for doc_key in sorted(by_doc):
        ordered = sorted(by_doc[doc_key], key=lambda c: (c.start, -c.end, c.rank))
        current: Optional[Span] = None
        checked = True  # every chunk of ``current`` has checked offsets
        for c in ordered:
            assert c.start is not None and c.end is not None
            if current is not None:
                assert current.start is not None and current.end is not None
                trusted = checked and c.checked_offsets
                shared = current.text[c.start - current.start : min(c.end, current.end) - current.start]
                agrees = c.start < current.end and c.text.startswith(shared) and (
                    trusted
                    or len(shared) >= min(MIN_UNCHECKED_OVERLAP_CHARS, len(c.text))
                    or _linked(c, current.chunks)
                )
                if agrees and c.end <= current.end:  # held whole by the span
                    holder = max(
                        (h for h in current.chunks if h.start <= c.start and c.end <= h.end and h.node_id not in contained),
                        key=lambda h: h.end - h.start,
                        default=None,
                    )
                    if holder is not None:
                        duplicates[c.node_id] = holder.node_id
                        contained.add(c.node_id)
                    current.chunks.append(c)
                    checked = trusted
                    continue
                last = current.chunks[-1]
                if agrees or (
                    trusted and c.start == current.end and (merge_sections or c.section_path == last.section_path)
                ):
                    current.text += c.text[current.end - c.start :]
                    current.end = c.end
                    current.chunks.append(c)
                    checked = trusted
                    continue
                gap = c.start - current.end
                filler = _gap_text(last, c, current.end, c.start) if trusted and 0 < gap <= max_gap_chars else None
                if filler is not None and last.parent_id is not None and last.parent_id == c.parent_id:
                    current.text += filler + c.text
                    current.end = c.end
                    current.chunks.append(c)
                    continue
            current = Span(c.doc_id, c.start, c.end, c.text, [c], c.section_path)
            checked = c.checked_offsets
            spans.append(current)
    for span in spans:
        span.section_path = span.best.section_path
    return spans, duplicates


def _linked(chunk: Chunk, others: Sequence[Chunk]) -> bool:
    """True when LlamaIndex links ``chunk`` to one of ``others`` as its previous or next split."""
    return any(o.node_id in chunk.neighbour_ids or chunk.node_id in o.neighbour_ids for o in others)


def _overlaps(chunk: Chunk, others: Sequence[Chunk]) -> bool:
    """True when ``chunk`` shares source text with one of ``others`` (same document, offsets
    overlap; without offsets: the same document at all)."""
    for o in others:
        if o.doc_key != chunk.doc_key:
            continue
        if not (chunk.has_offsets and o.has_offsets):
            return True
        if o.start < chunk.end and chunk.start < o.end:  # type: ignore[operator]
            return True
    return False


def sentence_boundaries(text: str) -> List[int]:
    """Offsets just after each sentence end (``.!?;:`` and closing quotes before whitespace) and line end."""
    return [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]


def cut_at_sentence(text: str, max_chars: int, min_chars: int = 0) -> str:
    """The longest prefix of ``text`` of at most ``max_chars`` characters that ends at a sentence
    boundary, or - when no sentence boundary lies in ``[min_chars, max_chars]`` - at a word
    boundary; trailing whitespace removed. ``""`` when neither exists.
    """
    if max_chars >= len(text):
        return text.rstrip()
    if max_chars <= 0:
        return ""
    ends = [e for e in sentence_boundaries(text) if min_chars <= e <= max_chars]
    if not ends:
        ends = [m.end() for m in _WORD_END.finditer(text, 0, max_chars + 1) if m.end() <= max_chars]
    return text[: ends[-1]].rstrip() if ends else ""


def page_text(page_start: Optional[int], page_end: Optional[int], compact: bool = False) -> Optional[str]:
    """``"p. 4"``, ``"pp. 3-4"`` (``compact``: ``"p.4"``, ``"pp.3-4"``), or None without pages."""
    if page_start is None:
        return None
    sep = "" if compact else " "
    if page_end is None or page_end <= page_start:
        return f"p.{sep}{page_start}"
    return f"pp.{sep}{page_start}-{page_end}"


def citation_text(
    file_name: Optional[str], section_path: Sequence[str], page_start: Optional[int], page_end: Optional[int]
) -> str:
    """The citation hint ``[terms.pdf, 3. Fees > 3.2 Late payment, p. 4]`` (parts that are missing are left out)."""
    parts = [p for p in (file_name, " > ".join(s for s in section_path if s), page_text(page_start, page_end)) if p]
    return f"[{', '.join(parts)}]" if parts else ""


def span_file_name(span: Span) -> str:
    """The name a citation gives the span's document: its file name, else its source's base name, else its id."""
    c = span.best
    return c.file_name or (os.path.basename(c.source) if c.source else None) or span.doc_id


def _path_parts(path: Optional[str]) -> List[str]:
    return [p for p in re.split(r"[\\/]", path) if p] if path else []


def display_names(spans: Sequence[Span]) -> Dict[Tuple[str, str], str]:
    """The name citations give each document (:attr:`Span.doc_key`) of ``spans``.

    :func:`span_file_name`, unless two documents of ``spans`` share it: then the shortest tail of
    their paths (``source``, else ``file_path``) that tells them apart (``pdf_a/terms.pdf``), else
    their doc ids when those differ, else the name and the document's ordinal (``terms.pdf #2``).
    """
    first: Dict[Tuple[str, str], Span] = {}
    for span in spans:
        first.setdefault(span.doc_key, span)
    names = {key: span_file_name(span) for key, span in first.items()}
    groups: Dict[str, List[Tuple[str, str]]] = {}
    for key, name in names.items():
        groups.setdefault(name, []).append(key)
    for name, keys in groups.items():
        if len(keys) < 2:
            continue
        names.update(_distinct_names(name, [first[k] for k in keys]))
    return names


def _distinct_names(name: str, spans: Sequence[Span]) -> Dict[Tuple[str, str], str]:
    """Names telling apart the documents of ``spans`` (one span each), which all share ``name``."""
    keys = [s.doc_key for s in spans]
    for attr in ("source", "file_path"):
        parts = [_path_parts(getattr(s.best, attr)) for s in spans]
        for depth in range(2, max(len(p) for p in parts) + 1):
            tails = ["/".join(p[-depth:]) for p in parts]
            if all(tails) and len(set(tails)) == len(tails):
                return dict(zip(keys, tails))
    if len({s.doc_id for s in spans}) == len(spans):
        return {s.doc_key: s.doc_id for s in spans}
    return {key: f"{name} #{i}" for i, key in enumerate(keys, 1)}


def citation_hints(ordered: Sequence[Span], compact: bool = False, title_words: int = 0) -> List[str]:
    """The citation hint of each span of ``ordered`` (the spans in context order).

    Full: :func:`citation_text` of the file name, section path and pages. ``compact`` is the
    shortest hint that still finds the span: the file name (left out when the previous span
    cites the same document: the LLM just read it), the innermost section only (left out when the
    span starts with that section's heading; cut to its first ``title_words`` words and "…" when
    longer, 0: never cut), and pages as ``p.4``/``pp.3-4``. A compact hint never comes out
    empty: with nothing else to say it names the file. Titles wrapped over lines read as one line.
    Two documents of one context that share a file name are named apart (:func:`display_names`).
    """
    hints: List[str] = []
    names = display_names(ordered)
    prev_key: Optional[Tuple[str, str]] = None
    for span in ordered:
        name = names[span.doc_key]
        path = [p for p in span.section_path if p and not p.isspace()]
        if not compact:
            hints.append(citation_text(name, [_one_line(p) for p in path], span.page_start, span.page_end))
            continue
        shown_name: Optional[str] = None if span.doc_key == prev_key else name
        title = _one_line(path[-1]) if path else ""
        if not path or _starts_with_heading(span.text, title):
            title = ""  # the span starts with its section heading: the LLM reads it there
        elif title_words and len(title.split()) > title_words:
            title = " ".join(title.split()[:title_words]) + "\u2026"
        pages = page_text(span.page_start, span.page_end, compact=True)
        parts = [p for p in (shown_name, title, pages) if p] or [name]
        hints.append(f"[{', '.join(parts)}]")
        prev_key = span.doc_key
    return hints


def node_text(hint: str, span_text: str) -> str:
    """The text of an assembled node, as the LLM reads it: the hint on its own line, then the span."""
    return f"{hint}\n{span_text}" if hint else span_text


@functools.lru_cache(maxsize=4096)
def _one_line(text: str) -> str:
    """``text`` with every run of whitespace (a title wrapped over lines in a PDF) one space."""
    return " ".join(text.split())


def _starts_with_heading(text: str, title: str) -> bool:
    """True when ``text`` starts with the heading ``title`` (one line: see :func:`_one_line`;
    Markdown ``#`` marks before it allowed; whitespace compared as single spaces)."""
    head = text[: 3 * len(title) + 16].lstrip().lstrip("#").lstrip()
    if head.startswith(title):
        return True
    first = title.split(" ", 1)[0]
    return head.startswith(first) and _one_line(head).startswith(title)


def order_spans(spans: Sequence[Span], order: ContextOrder) -> List[Span]:
    """``spans`` in context order.

    * relevance: best first (ties: earlier input rank);
    * document: documents by their best span, spans of one document by offset;
    * bookends: ranks 1, 3, 5, ... from the start and 2, 4, ... from the end, so the most
      relevant spans sit at both ends and the least relevant in the middle (Liu et al. 2024,
      "Lost in the Middle"; LlamaIndex's LongContextReorder does the same).
    """
    order = ContextOrder.from_str(order)
    by_relevance = sorted(spans, key=lambda s: (-s.score, s.rank))
    if order is ContextOrder.RELEVANCE:
        return by_relevance
    if order is ContextOrder.BOOKENDS:
        return by_relevance[0::2] + by_relevance[1::2][::-1]
    doc_rank: Dict[Tuple[str, str], int] = {}
    for s in by_relevance:
        doc_rank.setdefault(s.doc_key, len(doc_rank))
    return sorted(
        by_relevance,
        key=lambda s: (doc_rank[s.doc_key], s.start if s.start is not None else float("inf"), -s.score, s.rank),
    )


def word_boundaries(text: str) -> List[int]:
    """Offsets just after each word (a non-space character followed by whitespace) and the end."""
    return [m.end() for m in _WORD_END.finditer(text)] + [len(text)]


def cut_chunk(chunk: Chunk, length: int) -> Chunk:
    """The first ``length`` characters of ``chunk`` (trailing whitespace dropped), marked truncated.

    Still exact: ``doc.text[start:start + len(text)]`` is the cut text.
    """
    text = chunk.text[:length].rstrip()
    if chunk.start is None:
        return Chunk(**{**chunk.__dict__, "text": text, "end": None, "truncated": True})
    return part_of_chunk(chunk, chunk.start, text)


def sentence_pieces(text: str) -> List[Tuple[int, int]]:
    """``(start, end)`` offsets of the sentence pieces of ``text``; they tile it exactly.

    A sentence ends after ``.!?`` (and closing quotes or brackets) before whitespace, or at a line
    end. Each piece runs from its sentence's first non-space character to the next piece's start
    (the first from 0), so ``"".join(text[s:e] for s, e in pieces) == text`` and whitespace belongs
    to the piece before it.
    """
    if not text:
        return []
    starts = [0]
    n = len(text)
    for m in _PIECE_END.finditer(text):
        j = m.end()
        while j < n and text[j].isspace():
            j += 1
        if j < n and j > starts[-1]:
            starts.append(j)
    return list(zip(starts, starts[1:] + [n]))


def chunk_pieces(chunk: Chunk) -> List[Chunk]:
    """``chunk`` cut into its sentence pieces (:func:`sentence_pieces`), each still exact
    (``doc.text[start:end] == text``); a chunk without offsets is its own only piece."""
    bounds = sentence_pieces(chunk.text)
    if not chunk.has_offsets or len(bounds) <= 1:
        return [chunk]
    assert chunk.start is not None
    return [part_of_chunk(chunk, chunk.start + a, chunk.text[a:b]) for a, b in bounds]


def query_idf(query_terms: Sequence[str], docs: Sequence[Sequence[str]]) -> Dict[str, float]:
    """IDF of each distinct query term over the term lists ``docs``:
    ``ln(1 + (N - n_t + 0.5) / (n_t + 0.5))`` (BM25's IDF in Lucene's non-negative form)."""
    n_docs = len(docs)
    sets = [set(d) for d in docs]
    return {t: math.log(1.0 + (n_docs - (n := sum(1 for d in sets if t in d)) + 0.5) / (n + 0.5)) for t in set(query_terms)}


def best_run(
    weights: Dict[str, float],
    terms: Sequence[frozenset],
    fits: Callable[[int, int], bool],
    keep: Optional[Callable[[int, int], bool]] = None,
) -> Optional[Tuple[int, int]]:
    """``(i, j)``: the run of pieces ``i..j`` (inclusive) whose query terms weigh most,
    ``sum(weights[t] for t in union(terms[i..j]))`` (a term counts once), among the longest run
    from each start that ``fits`` and that ``keep`` accepts; ties go to the earliest start. None
    when no such run holds a query term.

    ``terms[k]``: the query terms of piece ``k``; ``weights``: each term's weight (its IDF).
    ``fits`` must be monotone (a run that fits still fits when shortened at its end), so the
    longest fitting run from each start is found by binary search. A run starts at a piece with
    a query term or at piece 0 (a longer run from a piece without one weighs no more).
    """
    n = len(terms)
    if not any(terms):
        return None
    best: Optional[Tuple[float, int, int]] = None
    for i in range(n):
        if i > 0 and not terms[i]:
            continue
        if best is not None and math.fsum(weights[t] for t in frozenset().union(*terms[i:])) <= best[0]:
            break  # no later run can weigh more
        lo, hi, found = i, n - 1, -1
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(i, mid):
                found, lo = mid, mid + 1
            else:
                hi = mid - 1
        if found < 0 or (keep is not None and not keep(i, found)):
            continue
        # fsum: correctly rounded, so equal term sets weigh exactly the same (ties go to the earliest start)
        total = math.fsum(weights[t] for t in frozenset().union(*terms[i : found + 1]))
        if total > 0 and (best is None or total > best[0]):
            best = (total, i, found)
    return (best[1], best[2]) if best is not None else None


# ------------------------------------------------------------------------------ the postprocessor
class ContextAssembler(PicklesTokenizer, TransientState, StrictOptions, BaseNodePostprocessor):
    """Turn retrieved chunks into a deduplicated, cited context of at most ``max_tokens`` tokens.

    ``postprocess_nodes(nodes, query_str=...)`` returns new nodes whose texts, in order, are
    the context: each starts with a citation hint and holds an exact span of its document.
    See the module docstring; :meth:`assemble` returns each call's report, :attr:`last_report`
    tells what the last call of the reader's thread or task left out.
    """

    max_tokens: int = Field(description="Most tokens of context (hints included), counted with the tokenizer.")
    order: ContextOrder = Field(
        default=ContextOrder.BOOKENDS,
        description="Order of the spans: 'bookends' (default: best at both ends, Lost in the Middle; it puts the "
        "evidence nearest the context's ends in benchmarks/context_assembly.py), 'relevance' (best first) or "
        "'document' (documents by relevance, spans in document order).",
    )
    expand_to_parent: bool = Field(
        default=False,
        description="Replace hierarchy children by their parent section (from metadata 'parent_text'; "
        "chunks without it are kept as they are).",
    )
    max_gap_chars: int = Field(
        default=200,
        ge=0,
        description="Fill a gap of at most this many characters between two chunks of one parent from the "
        "parent's text (hierarchy children with 'parent_text'); 0: never.",
    )
    min_cut_tokens: int = Field(
        default=24,
        ge=1,
        description="A span cut by the budget is kept only if at least this many tokens of its text remain.",
    )
    include_hint: bool = Field(
        default=True, description="Start each node's text with its citation hint, e.g. '[terms.pdf, 3. Fees, p. 4]'."
    )
    hint_style: HintStyle = Field(
        default=HintStyle.COMPACT,
        description="'compact' (default: the file name unless the previous span cites the same file, the innermost "
        "section unless the span starts with its heading - its first `hint_title_words` words - and pages as 'p.4'; "
        "it covers the most evidence in benchmarks/context_assembly.py), 'full' (file, whole section path and pages "
        "on every span) or 'none' (no hint; file, section and pages stay in the node metadata).",
    )
    hint_title_words: int = Field(
        default=6,
        ge=0,
        description="Compact hints cite a section by at most this many words of its title, then '…' (0: the "
        "whole title); the full section path stays in the node metadata. Long titles (papers, PDF bookmarks) "
        "otherwise cost many tokens on every span: on the SciFact PDFs of benchmarks/context_assembly.py, 6 words "
        "covered more evidence at 256 to 2048 tokens than whole titles, and the same on the bundled samples.",
    )
    merge_sections: bool = Field(
        default=True,
        description="Merge chunks of one document that touch across a section boundary into one span under one "
        "hint (the text keeps the section headings); False: one span per section.",
    )
    cut: CutMode = Field(
        default=CutMode.QUERY,
        description="What the budget keeps of a chunk that does not fit whole: 'query' (default: the run of "
        "consecutive sentences holding the most query-term weight - each distinct BM25 term of the query string "
        "once, weighted by its IDF over the candidates' sentences - ending at a sentence boundary; the chunk's "
        "prefix when no sentence matches or the best run starts it; it covers the most evidence at 256 tokens in "
        "benchmarks/context_assembly.py) or 'prefix' (its first sentences, cut at a sentence boundary).",
    )
    tokenizer_name: str = Field(
        default=DEFAULT_EMBED_MODEL,
        description="Hugging Face tokenizer (model id or local folder) that counts tokens; the default is the "
        "packaged all-MiniLM-L6-v2 embedding model's. Ignored when a `tokenizer` callable is passed.",
    )
    tokenizer_callable: Optional[str] = Field(
        default=None,
        description="Name of the `tokenizer` callable that counts the budget (set from `tokenizer=`: "
        "'tiktoken:<encoding>' or 'custom:<module>.<qualname>'); None: `tokenizer_name` counts. An assembler "
        "rebuilt from a dict naming one needs `tokenizer=` passed again (else a ValueError).",
    )

    __init_options__ = ("tokenizer",)
    __transient_private__ = ("_span_fn", "_lock", "_reports", "_terms_fn")
    __shared_private__ = ("_tokenizer",)

    _tokenizer: Optional[Callable[[str], Sequence]] = PrivateAttr(default=None)
    _span_fn: Any = PrivateAttr(default=None)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)
    _reports: LastValue = PrivateAttr(default_factory=lambda: LastValue("ContextAssembler.last_report"))
    _terms_fn: Optional[Callable[[str], List[str]]] = PrivateAttr(default=None)

    def __init__(self, tokenizer: Optional[Callable[[str], Sequence]] = None, **data: Any) -> None:
        data["tokenizer_callable"] = recorded_tokenizer(self.class_name(), tokenizer, data.get("tokenizer_callable"))
        super().__init__(**data)
        self._tokenizer = tokenizer

    @classmethod
    def class_name(cls) -> str:
        return "ContextAssembler"

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _check_max_tokens(cls, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {value!r} ({type(value).__name__})")
        return value

    @field_validator("order", mode="before")
    @classmethod
    def _check_order(cls, value: Any) -> ContextOrder:
        return ContextOrder.from_str(value)

    @field_validator("cut", mode="before")
    @classmethod
    def _check_cut(cls, value: Any) -> CutMode:
        return CutMode.from_str(value)

    @field_validator("hint_style", mode="before")
    @classmethod
    def _check_hint_style(cls, value: Any) -> HintStyle:
        return HintStyle.from_str(value)

    @property
    def last_report(self) -> Optional[AssemblyReport]:
        """What the last :meth:`postprocess_nodes` call did (None before the first).

        Concurrency: the last call made in the reader's own thread or asyncio task (``query`` in a
        thread pool, ``asyncio.gather`` of ``aquery``), else - the reader made none - the last call
        of this assembler from anywhere. One assembler serving concurrent queries therefore keeps
        each query's report apart for the code that ran the query; to hold a report explicitly, call
        :meth:`assemble` (returns ``(nodes, report)`` for that call), or trace the query
        (``response.metadata["trace"]``, its "context" stage).
        """
        return self._reports.get()

    # -- tokens ------------------------------------------------------------------------
    def _spans_of(self, text: str) -> Any:
        if self._span_fn is None:
            with self._lock:
                if self._span_fn is None:
                    self._span_fn = token_span_fn(self.tokenizer_name, self._tokenizer)
        return self._span_fn(text)

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` as the budget counts them: ``len(tokenizer(text))`` for a ``tokenizer``
        callable (whitespace and newlines included, exactly as that tokenizer counts them), else the
        Hugging Face tokenizer's tokens without special tokens."""
        if not text:
            return 0
        if self._tokenizer is not None:
            return len(self._tokenizer(text))
        return len(self._spans_of(text))

    # -- assembly ----------------------------------------------------------------------
    def _hints(self, ordered: Sequence[Span]) -> List[str]:
        """The citation hint of each span of ``ordered`` (the spans in context order)."""
        if not self.include_hint or self.hint_style is HintStyle.NONE:
            return ["" for _ in ordered]
        return citation_hints(ordered, compact=self.hint_style is HintStyle.COMPACT, title_words=self.hint_title_words)

    def _cost(self, spans: Sequence[Span], cache: Dict[str, int]) -> int:
        """Tokens of the context the spans make, in context order: the sum over its nodes of the tokens
        of each node's whole text (hint, newline and span text, counted as one text: exactly what
        :meth:`assemble` returns, for any tokenizer)."""
        ordered = order_spans(spans, self.order)
        return sum(self._tokens(node_text(hint, span.text), cache) for span, hint in zip(ordered, self._hints(ordered)))

    def _best_cut(self, selected: List[Chunk], chunk: Chunk, cache: Dict[str, int]) -> Optional[Chunk]:
        """The longest prefix of ``chunk`` ending at a sentence boundary (else a word boundary)
        that fits the budget next to ``selected``, with at least ``min_cut_tokens`` tokens; None if none."""

        def fits(length: int) -> Optional[Chunk]:
            cut = cut_chunk(chunk, length)
            return cut if cut.text and self._fits(selected, cut, cache) is not None else None

        def longest(bounds: Sequence[int]) -> Optional[Chunk]:
            bounds = sorted(set(b for b in bounds if 0 < b < len(chunk.text)))
            lo, hi, found = 0, len(bounds) - 1, None
            while lo <= hi:  # cost grows with the prefix: binary search the longest that fits
                mid = (lo + hi) // 2
                cut = fits(bounds[mid])
                if cut is not None:
                    found, lo = cut, mid + 1
                else:
                    hi = mid - 1
            # min_cut_tokens applies to the choice (a shorter prefix would be shorter still)
            return found if found is not None and self._tokens(found.text, cache) >= self.min_cut_tokens else None

        return longest(sentence_boundaries(chunk.text)) or longest(word_boundaries(chunk.text))

    def query_terms(self, text: str) -> List[str]:
        """BM25 terms of ``text`` (the kit's BM25 tokenizer: lowercased words, English stopwords out, stemmed)."""
        if self._terms_fn is None:
            with self._lock:
                if self._terms_fn is None:
                    from ..retrievers.bm25 import BM25TokenizerConfig, build_tokenizer

                    self._terms_fn = build_tokenizer(BM25TokenizerConfig())
        return self._terms_fn(text) if text else []

    def _fits(self, selected: List[Chunk], chunk: Chunk, cache: Dict[str, int]) -> Optional[int]:
        """Tokens of the context with ``chunk`` added to ``selected``, or None when over the budget."""
        spans, _ = merge_spans(selected + [chunk], self.max_gap_chars, self.merge_sections)
        cost = self._cost(spans, cache)
        return cost if cost <= self.max_tokens else None

    def _best_window(
        self,
        selected: List[Chunk],
        chunk: Chunk,
        pieces: Sequence[Tuple[Chunk, frozenset]],
        weights: Dict[str, float],
        cache: Dict[str, int],
    ) -> Optional[Chunk]:
        """The cut of ``chunk`` that ``cut="query"`` keeps: the run of its sentence ``pieces`` (each
        with its query terms) that :func:`best_run` picks among those that fit the budget next to
        ``selected`` with at least ``min_cut_tokens`` tokens; :meth:`_best_cut`'s prefix (finer
        boundaries) when that run starts the chunk or no piece matches."""
        if len(pieces) <= 1 or not chunk.has_offsets:
            return self._best_cut(selected, chunk, cache)
        assert chunk.start is not None

        def run(i: int, j: int) -> Chunk:
            start, end = pieces[i][0].start, pieces[j][0].end
            assert start is not None and end is not None
            text = chunk.text[start - chunk.start : end - chunk.start].rstrip()
            return part_of_chunk(chunk, start, text)

        def fits(i: int, j: int) -> bool:
            return self._fits(selected, run(i, j), cache) is not None

        def long_enough(i: int, j: int) -> bool:
            return self._tokens(run(i, j).text, cache) >= self.min_cut_tokens

        found = best_run(weights, [terms for _, terms in pieces], fits, long_enough)
        if found is None or found[0] == 0:
            return self._best_cut(selected, chunk, cache)
        return run(*found)

    def select(
        self, chunks: Sequence[Chunk], query_str: Optional[str] = None
    ) -> Tuple[List[Chunk], Dict[str, str], List[str]]:
        """Fill the budget by relevance; returns ``(selected, same-id duplicates, over-budget ids)``.

        Chunks are taken best first; a chunk costs what it adds to the merged context (an
        overlapping window only its new text, a chunk inside a taken span nothing), so the
        budget is never spent twice on the same source text. A chunk that does not fit whole is
        cut to the room left (``cut``): to the run of its sentences holding the most weight of
        ``query_str``'s terms (``"query"``, :func:`best_run`; IDF over all candidates' sentences),
        or to its prefix at a sentence (else word) boundary (``"prefix"``, and without a query).
        """
        duplicates: Dict[str, str] = {}
        pool: Dict[str, Chunk] = {}
        for c in chunks:
            if c.node_id in pool:
                duplicates.setdefault(c.node_id, c.node_id)
            else:
                pool[c.node_id] = c
        ranked = sorted(pool.values(), key=lambda c: (-c.score, c.rank))
        terms = self.query_terms(query_str) if self.cut is CutMode.QUERY and query_str else []
        pieces: Dict[str, List[Tuple[Chunk, frozenset]]] = {}  # filled at the first cut
        weights: Dict[str, float] = {}
        selected: List[Chunk] = []
        over: List[str] = []
        cache: Dict[str, int] = {}
        used = 0
        for c in ranked:
            # Text that shares no character with the context adds about its own tokens at least
            # (the file name another span's compact hint may drop is one its own hint names): skip
            # checks that cannot fit. Only a shortcut: whatever is added passed the exact count.
            fresh = not _overlaps(c, selected)
            room = self.max_tokens - used + _JOIN_SLACK_TOKENS
            if not fresh or self._tokens(c.text, cache) <= room:
                cost = self._fits(selected, c, cache)
                if cost is not None:
                    selected.append(c)
                    used = cost
                    continue
            if fresh and room < self.min_cut_tokens:
                over.append(c.node_id)
                continue
            if terms:
                if not pieces:  # every candidate's sentence pieces with their query terms, and the terms' IDF
                    query = frozenset(terms)
                    for r in ranked:
                        pieces[r.node_id] = [(p, query.intersection(self.query_terms(p.text))) for p in chunk_pieces(r)]
                    weights = query_idf(terms, [t for r in ranked for _, t in pieces[r.node_id]])
                cut = self._best_window(selected, c, pieces[c.node_id], weights, cache)
            else:
                cut = self._best_cut(selected, c, cache)
            if cut is not None:
                selected.append(cut)
                used = self._cost(merge_spans(selected, self.max_gap_chars, self.merge_sections)[0], cache)
            else:
                over.append(c.node_id)
        return selected, duplicates, over

    def _tokens(self, text: str, cache: Dict[str, int]) -> int:
        """Tokens of ``text``, counted once per call of :meth:`select` (``cache``)."""
        if text not in cache:
            cache[text] = self.count_tokens(text)
        return cache[text]

    def _node(self, span: Span, hint: str, id_doc: str) -> NodeWithScore:
        """The assembled node of ``span``; its id is uuid5 of ``id_doc`` (the doc id, or the doc id and
        file when two documents of the context share the id) and the span."""
        best = span.best
        node_id = chunk_id(id_doc, CONTEXT_NODE_KIND, span.start, span.end) if span.start is not None else best.node_id
        prefix = node_text(hint, "")
        metadata = {
            "doc_id": span.doc_id,
            "file_name": best.file_name,
            "file_path": best.file_path,
            "source": best.source,
            "section_path": list(span.section_path),
            "section_header": " > ".join(span.section_path),
            "page_start": span.page_start,
            "page_end": span.page_end,
            "char_start": span.start,
            "char_end": span.end,
            "citation": hint,
            "hint_chars": len(prefix),
            "truncated": span.truncated,
            "source_node_ids": [c.node_id for c in span.chunks],
            "source_scores": [c.score for c in span.chunks],
            "source_details": {c.node_id: c.details for c in span.chunks},
            "relevance": span.score,
        }
        node = TextNode(
            id_=node_id,
            text=node_text(hint, span.text),
            metadata=metadata,
            excluded_llm_metadata_keys=list(metadata),
            excluded_embed_metadata_keys=list(metadata),
            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=span.doc_id)},
        )
        return NodeWithScore(node=node, score=span.score)

    def assemble(
        self, nodes: Sequence[NodeWithScore], query_str: Optional[str] = None
    ) -> Tuple[List[NodeWithScore], AssemblyReport]:
        """The context nodes for ``nodes`` (retrieved for ``query_str``) and this call's report (see the
        class docstring): the per-call way to get a report, safe with concurrent calls (not traced,
        and :attr:`last_report` is left alone)."""
        report = AssemblyReport(max_tokens=self.max_tokens, input_nodes=len(nodes))
        chunks = drop_inconsistent_offsets([chunk_from_result(r, i) for i, r in enumerate(nodes)])
        if self.expand_to_parent:
            chunks = [expand_chunk(c) for c in chunks]
        report.spans = len(merge_spans(chunks, self.max_gap_chars, self.merge_sections)[0])
        selected, same_id, over = self.select(chunks, query_str)
        spans, contained = merge_spans(selected, self.max_gap_chars, self.merge_sections)
        report.left_out.extend(LeftOut(i, DUPLICATE_OF.format(of)) for i, of in {**same_id, **contained}.items())
        report.left_out.extend(LeftOut(i, OVER_BUDGET) for i in over)

        out: List[NodeWithScore] = []
        ordered = order_spans(spans, self.order)
        ids_per_doc: Dict[str, set] = {}
        for span in ordered:
            ids_per_doc.setdefault(span.doc_id, set()).add(span.doc_key)
        for span, hint in zip(ordered, self._hints(ordered)):
            shared_id = len(ids_per_doc[span.doc_id]) > 1
            result = self._node(span, hint, "|".join(span.doc_key) if shared_id else span.doc_id)
            out.append(result)
            # counted on the text the LLM reads, as _cost counted it during selection
            report.used_tokens += self.count_tokens(result.node.get_content(metadata_mode=MetadataMode.LLM))
            for c in span.chunks:
                report.merged_into.setdefault(c.node_id, result.node.node_id)
            if span.truncated:
                report.truncated.append(result.node.node_id)
        report.assembled = len(out)
        return out, report

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        out, report = self._assemble_traced(nodes, query_bundle)
        self._reports.set(report)
        return out

    async def _apostprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        """As LlamaIndex does (the work in a thread), with the report kept for the awaiting task."""
        out, report = await asyncio.to_thread(self._assemble_traced, nodes, query_bundle)
        self._reports.set(report)
        return out

    def _assemble_traced(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle]
    ) -> Tuple[List[NodeWithScore], AssemblyReport]:
        """:meth:`assemble`, traced when tracing is on."""
        traced = tracing_enabled()
        started = time.perf_counter()
        out, report = self.assemble(nodes, query_bundle.query_str if query_bundle is not None else None)
        if traced:
            trace_assembly(self, query_bundle, nodes, out, report, started)
        logger.debug(
            "context: %d results -> %d spans -> %d nodes, %d/%d tokens, %d left out",
            report.input_nodes,
            report.spans,
            report.assembled,
            report.used_tokens,
            report.max_tokens,
            len(report.left_out),
        )
        return out, report
