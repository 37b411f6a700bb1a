"""RAGAS glue: datasets from real retrieval, LLM-free metrics, a scripted judge, no network."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.mock import MockLLM
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from pydantic import PrivateAttr

from llama_index_retrieval_kit import HybridIndex
from llama_index_retrieval_kit.evaluation import (
    DEFAULT_RAGAS_METRICS,
    LLM_FREE_METRICS,
    LLM_METRICS,
    RAGAS_METRICS,
    RagasReport,
    RagasSample,
    RetrievalDataset,
    load_jsonl,
    run_ragas,
    run_retriever_for_ragas,
    to_ragas_dataset,
    to_ragas_samples,
)
from llama_index_retrieval_kit.evaluation import ragas_adapter
from llama_index_retrieval_kit.ingest import read_documents
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files

# --------------------------------------------------------------------------------------------
# Real retrieval over the bundled samples (built once for the module)
# --------------------------------------------------------------------------------------------


class ConstantTestRetriever(BaseRetriever):
    """A deliberately bad retriever: the same nodes for every question."""

    def __init__(self, nodes: List[Any]) -> None:
        super().__init__()
        self._nodes = list(nodes)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=node, score=1.0 / (rank + 1)) for rank, node in enumerate(self._nodes)]


@pytest.fixture(scope="module")
def dataset() -> RetrievalDataset:
    return load_jsonl(QUESTIONS_FILE)


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory: pytest.TempPathFactory):
    import torch

    # One intra-op thread: on a small shared CPU, torch's thread pool spins against other
    # processes and single-query embeddings get ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    documents, failures = read_documents(sample_files())
    assert not failures
    index = HybridIndex.from_documents(documents, tmp_path_factory.mktemp("ragas") / "idx")
    try:
        yield index
    finally:
        index.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hybrid_results(sample_index, dataset) -> Dict[str, List[NodeWithScore]]:
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=5)
    return {query_id: retriever.retrieve(question) for query_id, question in dataset.queries.items()}


@pytest.fixture(scope="module")
def bad_results(sample_index, dataset) -> Dict[str, List[NodeWithScore]]:
    privacy = sorted(
        (node for node in sample_index.docstore.docs.values() if node.metadata.get("doc_id") == "privacy_policy.txt"),
        key=lambda node: node.metadata["chunk_index"],
    )
    retriever = ConstantTestRetriever(privacy[:5])
    return {query_id: retriever.retrieve(question) for query_id, question in dataset.queries.items()}


def _in_unit_interval(report: RagasReport) -> None:
    for row in report.rows:
        for name in report.metrics:
            value = row[name]
            assert value is None or 0.0 <= value <= 1.0 + 1e-9, (row["query_id"], name, value)


def test_to_ragas_dataset_columns_ids_and_references(dataset, hybrid_results, caplog) -> None:
    by_chunk = to_ragas_dataset(dataset, hybrid_results)
    assert len(by_chunk) == len(dataset)
    assert by_chunk.query_ids == list(dataset.queries)
    first = by_chunk.samples[0]
    nodes = [n.node for n in hybrid_results["q01"]]
    assert first.user_input == dataset.queries["q01"]
    assert first.retrieved_contexts == [node.get_content() for node in nodes]
    assert first.retrieved_context_ids == [node.metadata["chunk_id"] for node in nodes]
    assert first.reference == dataset.reference_answers["q01"]
    assert first.reference_contexts == dataset.reference_contexts["q01"]
    assert first.reference_context_ids == ["credit_card_terms.md"]
    assert first.response is None

    by_doc = to_ragas_samples(dataset, hybrid_results, context_id_key="doc_id")
    assert by_doc[0].retrieved_context_ids == [node.metadata["doc_id"] for node in nodes]
    no_answer = {s.query_id: s for s in by_doc}["q36"]
    assert no_answer.reference is None and no_answer.reference_contexts == [] and no_answer.reference_context_ids == []

    # Chunk ids never equal doc-level qrels: said once, loudly, not discovered from all-zero scores.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ragas_adapter.__name__):
        to_ragas_samples(dataset, hybrid_results, context_id_key="chunk_id")
    assert "context_id_key='doc_id'" in caplog.text
    # ... unless the caller gives reference ids in the same id space.
    own = {"q01": [nodes[0].metadata["chunk_id"]]}
    mine = to_ragas_samples(dataset, {"q01": hybrid_results["q01"]}, reference_context_ids=own)
    assert mine[0].reference_context_ids == own["q01"]

    with pytest.raises(ValueError, match="not in the dataset"):
        to_ragas_samples(dataset, {"nope": []})
    with pytest.raises(ValueError, match="no 'section_id' in its metadata"):
        to_ragas_samples(dataset, {"q01": hybrid_results["q01"]}, context_id_key="section_id")
    with pytest.raises(ValueError, match="list of NodeWithScore"):
        to_ragas_samples(dataset, {"q01": "not nodes"})


def test_llm_free_metrics_on_real_retrieval_are_sensible(dataset, hybrid_results, bad_results) -> None:
    answerable, no_answer = dataset.answerable_ids(), dataset.no_answer_ids()
    hybrid = run_ragas(to_ragas_dataset(dataset, hybrid_results, context_id_key="doc_id"))
    bad = run_ragas(to_ragas_dataset(dataset, bad_results, context_id_key="doc_id"))

    for report in (hybrid, bad):
        assert report.metrics == DEFAULT_RAGAS_METRICS
        _in_unit_interval(report)
        # No-answer questions have no references: skipped (None), not scored 0 or NaN.
        for name in report.metrics:
            assert report.skipped[name] == no_answer
            assert report.counts[name] == len(answerable)
            assert report.failed[name] == []
            assert all(report.scores(name)[query_id] is None for query_id in no_answer)

    # Hybrid finds the right document for (nearly) every answerable question; the constant
    # retriever only for the privacy-policy questions.
    assert hybrid.means["id_context_recall"] >= 0.9
    assert hybrid.means["id_context_precision"] >= 0.7
    assert bad.means["id_context_recall"] <= 0.4
    assert hybrid.means["id_context_recall"] - bad.means["id_context_recall"] >= 0.5
    assert hybrid.means["id_context_precision"] > bad.means["id_context_precision"]
    privacy = [q for q in answerable if dataset.qrels[q] == {"privacy_policy.txt": 1}]
    assert all(bad.scores("id_context_recall")[q] == 1.0 for q in privacy)
    # RAGAS' default whole-string Levenshtein similarity: still never better for the bad retriever.
    for name in ("nonllm_context_precision", "nonllm_context_recall"):
        assert hybrid.means[name] >= bad.means[name]

    # Containment similarity (the chunk holds the reference passage) suits chunked retrieval.
    metrics = ("nonllm_context_precision", "nonllm_context_recall")
    hybrid_c = run_ragas(to_ragas_dataset(dataset, hybrid_results), metrics, string_similarity="containment")
    bad_c = run_ragas(to_ragas_dataset(dataset, bad_results), metrics, string_similarity="containment")
    _in_unit_interval(hybrid_c)
    assert hybrid_c.means["nonllm_context_recall"] >= 0.6
    assert hybrid_c.means["nonllm_context_recall"] > hybrid.means["nonllm_context_recall"]
    assert bad_c.means["nonllm_context_recall"] <= 0.3
    assert hybrid_c.means["nonllm_context_precision"] > bad_c.means["nonllm_context_precision"]

    frame = hybrid.to_pandas()
    assert list(frame.columns) == ["query_id", "user_input", *DEFAULT_RAGAS_METRICS]
    assert len(frame) == len(dataset)
    assert frame["id_context_recall"].isna().sum() == len(no_answer)
    assert json.loads(json.dumps(hybrid.to_dict()))["means"] == hybrid.means


def test_run_retriever_for_ragas_with_retriever_and_query_engine(sample_index, dataset, hybrid_results) -> None:
    ids = ["q01", "q20", "q36"]
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=5)
    from_retriever = run_retriever_for_ragas(retriever, dataset, query_ids=ids)
    assert from_retriever.query_ids == ids
    assert [s.retrieved_contexts for s in from_retriever.samples] == [
        [n.node.get_content() for n in hybrid_results[q]] for q in ids
    ]
    assert all(s.response is None for s in from_retriever.samples)

    engine = sample_index.as_query_engine(llm=MockLLM(max_tokens=8), similarity_top_k=3)
    from_engine = run_retriever_for_ragas(engine, dataset, query_ids=ids, context_id_key="doc_id")
    for sample in from_engine.samples:
        assert len(sample.retrieved_contexts) == len(sample.retrieved_context_ids) == 3
        assert isinstance(sample.response, str) and sample.response
    report = run_ragas(from_engine, ("id_context_recall",))
    assert report.scores("id_context_recall") == {"q01": 1.0, "q20": 1.0, "q36": None}

    with pytest.raises(TypeError, match="retriever"):
        run_retriever_for_ragas(object(), dataset)


def test_a_failing_question_loses_no_other_question_s_results(sample_index, dataset, hybrid_results) -> None:
    """A retriever that fails on one question (a server timeout) used to lose every retrieval of the
    run; the others' dataset now comes with the error, and the failed ids to run again."""
    from llama_index_retrieval_kit.evaluation import RagasRetrievalError

    inner = sample_index.as_retriever("hybrid", similarity_top_k=5)
    failing_text = dataset.queries["q20"]

    class Flaky:
        def retrieve(self, text):
            if text == failing_text:
                raise TimeoutError("the Qdrant server did not answer")
            return inner.retrieve(text)

    ids = ["q01", "q20", "q36"]
    with pytest.raises(RagasRetrievalError, match="q20: TimeoutError") as caught:
        run_retriever_for_ragas(Flaky(), dataset, query_ids=ids)
    error = caught.value
    assert list(error.failures) == ["q20"] and isinstance(error.failures["q20"], TimeoutError)
    assert error.dataset.query_ids == ["q01", "q36"]
    assert [s.retrieved_contexts for s in error.dataset.samples] == [
        [n.node.get_content() for n in hybrid_results[q]] for q in ("q01", "q36")
    ]


