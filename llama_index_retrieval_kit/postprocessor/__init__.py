"""Postprocessors of the precision stage: the no-answer gate, cross-encoder reranking and context assembly."""

from .context import AssemblyReport, ContextAssembler, ContextOrder, LeftOut
from .no_answer import NoAnswerPostprocessor
from .rerank import CrossEncoderReranker, RerankBackend, RerankedNodeWithScore

__all__ = [
    "NoAnswerPostprocessor",
    "CrossEncoderReranker",
    "RerankBackend",
    "RerankedNodeWithScore",
    "ContextAssembler",
    "ContextOrder",
    "AssemblyReport",
    "LeftOut",
]
