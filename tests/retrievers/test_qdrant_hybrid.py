"""Qdrant-native hybrid vs the in-process hybrid, on one HybridIndex over the bundled samples.

* Sparse leg alone: Qdrant's BM25 sparse vectors (IDF applied by Qdrant) score exactly like
  ``BM25Retriever`` (bm25s, Lucene variant) on a freshly built index; after an upsert they differ
  only because the sparse vectors keep the ``avgdl`` frozen at build time (checked against an
  independent Lucene BM25 oracle with each avgdl).
* Fusion: ``qdrant_hybrid`` and the mode it mirrors, ``hybrid_rrf`` (not the default ``hybrid``,
  whose feedback fusion needs the vectors in memory and has no Qdrant Query API form), return the
  same candidates with the same RRF scores, in the same order up to ties, at equal candidate depth.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, Sequence

import pytest
from llama_index.core.schema import QueryBundle

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.retrievers import FusedNodeWithScore
from llama_index_retrieval_kit.retrievers.qdrant_hybrid import (
    SPARSE_VECTOR,
    QdrantDenseRetriever,
    QdrantHybridRetriever,
    bm25_doc_vector,
    bm25_query_vector,
    token_id,
)

from ..indices import _support

ALL = 1000  # deeper than the corpus: every candidate


@pytest.fixture(scope="module")
def embed_model():
    return _support.embed_model()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, embed_model) -> _support.Template:
    """The session's sample index (built here when tests/indices did not build it already)."""
    return _support.build_template(tmp_path_factory.mktemp("qdrant_hybrid_template"))


@pytest.fixture(scope="module")
def qindex(template: _support.Template, tmp_path_factory: pytest.TempPathFactory, embed_model) -> Iterator[HybridIndex]:
    idx = HybridIndex.load(_support.copy_index(template, tmp_path_factory.mktemp("qh") / "index"), embed_model=embed_model)
    try:
        yield idx
    finally:
        idx.close()


@pytest.fixture(scope="module")
def bundles(embed_model):
    return _support.query_bundles()


# ---------------------------------------------------------------------- sparse leg alone


def qdrant_sparse_scores(index: HybridIndex, query: str) -> Dict[str, float]:
    vector = bm25_query_vector(index.bm25.tokenize(query))
    if not vector.indices:
        return {}
    hits = index.store.search(None, vector, limit=ALL)
    return {json.loads(payload["_node_content"])["id_"]: score for payload, score in hits}


def bm25_scores(index: HybridIndex, query: str) -> Dict[str, float]:
    return {r.node.node_id: float(r.score) for r in index.as_retriever("sparse", similarity_top_k=ALL).retrieve(query)}


def lucene_oracle(index: HybridIndex, query: str, avgdl: float) -> Dict[str, float]:
    """Lucene BM25 written out: sum over query tokens (repeats count) of
    ln(1 + (N - n + 0.5) / (n + 0.5)) * tf / (tf + k1 * (1 - b + b * dl / avgdl))."""
    k1, b = index.config["bm25"]["k1"], index.config["bm25"]["b"]
    docs = {n.node_id: index.bm25.tokenize(n.get_content()) for n in index.bm25.nodes}
    df = Counter(t for toks in docs.values() for t in set(toks))
    n_docs = len(docs)
    out = {}
    for node_id, toks in docs.items():
        tf, dl = Counter(toks), len(toks)
        score = math.fsum(
            math.log(1 + (n_docs - df[t] + 0.5) / (df[t] + 0.5)) * tf[t] / (tf[t] + k1 * (1 - b + b * dl / avgdl))
            for t in index.bm25.tokenize(query)
            if tf[t]
        )
        if score > 0:
            out[node_id] = score
    return out


def mean_doc_length(index: HybridIndex) -> float:
    lengths = [len(index.bm25.tokenize(n.get_content())) for n in index.bm25.nodes]
    return sum(lengths) / len(lengths)


def assert_scores_close(got: Dict[str, float], want: Dict[str, float], what: str, rel: float = 2e-6) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:5]}"
    for node_id, score in want.items():
        assert got[node_id] == pytest.approx(score, rel=rel, abs=1e-7), f"{what}: {node_id}"


