"""The async paths as an asyncio server (FastAPI) uses them: ``aretrieve`` of every retriever
``HybridIndex.as_retriever`` builds returns exactly what ``retrieve`` returns, alone and under
``asyncio.gather``, and raises what it raises; gathered ``aquery`` / ``achat`` / ``astream_chat``
with the no-answer gate, the reranker and the assembler give each request its own answer, gate
decision and trace (the sync ones); and concurrent gate calls (a sync endpoint's thread pool)
trace their own confidence. Real sample index, real MiniLM, MockLLM, a tiny offline cross-encoder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from llama_index.core.llms import MockLLM
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit import ContextAssembler, CrossEncoderReranker, NoAnswerPostprocessor
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.tracing import JsonlTraceWriter, QueryTrace, TraceCollector, collect_traces, read_traces

from .indices import _support
from .postprocessor._cross_encoder_folder import build_tiny_cross_encoder

RETRIEVERS = _support.RETRIEVER_KINDS
IDS = [f"{mode}-{options.get('dense_search', 'auto')}" for mode, options in RETRIEVERS]
FILTERS = {
    "none": None,
    "eq": MetadataFilters(filters=[MetadataFilter(key="doc_id", value="credit_card_terms.md")]),
    "nin": MetadataFilters(filters=[MetadataFilter(key="doc_id", value=["credit_card_terms.md"], operator=FilterOperator.NIN)]),
}
TOP_K = 8
NO_ANSWER = "No answer in these documents."


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    with _support.opened_sample_copy(tmp_path_factory.mktemp("async_paths")) as idx:
        yield idx


@pytest.fixture(scope="module")
def gate(index: HybridIndex) -> NoAnswerPostprocessor:
    return _support.calibrated_gate(index, top_k=TOP_K)


@pytest.fixture(scope="module")
def mixed_questions(index: HybridIndex, gate: NoAnswerPostprocessor) -> List[str]:
    """20 questions, answerable and not, on which the gate both opens and closes."""
    questions = list(_support.questions())
    mixed = questions[:12] + questions[-8:]
    retriever = index.as_retriever("hybrid", similarity_top_k=TOP_K)
    closed = [q for q in mixed if gate.confidence(retriever.retrieve(q), q) < gate.threshold]
    assert 2 <= len(closed) <= len(mixed) - 2, closed
    return mixed


def results(found: List[NodeWithScore]) -> List[Tuple[Any, ...]]:
    """Everything a caller reads from a result: id, score, leg ranks and scores, metadata, text, type."""
    return [
        (r.node.node_id, r.score, getattr(r, "leg_ranks", None), getattr(r, "leg_scores", None), dict(r.node.metadata),
         r.node.get_content(), type(r).__name__)
        for r in found
    ]


def failure(call: Any) -> Optional[Tuple[str, str]]:
    """(exception type, message) of ``call()``, None when it returns."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - compared whole by the caller
        return type(exc).__name__, str(exc)
    return None


# ----------------------------------------------------------------------------- retrievers
@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize(("mode", "options"), RETRIEVERS, ids=IDS)
def test_aretrieve_returns_exactly_what_retrieve_returns(index: HybridIndex, mode: str, options: dict, filters: str) -> None:
    retriever = index.as_retriever(mode, similarity_top_k=6, filters=FILTERS[filters], **options)
    for bundle in _support.query_bundles()[:2]:
        for query in (bundle.query_str, QueryBundle(bundle.query_str), bundle):  # the last carries its embedding
            want = results(retriever.retrieve(query))
            assert want and results(asyncio.run(retriever.aretrieve(query))) == want, (query, filters)


@pytest.mark.parametrize(("mode", "options"), RETRIEVERS, ids=IDS)
def test_gathered_aretrieve_calls_each_get_their_own_results(index: HybridIndex, mode: str, options: dict) -> None:
    retriever = index.as_retriever(mode, similarity_top_k=TOP_K, **options)
    bundles = _support.query_bundles()[:20]
    queries = [b.query_str if i % 4 == 0 else b for i, b in enumerate(bundles)]  # some embedded on the query path
    want = [results(retriever.retrieve(q)) for q in queries]

    async def gathered() -> List[List[NodeWithScore]]:
        return await asyncio.gather(*(retriever.aretrieve(q) for q in queries))

    assert [results(r) for r in asyncio.run(gathered())] == want


