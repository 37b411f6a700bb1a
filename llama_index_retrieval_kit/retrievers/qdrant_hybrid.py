"""Qdrant-native hybrid search: dense + BM25 sparse vectors in one collection, RRF in Qdrant.

The sparse vectors are BM25 term weights computed here with our BM25 tokenizer (no sparse
model to download); Qdrant multiplies them by its own IDF (``Modifier.IDF``), so the sparse leg
scores like Lucene BM25 (Lucene >= 8, which dropped the constant ``(k1 + 1)`` factor) and like
bm25s ``method="lucene"``, the scorer of :class:`BM25Retriever`:

    doc value(t)   = tf / (tf + k1 * (1 - b + b * dl / avgdl))
    query value(t) = occurrences of t in the query (as bm25s counts repeated terms)
    Qdrant IDF(t)  = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))

On a freshly built index the sparse leg's scores therefore equal the BM25 leg's (float32
rounding aside). Differences from bm25s worth knowing: ``avgdl`` is frozen when the index is
first written (an upsert re-weights neither older nor newer documents, while bm25s recomputes it
on every rebuild), IDF comes from Qdrant's live statistics (N and n_t follow upserts and
deletes, as bm25s does), and token ids are 32-bit hashes (a collision merges two terms; rare at
ordinary vocabularies).

Fusion runs inside Qdrant (Query API: one prefetch per leg, each with the same filter, then
RRF). Qdrant's RRF counts ranks from 0 (``1 / (k_q + rank0)``); we pass ``k_q = rrf_k + 1`` so
scores equal ours, ``1 / (rrf_k + rank)`` with ranks from 1. With weights Qdrant computes
``1 / (rank / w + k_q - 1)``, which is not ``w / (k + rank)``: weights rank alike only when equal.

Filters: with a ``HybridIndex``'s point store, ``point_filter`` gives the store's filter for the
index's ``filters`` (:meth:`~llama_index_retrieval_kit.indices.store.EdgePoints.metadata_filter`):
the ``MetadataFilters`` translated into Qdrant conditions on payload-indexed fields where that is
exact, else the list of matching point ids; both mean ``metadata_matches``. The store builds the
query (``plan_search``) and renders filter and query for Qdrant Edge or qdrant-client alike.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections import Counter
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import MetadataFilters, VectorStoreQuery
from llama_index.core.vector_stores.utils import metadata_dict_to_node

import numpy as np

from ..tracing import NO_LAPS, Laps, trace_index_fusion, tracing_enabled
from .checks import CheckedQueryMixin, check_positive_int, check_query_text
from .exact_dense import query_embedding
from .filters import metadata_matches, validate_filters
from .fused_index import LEG_NAMES
from .fusion import FusedNodeWithScore

BM25_LEG, DENSE_LEG = LEG_NAMES

if TYPE_CHECKING:  # qdrant-client (~0.5 s to import) is imported where a server or its types are used
    from qdrant_client import models

logger = logging.getLogger(__name__)

# The collection schema and the server-side filter are the store's (indices/store.py), re-exported here.
from ..indices.store import DENSE_VECTOR, SPARSE_VECTOR, LegSearch, ServerPoints, point_ids_filter, sparse_vectors_config  # noqa: E402,F401


#: ``node_lookup(point_ids)``: the node of each point id (a copy the caller may keep), None where unknown.
NodeLookup = Callable[[Sequence[str]], List[Optional[BaseNode]]]


def results_from_lookup(points: Any, node_lookup: Optional[NodeLookup], dense: Any, sparse: Any, **query: Any) -> Optional[List[NodeWithScore]]:
    """The search's results with nodes from ``node_lookup`` (the engine returns ids only), or None
    without a lookup or when it lacks a point (the caller then reads the payloads)."""
    if node_lookup is None:
        return None
    hits = points.search_ids(dense, sparse, **query)
    nodes = node_lookup([point for point, _ in hits])
    if any(node is None for node in nodes):
        logger.warning("%d of %d result point(s) are not among the index's nodes; reading the payloads instead",
                       sum(node is None for node in nodes), len(nodes))
        return None
    return [NodeWithScore(node=node, score=score) for node, (_, score) in zip(nodes, hits)]


#: The result leg name of each engine leg kind: the sparse vectors score BM25 (see the module docstring).
ENGINE_LEG_NAMES = {"sparse": BM25_LEG, "dense": DENSE_LEG}


def fused_with_legs(found: LegSearch, nodes: Sequence[BaseNode]) -> List[NodeWithScore]:
    """The engine's fused results (``found.fused``, with their ``nodes``) as :class:`FusedNodeWithScore`:
    the fused score, and the rank (from 1) and score each had in every leg that returned it, read
    from the legs' own rankings (``found.legs``; legs named by :data:`ENGINE_LEG_NAMES`, BM25 first
    as the in-process fused modes order them). The gate and the trace read them."""
    tables = {ENGINE_LEG_NAMES[kind]: {point: (rank, score) for rank, (point, score) in enumerate(hits, 1)}
              for kind, hits in sorted(found.legs.items(), key=lambda item: ENGINE_LEG_NAMES[item[0]])}
    out: List[NodeWithScore] = []
    for (point, score, _), node in zip(found.fused, nodes):
        ranks: Dict[str, int] = {}
        scores: Dict[str, Optional[float]] = {}
        for name, table in tables.items():
            hit = table.get(point)
            if hit is not None:
                ranks[name], scores[name] = hit
        out.append(FusedNodeWithScore.trusted(node, score, ranks, scores))
    return out


def leg_positions(found: LegSearch) -> Tuple[List[str], Dict[str, Tuple[np.ndarray, np.ndarray]]]:
    """The legs of ``found`` as a trace takes them: the point ids, and per leg name the positions
    of its hits in them and their scores, best first."""
    where: Dict[str, int] = {}
    legs: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for kind, hits in sorted(found.legs.items(), key=lambda item: ENGINE_LEG_NAMES[item[0]]):
        positions = [where.setdefault(point, len(where)) for point, _ in hits]
        legs[ENGINE_LEG_NAMES[kind]] = (np.asarray(positions, dtype=np.int64), np.asarray([s for _, s in hits], dtype=np.float64))
    return list(where), legs


def payload_nodes(payloads: Sequence[Any], filters: Optional[MetadataFilters]) -> List[Optional[BaseNode]]:
    """The node of each point's payload (LlamaIndex's ``metadata_dict_to_node``), None where its
    metadata no longer match ``filters``.

    The engine was asked with a filter built from this process's view of the index (an id list
    where a filter cannot be translated exactly); a server's points may have changed since, by
    another writer (a point moved to another tenant keeps its id). Checking each returned payload
    costs microseconds on the top k and means such a point is left out, never returned.
    """
    nodes: List[Optional[BaseNode]] = []
    for payload in payloads:
        node = metadata_dict_to_node(payload)
        nodes.append(node if filters is None or metadata_matches(node.metadata, filters) else None)
    dropped = sum(node is None for node in nodes)
    if dropped:
        logger.info("%d result point(s) no longer match the filters (changed by another writer since this index was read)", dropped)
    return nodes


def nodes_from_payloads(hits: Sequence[tuple[Any, float]], filters: Optional[MetadataFilters]) -> List[NodeWithScore]:
    """Result nodes parsed from the points' payloads, keeping only those whose metadata match
    ``filters`` (:func:`payload_nodes`)."""
    nodes = payload_nodes([payload for payload, _ in hits], filters)
    return [NodeWithScore(node=node, score=score) for node, (_, score) in zip(nodes, hits) if node is not None]


@functools.lru_cache(maxsize=1 << 20)
def token_id(token: str) -> int:
    """A stable 32-bit id for a term (same on every machine and process)."""
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest(), "little")


def bm25_doc_vector(tokens: Sequence[str], avgdl: float, k1: float = 1.5, b: float = 0.75) -> models.SparseVector:
    """BM25 term weights of a document, ``tf / (tf + k1 * (1 - b + b * dl / avgdl))`` (Qdrant applies IDF).

    No ``(k1 + 1)`` factor: bm25s' ``"lucene"`` method (and Lucene since 8.0) leaves it out, and
    with it the sparse leg's scores would be ``k1 + 1`` times the BM25 leg's.
    """
    if avgdl <= 0:
        raise ValueError(f"avgdl must be > 0, got {avgdl}")
    dl = len(tokens)
    norm = k1 * (1 - b + b * dl / avgdl)
    weights: dict[int, float] = {}
    for term, tf in Counter(tokens).items():
        tid = token_id(term)
        weights[tid] = weights.get(tid, 0.0) + tf / (tf + norm)
    ids = sorted(weights)
    from qdrant_client import models

    return models.SparseVector(indices=ids, values=[weights[i] for i in ids])


def bm25_query_vector(tokens: Sequence[str]) -> models.SparseVector:
    """Weight = how often the term occurs in the query (bm25s also counts repeats)."""
    counts: Counter[int] = Counter(token_id(t) for t in tokens)
    ids = sorted(counts)
    from qdrant_client import models

    return models.SparseVector(indices=ids, values=[float(counts[i]) for i in ids])


def qdrant_filter(
    filters: Optional[MetadataFilters],
    point_filter: Optional[Callable[[MetadataFilters], Any]],
    filter_builder: Optional[Callable[[VectorStoreQuery], Any]],
) -> Any:
    """The Qdrant filter of one query: None without ``filters``, else ``point_filter(filters)``
    when given, else ``filter_builder``'s translation of ``filters``."""
    if filters is None:
        return None
    if point_filter is not None:
        return point_filter(filters)
    if filter_builder is None:
        raise ValueError("filters need a filter_builder (MetadataFilters -> Qdrant filter) or a point_filter")
    return filter_builder(VectorStoreQuery(filters=filters))


