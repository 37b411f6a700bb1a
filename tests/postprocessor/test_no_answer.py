"""NoAnswerPostprocessor: calibration arithmetic, persistence, and query engines that abstain
without calling the LLM (real index over the bundled samples, real embedding model)."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from typing import Iterator, List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_retrieval_kit import NoAnswerPostprocessor
from llama_index_retrieval_kit.evaluation import load_jsonl
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.postprocessor.no_answer import (
    FeatureSet,
    auroc,
    feature_names,
    fit_logistic,
    retrieval_features,
    threshold_for_recall,
)
from llama_index_retrieval_kit.retrievers import FusedNodeWithScore
from llama_index_retrieval_kit.samples import QUESTIONS_FILE

from ..indices import _support


# ----------------------------------------------------------------------------- arithmetic
@settings(max_examples=60, deadline=None)
@given(
    pos=st.lists(st.integers(0, 6).map(float), min_size=1, max_size=15),
    neg=st.lists(st.integers(0, 6).map(float), min_size=1, max_size=15),
)
def test_auroc_is_the_pairwise_win_rate_with_half_ties(pos: List[float], neg: List[float]) -> None:
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    assert auroc(pos, neg) == pytest.approx(wins / (len(pos) * len(neg)))


@settings(max_examples=60, deadline=None)
@given(
    conf=st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=40),
    target=st.floats(0.05, 1.0),
)
def test_threshold_keeps_the_target_share_and_is_the_largest_that_does(conf: List[float], target: float) -> None:
    t = threshold_for_recall(conf, target)
    arr = np.asarray(conf)
    assert (arr >= t).mean() >= target - 1e-9
    higher = arr[arr > t]
    if len(higher):  # any larger threshold keeps fewer than the target
        assert (arr >= higher.min()).mean() < target + 1e-9 or math.isclose((arr >= higher.min()).mean(), target)


def test_logistic_fit_matches_a_generic_optimiser() -> None:
    from scipy.optimize import minimize

    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (X @ [1.5, -2.0, 0.3] + 0.4 + rng.logistic(size=200) > 0).astype(float)
    w, b = fit_logistic(X, y, l2=1.0)

    def loss(theta: np.ndarray) -> float:
        z = X @ theta[:3] + theta[3]
        return float(np.sum(np.logaddexp(0, z) - y * z) + 0.5 * np.sum(theta[:3] ** 2))

    ref = minimize(loss, np.zeros(4), method="BFGS", options={"gtol": 1e-10}).x
    assert np.allclose(np.append(w, b), ref, atol=1e-4)


def _fused(dense: List[float], bm25: List[float]) -> List[NodeWithScore]:
    """Results with leg scores: node i has dense score dense[i] and bm25 score bm25[i] (ranks by score)."""
    dense_rank = {i: r + 1 for r, i in enumerate(sorted(range(len(dense)), key=lambda i: -dense[i]))}
    bm25_rank = {i: r + 1 for r, i in enumerate(sorted(range(len(bm25)), key=lambda i: -bm25[i]))}
    return [
        FusedNodeWithScore(
            node=TextNode(id_=f"n{i}", text=f"chunk {i}"),
            score=1.0 - i / 10,
            leg_ranks={"dense": dense_rank[i], "bm25": bm25_rank[i]},
            leg_scores={"dense": dense[i], "bm25": bm25[i]},
        )
        for i in range(len(dense))
    ]


def _constructed(n: int, seed: int, shift: float) -> List[Tuple[str, List[NodeWithScore]]]:
    """Queries whose best dense score is centred on 0.5 + shift: answerable ones get shift > 0."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        top = 0.5 + shift + rng.gauss(0, 0.05)
        dense = sorted((top - 0.03 * k + rng.gauss(0, 0.005) for k in range(10)), reverse=True)
        bm25 = [max(0.0, 10 + 20 * shift + rng.gauss(0, 2) - k) for k in range(10)]
        out.append((f"question {i} about fees", _fused(dense, bm25)))
    return out


