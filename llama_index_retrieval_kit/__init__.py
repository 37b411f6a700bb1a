"""Production-grade retrieval components for LlamaIndex.

Readers keep pages and offsets, node parsers cut on sections, retrievers fuse BM25 and dense
search (in process or inside Qdrant), ``HybridIndex`` keeps it all in one storage folder, and
the evaluation package measures it.
"""

from .embeddings import FastHuggingFaceEmbedding
from .indices import DocumentIdConflictError, EmbeddingCache, HybridIndex, IndexBusyError
from .node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from .postprocessor import (
    ContextAssembler,
    ContextOrder,
    CrossEncoderReranker,
    NoAnswerPostprocessor,
    RerankBackend,
    RerankedNodeWithScore,
)
from .readers import DocumentReadError, FileReadError, MarkdownReader, PagedPDFReader, TextFileReader
from .retrievers import (
    BM25Retriever,
    BM25TokenizerConfig,
    ExactDenseRetriever,
    FusedNodeWithScore,
    HybridRetriever,
    QdrantHybridRetriever,
    reciprocal_rank_fusion,
    score_fusion,
)

__version__ = "0.1.0"

__all__ = [
    "PagedPDFReader",
    "TextFileReader",
    "MarkdownReader",
    "DocumentReadError",
    "FileReadError",
    "SectionWindowNodeParser",
    "SectionHierarchyNodeParser",
    "BM25Retriever",
    "BM25TokenizerConfig",
    "FusedNodeWithScore",
    "HybridRetriever",
    "QdrantHybridRetriever",
    "reciprocal_rank_fusion",
    "score_fusion",
    "HybridIndex",
    "IndexBusyError",
    "DocumentIdConflictError",
    "EmbeddingCache",
    "ExactDenseRetriever",
    "FastHuggingFaceEmbedding",
    "NoAnswerPostprocessor",
    "CrossEncoderReranker",
    "RerankBackend",
    "RerankedNodeWithScore",
    "ContextAssembler",
    "ContextOrder",
]
