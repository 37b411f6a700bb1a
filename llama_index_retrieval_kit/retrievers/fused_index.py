"""``FusedIndexRetriever``: BM25 + dense fusion over one ``HybridIndex``, in arrays.

The generic :class:`~llama_index_retrieval_kit.retrievers.HybridRetriever` fuses any LlamaIndex
retrievers, which means one ``NodeWithScore`` per candidate per leg and Python-level fusion:
about 10 ms per query at a depth of a few hundred candidates. When both legs live in the same
index (local mode: BM25 and the in-memory dense matrix share node positions) the same fusion runs
on position and score arrays (:func:`fuse_positions`) and only the ``similarity_top_k`` results
become node objects. The answers are the generic retriever's (same ids, order and scores, tested).

(Formerly ``llama_index_retrieval_kit.indices.fused_retriever``, which still imports as this module.)
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle

from ..tracing import NO_LAPS, Laps, trace_index_fusion, tracing_enabled
from .bm25 import BM25Retriever, top_bm25_positions
from .checks import CheckedQueryMixin, check_positive_int, check_query_text
from .exact_dense import DenseMatrix, query_embedding, top_dense_positions
from .fusion import (
    DEFAULT_RRF_K,
    FUSION_MODES,
    FusedNodeWithScore,
    check_rrf_k,
    check_weights,
    fuse_checked_positions,
)
from .node_copy import copy_node

logger = logging.getLogger(__name__)

LEG_NAMES = ("bm25", "dense")
_BM25, _DENSE = LEG_NAMES


class FusedIndexRetriever(CheckedQueryMixin, BaseRetriever):
    """Hybrid retriever of a local-mode ``HybridIndex``: BM25 and exact dense legs fused in numpy.

    Built by ``HybridIndex.as_retriever`` for the fused modes; results are
    :class:`FusedNodeWithScore` copies carrying each leg's rank and raw score under ``"bm25"``
    and ``"dense"``, exactly as :class:`HybridRetriever` over the two leg retrievers returns them.
    """

    def __init__(
        self,
        bm25: BM25Retriever,
        dense_matrix: Callable[[object], DenseMatrix],
        embed_model: BaseEmbedding,
        mode: str = "score",
        rrf_k: float = DEFAULT_RRF_K,
        weights: Optional[Sequence[float]] = None,
        candidate_top_k: int = 100,
        similarity_top_k: int = 10,
        callback_manager: Optional[CallbackManager] = None,
        verbose: bool = False,
    ) -> None:
        """Args:
        bm25: The BM25 retriever (view) of the index, with the query's filters.
        dense_matrix: Returns the dense matrix aligned with a given BM25 snapshot.
        embed_model: Embeds the query (unless the QueryBundle carries an embedding).
        mode: ``"score"`` (normalised score fusion) or ``"rrf"``.
        rrf_k, weights: As in :func:`reciprocal_rank_fusion` / :func:`score_fusion`.
        candidate_top_k: Candidates per leg (>= similarity_top_k).
        similarity_top_k: Number of fused results.
        """
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        if mode not in FUSION_MODES:
            raise ValueError(f"mode {mode!r} is not supported; use one of {FUSION_MODES}")
        check_positive_int("similarity_top_k", similarity_top_k)
        check_positive_int("candidate_top_k", candidate_top_k)
        self._bm25 = bm25
        self._dense_matrix = dense_matrix
        self._embed_model = embed_model
        self._mode = mode
        self._rrf_k = check_rrf_k(rrf_k)
        self._weights = check_weights(2, weights)
        self._depth = max(candidate_top_k, similarity_top_k)
        self._similarity_top_k = similarity_top_k

    @property
    def names(self) -> List[str]:
        """The leg names, in leg order."""
        return list(LEG_NAMES)

    @property
    def similarity_top_k(self) -> int:
        return self._similarity_top_k

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        laps = Laps() if tracing_enabled() else NO_LAPS
        snapshot = self._bm25.snapshot
        matrix = self._dense_matrix(snapshot)
        embedding = query_embedding(query_bundle, self._embed_model)
        filters = self._bm25.filters
        laps.mark("embed")
        sparse = top_bm25_positions(snapshot, self._bm25.tokenize(check_query_text(query_bundle.query_str)), self._depth, filters)
        laps.mark(_BM25)
        rows, similarities = top_dense_positions(matrix, embedding, self._depth, filters)
        dense = (rows, similarities.astype(np.float64))
        laps.mark(_DENSE)
        positions, fused, ranks, raw = fuse_checked_positions(
            [sparse, dense], snapshot.tie_order, self._mode, self._rrf_k, self._weights, self._similarity_top_k
        )
        nodes = snapshot.nodes
        out: List[NodeWithScore] = []
        for pos, score, (bm25_rank, dense_rank), (bm25_raw, dense_raw) in zip(
            positions.tolist(), fused.tolist(), ranks.T.tolist(), raw.T.tolist()
        ):
            leg_ranks, leg_scores = {}, {}
            if bm25_rank:
                leg_ranks[_BM25], leg_scores[_BM25] = bm25_rank, bm25_raw
            if dense_rank:
                leg_ranks[_DENSE], leg_scores[_DENSE] = dense_rank, dense_raw
            out.append(FusedNodeWithScore(node=copy_node(nodes[pos]), score=score, leg_ranks=leg_ranks, leg_scores=leg_scores))
        logger.debug("fused %d bm25 + %d dense candidates into %d results", len(sparse[0]), len(rows), len(out))
        if laps.on:
            laps.mark("fusion")
            trace_index_fusion(self, query_bundle, nodes, {_BM25: sparse, _DENSE: dense}, out, laps)
        return out
