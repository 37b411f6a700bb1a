"""Shared machinery of the section-aware node parsers: sections, tokens, nodes, serialisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
from llama_index.core.node_parser.interface import NodeParser
from llama_index.core.node_parser.node_utils import default_id_func
from llama_index.core.schema import BaseNode, Document, NodeRelationship, RelatedNodeInfo, TextNode

from .._options import StrictOptions
from ..models import DEFAULT_EMBED_MODEL
from ..readers.base import DOCUMENT_ONLY_KEYS
from ..retrievers.node_copy import copy_related
from ..retrievers.node_identity import check_chunk_ids
from .metadata import chunk_metadata, excluded_keys
from .sections import HeadingRules, Section, compile_patterns, detect_headings, headings_from_outline, split_sections
from .tokenization import BatchTokenSpanFn, batch_token_span_fn
from .tokenizer_identity import PicklesTokenizer, recorded_tokenizer
from .windows import TokenSpans, Window, limit_window_chars, plan_span_windows

#: Characters per token of the chunk size that a chunk may hold when ``max_chunk_chars`` is unset.
DEFAULT_CHARS_PER_TOKEN = 10
#: Most characters tokenized before the first chunk of a batch of documents is made.
TOKENIZE_BATCH_CHARS = 8_000_000


@dataclass(frozen=True)
class DocumentTokens:
    """A document's text with its token spans, sliceable by character range."""

    text: str
    spans: TokenSpans

    @classmethod
    def build(cls, text: str, spans: Sequence[tuple[int, int]]) -> "DocumentTokens":
        return cls(text, TokenSpans.from_pairs(spans, len(text)))

    @property
    def starts(self) -> Sequence[int]:
        """Start offset of every token, sorted."""
        return self.spans.starts

    def windows(
        self,
        start: int,
        end: int,
        chunk_size: int,
        overlap: int,
        slack: float,
        min_tail: int,
        max_chars: Optional[int] = None,
    ) -> List[Window]:
        """Windows over ``text[start:end]``, in document offsets, at most ``max_chars`` long."""
        spans = self.spans
        windows = plan_span_windows(
            self.text, spans.starts, spans.ends, start, end, chunk_size, overlap, slack, min_tail
        )
        if max_chars is None:
            return windows
        return limit_window_chars(self.text, windows, max_chars, spans.starts)


def document_batches(nodes: Sequence[BaseNode], max_docs: int, max_chars: int) -> Iterator[List[BaseNode]]:
    """Consecutive groups of ``nodes`` with at most ``max_docs`` documents and, unless a single
    document is larger, at most ``max_chars`` characters."""
    batch: List[BaseNode] = []
    size = 0
    for node in nodes:
        length = len(node.get_content())
        if batch and (len(batch) >= max_docs or size + length > max_chars):
            yield batch
            batch, size = [], 0
        batch.append(node)
        size += length
    if batch:
        yield batch


