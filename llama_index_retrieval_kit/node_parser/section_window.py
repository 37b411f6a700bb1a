"""Section-plus-fixed-size hybrid chunking."""

from __future__ import annotations

from typing import Any, List, Sequence

from llama_index.core.bridge.pydantic import Field, model_validator
from llama_index.core.schema import BaseNode, TextNode

from .base import DocumentTokens, SectionAwareNodeParser, link_prev_next


class SectionWindowNodeParser(SectionAwareNodeParser):
    """Split a document on its sections, then cut each section into token windows.

    Windows hold at most ``chunk_size`` tokens and ``max_chunk_chars`` characters, overlap by ``chunk_overlap`` tokens, never cross
    a section boundary, prefer to end at a sentence end, and carry the section in their metadata
    (``section_title``, ``section_path``) with exact ``char_start``/``char_end`` and pages.
    Node ids are deterministic (doc id + span), so re-parsing a document gives the same ids.

    Example:
        >>> parser = SectionWindowNodeParser(chunk_size=200, chunk_overlap=40)
        >>> nodes = parser.get_nodes_from_documents(PagedPDFReader().load_data("terms.pdf"))
    """

    chunk_size: int = Field(default=200, gt=0, description="Maximum tokens per chunk.")
    chunk_overlap: int = Field(default=40, ge=0, description="Tokens shared by consecutive chunks of a section.")
    min_chunk_tokens: int = Field(
        default=32,
        ge=0,
        description="A section's last chunk with fewer new tokens than this is merged into the previous "
        "chunk when both fit, else re-anchored to the section's last chunk_size tokens.",
    )

    @model_validator(mode="after")
    def _check_overlap(self) -> "SectionWindowNodeParser":
        if self.chunk_overlap >= self.chunk_size:
            raise ValueError(
                f"chunk_overlap ({self.chunk_overlap}) must be smaller than chunk_size ({self.chunk_size})"
            )
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SectionWindowNodeParser"

    def _parse_nodes(self, nodes: Sequence[BaseNode], show_progress: bool = False, **kwargs: Any) -> List[BaseNode]:
        out: List[BaseNode] = []
        for doc, tokens in self.iter_documents(nodes, show_progress):
            out.extend(self.split_document(doc, tokens))
        return out

    def split_document(self, doc: BaseNode, tokens: DocumentTokens | None = None) -> List[TextNode]:
        """The chunks of one document, in reading order."""
        text = doc.get_content()
        if not text.strip():
            return []
        if tokens is None:
            tokens = DocumentTokens.build(text, self.token_spans([text])[0])
        chunks: List[TextNode] = []
        source = doc.as_related_node_info()
        max_chars = self.chunk_char_limit(self.chunk_size)
        for section in self.sections_of(doc):
            for w in tokens.windows(
                section.start,
                section.end,
                self.chunk_size,
                self.chunk_overlap,
                self.sentence_slack,
                self.min_chunk_tokens,
                max_chars,
            ):
                if not text[w.start : w.end].strip():
                    continue
                chunks.append(self.make_node(doc, "chunk", len(chunks), w.start, w.end, section, source=source))
        if self.include_prev_next_rel:
            link_prev_next(chunks)
        return chunks
