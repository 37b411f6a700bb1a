"""evaluate_retriever on the bundled samples with real retrievers: doc-, node- and text-level relevance.

Keyword retrievers only (ours and LlamaIndex's BM25): no embedding model is needed here; the
dense and hybrid retrievers are exercised by tests/evaluation/test_job.py.
"""

from __future__ import annotations

import functools
from typing import List

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle

from llama_index_retrieval_kit.evaluation import (
    RetrievalDataset,
    doc_level_run,
    evaluate_retriever,
    evaluate_run,
    load_jsonl,
    retrieve_all,
    score_retrievals,
    text_match,
)
from llama_index_retrieval_kit.evaluation.evaluate import latency_summary, passage_ranking
from llama_index_retrieval_kit.ingest import read_documents
from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser
from llama_index_retrieval_kit.retrievers import BM25Retriever
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files

KS = (1, 5, 10, 100)


@functools.lru_cache(maxsize=None)
def chunks(chunk_size: int = 200, chunk_overlap: int = 40) -> tuple:
    documents, failures = read_documents(sample_files())
    assert not failures
    return tuple(SectionWindowNodeParser(chunk_size=chunk_size, chunk_overlap=chunk_overlap).get_nodes_from_documents(documents))


def bm25_over(nodes) -> BM25Retriever:
    return BM25Retriever(list(nodes), similarity_top_k=len(nodes))


@pytest.fixture(scope="module")
def dataset() -> RetrievalDataset:
    return load_jsonl(QUESTIONS_FILE)


def node_labels(dataset: RetrievalDataset, nodes) -> RetrievalDataset:
    """The dataset with node-level qrels: the chunks of ``nodes`` that hold a reference passage."""
    qrels = {
        qid: {n.node_id: 1 for n in nodes if any(text_match(ref, n.get_content()) for ref in refs)}
        for qid, refs in dataset.reference_contexts.items()
        if refs
    }
    return RetrievalDataset(queries=dict(dataset.queries), qrels=qrels, reference_contexts={}, name="node-labels")


class FixedRetriever(BaseRetriever):
    """Returns the same results for every query (or nothing)."""

    def __init__(self, results: List[NodeWithScore]) -> None:
        super().__init__()
        self._results = results

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return list(self._results)


def test_doc_level_maps_chunks_to_documents_with_max_score_aggregation(dataset: RetrievalDataset) -> None:
    nodes = chunks()
    ev = evaluate_retriever(bm25_over(nodes), dataset, ks=KS, relevance="doc")
    assert ev.relevance == "doc"
    assert ev.num_scored == len(dataset.answerable_ids()) == 30
    for qid in ev.scored_ids():
        q = ev.per_query[qid]
        retrieval = q.retrieval
        assert retrieval.node_ids and len(retrieval.node_ids) == len(retrieval.scores) == len(retrieval.doc_ids)
        assert all(doc in {"credit_card_terms.md", "product_manual.md", "privacy_policy.txt"} for doc in retrieval.doc_ids)
        expected = doc_level_run(list(zip(retrieval.node_ids, retrieval.scores)), dict(zip(retrieval.node_ids, retrieval.doc_ids)))
        assert list(q.ranking) == [doc for doc, _ in expected]
        assert len(q.ranking) == len(set(q.ranking)) <= 3
    # The means are evaluate_run's over the doc rankings of the answerable queries.
    run = {qid: list(ev.per_query[qid].ranking) for qid in ev.scored_ids()}
    reference = evaluate_run(run, {qid: dataset.qrels[qid] for qid in ev.scored_ids()}, ks=KS)
    assert ev.mean == pytest.approx(reference.mean)
    assert ev.mean["hit_rate@100"] == 1.0  # three documents: every one is retrieved
    assert 0.8 < ev.mean["ndcg@10"] <= 1.0


def test_no_answer_questions_are_kept_per_query_but_out_of_the_means(dataset: RetrievalDataset) -> None:
    ev = evaluate_retriever(bm25_over(chunks()), dataset, ks=KS, relevance="text")
    no_answer = dataset.no_answer_ids()
    assert len(no_answer) == 8 and tuple(no_answer) == ev.no_answer_ids
    assert len(ev.per_query) == len(dataset)
    for qid in no_answer:
        q = ev.per_query[qid]
        assert q.answerable is False
        assert q.retrieval.node_ids  # what was retrieved is kept (no-answer calibration uses it)
        assert not [key for key in q.metrics if not key.startswith("chars@")]
    assert set(ev.values("ndcg@10")) == set(dataset.answerable_ids())


