"""Per-stage tracing: stage events through LlamaIndex's instrumentation, per-query traces, JSON
lines, and nothing built when nobody listens (real sample index, real MiniLM, calibrated gate)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.bridge.pydantic import ValidationError
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent, RetrievalStartEvent
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_retrieval_kit import NoAnswerPostprocessor
from llama_index_retrieval_kit import tracing
from llama_index_retrieval_kit.evaluation import load_jsonl
from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.postprocessor.context import ContextAssembler
from llama_index_retrieval_kit.retrievers import HybridRetriever
from llama_index_retrieval_kit.samples import QUESTIONS_FILE
from llama_index_retrieval_kit.tracing import (
    DropReason,
    JsonlTraceWriter,
    NodesDroppedEvent,
    QueryTrace,
    Stage,
    StageTraceEvent,
    TraceCollector,
    collect_traces,
    format_trace,
    read_traces,
    tracing_enabled,
)

from .indices import _support

ANSWERABLE = ["How much is the late payment fee?", "What is the purchase APR?"]
AFTER_LEGS = ["fusion", "no_answer", "context"]


def _stages(sample_index: HybridIndex) -> List[str]:
    """The stage names of one engine query: the hybrid retriever's legs (its fusion mode decides), then the rest."""
    return [*sample_index.as_retriever("hybrid", similarity_top_k=8).names, *AFTER_LEGS]


class Recorder(BaseEventHandler):
    """An ordinary event handler that keeps every event it sees."""

    events: List[Any] = []

    @classmethod
    def class_name(cls) -> str:
        return "Recorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> Any:
        self.events.append(event)


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridIndex]:
    with _support.opened_sample_copy(tmp_path_factory.mktemp("trace")) as index:
        yield index


@pytest.fixture(scope="module")
def gate(sample_index: HybridIndex) -> NoAnswerPostprocessor:
    """Calibrated on the bundled questions, as tests/postprocessor/test_no_answer.py does."""
    return _support.calibrated_gate(sample_index, top_k=8)


@pytest.fixture(scope="module")
def assembler() -> ContextAssembler:
    return ContextAssembler(max_tokens=160)


@pytest.fixture(scope="module")
def engine(sample_index: HybridIndex, gate: NoAnswerPostprocessor, assembler: ContextAssembler) -> RetrieverQueryEngine:
    return RetrieverQueryEngine.from_args(
        sample_index.as_retriever("hybrid", similarity_top_k=8), llm=MockLLM(max_tokens=5), node_postprocessors=[gate, assembler]
    )


@pytest.fixture(scope="module")
def closed_question(sample_index: HybridIndex, gate: NoAnswerPostprocessor) -> str:
    dataset = load_jsonl(QUESTIONS_FILE)
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=8)
    for qid in dataset.no_answer_ids():
        q = dataset.queries[qid]
        if gate.confidence(retriever.retrieve(q), q) < gate.threshold:
            return q
    pytest.fail("the gate closes on none of the bundled no-answer questions")


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    handler = Recorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    try:
        yield handler
    finally:
        root.event_handlers = [h for h in root.event_handlers if h is not handler]


def _ids(nodes: List[Any]) -> List[str]:
    """Node ids of results or of traced nodes."""
    return [n["node_id"] if isinstance(n, dict) else n.node_id for n in nodes]


# ----------------------------------------------------------------------------- events
def test_an_ordinary_event_handler_sees_every_stage(
    engine: RetrieverQueryEngine, recorder: Recorder, sample_index: HybridIndex
) -> None:
    assert tracing_enabled()
    response = engine.query(ANSWERABLE[0])
    stage_events = [e for e in recorder.events if isinstance(e, StageTraceEvent)]
    assert [e.trace.name for e in stage_events] == _stages(sample_index)
    assert all(e.span_id for e in stage_events)  # emitted inside the stages' instrumentation spans
    # LlamaIndex's own retrieval events still come, around the retrieval stages
    kinds = [type(e) for e in recorder.events]
    assert RetrievalStartEvent in kinds and RetrievalEndEvent in kinds
    assert kinds.index(RetrievalStartEvent) < kinds.index(StageTraceEvent) < kinds.index(RetrievalEndEvent)
    dropped = [e for e in recorder.events if isinstance(e, NodesDroppedEvent)]
    assert {e.name for e in dropped} >= {"fusion"}
    for e in dropped:
        (match,) = [s.trace for s in stage_events if s.trace.name == e.name]
        assert e.dropped == match.dropped
    # the context the LLM read is the assembly stage's output
    assert _ids(response.source_nodes) == _ids(stage_events[-1].trace.outputs)


def test_the_dense_leg_says_how_much_of_its_time_embedded_the_query(sample_index: HybridIndex) -> None:
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=3)
    with collect_traces() as collector:
        retriever.retrieve(ANSWERABLE[0])
        embedding = sample_index.embed_model.get_query_embedding(ANSWERABLE[0])
        retriever.retrieve(QueryBundle(ANSWERABLE[0], embedding=embedding))
    text_query, embedded_query = (t.stage("dense") for t in collector.traces)
    assert 0 < text_query.attributes["query_embedding_ms"] <= text_query.latency_ms
    assert "query embedding" in tracing.format_trace(collector.traces[0])
    assert embedded_query.attributes["query_embedding_ms"] < text_query.attributes["query_embedding_ms"]
    assert "context tokens n/a" in tracing.format_trace(collector.traces[0])  # no assembly stage


