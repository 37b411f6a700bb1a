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
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import Any, Callable, List, Optional, Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import MetadataFilters, VectorStoreQuery
from llama_index.core.vector_stores.utils import metadata_dict_to_node
from qdrant_client import QdrantClient, models

logger = logging.getLogger(__name__)

DENSE_VECTOR = "text-dense"
SPARSE_VECTOR = "text-sparse-new"


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
    return models.SparseVector(indices=ids, values=[weights[i] for i in ids])


def bm25_query_vector(tokens: Sequence[str]) -> models.SparseVector:
    """Weight = how often the term occurs in the query (bm25s also counts repeats)."""
    counts: Counter[int] = Counter(token_id(t) for t in tokens)
    ids = sorted(counts)
    return models.SparseVector(indices=ids, values=[float(counts[i]) for i in ids])


def sparse_vectors_config() -> dict[str, models.SparseVectorParams]:
    """The sparse vector of a hybrid collection: BM25 weights with Qdrant's IDF modifier."""
    return {SPARSE_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)}


class QdrantHybridRetriever(BaseRetriever):
    """Hybrid retrieval fused by Qdrant itself (scales out with a Qdrant server or cluster).

    Args:
        client: A ``QdrantClient`` (local ``path=...`` or ``url=...``).
        collection_name: A collection with ``text-dense`` and ``text-sparse-new`` vectors, as
            written by :class:`~llama_index_retrieval_kit.HybridIndex`.
        embed_model: The embedding model the dense vectors were made with.
        tokenize: The BM25 tokenizer the sparse vectors were made with.
        filter_builder: Turns LlamaIndex ``MetadataFilters`` into a Qdrant filter
            (``QdrantVectorStore._build_query_filter``); applied to every prefetch.
        similarity_top_k: Results returned.
        candidate_top_k: Depth of each leg before fusion.
        rrf_k: RRF constant in our convention (ranks from 1).
        filters: Metadata filters for every query.
    """

    def __init__(
        self,
        client: QdrantClient,
        collection_name: str,
        embed_model: BaseEmbedding,
        tokenize: Callable[[str], List[str]],
        filter_builder: Callable[[VectorStoreQuery], Any],
        similarity_top_k: int = 10,
        candidate_top_k: int = 100,
        rrf_k: int = 60,
        filters: Optional[MetadataFilters] = None,
        **kwargs: Any,
    ) -> None:
        if similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be >= 1, got {similarity_top_k}")
        if candidate_top_k < similarity_top_k:
            raise ValueError(f"candidate_top_k ({candidate_top_k}) must be >= similarity_top_k ({similarity_top_k})")
        if rrf_k < 0 or int(rrf_k) != rrf_k:
            raise ValueError(f"rrf_k must be a non-negative integer for Qdrant, got {rrf_k}")
        super().__init__(**kwargs)
        self._client = client
        self._collection = collection_name
        self._embed_model = embed_model
        self._tokenize = tokenize
        self._filter_builder = filter_builder
        self.similarity_top_k = similarity_top_k
        self.candidate_top_k = candidate_top_k
        self.rrf_k = int(rrf_k)
        self.filters = filters

    def _query_filter(self) -> Any:
        if self.filters is None:
            return None
        return self._filter_builder(VectorStoreQuery(filters=self.filters))

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        dense = query_bundle.embedding or self._embed_model.get_query_embedding(query_bundle.query_str)
        sparse = bm25_query_vector(self._tokenize(query_bundle.query_str))
        flt = self._query_filter()
        prefetch = [models.Prefetch(query=list(dense), using=DENSE_VECTOR, limit=self.candidate_top_k, filter=flt)]
        if sparse.indices:
            prefetch.append(models.Prefetch(query=sparse, using=SPARSE_VECTOR, limit=self.candidate_top_k, filter=flt))
        response = self._client.query_points(
            collection_name=self._collection,
            prefetch=prefetch,
            query=models.RrfQuery(rrf=models.Rrf(k=self.rrf_k + 1)),
            limit=self.similarity_top_k,
            query_filter=flt,
            with_payload=True,
        )
        results = []
        for point in response.points:
            node = metadata_dict_to_node(point.payload)
            results.append(NodeWithScore(node=node, score=float(point.score)))
        return results