def test_text_level_relevance_and_its_agreement_with_node_labels_of_the_same_chunking(dataset: RetrievalDataset) -> None:
    nodes = chunks()
    retrievals = retrieve_all(bm25_over(nodes), dataset.queries, text_depth=max(KS))
    by_text = score_retrievals(retrievals, dataset, ks=KS, relevance="auto")
    by_node = score_retrievals(retrievals, node_labels(dataset, nodes), ks=KS, relevance="node")
    assert by_text.relevance == "text" and by_node.relevance == "node"
    # The first relevant chunk is the same under both labels, so hit rate and MRR agree at every k.
    for k in KS:
        assert by_text.values(f"hit_rate@{k}") == pytest.approx(by_node.values(f"hit_rate@{k}"))
        assert by_text.values(f"mrr@{k}") == pytest.approx(by_node.values(f"mrr@{k}"))
    # Text relevance: passage items, coverage and context size are reported.
    for k in KS:
        assert 0.0 <= by_text.mean[f"recall@{k}"] <= by_text.mean[f"coverage@{k}"] + 1e-9 <= 1.0 + 1e-9
    assert by_text.mean["coverage@100"] == pytest.approx(1.0)
    assert by_text.mean["chars@1"] < by_text.mean["chars@5"] < by_text.mean["chars@10"]
    q = by_text.per_query["q01"]
    relevant = [item for item in q.ranking if item.startswith("ref")]
    assert relevant == ["ref0"]  # q01 has one reference passage, found once


def test_same_labels_under_two_chunkings_give_consistent_text_results_where_node_labels_fail(dataset: RetrievalDataset) -> None:
    small, large = chunks(64, 16), chunks(256, 40)
    assert len(small) > 2 * len(large)
    ev_small = evaluate_retriever(bm25_over(small), dataset, ks=KS, relevance="text")
    ev_large = evaluate_retriever(bm25_over(large), dataset, ks=KS, relevance="text")
    # Every reference passage lies in the retrieved text under both chunkings...
    assert ev_small.mean["coverage@100"] == pytest.approx(1.0)
    assert ev_large.mean["coverage@100"] == pytest.approx(1.0)
    # ...and at similar context size (chars@k) the coverage is similar, whatever the chunk size.
    assert ev_small.mean["chars@10"] == pytest.approx(ev_large.mean["chars@5"], rel=0.15)
    assert abs(ev_small.mean["coverage@10"] - ev_large.mean["coverage@5"]) < 0.1
    assert ev_small.mean["recall@100"] > 0.85 and ev_large.mean["recall@100"] > 0.85
    # Node-id labels made on the large chunking mostly find nothing in the small one: a node id
    # is derived from the chunk's span, so only chunks cut identically (a whole short section)
    # keep their id; every other labelled question scores 0.
    labels = node_labels(dataset, large)
    on_own = evaluate_retriever(bm25_over(large), labels, ks=KS, relevance="node")
    on_other = evaluate_retriever(bm25_over(small), labels, ks=KS, relevance="node")
    assert on_own.mean["hit_rate@100"] == pytest.approx(1.0)
    small_ids = {n.node_id for n in small}
    surviving = {qid for qid, judged in labels.qrels.items() if set(judged) & small_ids}
    hits = {qid for qid, value in on_other.values("hit_rate@100").items() if value > 0}
    assert hits == surviving and len(surviving) <= 0.2 * len(labels.qrels)
    assert on_other.mean["hit_rate@100"] <= 0.2 < ev_small.mean["recall@100"]


def test_llamaindex_own_bm25_retriever_is_evaluated_like_ours(dataset: RetrievalDataset) -> None:
    from llama_index.retrievers.bm25 import BM25Retriever as LlamaBM25Retriever

    nodes = list(chunks())
    ev = evaluate_retriever(LlamaBM25Retriever.from_defaults(nodes=nodes, similarity_top_k=10), dataset, ks=(1, 10), relevance="doc")
    assert ev.num_scored == 30 and 0.8 < ev.mean["hit_rate@1"] <= 1.0
    assert all(len(q.retrieval.node_ids) == 10 for q in ev.per_query.values())
    assert ev.latency["p50_ms"] > 0 and ev.latency["p95_ms"] >= ev.latency["p50_ms"]


def test_an_empty_retrieval_is_a_miss(dataset: RetrievalDataset) -> None:
    ev = evaluate_retriever(FixedRetriever([]), dataset, ks=(1, 10), relevance="doc")
    assert ev.num_scored == 30
    assert all(value == 0.0 for value in ev.mean.values())
    text = evaluate_retriever(FixedRetriever([]), dataset, ks=(1, 10), relevance="text")
    assert text.mean["coverage@10"] == 0.0 and text.mean["chars@10"] == 0.0


def test_doc_relevance_needs_a_document_for_every_chunk(dataset: RetrievalDataset) -> None:
    from llama_index.core.schema import TextNode

    orphan = TextNode(text="The annual fee is $95.", id_="orphan")
    with pytest.raises(ValueError, match="orphan.*doc_id"):
        evaluate_retriever(FixedRetriever([NodeWithScore(node=orphan, score=1.0)]), dataset, ks=(1,), relevance="doc")


def test_bad_arguments_are_clear_value_errors(dataset: RetrievalDataset) -> None:
    retriever = FixedRetriever([])
    with pytest.raises(ValueError, match="relevance must be one of"):
        evaluate_retriever(retriever, dataset, relevance="chunk")
    with pytest.raises(ValueError, match="BaseRetriever"):
        evaluate_retriever("bm25", dataset)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        evaluate_retriever(retriever, dataset, ks=(0, 10))
    with pytest.raises(ValueError, match="RetrievalDataset"):
        evaluate_retriever(retriever, {"q": "text"})  # type: ignore[arg-type]
    unlabelled = RetrievalDataset(queries={"q": "annual fee"}, qrels={})
    with pytest.raises(ValueError, match="no query .* has labels"):
        evaluate_retriever(retriever, unlabelled, relevance="doc")