def test_an_event_handler_serialising_the_events_gets_the_node_lists(engine: RetrieverQueryEngine) -> None:
    """A handler that logs events as JSON (``model_dump_json``, as exporters do) gets every
    stage's inputs, outputs and drops, though the records build them only when read."""
    logged: List[dict] = []

    class JsonLogger(BaseEventHandler):
        def handle(self, event: BaseEvent, **kwargs: Any) -> None:
            if isinstance(event, StageTraceEvent):
                logged.append(json.loads(event.model_dump_json()))
                logged.append(event.model_dump(mode="json"))

    handler = JsonLogger()
    root = get_dispatcher()
    root.add_event_handler(handler)
    try:
        engine.query(ANSWERABLE[0])
    finally:
        root.event_handlers = [h for h in root.event_handlers if h is not handler]
    assert logged
    for as_json, as_dump in zip(logged[::2], logged[1::2]):
        record = as_json["trace"]
        assert {"inputs", "outputs", "dropped"} <= set(record) and record == as_dump["trace"]
    assert any(entry["trace"]["outputs"] for entry in logged)
    fusion = next(entry["trace"] for entry in logged if entry["trace"]["name"] == "fusion")
    assert fusion["inputs"] and all("leg_ranks" in row for row in fusion["inputs"])


def test_a_collected_trace_nested_in_another_model_serialises_whole(engine: RetrieverQueryEngine) -> None:
    from llama_index.core.bridge.pydantic import BaseModel

    class Report(BaseModel):
        traces: List[QueryTrace]

    with collect_traces() as collector:
        engine.query(ANSWERABLE[0])
    report = Report(traces=[collector.last])  # stages not read yet
    dumped = report.model_dump(mode="json")["traces"][0]
    assert dumped["stages"] and dumped == collector.last.model_dump(mode="json")
    assert json.loads(report.model_dump_json())["traces"][0] == dumped


# ----------------------------------------------------------------------------- completeness
def _check_complete(trace: QueryTrace) -> None:
    *leg_records, fusion, gate, context = trace.stages
    assert [s.name for s in trace.stages[-3:]] == AFTER_LEGS and len(leg_records) >= 2
    assert all(s.stage is Stage.RETRIEVAL_LEG for s in leg_records)
    for record in trace.stages:
        assert record.unaccounted_ids() == [], (record.name, record.unaccounted_ids())
        assert record.latency_ms >= 0
        outputs = set(_ids(record.outputs))
        for d in record.dropped:
            assert isinstance(d["reason"], DropReason) and d["detail"]
            if record.stage is not Stage.ASSEMBLY:
                assert d["node_id"] not in outputs
    # every candidate of fusion is a leg candidate, with that leg's rank and score
    legs = {leg.name: {n["node_id"]: n for n in leg.outputs} for leg in leg_records}
    assert set(_ids(fusion.inputs)) == set().union(*legs.values())
    for n in fusion.inputs:
        for leg, rank in n["leg_ranks"].items():
            assert legs[leg][n["node_id"]]["rank"] == rank and legs[leg][n["node_id"]]["score"] == n["leg_scores"][leg]
    # the stages chain: each stage's input is the previous stage's output
    assert _ids(gate.inputs) == _ids(fusion.outputs)
    assert _ids(context.inputs) == _ids(gate.outputs)
    assert gate.confidence is not None and gate.threshold is not None
    assert context.context_tokens is not None and context.context_tokens <= context.max_tokens


def test_every_candidate_is_kept_or_dropped_with_a_reason(
    engine: RetrieverQueryEngine, closed_question: str, assembler: ContextAssembler, gate: NoAnswerPostprocessor
) -> None:
    with collect_traces() as collector:
        responses = [engine.query(q) for q in ANSWERABLE]
        last = assembler.last_report
        closed = engine.query(closed_question)
    traces = collector.traces
    assert [t.query_str for t in traces] == ANSWERABLE + [closed_question]
    for trace in traces:
        _check_complete(trace)
        assert trace.latency_ms >= sum(s.latency_ms for s in trace.stages) * 0.99
    # the open gate passes everything; assembly drops what the budget (or an overlap) left out
    for trace, response in zip(traces[:2], responses):
        gate_record, context = trace.stage("no_answer"), trace.stage("context")
        assert gate_record.dropped == [] and gate_record.confidence >= gate_record.threshold
        assert response.metadata["trace"] == trace.to_dict()
        assert trace.context_tokens == context.context_tokens
    context = traces[1].stage("context")
    assert context.context_tokens == last.used_tokens
    assert {(d["node_id"], d["reason"]) for d in context.dropped} == {
        (x.node_id, DropReason.OVER_BUDGET if x.reason == "over budget" else DropReason.DUPLICATE) for x in last.left_out
    }
    assert any(d["reason"] is DropReason.OVER_BUDGET for t in traces[:2] for d in t.stage("context").dropped)
    # a closed gate drops every fused result below threshold; the no-answer response keeps its metadata
    gate_record = traces[2].stage("no_answer")
    assert gate_record.outputs == [] and len(gate_record.dropped) == len(gate_record.inputs) > 0
    assert all(d["reason"] is DropReason.BELOW_THRESHOLD for d in gate_record.dropped)
    assert gate_record.confidence < gate_record.threshold == gate.threshold
    assert closed.metadata["no_answer"] is True and closed.metadata["trace"]["stages"][-2]["name"] == "no_answer"
    assert traces[2].stage("context").outputs == [] and traces[2].context_tokens == 0


