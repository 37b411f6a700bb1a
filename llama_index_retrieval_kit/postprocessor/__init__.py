"""Postprocessors of the precision stage: the no-answer gate and cross-encoder reranking."""

from .no_answer import NoAnswerPostprocessor
from .rerank import CrossEncoderReranker, RerankBackend, RerankedNodeWithScore

__all__ = ["NoAnswerPostprocessor", "CrossEncoderReranker", "RerankBackend", "RerankedNodeWithScore"]
