"""Embedding models: LlamaIndex ``BaseEmbedding`` subclasses."""

from .onnx_query import FastHuggingFaceEmbedding

__all__ = ["FastHuggingFaceEmbedding"]