def test_async_queries_are_traced_apart(engine: RetrieverQueryEngine) -> None:
    async def both() -> List[Any]:
        return await asyncio.gather(*(engine.aquery(q) for q in ANSWERABLE))

    with collect_traces() as collector:
        responses = asyncio.run(both())
    by_query = {t.query_str: t for t in collector.traces}
    assert set(by_query) == set(ANSWERABLE)
    for q, response in zip(ANSWERABLE, responses):
        _check_complete(by_query[q])
        assert response.metadata["trace"]["trace_id"] == by_query[q].trace_id


def test_generic_hybrid_retriever_traces_its_legs_and_depth_cut(sample_index: HybridIndex) -> None:
    retriever = HybridRetriever(
        [sample_index.as_retriever("sparse", similarity_top_k=10), sample_index.as_retriever("dense", similarity_top_k=10)],
        names=["bm25", "dense"],
        candidate_top_k=6,
        similarity_top_k=4,
    )
    with collect_traces() as collector:
        results = retriever.retrieve(ANSWERABLE[1])
        asyncio.run(retriever.aretrieve(ANSWERABLE[0]))
    sync_trace, async_trace = collector.traces  # a retriever called on its own: one trace per retrieve call
    assert sync_trace.query_str == ANSWERABLE[1] and async_trace.query_str == ANSWERABLE[0]
    for trace in (sync_trace, async_trace):
        legs = [s for s in trace.stages if s.stage is Stage.RETRIEVAL_LEG]
        assert [s.name for s in legs] == ["bm25", "dense"]
        for leg in legs:
            assert leg.unaccounted_ids() == [] and len(leg.outputs) == 6 and len(leg.inputs) == 10
            assert all(d["reason"] is DropReason.NOT_IN_TOP_K for d in leg.dropped) and len(leg.dropped) == 4
        fusion = trace.stage("fusion")
        assert fusion.unaccounted_ids() == [] and fusion.attributes["mode"] == "rrf"
    assert _ids(sync_trace.stage("fusion").outputs) == [r.node.node_id for r in results]


def test_rerank_record_names_why_each_candidate_went() -> None:
    nodes = [NodeWithScore(node=TextNode(id_=f"n{i}", text=f"t{i}"), score=1.0 - i / 10) for i in range(6)]
    results = [SimpleNamespace(node=nodes[i].node, score=0.9 - i / 10, pre_rerank_rank=i + 1) for i in (1, 0)]
    stats = SimpleNamespace(candidates=6, capped_to=4, scored=3, returned=2, scoring_ms=1.0, per_pair_ms=0.3)
    reranker = SimpleNamespace(last_stats=stats, top_n=2, latency_budget_ms=5.0, model="tiny")
    record = tracing.rerank_record(reranker, "q", nodes, results, 2.0)
    assert record.unaccounted_ids() == []
    reasons = {d["node_id"]: d["reason"] for d in record.dropped}
    assert reasons == {
        "n2": DropReason.NOT_IN_TOP_K,
        "n3": DropReason.NOT_SCORED,
        "n4": DropReason.OVER_MAX_CANDIDATES,
        "n5": DropReason.OVER_MAX_CANDIDATES,
    }
    assert [(n["node_id"], n["pre_rerank_rank"]) for n in record.outputs] == [("n1", 2), ("n0", 1)]


def test_rerank_record_counts_a_repeated_id_once_and_names_it_a_duplicate() -> None:
    """The reranker scores a repeated node id once (its first place): the record drops the repeat
    as a duplicate and compares max_candidates / scored with distinct ids (with [a, a, b, c, d] and
    max_candidates 3 it called c over max_candidates although c was scored)."""
    node = {i: NodeWithScore(node=TextNode(id_=i, text=i), score=1.0) for i in "abcd"}
    nodes = [node["a"], node["a"], node["b"], node["c"], node["d"]]
    results = [SimpleNamespace(node=node["b"].node, score=0.9, pre_rerank_rank=3)]
    stats = SimpleNamespace(candidates=4, capped_to=3, scored=3, returned=1, scoring_ms=1.0, per_pair_ms=0.3,
                            truncated=0, duplicates_dropped=1, fixed_call_ms=0.2)
    reranker = SimpleNamespace(last_stats=stats, top_n=1, latency_budget_ms=None, model="tiny")
    record = tracing.rerank_record(reranker, "q", nodes, results, 2.0)
    dropped = [(d["node_id"], d["reason"], d["rank"]) for d in record.dropped]
    assert dropped == [("a", DropReason.NOT_IN_TOP_K, 1), ("a", DropReason.DUPLICATE, 2), ("c", DropReason.NOT_IN_TOP_K, 4),
                       ("d", DropReason.OVER_MAX_CANDIDATES, 5)]
    assert record.attributes["duplicates_dropped"] == 1 and record.attributes["truncated"] == 0