def test_passage_ranking_counts_each_passage_once() -> None:
    refs = ["the annual fee is $95", "late fee of up to $40"]
    chunks_text = ["intro", "The annual fee is $95. More.", "again: the annual fee is $95", "a late fee of up to $40 applies"]
    assert passage_ranking(chunks_text, refs) == ["chunk1", "ref0", "chunk3", "ref1"]


def test_latency_summary() -> None:
    assert latency_summary([]) == {"p50_ms": 0.0, "p95_ms": 0.0, "mean_ms": 0.0, "total_s": 0.0}
    summary = latency_summary([0.001, 0.002, 0.003, 0.100])
    assert summary["p50_ms"] == pytest.approx(2.5)
    assert summary["total_s"] == pytest.approx(0.106)


def test_caller_objects_are_not_modified(dataset: RetrievalDataset) -> None:
    nodes: List[BaseNode] = list(chunks())
    before = [(n.node_id, dict(n.metadata)) for n in nodes]
    queries_before = dict(dataset.queries)
    evaluate_retriever(BM25Retriever(nodes, similarity_top_k=5), dataset, ks=(1, 5), relevance="text")
    assert [(n.node_id, dict(n.metadata)) for n in nodes] == before
    assert dataset.queries == queries_before


# ------------------------------------------------------------------ do the labels name the documents?


def test_indexed_doc_ids_that_match_no_reference_are_an_error_unless_allowed(dataset: RetrievalDataset, caplog) -> None:
    import logging

    from llama_index_retrieval_kit.evaluation import UnmatchedReferencesError

    retriever = bm25_over(chunks())
    with pytest.raises(UnmatchedReferencesError, match=r"3 of 3 reference doc ids \(in 30 questions\) match none of the 2 indexed") as caught:
        evaluate_retriever(retriever, dataset, ks=(1, 5), relevance="doc", indexed_doc_ids=["a.txt", "b.txt"])
    assert "allow_unmatched_references=True" in str(caught.value) and "['a.txt', 'b.txt']" in str(caught.value)
    caplog.set_level(logging.WARNING, logger="llama_index_retrieval_kit.evaluation")
    allowed = evaluate_retriever(
        retriever, dataset, ks=(1, 5), relevance="doc", indexed_doc_ids=["a.txt"], allow_unmatched_references=True
    )
    assert allowed.num_scored == 30  # scored as asked (these labels do match what BM25 searches)
    partial = evaluate_retriever(
        retriever, dataset, ks=(1, 5), relevance="doc", indexed_doc_ids=["credit_card_terms.md", "product_manual.md"]
    )
    assert partial.mean["hit_rate@5"] > 0.5
    assert any(r.getMessage().startswith("1 of 3 reference doc ids (in 7 questions) match no indexed document") for r in caplog.records)
    # The ids BM25 really searches match: no error, no warning.
    caplog.clear()
    ids = {n.ref_doc_id for n in chunks()}
    evaluate_retriever(retriever, dataset, ks=(1, 5), relevance="doc", indexed_doc_ids=ids)
    assert not [r for r in caplog.records if "reference" in r.getMessage()]


def test_without_indexed_ids_a_run_that_never_meets_a_reference_document_warns(dataset: RetrievalDataset, caplog) -> None:
    import logging

    renamed = RetrievalDataset(
        queries=dict(dataset.queries),
        qrels={qid: {f"other-{doc}": v for doc, v in judged.items()} for qid, judged in dataset.qrels.items()},
        name="renamed",
    )
    caplog.set_level(logging.WARNING, logger="llama_index_retrieval_kit.evaluation")
    ev = evaluate_retriever(bm25_over(chunks()), renamed, ks=(1, 5), relevance="doc")
    assert ev.mean["ndcg@5"] == 0.0
    assert any("no retrieved chunk of any query comes from a reference document" in r.getMessage() for r in caplog.records)
    caplog.clear()
    evaluate_retriever(bm25_over(chunks()), dataset, ks=(1, 5), relevance="doc")  # real labels: quiet
    assert not [r for r in caplog.records if "reference document" in r.getMessage()]
    with pytest.raises(ValueError, match="indexed_doc_ids must be a collection of doc ids, got str"):
        evaluate_retriever(bm25_over(chunks()), dataset, indexed_doc_ids="credit_card_terms.md")


def test_a_query_the_retriever_refuses_stays_a_value_error_naming_the_query() -> None:
    odd = RetrievalDataset(queries={"q1": "annual fee", "q2": "annual \ud800 fee"}, qrels={"q1": {"credit_card_terms.md": 1}})
    with pytest.raises(ValueError, match=r"BM25Retriever refused query 'q2' .*lone surrogate"):
        evaluate_retriever(bm25_over(chunks()), odd, ks=(1,), relevance="doc")
