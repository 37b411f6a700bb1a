"""RAGAS glue, audited: what reaches RAGAS' sample fields, which query a score lands on, what is skipped."""

from __future__ import annotations

import logging
from typing import List, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.base.response.schema import Response
from llama_index.core.llms.mock import MockLLM
from llama_index.core.postprocessor import LongContextReorder
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_retrieval_kit import ContextAssembler
from llama_index_retrieval_kit.evaluation import RagasSample, RetrievalDataset, run_ragas, to_ragas_samples
from llama_index_retrieval_kit.evaluation import ragas_adapter
from llama_index_retrieval_kit.postprocessor.no_answer import DEFAULT_NO_ANSWER_TEXT

PASSAGES = [
    "The annual fee is ninety five dollars.",
    "Late payments cost up to forty dollars.",
    "Cash advances carry a five percent charge.",
    "Foreign transactions are charged three percent.",
    "Balance transfers are free in the first year.",
]
QUESTION = "What does the card cost?"


def ranked_nodes() -> List[NodeWithScore]:
    """Five chunks of five documents, best first; the first two are the relevant ones."""
    return [
        NodeWithScore(
            node=TextNode(
                id_=f"n{i}", text=text,
                metadata={"doc_id": f"d{i}", "chunk_id": f"d{i}#0", "file_name": f"terms{i}.txt"},
            ),
            score=1.0 - i / 10,
        )
        for i, text in enumerate(PASSAGES)
    ]


def card_dataset() -> RetrievalDataset:
    return RetrievalDataset(
        queries={"q": QUESTION, "none": "How many vacation days do employees get?"},
        qrels={"q": {"d0": 1, "d1": 1}},
        reference_contexts={"q": PASSAGES[:2]},
    )


def average_precision(verdicts: List[int]) -> float:
    """RAGAS' context precision: sum_k precision@k * v_k / (sum v + 1e-10)."""
    hits = [sum(verdicts[: k + 1]) / (k + 1) * v for k, v in enumerate(verdicts)]
    return sum(hits) / (sum(verdicts) + 1e-10)


def test_contexts_are_ranked_by_score_not_in_presentation_order() -> None:
    """ContextAssembler ("bookends", its default) and LongContextReorder put the 2nd best chunk last;
    RAGAS' context precision is rank-aware, so the adapter restores the rank order."""
    nodes = ranked_nodes()
    assembled = ContextAssembler(max_tokens=500, tokenizer=str.split).postprocess_nodes(nodes, query_str=QUESTION)
    reordered = LongContextReorder().postprocess_nodes(ranked_nodes())
    for presented in (assembled, reordered):
        assert [n.score for n in presented] != sorted((n.score for n in presented), reverse=True)  # really reordered
        before = [(n.node.node_id, n.score) for n in presented]
        sample = to_ragas_samples(card_dataset(), {"q": presented}, context_id_key="doc_id")[0]
        assert sample.retrieved_contexts == PASSAGES  # best first, and no citation hint / metadata text
        assert sample.retrieved_context_ids == [f"d{i}" for i in range(5)]
        assert [(n.node.node_id, n.score) for n in presented] == before  # the caller's list is not reordered

        report = run_ragas([sample], ("nonllm_context_precision",), string_similarity="containment")
        relevant = [int(text in PASSAGES[:2]) for text in sample.retrieved_contexts]
        assert report.scores("nonllm_context_precision")["q"] == pytest.approx(average_precision(relevant))
        assert report.means["nonllm_context_precision"] == pytest.approx(1.0)

    # order_by_score=False keeps the presentation order (and its lower precision).
    kept = to_ragas_samples(card_dataset(), {"q": reordered}, context_id_key="doc_id", order_by_score=False)[0]
    assert kept.retrieved_contexts == [n.node.get_content() for n in reordered]
    as_presented = run_ragas([kept], ("nonllm_context_precision",), string_similarity="containment")
    relevant = [int(text in PASSAGES[:2]) for text in kept.retrieved_contexts]
    assert as_presented.means["nonllm_context_precision"] == pytest.approx(average_precision(relevant))
    assert as_presented.means["nonllm_context_precision"] < 1.0
    with pytest.raises(ValueError, match="order_by_score"):
        to_ragas_samples(card_dataset(), {"q": reordered}, order_by_score="no")


