"""Per-stage trace records, emitted through LlamaIndex's instrumentation.

Every stage of the query path (each retrieval leg, fusion, the no-answer gate, the reranker,
context assembly) describes what it did in a :class:`StageTrace`: the nodes it was given and
the nodes it returned (ids, scores, ranks), every input it did not pass on with the reason
(:class:`DropReason`), its latency and, for assembly, the context's token count. The record
travels as a :class:`StageTraceEvent` (plus a :class:`NodesDroppedEvent` when something was
dropped) through ``get_dispatcher(__name__).event(...)``, so any event handler on the root
dispatcher sees it next to LlamaIndex's own ``RetrievalStart/End``, ``ReRankStart/End`` and
``QueryStart/End`` events.

:class:`TraceCollector` (an event handler) groups the records of one query into a
:class:`QueryTrace` (between ``QueryStartEvent`` and ``QueryEndEvent``, tracked per
context, so threads and asyncio tasks keep their queries apart), attaches it to the response
(``response.metadata["trace"]``, :func:`attach_trace`) and hands it on;
:class:`JsonlTraceWriter` appends one JSON line per query; :func:`collect_traces` installs a
collector for a ``with`` block; :func:`format_trace` renders a trace as one table per stage.

Cost: stages check :func:`tracing_enabled` (a walk over the few handlers on the dispatcher
chain) and build nothing when no handler listens; LlamaIndex's ``NullEventHandler`` and this
package's no-answer response handler do not count as listeners.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
import time
import uuid
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent, RetrievalStartEvent
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.schema import NodeWithScore, QueryBundle
from typing_extensions import Annotated, NotRequired, TypedDict

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

__all__ = [
    "DropReason",
    "DroppedNode",
    "JsonlTraceWriter",
    "NodesDroppedEvent",
    "QueryTrace",
    "Stage",
    "StageTrace",
    "StageTraceEvent",
    "TraceCollector",
    "TracedNode",
    "attach_trace",
    "collect_traces",
    "format_trace",
    "read_traces",
    "tracing_enabled",
]

#: Handlers that do not count as listeners (LlamaIndex's default, this package's own response filler).
PASSIVE_HANDLERS = frozenset({"NullEventHandler", "NoAnswerResponseHandler"})


# ------------------------------------------------------------------------------ records
class Stage(str, Enum):
    """The kind of stage a record describes."""

    RETRIEVAL_LEG = "retrieval_leg"
    FUSION = "fusion"
    NO_ANSWER_GATE = "no_answer_gate"
    RERANK = "rerank"
    ASSEMBLY = "assembly"


class DropReason(str, Enum):
    """Why a stage did not pass an input node on."""

    NOT_IN_TOP_K = "not in top-k"
    BELOW_THRESHOLD = "below threshold"
    BELOW_CUTOFF = "below similarity cutoff"
    OVER_BUDGET = "over budget"
    DUPLICATE = "duplicate"
    FILTERED = "filtered"
    OVER_MAX_CANDIDATES = "over max candidates"
    NOT_SCORED = "not scored (latency budget)"


# Per-node entries are TypedDicts (validated and described by pydantic inside StageTrace) rather
# than models: a query traces a few hundred of them, and a dict costs a tenth of a model to build.
class TracedNode(TypedDict):
    """A node as a stage saw it (input) or returned it (output); optional keys only when they apply."""

    node_id: Annotated[str, Field(description="Node id (for assembly outputs: the assembled context node's id).")]
    rank: Annotated[int, Field(description="Position in the stage's list, 1 = first.")]
    score: Annotated[Optional[float], Field(description="The node's score in that list.")]
    leg_ranks: NotRequired[Annotated[Dict[str, int], Field(description="Rank per retrieval leg (fused results).")]]
    leg_scores: NotRequired[Annotated[Dict[str, Optional[float]], Field(description="Raw score per retrieval leg.")]]
    pre_rerank_rank: NotRequired[Annotated[int, Field(description="Rank before reranking (reranked results).")]]
    source_ids: NotRequired[Annotated[List[str], Field(description="Input node ids an assembled node was built from.")]]


class DroppedNode(TypedDict):
    """An input node a stage did not pass on, and why."""

    node_id: Annotated[str, Field(description="The dropped node's id.")]
    reason: Annotated[DropReason, Field(description="Why it was dropped.")]
    rank: Annotated[Optional[int], Field(description="Its rank in the stage's input, 1 = first.")]
    score: Annotated[Optional[float], Field(description="Its score in the stage's input.")]
    detail: NotRequired[Annotated[str, Field(description="Specifics, e.g. 'confidence 0.12 < threshold 0.40'.")]]
    duplicate_of: NotRequired[Annotated[str, Field(description="For duplicates: the node id that holds its text.")]]


_LAZY_FIELDS = frozenset({"inputs", "outputs", "dropped"})
_MATERIALIZE_LOCK = threading.RLock()


def _construct(cls: Any, values: Dict[str, Any], private: Optional[Dict[str, Any]] = None) -> Any:
    """``cls.model_construct(**values)`` without its per-field default handling (every field is given, or lazy)."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(cls.model_fields))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", private)
    return obj


