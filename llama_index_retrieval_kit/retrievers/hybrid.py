"""Hybrid retrieval: run several LlamaIndex retrievers (e.g. BM25 + dense) and fuse their rankings."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import MetadataFilters

from ..tracing import atimed, elapsed_ms, timed, trace_hybrid, tracing_enabled
from .checks import CheckedQueryMixin, check_positive_int
from .filters import has_settable_filters
from .fusion import (
    DEFAULT_RRF_K,
    FUSION_MODES,
    check_rrf_k,
    check_weights,
    fusion_attributes,
    leg_names,
    reciprocal_rank_fusion,
    score_fusion,
)

logger = logging.getLogger(__name__)


def _check_depths(n_legs: int, candidate_top_k: Union[int, Sequence[int], None]) -> List[Optional[int]]:
    """Per-leg candidate depth: None (keep all the leg returns) or an int >= 1."""
    if candidate_top_k is None:
        return [None] * n_legs
    depths = [candidate_top_k] * n_legs if isinstance(candidate_top_k, int) else list(candidate_top_k)
    if len(depths) != n_legs:
        raise ValueError(f"candidate_top_k has {len(depths)} entries ({depths!r}); expected one per retriever ({n_legs})")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths):
        raise ValueError(f"candidate_top_k must be an int >= 1 or one such int per retriever, got {candidate_top_k!r}")
    return depths


class HybridRetriever(CheckedQueryMixin, BaseRetriever):
    """Fuse the rankings of two or more retrievers (any LlamaIndex ``BaseRetriever``).

    Each leg is queried with the same ``QueryBundle`` through its public ``retrieve``/``aretrieve``
    (so callbacks and instrumentation see it), its results are cut to ``candidate_top_k``, and the
    lists are fused by weighted reciprocal rank fusion (``mode="rrf"``) or by a convex combination
    of min-max normalised scores (``mode="score"``). Results are
    :class:`~llama_index_retrieval_kit.retrievers.fusion.FusedNodeWithScore` objects carrying each
    leg's rank and raw score under the leg's name.

    Candidate depth: the legs are never reconfigured. A leg returns as many results as it is set
    up for (e.g. its own ``similarity_top_k``) and ``candidate_top_k`` only truncates that list, so
    to fuse deeper candidates build the leg deeper, e.g. ``index.as_retriever(similarity_top_k=50)``.
    A warning is logged when a leg's ``similarity_top_k`` is below its requested depth.

    ``_aretrieve`` queries the legs concurrently with ``asyncio.gather``; a leg without a native
    async implementation runs synchronously inside the event loop (LlamaIndex's default).

    A blank query is left to the legs: this package's retrievers refuse one that carries no
    embedding (:func:`~.checks.check_not_blank`), and a leg of another kind may answer it (e.g.
    from ``QueryBundle.image_path``).

    ``read_guard`` (e.g. ``HybridIndex``'s read lock, which the retrievers it builds pass) is held
    around all legs of a query, so that a write between two legs cannot mix two states of the
    index in one answer. The legs must not take it themselves (a lock that favours waiting writers
    deadlocks on nested reads). With a guard, ``_aretrieve`` runs the legs' synchronous
    ``retrieve`` in a worker thread (``asyncio.to_thread``) holding the guard there: a thread lock
    held across ``await`` points could block the event loop.
    """

    refuses_blank_query = False  # the legs decide (see above)

    def __init__(
        self,
        retrievers: Sequence[BaseRetriever],
        names: Optional[Sequence[str]] = None,
        mode: str = "rrf",
        rrf_k: float = DEFAULT_RRF_K,
        weights: Optional[Sequence[float]] = None,
        candidate_top_k: Union[int, Sequence[int], None] = None,
        similarity_top_k: int = 10,
        callback_manager: Optional[CallbackManager] = None,
        verbose: bool = False,
        read_guard: Optional[Callable[[], ContextManager[Any]]] = None,
    ) -> None:
        """Set up the fusion; all arguments are checked here.

        Args:
            retrievers: Two or more retrievers (the legs).
            names: Leg names for ``leg_ranks``/``leg_scores``; default ``leg0``, ``leg1``, ...
            mode: ``"rrf"`` (reciprocal rank fusion) or ``"score"`` (normalised score fusion).
            rrf_k: RRF rank offset (>= 0), ranks counted from 1; used in ``"rrf"`` mode.
            weights: One weight (>= 0) per leg; default equal.
            candidate_top_k: Per-leg depth (int for all legs, or one int per leg); None keeps all.
            similarity_top_k: Number of fused results (>= 1).
            read_guard: Called once per query; returns a context manager held while every leg
                runs (default: none). See the class docstring.
        """
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        retrievers = list(retrievers)
        if len(retrievers) < 2:
            raise ValueError(f"HybridRetriever needs at least 2 retrievers, got {len(retrievers)}")
        bad = [type(r).__name__ for r in retrievers if not isinstance(r, BaseRetriever)]
        if bad:
            raise ValueError(f"retrievers must be llama_index BaseRetriever objects, got {bad}")
        if mode not in FUSION_MODES:
            raise ValueError(f"mode {mode!r} is not supported; use one of {FUSION_MODES}")
        check_positive_int("similarity_top_k", similarity_top_k)
        if read_guard is not None and not callable(read_guard):
            raise TypeError(f"read_guard must be None or a callable returning a context manager, got {read_guard!r}")
        self._read_guard = read_guard
        self._retrievers = retrievers
        self._names = leg_names(len(retrievers), names)
        self._weights = check_weights(len(retrievers), weights)
        self._depths = _check_depths(len(retrievers), candidate_top_k)
        self._mode = mode
        self._rrf_k = check_rrf_k(rrf_k)
        self._similarity_top_k = similarity_top_k
        for name, leg, depth in zip(self._names, retrievers, self._depths):
            leg_top_k = getattr(leg, "similarity_top_k", None)
            if depth is not None and isinstance(leg_top_k, int) and leg_top_k < depth:
                logger.warning(
                    "leg %r returns at most %d results but candidate_top_k asks for %d; "
                    "configure the leg deeper (e.g. similarity_top_k=%d) to fuse that many",
                    name,
                    leg_top_k,
                    depth,
                    depth,
                )

    @property
    def names(self) -> List[str]:
        """The leg names, in leg order."""
        return list(self._names)

    @property
    def similarity_top_k(self) -> int:
        """Number of fused results."""
        return self._similarity_top_k

    @property
    def filters(self) -> Optional[MetadataFilters]:
        """The metadata filters of the first leg (every leg's, when set here)."""
        return getattr(self._retrievers[0], "filters", None)

    @filters.setter
    def filters(self, filters: Optional[MetadataFilters]) -> None:
        """Set ``filters`` on every leg; refused (nothing changed) when a leg has no settable
        ``filters``: a filter that one leg ignores leaks documents."""
        fixed = [name for name, leg in zip(self._names, self._retrievers) if not has_settable_filters(leg)]
        if fixed:
            raise TypeError(f"legs {fixed} have no settable filters: build the retriever again with the filters instead")
        for leg in self._retrievers:
            leg.filters = filters

    @property
    def candidate_depths(self) -> List[Optional[int]]:
        """Per leg, how many of its results are fused (None: all it returns)."""
        return list(self._depths)

    @property
    def fusion_attributes(self) -> Dict[str, Any]:
        """The fusion's settings as a trace records them (:func:`~.fusion.fusion_attributes`)."""
        return fusion_attributes(self._mode, self._similarity_top_k, self._weights, self._rrf_k)

    def _fuse(self, leg_results: Sequence[Sequence[NodeWithScore]]) -> List[NodeWithScore]:
        """Truncate each leg to its depth and fuse."""
        truncated = [list(results)[:depth] for results, depth in zip(leg_results, self._depths)]
        for name, results in zip(self._names, truncated):
            logger.debug("hybrid leg %r: %d candidates", name, len(results))
        if self._mode == "rrf":
            return reciprocal_rank_fusion(
                truncated, k=self._rrf_k, weights=self._weights, top_k=self._similarity_top_k, names=self._names
            )
        return score_fusion(truncated, weights=self._weights, top_k=self._similarity_top_k, names=self._names)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        traced = tracing_enabled()
        with (self._read_guard or nullcontext)():  # every leg from one state of the index
            if traced:
                timed_legs = [timed(leg.retrieve, query_bundle) for leg in self._retrievers]
            else:
                leg_results = [leg.retrieve(query_bundle) for leg in self._retrievers]
        if traced:
            return self._traced_fuse(query_bundle, timed_legs)
        return self._fuse(leg_results)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        if self._read_guard is not None:  # the guard is held in a worker thread, never across an await
            return await asyncio.to_thread(self._retrieve, query_bundle)
        if tracing_enabled():
            timed_legs = await asyncio.gather(*(atimed(leg.aretrieve(query_bundle)) for leg in self._retrievers))
            return self._traced_fuse(query_bundle, timed_legs)
        results = await asyncio.gather(*(leg.aretrieve(query_bundle) for leg in self._retrievers))
        return self._fuse(results)

    def _traced_fuse(self, query_bundle: QueryBundle, timed_legs: Sequence[tuple]) -> List[NodeWithScore]:
        """:meth:`_fuse` of ``(results, ms)`` legs, emitting the leg and fusion trace records."""
        started = time.perf_counter()
        fused = self._fuse([results for results, _ in timed_legs])
        trace_hybrid(self, query_bundle, [r for r, _ in timed_legs], [ms for _, ms in timed_legs], fused, elapsed_ms(started))
        return fused
