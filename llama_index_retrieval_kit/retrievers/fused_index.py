"""``FusedIndexRetriever``: BM25 + dense fusion over one ``HybridIndex``, in arrays.

The generic :class:`~llama_index_retrieval_kit.retrievers.HybridRetriever` fuses any LlamaIndex
retrievers, which means one ``NodeWithScore`` per candidate per leg and Python-level fusion:
about 10 ms per query at a depth of a few hundred candidates. When both legs live in the same
index (local mode: BM25 and the in-memory dense matrix share node positions) the same fusion runs
on position and score arrays (:func:`fuse_positions`) and only the ``similarity_top_k`` results
become node objects. The answers are the generic retriever's (same ids, order and scores, tested).

``mode="feedback"`` (the default of ``HybridIndex.as_retriever("hybrid")``) needs the index's
vectors and so exists only here: see :class:`~llama_index_retrieval_kit.retrievers.fusion.IndexFusion`.

(Formerly ``llama_index_retrieval_kit.indices.fused_retriever``, which still imports as this module.)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import MetadataFilters

from ..tracing import NO_LAPS, Laps, trace_index_fusion, tracing_enabled
from .bm25 import BM25Retriever, BM25Snapshot, top_bm25_with_scores
from .checks import CheckedQueryMixin, check_positive_int, check_query_text
from .exact_dense import DenseMatrix, FilteredDense, one_blas_thread, query_embedding, unit_query
from .fusion import (
    DEFAULT_FEEDBACK_WEIGHTS,
    DEFAULT_RRF_K,
    FEEDBACK_TOP_M,
    FusedNodeWithScore,
    IndexFusion,
    check_rrf_k,
    check_weights,
    fuse_checked_positions,
    fuse_exact_scores,
    fusion_attributes,
)
from .node_copy import copy_node

logger = logging.getLogger(__name__)

LEG_NAMES = ("bm25", "dense")
FEEDBACK_LEG = "feedback"
_BM25, _DENSE = LEG_NAMES


def feedback_weights(weights: Optional[Sequence[float]]) -> List[float]:
    """The three weights ``[bm25, dense, feedback]`` of :class:`IndexFusion.FEEDBACK`: the default
    (0.3 / 0.3 / 0.4), three given ones, or two ``[bm25, dense]`` that split the default's
    non-feedback share (0.6) in their ratio, the feedback leg keeping 0.4 (``[1, 1]`` is the default)."""
    if weights is None:
        return list(DEFAULT_FEEDBACK_WEIGHTS)
    if len(weights) == 2:
        bm25, dense = check_weights(2, weights)
        share = DEFAULT_FEEDBACK_WEIGHTS[0] + DEFAULT_FEEDBACK_WEIGHTS[1]
        total = bm25 + dense
        return [share * bm25 / total, share * dense / total, DEFAULT_FEEDBACK_WEIGHTS[2]] if total > 0 else [0.0, 0.0, DEFAULT_FEEDBACK_WEIGHTS[2]]
    if len(weights) != 3:
        raise ValueError(
            f"weights has {len(weights)} entries ({list(weights)!r}); the feedback fusion of mode='hybrid' takes "
            "[bm25, dense] or [bm25, dense, feedback] (default [0.3, 0.3, 0.4])"
        )
    return check_weights(3, weights)


class FusedIndexRetriever(CheckedQueryMixin, BaseRetriever):
    """Hybrid retriever of a local-mode ``HybridIndex``: BM25 and exact dense legs fused in numpy.

    Built by ``HybridIndex.as_retriever`` for the fused modes; results are
    :class:`FusedNodeWithScore` copies carrying each leg's rank and raw score under ``"bm25"``
    and ``"dense"`` (and ``"feedback"`` in ``mode="feedback"``: rank in the feedback query's top
    ``candidate_top_k`` and cosine to it), where that leg's top ``candidate_top_k`` holds the node.
    In ``"score"`` and ``"rrf"`` mode exactly as :class:`HybridRetriever` over the two leg
    retrievers returns them.
    """

    def __init__(
        self,
        bm25: BM25Retriever,
        dense_matrix: Callable[[object], DenseMatrix],
        embed_model: BaseEmbedding,
        mode: str = "feedback",
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
        mode: An :class:`IndexFusion` (``"feedback"``, ``"score"`` or ``"rrf"``).
        rrf_k: As in :func:`reciprocal_rank_fusion` (``"rrf"`` only).
        weights: Per leg, ``[bm25, dense]``; default equal. ``"feedback"`` mode: see
            :func:`feedback_weights` (default 0.3 / 0.3 / 0.4 for bm25 / dense / feedback).
        candidate_top_k: Candidates per leg (raised to similarity_top_k if below).
        similarity_top_k: Number of fused results.
        """
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        fusion = IndexFusion.from_str(mode)
        check_positive_int("similarity_top_k", similarity_top_k)
        check_positive_int("candidate_top_k", candidate_top_k)
        self._bm25 = bm25
        self._dense_matrix = dense_matrix
        self._embed_model = embed_model
        self._mode = fusion.value
        self._rrf_k = check_rrf_k(rrf_k)
        if fusion is IndexFusion.FEEDBACK:
            self._weights = feedback_weights(weights)
        else:
            self._weights = check_weights(2, weights)
        self._depth = max(candidate_top_k, similarity_top_k)
        self._similarity_top_k = similarity_top_k

    @property
    def names(self) -> List[str]:
        """The leg names, in leg order."""
        return [*LEG_NAMES, FEEDBACK_LEG] if self._mode == IndexFusion.FEEDBACK.value else list(LEG_NAMES)

    @property
    def similarity_top_k(self) -> int:
        """Number of fused results."""
        return self._similarity_top_k

    @property
    def filters(self) -> Optional[MetadataFilters]:
        """The metadata filters of both legs (those of the BM25 view)."""
        return self._bm25.filters

    @filters.setter
    def filters(self, filters: Optional[MetadataFilters]) -> None:
        self._bm25 = self._bm25.with_filters(filters)  # a new view: a BM25 retriever shared with others is left alone

    @property
    def candidate_top_k(self) -> int:
        """Candidates per leg (``candidate_top_k``, raised to ``similarity_top_k`` if below)."""
        return self._depth

    @property
    def fusion_attributes(self) -> Dict[str, Any]:
        """The fusion's settings as a trace records them (:func:`~.fusion.fusion_attributes`;
        ``mode`` is an :class:`IndexFusion` value)."""
        return fusion_attributes(self._mode, self._similarity_top_k, self._weights, self._rrf_k)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        laps = Laps() if tracing_enabled() else NO_LAPS
        snapshot = self._bm25.snapshot
        matrix = self._dense_matrix(snapshot)
        embedding = query_embedding(query_bundle, self._embed_model)
        filters = self._bm25.filters
        laps.mark("embed")
        tokens = self._bm25.tokenize(check_query_text(query_bundle.query_str))
        sparse_top, sparse_scores, exact_bm25 = top_bm25_with_scores(snapshot, tokens, self._depth, filters)
        sparse = (sparse_top, sparse_scores)
        laps.mark(_BM25)
        space = FilteredDense.of(matrix, filters)
        with one_blas_thread():  # both dense passes of the query on one BLAS thread (see one_blas_thread)
            similarities = space.similarities(unit_query(matrix, embedding))
            rows, top_similarities = space.top(similarities, self._depth)
            dense = (rows, top_similarities.astype(np.float64))
            laps.mark(_DENSE)
            legs = {_BM25: sparse, _DENSE: dense}
            if self._mode == IndexFusion.FEEDBACK.value:
                positions, fused, ranks, raw = self._feedback_fusion(snapshot, space, exact_bm25, similarities, legs, laps)
            else:
                positions, fused, ranks, raw = fuse_checked_positions(
                    [sparse, dense], snapshot.tie_order, self._mode, self._rrf_k, self._weights, self._similarity_top_k
                )
        nodes = snapshot.nodes
        names = list(legs)
        out: List[NodeWithScore] = []
        for pos, score, leg_rank_row, leg_raw_row in zip(positions.tolist(), fused.tolist(), ranks.T.tolist(), raw.T.tolist()):
            leg_ranks = {leg: rank for leg, rank in zip(names, leg_rank_row) if rank}
            leg_scores = {leg: value for leg, rank, value in zip(names, leg_rank_row, leg_raw_row) if rank}
            out.append(FusedNodeWithScore.trusted(copy_node(nodes[pos]), score, leg_ranks, leg_scores))
        logger.debug("fused %s candidates into %d results", {leg: len(p) for leg, (p, _) in legs.items()}, len(out))
        if laps.on:
            laps.mark("fusion")
            trace_index_fusion(self, query_bundle, snapshot.node_ids, legs, out, laps)
        return out

    def _feedback_fusion(
        self,
        snapshot: BM25Snapshot,
        space: FilteredDense,
        exact_bm25: np.ndarray,
        similarities: np.ndarray,
        legs: Dict[str, Tuple[np.ndarray, np.ndarray]],
        laps: Laps,
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:class:`IndexFusion.FEEDBACK`: a first z-scored fusion of the two legs picks the
        feedback query (the mean vector of its best ``FEEDBACK_TOP_M`` chunks); that query's top
        ``depth`` is the third leg (added to ``legs``); all three fused by :func:`fuse_exact_scores`.
        The legs' scores are read at candidates only, which all pass the filters."""
        exact_dense = similarities  # float32, widened at the candidates by fuse_exact_scores
        two = [(legs[_BM25][0], exact_bm25), (legs[_DENSE][0], exact_dense)]
        seeds, _, _, _ = fuse_exact_scores(two, snapshot.tie_order, self._weights[:2], FEEDBACK_TOP_M)
        if seeds.size:
            seed = unit_query(space.matrix, space.matrix.vectors[seeds].mean(axis=0))
            feedback_all = space.similarities(seed)
            feedback_rows, feedback_top = space.top(feedback_all, self._depth)
        else:  # no candidate at all (an empty index, or nothing passes the filters)
            feedback_all, feedback_rows, feedback_top = exact_dense, np.zeros(0, np.int64), np.zeros(0, np.float64)
        legs[FEEDBACK_LEG] = (feedback_rows, feedback_top)
        laps.mark(FEEDBACK_LEG)
        return fuse_exact_scores(
            [*two, (feedback_rows, feedback_all)], snapshot.tie_order, self._weights, self._similarity_top_k
        )