class StageTrace(BaseModel):
    """What one stage did for one query."""

    stage: Stage = Field(description="Kind of stage.")
    name: str = Field(description="Stage name, e.g. 'bm25', 'dense', 'fusion', 'no_answer', 'rerank', 'context'.")
    component: str = Field(description="Class name of the component that ran it.")
    query_str: Optional[str] = Field(default=None, description="The query text.")
    inputs: List[TracedNode] = Field(default_factory=list, description="Nodes handed to the stage, in order.")
    outputs: List[TracedNode] = Field(default_factory=list, description="Nodes the stage returned, in order.")
    dropped: List[DroppedNode] = Field(default_factory=list, description="Inputs not passed on, with the reason.")
    latency_ms: float = Field(description="Wall time of the stage in milliseconds.")
    confidence: Optional[float] = Field(default=None, description="No-answer gate: the answer probability.")
    threshold: Optional[float] = Field(default=None, description="No-answer gate: the threshold it was compared with.")
    context_tokens: Optional[int] = Field(default=None, description="Assembly: tokens of the final context.")
    max_tokens: Optional[int] = Field(default=None, description="Assembly: the token budget.")
    attributes: Dict[str, Any] = Field(default_factory=dict, description="Further stage settings and statistics.")
    span_id: Optional[str] = Field(default=None, description="Instrumentation span the stage ran in.")

    # Builds ``inputs`` / ``outputs`` / ``dropped`` on first read (see :func:`_lazy_record`): the hot path stores raw lists.
    _lazy: Optional[Callable[[], Dict[str, Any]]] = PrivateAttr(default=None)

    def __getattr__(self, name: str) -> Any:
        if name in _LAZY_FIELDS:  # only reached while the field is not built yet (not in __dict__)
            self._materialize()
            return self.__dict__[name]
        return super().__getattr__(name)

    def _materialize(self) -> "StageTrace":
        private = self.__pydantic_private__
        if private and private.get("_lazy") is not None:
            with _MATERIALIZE_LOCK:
                build = private.get("_lazy")
                if build is not None:
                    self.__dict__.update(build())
                    private["_lazy"] = None
        return self

    def model_dump(self, **kwargs: Any) -> Dict[str, Any]:
        return super(StageTrace, self._materialize()).model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        return super(StageTrace, self._materialize()).model_dump_json(**kwargs)

    def model_copy(self, **kwargs: Any) -> Any:
        return super(StageTrace, self._materialize()).model_copy(**kwargs)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, StageTrace):
            other._materialize()
        return super(StageTrace, self._materialize()).__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr_args__(self) -> Any:
        return super(StageTrace, self._materialize()).__repr_args__()

    def __getstate__(self) -> Dict[Any, Any]:
        return super(StageTrace, self._materialize()).__getstate__()

    def __copy__(self) -> Any:
        return super(StageTrace, self._materialize()).__copy__()

    def __deepcopy__(self, memo: Any = None) -> Any:
        return super(StageTrace, self._materialize()).__deepcopy__(memo)

    def unaccounted_ids(self) -> List[str]:
        """Input ids neither returned (directly or inside an assembled node) nor dropped: empty for a complete record."""
        covered = {n["node_id"] for n in self.outputs} | {d["node_id"] for d in self.dropped}
        for n in self.outputs:
            covered.update(n.get("source_ids", ()))
        return [n["node_id"] for n in self.inputs if n["node_id"] not in covered]


