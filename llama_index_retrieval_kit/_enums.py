"""``ChoiceEnum``: the one ``from_str`` of the package's modes and kinds."""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, TypeVar

E = TypeVar("E", bound="ChoiceEnum")


class ChoiceEnum(str, Enum):
    """A string enum whose ``from_str`` names the bad value and lists the allowed ones.

    The error calls the kind by its class name in words (``ContextOrder`` -> "context order").
    """

    @classmethod
    def from_str(cls: type[E], value: Any) -> E:
        """The member named ``value`` (a member or its string); ValueError listing the allowed names."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            kind = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"unknown {kind} {value!r}; allowed: {allowed}") from None


class RetrieverMode(ChoiceEnum):
    """The retriever modes of ``HybridIndex.as_retriever`` (also the CLI's ``--mode`` and configs)."""

    HYBRID = "hybrid"
    HYBRID_SCORE = "hybrid_score"
    HYBRID_RRF = "hybrid_rrf"
    DENSE = "dense"
    SPARSE = "sparse"
    QDRANT_HYBRID = "qdrant_hybrid"


class DenseSearch(ChoiceEnum):
    """Where the dense leg runs: ``memory`` (exact, numpy), ``qdrant`` (the store), ``auto``."""

    AUTO = "auto"
    MEMORY = "memory"
    QDRANT = "qdrant"


class QueryBackend(ChoiceEnum):
    """What embeds queries (``embedding.query_backend``): ``onnx`` (ONNX Runtime) or ``torch`` (PyTorch)."""

    ONNX = "onnx"
    TORCH = "torch"


class EngineFusion(ChoiceEnum):
    """Fusion run inside Qdrant (``mode="qdrant_hybrid"``): ``rrf`` (reciprocal rank fusion) or
    ``dbsf`` (distribution-based score fusion: each leg's scores normalised by mean +- 3 sd, summed)."""

    RRF = "rrf"
    DBSF = "dbsf"


class ChatEngineMode(ChoiceEnum):
    """The chat engines of ``HybridIndex.as_chat_engine``: LlamaIndex's ``ChatMode`` values whose
    engine reads the index (``best`` is taken as ``condense_plus_context``, as LlamaIndex does)."""

    CONDENSE_PLUS_CONTEXT = "condense_plus_context"
    CONTEXT = "context"
    CONDENSE_QUESTION = "condense_question"
