"""Production-grade retrieval components for LlamaIndex.

Readers keep pages and offsets, node parsers cut on sections, retrievers fuse BM25 and dense
search, postprocessors gate and rerank, and the evaluation package measures it all.
"""

from .node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from .readers import DocumentReadError, FileReadError, MarkdownReader, PagedPDFReader, TextFileReader

__version__ = "0.1.0"

__all__ = [
    "PagedPDFReader",
    "TextFileReader",
    "MarkdownReader",
    "DocumentReadError",
    "FileReadError",
    "SectionWindowNodeParser",
    "SectionHierarchyNodeParser",
]