class QueryTrace(BaseModel):
    """The stage records of one query, in the order the stages ran."""

    trace_id: str = Field(default_factory=lambda: uuid.uuid4().hex, description="Unique id of this trace.")
    query_str: Optional[str] = Field(default=None, description="The query text.")
    started_at: datetime = Field(default_factory=datetime.now, description="When the query started.")
    latency_ms: Optional[float] = Field(default=None, description="Query wall time (QueryStart to QueryEnd).")
    stages: List[StageTrace] = Field(default_factory=list, description="Stage records in run order.")
    span_id: Optional[str] = Field(default=None, description="Span of the query (or retrieval) that opened the trace.")

    @property
    def context_tokens(self) -> Optional[int]:
        """Tokens of the final context (the last assembly stage), None without assembly."""
        counts = [s.context_tokens for s in self.stages if s.stage is Stage.ASSEMBLY]
        return counts[-1] if counts else None

    def stage(self, name: str) -> StageTrace:
        """The last record named ``name`` (KeyError naming the stages there are)."""
        for record in reversed(self.stages):
            if record.name == name:
                return record
        raise KeyError(f"no stage {name!r} in this trace; stages: {[s.name for s in self.stages]}")

    def _materialize(self) -> "QueryTrace":
        for record in self.stages:
            record._materialize()
        return self

    def model_dump(self, **kwargs: Any) -> Dict[str, Any]:
        return super(QueryTrace, self._materialize()).model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        return super(QueryTrace, self._materialize()).model_dump_json(**kwargs)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        """One JSON line (no newline inside)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, line: str) -> "QueryTrace":
        """The trace written by :meth:`to_json`."""
        return cls.model_validate_json(line)


def read_traces(path: Union[str, Path]) -> List[QueryTrace]:
    """Every trace of a JSON-lines file written by :class:`JsonlTraceWriter`."""
    with open(path, encoding="utf-8") as fh:
        return [QueryTrace.from_json(line) for line in fh if line.strip()]


# ------------------------------------------------------------------------------ events
class StageTraceEvent(BaseEvent):
    """A stage finished; ``trace`` says what it did."""

    trace: StageTrace = Field(description="The stage record.")

    @classmethod
    def class_name(cls) -> str:
        return "StageTraceEvent"


class NodesDroppedEvent(BaseEvent):
    """A stage did not pass some of its input nodes on (LlamaIndex has no such event)."""

    stage: Stage = Field(description="Kind of stage.")
    name: str = Field(description="Stage name.")
    query_str: Optional[str] = Field(default=None, description="The query text.")
    dropped: List[DroppedNode] = Field(description="The dropped nodes with their reasons.")

    _record: Optional[StageTrace] = PrivateAttr(default=None)  # when emitted by a stage: `dropped` is its record's

    @classmethod
    def class_name(cls) -> str:
        return "NodesDroppedEvent"

    def __getattr__(self, name: str) -> Any:
        if name == "dropped":
            private = self.__pydantic_private__
            record = private.get("_record") if private else None
            if record is not None:
                self.__dict__["dropped"] = value = record.dropped
                return value
        return super().__getattr__(name)

    def _materialize(self) -> "NodesDroppedEvent":
        if "dropped" not in self.__dict__:
            self.dropped  # noqa: B018 (builds it)
        return self

    def model_dump(self, **kwargs: Any) -> Dict[str, Any]:
        return super(NodesDroppedEvent, self._materialize()).model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        return super(NodesDroppedEvent, self._materialize()).model_dump_json(**kwargs)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, NodesDroppedEvent):
            other._materialize()
        return super(NodesDroppedEvent, self._materialize()).__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr_args__(self) -> Any:
        return super(NodesDroppedEvent, self._materialize()).__repr_args__()


def tracing_enabled() -> bool:
    """True when an event handler other than the passive defaults listens on this module's dispatcher chain."""
    d: Any = dispatcher
    while d is not None:
        for handler in d.event_handlers:
            if type(handler).class_name() not in PASSIVE_HANDLERS:
                return True
        d = d.parent if d.propagate and d.name != d.root_name else None
    return False


def emit(record: StageTrace, n_dropped: Optional[int] = None) -> None:
    """Dispatch ``record`` (and a :class:`NodesDroppedEvent` when it dropped nodes).

    ``n_dropped``: how many it dropped, for a lazy record (whose ``dropped`` is built only when read).
    Both events are built unvalidated (every field given), the drop event's entries are the record's.
    """
    span_id = active_span_id.get()
    record.__dict__["span_id"] = span_id
    event = _construct(StageTraceEvent, {"timestamp": datetime.now(), "id_": str(uuid.uuid4()), "span_id": span_id,
                                         "tags": {}, "trace": record})
    dispatcher.event(event)
    if n_dropped is None:
        n_dropped = len(record.dropped)
    if n_dropped:
        values = {"timestamp": event.timestamp, "id_": event.id_ + "-dropped", "span_id": span_id, "tags": {},
                  "stage": record.stage, "name": record.name, "query_str": record.query_str}
        if "dropped" in record.__dict__:
            values["dropped"] = record.__dict__["dropped"]
        dispatcher.event(_construct(NodesDroppedEvent, values, {"_record": record}))


# ------------------------------------------------------------------------------ building records (pure)
class Laps:
    """Wall time of consecutive segments, in ms (``mark(name)`` ends the current segment)."""

    __slots__ = ("_t", "ms")
    on = True

    def __init__(self) -> None:
        self._t = time.perf_counter()
        self.ms: Dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = self.ms.get(name, 0.0) + (now - self._t) * 1000.0
        self._t = now


class _NoLaps:
    """The :class:`Laps` of an untraced call: measures nothing."""

    __slots__ = ()
    on = False

    def mark(self, name: str) -> None:
        pass


#: Shared no-op :class:`Laps` for when tracing is off.
NO_LAPS = _NoLaps()