def test_sparse_leg_scores_equal_bm25_on_a_fresh_index(qindex: HybridIndex) -> None:
    avgdl = mean_doc_length(qindex)
    assert qindex.config["bm25"]["avgdl"] == pytest.approx(avgdl)
    compared = 0
    for query in _support.questions():
        bm25, qdrant = bm25_scores(qindex, query), qdrant_sparse_scores(qindex, query)
        assert_scores_close(qdrant, bm25, f"qdrant vs bm25s for {query!r}")
        assert_scores_close(bm25, lucene_oracle(qindex, query, avgdl), f"bm25s vs oracle for {query!r}")
        compared += len(bm25)
    assert compared > 300


def test_after_an_upsert_the_sparse_leg_differs_from_bm25_only_by_its_frozen_avgdl(
    tmp_path: Path, template: _support.Template, embed_model
) -> None:
    with HybridIndex.load(_support.copy_index(template, tmp_path / "upserted"), embed_model=embed_model) as idx:
        frozen = idx.config["bm25"]["avgdl"]
        idx.upsert([_support.changed_document()])
        idx.delete("credit_card_terms.md")
        live = mean_doc_length(idx)
        assert idx.config["bm25"]["avgdl"] == frozen and abs(live - frozen) > 1
        differ = 0
        for query in _support.questions()[:12]:
            bm25, qdrant = bm25_scores(idx, query), qdrant_sparse_scores(idx, query)
            assert set(bm25) == set(qdrant)  # IDF statistics (N, n_t) are live in both
            assert_scores_close(bm25, lucene_oracle(idx, query, live), f"bm25s, live avgdl, {query!r}")
            assert_scores_close(qdrant, lucene_oracle(idx, query, frozen), f"qdrant, frozen avgdl, {query!r}")
            differ += sum(not math.isclose(bm25[i], qdrant[i], rel_tol=1e-4) for i in bm25)
        assert differ > 0  # the documented difference is real


def test_bm25_doc_vector_is_lucene_term_weight() -> None:
    tokens = ["fee", "annual", "fee", "waiv"]
    vector = bm25_doc_vector(tokens, avgdl=8.0, k1=1.2, b=0.75)
    norm = 1.2 * (1 - 0.75 + 0.75 * 4 / 8.0)
    want = {token_id("fee"): 2 / (2 + norm), token_id("annual"): 1 / (1 + norm), token_id("waiv"): 1 / (1 + norm)}
    assert list(vector.indices) == sorted(want)
    assert list(vector.values) == pytest.approx([want[i] for i in sorted(want)])
    query = bm25_query_vector(["fee", "fee", "annual"])
    assert dict(zip(query.indices, query.values)) == {token_id("fee"): 2.0, token_id("annual"): 1.0}
    assert token_id("fee") == token_id("fee") != token_id("fees")
    with pytest.raises(ValueError, match="avgdl must be > 0"):
        bm25_doc_vector(tokens, avgdl=0)


# ---------------------------------------------------------------------- fused results


def tied_ids(scores: Sequence[float], ids: Sequence[str], rel: float = 1e-6) -> set:
    """Ids whose score equals a neighbour's (their rank between them is arbitrary)."""
    out = set()
    for i in range(1, len(scores)):
        if math.isclose(scores[i], scores[i - 1], rel_tol=rel, abs_tol=1e-8):
            out.update((ids[i], ids[i - 1]))
    return out


def leg_ties(index: HybridIndex, qb: QueryBundle) -> set:
    out = set()
    for mode in ("sparse", "dense"):
        res = index.as_retriever(mode, similarity_top_k=ALL).retrieve(qb)
        out |= tied_ids([r.score for r in res], [r.node.node_id for r in res])
    return out


def test_qdrant_hybrid_and_hybrid_agree_on_every_sample_question(qindex: HybridIndex, bundles) -> None:
    strict = 0
    for qb in bundles:
        native = qindex.as_retriever("qdrant_hybrid", similarity_top_k=ALL).retrieve(qb)
        ours = qindex.as_retriever("hybrid_rrf", similarity_top_k=ALL).retrieve(qb)
        native_scores = {r.node.node_id: r.score for r in native}
        our_scores = {r.node.node_id: r.score for r in ours}
        assert len(native_scores) == len(native) and native_scores.keys() == our_scores.keys(), qb.query_str
        ties = leg_ties(qindex, qb)
        for node_id, score in our_scores.items():
            if node_id not in ties:  # a leg tie may swap two ranks, and with them two RRF terms
                assert native_scores[node_id] == pytest.approx(score, abs=1e-8), (qb.query_str, node_id)
        if not ties:
            strict += 1
            _support.assert_same_ranking(_support.ranking(native), _support.ranking(ours), tol=1e-8)
            # And the top 10 (what users see) agree up to ties at the cut.
            top = qindex.as_retriever("qdrant_hybrid", similarity_top_k=10).retrieve(qb)
            _support.assert_same_ranking(_support.ranking(top), _support.ranking(ours[:10]), tol=1e-8, truncated=True)
    assert strict >= len(bundles) * 3 // 4, f"only {strict} questions without leg ties"