# --------------------------------------------------------------------------------------------
# The LLM-judged metrics, with a scripted judge
# --------------------------------------------------------------------------------------------


def _sentences(text: str) -> List[str]:
    return [part.strip() for part in re.split(r"(?<=\.)\s+", text.strip()) if part.strip()]


def _holds(context: str, statement: str) -> bool:
    return statement.lower().rstrip(".") in context.lower()


def _entities(text: str) -> List[str]:
    return sorted(set(re.findall(r"\$\d+|\b[A-Z][a-z]+\b", text)))


#: What the scripted judge answers, by the RAGAS output model named in the prompt's JSON schema.
SCRIPT: Dict[str, Callable[[Dict[str, Any]], Dict[str, Any]]] = {
    # faithfulness, step 1: one statement per sentence of the answer
    "StatementGeneratorOutput": lambda data: {"statements": _sentences(data["answer"])},
    # faithfulness, step 2: a statement is supported when the context holds it verbatim
    "NLIStatementOutput": lambda data: {
        "statements": [
            {"statement": s, "reason": "scripted", "verdict": int(_holds(data["context"], s))}
            for s in data["statements"]
        ]
    },
    # answer_relevancy: noncommittal when the answer hedges
    "ResponseRelevanceOutput": lambda data: {
        "question": "What does the answer say?",
        "noncommittal": int("not sure" in data["response"].lower()),
    },
    # llm_context_precision: a context is useful when it holds a sentence of the reference answer
    "Verification": lambda data: {
        "reason": "scripted",
        "verdict": int(any(_holds(data["context"], s) for s in _sentences(data["answer"]))),
    },
    # llm_context_recall: a reference sentence is attributed when the context holds it
    "ContextRecallClassifications": lambda data: {
        "classifications": [
            {"statement": s, "reason": "scripted", "attributed": int(_holds(data["context"], s))}
            for s in _sentences(data["answer"])
        ]
    },
    # context_entity_recall: capitalised words and dollar amounts
    "EntitiesList": lambda data: {"entities": _entities(data["text"])},
}