def elapsed_ms(started: float) -> float:
    """Milliseconds since ``started`` (a ``time.perf_counter()`` value)."""
    return (time.perf_counter() - started) * 1000.0


def _query_text(query: Any) -> Optional[str]:
    if query is None:
        return None
    return query.query_str if isinstance(query, QueryBundle) else str(query)


def _score(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def traced_node(result: NodeWithScore, rank: int) -> TracedNode:
    """The :class:`TracedNode` of a result at ``rank`` (reads fusion and rerank attributes when present)."""
    node: TracedNode = {"node_id": result.node.node_id, "rank": rank, "score": _score(result.score)}
    fields = result.__dict__  # not getattr: a missing attribute costs a pydantic AttributeError (microseconds)
    legs = fields.get("leg_ranks")
    if legs:
        node["leg_ranks"] = dict(legs)
        node["leg_scores"] = dict(fields.get("leg_scores") or {})
    pre = fields.get("pre_rerank_rank")
    if pre is not None:
        node["pre_rerank_rank"] = pre
    return node


def traced_nodes(results: Sequence[NodeWithScore]) -> List[TracedNode]:
    """:func:`traced_node` of each result, ranks from 1."""
    return [traced_node(r, i) for i, r in enumerate(results, 1)]


def _dropped(node: TracedNode, reason: DropReason, detail: Optional[str] = None, duplicate_of: Optional[str] = None) -> DroppedNode:
    dropped: DroppedNode = {"node_id": node["node_id"], "reason": reason, "rank": node["rank"], "score": node["score"]}
    if detail is not None:
        dropped["detail"] = detail
    if duplicate_of is not None:
        dropped["duplicate_of"] = duplicate_of
    return dropped


def _record(stage: Stage, name: str, component: str, query_str: Optional[str], latency_ms: float, **fields: Any) -> StageTrace:
    defaults: Dict[str, Any] = dict(
        inputs=[], outputs=[], dropped=[], confidence=None, threshold=None, context_tokens=None, max_tokens=None,
        attributes={}, span_id=None,
    )
    defaults.update(fields)
    defaults.update(stage=stage, name=name, component=component, query_str=query_str, latency_ms=float(latency_ms))
    return _construct(StageTrace, defaults, {"_lazy": None})


def _lazy_record(stage: Stage, name: str, component: str, query_str: Optional[str], latency_ms: float,
                 build: Callable[[], Dict[str, Any]], **fields: Any) -> StageTrace:
    """A record whose ``inputs`` / ``outputs`` / ``dropped`` not in ``fields`` come from ``build()`` when first read."""
    values: Dict[str, Any] = dict(confidence=None, threshold=None, context_tokens=None, max_tokens=None, attributes={}, span_id=None)
    values.update(fields)
    values.update(stage=stage, name=name, component=component, query_str=query_str, latency_ms=float(latency_ms))

    def fill() -> Dict[str, Any]:
        built = build()
        return {k: built.get(k, []) for k in _LAZY_FIELDS if k not in values}

    return _construct(StageTrace, values, {"_lazy": fill})


def leg_record(
    name: str, component: str, query_str: Optional[str], results: Sequence[NodeWithScore], depth: Optional[int], latency_ms: float
) -> StageTrace:
    """A retrieval leg: what it returned (inputs) and the first ``depth`` that go to fusion (outputs)."""
    inputs = traced_nodes(results)
    kept = inputs if depth is None else inputs[:depth]
    dropped = [_dropped(n, DropReason.NOT_IN_TOP_K, f"leg rank {n['rank']} > candidate_top_k {depth}") for n in inputs[len(kept):]]
    return _record(Stage.RETRIEVAL_LEG, name, component, query_str, latency_ms, inputs=inputs, outputs=kept, dropped=dropped,
                   attributes={"candidate_top_k": depth})


def fusion_record(
    component: str,
    query_str: Optional[str],
    legs: Mapping[str, Sequence[TracedNode]],
    fused: Sequence[NodeWithScore],
    latency_ms: float,
    attributes: Dict[str, Any],
) -> StageTrace:
    """Fusion: the union of the legs' candidates (with each leg's rank and score) in, the fused top-k out."""
    outputs = traced_nodes(fused)
    return _record(Stage.FUSION, "fusion", component, query_str, latency_ms, outputs=outputs,
                   **_fusion_fields(legs, outputs, attributes), attributes=attributes)


def _fusion_fields(legs: Mapping[str, Sequence[TracedNode]], outputs: Sequence[TracedNode], attributes: Mapping[str, Any]) -> Dict[str, Any]:
    """Fusion's ``inputs`` (merged leg candidates, ranked by best leg rank) and ``dropped`` (those not in ``outputs``)."""
    merged: Dict[str, TracedNode] = {}
    for leg, nodes in legs.items():
        for n in nodes:
            entry = merged.get(n["node_id"])
            if entry is None:
                entry = merged[n["node_id"]] = {"node_id": n["node_id"], "rank": 0, "score": None, "leg_ranks": {}, "leg_scores": {}}
            entry["leg_ranks"][leg] = n["rank"]
            entry["leg_scores"][leg] = n["score"]
    inputs = sorted(merged.values(), key=lambda n: (min(n["leg_ranks"].values()), n["node_id"]))
    for i, n in enumerate(inputs, 1):
        n["rank"] = i
    kept = {n["node_id"] for n in outputs}
    detail = f"fused rank > similarity_top_k {attributes.get('similarity_top_k')}"
    dropped = [_dropped(n, DropReason.NOT_IN_TOP_K, detail) for n in inputs if n["node_id"] not in kept]
    return {"inputs": inputs, "dropped": dropped}


def _emit_lazy_fusion(component: str, query_str: Optional[str], leg_records: Mapping[str, StageTrace], candidates: int,
                      fused: Sequence[NodeWithScore], latency_ms: float, attributes: Dict[str, Any]) -> None:
    """Emit fusion's record with ``inputs`` / ``dropped`` built on first read (``candidates``: distinct leg candidates)."""
    outputs = traced_nodes(fused)  # the results are the caller's (mutable): copied now

    def build() -> Dict[str, Any]:
        return _fusion_fields({name: record.outputs for name, record in leg_records.items()}, outputs, attributes)

    record = _lazy_record(Stage.FUSION, "fusion", component, query_str, latency_ms, build, outputs=outputs, attributes=attributes)
    emit(record, n_dropped=max(0, candidates - len(outputs)))


def array_leg_nodes(nodes: Sequence[Any], positions: Sequence[int], scores: Sequence[float]) -> List[TracedNode]:
    """Traced nodes of an array leg (positions into ``nodes``, scores best first)."""
    return [{"node_id": nodes[p].node_id, "rank": i, "score": s} for i, (p, s) in enumerate(zip(positions, scores), 1)]


# ------------------------------------------------------------------------------ stage hooks (called only when enabled)
def trace_index_fusion(
    retriever: Any, query: Any, nodes: Sequence[Any], legs: Mapping[str, Tuple[Any, Any]], fused: Sequence[NodeWithScore], laps: Laps
) -> None:
    """Emit the leg and fusion records of a ``FusedIndexRetriever`` query (legs as position/score arrays)."""
    query_str = _query_text(query)
    component = type(retriever).__name__
    records: Dict[str, StageTrace] = {}
    seen: set = set()
    for name, (positions, scores) in legs.items():
        positions, scores = positions.tolist(), scores.tolist()  # copies: the per-node entries are built on first read
        seen.update(positions)
        ms = laps.ms.get(name, 0.0) + (laps.ms.get("embed", 0.0) if name == "dense" else 0.0)
        build = (lambda p=positions, s=scores: {"outputs": array_leg_nodes(nodes, p, s)})
        records[name] = record = _lazy_record(Stage.RETRIEVAL_LEG, name, component, query_str, ms, build, inputs=[], dropped=[],
                                              attributes={"candidate_top_k": retriever._depth})
        emit(record, n_dropped=0)
    attributes = {"mode": retriever._mode, "similarity_top_k": retriever.similarity_top_k, "weights": list(retriever._weights)}
    if retriever._mode == "rrf":
        attributes["rrf_k"] = retriever._rrf_k
    _emit_lazy_fusion(component, query_str, records, len(seen), fused, laps.ms.get("fusion", 0.0), attributes)


def trace_hybrid(
    retriever: Any, query: Any, leg_results: Sequence[Sequence[NodeWithScore]], leg_ms: Sequence[float],
    fused: Sequence[NodeWithScore], fusion_ms: float,
) -> None:
    """Emit the leg and fusion records of a ``HybridRetriever`` query."""
    query_str = _query_text(query)
    component = type(retriever).__name__
    records: Dict[str, StageTrace] = {}
    seen: set = set()
    for name, results, depth, ms in zip(retriever.names, leg_results, retriever._depths, leg_ms):
        records[name] = record = leg_record(name, component, query_str, results, depth, ms)
        seen.update(n["node_id"] for n in record.outputs)
        emit(record)
    attributes = {"mode": retriever._mode, "similarity_top_k": retriever._similarity_top_k, "weights": list(retriever._weights)}
    if retriever._mode == "rrf":
        attributes["rrf_k"] = retriever._rrf_k
    _emit_lazy_fusion(component, query_str, records, len(seen), fused, fusion_ms, attributes)


def timed(fn: Callable[[Any], Any], arg: Any) -> Tuple[Any, float]:
    """``(fn(arg), milliseconds)``."""
    started = time.perf_counter()
    return fn(arg), elapsed_ms(started)


async def atimed(awaitable: Any) -> Tuple[Any, float]:
    """``(await awaitable, milliseconds)``."""
    started = time.perf_counter()
    return await awaitable, elapsed_ms(started)


def gate_record(gate: Any, nodes: Sequence[NodeWithScore], kept: Sequence[NodeWithScore], query: Any, latency_ms: float) -> StageTrace:
    """The no-answer gate: closed -> every input dropped below threshold (or below the cutoff)."""
    inputs = traced_nodes(nodes)
    outputs = traced_nodes(kept)
    conf = gate._last_confidence if gate.is_fitted else None
    closed = bool(nodes) and not kept
    cutoff = gate.similarity_cutoff
    kept_ids = {n["node_id"] for n in outputs}
    dropped = []
    for n in inputs:
        if n["node_id"] in kept_ids:
            continue
        if cutoff is not None and (n["score"] is None or n["score"] < cutoff):
            dropped.append(_dropped(n, DropReason.BELOW_CUTOFF, f"score {n['score']} < similarity_cutoff {cutoff}"))
        else:
            dropped.append(_dropped(n, DropReason.BELOW_THRESHOLD, f"confidence {conf:.4f} < threshold {gate.threshold:.4f}"
                                    if conf is not None else "gate closed"))
    return _record(Stage.NO_ANSWER_GATE, "no_answer", type(gate).__name__, _query_text(query), latency_ms, inputs=inputs,
                   outputs=outputs, dropped=dropped, confidence=conf, threshold=gate.threshold if gate.is_fitted else None,
                   attributes={"closed": closed, "similarity_cutoff": cutoff})


def trace_gate(gate: Any, nodes: Sequence[NodeWithScore], kept: Sequence[NodeWithScore], query: Any, started: float) -> None:
    """Emit the no-answer gate's record."""
    emit(gate_record(gate, nodes, kept, query, elapsed_ms(started)))


def rerank_record(reranker: Any, query: Any, nodes: Sequence[NodeWithScore], results: Sequence[NodeWithScore], latency_ms: float) -> StageTrace:
    """The reranker: inputs beyond ``max_candidates``, unscored (latency budget) or below ``top_n`` are dropped."""
    stats = reranker.last_stats
    inputs = traced_nodes(nodes)
    outputs = traced_nodes(results)
    kept = {n["node_id"] for n in outputs}
    capped = stats.capped_to if stats is not None else len(inputs)
    scored = stats.scored if stats is not None else len(inputs)
    dropped = []
    for n in inputs:
        if n["node_id"] in kept:
            continue
        if n["rank"] > capped:
            dropped.append(_dropped(n, DropReason.OVER_MAX_CANDIDATES, f"input rank {n['rank']} > max_candidates {capped}"))
        elif n["rank"] > scored:
            dropped.append(_dropped(n, DropReason.NOT_SCORED, f"latency budget {reranker.latency_budget_ms} ms: scored {scored}"))
        else:
            dropped.append(_dropped(n, DropReason.NOT_IN_TOP_K, f"reranked below top_n {reranker.top_n}"))
    attributes: Dict[str, Any] = {"model": reranker.model, "top_n": reranker.top_n}
    if stats is not None:
        attributes.update(scoring_ms=stats.scoring_ms, scored=stats.scored, per_pair_ms=stats.per_pair_ms)
    return _record(Stage.RERANK, "rerank", type(reranker).__name__, _query_text(query), latency_ms, inputs=inputs,
                   outputs=outputs, dropped=dropped, attributes=attributes)


def trace_rerank(reranker: Any, query: Any, nodes: Sequence[NodeWithScore], results: Sequence[NodeWithScore], started: float) -> None:
    """Emit the reranker's record."""
    emit(rerank_record(reranker, query, nodes, results, elapsed_ms(started)))


def assembly_record(assembler: Any, query: Any, nodes: Sequence[NodeWithScore], out: Sequence[NodeWithScore], report: Any,
                    latency_ms: float) -> StageTrace:
    """Context assembly: outputs are the assembled nodes (with the input ids each holds), drops from its report."""
    inputs = traced_nodes(nodes)
    by_id = {n["node_id"]: n for n in inputs}
    outputs = traced_nodes(out)
    for node, result in zip(outputs, out):
        node["source_ids"] = list((result.node.metadata or {}).get("source_node_ids") or [])
    dropped = []
    for left in report.left_out:
        n = by_id.get(left.node_id) or {"node_id": left.node_id, "rank": None, "score": None}
        if left.reason.startswith("duplicate of "):
            of = left.reason[len("duplicate of "):]
            dropped.append(_dropped(n, DropReason.DUPLICATE, left.reason, duplicate_of=of))
        else:
            dropped.append(_dropped(n, DropReason.OVER_BUDGET, f"budget {report.max_tokens} tokens"))
    return _record(Stage.ASSEMBLY, "context", type(assembler).__name__, _query_text(query), latency_ms, inputs=inputs,
                   outputs=outputs, dropped=dropped, context_tokens=report.used_tokens, max_tokens=report.max_tokens,
                   attributes={"order": getattr(assembler.order, "value", str(assembler.order)), "spans": report.spans,
                               "truncated": list(report.truncated)})


def trace_assembly(assembler: Any, query: Any, nodes: Sequence[NodeWithScore], out: Sequence[NodeWithScore], report: Any,
                   started: float) -> None:
    """Emit the context assembler's record."""
    emit(assembly_record(assembler, query, nodes, out, report, elapsed_ms(started)))


# ------------------------------------------------------------------------------ responses
def attach_trace(response: Any, trace: Union[QueryTrace, Mapping[str, Any]]) -> Any:
    """Put ``trace`` (as a JSON-ready dict) in ``response.metadata["trace"]``; returns the response."""
    data = trace.to_dict() if isinstance(trace, QueryTrace) else dict(trace)
    response.metadata = {**(getattr(response, "metadata", None) or {}), "trace": data}
    return response


# ------------------------------------------------------------------------------ collecting
class _Open:
    """A trace being collected in one context, and the one it interrupted."""

    __slots__ = ("trace", "owner", "started", "previous")

    def __init__(self, trace: QueryTrace, owner: Optional[str], previous: Optional["_Open"]) -> None:
        self.trace, self.owner, self.previous = trace, owner, previous
        self.started = time.perf_counter()


def _new_trace(query_str: Optional[str], span_id: Optional[str]) -> QueryTrace:
    """An empty :class:`QueryTrace`, unvalidated."""
    return _construct(QueryTrace, {"trace_id": uuid.uuid4().hex, "query_str": query_str, "started_at": datetime.now(),
                                   "latency_ms": None, "stages": [], "span_id": span_id})


class TraceCollector(BaseEventHandler):
    """Groups :class:`StageTraceEvent` records into one :class:`QueryTrace` per query.

    A trace opens at ``QueryStartEvent`` (or at the outermost ``RetrievalStartEvent`` when a
    retriever is called on its own) and closes at the matching end event; stage records outside
    any query become one-stage traces. Open traces live in a context variable, so concurrent
    queries (threads, asyncio tasks) do not mix. Use :meth:`install` / :meth:`uninstall`, or
    ``with collector:``.
    """

    attach: bool = Field(default=True, description="Attach each query's trace to its response (metadata['trace']).")
    keep: bool = Field(default=True, description="Keep finished traces in `traces`.")
    max_traces: int = Field(default=1000, ge=1, description="Most finished traces kept (oldest dropped first).")

    _current: Any = PrivateAttr(default=None)
    _traces: List[QueryTrace] = PrivateAttr(default_factory=list)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        self._current = contextvars.ContextVar(f"rkit_trace_{id(self)}", default=None)

    @classmethod
    def class_name(cls) -> str:
        return "TraceCollector"

    @property
    def traces(self) -> List[QueryTrace]:
        """Finished traces, oldest first (a copy)."""
        with self._lock:
            return list(self._traces)

    @property
    def last(self) -> Optional[QueryTrace]:
        """The most recent finished trace."""
        with self._lock:
            return self._traces[-1] if self._traces else None

    def clear(self) -> None:
        """Forget the finished traces."""
        with self._lock:
            self._traces.clear()

    # -- installation
    def install(self) -> "TraceCollector":
        """Add this handler to the root dispatcher (once)."""
        root = get_dispatcher()
        if not any(h is self for h in root.event_handlers):
            root.add_event_handler(self)
        return self

    def uninstall(self) -> None:
        """Remove this handler from the root dispatcher."""
        root = get_dispatcher()
        root.event_handlers = [h for h in root.event_handlers if h is not self]

    def __enter__(self) -> "TraceCollector":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    # -- events
    def handle(self, event: BaseEvent, **kwargs: Any) -> Any:
        cls = type(event)
        if cls is StageTraceEvent or isinstance(event, StageTraceEvent):
            self._add(event.__dict__["trace"])
        elif cls is NodesDroppedEvent:
            return None
        elif isinstance(event, QueryStartEvent):
            self._begin(_query_text(event.query), event.span_id, owner=None)
        elif isinstance(event, QueryEndEvent):
            self._end(event.span_id, event.response, query_end=True)
        elif isinstance(event, RetrievalStartEvent) and self.__pydantic_private__["_current"].get() is None:
            self._begin(_query_text(event.str_or_query_bundle), event.span_id, owner=event.span_id)
        elif isinstance(event, RetrievalEndEvent):
            self._end(event.span_id, None, query_end=False)

    def _begin(self, query_str: Optional[str], span_id: Optional[str], owner: Optional[str]) -> None:
        current = self.__pydantic_private__["_current"]  # not self._current: pydantic's __getattr__ on every event
        current.set(_Open(_new_trace(query_str, span_id), owner, current.get()))

    def _add(self, record: StageTrace) -> None:
        open_ = self.__pydantic_private__["_current"].get()
        if open_ is None:  # a stage run outside a query: a trace of its own
            values = record.__dict__
            trace = _new_trace(values["query_str"], values["span_id"])
            trace.__dict__.update(stages=[record], latency_ms=values["latency_ms"])
            self._finish(trace)
        else:
            open_.trace.stages.append(record)

    def _end(self, span_id: Optional[str], response: Any, query_end: bool) -> None:
        current = self.__pydantic_private__["_current"]
        open_ = current.get()
        if open_ is None or (open_.owner is None) != query_end or (not query_end and open_.owner != span_id):
            return
        current.set(open_.previous)
        open_.trace.latency_ms = elapsed_ms(open_.started)
        if self.attach and response is not None and hasattr(response, "metadata"):
            attach_trace(response, open_.trace)
        self._finish(open_.trace)

    def _finish(self, trace: QueryTrace) -> None:
        if self.keep:
            private = self.__pydantic_private__
            traces = private["_traces"]
            with private["_lock"]:
                traces.append(trace)
                if len(traces) > self.max_traces:
                    del traces[: len(traces) - self.max_traces]
        try:
            self.on_trace(trace)
        except Exception:  # the dispatcher would swallow it silently
            logger.exception("trace handler %s failed for query %r", type(self).__name__, trace.query_str)

    def on_trace(self, trace: QueryTrace) -> None:
        """Called with each finished trace (override to export it)."""


class JsonlTraceWriter(TraceCollector):
    """A :class:`TraceCollector` that appends each finished trace to ``path`` as one JSON line."""

    path: str = Field(description="JSON-lines file the traces are appended to.")
    keep: bool = Field(default=False, description="Also keep finished traces in `traces`.")

    _write_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "JsonlTraceWriter"

    def on_trace(self, trace: QueryTrace) -> None:
        line = trace.to_json() + "\n"
        with self._write_lock:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)


