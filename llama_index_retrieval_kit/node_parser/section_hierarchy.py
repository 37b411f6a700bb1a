"""Hierarchical parent/child chunking: parents are sections, children are small windows."""

from __future__ import annotations

from typing import Any, List, Sequence

from llama_index.core.bridge.pydantic import Field, model_validator
from llama_index.core.schema import BaseNode, NodeRelationship, ObjectType, RelatedNodeInfo, TextNode

from .base import DocumentTokens, SectionAwareNodeParser, link_prev_next


class SectionHierarchyNodeParser(SectionAwareNodeParser):
    """Parents are sections (split into ``parent_chunk_size`` windows when larger), children are
    ``child_chunk_size`` windows inside one parent. ``max_chunk_chars`` bounds both in characters
    (unset: ten characters per token of each one's size limit).

    Returns parents and children together, like LlamaIndex's ``HierarchicalNodeParser``: index
    the leaves (``get_leaf_nodes``), put every node in the docstore, and LlamaIndex's own
    ``AutoMergingRetriever`` merges children into their parent. Each child also carries
    ``parent_id``, the parent's span (``parent_char_start``/``parent_char_end``), its pages
    (``parent_page_start``/``parent_page_end``) and (with ``store_parent_text``) its text, so a
    postprocessor can swap a child for its parent, and cite the parent's pages, without a docstore.
    """

    parent_chunk_size: int = Field(default=1024, gt=0, description="Maximum tokens per parent node.")
    child_chunk_size: int = Field(default=128, gt=0, description="Maximum tokens per child node.")
    child_chunk_overlap: int = Field(default=16, ge=0, description="Tokens shared by consecutive children.")
    min_chunk_tokens: int = Field(
        default=16, ge=0, description="Tail windows with fewer new tokens merge into / re-anchor on the previous one."
    )
    store_parent_text: bool = Field(
        default=True, description="Copy the parent's text into each child's metadata (hidden from embed and LLM)."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> "SectionHierarchyNodeParser":
        if self.child_chunk_size > self.parent_chunk_size:
            raise ValueError(
                f"child_chunk_size ({self.child_chunk_size}) must not exceed parent_chunk_size ({self.parent_chunk_size})"
            )
        if self.child_chunk_overlap >= self.child_chunk_size:
            raise ValueError(
                f"child_chunk_overlap ({self.child_chunk_overlap}) must be smaller than child_chunk_size "
                f"({self.child_chunk_size})"
            )
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SectionHierarchyNodeParser"

    def _parse_nodes(self, nodes: Sequence[BaseNode], show_progress: bool = False, **kwargs: Any) -> List[BaseNode]:
        out: List[BaseNode] = []
        for doc, tokens in self.iter_documents(nodes, show_progress):
            parents, children = self.split_document(doc, tokens)
            out.extend(parents)
            out.extend(children)
        return out

    def split_document(self, doc: BaseNode, tokens: DocumentTokens | None = None) -> tuple[List[TextNode], List[TextNode]]:
        """(parents, children) of one document, each in reading order."""
        text = doc.get_content()
        if not text.strip():
            return [], []
        if tokens is None:
            tokens = DocumentTokens.build(text, self.token_spans([text])[0])
        parents: List[TextNode] = []
        children: List[TextNode] = []
        source = doc.as_related_node_info()
        parent_chars = self.chunk_char_limit(self.parent_chunk_size)
        child_chars = self.chunk_char_limit(self.child_chunk_size)
        for section in self.sections_of(doc):
            for pw in tokens.windows(
                section.start,
                section.end,
                self.parent_chunk_size,
                0,
                self.sentence_slack,
                self.min_chunk_tokens,
                parent_chars,
            ):
                if not text[pw.start : pw.end].strip():
                    continue
                parent = self.make_node(doc, "parent", len(parents), pw.start, pw.end, section, source=source)
                parent_hash = parent.hash
                parents.append(parent)
                kids: List[TextNode] = []
                for cw in tokens.windows(
                    pw.start,
                    pw.end,
                    self.child_chunk_size,
                    self.child_chunk_overlap,
                    self.sentence_slack,
                    self.min_chunk_tokens,
                    child_chars,
                ):
                    if not text[cw.start : cw.end].strip():
                        continue
                    extra = {
                        "parent_id": parent.node_id,
                        "parent_char_start": pw.start,
                        "parent_char_end": pw.end,
                        # the parent's pages, so a child swapped for its parent cites them (ContextAssembler)
                        "parent_page_start": parent.metadata["page_start"],
                        "parent_page_end": parent.metadata["page_end"],
                    }
                    if parent.metadata.get("page_breaks"):
                        extra["parent_page_breaks"] = list(parent.metadata["page_breaks"])
                    if self.store_parent_text:
                        extra["parent_text"] = parent.text
                    child = self.make_node(doc, "chunk", len(children), cw.start, cw.end, section, extra, source)
                    child.relationships[NodeRelationship.PARENT] = RelatedNodeInfo(
                        node_id=parent.node_id,
                        node_type=ObjectType.TEXT,
                        metadata={"section_title": section.title, "char_start": pw.start, "char_end": pw.end},
                        hash=parent_hash,
                    )
                    kids.append(child)
                parent.relationships[NodeRelationship.CHILD] = [
                    RelatedNodeInfo(node_id=k.node_id, node_type=ObjectType.TEXT) for k in kids
                ]
                children.extend(kids)
        if self.include_prev_next_rel:
            link_prev_next(parents)
            link_prev_next(children)
        return parents, children
