"""HybridIndex retrievers and engines: per-leg ranks and scores on fused results, aretrieve ==
retrieve, the query engine (no LLM: clear error; MockLLM: hybrid sources), and the hierarchical
parser with LlamaIndex's AutoMergingRetriever."""

from __future__ import annotations

import asyncio
import copy
import math
from pathlib import Path

import pytest
from llama_index.core import Settings, StorageContext
from llama_index.core.llms import MockLLM
from llama_index.core.retrievers import AutoMergingRetriever
from llama_index.core.schema import QueryBundle
from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.indices import RETRIEVER_MODES, HybridIndex
from llama_index_retrieval_kit.node_parser import SectionHierarchyNodeParser
from llama_index_retrieval_kit.retrievers import FusedNodeWithScore
from llama_index_retrieval_kit.retrievers.fused_index import FusedIndexRetriever

from . import _support


@pytest.mark.parametrize("mode", ["hybrid", "hybrid_score", "hybrid_rrf"])
def test_fused_results_carry_each_legs_rank_and_score(index: HybridIndex, bundles, mode: str) -> None:
    depth = 200 if mode == "hybrid" else 100  # the default candidate_top_k of each fusion
    legs_of_mode = {"bm25", "dense", "feedback"} if mode == "hybrid" else {"bm25", "dense"}
    for qb in bundles[:3]:
        legs = {
            "bm25": index.as_retriever("sparse", similarity_top_k=depth).retrieve(qb),
            "dense": index.as_retriever("dense", similarity_top_k=depth).retrieve(qb),
        }
        rank_of = {leg: {r.node.node_id: (rank, r.score) for rank, r in enumerate(res, 1)} for leg, res in legs.items()}
        results = index.as_retriever(mode, similarity_top_k=10).retrieve(qb)
        assert len(results) == 10
        for r in results:
            assert isinstance(r, FusedNodeWithScore)
            assert r.leg_ranks and set(r.leg_ranks) <= legs_of_mode and set(r.leg_scores) == set(r.leg_ranks)
            for leg in ("bm25", "dense"):
                if r.node.node_id in rank_of[leg]:
                    assert (r.leg_ranks[leg], r.leg_scores[leg]) == pytest.approx(rank_of[leg][r.node.node_id], abs=1e-12)
                else:
                    assert leg not in r.leg_ranks
            if mode == "hybrid_rrf":  # RRF, k = 60, ranks from 1
                assert r.score == pytest.approx(math.fsum(1 / (60 + k) for k in r.leg_ranks.values()), abs=1e-15)
            elif mode == "hybrid_score":  # score fusion, equal weights: mean of the legs' min-max normalised scores
                assert 0.0 <= r.score <= 1.0
        assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
        if mode == "hybrid":  # the feedback leg: cosine to the first pass's best chunk, ranked by it
            feedback = sorted((r.leg_ranks["feedback"], r.leg_scores["feedback"]) for r in results if "feedback" in r.leg_ranks)
            assert feedback and [s for _, s in feedback] == sorted((s for _, s in feedback), reverse=True)
            seed = [r for r in results if r.leg_ranks.get("feedback") == 1]
            assert seed and seed[0].leg_scores["feedback"] == pytest.approx(1.0, abs=1e-5)  # the seed chunk itself


@pytest.mark.parametrize("mode", RETRIEVER_MODES)
def test_aretrieve_gives_the_same_results_as_retrieve(index: HybridIndex, mode: str) -> None:
    retriever = index.as_retriever(mode, similarity_top_k=8)
    for query in ("What is the late payment fee?",):  # a string: the legs embed it on their own path
        sync = retriever.retrieve(query)
        async_ = asyncio.run(retriever.aretrieve(query))
        _support.assert_same_ranking(_support.ranking(async_), _support.ranking(sync), truncated=True)
        if mode.startswith("hybrid"):
            assert [r.leg_ranks for r in async_] == [r.leg_ranks for r in sync]
            for a, b in zip(async_, sync):
                assert a.leg_scores == pytest.approx(b.leg_scores, abs=1e-9)


def test_query_engine_needs_an_llm(index: HybridIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings, "_llm", None)
    with pytest.raises(ValueError, match=r"as_query_engine needs an LLM: pass llm=.*never falls back to a paid API"):
        index.as_query_engine()


def test_query_engine_with_mock_llm_answers_from_the_hybrid_results(index: HybridIndex) -> None:
    query = "How much does the Northwind Everyday Visa cost per year?"
    response = index.as_query_engine(llm=MockLLM(), similarity_top_k=4).query(query)
    assert str(response)  # MockLLM echoes the prompt, so the answer is not empty
    want = index.as_retriever("hybrid", similarity_top_k=4).retrieve(query)
    assert [(s.node.node_id, s.score) for s in response.source_nodes] == [(w.node.node_id, w.score) for w in want]
    assert all(isinstance(s, FusedNodeWithScore) for s in response.source_nodes)