def test_no_scores_keep_the_given_order_and_metadata_never_enters_contexts() -> None:
    nodes = [NodeWithScore(node=n.node, score=None) for n in reversed(ranked_nodes())]
    sample = to_ragas_samples(card_dataset(), {"q": nodes}, context_id_key="doc_id")[0]
    assert sample.retrieved_contexts == PASSAGES[::-1]
    assert not any("terms" in text or "doc_id" in text for text in sample.retrieved_contexts)


def test_samples_with_ids_only_are_scored_by_their_ids() -> None:
    """A sample with retrieved ids but no texts retrieved something: the ID metrics score it."""
    ids_only = RagasSample("ids", QUESTION, retrieved_context_ids=["d0", "d7"], reference_context_ids=["d0", "d1"])
    report = run_ragas([ids_only], ("id_context_precision", "id_context_recall"))
    assert report.scores("id_context_precision") == {"ids": 0.5}
    assert report.scores("id_context_recall") == {"ids": 0.5}
    # The string metrics read the texts: none here, and nothing to compare is not "nothing relevant".
    strings = run_ragas(
        [RagasSample("ids", QUESTION, retrieved_context_ids=["d0"], reference_contexts=[PASSAGES[0]])],
        ("nonllm_context_recall",),
    )
    assert strings.scores("nonllm_context_recall") == {"ids": None}
    assert strings.skipped["nonllm_context_recall"] == ["ids"]


def test_texts_without_ids_are_skipped_by_the_id_metrics_not_scored_zero(caplog) -> None:
    texts_only = RagasSample("texts", QUESTION, retrieved_contexts=[PASSAGES[0]], reference_context_ids=["d0"])
    nothing = RagasSample("nothing", QUESTION, reference_context_ids=["d0"])
    with caplog.at_level(logging.INFO, logger=ragas_adapter.__name__):
        report = run_ragas([texts_only, nothing], ("id_context_recall",))
    assert report.scores("id_context_recall") == {"texts": None, "nothing": 0.0}
    assert report.skipped["id_context_recall"] == ["texts"]
    assert report.counts["id_context_recall"] == 1
    assert "retrieved_context_ids" in caplog.text


@pytest.mark.parametrize("field", ["retrieved_contexts", "reference_contexts", "retrieved_context_ids"])
def test_a_bare_string_is_refused_not_split_into_characters(field: str) -> None:
    row = {"query_id": "q", "user_input": QUESTION, field: PASSAGES[0]}
    with pytest.raises(ValueError, match=f"{field} must be a list of strings, got str"):
        run_ragas([row], ("nonllm_context_recall",))
    with pytest.raises(ValueError, match=f"{field} must be a list of strings"):
        RagasSample("q", QUESTION, **{field: PASSAGES[0]})
    with pytest.raises(ValueError, match="response must be a string"):
        RagasSample("q", QUESTION, response=Response("an answer"))
    # integer ids (RAGAS accepts them) become strings
    assert RagasSample("q", QUESTION, retrieved_context_ids=[3, "4"]).retrieved_context_ids == ["3", "4"]


@pytest.mark.parametrize(
    "abstention",
    [
        Response(DEFAULT_NO_ANSWER_TEXT, source_nodes=[], metadata={"no_answer": True}),  # NoAnswerPostprocessor
        Response("Empty Response", source_nodes=[]),  # LlamaIndex's synthesizer without nodes
    ],
)
def test_an_abstention_is_no_response_to_judge(abstention: Response) -> None:
    dataset = card_dataset()
    answered = Response("The fee is $95.", source_nodes=ranked_nodes())
    samples = to_ragas_samples(dataset, {"none": abstention, "q": answered})
    by_id = {s.query_id: s for s in samples}
    assert by_id["none"].response is None and by_id["none"].retrieved_contexts == []
    assert by_id["q"].response == "The fee is $95."
    report = run_ragas([by_id["none"]], ("faithfulness",), llm=MockLLM(max_tokens=4))
    assert report.skipped["faithfulness"] == ["none"] and report.means["faithfulness"] is None