def filters_point_filter(point_filter: Optional[Callable[..., Any]]) -> Optional[Callable[[MetadataFilters], Any]]:
    """``point_filter`` as a callable of the current filters: itself when it takes an argument,
    else a wrapper calling it without (the protocol of earlier versions)."""
    if point_filter is None:
        return None
    import inspect

    try:
        params = inspect.signature(point_filter).parameters.values()
    except (TypeError, ValueError):
        return point_filter
    if any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        return point_filter
    return lambda filters: point_filter()


def check_filter_source(filters: Optional[MetadataFilters], point_filter: Any, filter_builder: Any) -> Optional[MetadataFilters]:
    """``filters`` validated; a ValueError when they are given with no way to translate them."""
    filters = validate_filters(filters)
    if filters is not None and point_filter is None and filter_builder is None:
        raise ValueError("filters need a filter_builder (MetadataFilters -> Qdrant filter) or a point_filter")
    return filters


def points_store(client: Any, collection_name: Optional[str]) -> Any:
    """The point store a Qdrant retriever searches: ``client`` itself when it is one (an
    ``EdgePoints`` / ``ServerPoints`` of :mod:`llama_index_retrieval_kit.indices.store`, as
    ``HybridIndex`` passes), else a ``QdrantClient`` wrapped with ``collection_name``."""
    if hasattr(client, "search") and hasattr(client, "ids_filter"):
        return client
    if not collection_name:
        raise ValueError("a QdrantClient needs collection_name=")
    return ServerPoints(client, collection_name)