@pytest.mark.parametrize(("mode", "options"), RETRIEVERS, ids=IDS)
def test_aretrieve_raises_what_retrieve_raises(index: HybridIndex, mode: str, options: dict) -> None:
    retriever = index.as_retriever(mode, similarity_top_k=3, **options)
    for bad in ("", " \n", QueryBundle(""), None, b"fees"):
        error = failure(lambda: retriever.retrieve(bad))
        assert error is not None and error[0] == "ValueError"
        assert failure(lambda: asyncio.run(retriever.aretrieve(bad))) == error, bad
    # a malformed filter set on a built retriever: refused when set, else when the query runs, alike
    malformed = MetadataFilters(filters=[MetadataFilter(key="doc_id", value="x", operator=FilterOperator.IN)])
    if failure(lambda: setattr(retriever, "filters", malformed)) is None:
        error = failure(lambda: retriever.retrieve("annual fee"))
        assert error is not None and "needs a list value" in error[1]
        assert failure(lambda: asyncio.run(retriever.aretrieve("annual fee"))) == error


# ----------------------------------------------------------------------------- engines
def answer(response: Any) -> Tuple[str, List[Tuple[str, Optional[float]]], str]:
    """A query or chat response as a caller reads it: text, sources, metadata (bar the trace)."""
    metadata = {k: v for k, v in (getattr(response, "metadata", None) or {}).items() if k != "trace"}
    sources = [(n.node.node_id, n.score) for n in response.source_nodes]
    return str(response), sources, json.dumps(metadata, sort_keys=True, default=str)


def stages(trace: QueryTrace) -> List[Tuple[Any, ...]]:
    """Per stage: name, query, input and output ids, confidence."""
    return [
        (s.name, s.query_str, [n["node_id"] for n in s.inputs], [n["node_id"] for n in s.outputs], s.confidence)
        for s in trace.stages
    ]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> CrossEncoderReranker:
    folder = build_tiny_cross_encoder(tmp_path_factory.mktemp("async_cross_encoder"))
    return CrossEncoderReranker(model=str(folder), backend="sentence_transformers", device="cpu", max_length=128, top_n=4).load()


@pytest.mark.parametrize("with_reranker", [False, True])
def test_gathered_aqueries_each_get_their_own_answer_gate_decision_and_trace(
    index: HybridIndex, gate: NoAnswerPostprocessor, reranker: CrossEncoderReranker, mixed_questions: List[str], with_reranker: bool,
    tmp_path: Path,
) -> None:
    postprocessors = [gate, reranker, ContextAssembler(max_tokens=300)] if with_reranker else [gate, ContextAssembler(max_tokens=300)]
    engine = index.as_query_engine(llm=MockLLM(), similarity_top_k=TOP_K, node_postprocessors=postprocessors)
    writer = JsonlTraceWriter(path=str(tmp_path / "traces.jsonl"))
    with TraceCollector() as collector, writer:
        sync = {q: engine.query(q) for q in mixed_questions}
        want = {t.query_str: stages(t) for t in collector.traces}
        collector.clear()

        async def gathered() -> List[Any]:
            return await asyncio.gather(*(engine.aquery(q) for q in mixed_questions))

        got = asyncio.run(gathered())
    assert sum(bool(r.metadata.get("no_answer")) for r in got) >= 2  # the gate closed on some, opened on others
    for question, response in zip(mixed_questions, got):
        assert answer(response) == answer(sync[question]), question
        assert response.metadata["trace"]["query_str"] == question
    assert len(collector.traces) == len(mixed_questions)
    assert {t.query_str: stages(t) for t in collector.traces} == want
    lines = read_traces(tmp_path / "traces.jsonl")
    assert len(lines) == 2 * len(mixed_questions)
    assert {t.query_str: stages(t) for t in lines[len(mixed_questions):]} == want


async def _drained(response: Any) -> str:
    return "".join([token async for token in response.async_response_gen()])