def test_responses_given_as_query_engine_responses_and_unused_ones_are_said(caplog) -> None:
    dataset = card_dataset()
    with caplog.at_level(logging.WARNING, logger=ragas_adapter.__name__):
        samples = to_ragas_samples(
            dataset, {"q": ranked_nodes()},
            responses={"q": Response("The fee is $95.", source_nodes=[]), "none": "Ten days."},
        )
    assert samples[0].response == "The fee is $95." and isinstance(samples[0].response, str)
    assert "responses for 1 questions without results are not used: ['none']" in caplog.text
    with pytest.raises(ValueError, match=r"responses\['q'\] must be a string"):
        to_ragas_samples(dataset, {"q": ranked_nodes()}, responses={"q": 42})


ID_POOL = ["a", "b", "c", "d", "e"]


@st.composite
def id_samples(draw: st.DrawFn) -> List[RagasSample]:
    count = draw(st.integers(min_value=1, max_value=8))
    samples = []
    for index in range(count):
        reference = draw(st.lists(st.sampled_from(ID_POOL), max_size=3, unique=True))
        retrieved = draw(st.lists(st.sampled_from(ID_POOL), max_size=5))  # duplicates allowed
        texts = [f"text of {i}" for i in retrieved] if draw(st.booleans()) else []
        if not retrieved and draw(st.booleans()):
            texts = ["text without an id"]
        samples.append(
            RagasSample(f"q{index}", f"question {index}", texts, retrieved, reference_context_ids=reference)
        )
    return samples


def expected_id_scores(sample: RagasSample) -> tuple[Optional[float], Optional[float]]:
    """(precision, recall) on id sets; None when unknown, 0.0 when nothing was retrieved."""
    reference, retrieved = set(sample.reference_context_ids), set(sample.retrieved_context_ids)
    if not reference:
        return None, None
    if not retrieved:
        return (0.0, 0.0) if not sample.retrieved_contexts else (None, None)
    hits = len(reference & retrieved)
    return hits / len(retrieved), hits / len(reference)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=id_samples())
def test_every_score_lands_on_its_own_query(samples: List[RagasSample]) -> None:
    report = run_ragas(samples, ("id_context_precision", "id_context_recall"))
    expected = {s.query_id: expected_id_scores(s) for s in samples}
    precision, recall = report.scores("id_context_precision"), report.scores("id_context_recall")
    for query_id, (want_precision, want_recall) in expected.items():
        assert precision[query_id] == pytest.approx(want_precision), query_id
        assert recall[query_id] == pytest.approx(want_recall), query_id
    scored = [r for _, r in expected.values() if r is not None]
    assert report.counts["id_context_recall"] == len(scored)
    assert report.means["id_context_recall"] == (pytest.approx(sum(scored) / len(scored)) if scored else None)
    assert [row["query_id"] for row in report.rows] == [s.query_id for s in samples]


def test_assembled_context_nodes_stand_for_the_chunks_they_were_built_from() -> None:
    """A ContextAssembler node's own id is generated from its span: the ID metrics read its source chunks."""
    chunks = [
        NodeWithScore(node=TextNode(id_=r.node.node_id, text=r.node.text, metadata={
            **r.node.metadata, "char_start": 0, "char_end": len(r.node.text)}), score=r.score)
        for r in ranked_nodes()
    ]
    assembled = ContextAssembler(max_tokens=200, hint_style="none").postprocess_nodes(chunks, query_str=QUESTION)
    assert len(assembled) == 5 and not any(n.node.node_id.startswith("n") for n in assembled)  # generated ids
    by_chunk = to_ragas_samples(card_dataset(), {"q": assembled}, reference_context_ids={"q": ["d0#0", "d1#0"]})[0]
    assert sorted(by_chunk.retrieved_context_ids) == [f"d{i}#0" for i in range(5)]
    by_node = to_ragas_samples(card_dataset(), {"q": assembled}, context_id_key="node_id",
                               reference_context_ids={"q": ["n0"]})[0]
    assert sorted(by_node.retrieved_context_ids) == [f"n{i}" for i in range(5)]
    report = run_ragas([by_chunk], ("id_context_recall",))
    assert report.scores("id_context_recall") == {"q": 1.0}  # was 0.0: no generated id matches a chunk id
