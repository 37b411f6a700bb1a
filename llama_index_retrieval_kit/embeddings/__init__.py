"""Embedding models: LlamaIndex ``BaseEmbedding`` subclasses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "FastHuggingFaceEmbedding": ".onnx_query",
}

__all__ = ["FastHuggingFaceEmbedding"]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .onnx_query import FastHuggingFaceEmbedding
