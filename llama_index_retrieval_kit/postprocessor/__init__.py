"""Postprocessors of the precision stage: the no-answer gate, cross-encoder reranking and context assembly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "AssemblyReport": ".context",
    "ContextAssembler": ".context",
    "ContextOrder": ".context",
    "LeftOut": ".context",
    "NoAnswerPostprocessor": ".no_answer",
    "CrossEncoderReranker": ".rerank",
    "RerankBackend": ".rerank",
    "RerankedNodeWithScore": ".rerank",
}

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

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .context import AssemblyReport, ContextAssembler, ContextOrder, LeftOut
    from .no_answer import NoAnswerPostprocessor
    from .rerank import CrossEncoderReranker, RerankBackend, RerankedNodeWithScore