@contextlib.contextmanager
def collect_traces(**options: Any) -> Iterator[TraceCollector]:
    """``with collect_traces() as collector:`` traces every query run inside (``collector.traces``, ``.last``)."""
    collector = TraceCollector(**options)
    with collector:
        yield collector


# ------------------------------------------------------------------------------ rendering
def _fmt_score(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def _legs(node: TracedNode) -> str:
    parts = [f"{leg}#{rank}" for leg, rank in sorted(node.get("leg_ranks", {}).items())]
    if "pre_rerank_rank" in node:
        parts.append(f"pre#{node['pre_rerank_rank']}")
    if node.get("source_ids"):
        parts.append("from " + ",".join(i[:8] for i in node["source_ids"]))
    return " ".join(parts)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> List[str]:
    rows = [list(r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _stage_header(s: StageTrace) -> str:
    bits = [f"{s.name} ({s.stage.value}, {s.component})", f"{s.latency_ms:.2f} ms",
            f"in {len(s.inputs)}", f"out {len(s.outputs)}", f"dropped {len(s.dropped)}"]
    if s.confidence is not None:
        bits.append(f"confidence {s.confidence:.3f} / threshold {s.threshold:.3f}")
    if s.context_tokens is not None:
        bits.append(f"tokens {s.context_tokens}/{s.max_tokens}")
    return "== " + " | ".join(bits)


def format_trace(trace: Union[QueryTrace, Mapping[str, Any], str], max_rows: int = 10) -> str:
    """A readable rendering: a summary, then per stage a table of its outputs and its dropped nodes."""
    if isinstance(trace, str):
        trace = QueryTrace.from_json(trace)
    elif not isinstance(trace, QueryTrace):
        trace = QueryTrace.model_validate(dict(trace))
    total = f"{trace.latency_ms:.1f} ms" if trace.latency_ms is not None else "n/a"
    lines = [f"trace {trace.trace_id} | query {trace.query_str!r} | total {total} | context tokens {trace.context_tokens}"]
    for s in trace.stages:
        lines += ["", _stage_header(s)]
        rows = [("out", str(n["rank"]), n["node_id"], _fmt_score(n["score"]), _legs(n)) for n in s.outputs[:max_rows]]
        rows += [("drop", "" if d["rank"] is None else str(d["rank"]), d["node_id"], _fmt_score(d["score"]),
                  DropReason(d["reason"]).value + (f": {d['detail']}" if d.get("detail") else "")) for d in s.dropped[:max_rows]]
        if rows:
            lines += _table(("", "rank", "node id", "score", "legs / reason"), rows)
        more_out, more_drop = max(0, len(s.outputs) - max_rows), max(0, len(s.dropped) - max_rows)
        if more_out or more_drop:
            lines.append(f"... {more_out} more outputs, {more_drop} more dropped")
    return "\n".join(lines)
