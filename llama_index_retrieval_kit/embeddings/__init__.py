"""Embedding models: LlamaIndex ``BaseEmbedding`` subclasses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "FastHuggingFaceEmbedding": ".onnx_query",
    "OnnxQueryEmbedding": ".query_export",
}

__all__ = ["FastHuggingFaceEmbedding", "OnnxQueryEmbedding"]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .onnx_query import FastHuggingFaceEmbedding
    from .query_export import OnnxQueryEmbedding