# ----------------------------------------------------------------------------- JSON lines
def test_json_lines_round_trip(engine: RetrieverQueryEngine, closed_question: str, tmp_path: Path) -> None:
    path = tmp_path / "traces" / "queries.jsonl"
    writer = JsonlTraceWriter(path=str(path), keep=True)
    with writer:
        for q in ANSWERABLE + [closed_question]:
            engine.query(q)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and all(json.loads(line)["query_str"] for line in lines)
    read = read_traces(path)
    assert [t.to_dict() for t in read] == [t.to_dict() for t in writer.traces] == [json.loads(line) for line in lines]
    assert read == writer.traces
    for trace, line in zip(read, lines):
        _check_complete(trace)  # every candidate kept or dropped with a reason, after reading back
        assert QueryTrace.from_json(trace.to_json()) == trace
        # the columnar layout (format 2): columns of equal length, fusion's candidates rebuilt from its legs
        data = json.loads(line)
        assert data["format"] == tracing.TRACE_FORMAT == 2
        for stage in data["stages"]:
            for key in ("inputs", "outputs", "dropped"):
                columns = stage[key]
                assert columns == [] or "merged_from" in columns or len({len(v) for v in columns.values() if isinstance(v, list)}) == 1
        (fusion,) = [s for s in data["stages"] if s["name"] == "fusion"]
        legs = [s["name"] for s in data["stages"] if s["stage"] == "retrieval_leg"]
        assert fusion["inputs"] == fusion["dropped"] == {"merged_from": legs}
        # the row layout (format 1, pydantic's model_dump) reads back to the same trace
        rows = trace.model_dump(mode="json")
        assert "format" not in rows and isinstance(rows["stages"][0]["outputs"], list)
        assert QueryTrace.from_dict(rows) == trace == QueryTrace.from_json(trace.model_dump_json())
        assert format_trace(rows) == format_trace(trace)
    text = format_trace(read[0])
    for name in [s.name for s in read[0].stages]:  # the legs, then AFTER_LEGS (_check_complete)
        assert f"== {name} (" in text
    assert "tokens" in text and "not in top-k" in text
    assert format_trace(lines[0]) == text == format_trace(json.loads(lines[0]))