def test_fit_on_separable_distributions_reports_what_it_did() -> None:
    answerable, unanswerable = _constructed(200, 1, 0.15), _constructed(200, 2, -0.15)
    gate = NoAnswerPostprocessor.fit(answerable, unanswerable, target_answerable_recall=0.9)
    report = gate.fit_report
    assert gate.feature_set == FeatureSet.LEGS.value and gate.feature_names == feature_names(FeatureSet.LEGS)
    assert report["auroc"] > 0.99 and report["threshold"] == gate.threshold
    assert report["answerable_kept"] >= 0.9 and report["abstention_recall"] > 0.95
    confidences = [gate.confidence(nodes, q) for q, nodes in answerable]
    assert np.mean(np.asarray(confidences) >= gate.threshold) == pytest.approx(report["answerable_kept"])
    assert all(0.0 <= c <= 1.0 for c in confidences)
    # the gate is calibrated on what it saw: a fresh draw of the same distributions behaves alike
    fresh = [gate.confidence(nodes, q) for q, nodes in _constructed(200, 3, 0.15)]
    assert np.mean(np.asarray(fresh) >= gate.threshold) > 0.8


def test_features_read_leg_scores_not_the_fused_score() -> None:
    nodes = _fused([0.8, 0.7, 0.6, 0.5, 0.4, 0.3], [5.0, 9.0, 1.0, 0.5, 0.2, 0.1])
    feats = retrieval_features(nodes, "annual fee", FeatureSet.LEGS)
    assert feats["dense_top1"] == 0.8 and feats["dense_margin"] == pytest.approx(0.1)
    assert feats["dense_gap5"] == pytest.approx(0.4) and feats["agreement"] == 0.0
    assert feats["bm25_top1"] == pytest.approx(4.5)  # BM25 per query term: 9.0 over "annual", "fee"
    assert feats["dense_of_bm25_top1"] == 0.7 and feats["overlap10"] == pytest.approx(0.6)
    assert feats["dense_docmargin"] == pytest.approx(0.1)  # every chunk is its own document here
    assert feats["coverage_max3"] == 0.0  # "annual fee" is not in "chunk i"
    rescored = [FusedNodeWithScore(node=n.node, score=0.5, leg_ranks=n.leg_ranks, leg_scores=n.leg_scores) for n in nodes]
    assert retrieval_features(rescored, "annual fee", FeatureSet.LEGS) == feats


def test_bad_inputs_are_refused_with_what_to_do() -> None:
    good = _constructed(5, 1, 0.1)
    with pytest.raises(ValueError, match="at least 2 answerable and 2 unanswerable"):
        NoAnswerPostprocessor.fit(good, good[:1])
    with pytest.raises(ValueError, match="target_answerable_recall"):
        NoAnswerPostprocessor.fit(good, good, target_answerable_recall=1.5)
    with pytest.raises(ValueError, match=r"answerable\[0\]"):
        NoAnswerPostprocessor.fit([("q", "not nodes"), *good], good)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="fit, calibrate or load"):
        NoAnswerPostprocessor().postprocess_nodes(good[0][1], query_str="q")
    gate = NoAnswerPostprocessor.fit(good, _constructed(5, 2, -0.1))
    plain = [NodeWithScore(node=n.node, score=n.score) for n in good[0][1]]
    with pytest.raises(ValueError, match="same retriever"):
        gate.confidence(plain, "q")
    assert gate.confidence([], "q") == 0.0


def test_similarity_cutoff_alone_is_llamaindex_behaviour() -> None:
    nodes = [NodeWithScore(node=TextNode(id_=f"n{i}", text="x"), score=s) for i, s in enumerate([0.9, 0.5, 0.2])]
    gate = NoAnswerPostprocessor(similarity_cutoff=0.4)
    assert [n.node.node_id for n in gate.postprocess_nodes(nodes, query_str="q")] == ["n0", "n1"]
    assert NoAnswerPostprocessor(similarity_cutoff=0.95).postprocess_nodes(nodes, query_str="q") == []