class _EngineSearchMixin:
    """What the retrievers searching Qdrant share: ``filters`` validated when assigned (as the
    other retrievers' are), and ``aretrieve`` run in a worker thread: a query waits for the index's
    read guard (an in-process upsert or purge holds it for up to seconds) and for the engine's
    answer (a server's network round trip) there, never on the event loop."""

    _point_filter: Optional[Callable[[MetadataFilters], Any]]
    _filter_builder: Optional[Callable[[VectorStoreQuery], Any]]

    @property
    def filters(self) -> Optional[MetadataFilters]:
        """The metadata filters of every query (validated when assigned)."""
        return self._filters

    @filters.setter
    def filters(self, filters: Optional[MetadataFilters]) -> None:
        self._filters = check_filter_source(filters, self._point_filter, self._filter_builder)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)  # type: ignore[attr-defined]


class QdrantHybridRetriever(_EngineSearchMixin, CheckedQueryMixin, BaseRetriever):
    """Hybrid retrieval fused by Qdrant itself (scales out with a Qdrant server or cluster).

    Args:
        client: A ``QdrantClient`` (local ``path=...`` or ``url=...``), or the point store of a
            ``HybridIndex`` (Qdrant Edge or a server, :mod:`~llama_index_retrieval_kit.indices.store`).
        collection_name: A collection with ``text-dense`` and ``text-sparse-new`` vectors, as
            written by :class:`~llama_index_retrieval_kit.HybridIndex`.
        embed_model: The embedding model the dense vectors were made with.
        tokenize: The BM25 tokenizer the sparse vectors were made with.
        filter_builder: Turns LlamaIndex ``MetadataFilters`` into a Qdrant filter (e.g.
            ``QdrantVectorStore._build_query_filter``); applied to every prefetch. Optional
            when ``point_filter`` is given or there are no ``filters``.
        similarity_top_k: Results returned.
        candidate_top_k: Depth of each leg before fusion.
        rrf_k: RRF constant in our convention (ranks from 1).
        fusion: ``"rrf"`` (default) or ``"dbsf"`` (Qdrant's distribution-based score fusion;
            ``rrf_k`` then plays no part).
        filters: Metadata filters for every query (validated here).
        point_filter: Called once per query with the retriever's current ``filters`` (so a later
            ``retriever.filters = ...`` is followed), returns the filter that implements them
            (takes precedence over ``filter_builder``): a Qdrant filter, or a store
            ``PointFilter``. One that takes no argument is called without. ``HybridIndex`` passes one that admits exactly the chunks
            ``filters`` matches in every other mode (translated for the engine where exact).
        read_guard: Called once per query, returns a context manager held while Qdrant is read
            (``HybridIndex`` passes its read lock, so a query never sees half an update).
        node_lookup: Optional :data:`NodeLookup`: the engine then returns point ids only and the
            result nodes come from it (an embedded ``HybridIndex`` passes copies of its own nodes,
            about 10x cheaper than parsing each payload); without it, or when it lacks a point,
            nodes are parsed from the payloads (LlamaIndex's ``metadata_dict_to_node``).
        leg_scores: Also run each leg on its own in the same engine batch, so that every result
            carries its rank and score in the ``bm25`` and ``dense`` legs (``FusedNodeWithScore``;
            what the no-answer gate and the trace read). About doubles the engine's share of the
            query; False returns plain ``NodeWithScore`` results with the fused score only.
    """

    def __init__(
        self,
        client: Any,
        collection_name: Optional[str],
        embed_model: BaseEmbedding,
        tokenize: Callable[[str], List[str]],
        filter_builder: Optional[Callable[[VectorStoreQuery], Any]] = None,
        similarity_top_k: int = 10,
        candidate_top_k: int = 100,
        rrf_k: int = 60,
        filters: Optional[MetadataFilters] = None,
        point_filter: Optional[Callable[[], Any]] = None,
        read_guard: Optional[Callable[[], ContextManager[Any]]] = None,
        fusion: str = "rrf",
        node_lookup: Optional[NodeLookup] = None,
        leg_scores: bool = True,
        **kwargs: Any,
    ) -> None:
        from .._enums import EngineFusion

        if not isinstance(leg_scores, bool):
            raise ValueError(f"leg_scores must be True or False, got {leg_scores!r}")

        check_positive_int("similarity_top_k", similarity_top_k)
        check_positive_int("candidate_top_k", candidate_top_k)
        self.fusion = EngineFusion.from_str(fusion).value
        if isinstance(rrf_k, bool) or not isinstance(rrf_k, (int, float)):
            raise ValueError(f"rrf_k must be a non-negative integer for Qdrant, got {rrf_k!r}")
        filters = check_filter_source(filters, point_filter, filter_builder)
        if candidate_top_k < similarity_top_k:
            raise ValueError(f"candidate_top_k ({candidate_top_k}) must be >= similarity_top_k ({similarity_top_k})")
        if rrf_k < 0 or int(rrf_k) != rrf_k:
            raise ValueError(f"rrf_k must be a non-negative integer for Qdrant, got {rrf_k}")
        super().__init__(**kwargs)
        self._points = points_store(client, collection_name)
        self._embed_model = embed_model
        self._tokenize = tokenize
        self._filter_builder = filter_builder
        self._point_filter = filters_point_filter(point_filter)
        self._read_guard = read_guard or nullcontext
        self._node_lookup = node_lookup
        self.similarity_top_k = similarity_top_k
        self.candidate_top_k = candidate_top_k
        self.rrf_k = int(rrf_k)
        self.leg_scores = leg_scores
        self.filters = filters

    def _query_filter(self) -> Any:
        return qdrant_filter(self.filters, self._point_filter, self._filter_builder)

    @property
    def fusion_attributes(self) -> Dict[str, Any]:
        """The fusion's settings as a trace records them (run by the engine, the legs in the same batch)."""
        attributes: Dict[str, Any] = {"mode": f"qdrant_{self.fusion}", "similarity_top_k": self.similarity_top_k, "engine": True}
        if self.fusion == "rrf":
            attributes["rrf_k"] = self.rrf_k
        return attributes

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        laps = Laps() if tracing_enabled() else NO_LAPS
        dense = query_embedding(query_bundle, self._embed_model)
        laps.mark("embed")
        sparse = bm25_query_vector(self._tokenize(check_query_text(query_bundle.query_str)))
        laps.mark(BM25_LEG)
        with self._read_guard():
            found, results = self._query(dense, sparse)
        if laps.on:
            laps.mark("fusion")  # the engine's batch: both legs and their fusion
            node_ids, legs = leg_positions(found)  # no legs recorded without leg_scores
            trace_index_fusion(self, query_bundle, node_ids, legs, results, laps)
        return results

    def _query(self, dense: Sequence[float], sparse: models.SparseVector) -> Tuple[LegSearch, List[NodeWithScore]]:
        """The fused results, each with its rank and score in every leg (:func:`fused_with_legs`;
        with ``leg_scores`` off, plain results and no legs)."""
        query = dict(limit=self.similarity_top_k, prefetch_limit=self.candidate_top_k, rrf_k=self.rrf_k,
                     filter=self._query_filter(), fusion=self.fusion)
        if not self.leg_scores:
            found = results_from_lookup(self._points, self._node_lookup, dense, sparse, **query)
            if found is None:
                found = nodes_from_payloads(self._points.search(dense, sparse, **query), self.filters)
            return LegSearch([], {}), found
        if self._node_lookup is not None:
            found = self._points.search_with_legs(dense, sparse, **query)
            nodes = self._node_lookup([point for point, _, _ in found.fused])
            if all(node is not None for node in nodes):
                return found, fused_with_legs(found, nodes)
            logger.warning("%d of %d result point(s) are not among the index's nodes; reading the payloads instead",
                           sum(node is None for node in nodes), len(nodes))
        found = self._points.search_with_legs(dense, sparse, with_payload=True, **query)
        nodes = payload_nodes([payload for _, _, payload in found.fused], self.filters)  # re-checked against the filters
        pairs = [(hit, node) for hit, node in zip(found.fused, nodes) if node is not None]
        found = LegSearch([hit for hit, _ in pairs], found.legs)
        return found, fused_with_legs(found, [node for _, node in pairs])