def test_hierarchical_parser_indexes_leaves_and_auto_merging_works(tmp_path: Path, embed_model) -> None:
    (doc,) = [d for d in _support.sample_documents() if d.id_ == _support.CHANGED_DOC]
    parser = SectionHierarchyNodeParser(child_chunk_size=64, child_chunk_overlap=8)
    with HybridIndex.from_documents([doc], tmp_path / "idx", embed_model=embed_model, node_parser=parser) as idx:
        legs = _support.assert_consistent(idx)  # BM25 == Qdrant == docstore leaves; no parent in Qdrant
        assert legs.docstore_parents and legs.docstore_leaves
        assert not set(legs.docstore_parents) & (set(legs.bm25) | set(legs.qdrant))
        assert len(idx) == legs.qdrant_count == len(legs.docstore_leaves)
        for leaf in legs.docstore_leaves.values():
            assert leaf.parent_node.node_id in legs.docstore_parents
        assert {n.metadata["node_kind"] for n in legs.docstore_parents.values()} == {"parent"}

        # A query made of one multi-child section's text retrieves most of its children, which
        # AutoMergingRetriever (LlamaIndex's own) replaces by the parent from index.docstore.
        parent = max(
            (p for p in legs.docstore_parents.values() if 2 <= len(p.child_nodes) <= 4), key=lambda p: len(p.child_nodes)
        )
        merging = AutoMergingRetriever(
            idx.as_retriever("hybrid", similarity_top_k=6), StorageContext.from_defaults(docstore=idx.docstore)
        )
        merged = merging.retrieve(QueryBundle(parent.get_content()))
        assert parent.node_id in {r.node.node_id for r in merged}
        children = {c.node_id for c in parent.child_nodes}
        assert not children & {r.node.node_id for r in merged}  # replaced, not duplicated

    with HybridIndex.load(tmp_path / "idx", embed_model=embed_model) as reopened:  # parser restored from index.json
        assert isinstance(reopened.node_parser, SectionHierarchyNodeParser)
        assert reopened.node_parser.child_chunk_size == 64
        _support.assert_consistent(reopened)


