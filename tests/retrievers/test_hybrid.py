"""HybridRetriever: fusion of real and fake legs, sync == async, concurrency, depth, no mutation."""

from __future__ import annotations

import asyncio
import logging
from typing import List, Optional, Sequence

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_retrieval_kit.retrievers import (
    BM25Retriever,
    BM25TokenizerConfig,
    FusedNodeWithScore,
    HybridRetriever,
    reciprocal_rank_fusion,
)


class FakeRetriever(BaseRetriever):
    """Returns a fixed ranked list (like a dense leg would), whatever the query."""

    def __init__(self, results: Sequence[NodeWithScore], similarity_top_k: Optional[int] = None) -> None:
        super().__init__()
        self._results = list(results)
        self.similarity_top_k = similarity_top_k if similarity_top_k is not None else len(self._results)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=r.node, score=r.score) for r in self._results[: self.similarity_top_k]]


class RendezvousRetriever(BaseRetriever):
    """An async leg that only finishes once its partner has started: proves legs run concurrently."""

    def __init__(self, mine: asyncio.Event, partner: asyncio.Event, node: TextNode) -> None:
        super().__init__()
        self._mine, self._partner, self._node = mine, partner, node

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=self._node, score=1.0)]

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self._mine.set()
        await self._partner.wait()
        return self._retrieve(query_bundle)


@pytest.fixture()
def nodes() -> List[TextNode]:
    texts = [
        "The annual fee is ninety five dollars.",
        "A late payment fee applies after the due date.",
        "Interest accrues daily on the average balance.",
        "Dispute a charge within sixty days of the statement.",
        "Annual percentage rate for purchases and cash advances.",
        "Rewards points never expire while the account is open.",
    ]
    return [TextNode(id_=f"n{i}", text=t, metadata={"i": i}) for i, t in enumerate(texts)]


def summary(results: List[NodeWithScore]) -> list:
    return [(r.node.node_id, r.score, r.leg_ranks, r.leg_scores) for r in results]  # type: ignore[attr-defined]


def test_bm25_plus_fake_leg_sync_equals_async(nodes: List[TextNode]) -> None:
    before = [n.to_dict() for n in nodes]
    bm25 = BM25Retriever.from_nodes(nodes, similarity_top_k=5)
    dense = FakeRetriever([NodeWithScore(node=nodes[i], score=s) for i, s in [(4, 0.9), (0, 0.8), (5, 0.3)]])
    hybrid = HybridRetriever([bm25, dense], names=["bm25", "dense"], similarity_top_k=4)
    sync = hybrid.retrieve("annual fee")
    async_ = asyncio.run(hybrid.aretrieve("annual fee"))
    assert summary(sync) == summary(async_)
    assert all(isinstance(r, FusedNodeWithScore) for r in sync)
    assert sync[0].node.node_id == "n0"  # first in bm25, second in dense
    assert sync[0].leg_ranks == {"bm25": 1, "dense": 2}
    expected = reciprocal_rank_fusion([bm25.retrieve("annual fee"), dense.retrieve("annual fee")], names=["bm25", "dense"], top_k=4)
    assert summary(sync) == summary(expected)
    assert [n.to_dict() for n in nodes] == before


def test_two_bm25_legs_score_mode_sync_equals_async(nodes: List[TextNode]) -> None:
    stemmed = BM25Retriever.from_nodes(nodes)
    plain = BM25Retriever.from_nodes(nodes, tokenizer_config=BM25TokenizerConfig(stopwords=None, stemmer_language=None))
    for mode in ("rrf", "score"):
        hybrid = HybridRetriever([stemmed, plain], mode=mode, weights=[0.7, 0.3])
        sync = hybrid.retrieve("fees for late payments")
        assert summary(sync) == summary(asyncio.run(hybrid.aretrieve("fees for late payments")))
        assert sync and set(sync[0].leg_ranks) <= {"leg0", "leg1"}
        assert all(a.score >= b.score for a, b in zip(sync, sync[1:]))