@pytest.mark.parametrize("depth", [3, 10])
def test_equal_candidate_depth_gives_equal_fusion(qindex: HybridIndex, bundles, depth: int) -> None:
    for qb in bundles[:10]:
        if leg_ties(qindex, qb):
            continue
        native = qindex.as_retriever("qdrant_hybrid", similarity_top_k=depth, candidate_top_k=depth).retrieve(qb)
        ours = qindex.as_retriever("hybrid_rrf", similarity_top_k=depth, candidate_top_k=depth).retrieve(qb)
        _support.assert_same_ranking(_support.ranking(native), _support.ranking(ours), tol=1e-8, truncated=True)
        assert all(isinstance(r, FusedNodeWithScore) and max(r.leg_ranks.values()) <= depth for r in ours)


def test_qdrant_hybrid_rejects_what_it_cannot_reproduce(qindex: HybridIndex) -> None:
    retriever = qindex.as_retriever("qdrant_hybrid", rrf_k=60.0)
    assert isinstance(retriever, QdrantHybridRetriever) and retriever.rrf_k == 60
    with pytest.raises(ValueError, match="rrf_k must be a non-negative integer"):
        qindex.as_retriever("qdrant_hybrid", rrf_k=60.5)  # was silently truncated to 60
    with pytest.raises(ValueError, match="cannot weight its legs"):
        qindex.as_retriever("qdrant_hybrid", weights=[2.0, 1.0])
    qindex.as_retriever("qdrant_hybrid", weights=[1.0, 1.0])  # equal weights rank alike: allowed


def test_query_of_stopwords_only_uses_the_dense_leg_in_both(qindex: HybridIndex, embed_model) -> None:
    query = "is it not that, or this? there they are, as such."
    assert qindex.bm25.tokenize(query) == []
    qb = QueryBundle(query, embedding=embed_model.get_query_embedding(query))
    native = qindex.as_retriever("qdrant_hybrid", similarity_top_k=5).retrieve(qb)
    ours = qindex.as_retriever("hybrid_rrf", similarity_top_k=5).retrieve(qb)
    _support.assert_same_ranking(_support.ranking(native), _support.ranking(ours), tol=1e-8, truncated=True)
    assert all(set(r.leg_ranks) == {"dense"} for r in ours)


def test_qdrant_hybrid_fusion_dbsf_is_an_option_and_checked(qindex: HybridIndex, bundles) -> None:
    dbsf = qindex.as_retriever("qdrant_hybrid", fusion="dbsf", similarity_top_k=ALL)
    assert isinstance(dbsf, QdrantHybridRetriever) and dbsf.fusion == "dbsf"
    for qb in bundles[:5]:
        fused = dbsf.retrieve(qb)
        legs = {r.node.node_id for mode in ("sparse", "dense") for r in qindex.as_retriever(mode, similarity_top_k=ALL).retrieve(qb)}
        scores = [r.score for r in fused]
        assert fused and scores == sorted(scores, reverse=True) and {r.node.node_id for r in fused} <= legs
        rrf = [r.node.node_id for r in qindex.as_retriever("qdrant_hybrid", similarity_top_k=ALL).retrieve(qb)]
        assert sorted(rrf) == sorted(r.node.node_id for r in fused)  # same candidates, another fusion
        assert max(scores) > 0.5  # DBSF sums normalised scores in [0, 1] per leg, RRF stays below 2 / 61
    with pytest.raises(ValueError, match="has no part in fusion='dbsf'"):
        qindex.as_retriever("qdrant_hybrid", fusion="dbsf", rrf_k=10)
    with pytest.raises(ValueError, match="unknown engine fusion 'max'; allowed: 'rrf', 'dbsf'"):
        qindex.as_retriever("qdrant_hybrid", fusion="max")
    with pytest.raises(ValueError, match="fusion"):
        qindex.as_retriever("hybrid", fusion="dbsf")  # an option of another mode