class ScriptedTestLLM(CustomLLM):
    """Test double: a LlamaIndex LLM that answers RAGAS' prompts from :data:`SCRIPT`.

    It reads the output model's name from the JSON schema RAGAS puts in every prompt and the
    input from the prompt's last ``input:`` block, and records which prompts it saw.
    """

    _calls: List[str] = PrivateAttr(default_factory=list)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name="scripted-test-llm", is_chat_model=False)

    @property
    def calls(self) -> List[str]:
        return self._calls

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        schema_text = prompt.split("JSON Schema:\n", 1)[1].split("Do not use single quotes", 1)[0]
        title = json.loads(schema_text)["title"]
        data = json.loads(prompt.rsplit("\ninput: ", 1)[1].rsplit("\nOutput: ", 1)[0])
        if title not in SCRIPT:
            raise AssertionError(f"ScriptedTestLLM has no script for {title}")
        self._calls.append(title)
        return CompletionResponse(text=json.dumps(SCRIPT[title](data)))

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        yield self.complete(prompt, formatted, **kwargs)


FEE = "The annual fee is $95."
LATE = "Late payments cost up to $40."
WAIVER = "Northwind waives the fee in the first year."


def judged_samples() -> List[RagasSample]:
    return [
        RagasSample(  # half the answer is supported; the useful context comes first
            query_id="fee",
            user_input="What is the annual fee and when is it charged?",
            retrieved_contexts=[FEE + " " + WAIVER, LATE],
            retrieved_context_ids=["terms#1", "terms#2"],
            reference="The annual fee is $95. Northwind waives the fee in the first year.",
            reference_contexts=[FEE],
            reference_context_ids=["terms#1"],
            response="The annual fee is $95. The fee is charged every month.",
        ),
        RagasSample(  # fully supported; the useful context comes second; one of two ref sentences found
            query_id="late",
            user_input="What does a late payment cost?",
            retrieved_contexts=[FEE, "Northwind charges late payments. " + LATE],
            retrieved_context_ids=["terms#1", "terms#3"],
            reference="Late payments cost up to $40. The Bank reports them to Equifax.",
            reference_contexts=[LATE],
            reference_context_ids=["terms#3"],
            response="Late payments cost up to $40.",
        ),
        RagasSample(  # a no-answer question with a hedging response
            query_id="vacation",
            user_input="How many vacation days do employees get?",
            retrieved_contexts=[LATE],
            retrieved_context_ids=["terms#2"],
            response="I am not sure.",
        ),
        RagasSample(  # nothing generated yet: the answer metrics skip it
            query_id="pending",
            user_input="Is there a foreign transaction fee?",
            retrieved_contexts=["We charge a foreign transaction fee of 3%."],
            retrieved_context_ids=["terms#4"],
            reference="Yes, 3%.",
        ),
    ]