class SectionAwareNodeParser(PicklesTokenizer, StrictOptions, NodeParser):
    """Base for parsers that cut documents on their sections (not used directly).

    Every keyword is a field or ``tokenizer`` (anything else is a TypeError listing them).
    ``include_metadata=False`` gives chunks the metadata contract only (no document keys).
    ``id_func`` is refused: chunk ids are deterministic (doc id + span).
    """

    __init_options__ = ("tokenizer",)

    tokenizer_name: str = Field(
        default=DEFAULT_EMBED_MODEL,
        description="Hugging Face tokenizer (model id or local folder) that measures chunk sizes; "
        "the default is the packaged all-MiniLM-L6-v2 embedding model's tokenizer. Ignored when a "
        "`tokenizer` callable is passed.",
    )
    tokenizer_callable: Optional[str] = Field(
        default=None,
        description="Name of the `tokenizer` callable that measures chunk sizes (set from `tokenizer=`: "
        "'tiktoken:<encoding>' or 'custom:<module>.<qualname>'); None: `tokenizer_name` measures. Recorded so that "
        "to_dict(), cache hashes and index manifests tell tokenizers apart; a parser rebuilt from a dict naming one "
        "needs `tokenizer=` passed again (else a ValueError).",
    )
    heading_patterns: List[str] = Field(
        default_factory=list,
        description="Extra heading regexes, tried first on each stripped line. Optional named groups: "
        "`title`, `number` (dots give the level) or `level`.",
    )
    detect_markdown_headings: bool = Field(default=True, description="Treat '#' lines as headings.")
    detect_numbered_headings: bool = Field(default=True, description="Treat '1.', '2 Fees', '3.1.2 ...' as headings.")
    detect_keyword_headings: bool = Field(
        default=True, description="Treat 'Section 4', 'ARTICLE IV', 'Schedule A', 'Appendix B' lines as headings."
    )
    detect_caps_headings: bool = Field(default=True, description="Treat short ALL-CAPS lines as headings.")
    use_pdf_outline: bool = Field(
        default=True, description="Use the PDF outline (bookmarks) recorded by PagedPDFReader when it has one."
    )
    max_heading_chars: int = Field(default=90, gt=0, description="Longer lines are never headings.")
    merge_empty_sections: bool = Field(
        default=True,
        description="A heading with no body text before its first sub-heading joins that sub-section's "
        "first chunk instead of becoming a chunk of its own.",
    )
    sentence_slack: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="End a window at a sentence end if one lies within this share of the size limit.",
    )
    max_chunk_chars: Optional[int] = Field(
        default=None,
        gt=0,
        description="Maximum characters per chunk. Token limits alone do not bound length: a run without "
        "spaces (a URL, a base64 blob, a 1 MB 'word') is a single unknown token. Longer windows are cut "
        f"after whitespace when possible, else hard. None: {DEFAULT_CHARS_PER_TOKEN} characters per token "
        "of the size limit (chunk_size * 10; for parents, parent_chunk_size * 10).",
    )
    contextual_header: bool = Field(
        default=False,
        description="Prefix the section path (e.g. '3. Fees > 3.2 Late fees') to the text that is embedded; "
        "the stored text is unchanged.",
    )

    _tokenizer: Optional[Callable[[str], Sequence]] = PrivateAttr(default=None)
    _span_fn: Optional[BatchTokenSpanFn] = PrivateAttr(default=None)

    def __init__(self, tokenizer: Optional[Callable[[str], Sequence]] = None, **data: Any) -> None:
        data["tokenizer_callable"] = recorded_tokenizer(self.class_name(), tokenizer, data.get("tokenizer_callable"))
        super().__init__(**data)
        compile_patterns(self.heading_patterns)  # fail now, naming the bad pattern
        self._tokenizer = tokenizer

    @model_validator(mode="before")
    @classmethod
    def _check_id_func(cls, data: Any) -> Any:
        """Chunk ids are deterministic (doc id + kind + span, see ``metadata.chunk_id``): a custom
        ``id_func`` is refused. LlamaIndex serialises ``id_func`` as a dict it cannot load back; a
        serialised one (``to_dict()``) is dropped on load."""
        if not isinstance(data, dict) or "id_func" not in data:
            return data
        id_func = data["id_func"]
        if id_func is None or id_func is default_id_func or isinstance(id_func, dict):
            return {k: v for k, v in data.items() if k != "id_func"}
        raise ValueError(
            f"{cls.__name__} does not take id_func (got {getattr(id_func, '__qualname__', id_func)!r}): chunk ids are "
            "deterministic, uuid5 of the document id, node kind and character span, so re-parsing a document gives "
            "the same ids (upserts and caches rely on it). Give documents the ids you want (doc_id metadata) instead"
        )

    def __getstate__(self) -> Dict[str, Any]:
        """Pickle state without the cached span function (a closure, rebuilt on first use):
        LlamaIndex would otherwise log a root-logger WARNING for it on every pickling, e.g. for
        each worker of ``IngestionPipeline.run(num_workers=...)``. ``self`` keeps its cache."""
        span_fn, self._span_fn = self._span_fn, None
        try:
            return super().__getstate__()
        finally:
            self._span_fn = span_fn

    # -- pieces used by subclasses -------------------------------------------------------
    def token_spans(self, texts: Sequence[str]) -> List[TokenSpans]:
        """Token character spans of each text, as this parser measures tokens."""
        if self._span_fn is None:
            self._span_fn = batch_token_span_fn(self.tokenizer_name, self._tokenizer)
        return self._span_fn(texts)

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` as this parser measures them."""
        return len(self.token_spans([text])[0])

    def chunk_char_limit(self, chunk_tokens: int) -> int:
        """Most characters of a chunk whose token limit is ``chunk_tokens``."""
        return self.max_chunk_chars or DEFAULT_CHARS_PER_TOKEN * chunk_tokens

    def tokenized_documents(self, nodes: Sequence[BaseNode], show_progress: bool, batch_size: int = 256) -> Any:
        """Yield ``(doc, DocumentTokens)``, tokenizing documents in batches (at most
        ``batch_size`` documents and, unless one is larger, ``TOKENIZE_BATCH_CHARS`` characters)."""
        for batch in document_batches(nodes, batch_size, TOKENIZE_BATCH_CHARS):
            texts = [doc.get_content() for doc in batch]
            for doc, text, spans in zip(batch, texts, self.token_spans(texts)):
                yield doc, DocumentTokens.build(text, spans)

    def heading_rules(self) -> HeadingRules:
        return HeadingRules(
            markdown=self.detect_markdown_headings,
            numbered=self.detect_numbered_headings,
            keywords=self.detect_keyword_headings,
            all_caps=self.detect_caps_headings,
            custom_patterns=tuple(self.heading_patterns),
            max_heading_chars=self.max_heading_chars,
        )

    def sections_of(self, doc: BaseNode) -> List[Section]:
        """The sections of a document: outline headings when usable, else detected ones."""
        text = doc.get_content()
        outline = doc.metadata.get("outline") if self.use_pdf_outline else None
        headings = []
        if outline:
            headings = headings_from_outline(text, outline, doc.metadata.get("page_starts") or [0])
            if len(headings) < max(1, len(outline) // 2):
                headings = []
        if not headings:
            headings = detect_headings(text, self.heading_rules())
        sections = split_sections(text, headings)
        return merge_heading_only_sections(text, sections) if self.merge_empty_sections else sections

    def make_node(
        self,
        doc: BaseNode,
        kind: str,
        index: int,
        start: int,
        end: int,
        section: Section,
        extra: Optional[Dict[str, Any]] = None,
        source: Optional[RelatedNodeInfo] = None,
    ) -> TextNode:
        """A TextNode for ``doc.text[start:end]`` carrying the metadata contract.

        ``source`` is ``doc.as_related_node_info()``; pass it in to hash the document once.
        """
        doc_id = doc.metadata.get("doc_id") or doc.node_id
        doc_meta = doc.metadata if self.include_metadata else contract_sources(doc.metadata)
        meta = chunk_metadata(doc_meta, doc_id, kind, index, start, end, section.title, section.path)
        if extra:
            meta.update(extra)
        embed_ex, llm_ex = excluded_keys(
            meta, doc.excluded_embed_metadata_keys, doc.excluded_llm_metadata_keys, self.contextual_header
        )
        node = TextNode(
            id_=meta["chunk_id"],
            text=doc.get_content()[start:end],
            metadata=meta,
            excluded_embed_metadata_keys=embed_ex,
            excluded_llm_metadata_keys=llm_ex,
            start_char_idx=start,
            end_char_idx=end,
        )
        # The chunk's own copy (metadata at every depth): changing the document later leaves it alone.
        node.relationships[NodeRelationship.SOURCE] = copy_related(source if source else doc.as_related_node_info())
        return node

    def iter_documents(self, nodes: Sequence[BaseNode], show_progress: bool) -> Any:
        """``(doc, DocumentTokens)`` pairs with a progress bar."""
        items = self.tokenized_documents(nodes, show_progress)
        if not show_progress:
            return items
        from tqdm.auto import tqdm

        return tqdm(items, total=len(nodes), desc=f"Parsing ({self.class_name()})", unit="doc")

    # -- LlamaIndex hooks --------------------------------------------------------------
    def _postprocess_parsed_nodes(self, nodes: List[BaseNode], parent_doc_map: Dict[str, Document]) -> List[BaseNode]:
        """Offsets, metadata and relationships are set at construction: nothing to redo.

        (LlamaIndex's default would re-find each chunk with ``str.find``, which picks the wrong
        copy of repeated text, and would copy page tables into every chunk.) Chunks of two
        documents with one id (two Documents sharing ``metadata["doc_id"]``) are refused with
        :class:`~..retrievers.node_identity.ChunkIdConflictError`: any store would keep one of them.
        """
        check_chunk_ids(nodes)
        return nodes


def contract_sources(doc_metadata: Dict[str, Any]) -> Dict[str, Any]:
    """The document keys the metadata contract is computed from (page tables, ``source``): what
    ``include_metadata=False`` passes on, so chunks carry the contract keys and nothing else."""
    return {k: v for k, v in doc_metadata.items() if k in DOCUMENT_ONLY_KEYS or k == "source"}


def link_prev_next(nodes: Sequence[TextNode]) -> None:
    """PREVIOUS/NEXT relationships along a sequence of new nodes of one document."""
    for a, b in zip(nodes, nodes[1:]):
        a.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=b.node_id)
        b.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=a.node_id)


def merge_heading_only_sections(text: str, sections: List[Section]) -> List[Section]:
    """Join a section that is only its heading to the following sub-section.

    "3. Interest\\n\\n3.1 Purchase rate ..." gives one section titled "3.1 Purchase rate" whose
    span starts at "3. Interest" (its path already names section 3), so no chunk is a lone
    heading. A heading-only section followed by a sibling stays as it is.
    """
    out: List[Section] = []
    pending: Optional[Section] = None
    for sec in sections:
        if pending is not None:
            if sec.level > pending.level and sec.path[: len(pending.path)] == pending.path:
                sec = Section(sec.title, sec.path, sec.level, pending.start, sec.end, sec.heading_end)
            else:
                out.append(pending)
            pending = None
        body = text[sec.heading_end : sec.end]
        if sec.title and not body.strip():
            pending = sec
            continue
        out.append(sec)
    if pending is not None:
        out.append(pending)
    return out