def test_out_of_range_results_get_zero_confidence() -> None:
    """Questions unlike every calibration question (off-topic: far lower top-1 evidence) never
    pass on the model's extrapolation: below the answerable 1% quantile the confidence is 0."""
    answerable, unanswerable = _constructed(200, 1, 0.15), _constructed(200, 2, -0.15)
    gate = NoAnswerPostprocessor.fit(answerable, unanswerable, target_answerable_recall=0.9)
    tops = sorted(nodes[0].leg_scores["dense"] for _, nodes in answerable)
    assert tops[1] <= gate.min_top_score <= tops[3]
    q, nodes = _constructed(1, 7, -0.4)[0]
    assert gate.confidence(nodes, q) == 0.0 and gate.postprocess_nodes(nodes, query_str=q) == []
    assert NoAnswerPostprocessor.fit(answerable, unanswerable, floor_quantile=0).min_top_score is None
    with pytest.raises(ValueError, match="floor_quantile"):
        NoAnswerPostprocessor.fit(answerable, unanswerable, target_answerable_recall=0.95, floor_quantile=0.2)


def test_save_load_and_dict_round_trip(tmp_path: Path) -> None:
    gate = NoAnswerPostprocessor.fit(_constructed(30, 1, 0.1), _constructed(30, 2, -0.1), no_answer_text="Not in the contract.")
    path = gate.save(tmp_path / "gate.json")
    data = json.loads(path.read_text())
    assert data["class_name"] == "NoAnswerPostprocessor" and "pickle" not in path.read_text()
    for again in (NoAnswerPostprocessor.load(path), NoAnswerPostprocessor.from_dict(gate.to_dict())):
        assert again.threshold == gate.threshold and again.no_answer_text == "Not in the contract."
        q, nodes = _constructed(1, 9, 0.0)[0]
        assert again.confidence(nodes, q) == gate.confidence(nodes, q)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        NoAnswerPostprocessor.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        NoAnswerPostprocessor.load(tmp_path / "missing.json")
    broken = gate.to_dict()
    broken["coefficients"] = broken["coefficients"][:-1]
    with pytest.raises(ValueError, match="same length"):
        NoAnswerPostprocessor.from_dict(broken)