def test_llm_metrics_with_scripted_judge_give_the_scripted_scores() -> None:
    llm = ScriptedTestLLM()
    report = run_ragas(
        judged_samples(),
        metrics=LLM_METRICS,
        llm=llm,
        embed_model=MockEmbedding(embed_dim=8),
        raise_exceptions=True,
    )
    assert report.metrics == LLM_METRICS
    assert all(not failed for failed in report.failed.values())
    _in_unit_interval(report)

    # faithfulness = supported statements / statements: 1 of 2, 1 of 1; "I am not sure." is one
    # statement the context does not hold; no response -> skipped.
    assert report.scores("faithfulness") == {"fee": 0.5, "late": 1.0, "vacation": 0.0, "pending": None}
    assert report.means["faithfulness"] == pytest.approx(0.5)
    assert report.skipped["faithfulness"] == ["pending"]
    # answer_relevancy = cosine(question, generated question) (MockEmbedding: 1.0) x committal
    relevancy = report.scores("answer_relevancy")
    assert relevancy["fee"] == pytest.approx(1.0) and relevancy["late"] == pytest.approx(1.0)
    assert relevancy["vacation"] == 0.0 and relevancy["pending"] is None
    # llm_context_precision = average precision of the useful-context verdicts: [1, 0] and [0, 1]
    precision = report.scores("llm_context_precision")
    assert precision["fee"] == pytest.approx(1.0) and precision["late"] == pytest.approx(0.5)
    assert precision["pending"] == pytest.approx(0.0)  # its context does not hold "Yes, 3%"
    assert precision["vacation"] is None and report.skipped["llm_context_precision"] == ["vacation"]
    # llm_context_recall = attributed reference sentences: 2 of 2, 1 of 2, 0 of 1
    assert report.scores("llm_context_recall") == {"fee": 1.0, "late": 0.5, "vacation": None, "pending": 0.0}
    # context_entity_recall = reference entities found in the contexts:
    # fee: {$95, Northwind, The} all found; late: {$40, Late, The} of {$40, Bank, Equifax, Late, The}
    entities = report.scores("context_entity_recall")
    assert entities["fee"] == pytest.approx(1.0) and entities["late"] == pytest.approx(3 / 5)
    assert entities["pending"] == pytest.approx(0.0) and entities["vacation"] is None

    assert set(llm.calls) == set(SCRIPT)
    assert report.ragas_names["answer_relevancy"] == "answer_relevancy"
    assert report.ragas_names["llm_context_recall"] == "context_recall"