def test_dense_leg_with_mock_embedding(nodes: List[TextNode]) -> None:
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    hybrid = HybridRetriever(
        [BM25Retriever.from_nodes(nodes), index.as_retriever(similarity_top_k=3)], names=["bm25", "dense"], similarity_top_k=5
    )
    sync = hybrid.retrieve("interest balance")
    assert summary(sync) == summary(asyncio.run(hybrid.aretrieve("interest balance")))
    assert sync[0].node.node_id == "n2"


def test_async_legs_run_concurrently() -> None:
    async def run() -> List[NodeWithScore]:
        a, b = asyncio.Event(), asyncio.Event()
        legs = [RendezvousRetriever(a, b, TextNode(id_="x", text="x")), RendezvousRetriever(b, a, TextNode(id_="y", text="y"))]
        return await asyncio.wait_for(HybridRetriever(legs).aretrieve("q"), timeout=5)

    assert [r.node.node_id for r in asyncio.run(run())] == ["x", "y"]


def test_candidate_depth_truncates_without_touching_legs(nodes: List[TextNode], caplog: pytest.LogCaptureFixture) -> None:
    dense = FakeRetriever([NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(nodes)], similarity_top_k=4)
    other = FakeRetriever([NodeWithScore(node=nodes[5], score=1.0)])
    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.retrievers.hybrid"):
        hybrid = HybridRetriever([dense, other], candidate_top_k=[2, 5])
    assert "returns at most 1" in caplog.text
    assert dense.similarity_top_k == 4 and other.similarity_top_k == 1
    results = hybrid.retrieve("q")
    assert [r.node.node_id for r in results] == ["n0", "n5", "n1"]
    assert max(r.leg_ranks.get("leg0", 0) for r in results) == 2  # type: ignore[attr-defined]


def test_zero_weight_leg_only_adds_zero_score_tail(nodes: List[TextNode]) -> None:
    a = FakeRetriever([NodeWithScore(node=nodes[0], score=1.0), NodeWithScore(node=nodes[1], score=0.5)])
    b = FakeRetriever([NodeWithScore(node=nodes[2], score=1.0), NodeWithScore(node=nodes[1], score=0.5)])
    results = HybridRetriever([a, b], weights=[1, 0]).retrieve("q")
    assert [(r.node.node_id, r.score) for r in results] == [("n0", 1 / 61), ("n1", 1 / 62), ("n2", 0.0)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "max"}, "max"),
        ({"rrf_k": -1}, "k must be"),
        ({"weights": [1.0]}, "weights has 1"),
        ({"candidate_top_k": 0}, "candidate_top_k"),
        ({"candidate_top_k": [3]}, "candidate_top_k has 1"),
        ({"similarity_top_k": 0}, "similarity_top_k"),
        ({"names": ["a", "a"]}, "unique"),
    ],
)
def test_validation(kwargs: dict, message: str) -> None:
    legs = [FakeRetriever([]), FakeRetriever([])]
    with pytest.raises(ValueError, match=message):
        HybridRetriever(legs, **kwargs)


def test_needs_two_retrievers() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        HybridRetriever([FakeRetriever([])])
    with pytest.raises(ValueError, match="BaseRetriever"):
        HybridRetriever([FakeRetriever([]), "not a retriever"])  # type: ignore[list-item]


def test_filters_set_on_the_fusion_reach_every_leg_or_are_refused(nodes: List[TextNode]) -> None:
    """``hybrid.filters = f`` filters every leg; a leg that cannot take filters makes it a
    TypeError with nothing changed (one unfiltered leg would leak what the filter excludes)."""
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    only_0 = MetadataFilters(filters=[MetadataFilter(key="i", value=0)])
    bm25 = BM25Retriever.from_nodes(nodes, similarity_top_k=6)
    hybrid = HybridRetriever([bm25, bm25.with_filters(None)], similarity_top_k=6)
    hybrid.filters = only_0
    assert hybrid.filters is only_0 and [r.node.node_id for r in hybrid.retrieve("annual fee")] == ["n0"]
    assert bm25.filters == only_0  # the legs themselves were set
    fixed = HybridRetriever([bm25.with_filters(None), FakeRetriever([NodeWithScore(node=nodes[1], score=1.0)])], similarity_top_k=6)
    with pytest.raises(TypeError, match=rf"legs \[{fixed.names[1]!r}\] have no settable filters"):
        fixed.filters = only_0
    assert fixed.filters is None