class QdrantDenseRetriever(_EngineSearchMixin, CheckedQueryMixin, BaseRetriever):
    """Dense search run by Qdrant (``query_points`` on the dense vector), cosine scores.

    The dense leg of a ``HybridIndex`` on a Qdrant server. Filters work as in
    :class:`QdrantHybridRetriever` (``point_filter`` / ``filter_builder``), and so do ``read_guard``
    and ``node_lookup``.
    """

    def __init__(
        self,
        client: Any,
        collection_name: Optional[str],
        embed_model: BaseEmbedding,
        similarity_top_k: int = 10,
        filters: Optional[MetadataFilters] = None,
        filter_builder: Optional[Callable[[VectorStoreQuery], Any]] = None,
        point_filter: Optional[Callable[[], Any]] = None,
        read_guard: Optional[Callable[[], ContextManager[Any]]] = None,
        node_lookup: Optional[NodeLookup] = None,
        **kwargs: Any,
    ) -> None:
        check_positive_int("similarity_top_k", similarity_top_k)
        filters = check_filter_source(filters, point_filter, filter_builder)
        super().__init__(**kwargs)
        self._points = points_store(client, collection_name)
        self._embed_model = embed_model
        self._filter_builder = filter_builder
        self._point_filter = filters_point_filter(point_filter)
        self._read_guard = read_guard or nullcontext
        self._node_lookup = node_lookup
        self.similarity_top_k = similarity_top_k
        self.filters = filters

    def _query_filter(self) -> Any:
        return qdrant_filter(self.filters, self._point_filter, self._filter_builder)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        dense = query_embedding(query_bundle, self._embed_model)
        with self._read_guard():
            found = results_from_lookup(self._points, self._node_lookup, dense, None, limit=self.similarity_top_k, filter=self._query_filter())
            if found is not None:
                return found
            hits = self._points.search(dense, None, limit=self.similarity_top_k, filter=self._query_filter())
        return nodes_from_payloads(hits, self.filters)