@pytest.mark.parametrize("chat_mode", ["condense_plus_context", "context", "condense_question"])
@pytest.mark.parametrize("streaming", [False, True])
def test_gathered_chat_turns_each_get_their_own_answer_and_trace(
    index: HybridIndex, gate: NoAnswerPostprocessor, mixed_questions: List[str], chat_mode: str, streaming: bool
) -> None:
    """One chat engine per conversation (an engine keeps its conversation), all sharing the gate
    and the assembler, gathered: each turn answers (or abstains) and is traced as it does alone."""
    assembler = ContextAssembler(max_tokens=300)
    questions = mixed_questions[::2]  # 10 conversations

    def engine() -> Any:  # streamed: a short answer (MockLLM streams its echo of the prompt token by token)
        llm = MockLLM(max_tokens=8) if streaming else MockLLM()
        # an in-process memory: LlamaIndex's default (SQL over aiosqlite) outlives each asyncio.run's loop
        memory = ChatMemoryBuffer.from_defaults(token_limit=4000)
        return index.as_chat_engine(chat_mode, llm=llm, similarity_top_k=TOP_K, node_postprocessors=[gate, assembler], memory=memory)

    def turn(question: str) -> Tuple[str, List[Any], str]:
        if streaming:
            response = engine().stream_chat(question)
            return "".join(response.response_gen), [(n.node.node_id, n.score) for n in response.source_nodes], ""
        return answer(engine().chat(question))

    async def aturn(question: str) -> Tuple[str, List[Any], str]:
        if streaming:
            response = await engine().astream_chat(question)
            return await _drained(response), [(n.node.node_id, n.score) for n in response.source_nodes], ""
        return answer(await engine().achat(question))

    async def gathered() -> List[Tuple[str, List[Any], str]]:
        return await asyncio.gather(*(aturn(q) for q in questions))

    with collect_traces() as collector:
        sync = {q: turn(q) for q in questions}
        want = {t.query_str: stages(t) for t in collector.traces}
        collector.clear()
        got = asyncio.run(gathered())
    assert sum(text == NO_ANSWER for text, _, _ in got) >= 2
    for question, (text, sources, metadata) in zip(questions, got):
        want_text, want_sources, want_metadata = sync[question]
        assert (text, metadata) == (want_text, want_metadata), question
        if not (streaming and chat_mode == "condense_question"):
            # LlamaIndex's astream_chat of CondenseQuestionChatEngine leaves source_nodes empty
            # (StreamingAgentChatResponse reads them from a Response or StreamingResponse only)
            assert sources == want_sources, question
    assert len(want) == len(questions) and len(collector.traces) == len(questions)
    assert {t.query_str: stages(t) for t in collector.traces} == want


# ----------------------------------------------------------------------------- the gate in threads
class _HoldClosingThread(logging.Handler):
    """Holds the thread whose gate has just closed (at its debug line) until ``go_on`` is set."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.held = threading.Event()
        self.go_on = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("no-answer gate closed") and not self.held.is_set():
            self.held.set()
            self.go_on.wait(timeout=30)


@contextlib.contextmanager
def _held_at_close() -> Iterator[_HoldClosingThread]:
    logger = logging.getLogger("llama_index_retrieval_kit.postprocessor.no_answer")
    handler, level = _HoldClosingThread(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        handler.go_on.set()
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_concurrent_gate_calls_each_trace_their_own_confidence(index: HybridIndex, gate: NoAnswerPostprocessor, mixed_questions: List[str]) -> None:
    """A sync endpoint's thread pool runs the gate in several threads at once: the trace of a query
    whose gate closed must record its own confidence, not that of a query another thread gated
    meanwhile (the gate kept the last confidence on itself, shared by every thread)."""
    retriever = index.as_retriever("hybrid", similarity_top_k=TOP_K)
    found = {q: retriever.retrieve(q) for q in mixed_questions}
    confidence: Dict[str, float] = {q: gate.confidence(found[q], q) for q in mixed_questions}
    closed = next(q for q in mixed_questions if confidence[q] < gate.threshold)
    opened = next(q for q in mixed_questions if confidence[q] >= gate.threshold)
    with collect_traces() as collector, _held_at_close() as hold:
        worker = threading.Thread(target=gate.postprocess_nodes, args=(found[closed],), kwargs={"query_str": closed})
        worker.start()
        assert hold.held.wait(timeout=30)  # the closed query is inside the gate, its decision made
        assert gate.postprocess_nodes(found[opened], query_str=opened)  # another request passes the gate meanwhile
        hold.go_on.set()
        worker.join(timeout=30)
    records = {t.query_str: t.stage("no_answer") for t in collector.traces}
    assert records[closed].confidence == pytest.approx(confidence[closed], abs=1e-12)
    assert records[closed].outputs == [] and records[closed].confidence < records[closed].threshold
    assert all(f"confidence {confidence[closed]:.4f}" in d["detail"] for d in records[closed].dropped)
    assert records[opened].confidence == pytest.approx(confidence[opened], abs=1e-12)