def test_the_attached_trace_is_the_json_line_and_reads_back(engine: RetrieverQueryEngine, tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    with JsonlTraceWriter(path=str(path), keep=True) as writer:
        response = engine.query(ANSWERABLE[0])
        attached = response.metadata["trace"]
        assert writer.pending == 1  # serialised when the query ended: changing the dict now changes nothing written
        attached["query_str"] = "changed"
        attached["stages"][-1]["outputs"]["node_id"].clear()
    (trace,) = writer.traces
    (line,) = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(line) == trace.to_dict() and json.loads(line)["query_str"] == ANSWERABLE[0]
    assert QueryTrace.from_json(line) == trace
    assert _ids(trace.stage("context").outputs) == _ids(response.source_nodes)


def test_a_fusion_record_without_its_legs_is_written_in_full(engine: RetrieverQueryEngine) -> None:
    with collect_traces() as collector:
        engine.query(ANSWERABLE[1])
    trace = collector.last
    fusion = trace.stage("fusion")
    alone = QueryTrace(query_str="q", stages=[fusion])  # no leg precedes it: nothing to rebuild the candidates from
    data = alone.to_dict()
    (stage,) = data["stages"]
    assert stage["inputs"]["node_id"] == _ids(fusion.inputs) and stage["dropped"]["node_id"] == _ids(fusion.dropped)
    assert QueryTrace.from_dict(data).stages[0] == fusion
    # a columnar trace that names a leg it does not hold is refused, naming the stages it has
    broken = trace.to_dict()
    broken["stages"] = [s for s in broken["stages"] if s["stage"] != "retrieval_leg"]
    with pytest.raises(ValueError, match="merged from leg .* not an earlier stage"):
        QueryTrace.from_dict(broken)
    with pytest.raises(ValueError, match="unknown trace format 7; readable formats: 1 \\(rows\\), 2 \\(columns\\)"):
        QueryTrace.from_dict({**trace.to_dict(), "format": 7})
    uneven = trace.to_dict()
    uneven["stages"][-1]["inputs"]["score"].pop()
    with pytest.raises(ValueError, match="column 'score' must be a list of"):
        QueryTrace.from_dict(uneven)


def test_the_standard_library_json_writes_and_reads_the_same_lines(engine: RetrieverQueryEngine, tmp_path: Path) -> None:
    """Without orjson (not a declared dependency) the traces are written and read with ``json``: the same data."""
    path = tmp_path / "orjson.jsonl"
    with JsonlTraceWriter(path=str(path), keep=True) as writer:
        for q in ANSWERABLE:
            engine.query(q)
    assert tracing.json_backend() == "orjson"  # in this venv (brought by other packages)
    out = tmp_path / "json.jsonl"
    script = (
        "import json, sys\n"
        "sys.modules['orjson'] = None\n"  # import orjson fails: the standard library's json is used
        "from llama_index_retrieval_kit import tracing\n"
        "assert tracing.json_backend() == 'json'\n"
        f"traces = tracing.read_traces({str(path)!r})\n"
        f"with open({str(out)!r}, 'w', encoding='utf-8') as fh:\n"
        "    for trace in traces:\n"
        "        line = trace.to_json()\n"
        "        assert tracing.QueryTrace.from_json(line) == trace and json.loads(line) == trace.to_dict()\n"
        "        fh.write(line + '\\n')\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert read_traces(out) == read_traces(path) == writer.traces
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == [t.to_dict() for t in writer.traces]


_node_lists = st.lists(
    st.tuples(st.one_of(st.none(), st.floats(-5, 5)), st.one_of(st.none(), st.dictionaries(st.sampled_from(["bm25", "dense"]), st.integers(1, 50), min_size=1)),
              st.one_of(st.none(), st.integers(1, 9))),
    max_size=12,
)


def _results_of(entries: List[Any], prefix: str) -> List[NodeWithScore]:
    """Results from ``(score, leg ranks or None, pre-rerank rank or None)`` entries, ids ``prefix0``, ``prefix1``, ..."""
    out = []
    for i, (score, legs, pre) in enumerate(entries):
        result = NodeWithScore(node=TextNode(id_=f"{prefix}{i}", text="t"), score=score)
        if legs:
            result.__dict__["leg_ranks"] = legs
            result.__dict__["leg_scores"] = {leg: rank / 10 for leg, rank in legs.items()}
        if pre is not None:
            result.__dict__["pre_rerank_rank"] = pre
        out.append(result)
    return out


@settings(max_examples=50, deadline=None)
@given(_node_lists, _node_lists, st.data())
def test_both_layouts_read_back_to_the_same_record(inputs: List[Any], outputs: List[Any], data: st.DataObject) -> None:
    """A gate record: its columnar form (from the snapshots) and its row form (model_dump) read back alike."""

    results = _results_of

    nodes = results(inputs, "n")
    kept = nodes[: data.draw(st.integers(0, len(nodes)))] + results(outputs, "m")
    gate = SimpleNamespace(is_fitted=True, threshold=0.5, similarity_cutoff=data.draw(st.one_of(st.none(), st.floats(-5, 5))))
    trace = QueryTrace(query_str="q")
    trace.stages.append(tracing.gate_record(gate, nodes, kept, "q", 1.0, confidence=0.25))
    columns = trace.to_json()  # built from the snapshots: no row read yet
    record = trace.stages[0]
    assert record.unaccounted_ids() == []
    assert QueryTrace.from_json(columns) == trace == QueryTrace.from_json(trace.model_dump_json())
    assert QueryTrace.from_json(columns).to_json() == columns == trace.to_json()  # the same form once the rows are built


# ----------------------------------------------------------------------------- off
def test_nothing_is_built_or_emitted_without_a_listener(
    engine: RetrieverQueryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not tracing_enabled(), [type(h).__name__ for h in get_dispatcher().event_handlers]

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a trace record was built with no handler listening")

    for name in ("traced_node", "traced_nodes", "snapshot", "from_snapshot", "emit", "trace_index_fusion", "trace_gate", "trace_assembly"):
        monkeypatch.setattr(tracing, name, fail)
    import llama_index_retrieval_kit.indices.fused_retriever as fr
    import llama_index_retrieval_kit.postprocessor.context as ctx
    import llama_index_retrieval_kit.postprocessor.no_answer as na

    monkeypatch.setattr(fr, "trace_index_fusion", fail)
    monkeypatch.setattr(na, "trace_gate", fail)
    monkeypatch.setattr(ctx, "trace_assembly", fail)
    response = engine.query(ANSWERABLE[0])
    assert response.source_nodes and "trace" not in (response.metadata or {})
    # and an uninstalled collector collects nothing
    collector = tracing.TraceCollector()
    with collector:
        pass
    engine.query(ANSWERABLE[1])
    assert collector.traces == [] and not tracing_enabled()


# ----------------------------------------------------------------------------- cost: what is built, when
class DropAwareCollector(TraceCollector):
    """A collector that also reads the NodesDroppedEvents (its ``handle`` is its own)."""

    drops: List[Any] = []

    def handle(self, event: BaseEvent, **kwargs: Any) -> Any:
        if isinstance(event, NodesDroppedEvent):
            self.drops.append(event)
        return super().handle(event, **kwargs)


def test_drop_events_are_built_for_handlers_that_may_read_them_only(
    engine: RetrieverQueryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    aware = DropAwareCollector(drops=[])
    with aware:
        engine.query(ANSWERABLE[0])
    (trace,) = aware.traces
    assert {e.name for e in aware.drops} >= {"fusion"}
    for event in aware.drops:
        assert event.dropped == trace.stage(event.name).dropped and event.dropped

    class Unbuildable(NodesDroppedEvent):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a NodesDroppedEvent was built for a plain collector")

    class UnbuildableStageEvent(StageTraceEvent):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a StageTraceEvent was built with only plain collectors listening")

    monkeypatch.setattr(tracing, "NodesDroppedEvent", Unbuildable)
    monkeypatch.setattr(tracing, "StageTraceEvent", UnbuildableStageEvent)
    with collect_traces() as collector:  # takes the stage records directly, reads the drops from them
        engine.query(ANSWERABLE[0])
    direct = collector.last
    _check_complete(direct)
    assert [s.name for s in direct.stages] == [s.name for s in trace.stages]
    def settings(record: Any) -> dict:  # the attributes but the timings, which differ between the two queries
        return {k: v for k, v in record.attributes.items() if not k.endswith("_ms")}

    for got, want in zip(direct.stages, trace.stages):  # the same records as through the dispatcher
        assert (got.inputs, got.outputs, got.dropped, settings(got)) == (want.inputs, want.outputs, want.dropped, settings(want))


def test_records_keep_what_the_stage_saw(sample_index: HybridIndex, gate: NoAnswerPostprocessor, assembler: ContextAssembler) -> None:
    query = QueryBundle(ANSWERABLE[1])
    nodes = sample_index.as_retriever("hybrid", similarity_top_k=8).retrieve(query)
    with collect_traces() as collector:
        kept = gate.postprocess_nodes(nodes, query_bundle=query)
        out = assembler.postprocess_nodes(kept, query_bundle=query)
    seen = [(r.node.node_id, r.score) for r in nodes]
    sources = [list(r.node.metadata["source_node_ids"]) for r in out]
    # what later code may do to the results: rescore in place (as SentenceTransformerRerank does), reorder, edit metadata
    for r in nodes:
        r.score = -1.0
    nodes.reverse()
    for r in out:
        r.node.metadata["source_node_ids"].append("changed")
    gate_trace, context_trace = collector.traces  # stages run outside a query: one trace each
    assert collector.last is context_trace and collector.traces[0] is gate_trace  # made once, when first read
    record = gate_trace.stage("no_answer")
    assert [(n["node_id"], n["score"]) for n in record.inputs] == seen
    assert [(n["node_id"], n["score"]) for n in record.outputs] == seen
    assert [n["source_ids"] for n in context_trace.stage("context").outputs] == sources



def test_records_keep_the_leg_ranks_and_scores_the_stage_saw(
    sample_index: HybridIndex, gate: NoAnswerPostprocessor, tmp_path: Path
) -> None:
    """The fused results' ``leg_ranks`` / ``leg_scores`` dicts edited in place after the stages ran
    (a user postprocessor renaming legs): the fusion, gate and rerank records and the JSON line
    keep what each stage saw."""
    query = QueryBundle(ANSWERABLE[1])
    writer = JsonlTraceWriter(path=str(tmp_path / "traces.jsonl"), flush_interval_s=3600.0)
    with collect_traces() as collector, writer:
        nodes = sample_index.as_retriever("hybrid", similarity_top_k=8).retrieve(query)
        gate.postprocess_nodes(nodes, query_bundle=query)
        reranked = [NodeWithScore(node=r.node, score=r.score) for r in reversed(nodes[:2])]
        for rank, r in zip((2, 1), reranked):
            r.__dict__.update(pre_rerank_rank=rank, leg_ranks=nodes[rank - 1].leg_ranks, leg_scores=nodes[rank - 1].leg_scores)
        tracing.emit(tracing.rerank_record(SimpleNamespace(last_stats=None, top_n=2, latency_budget_ms=None, model="m"), query, nodes, reranked, 1.0))
        seen = [(dict(r.leg_ranks), dict(r.leg_scores)) for r in nodes]
        assert seen and all(ranks for ranks, _ in seen)
        for r in nodes:
            r.leg_ranks["bm25"] = 999
            r.leg_scores.clear()
    retrieval, gate_trace, rerank_trace = collector.traces
    for rows in (retrieval.stage("fusion").outputs, gate_trace.stage("no_answer").inputs, rerank_trace.stage("rerank").inputs):
        assert [(n["leg_ranks"], n["leg_scores"]) for n in rows] == seen
    assert [(n["leg_ranks"], n["leg_scores"]) for n in rerank_trace.stage("rerank").outputs] == [seen[1], seen[0]]
    line = json.loads((tmp_path / "traces.jsonl").read_text().splitlines()[0])
    fusion = next(s for s in line["stages"] if s["name"] == "fusion")["outputs"]
    assert list(zip(fusion["leg_ranks"], fusion["leg_scores"])) == seen


_legs = st.dictionaries(st.sampled_from(["bm25", "dense"]), st.integers(1, 50), min_size=1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(-5, 5)), st.one_of(st.none(), _legs), st.one_of(st.none(), st.integers(1, 9)))))
def test_a_snapshot_reads_as_the_results_did(entries: List[Any]) -> None:
    results = _results_of(entries, "n")
    assert tracing.from_snapshot(tracing.snapshot(results)) == tracing.traced_nodes(results)


def test_a_collected_trace_reads_copies_and_pickles_as_a_built_one(engine: RetrieverQueryEngine) -> None:
    """A collector keeps the stages as they were handed on and makes the records when they are first read."""
    import copy
    import pickle

    first, second = TraceCollector(), TraceCollector()  # two plain collectors: the same stages, records of their own
    with first, second:
        response = engine.query(ANSWERABLE[0])
    attached = response.metadata["trace"]  # each collector attaches its own trace: the last one stays
    trace, twin = sorted([first.last, second.last], key=lambda t: t.trace_id != attached["trace_id"])
    assert trace.to_dict() == attached  # written from the stages as handed on, nothing read yet
    # a copy, a pickle and a comparison read the stages; the JSON form stays the same once they are read
    assert copy.deepcopy(trace) == trace == pickle.loads(pickle.dumps(trace))
    assert trace.to_dict() == attached
    assert [s.name for s in twin.stages] == [s.name for s in trace.stages] and twin.stages[0] is not trace.stages[0]
    legs = [s for s in twin.stages if s.stage is Stage.RETRIEVAL_LEG]
    assert legs[0].outputs  # one leg's rows read, fusion's not: fusion still finds its legs
    fusion = twin.to_dict()["stages"][len(legs)]
    assert fusion["name"] == "fusion" and fusion["inputs"] == {"merged_from": [s.name for s in legs]}
    assert twin.to_dict()["stages"] == attached["stages"]
    _check_complete(twin)
    assert twin.model_dump(mode="json")["stages"] == trace.model_dump(mode="json")["stages"]


def test_trace_and_event_ids_are_unique_uuid4s(engine: RetrieverQueryEngine, recorder: Recorder) -> None:
    with collect_traces() as collector:
        for q in ANSWERABLE:
            engine.query(q)
    trace_ids = [t.trace_id for t in collector.traces] + [QueryTrace().trace_id for _ in range(3)]
    assert len(set(trace_ids)) == len(trace_ids)
    assert all(uuid.UUID(hex=i).hex == i and uuid.UUID(hex=i).version == 4 for i in trace_ids)
    event_ids = [e.id_ for e in recorder.events if isinstance(e, (StageTraceEvent, NodesDroppedEvent))]
    assert event_ids and len(set(event_ids)) == len(event_ids)
    assert all(uuid.UUID(e.id_).version == 4 for e in recorder.events if isinstance(e, StageTraceEvent))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a forked worker draws ids of its own
        os.write(write, QueryTrace().trace_id.encode())
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 64).decode()[:20] != QueryTrace().trace_id[:20]


