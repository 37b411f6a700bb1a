"""Moved to :mod:`llama_index_retrieval_kit.retrievers.fused_index` (retrievers live in ``retrievers/``).

This old import path is that module itself (an alias in ``sys.modules``), so that
``import llama_index_retrieval_kit.indices.fused_retriever`` and patching names on it keep working.
"""

from __future__ import annotations

import sys

from ..retrievers import fused_index as _fused_index

sys.modules[__name__] = _fused_index
