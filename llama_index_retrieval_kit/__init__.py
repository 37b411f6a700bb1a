"""Production-grade retrieval components for LlamaIndex.

Readers keep pages and offsets, node parsers cut on sections, retrievers fuse BM25 and dense
search (in process or inside Qdrant), ``HybridIndex`` keeps it all in one storage folder, and
the evaluation package measures it. ``PipelineConfig`` describes the whole pipeline in one YAML file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .__about__ import __version__
from ._lazy import lazy_exports

_EXPORTS = {
    "FastHuggingFaceEmbedding": ".embeddings",
    "PipelineConfig": ".pipeline",
    "build_index": ".pipeline",
    "build_query_engine": ".pipeline",
    "build_retriever": ".pipeline",
    "TraceCollector": ".tracing",
    "QueryTrace": ".tracing",
    "StageTrace": ".tracing",
    "JsonlTraceWriter": ".tracing",
    "collect_traces": ".tracing",
    "format_trace": ".tracing",
    "ChunkIdConflictError": ".indices",
    "DocumentIdConflictError": ".indices",
    "EmbeddingCache": ".indices",
    "HybridIndex": ".indices",
    "IndexBusyError": ".indices",
    "EmbedSettingsMismatchError": ".indices",
    "StaleServerCopyError": ".indices",
    "SectionHierarchyNodeParser": ".node_parser",
    "SectionWindowNodeParser": ".node_parser",
    "ContextAssembler": ".postprocessor",
    "ContextOrder": ".postprocessor",
    "CrossEncoderReranker": ".postprocessor",
    "NoAnswerPostprocessor": ".postprocessor",
    "RerankBackend": ".postprocessor",
    "RerankedNodeWithScore": ".postprocessor",
    "DocumentReadError": ".readers",
    "FileReadError": ".readers",
    "MarkdownReader": ".readers",
    "PagedPDFReader": ".readers",
    "TextFileReader": ".readers",
    "BM25Retriever": ".retrievers",
    "BM25TokenizerConfig": ".retrievers",
    "ExactDenseRetriever": ".retrievers",
    "FusedNodeWithScore": ".retrievers",
    "HybridRetriever": ".retrievers",
    "QdrantHybridRetriever": ".retrievers",
    "reciprocal_rank_fusion": ".retrievers",
    "score_fusion": ".retrievers",
}

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
    "EmbedSettingsMismatchError",
    "StaleServerCopyError",
    "ChunkIdConflictError",
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
    "TraceCollector",
    "QueryTrace",
    "StageTrace",
    "JsonlTraceWriter",
    "collect_traces",
    "format_trace",
    "PipelineConfig",
    "build_index",
    "build_retriever",
    "build_query_engine",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .tracing import JsonlTraceWriter, QueryTrace, StageTrace, TraceCollector, collect_traces, format_trace
    from .embeddings import FastHuggingFaceEmbedding
    from .pipeline import PipelineConfig, build_index, build_query_engine, build_retriever
    from .indices import ChunkIdConflictError, DocumentIdConflictError, EmbedSettingsMismatchError, EmbeddingCache, HybridIndex, IndexBusyError, StaleServerCopyError
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