# ------------------------------------------------------------------------ each leg's rank and score
def test_qdrant_hybrid_results_carry_each_legs_rank_and_score(qindex: HybridIndex, bundles) -> None:
    """Fusion runs in the engine, and every result still carries the rank and score it had in the
    BM25 (sparse vectors) and dense legs, as hybrid_rrf's results do: the no-answer gate and the
    trace read them. The legs run in the same engine batch, under the same filter."""
    compared = 0
    for qb in bundles[:12]:
        native = qindex.as_retriever("qdrant_hybrid", similarity_top_k=10).retrieve(qb)
        ours = {r.node.node_id: r for r in qindex.as_retriever("hybrid_rrf", similarity_top_k=ALL).retrieve(qb)}
        ties = leg_ties(qindex, qb)
        assert native and all(isinstance(r, FusedNodeWithScore) for r in native)
        for r in native:
            mine = ours[r.node.node_id]
            assert list(r.leg_ranks) == list(r.leg_scores) and set(r.leg_ranks) == set(mine.leg_ranks) <= {"bm25", "dense"}
            for leg in r.leg_ranks:
                assert r.leg_scores[leg] == pytest.approx(mine.leg_scores[leg], rel=2e-6, abs=1e-7), (qb.query_str, leg)
                if r.node.node_id not in ties:
                    assert r.leg_ranks[leg] == mine.leg_ranks[leg], (qb.query_str, leg)
                    compared += 1
            rrf = sum(1.0 / (60 + rank) for rank in r.leg_ranks.values())
            if r.node.node_id not in ties:
                assert r.score == pytest.approx(rrf, abs=1e-7)  # the engine's fused score is RRF of those ranks
    assert compared >= 100


def test_qdrant_hybrid_legs_follow_the_filters(qindex: HybridIndex, bundles) -> None:
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    only = MetadataFilters(filters=[MetadataFilter(key="doc_id", value="product_manual.md")])
    for qb in bundles[:5]:
        native = qindex.as_retriever("qdrant_hybrid", similarity_top_k=5, filters=only).retrieve(qb)
        ours = {r.node.node_id: r for r in qindex.as_retriever("hybrid_rrf", similarity_top_k=ALL, filters=only).retrieve(qb)}
        ties = leg_ties(qindex, qb)
        assert native and all(r.node.metadata["doc_id"] == "product_manual.md" for r in native)
        for r in native:  # ranks among the filtered chunks only, as the in-process legs count them
            if r.node.node_id not in ties:
                assert r.leg_ranks == ours[r.node.node_id].leg_ranks


def test_qdrant_hybrid_on_a_server_carries_the_same_legs(qindex: HybridIndex, bundles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embed_model) -> None:
    """The same batch through qdrant-client (a server; local mode stands in): results parsed from
    the payloads carry the same leg ranks and scores as the embedded shard's."""
    from qdrant_client import QdrantClient

    server = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    try:
        qindex.push_to("http://qdrant.example:6333", collection="chunks")
        remote = QdrantHybridRetriever(server, "chunks", embed_model, qindex.bm25.tokenize, similarity_top_k=8)
        for qb in bundles[:6]:
            embedded = qindex.as_retriever("qdrant_hybrid", similarity_top_k=8).retrieve(qb)
            served = remote.retrieve(qb)
            assert [r.node.node_id for r in served] == [r.node.node_id for r in embedded]
            for a, b in zip(served, embedded):
                assert isinstance(a, FusedNodeWithScore) and a.leg_ranks == b.leg_ranks
                assert a.leg_scores == pytest.approx(b.leg_scores, rel=1e-5)
    finally:
        server.close()