# ----------------------------------------------------------------------------- with the real index
class FailingLLM(MockLLM):
    """An LLM that fails the test if anything calls it."""

    def complete(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the LLM was called although the gate closed")

    def stream_complete(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the LLM was called although the gate closed")

    async def acomplete(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the LLM was called although the gate closed")

    def chat(self, *args, **kwargs):  # type: ignore[override]
        raise AssertionError("the LLM was called although the gate closed")


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    with _support.opened_sample_copy(tmp_path_factory.mktemp("gate")) as index:
        yield index


@pytest.fixture(scope="module")
def gate(sample_index: HybridIndex) -> NoAnswerPostprocessor:
    """Calibrated on the bundled questions, with hard unanswerable ones made by excluding the answer."""
    return _support.calibrated_gate(sample_index, top_k=5)


def test_calibrate_counts_questions_without_references_as_unanswerable(gate: NoAnswerPostprocessor) -> None:
    dataset = load_jsonl(QUESTIONS_FILE)
    report = gate.fit_report
    assert report["answerable"] == len(dataset.answerable_ids()) == 30
    # 8 questions without references + one excluded-answer copy of each answerable question with doc refs
    assert report["unanswerable"] > len(dataset.no_answer_ids()) == 8
    assert report["auroc"] > 0.85 and report["answerable_kept"] >= 0.95


def test_a_larger_similarity_top_k_than_calibrated_leaves_every_decision_unchanged(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    """The gate reads the first feature_top_k results (as many as at calibration): before, a gate
    calibrated on top 8 and given top 30 kept 17 of the 30 answerable bundled questions, not 29."""
    assert gate.feature_top_k == 5  # calibrated with similarity_top_k=5
    dataset = load_jsonl(QUESTIONS_FILE)
    calibrated = sample_index.as_retriever("hybrid", similarity_top_k=5)
    wider = sample_index.as_retriever("hybrid", similarity_top_k=30)
    kept = {"calibrated": 0, "wider": 0}
    for qid in dataset.answerable_ids():
        q = dataset.queries[qid]
        top5, top30 = calibrated.retrieve(q), wider.retrieve(q)
        assert len(top30) > len(top5) == 5
        assert gate.confidence(top30, q) == gate.confidence(top5, q)
        out = gate.postprocess_nodes(top30, query_str=q)
        assert out == [] or [n.node.node_id for n in out] == [n.node.node_id for n in top30]  # all passed on when open
        kept["calibrated"] += bool(gate.postprocess_nodes(top5, query_str=q))
        kept["wider"] += bool(out)
    assert kept["wider"] == kept["calibrated"] >= 0.9 * len(dataset.answerable_ids())


def test_feature_top_k_is_recorded_validated_and_old_files_still_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    answerable, unanswerable = _constructed(30, 1, 0.1), _constructed(30, 2, -0.1)
    gate = NoAnswerPostprocessor.fit(answerable, unanswerable)
    assert gate.feature_top_k == max(len(nodes) for _, nodes in answerable + unanswerable)
    assert NoAnswerPostprocessor.load(gate.save(tmp_path / "gate.json")).feature_top_k == gate.feature_top_k
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="feature_top_k"):
            NoAnswerPostprocessor.fit(answerable, unanswerable, feature_top_k=bad)
    one = NoAnswerPostprocessor.fit(answerable, unanswerable, feature_top_k=1)
    q, nodes = _constructed(1, 9, 0.0)[0]
    assert one.confidence(nodes, q) == one.confidence(nodes[:1], q)
    data = json.loads((tmp_path / "gate.json").read_text())
    del data["feature_top_k"]  # a gate saved by an earlier version
    (tmp_path / "old.json").write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="llama_index_retrieval_kit.postprocessor.no_answer"):
        old = NoAnswerPostprocessor.load(tmp_path / "old.json")
    assert old.feature_top_k is None and "calibrate it again" in caplog.text
    assert old.confidence(nodes, q) == gate.confidence(nodes, q)  # every result read, as before


def _no_answer_questions() -> List[str]:
    dataset = load_jsonl(QUESTIONS_FILE)
    return [dataset.queries[q] for q in dataset.no_answer_ids()]


def _closed_question(gate: NoAnswerPostprocessor, index: HybridIndex) -> str:
    retriever = index.as_retriever("hybrid", similarity_top_k=5)
    closed = [q for q in _no_answer_questions() if gate.confidence(retriever.retrieve(q), q) < gate.threshold]
    assert len(closed) >= 6, "the gate should close on most bundled no-answer questions"
    return closed[0]


def test_query_engine_abstains_without_calling_the_llm(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    question = _closed_question(gate, sample_index)
    engines = [
        RetrieverQueryEngine.from_args(sample_index.as_retriever("hybrid", similarity_top_k=5), llm=FailingLLM(), node_postprocessors=[gate]),
        sample_index.as_query_engine(llm=FailingLLM(), node_postprocessors=[gate]),
    ]
    for engine in engines:
        response = engine.query(question)
        assert str(response) == "No answer in these documents."
        assert response.source_nodes == []
        meta = response.metadata
        assert meta["no_answer"] is True and meta["no_answer_confidence"] < meta["no_answer_threshold"] == gate.threshold
        assert meta["best_rejected"]["doc_id"] in {"credit_card_terms.md", "product_manual.md", "privacy_policy.txt"}
        async_response = asyncio.run(engine.aquery(question))
        assert str(async_response) == "No answer in these documents." and async_response.metadata["no_answer"] is True
    streaming = sample_index.as_query_engine(llm=FailingLLM(), node_postprocessors=[gate], streaming=True)
    response = streaming.query(question)
    assert "".join(response.response_gen) == "No answer in these documents."
    assert response.metadata["no_answer"] is True


class RewritingLLM(FailingLLM):
    """Rewrites a follow-up into ``rewritten`` (the chat engine's condense step); any other call fails."""

    rewritten: str = ""

    def complete(self, prompt, formatted: bool = False, **kwargs):  # type: ignore[override]
        from llama_index.core.base.llms.types import CompletionResponse

        if "Follow Up" in prompt or "follow up" in prompt.lower():
            return CompletionResponse(text=self.rewritten)
        raise AssertionError("the LLM was called although the gate closed")

    async def acomplete(self, prompt, formatted: bool = False, **kwargs):  # type: ignore[override]
        return self.complete(prompt, formatted, **kwargs)


def test_chat_engine_that_rewrites_the_question_abstains(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    """CondensePlusContextChatEngine retrieves with the rewritten question, then synthesizes the
    user's own message: the gate's answer must still replace LlamaIndex's "Empty Response"."""
    from llama_index.core.chat_engine import CondensePlusContextChatEngine
    from llama_index.core.llms import ChatMessage

    question = _closed_question(gate, sample_index)
    llm = RewritingLLM()
    llm.rewritten = question
    engine = CondensePlusContextChatEngine.from_defaults(
        sample_index.as_retriever("hybrid", similarity_top_k=5), llm=llm, node_postprocessors=[gate]
    )
    history = [ChatMessage(role="user", content="Hello"), ChatMessage(role="assistant", content="Hi, ask me about the documents.")]
    reply = engine.chat("and what about that?", chat_history=history)
    assert str(reply) == "No answer in these documents."
    assert reply.source_nodes == []
    # the chat response carries the decision, as a query engine's Response does
    assert reply.metadata["no_answer"] is True and reply.metadata["no_answer_confidence"] < gate.threshold
    async_reply = asyncio.run(engine.achat("and what about that?", chat_history=history))
    assert str(async_reply) == "No answer in these documents."
    assert (async_reply.metadata or {}).get("no_answer") is True
    # A later query with an open gate is answered normally: the decision was used up.
    open_engine = sample_index.as_query_engine(llm=MockLLM(max_tokens=5), node_postprocessors=[gate])
    response = open_engine.query("How much is the late payment fee?")
    assert response.source_nodes and not (response.metadata or {}).get("no_answer")


def test_a_closed_decision_does_not_answer_another_query_after_a_new_retrieval(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    """Within one request (a parent span, as a query engine's), a later retrieval of another
    question leaves the decision to the synthesis of its own question only."""
    from llama_index.core.base.response.schema import Response
    from llama_index.core.instrumentation import get_dispatcher

    from llama_index_retrieval_kit.postprocessor.no_answer import apply_decision

    question = _closed_question(gate, sample_index)
    dispatcher = get_dispatcher(__name__)

    @dispatcher.span
    def one_request() -> tuple[bool, bool]:
        nodes = sample_index.as_retriever("hybrid", similarity_top_k=5).retrieve(question)
        assert gate.postprocess_nodes(nodes, query_str=question) == []
        sample_index.as_retriever("hybrid", similarity_top_k=5).retrieve("another question entirely")  # a new retrieval
        other = Response(response="Empty Response", source_nodes=[])
        answered_other = apply_decision("another question entirely", other)
        assert other.response == "Empty Response"
        own = Response(response="Empty Response", source_nodes=[])
        answered_own = apply_decision(question, own)
        assert own.response == ("No answer in these documents." if answered_own else "Empty Response")
        return answered_other, answered_own

    assert one_request() == (False, True)


def test_a_closed_decision_ends_with_its_request(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    """A server's worker thread keeps its context between requests: a gate that closed in a
    search request (no synthesis) must not answer, nor show its best rejected chunk to, the next
    request, even one asking the same question whose filter matches nothing."""
    from concurrent.futures import ThreadPoolExecutor

    from llama_index.core.base.response.schema import Response
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

    from llama_index_retrieval_kit.pipeline import PostprocessedRetriever
    from llama_index_retrieval_kit.postprocessor.no_answer import apply_decision

    question = _closed_question(gate, sample_index)

    def search_request() -> int:
        return len(PostprocessedRetriever(sample_index.as_retriever("hybrid", similarity_top_k=5), [gate]).retrieve(question))

    def ask_request_matching_nothing() -> Response:
        nothing = MetadataFilters(filters=[MetadataFilter(key="doc_id", value="no-such-document")])
        engine = sample_index.as_query_engine(llm=MockLLM(max_tokens=5), filters=nothing)
        return engine.query(question)

    with ThreadPoolExecutor(max_workers=1) as worker:
        assert worker.submit(search_request).result() == 0  # the gate closed
        response = worker.submit(ask_request_matching_nothing).result()
        assert response.source_nodes == []
        assert not (response.metadata or {}).get("no_answer") and "best_rejected" not in (response.metadata or {})
        assert str(response) != "No answer in these documents."
        # a top-level retrieval of the same question also starts a new request
        assert worker.submit(search_request).result() == 0

        def retrieve_then_apply() -> bool:
            sample_index.as_retriever("hybrid", similarity_top_k=5).retrieve(question)
            return apply_decision(question, Response(response="Empty Response", source_nodes=[]))

        assert worker.submit(retrieve_then_apply).result() is False


def test_open_gate_passes_the_nodes_unchanged(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=5)
    question = "How much is the late payment fee?"
    nodes = retriever.retrieve(question)
    assert gate.confidence(nodes, question) >= gate.threshold
    out = gate.postprocess_nodes(nodes, query_str=question)
    assert out == nodes and all(a is b for a, b in zip(out, nodes))
    response = sample_index.as_query_engine(llm=MockLLM(max_tokens=5), node_postprocessors=[gate]).query(question)
    assert response.source_nodes and not (response.metadata or {}).get("no_answer")


def test_on_a_small_set_the_floor_is_an_observed_answerable_score() -> None:
    """With fewer than 100 answerable questions the 1% quantile must not be interpolated above the
    lowest one (which would get confidence 0 and pull the recall threshold down to 0)."""
    answerable, unanswerable = _constructed(15, 3, 0.15), _constructed(15, 4, -0.15)
    gate = NoAnswerPostprocessor.fit(answerable, unanswerable, target_answerable_recall=0.95)
    tops = sorted(nodes[0].leg_scores["dense"] for _, nodes in answerable)
    assert gate.min_top_score == tops[0]
    assert all(gate.confidence(nodes, q) > 0 for q, nodes in answerable)
    assert gate.threshold > 0.0


def test_presentation_order_before_the_gate_changes_no_decision(gate: NoAnswerPostprocessor, sample_index: HybridIndex) -> None:
    """The gate reads the best feature_top_k results by score: LlamaIndex's LongContextReorder (the
    second best put last) or any shuffle before it leaves every confidence unchanged. Before, it read
    the first five of the reordered list (the 2nd and 4th best missing, lower ones read instead)."""
    from llama_index.core.postprocessor import LongContextReorder

    dataset = load_jsonl(QUESTIONS_FILE)
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=10)  # more results than the gate reads (5)
    shuffler = random.Random(7)
    moved = 0
    for qid in dataset.queries:
        q = dataset.queries[qid]
        nodes = retriever.retrieve(q)
        reordered = LongContextReorder().postprocess_nodes(nodes)
        shuffled = shuffler.sample(nodes, len(nodes))
        moved += [n.node.node_id for n in reordered[:5]] != [n.node.node_id for n in nodes[:5]]
        expected = gate.confidence(nodes, q)
        assert gate.confidence(reordered, q) == expected
        assert gate.confidence(shuffled, q) == expected
        decided = bool(gate.postprocess_nodes(nodes, query_str=q))
        assert bool(gate.postprocess_nodes(reordered, query_str=q)) == decided
    assert moved == len(dataset.queries)  # the reorder changed what "the first five" were for every question