def test_hybrid_defaults_to_the_feedback_fusion_and_keeps_the_old_rule_as_hybrid_score(index: HybridIndex, bundles) -> None:
    default = index.as_retriever("hybrid", similarity_top_k=10)
    assert isinstance(default, FusedIndexRetriever) and default.names == ["bm25", "dense", "feedback"]
    explicit = index.as_retriever("hybrid", similarity_top_k=10, candidate_top_k=200, weights=[0.3, 0.3, 0.4])
    two_weights = index.as_retriever("hybrid", similarity_top_k=10, weights=[1.0, 1.0])  # feedback keeps 0.4
    for qb in bundles[:5]:
        want = _support.ranking(default.retrieve(qb))
        _support.assert_same_ranking(_support.ranking(explicit.retrieve(qb)), want)
        _support.assert_same_ranking(_support.ranking(two_weights.retrieve(qb)), want)
    old = index.as_retriever("hybrid_score", similarity_top_k=10)
    assert isinstance(old, FusedIndexRetriever) and old.names == ["bm25", "dense"]
    # with the dense leg in Qdrant there are no vectors in memory to feed back: "hybrid" is "hybrid_score"
    in_qdrant = index.as_retriever("hybrid", similarity_top_k=10, dense_search="qdrant")
    score_in_qdrant = index.as_retriever("hybrid_score", similarity_top_k=10, dense_search="qdrant")
    for qb in bundles[:3]:
        _support.assert_same_ranking(_support.ranking(in_qdrant.retrieve(qb)), _support.ranking(score_in_qdrant.retrieve(qb)))
    with pytest.raises(ValueError, match=r"weights has 4 entries .*\[bm25, dense\] or \[bm25, dense, feedback\]"):
        index.as_retriever("hybrid", weights=[1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        index.as_retriever("hybrid", weights=[1.0, -1.0, 1.0])


def test_feedback_fusion_respects_filters(index: HybridIndex, bundles) -> None:
    doc_id = index.doc_ids()[0]
    only = MetadataFilters(filters=[MetadataFilter(key="doc_id", value=doc_id)])
    for qb in bundles[:3]:
        results = index.as_retriever("hybrid", similarity_top_k=50, filters=only).retrieve(qb)
        assert results and {r.node.metadata["doc_id"] for r in results} == {doc_id}
        assert all(set(r.leg_ranks) <= {"bm25", "dense", "feedback"} for r in results)


def _as_compared(results) -> list:
    """What a result is: id, score, class, text, metadata, relationships."""
    return [(r.node.node_id, r.score, type(r.node).__name__, r.node.text, r.node.metadata, r.node.relationships) for r in results]


@pytest.mark.parametrize("mode, options", [("qdrant_hybrid", {}), ("qdrant_hybrid", {"fusion": "dbsf"}), ("dense", {"dense_search": "qdrant"})])
@pytest.mark.parametrize("filtered", [False, True])
def test_engine_side_results_from_the_index_nodes_equal_the_payloads(
    index: HybridIndex, bundles, mode, options, filtered, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the embedded store the engine returns ids and the nodes are copies of the index's own:
    the same results as parsing every payload (what a server's results are built from)."""
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import QdrantDenseRetriever, QdrantHybridRetriever

    doc_id = index.doc_ids()[0]
    filters = MetadataFilters(filters=[MetadataFilter(key="doc_id", value=doc_id)]) if filtered else None
    from_index = index.as_retriever(mode, similarity_top_k=25, filters=filters, **options)
    point_filter = None if filters is None else (lambda: index.store.metadata_filter(filters, index.bm25.snapshot.nodes))
    if mode == "dense":
        from_payloads = QdrantDenseRetriever(index.store, None, index.embed_model, similarity_top_k=25, filters=filters, point_filter=point_filter)
    else:
        from_payloads = QdrantHybridRetriever(
            index.store, None, index.embed_model, index.bm25.tokenize, similarity_top_k=25, candidate_top_k=100,
            rrf_k=60, filters=filters, point_filter=point_filter, **options,
        )
    wanted = [from_payloads.retrieve(qb) for qb in bundles[:4]]

    def no_payload_search(*args, **kwargs):
        raise AssertionError("the embedded index read the payloads")

    monkeypatch.setattr(index.store, "search", no_payload_search)  # the index's retriever asks for ids only
    for qb, want in zip(bundles[:4], wanted):
        got = from_index.retrieve(qb)
        assert got and _as_compared(got) == _as_compared(want)
        if filtered:
            assert {r.node.metadata["doc_id"] for r in got} == {doc_id}
    # copies: changing a result changes neither the index nor the next query's results
    first = from_index.retrieve(bundles[0])
    first[0].node.metadata["doc_id"] = "changed"
    first[0].node.relationships.clear()
    assert _as_compared(from_index.retrieve(bundles[0])) == _as_compared(wanted[0])


def test_engine_side_results_fall_back_to_payloads_when_the_lookup_lacks_a_point(index: HybridIndex, bundles, caplog) -> None:
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import QdrantHybridRetriever

    def partial_lookup(point_ids):  # knows every second point only
        return [None if i % 2 else index.docstore.get_node(index.bm25.snapshot.nodes[0].node_id) for i, _ in enumerate(point_ids)]

    common = dict(similarity_top_k=10, candidate_top_k=100, rrf_k=60)
    lacking = QdrantHybridRetriever(index.store, None, index.embed_model, index.bm25.tokenize, node_lookup=partial_lookup, **common)
    plain = QdrantHybridRetriever(index.store, None, index.embed_model, index.bm25.tokenize, **common)
    with caplog.at_level("WARNING"):
        got = lacking.retrieve(bundles[0])
    assert _as_compared(got) == _as_compared(plain.retrieve(bundles[0]))
    assert "not among the index's nodes" in caplog.text


@pytest.mark.parametrize("options", [{"rrf_k": 1}, {"fusion": "dbsf"}])
def test_qdrant_hybrid_orders_ties_by_point_id_the_same_on_every_call(index: HybridIndex, bundles, options) -> None:
    """Qdrant returns equal scores in no fixed order (RRF ties are common): the store orders
    them by point id, so a query ranks the same every time."""
    from llama_index_retrieval_kit.indices.store import point_id

    retriever = index.as_retriever("qdrant_hybrid", similarity_top_k=30, **options)
    ties = 0
    for qb in bundles:
        runs = [[(r.node.node_id, r.score) for r in retriever.retrieve(qb)] for _ in range(4)]
        assert all(run == runs[0] for run in runs[1:])
        keys = [(-score, point_id(node_id)) for node_id, score in runs[0]]
        assert keys == sorted(keys)
        ties += sum(a[0] == b[0] for a, b in zip(keys, keys[1:]))
    assert ties or "fusion" in options  # RRF with k=1 ties on these questions: the rule was exercised


def _scramble_relationships(results) -> None:
    """Change, in place, every relationship a result carries: its id, hash and metadata."""
    for r in results:
        for info in r.node.relationships.values():
            for one in info if isinstance(info, list) else [info]:
                one.node_id = "changed"
                one.hash = "changed"
                one.metadata["injected"] = "changed"


@pytest.mark.parametrize("mode", RETRIEVER_MODES)
def test_changing_a_results_relationships_in_place_changes_neither_the_index_nor_later_results(
    index: HybridIndex, bundles, mode: str
) -> None:
    """Results share no RelatedNodeInfo with the index: a postprocessor that edits one (its id,
    hash or metadata) leaves the index, later queries and what the index saves as they were."""
    retriever = index.as_retriever(mode, similarity_top_k=8)
    first = retriever.retrieve(bundles[0])
    want = copy.deepcopy(_as_compared(first))  # what the results were, not the objects about to change
    assert first and all(r.node.relationships for r in first)
    assert any(info.metadata for r in first for info in r.node.relationships.values() if not isinstance(info, list))
    _scramble_relationships(first)
    assert _as_compared(retriever.retrieve(bundles[0])) == want
    stored = index.docstore.get_node(first[0].node.node_id)
    assert "changed" not in {info.node_id for info in stored.relationships.values() if not isinstance(info, list)}