def test_llm_and_llm_free_metrics_together_and_empty_retrieval() -> None:
    samples = judged_samples()
    nothing = RagasSample(
        query_id="empty", user_input="What is the APR?", reference="21.49%.", reference_contexts=["APR is 21.49%."],
        reference_context_ids=["terms#9"], response="The APR is 21.49%.",
    )
    report = run_ragas(
        [*samples, nothing],
        metrics=(*LLM_FREE_METRICS, "llm_context_recall", "faithfulness"),
        llm=ScriptedTestLLM(),
        raise_exceptions=True,
    )
    assert report.scores("id_context_precision")["fee"] == 0.5
    recall = report.scores("id_context_recall")
    assert recall == {"fee": 1.0, "late": 1.0, "vacation": None, "pending": None, "empty": 0.0}
    assert report.scores("nonllm_context_recall")["fee"] in (0.0, 1.0)
    # Nothing retrieved: the context metrics score 0.0 (RAGAS alone would crash or give NaN) ...
    for name in (*LLM_FREE_METRICS, "llm_context_recall"):
        assert report.scores(name)["empty"] == 0.0, name
    # ... while faithfulness still asks the judge (no context supports the statement).
    assert report.scores("faithfulness")["empty"] == 0.0


def test_string_similarity_levenshtein_misses_a_chunk_that_holds_the_passage() -> None:
    """RAGAS' default compares whole strings: a chunk twice the passage's length falls below 0.5."""
    chunk = "Northwind charges late payments. " + LATE
    sample = RagasSample("late", "What does a late payment cost?", [chunk], ["c1"], reference_contexts=[LATE])
    metrics = ("nonllm_context_precision", "nonllm_context_recall")
    assert run_ragas([sample], metrics).means == {name: 0.0 for name in metrics}
    contained = run_ragas([sample], metrics, string_similarity="containment").means
    assert contained == pytest.approx({name: 1.0 for name in metrics})
    same = RagasSample("x", "q", [LATE], ["c1"], reference_contexts=[LATE])
    assert run_ragas([same], metrics).means == pytest.approx({name: 1.0 for name in metrics})


# --------------------------------------------------------------------------------------------
# Errors, offline guarantees
# --------------------------------------------------------------------------------------------


