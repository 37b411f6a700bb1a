"""Context assembly: :class:`ContextAssembler`, a LlamaIndex node postprocessor.

It turns retrieved chunks into the context an LLM reads, within a token budget:

1. **deduplicate and merge** (:func:`merge_spans`): a node id seen twice is kept once; chunks of
   one document whose character spans overlap (window chunks overlap by design) or touch within
   one section (any sections with ``merge_sections``, the default: one hint then covers them,
   and the text keeps their headings) become one span. The span's text is rebuilt from the chunks' own texts and
   offsets (``text1 + text2[e1 - s2:]``), which is exact because every chunk of the metadata
   contract satisfies ``doc.text[char_start:char_end] == node.text``: no character of the
   source is repeated. A gap between chunks of the same parent is filled from ``parent_text``
   (hierarchy children) when it is at most ``max_gap_chars``; other gaps keep separate spans.
   ``expand_to_parent=True`` replaces each hierarchy child by its parent section.
2. **fill the budget by relevance** (:meth:`ContextAssembler.select`): chunks best first, each
   costing what it adds to the merged context (an overlapping window pays only for its new
   text), so the budget is never spent twice on one source character; a chunk that does not
   fit whole is cut to the room left at a sentence boundary (:func:`cut_at_sentence`'s rule;
   else a word boundary). A span's relevance is its best chunk's score. Tokens are counted with
   a real tokenizer on the text the LLM reads, hints included: the embedding model's by default
   (``tokenizer_name``), or any ``str -> list`` callable (``tokenizer=``).
3. **order** (:func:`order_spans`, :class:`ContextOrder`): by relevance, in document order, or
   "bookends" - the most relevant spans at the start and the end of the context, because LLMs
   use information in the middle of a long context worst (Liu et al. 2024, "Lost in the
   Middle: How Language Models Use Long Contexts", TACL).

Each result is a new ``TextNode`` whose text starts with a citation hint
(:func:`citation_hints`; ``hint_style="full"``: ``[terms.pdf, 3. Fees > 3.2 Late payment, p. 4]``;
the default ``"compact"`` leaves out what the LLM reads anyway - the file name the previous span
cited, the section path's shared parent, a section whose heading starts the span - e.g.
``[3.2 Late payment, p.4]``; the hints cost tokens of the budget) followed by the exact source span; its metadata (hidden from the LLM and the embedder) records the document,
section, pages, span offsets and the chunks it was built from with their scores. What was left
out (duplicates, over budget) is in :attr:`ContextAssembler.last_report`. Input nodes are never
changed.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeRelationship, NodeWithScore, QueryBundle, RelatedNodeInfo, TextNode

from ..models import DEFAULT_EMBED_MODEL
from ..node_parser.metadata import chunk_id
from ..node_parser.tokenization import token_span_fn
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
    "chunk_from_result",
    "citation_hints",
    "citation_text",
    "cut_at_sentence",
    "cut_chunk",
    "merge_spans",
    "order_spans",
    "page_text",
]

#: Node kind used for the deterministic ids of assembled nodes (uuid5 of doc id + span).
CONTEXT_NODE_KIND = "context"
#: Reasons recorded in :class:`AssemblyReport`.
OVER_BUDGET = "over budget"
DUPLICATE_OF = "duplicate of {}"
#: Metadata keys of assembled nodes (all hidden from the LLM: the hint in the text carries the citation).
CONTEXT_METADATA_KEYS = (
    "doc_id",
    "file_name",
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


class ContextOrder(ChoiceEnum):
    """How assembled spans are ordered in the context."""

    RELEVANCE = "relevance"  # best span first
    DOCUMENT = "document"  # documents by relevance, spans of a document in document order
    BOOKENDS = "bookends"  # best spans at the start and the end (Lost in the Middle, Liu et al. 2024)

class HintStyle(ChoiceEnum):
    """How much each citation hint says (every style but "none" keeps a citation on every span)."""

    FULL = "full"  # [terms.pdf, 3. Fees > 3.2 Late payment, p. 4] on every span
    COMPACT = "compact"  # what the LLM reads anyway is left out: [3.2 Late payment, p.4], [p.5]
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

    @property
    def has_offsets(self) -> bool:
        return self.start is not None and self.end is not None


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
    """The :class:`Chunk` view of a retrieved result (its node is only read, never changed)."""
    node = result.node
    meta = node.metadata or {}
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    start, end = _int_or_none(meta.get("char_start")), _int_or_none(meta.get("char_end"))
    if start is None or end is None or end - start != len(text):
        start = end = None
    details: Dict[str, Any] = {"score": result.score}
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
    )


def expand_chunk(chunk: Chunk) -> Chunk:
    """``chunk`` widened to its parent section when it carries ``parent_text`` (else unchanged).

    Pages stay the chunk's: the parent's pages are not in the chunk metadata contract.
    """
    if chunk.parent_text is None or chunk.parent_start is None:
        return chunk
    return Chunk(
        **{
            **chunk.__dict__,
            "start": chunk.parent_start,
            "end": chunk.parent_start + len(chunk.parent_text),
            "text": chunk.parent_text,
        }
    )


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
    document merge into one span when their spans overlap, or touch (``e1 == s2``) within one
    section (in any sections with ``merge_sections``: one hint then covers both), or - when a parent text covers the gap - lie at most ``max_gap_chars`` apart. The
    merged text is ``text1 + text2[e1 - s2:]`` (exact: chunk texts are ``doc.text[s:e]``), so
    no source character is repeated. Spans come out by document then offset.
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
    by_text: Dict[Tuple[str, str], Span] = {}
    by_doc: Dict[str, List[Chunk]] = {}
    for c in unique:
        if c.has_offsets:
            by_doc.setdefault(c.doc_id, []).append(c)
            continue
        key = (c.doc_id, c.text)
        if key in by_text:  # the same text without offsets: one span
            by_text[key].chunks.append(c)
            duplicates[c.node_id] = by_text[key].chunks[0].node_id
            continue
        span = Span(c.doc_id, None, None, c.text, [c], c.section_path)
        by_text[key] = span
        spans.append(span)

    for doc_id in sorted(by_doc):
        ordered = sorted(by_doc[doc_id], key=lambda c: (c.start, -c.end, c.rank))
        current: Optional[Span] = None
        for c in ordered:
            assert c.start is not None and c.end is not None
            if current is not None:
                assert current.start is not None and current.end is not None
                if c.end <= current.end:  # held whole by the span
                    holder = max(
                        (h for h in current.chunks if h.start <= c.start and c.end <= h.end and h.node_id not in contained),
                        key=lambda h: h.end - h.start,
                        default=None,
                    )
                    if holder is not None:
                        duplicates[c.node_id] = holder.node_id
                        contained.add(c.node_id)
                    current.chunks.append(c)
                    continue
                last = current.chunks[-1]
                if c.start < current.end or (
                    c.start == current.end and (merge_sections or c.section_path == last.section_path)
                ):
                    current.text += c.text[current.end - c.start :]
                    current.end = c.end
                    current.chunks.append(c)
                    continue
                gap = c.start - current.end
                filler = _gap_text(last, c, current.end, c.start) if 0 < gap <= max_gap_chars else None
                if filler is not None and last.parent_id is not None and last.parent_id == c.parent_id:
                    current.text += filler + c.text
                    current.end = c.end
                    current.chunks.append(c)
                    continue
            current = Span(doc_id, c.start, c.end, c.text, [c], c.section_path)
            spans.append(current)
    for span in spans:
        span.section_path = span.best.section_path
    return spans, duplicates


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


def citation_hints(ordered: Sequence[Span], compact: bool = False) -> List[str]:
    """The citation hint of each span of ``ordered`` (the spans in context order).

    Full: :func:`citation_text` of the file name, section path and pages. ``compact`` leaves out
    what the LLM reads anyway: the file name when the previous span cites the same file, the
    section path's parent when the previous span of the same document shares it (only the last
    element is kept), and the whole section path when the span itself starts with the section's
    heading; pages read ``p.4``/``pp.3-4``. A compact hint never comes out empty: with nothing
    else to say it names the file.
    """
    hints: List[str] = []
    prev_name: Optional[str] = None
    prev_path: Dict[str, Tuple[str, ...]] = {}  # doc id -> section path of its previous span
    for span in ordered:
        name = span_file_name(span)
        path = tuple(p for p in span.section_path if p)
        if not compact:
            hints.append(citation_text(name, path, span.page_start, span.page_end))
            continue
        shown_name: Optional[str] = None if name == prev_name else name
        before = prev_path.get(span.doc_id)
        shown_path = path
        if before is not None and len(path) > 1 and before[: len(path) - 1] == path[:-1]:
            shown_path = path[-1:]
        if path and span.text.lstrip().startswith(path[-1]):
            shown_path = ()  # the span starts with its section heading: the LLM reads it there
        pages = page_text(span.page_start, span.page_end, compact=True)
        parts = [p for p in (shown_name, " > ".join(shown_path), pages) if p] or [name]
        hints.append(f"[{', '.join(parts)}]")
        prev_name, prev_path[span.doc_id] = name, path
    return hints


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
    doc_rank: Dict[str, int] = {}
    for s in by_relevance:
        doc_rank.setdefault(s.doc_id, len(doc_rank))
    return sorted(
        by_relevance,
        key=lambda s: (doc_rank[s.doc_id], s.start if s.start is not None else float("inf"), -s.score, s.rank),
    )


def word_boundaries(text: str) -> List[int]:
    """Offsets just after each word (a non-space character followed by whitespace) and the end."""
    return [m.end() for m in _WORD_END.finditer(text)] + [len(text)]


def cut_chunk(chunk: Chunk, length: int) -> Chunk:
    """The first ``length`` characters of ``chunk`` (trailing whitespace dropped), marked truncated.

    Still exact: ``doc.text[start:start + len(text)]`` is the cut text.
    """
    text = chunk.text[:length].rstrip()
    end = chunk.start + len(text) if chunk.start is not None else None
    return Chunk(**{**chunk.__dict__, "text": text, "end": end, "truncated": True})


# ------------------------------------------------------------------------------ the postprocessor
class ContextAssembler(BaseNodePostprocessor):
    """Turn retrieved chunks into a deduplicated, cited context of at most ``max_tokens`` tokens.

    ``postprocess_nodes(nodes, query_str=...)`` returns new nodes whose texts, in order, are
    the context: each starts with a citation hint and holds an exact span of its document.
    See the module docstring; :attr:`last_report` tells what the last call left out.
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
        description="'compact' (default: what the LLM reads anyway is left out - the file name when the previous "
        "span cites the same file, the section path's prefix shared with the document's previous span, the section "
        "when the span starts with its heading - and pages as 'p.4'; it covers the most evidence in "
        "benchmarks/context_assembly.py), 'full' (file, whole section path "
        "and pages on every span) or 'none' (no hint; file, section and pages stay in the node metadata).",
    )
    merge_sections: bool = Field(
        default=True,
        description="Merge chunks of one document that touch across a section boundary into one span under one "
        "hint (the text keeps the section headings); False: one span per section.",
    )
    tokenizer_name: str = Field(
        default=DEFAULT_EMBED_MODEL,
        description="Hugging Face tokenizer (model id or local folder) that counts tokens; the default is the "
        "packaged all-MiniLM-L6-v2 embedding model's. Ignored when a `tokenizer` callable is passed.",
    )

    _tokenizer: Optional[Callable[[str], Sequence]] = PrivateAttr(default=None)
    _span_fn: Any = PrivateAttr(default=None)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)
    _last_report: Optional[AssemblyReport] = PrivateAttr(default=None)

    def __init__(self, tokenizer: Optional[Callable[[str], Sequence]] = None, **data: Any) -> None:
        if tokenizer is not None and not callable(tokenizer):
            raise ValueError(f"tokenizer must be a callable str -> list of tokens, got {type(tokenizer).__name__}")
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

    @field_validator("hint_style", mode="before")
    @classmethod
    def _check_hint_style(cls, value: Any) -> HintStyle:
        return HintStyle.from_str(value)

    @property
    def last_report(self) -> Optional[AssemblyReport]:
        """What the last :meth:`postprocess_nodes` call did (None before the first)."""
        return self._last_report

    # -- tokens ------------------------------------------------------------------------
    def _spans_of(self, text: str) -> Any:
        if self._span_fn is None:
            with self._lock:
                if self._span_fn is None:
                    self._span_fn = token_span_fn(self.tokenizer_name, self._tokenizer)
        return self._span_fn(text)

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` as the budget counts them."""
        return len(self._spans_of(text)) if text else 0

    # -- assembly ----------------------------------------------------------------------
    def _hints(self, ordered: Sequence[Span]) -> List[str]:
        """The citation hint of each span of ``ordered`` (the spans in context order)."""
        if not self.include_hint or self.hint_style is HintStyle.NONE:
            return ["" for _ in ordered]
        return citation_hints(ordered, compact=self.hint_style is HintStyle.COMPACT)

    def _cost(self, spans: Sequence[Span], cache: Dict[str, int]) -> int:
        """Tokens of the context the spans make, in context order (each hint, its newline and the span text)."""
        total = 0
        ordered = order_spans(spans, self.order)
        for span, hint in zip(ordered, self._hints(ordered)):
            for text in (f"{hint}\n" if hint else "", span.text):
                if text not in cache:
                    cache[text] = self.count_tokens(text)
                total += cache[text]
        return total

    def _best_cut(self, selected: List[Chunk], chunk: Chunk, cache: Dict[str, int]) -> Optional[Chunk]:
        """The longest prefix of ``chunk`` ending at a sentence boundary (else a word boundary)
        that fits the budget next to ``selected``, with at least ``min_cut_tokens`` tokens; None if none."""

        def fits(length: int) -> Optional[Chunk]:
            cut = cut_chunk(chunk, length)
            if not cut.text or self.count_tokens(cut.text) < self.min_cut_tokens:
                return None
            spans, _ = merge_spans(selected + [cut], self.max_gap_chars, self.merge_sections)
            return cut if self._cost(spans, cache) <= self.max_tokens else None

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
            return found

        return longest(sentence_boundaries(chunk.text)) or longest(word_boundaries(chunk.text))

    def select(self, chunks: Sequence[Chunk]) -> Tuple[List[Chunk], Dict[str, str], List[str]]:
        """Fill the budget by relevance; returns ``(selected, same-id duplicates, over-budget ids)``.

        Chunks are taken best first; a chunk costs what it adds to the merged context (an
        overlapping window only its new text, a chunk inside a taken span nothing), so the
        budget is never spent twice on the same source text. A chunk that does not fit whole
        is cut to the room left at a sentence (else word) boundary.
        """
        duplicates: Dict[str, str] = {}
        pool: Dict[str, Chunk] = {}
        for c in chunks:
            if c.node_id in pool:
                duplicates.setdefault(c.node_id, c.node_id)
            else:
                pool[c.node_id] = c
        selected: List[Chunk] = []
        over: List[str] = []
        cache: Dict[str, int] = {}
        for c in sorted(pool.values(), key=lambda c: (-c.score, c.rank)):
            spans, _ = merge_spans(selected + [c], self.max_gap_chars, self.merge_sections)
            if self._cost(spans, cache) <= self.max_tokens:
                selected.append(c)
                continue
            cut = self._best_cut(selected, c, cache)
            if cut is not None:
                selected.append(cut)
            else:
                over.append(c.node_id)
        return selected, duplicates, over

    def _node(self, span: Span, hint: str) -> NodeWithScore:
        best = span.best
        node_id = chunk_id(span.doc_id, CONTEXT_NODE_KIND, span.start, span.end) if span.start is not None else best.node_id
        prefix = f"{hint}\n" if hint else ""
        metadata = {
            "doc_id": span.doc_id,
            "file_name": best.file_name,
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
            text=prefix + span.text,
            metadata=metadata,
            excluded_llm_metadata_keys=list(metadata),
            excluded_embed_metadata_keys=list(metadata),
            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=span.doc_id)},
        )
        return NodeWithScore(node=node, score=span.score)

    def assemble(self, nodes: Sequence[NodeWithScore]) -> Tuple[List[NodeWithScore], AssemblyReport]:
        """The context nodes for ``nodes`` and the report (see the class docstring)."""
        report = AssemblyReport(max_tokens=self.max_tokens, input_nodes=len(nodes))
        chunks = [chunk_from_result(r, i) for i, r in enumerate(nodes)]
        if self.expand_to_parent:
            chunks = [expand_chunk(c) for c in chunks]
        report.spans = len(merge_spans(chunks, self.max_gap_chars, self.merge_sections)[0])
        selected, same_id, over = self.select(chunks)
        spans, contained = merge_spans(selected, self.max_gap_chars, self.merge_sections)
        report.left_out.extend(LeftOut(i, DUPLICATE_OF.format(of)) for i, of in {**same_id, **contained}.items())
        report.left_out.extend(LeftOut(i, OVER_BUDGET) for i in over)

        out: List[NodeWithScore] = []
        cache: Dict[str, int] = {}
        ordered = order_spans(spans, self.order)
        for span, hint in zip(ordered, self._hints(ordered)):
            result = self._node(span, hint)
            out.append(result)
            for text in (f"{hint}\n" if hint else "", span.text):  # as _cost counts them
                if text not in cache:
                    cache[text] = self.count_tokens(text)
                report.used_tokens += cache[text]
            for c in span.chunks:
                report.merged_into.setdefault(c.node_id, result.node.node_id)
            if span.truncated:
                report.truncated.append(result.node.node_id)
        report.assembled = len(out)
        return out, report

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        traced = tracing_enabled()
        started = time.perf_counter()
        out, report = self.assemble(nodes)
        self._last_report = report
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
        return out