def test_unknown_or_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="max_trace"):
        TraceCollector(max_trace=10)
    with pytest.raises(ValidationError, match="flush_interval_s"):
        JsonlTraceWriter(path=str(tmp_path / "t.jsonl"), flush_interval_s=0)
    with pytest.raises(ValidationError, match="max_pending"):
        JsonlTraceWriter(path=str(tmp_path / "t.jsonl"), max_pending=0)


# ----------------------------------------------------------------------------- JSON lines: buffered, never lost
def _stage_only_traces(writer: JsonlTraceWriter, names: List[str], **attributes: Any) -> None:
    """One single-stage trace per name (a record emitted outside any query), with ``writer`` listening."""
    nodes = [NodeWithScore(node=TextNode(id_=f"n{i}", text=f"t{i}"), score=1.0 - i / 10) for i in range(3)]
    with writer:
        for name in names:
            record = tracing.rerank_record(SimpleNamespace(last_stats=None, top_n=2, latency_budget_ms=None, model=name),
                                           name, nodes, nodes[:2], 1.0)
            record.attributes.update(attributes)
            tracing.emit(record)


def test_json_lines_wait_for_a_flush_and_keep_their_order(engine: RetrieverQueryEngine, tmp_path: Path) -> None:
    path = tmp_path / "deep" / "queries.jsonl"
    writer = JsonlTraceWriter(path=str(path), flush_interval_s=3600, keep=True)
    writer.install()
    try:
        for q in ANSWERABLE + ANSWERABLE[:1]:
            engine.query(q)
        assert writer.pending == 3 and not path.exists()  # queued, not written on the query path
        assert writer.flush() == 3 and writer.pending == 0 and writer.flush() == 0
        engine.query(ANSWERABLE[1])
    finally:
        writer.uninstall()  # writes the rest
    assert [t.query_str for t in read_traces(path)] == ANSWERABLE + ANSWERABLE[:1] + ANSWERABLE[1:]
    assert [t.to_dict() for t in read_traces(path)] == [t.to_dict() for t in writer.traces]
    writer.close()
    assert path.read_text(encoding="utf-8").count("\n") == 4