def test_llm_metric_without_llm_is_a_clear_value_error(monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setitem(sys.modules, "ragas", None)  # raised before RAGAS is even imported
    with pytest.raises(ValueError, match=r"'faithfulness'.*pass llm=\.\.\.") as info:
        run_ragas(judged_samples(), metrics=("id_context_recall", "faithfulness"))
    assert "OpenAI" not in type(info.value).__name__ and "api_key" not in str(info.value).lower()
    with pytest.raises(ValueError, match=r"'answer_relevancy'.*embed_model=\.\.\."):
        run_ragas(judged_samples(), metrics="answer_relevancy", llm=ScriptedTestLLM())
    with pytest.raises(ValueError, match="unknown RAGAS metric 'context_precision'.*id_context_precision.*faithfulness"):
        run_ragas(judged_samples(), metrics=("context_precision",))
    with pytest.raises(ValueError, match="string_similarity"):
        run_ragas(judged_samples(), string_similarity="cosine")
    # Without RAGAS, building samples still works and running says what is missing.
    assert to_ragas_samples(
        RetrievalDataset(queries={"a": "q"}, qrels={}), {"a": [NodeWithScore(node=TextNode(text="t"))]}
    )[0].retrieved_context_ids
    with pytest.raises(ImportError, match=r"needs the 'eval' extra: pip install 'llama-index-retrieval-kit\[eval\]'"):
        run_ragas(judged_samples())


def test_samples_as_dicts_and_bad_inputs() -> None:
    rows = [s.to_ragas_dict() | {"query_id": s.query_id} for s in judged_samples()]
    report = run_ragas(rows, metrics=("id_context_recall",))
    assert list(report.scores("id_context_recall")) == ["fee", "late", "vacation", "pending"]
    plain = [s.to_ragas_dict() for s in judged_samples()]
    renamed = run_ragas(plain, "id_context_recall", query_ids=["a", "b", "c", "d"])
    assert renamed.scores("id_context_recall") == {"a": 1.0, "b": 1.0, "c": None, "d": None}
    with pytest.raises(ValueError, match="unknown fields"):
        run_ragas([{"user_input": "q", "contexts": ["x"]}])
    with pytest.raises(ValueError, match="duplicate query ids"):
        run_ragas([judged_samples()[0], judged_samples()[0]])
    with pytest.raises(ValueError, match="to_ragas_dataset"):
        run_ragas(RetrievalDataset(queries={"a": "q"}, qrels={}))
    with pytest.raises(ValueError, match="no samples"):
        run_ragas([])


def test_nothing_reaches_the_network(monkeypatch) -> None:
    import ragas._analytics
    import ragas.evaluation

    attempts: List[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args[1:] if args else kwargs)
        raise OSError("network access attempted during run_ragas")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    # RAGAS' default judge/embeddings must never be built (they would be OpenAI's).
    monkeypatch.setattr(ragas.evaluation, "llm_factory", refuse)
    monkeypatch.setattr(ragas.evaluation, "embedding_factory", refuse)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    # Telemetry is off by default: our setting applies when the user has none.
    monkeypatch.delenv("RAGAS_DO_NOT_TRACK", raising=False)
    ragas._analytics.do_not_track.cache_clear()

    report = run_ragas(
        judged_samples(),
        metrics=(*LLM_FREE_METRICS, *LLM_METRICS),
        llm=ScriptedTestLLM(),
        embed_model=MockEmbedding(embed_dim=8),
        raise_exceptions=True,
    )
    ragas._analytics._analytics_batcher.flush()
    assert os.environ["RAGAS_DO_NOT_TRACK"] == "true"
    assert ragas._analytics.do_not_track() is True
    assert attempts == []
    assert set(report.metrics) == set(RAGAS_METRICS)
    assert all(not failed for failed in report.failed.values())


def test_users_own_telemetry_setting_is_kept(monkeypatch) -> None:
    monkeypatch.setenv("RAGAS_DO_NOT_TRACK", "false")
    ragas_adapter._import_ragas()
    assert os.environ["RAGAS_DO_NOT_TRACK"] == "false"


def test_ragas_is_imported_lazily() -> None:
    """No module-level RAGAS import: importing the package never imports (or breaks on) RAGAS."""
    tree = ast.parse(Path(ragas_adapter.__file__).read_text(encoding="utf-8"))
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [alias.name for node in top_level if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in top_level if isinstance(node, ast.ImportFrom)]
    assert not [name for name in names if name.split(".")[0] == "ragas"]