def test_a_gate_and_a_trace_work_on_qdrant_hybrid(qindex: HybridIndex, bundles) -> None:
    """Before, qdrant_hybrid gave plain scores: a gate fitted on the legs refused its results, one
    fitted on them read RRF scores (not comparable across queries), and its trace had no legs."""
    from llama_index_retrieval_kit import NoAnswerPostprocessor
    from llama_index_retrieval_kit.evaluation import load_jsonl
    from llama_index_retrieval_kit.samples import QUESTIONS_FILE
    from llama_index_retrieval_kit.tracing import Stage, TraceCollector

    retriever = qindex.as_retriever("qdrant_hybrid", similarity_top_k=5)
    gate = NoAnswerPostprocessor.calibrate(
        retriever, load_jsonl(QUESTIONS_FILE),
        exclusion_retriever=lambda f: qindex.as_retriever("qdrant_hybrid", similarity_top_k=5, filters=f),
    )
    assert gate.feature_set == "legs" and gate.fit_report["auroc"] > 0.85
    with TraceCollector() as collector:
        results = retriever.retrieve(bundles[0])
    trace = collector.last
    assert [s.name for s in trace.stages] == ["bm25", "dense", "fusion"]
    assert [s.stage for s in trace.stages] == [Stage.RETRIEVAL_LEG, Stage.RETRIEVAL_LEG, Stage.FUSION]
    fusion = trace.stage("fusion")
    assert [n["node_id"] for n in fusion.outputs] == [r.node.node_id for r in results]
    assert [n["leg_ranks"] for n in fusion.outputs] == [r.leg_ranks for r in results]
    assert not fusion.unaccounted_ids() and fusion.attributes["mode"] == "qdrant_rrf"
    for stage in trace.stages[:2]:  # each leg's candidates, best first, with their scores
        scores = [n["score"] for n in stage.outputs]
        assert stage.outputs and scores == sorted(scores, reverse=True)


def test_leg_scores_can_be_turned_off(qindex: HybridIndex, bundles) -> None:
    from llama_index_retrieval_kit.tracing import TraceCollector

    plain = qindex.as_retriever("qdrant_hybrid", similarity_top_k=8, leg_scores=False)
    with_legs = qindex.as_retriever("qdrant_hybrid", similarity_top_k=8)
    for qb in bundles[:5]:
        fast, full = plain.retrieve(qb), with_legs.retrieve(qb)
        assert _support.ranking(fast) == _support.ranking(full)  # the same engine fusion
        assert not any(isinstance(r, FusedNodeWithScore) for r in fast)
    with TraceCollector() as collector:
        plain.retrieve(bundles[0])
    assert [s.name for s in collector.last.stages] == ["fusion"]  # no legs to record
    with pytest.raises(ValueError, match="leg_scores must be True or False"):
        qindex.as_retriever("qdrant_hybrid", leg_scores="yes")
    with pytest.raises(ValueError, match="does not use leg_scores"):
        qindex.as_retriever("hybrid", leg_scores=False)


def test_aretrieve_waits_for_the_index_off_the_event_loop(qindex: HybridIndex, bundles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embed_model) -> None:
    """The engine-side retrievers wait for their read guard (an index's read lock, held off by an
    in-process upsert or purge) and the engine in a worker thread: before, `aretrieve` waited on the
    event loop, which stalled every other request (961 ms for a lock held 1 s)."""
    import asyncio
    import threading
    from contextlib import contextmanager

    from qdrant_client import QdrantClient

    server = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    entered, release, waited_in = threading.Event(), threading.Event(), []

    @contextmanager
    def guard():
        waited_in.append(threading.get_ident())
        entered.set()
        if not release.wait(5):
            raise AssertionError("the event loop did not run while the query waited for the index")
        yield

    try:
        qindex.push_to("http://qdrant.example:6333", collection="chunks")
        retrievers = [
            QdrantHybridRetriever(server, "chunks", embed_model, qindex.bm25.tokenize, similarity_top_k=5, read_guard=guard),
            QdrantDenseRetriever(server, "chunks", embed_model, similarity_top_k=5, read_guard=guard),
        ]
        for retriever in retrievers:
            entered.clear()
            release.clear()

            async def query_while_the_loop_runs():
                task = asyncio.ensure_future(retriever.aretrieve(bundles[0]))
                while not entered.is_set():  # the loop keeps serving while the query waits in the guard
                    await asyncio.sleep(0.001)
                release.set()
                return await task

            got = asyncio.run(query_while_the_loop_runs())
            assert waited_in[-1] != threading.get_ident()
            assert [r.node.node_id for r in got] == [r.node.node_id for r in retriever.retrieve(bundles[0])]
            with pytest.raises(ValueError, match="filters"):
                retriever.filters = {"source": "a.md"}  # refused when assigned, as by the other retrievers
    finally:
        server.close()