def test_json_lines_are_written_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "exit.jsonl"
    script = (
        "import sys\n"
        "from types import SimpleNamespace\n"
        "from llama_index.core.schema import NodeWithScore, TextNode\n"
        "from llama_index_retrieval_kit import tracing\n"
        f"writer = tracing.JsonlTraceWriter(path={str(path)!r}, flush_interval_s=3600).install()\n"
        "nodes = [NodeWithScore(node=TextNode(id_='a', text='a'), score=1.0)]\n"
        "for q in ('q1', 'q2', 'q3'):\n"
        "    ranker = SimpleNamespace(last_stats=None, top_n=1, latency_budget_ms=None, model='m')\n"
        "    tracing.emit(tracing.rerank_record(ranker, q, nodes, nodes, 1.0))\n"
        "assert writer.pending == 3\n"  # no flush, no uninstall: the interpreter's exit writes them
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert [t.query_str for t in read_traces(path)] == ["q1", "q2", "q3"]


def test_a_failed_write_keeps_the_lines_and_a_bad_trace_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "blocked.jsonl"
    path.mkdir()  # a folder where the file should be: writing fails
    writer = JsonlTraceWriter(path=str(path), flush_interval_s=3600)
    _stage_only_traces(writer, ["a"])  # the end of the with block cannot write: logged, the line kept
    assert writer.pending == 1 and "could not write traces" in caplog.text
    with pytest.raises(IsADirectoryError):
        writer.flush()  # an explicit flush says why
    assert writer.pending == 1
    path.rmdir()
    _stage_only_traces(writer, ["b"], unserialisable=object())  # never writable: logged and skipped
    _stage_only_traces(writer, ["c"])
    assert [t.query_str for t in read_traces(path)] == ["a", "c"]
    assert "cannot be serialised" in caplog.text


def test_a_failed_query_does_not_swallow_the_traces_of_later_ones(sample_index: HybridIndex) -> None:
    """A query that raises emits no end event (LlamaIndex drops its span): its open trace must not
    stay open in that context (a server's worker thread) and collect every later query's stages."""
    from concurrent.futures import ThreadPoolExecutor

    from llama_index.core.postprocessor.types import BaseNodePostprocessor

    class Fails(BaseNodePostprocessor):
        def _postprocess_nodes(self, nodes, query_bundle=None):
            raise RuntimeError("postprocessor failed")

    failing = RetrieverQueryEngine.from_args(
        sample_index.as_retriever("hybrid", similarity_top_k=3), llm=MockLLM(max_tokens=5), node_postprocessors=[Fails()]
    )
    working = RetrieverQueryEngine.from_args(sample_index.as_retriever("hybrid", similarity_top_k=3), llm=MockLLM(max_tokens=5))

    def fail() -> None:
        with pytest.raises(RuntimeError, match="postprocessor failed"):
            failing.query("late payment fee")

    with TraceCollector() as collector, ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(fail).result()
        assert collector.traces == []
        for i in range(3):
            worker.submit(lambda i=i: sample_index.as_retriever("hybrid", similarity_top_k=3).retrieve(f"annual fee {i}")).result()
        response = worker.submit(lambda: working.query("annual fee")).result()
        traces = collector.traces
        assert [t.query_str for t in traces] == ["annual fee 0", "annual fee 1", "annual fee 2", "annual fee"]
        assert response.metadata["trace"]["query_str"] == "annual fee"
        assert all(t.stages for t in traces)


def test_the_jsonl_file_only_ever_grows_by_whole_lines(tmp_path: Path) -> None:
    """A failed append (a full disk) is cut back, a retry writes every line once, a file that does
    not end with a newline gets one first, and a torn line is named (or skipped on request)."""
    from llama_index_retrieval_kit.tracing import append_lines

    path = tmp_path / "traces.jsonl"
    script = (
        "import resource, signal, sys\n"
        "from llama_index.core.schema import TextNode\n"
        "from llama_index_retrieval_kit.retrievers.bm25 import BM25Retriever\n"
        "from llama_index_retrieval_kit.tracing import JsonlTraceWriter\n"
        f"path = {str(path)!r}\n"
        "retriever = BM25Retriever([TextNode(text=f'fee clause {i}', id_=f'n{i}') for i in range(9)], similarity_top_k=3)\n"
        "writer = JsonlTraceWriter(path=path, flush_interval_s=60)\n"
        "with writer:\n"
        "    retriever.retrieve('fee one'); writer.flush()\n"
        "    import os; first = os.path.getsize(path)\n"
        "    retriever.retrieve('clause two'); retriever.retrieve('fee three')\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (first + 100, hard))\n"
        "    try:\n"
        "        writer.flush(); sys.exit('the flush should have failed')\n"
        "    except OSError:\n"
        "        pass\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))\n"
        "    assert os.path.getsize(path) == first, (os.path.getsize(path), first)\n"
        "    assert writer.flush() == 2\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [t.query_str for t in read_traces(path)] == ["fee one", "clause two", "fee three"]
    with open(path, "ab") as fh:
        fh.write(b'{"trace_id": "cut by a cra')  # a writer killed mid-line
    with pytest.raises(ValueError, match="line 4 is not a trace"):
        read_traces(path)
    append_lines(path, read_traces(path, skip_bad_lines=True)[0].to_json().encode("utf-8") + b"\n")
    assert [t.query_str for t in read_traces(path, skip_bad_lines=True)] == ["fee one", "clause two", "fee three", "fee one"]
