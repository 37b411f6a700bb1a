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
package's no-answer response handler do not count as listeners. When a handler listens, a stage
keeps a snapshot of its nodes (ids and scores, taken when it ran; a retrieval leg keeps its
result arrays) and its record builds the per-node ``inputs`` / ``outputs`` / ``dropped`` entries
only when they are first read. When the only listeners are plain :class:`TraceCollector` s
(``handle`` not overridden, e.g. :class:`JsonlTraceWriter`) the stages hand them each stage as one
flat tuple (a ``Spec``: the record's fields, its snapshot and the function that builds its node
lists) and build no event and no record (nobody else could see one): the trace's JSON form is
written from those tuples, and its :class:`StageTrace` records are made when ``trace.stages`` is
first read. Any other handler on the chain (an ordinary or OpenInference-style handler) gets every
:class:`StageTraceEvent` and :class:`NodesDroppedEvent` through ``dispatcher.event``. A collector
makes the one-stage trace of a stage run outside any query when it is read. A retrieval leg's ids
are read from the index snapshot's id tuple (``BM25Snapshot.node_ids``): one look-up per id when
the trace is written.

JSON form (``response.metadata["trace"]``, the JSON lines, ``rkit query --json --trace``):
:meth:`QueryTrace.to_dict`, a columnar layout marked ``"format": 2``: per stage and node list a
dict of equal-length columns (``node_id``, ``score``, ...), sliced from the snapshots with no
per-node dict; fusion's merged candidates are rebuilt from its legs' outputs on reading.
:meth:`QueryTrace.from_dict` / :func:`read_traces` read it and the row layout of
``model_dump(mode="json")`` (format 1). JSON text comes from ``orjson`` when it is importable,
else from the standard library's ``json``. The JSON-lines writer writes in batches on a
background thread (:meth:`JsonlTraceWriter.flush`). A kept trace holds few objects (no reference
to the nodes), which keeps garbage collection and its eviction cheap.
``benchmarks/tracing_overhead.py`` measures the cost.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import logging
import operator
import os
import threading
import time
import uuid
import weakref
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SerializerFunctionWrapHandler, model_serializer
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent, RetrievalStartEvent
from llama_index.core.instrumentation.events.span import SpanDropEvent
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.schema import NodeWithScore, QueryBundle
from typing_extensions import Annotated, NotRequired, TypedDict

from ._models import assemble

try:  # not a declared dependency (several packages bring it): the standard library's json without it
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment (tests run both)
    _orjson = None

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
    "TRACE_FORMAT",
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


_DUPLICATE_VALUE, _OVER_BUDGET_VALUE = DropReason.DUPLICATE._value_, DropReason.OVER_BUDGET._value_
_DUPLICATE_OF = "duplicate of "  # how the assembler's report words a duplicate: "duplicate of <node id>"


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
_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}
_ALL_FIELDS_SET: Dict[type, set] = {}


def _field_names(cls: Any) -> Tuple[str, ...]:
    """The model's field names in declaration order (cached)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(cls.model_fields)
    return names


def _construct(cls: Any, values: Dict[str, Any], private: Optional[Dict[str, Any]] = None) -> Any:
    """``cls.model_construct(**values)`` without its per-field default handling (every field is given, or lazy).

    Every field counts as set, so the objects of a class share one fields-set: pydantic only ever
    adds a field name to it (an assignment), which changes nothing, and copies it for a copy. One
    set less per record, event and trace: fewer objects for the garbage collector to scan.
    """
    fields_set = _ALL_FIELDS_SET.get(cls)
    if fields_set is None:
        fields_set = _ALL_FIELDS_SET[cls] = set(_field_names(cls))
    return assemble(cls, values, fields_set, private=private)


class _BuiltOnRead:
    """For a pydantic model with fields made when first read (not in ``__dict__`` until then):
    everything of pydantic's that reads ``__dict__`` makes them first. ``_materialize`` makes all
    of them (serialisation); ``_made_for_copy`` what a copy, comparison or ``repr`` needs (by
    default the same). A model also needs a wrap ``model_serializer`` calling ``_materialize``, for
    serialisation as a nested value (pydantic collects those from model classes only)."""

    __slots__ = ()

    def _materialize(self) -> Any:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def _made_for_copy(self) -> Any:
        return self._materialize()

    def model_dump(self, **kwargs: Any) -> Dict[str, Any]:
        return super(_BuiltOnRead, self._materialize()).model_dump(**kwargs)  # type: ignore[misc]

    def model_dump_json(self, **kwargs: Any) -> str:
        return super(_BuiltOnRead, self._materialize()).model_dump_json(**kwargs)  # type: ignore[misc]

    def model_copy(self, **kwargs: Any) -> Any:
        return super(_BuiltOnRead, self._made_for_copy()).model_copy(**kwargs)  # type: ignore[misc]

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, _BuiltOnRead):
            other._made_for_copy()
        return super(_BuiltOnRead, self._made_for_copy()).__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __iter__(self) -> Any:
        return super(_BuiltOnRead, self._made_for_copy()).__iter__()  # type: ignore[misc]

    def __repr_args__(self) -> Any:
        return super(_BuiltOnRead, self._made_for_copy()).__repr_args__()  # type: ignore[misc]

    def __getstate__(self) -> Dict[Any, Any]:
        return super(_BuiltOnRead, self._made_for_copy()).__getstate__()  # type: ignore[misc]

    def __copy__(self) -> Any:
        return super(_BuiltOnRead, self._made_for_copy()).__copy__()  # type: ignore[misc]

    def __deepcopy__(self, memo: Any = None) -> Any:
        return super(_BuiltOnRead, self._made_for_copy()).__deepcopy__(memo)  # type: ignore[misc]


class StageTrace(_BuiltOnRead, BaseModel):
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

    # ``(build, *args)``: ``build(*args)`` makes ``inputs`` / ``outputs`` / ``dropped`` on first read (see
    # :func:`_spec`); the hot path keeps only a snapshot of plain values.
    _lazy: Optional[Tuple[Any, ...]] = PrivateAttr(default=None)

    def __getattr__(self, name: str) -> Any:
        if name in _LAZY_FIELDS:  # only reached while the field is not built yet (not in __dict__)
            self._materialize()
            return self.__dict__[name]
        return super().__getattr__(name)

    def _materialize(self) -> "StageTrace":
        private = self.__pydantic_private__
        if private and private.get("_lazy") is not None:
            with _MATERIALIZE_LOCK:
                lazy = private.get("_lazy")
                if lazy is not None:
                    built, given = _rows_of_built(lazy[0](*lazy[1:])), self.__dict__
                    values = {k: given[k] if k in given else built.get(k, []) for k in _field_names(StageTrace)}
                    # declaration order, as a validated record has it (the JSON keys follow the dict)
                    object.__setattr__(self, "__dict__", values)
                    private["_lazy"] = None
        return self

    @model_serializer(mode="wrap")
    def serialize_built(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Every pydantic serialisation (also of a record nested in an event or another model)
        builds the node lists first: pydantic reads the fields from ``__dict__``."""
        return handler(self._materialize())

    def unaccounted_ids(self) -> List[str]:
        """Input ids neither returned (directly or inside an assembled node) nor dropped: empty for a complete record."""
        covered = {n["node_id"] for n in self.outputs} | {d["node_id"] for d in self.dropped}
        for n in self.outputs:
            covered.update(n.get("source_ids", ()))
        return [n["node_id"] for n in self.inputs if n["node_id"] not in covered]


_STAGE_FIELDS_SET = _ALL_FIELDS_SET.setdefault(StageTrace, set(_field_names(StageTrace)))

#: A stage record not made yet, as a stage hands it to plain collectors: the record's fields in
#: :data:`_SPEC_FIELDS` order, then ``build`` and its arguments (``build(*args)``: the record's
#: ``inputs`` / ``outputs`` / ``dropped`` in the JSON form, see :func:`_spec`). One flat tuple: one
#: object per stage for the garbage collector, and no model unless the record is read.
Spec = Tuple[Any, ...]
_SPEC_FIELDS = ("stage", "name", "component", "query_str", "latency_ms", "confidence", "threshold", "context_tokens",
                "max_tokens", "attributes", "span_id")
_SPEC_NAME, _SPEC_QUERY, _SPEC_LATENCY, _SPEC_SPAN, _SPEC_BUILD = 1, 3, 4, 10, len(_SPEC_FIELDS)


class QueryTrace(_BuiltOnRead, BaseModel):
    """The stage records of one query, in the order the stages ran."""

    trace_id: str = Field(default_factory=lambda: _IDS.hex(), description="Unique id of this trace (UUID-4 form, 32 hex digits).")
    query_str: Optional[str] = Field(default=None, description="The query text.")
    started_at: datetime = Field(default_factory=datetime.now, description="When the query started.")
    latency_ms: Optional[float] = Field(default=None, description="Query wall time (QueryStart to QueryEnd).")
    stages: List[StageTrace] = Field(default_factory=list, description="Stage records in run order.")
    span_id: Optional[str] = Field(default=None, description="Span of the query (or retrieval) that opened the trace.")

    # A collected trace's stages as the stages handed them on (:data:`Spec` tuples, or records), made
    # into ``stages`` on first read; None once made (and for a trace built or validated as usual).
    _pending: Optional[List[Any]] = PrivateAttr(default=None)

    def __getattr__(self, name: str) -> Any:
        if name == "stages":  # only reached while the stages are pending (not in __dict__)
            self._materialize_stages()
            return self.__dict__["stages"]
        return super().__getattr__(name)

    def _materialize_stages(self) -> "QueryTrace":
        private = self.__pydantic_private__
        if private and private.get("_pending") is not None:
            with _MATERIALIZE_LOCK:
                pending = private.get("_pending")
                if pending is not None:
                    given, stages = self.__dict__, _records_of(pending)
                    # declaration order, as a validated trace has it (the JSON keys follow the dict)
                    object.__setattr__(self, "__dict__", {k: given[k] if k in given else stages for k in _field_names(QueryTrace)})
                    private["_pending"] = None
        return self

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
        for record in self._materialize_stages().__dict__["stages"]:
            record._materialize()
        return self

    @model_serializer(mode="wrap")
    def serialize_built(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Every pydantic serialisation (also of a trace nested in another model) makes the stage
        records and their node lists first: pydantic reads the fields from ``__dict__``."""
        return handler(self._materialize())

    def _made_for_copy(self) -> "QueryTrace":
        return self._materialize_stages()  # the records make their own node lists when they are read

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict in the columnar layout (``"format": 2``, see :data:`TRACE_FORMAT`).

        Each stage's ``inputs`` / ``outputs`` / ``dropped`` is ``[]`` or a dict of equal-length
        columns (``node_id``, ``score``, ...; a node's rank is its position + 1; dropped nodes add
        ``reason`` and ``rank``); fusion's merged candidates and drops are ``{"merged_from": [leg
        names]}``, rebuilt from those legs' outputs on reading. Built from the stages' snapshots
        without a per-node dict. :meth:`from_dict` reads it back; ``model_dump(mode="json")`` is
        the row layout (format 1: a dict per node), which :meth:`from_dict` reads too.
        """
        private = self.__pydantic_private__
        entries = private.get("_pending") if private else None  # pending stages are written as they are
        values = self.__dict__
        if entries is None:
            entries = self.stages
        started_at = values["started_at"]
        return {
            "format": TRACE_FORMAT,
            "trace_id": values["trace_id"],
            "query_str": values["query_str"],
            "started_at": started_at.isoformat() if isinstance(started_at, datetime) else started_at,
            "latency_ms": _score(values["latency_ms"]),
            "stages": [_stage_dict(entry, entries, i) for i, entry in enumerate(entries)],
            "span_id": values["span_id"],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as one JSON line (no newline inside; ``orjson`` when importable, else ``json``)."""
        return dumps_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QueryTrace":
        """The trace of a :meth:`to_dict` (format 2, columns) or of a ``model_dump(mode="json")`` (format 1, rows)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a trace is a mapping (QueryTrace.to_dict()), got {type(data).__name__}")
        version = data.get("format", 1)
        if version == 1:
            return cls.model_validate(data)
        if version != TRACE_FORMAT:
            raise ValueError(f"unknown trace format {version!r}; readable formats: 1 (rows), {TRACE_FORMAT} (columns)")
        stages = data.get("stages") or []
        if not isinstance(stages, list):
            raise ValueError(f"trace {data.get('trace_id')!r}: 'stages' must be a list, got {type(stages).__name__}")
        values = {k: v for k, v in data.items() if k != "format"}
        values["stages"] = rows = []
        for i, stage in enumerate(stages):
            rows.append(_stage_rows(stage, rows, f"trace {data.get('trace_id')!r} stage {i}"))
        return cls.model_validate(values)

    @classmethod
    def from_json(cls, line: Union[str, bytes]) -> "QueryTrace":
        """The trace of a JSON line (:meth:`to_json`, or the row layout of ``model_dump_json()``)."""
        return cls.from_dict(loads_json(line))


def read_traces(path: Union[str, Path], skip_bad_lines: bool = False) -> List[QueryTrace]:
    """Every trace of a JSON-lines file written by :class:`JsonlTraceWriter` (either layout, see
    :meth:`QueryTrace.from_dict`). A line that is not a trace is a ValueError naming its number,
    or, with ``skip_bad_lines=True``, skipped with a warning counting them (e.g. a line cut by a
    crash of a process writing the file)."""
    traces, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                traces.append(QueryTrace.from_json(line))
            except ValueError as exc:
                if not skip_bad_lines:
                    raise ValueError(f"{path}: line {number} is not a trace ({exc}); read_traces(..., skip_bad_lines=True) skips such lines") from None
                bad.append(number)
    if bad:
        logger.warning("%s: skipped %d line(s) that are not traces (first: line %d)", path, len(bad), bad[0])
    return traces


def append_lines(path: Union[str, Path], data: bytes) -> None:
    """Append ``data`` (whole lines) to ``path`` so that the file only ever grows by whole lines:
    a file that does not end with a newline (a line cut by a crash, or a file of someone else's)
    gets one first, and a write that fails part-way (a full disk) is cut back to the file's
    earlier size, so a retry cannot leave a torn line behind."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        if start > 0:
            with open(path, "rb") as tail:
                tail.seek(start - 1)
                if tail.read(1) != b"\n":
                    data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:  # pragma: no cover - cannot even be cut: read_traces(skip_bad_lines=True) skips the torn line
                logger.warning("%s: could not cut a failed append back to %d bytes", path, start)
            raise
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ JSON form
#: Version of the layout :meth:`QueryTrace.to_dict` writes (columns); 1 is the row layout of ``model_dump``.
TRACE_FORMAT = 2


def _json_default(value: Any) -> Any:
    """JSON form of what the encoders do not know: enums (their value), numpy values (``tolist``), datetimes."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps_json(data: Any) -> str:
    """``data`` as compact JSON text: ``orjson`` when importable (several times faster), else the standard library."""
    if _orjson is not None:
        return _orjson.dumps(data, default=_json_default).decode("utf-8")
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=_json_default)


def _dumps_utf8(data: Any) -> bytes:
    """:func:`dumps_json` as UTF-8 bytes (what ``orjson`` makes: no decoding for a file that stores them)."""
    if _orjson is not None:
        return _orjson.dumps(data, default=_json_default)
    return dumps_json(data).encode("utf-8")


def loads_json(text: Union[str, bytes]) -> Any:
    """Parse JSON text (``orjson`` when importable, else the standard library)."""
    return _orjson.loads(text) if _orjson is not None else json.loads(text)


def json_backend() -> str:
    """Which JSON library writes and reads traces here: ``"orjson"`` or ``"json"``."""
    return "orjson" if _orjson is not None else "json"


def _entry_name(entry: Union[Spec, StageTrace]) -> str:
    """The stage name of a :data:`Spec` or a record."""
    return entry[_SPEC_NAME] if type(entry) is tuple else entry.__dict__["name"]


def _entry_outputs(entry: Union[Spec, StageTrace]) -> List[TracedNode]:
    """The output rows of a :data:`Spec` (built, not kept) or a record."""
    if type(entry) is tuple:
        return _rows_of_columns(entry[_SPEC_BUILD](*entry[_SPEC_BUILD + 1:])[1], False, f"{entry[_SPEC_NAME]} outputs")
    return entry.outputs


def _preceding_legs(legs: Sequence[Any], entries: Sequence[Any], index: int) -> Optional[List[str]]:
    """The names of ``legs`` (:data:`Spec` s or records) when each is the last stage of its name before
    ``entries[index]`` (a reader finds it by name), else None."""
    names = [leg[_SPEC_NAME] if type(leg) is tuple else leg.__dict__["name"] for leg in legs]
    n = len(legs)
    if n <= index and all(map(operator.is_, entries[index - n:index], legs)) and len(set(names)) == n:
        return names  # the legs right before it, in order (as this package's retrievers emit them)
    for leg, name in zip(legs, names):
        for earlier in reversed(entries[:index]):
            if _entry_name(earlier) == name:
                if earlier is not leg:
                    return None
                break
        else:
            return None
    return names


def _merged_from(values: Mapping[str, Any], entries: Sequence[Any], index: int) -> Optional[List[str]]:
    """The legs a fusion record's built rows (``values``) derive from, as :func:`_fusion_fields` derives them, else None.

    For records not built lazily (read back, or already read): the same JSON form either way.
    """
    inputs = values["inputs"]
    names = {leg for n in inputs for leg in n.get("leg_ranks") or ()}
    legs: Dict[str, Any] = {}
    for earlier in entries[:index]:
        name = _entry_name(earlier)
        if name in names:
            legs.pop(name, None)
            legs[name] = earlier  # the last of each name, in run order
    if not names or len(legs) != len(names):
        return None
    derived = _fusion_fields({name: _entry_outputs(entry) for name, entry in legs.items()}, values["outputs"], values["attributes"])
    return list(legs) if derived == {"inputs": inputs, "dropped": values["dropped"]} else None


def _stage_dict(entry: Union[Spec, StageTrace], entries: Sequence[Any], index: int) -> Dict[str, Any]:
    """The JSON form (format 2) of ``entry`` (a :data:`Spec` or a record), ``entries[index]`` of its trace."""
    if type(entry) is tuple:
        header, built = entry, entry[_SPEC_BUILD](*entry[_SPEC_BUILD + 1:])
    else:
        private = entry.__pydantic_private__
        lazy = private.get("_lazy") if private else None  # read before __dict__: a record built meanwhile has its rows there
        values = entry.__dict__
        if lazy is None or "outputs" in values:
            return _built_stage_dict(values, entries, index)
        header, built = [values[k] for k in _SPEC_FIELDS], lazy[0](*lazy[1:])
    inputs, outputs, dropped = built  # the JSON parts: columns, [] or fusion's _Merged
    if type(inputs) is _Merged:  # fusion: its inputs and drops are its legs' outputs
        names = _preceding_legs(inputs.legs, entries, index)
        if names is not None:
            inputs, dropped = {"merged_from": names}, {"merged_from": names.copy()}
        else:  # the legs are not in this trace: written in full
            rows = _rows_of_built(built)
            inputs, dropped = _columns_of_rows(rows["inputs"], False), _columns_of_rows(rows["dropped"], True)
    if type(entry) is not tuple:  # a record: its values may have been set since
        return _stage_json(header, inputs, outputs, dropped)
    # a spec's values are JSON-ready as :func:`_spec` takes them (plain floats and ints), but for the stage's enum
    stage, name, component, query_str, latency_ms, confidence, threshold, context_tokens, max_tokens, attributes, span_id = \
        header[:_SPEC_BUILD]
    return {"stage": stage._value_, "name": name, "component": component, "query_str": query_str,
            "inputs": inputs, "outputs": outputs, "dropped": dropped, "latency_ms": latency_ms, "confidence": confidence,
            "threshold": threshold, "context_tokens": context_tokens, "max_tokens": max_tokens,
            "attributes": attributes.copy(), "span_id": span_id}


def _stage_json(header: Sequence[Any], inputs: Any, outputs: Any, dropped: Any) -> Dict[str, Any]:
    """A stage's JSON dict from its field values (``header``, in :data:`_SPEC_FIELDS` order) and its node parts, keys in declaration order."""
    stage, name, component, query_str, latency_ms, confidence, threshold, context_tokens, max_tokens, attributes, span_id = \
        header[:_SPEC_BUILD]
    return {"stage": stage._value_ if isinstance(stage, Enum) else stage, "name": name, "component": component,
            "query_str": query_str, "inputs": inputs, "outputs": outputs, "dropped": dropped,
            "latency_ms": latency_ms if type(latency_ms) is float else _score(latency_ms),
            "confidence": None if confidence is None else float(confidence),
            "threshold": None if threshold is None else float(threshold),
            "context_tokens": None if context_tokens is None else int(context_tokens),
            "max_tokens": None if max_tokens is None else int(max_tokens),
            "attributes": attributes.copy() if type(attributes) is dict else dict(attributes), "span_id": span_id}


def _built_stage_dict(values: Mapping[str, Any], entries: Sequence[Any], index: int) -> Dict[str, Any]:
    """:func:`_stage_dict` of a record whose rows are built (read back, validated, or already read)."""
    merged_from = _merged_from(values, entries, index) if values["stage"] == Stage.FUSION else None
    parts = [{"merged_from": list(merged_from)} if merged_from and key != "outputs" else _columns_of_rows(values[key], key == "dropped")
             for key in ("inputs", "outputs", "dropped")]
    return _stage_json([values[k] for k in _SPEC_FIELDS], *parts)


def _rows_of_built(built: Tuple[Any, Any, Any]) -> Dict[str, Any]:
    """The row form of a lazy record's ``build(*args)``: ``(inputs, outputs, dropped)``, each columns, ``[]`` or fusion's :class:`_Merged`."""
    inputs, outputs, dropped = built
    outputs = _rows_of_columns(outputs, False, "outputs")
    if isinstance(inputs, _Merged):
        legs = {_entry_name(leg): _entry_outputs(leg) for leg in inputs.legs}
        return {"outputs": outputs, **_fusion_fields(legs, outputs, inputs.attributes)}
    return {"inputs": _rows_of_columns(inputs, False, "inputs"), "outputs": outputs, "dropped": _rows_of_columns(dropped, True, "dropped")}


def _stage_rows(stage: Any, earlier: Sequence[Mapping[str, Any]], where: str) -> Dict[str, Any]:
    """A stage of format 2 in the row layout (``earlier``: the trace's stages before it, already in rows)."""
    if not isinstance(stage, Mapping):
        raise ValueError(f"{where}: a stage is a mapping, got {type(stage).__name__}")
    where = f"{where} ({stage.get('name')!r})"
    rows = dict(stage)
    rows["outputs"] = outputs = _rows_of_columns(stage.get("outputs", []), False, f"{where} outputs")
    merged = [key for key in ("inputs", "dropped") if isinstance(stage.get(key), Mapping) and "merged_from" in stage[key]]
    if merged:
        legs: Dict[str, Any] = {}
        for name in stage[merged[0]]["merged_from"]:
            found = [s for s in earlier if s.get("name") == name]
            if not found:
                raise ValueError(f"{where}: merged from leg {name!r}, which is not an earlier stage; stages: {[s.get('name') for s in earlier]}")
            legs[name] = found[-1]["outputs"]
        derived = _fusion_fields(legs, outputs, stage.get("attributes") or {})
        for key in merged:
            rows[key] = derived[key]
    for key in ("inputs", "dropped"):
        if key not in merged:
            rows[key] = _rows_of_columns(stage.get(key, []), key == "dropped", f"{where} {key}")
    return rows


# ------------------------------------------------------------------------------ events
class StageTraceEvent(BaseEvent):
    """A stage finished; ``trace`` says what it did."""

    trace: StageTrace = Field(description="The stage record.")

    @classmethod
    def class_name(cls) -> str:
        return "StageTraceEvent"


class NodesDroppedEvent(_BuiltOnRead, BaseEvent):
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

    @model_serializer(mode="wrap")
    def serialize_built(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Any pydantic serialisation builds ``dropped`` first (see :class:`_BuiltOnRead`)."""
        return handler(self._materialize())


class _Kind(int, Enum):
    """How a handler on the dispatcher chain takes part in tracing."""

    PASSIVE = 0  # LlamaIndex's default, this package's response filler: not a listener
    COLLECTOR = 1  # a TraceCollector whose ``handle`` is not overridden: takes stage records directly
    LISTENER = 2  # any other handler: sees the events


_KINDS: Dict[type, _Kind] = {}  # handler class -> its kind
_COLLECTOR = _Kind.COLLECTOR


def _kind(cls: type) -> _Kind:
    """The :class:`_Kind` of handlers of ``cls`` (cached per class)."""
    kind = _KINDS.get(cls)
    if kind is None:
        if cls.class_name() in PASSIVE_HANDLERS:  # type: ignore[attr-defined]
            kind = _Kind.PASSIVE
        elif issubclass(cls, TraceCollector) and cls.handle is TraceCollector.handle:  # type: ignore[attr-defined]
            kind = _Kind.COLLECTOR
        else:
            kind = _Kind.LISTENER
        _KINDS[cls] = kind
    return kind


def tracing_enabled() -> bool:
    """True when an event handler other than the passive defaults listens on this module's dispatcher chain."""
    receivers = _receivers()
    return receivers is None or bool(receivers)


def _receivers() -> Optional[List[Any]]:
    """The plain collectors listening, or None when another handler listens (then the events are dispatched)."""
    collectors: List[Any] = []
    d: Any = dispatcher
    kinds = _KINDS
    while True:
        for handler in d.event_handlers:
            kind = kinds.get(type(handler))
            if kind is None:
                kind = _kind(type(handler))
            if kind is _COLLECTOR:
                collectors.append(handler)
            elif kind:
                return None
        if not d.propagate or d.name == d.root_name:
            return collectors
        d = d.parent


class _Ids:
    """Unique ids in UUID-4 form, cheap: a random per-process prefix (from ``uuid4``) and a counter.

    ``uuid4()`` reads ``os.urandom`` (a system call) each time; a query emits several events. The
    prefix is drawn again in a forked child, so processes never share ids.
    """

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        p = uuid.uuid4().hex[:20]  # keeps the version (4) and variant digits of a UUID-4
        self._prefix, self._dashed = p, f"{p[:8]}-{p[8:12]}-{p[12:16]}-{p[16:20]}-"
        self._count = itertools.count()

    def hex(self) -> str:
        """32 hex digits (``uuid4().hex`` form)."""
        return f"{self._prefix}{next(self._count):012x}"

    def dashed(self) -> str:
        """``str(uuid4())`` form."""
        return f"{self._dashed}{next(self._count):012x}"


_IDS = _Ids()


def emit(record: StageTrace, n_dropped: Optional[int] = None) -> None:
    """Dispatch ``record`` as a :class:`StageTraceEvent`, plus a :class:`NodesDroppedEvent` when it dropped nodes.

    When the only listeners are plain :class:`TraceCollector` s (their ``handle`` not overridden), no
    event is built: each collector takes the record directly (what its ``handle`` would do with
    the event); any other handler on the chain gets both events through ``dispatcher.event``.
    ``n_dropped``: how many it dropped when the caller knows (0 skips the check; else the record's
    ``dropped`` is built to see). Both events are built unvalidated (every field given); the drop
    event's entries are the record's, built when first read.
    """
    _emit(record, n_dropped, _receivers(), active_span_id.get())


def _emit(record: StageTrace, n_dropped: Optional[int], collectors: Optional[List[Any]], span_id: Optional[str]) -> None:
    """:func:`emit` with the receivers (:func:`_receivers`) and the active span given (one look-up for several records)."""
    record.__dict__["span_id"] = span_id
    if collectors is not None:
        for collector in collectors:
            collector._add(record)
        return
    _dispatch(record, n_dropped, span_id)


def _emit_spec(spec: Spec, n_dropped: Optional[int], collectors: Optional[List[Any]]) -> Union[Spec, StageTrace]:
    """Hand a stage's :data:`Spec` on: to each plain collector as it is (and return it), or, when
    events are dispatched (``collectors`` None), as its record (made now, and returned): what a later
    record refers to it by (fusion's legs)."""
    if collectors is not None:
        for collector in collectors:
            open_ = collector.__pydantic_private__["_current"].get()
            if open_ is not None:  # what collector._add does, without the call: the common case
                open_.entries.append(spec)
            else:
                collector._add(spec)
        return spec
    record = _record_of_spec(spec)
    _dispatch(record, n_dropped, spec[_SPEC_SPAN])
    return record


def _dispatch(record: StageTrace, n_dropped: Optional[int], span_id: Optional[str]) -> None:
    """Send ``record`` through the dispatcher: a :class:`StageTraceEvent`, and a :class:`NodesDroppedEvent` when it dropped nodes."""
    event = _construct(StageTraceEvent, {"timestamp": datetime.now(), "id_": _IDS.dashed(), "span_id": span_id,
                                         "tags": {}, "trace": record})
    dispatcher.event(event)
    if n_dropped == 0 or (n_dropped is None and not record.dropped):
        return
    values = {"timestamp": event.timestamp, "id_": event.id_ + "-dropped", "span_id": span_id, "tags": {},
              "stage": record.stage, "name": record.name, "query_str": record.query_str}
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


def _enum_value(value: Any) -> Any:
    """An enum's value (read directly: ``Enum.value`` is a Python-level property), else ``str(value)``."""
    return value._value_ if isinstance(value, Enum) else str(value)


def _score(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _floats(values: Sequence[Any]) -> List[Optional[float]]:
    """``values`` as Python floats (None kept); one C-level pass when none is None."""
    try:
        return list(map(float, values))
    except TypeError:
        return [None if v is None else float(v) for v in values]


def _entry(rank: int, node_id: str, score: Any, leg_ranks: Any, leg_scores: Any, pre_rerank_rank: Any) -> TracedNode:
    """A :class:`TracedNode` (optional keys only when they apply)."""
    node: TracedNode = {"node_id": node_id, "rank": rank, "score": None if score is None else float(score)}
    if leg_ranks:
        node["leg_ranks"] = dict(leg_ranks)
        node["leg_scores"] = dict(leg_scores or {})
    if pre_rerank_rank is not None:
        node["pre_rerank_rank"] = pre_rerank_rank
    return node


def traced_node(result: NodeWithScore, rank: int) -> TracedNode:
    """The :class:`TracedNode` of a result at ``rank`` (reads fusion and rerank attributes when present)."""
    fields = result.__dict__  # not getattr: a missing attribute costs a pydantic AttributeError (microseconds)
    return _entry(rank, result.node.node_id, result.score, fields.get("leg_ranks"), fields.get("leg_scores"),
                  fields.get("pre_rerank_rank"))


def traced_nodes(results: Sequence[NodeWithScore]) -> List[TracedNode]:
    """:func:`traced_node` of each result, ranks from 1."""
    return [traced_node(r, i) for i, r in enumerate(results, 1)]


#: What a stage keeps of its nodes when it runs: for each result in order, ``node id, score, leg
#: ranks, leg scores, pre-rerank rank`` (:data:`_SNAPSHOT_WIDTH` values), in one flat tuple. Plain
#: values: no reference to the results (they are freed with the query), and one object whatever
#: the number of nodes, for the garbage collector to scan and for the trace's eviction to free.
Snapshot = Tuple[Any, ...]
_SNAPSHOT_WIDTH = 5
_chain = itertools.chain.from_iterable


def snapshot(results: Sequence[NodeWithScore]) -> Snapshot:
    """The results' ids, scores and fusion / rerank attributes as they are now (later stages may rescore in place).

    The node columns (:func:`snapshot_columns`) and per-node entries (:func:`from_snapshot`) are
    built from it only when a record is read or written. The leg rank and score mappings are
    copied now (two small dicts per fused result, ~0.1 us): the results' own are the caller's to
    edit in place afterwards, which must not rewrite what the stage recorded; an empty or missing
    mapping is kept as None (no leg ranks, as the columns read it).
    """
    values: List[Any] = []
    extend = values.extend
    for r in results:
        f = r.__dict__  # not getattr: a missing attribute costs a pydantic AttributeError (microseconds)
        ranks = f.get("leg_ranks")
        if ranks:
            scores = f.get("leg_scores")
            try:  # fusion's dicts
                ranks, scores = ranks.copy(), scores.copy()
            except AttributeError:  # another mapping, or no scores
                ranks, scores = dict(ranks), None if scores is None else dict(scores)
            extend((f["node"].node_id, f["score"], ranks, scores, f.get("pre_rerank_rank")))
        else:
            extend((f["node"].node_id, f["score"], None, None, f.get("pre_rerank_rank")))
    return tuple(values)


# ---- node lists in columns (the trace's JSON form, format 2) and in rows (TracedNode / DroppedNode)
#: Optional node columns, in the order they are written.
_NODE_OPTIONAL = ("leg_ranks", "leg_scores", "pre_rerank_rank", "source_ids")
_DROP_OPTIONAL = ("detail", "duplicate_of")


def snapshot_columns(snap: Snapshot) -> Dict[str, Any]:
    """The node columns of a :func:`snapshot`: ``node_id`` and ``score`` lists (rank = position + 1),
    ``leg_ranks`` / ``leg_scores`` (a copied mapping or None per node) when a node has leg ranks,
    ``pre_rerank_rank`` (int or None per node) when a node has one. Slices of the flat tuple: no per-node dict."""
    scores = snap[1::_SNAPSHOT_WIDTH]
    try:
        scores = list(map(float, scores))  # one C-level pass (as _floats)
    except TypeError:
        scores = _floats(scores)
    columns: Dict[str, Any] = {"node_id": list(snap[0::_SNAPSHOT_WIDTH]), "score": scores}
    leg_ranks = snap[2::_SNAPSHOT_WIDTH]
    if any(leg_ranks):
        leg_scores = snap[3::_SNAPSHOT_WIDTH]
        try:  # every node has leg ranks and scores as dicts (fusion's results): copied in one C-level pass each
            columns["leg_ranks"], columns["leg_scores"] = list(map(dict.copy, leg_ranks)), list(map(dict.copy, leg_scores))
        except TypeError:  # a node without them, or another mapping
            columns["leg_ranks"], columns["leg_scores"] = _leg_columns_of(leg_ranks, leg_scores)
        else:
            if not all(leg_ranks):  # an empty mapping is no leg ranks
                columns["leg_ranks"], columns["leg_scores"] = _leg_columns_of(leg_ranks, leg_scores)
    pre = snap[4::_SNAPSHOT_WIDTH]
    if pre.count(None) != len(pre):
        columns["pre_rerank_rank"] = list(pre)
    return columns


def _leg_columns_of(leg_ranks: Sequence[Any], leg_scores: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
    """The ``leg_ranks`` / ``leg_scores`` columns: a new dict per node with leg ranks, else None."""
    return [dict(r) if r else None for r in leg_ranks], [dict(s or {}) if r else None for r, s in zip(leg_ranks, leg_scores)]


def _copy_nested(values: List[Any]) -> List[Any]:
    """A copy of a column of dicts or lists (None kept): a new dict or list per node."""
    try:
        return list(map(dict.copy, values))  # one C-level pass (leg ranks and scores)
    except TypeError:  # a None, or lists (source ids)
        return [v if v is None else v.copy() for v in values]


def _part(columns: Dict[str, Any]) -> Any:
    """Node columns as a stage's JSON part: ``[]`` when they hold no node (as :func:`_columns_of_rows` writes none)."""
    return columns if columns["node_id"] else []


def _columns_of_rows(rows: Sequence[Mapping[str, Any]], drops: bool) -> Any:
    """Node (or, ``drops``, dropped-node) rows as columns; ``[]`` for none. ``rank`` is written for
    nodes only when a rank is not its position + 1 (never, for records built here)."""
    if not rows:
        return []
    columns: Dict[str, Any] = {"node_id": [n["node_id"] for n in rows]}
    if drops:
        columns["reason"] = [DropReason(n["reason"]).value for n in rows]
        columns["rank"] = [n["rank"] for n in rows]
    elif any(n["rank"] != i for i, n in enumerate(rows, 1)):
        columns["rank"] = [n["rank"] for n in rows]
    columns["score"] = [n["score"] for n in rows]
    for key in _DROP_OPTIONAL if drops else _NODE_OPTIONAL:
        if any(key in n for n in rows):
            values = [n.get(key) for n in rows]
            columns[key] = [type(v)(v) if isinstance(v, (dict, list)) else v for v in values]  # copies, as pydantic's dump
    return columns


def _column(columns: Mapping[str, Any], key: str, n: int, where: str) -> Optional[Sequence[Any]]:
    values = columns.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"{where}: column {key!r} must be a list of {n} values (one per node_id), got {values!r:.80}")
    return values


_NESTED_COLUMNS = frozenset({"leg_ranks", "leg_scores", "source_ids"})


def _fresh_columns(columns: Mapping[str, List[Any]]) -> Dict[str, List[Any]]:
    """A copy of node columns: the lists, and the mappings / lists in them (as :func:`snapshot_columns` copies them)."""
    return {k: _copy_nested(values) if k in _NESTED_COLUMNS else values.copy() for k, values in columns.items()}


def _rows_of_columns(columns: Any, drops: bool, where: str) -> List[Dict[str, Any]]:
    """The rows of a node (or dropped-node) list given as rows (format 1, or an empty list) or as columns (format 2)."""
    if isinstance(columns, list):
        return columns
    if not isinstance(columns, Mapping) or not isinstance(columns.get("node_id"), list):
        raise ValueError(f"{where}: expected a list of nodes or columns with a 'node_id' list, got {columns!r:.80}")
    ids = columns["node_id"]
    n = len(ids)
    ranks = _column(columns, "rank", n, where) or range(1, n + 1)
    scores = _column(columns, "score", n, where) or [None] * n
    reasons = _column(columns, "reason", n, where) if drops else None
    if drops and reasons is None:
        raise ValueError(f"{where}: dropped nodes need a 'reason' column")
    optional = [(key, values) for key in (_DROP_OPTIONAL if drops else _NODE_OPTIONAL)
                if (values := _column(columns, key, n, where)) is not None]
    rows: List[Dict[str, Any]] = []
    for i in range(n):
        row: Dict[str, Any] = {"node_id": ids[i], "rank": ranks[i], "score": scores[i]}
        if drops:
            row["reason"] = DropReason(reasons[i])
        for key, values in optional:
            if values[i] is not None:
                row[key] = values[i]
        rows.append(row)
    return rows


def from_snapshot(snap: Snapshot) -> List[TracedNode]:
    """The :class:`TracedNode` entries of a :func:`snapshot`, ranks from 1 (equal to :func:`traced_nodes` then)."""
    return _rows_of_columns(snapshot_columns(snap), False, "snapshot")  # type: ignore[return-value]


class _Drops:
    """Dropped-node columns being built (reason values as strings: the JSON form)."""

    __slots__ = ("node_id", "reason", "rank", "score", "detail", "duplicate_of")

    def __init__(self) -> None:
        self.node_id: List[str] = []
        self.reason: List[str] = []
        self.rank: List[Optional[int]] = []
        self.score: List[Optional[float]] = []
        self.detail: List[Optional[str]] = []
        self.duplicate_of: List[Optional[str]] = []

    def add(self, node_id: str, reason: DropReason, rank: Optional[int], score: Optional[float], detail: Optional[str] = None,
            duplicate_of: Optional[str] = None) -> None:
        self.node_id.append(node_id)
        self.reason.append(reason._value_)
        self.rank.append(rank)
        self.score.append(score)
        self.detail.append(detail)
        self.duplicate_of.append(duplicate_of)

    def columns(self) -> Any:
        """The columns (optional ones only when some node has a value), ``[]`` for none."""
        if not self.node_id:
            return []
        columns = {"node_id": self.node_id, "reason": self.reason, "rank": self.rank, "score": self.score}
        for key in _DROP_OPTIONAL:
            values = getattr(self, key)
            if values.count(None) != len(values):
                columns[key] = values
        return columns


class _Merged:
    """Fusion's inputs and drops: derived from its legs' outputs (:func:`_fusion_fields`), in memory and on reading.

    ``legs``: the legs' :data:`Spec` s or records, found again in the trace by identity. Written as
    ``{"merged_from": [leg names]}`` when the legs precede fusion in the same trace (they always do
    for this package's retrievers), else in full.
    """

    __slots__ = ("legs", "attributes")

    def __init__(self, legs: Tuple[Any, ...], attributes: Mapping[str, Any]) -> None:
        self.legs, self.attributes = legs, attributes


def _spec(stage: Stage, name: str, component: str, query_str: Optional[str], latency_ms: float,
          build: Callable[..., Tuple[Any, Any, Any]], args: Tuple[Any, ...], attributes: Dict[str, Any], span_id: Optional[str],
          confidence: Optional[float] = None, threshold: Optional[float] = None, context_tokens: Optional[int] = None,
          max_tokens: Optional[int] = None) -> Spec:
    """A stage's :data:`Spec`: its fields (JSON-ready: plain floats and ints, ``attributes`` a dict), then
    ``build`` and ``args``. ``build(*args)`` returns the
    record's ``(inputs, outputs, dropped)`` in the trace's JSON form (columns, ``[]`` for no node, or
    fusion's :class:`_Merged`; see :func:`snapshot_columns`, :class:`_Drops`), written as they are
    and turned into rows when the record is first read.

    ``build`` is a module function and ``args`` plain values (no closure): a kept trace holds few
    objects the garbage collector must track.
    """
    return (stage, name, component, query_str, float(latency_ms), _score(confidence), _score(threshold),
            None if context_tokens is None else int(context_tokens), None if max_tokens is None else int(max_tokens),
            attributes, span_id, build, *args)


def _record_of_spec(spec: Spec) -> StageTrace:
    """The :class:`StageTrace` of a :data:`Spec` (unvalidated; its node lists built on first read)."""
    return assemble(StageTrace, dict(zip(_SPEC_FIELDS, spec)), _STAGE_FIELDS_SET, private={"_lazy": spec[_SPEC_BUILD:]})


def _records_of(entries: Sequence[Union[Spec, StageTrace]]) -> List[StageTrace]:
    """The records of a trace's entries, in order: a :data:`Spec` made into its record, a fusion's
    legs replaced by the records made of them (the legs are found again by identity)."""
    made: Dict[int, StageTrace] = {}
    records: List[StageTrace] = []
    for entry in entries:
        if type(entry) is tuple:
            spec = entry
            if spec[_SPEC_BUILD] is _fusion_columns:
                snap, legs, attributes = spec[_SPEC_BUILD + 1:]
                legs = tuple((made.get(id(leg)) or _record_of_spec(leg)) if type(leg) is tuple else leg for leg in legs)
                spec = spec[:_SPEC_BUILD + 2] + (legs, attributes)
            made[id(entry)] = record = _record_of_spec(spec)
            records.append(record)
        else:
            records.append(entry)
    return records


def _leg_columns(snap: Snapshot, depth: Optional[int]) -> Tuple[Any, Any, Any]:
    inputs = snapshot_columns(snap)
    n = len(inputs["node_id"])
    if depth is None or depth >= n:
        return _part(inputs), _part({k: list(v) for k, v in inputs.items()}), []
    outputs = {k: v[:depth] for k, v in inputs.items()}
    drops = _Drops()
    for rank, node_id, score in zip(range(depth + 1, n + 1), inputs["node_id"][depth:], inputs["score"][depth:]):
        drops.add(node_id, DropReason.NOT_IN_TOP_K, rank, score, f"leg rank {rank} > candidate_top_k {depth}")
    return inputs, _part(outputs), drops.columns()


def leg_record(
    name: str, component: str, query_str: Optional[str], results: Sequence[NodeWithScore], depth: Optional[int], latency_ms: float
) -> StageTrace:
    """A retrieval leg: what it returned (inputs) and the first ``depth`` that go to fusion (outputs)."""
    return _record_of_spec(_leg_spec(name, component, query_str, results, depth, latency_ms, None))


def _leg_spec(name: str, component: str, query_str: Optional[str], results: Sequence[NodeWithScore], depth: Optional[int],
              latency_ms: float, span_id: Optional[str]) -> Spec:
    return _spec(Stage.RETRIEVAL_LEG, name, component, query_str, latency_ms, _leg_columns, (snapshot(results), depth),
                 {"candidate_top_k": depth}, span_id)


def _fusion_fields(legs: Mapping[str, Sequence[TracedNode]], outputs: Sequence[TracedNode], attributes: Mapping[str, Any]) -> Dict[str, Any]:
    """Fusion's ``inputs`` (merged leg candidates, ranked by best leg rank) and ``dropped`` (those not in ``outputs``)."""
    merged: Dict[str, Tuple[List[int], Dict[str, int], Dict[str, Optional[float]]]] = {}  # id -> ([best rank], ranks, scores)
    for leg, nodes in legs.items():
        for n in nodes:
            node_id, rank = n["node_id"], n["rank"]
            entry = merged.get(node_id)
            if entry is None:
                merged[node_id] = ([rank], {leg: rank}, {leg: n["score"]})
            else:
                entry[1][leg] = rank
                entry[2][leg] = n["score"]
                if rank < entry[0][0]:
                    entry[0][0] = rank
    order = sorted(merged, key=lambda node_id: (merged[node_id][0][0], node_id))
    inputs: List[TracedNode] = [{"node_id": node_id, "rank": i, "score": None, "leg_ranks": merged[node_id][1],
                                 "leg_scores": merged[node_id][2]} for i, node_id in enumerate(order, 1)]
    kept = {n["node_id"] for n in outputs}
    detail = f"fused rank > similarity_top_k {attributes.get('similarity_top_k')}"
    reason = DropReason.NOT_IN_TOP_K
    dropped: List[DroppedNode] = [{"node_id": n["node_id"], "reason": reason, "rank": n["rank"], "score": None, "detail": detail}
                                  for n in inputs if n["node_id"] not in kept]
    return {"inputs": inputs, "dropped": dropped}


def _fusion_columns(snap: Snapshot, legs: Tuple[Union[Spec, StageTrace], ...], attributes: Mapping[str, Any]) -> Tuple[Any, Any, Any]:
    merged, outputs = _Merged(legs, attributes), snapshot_columns(snap)
    return merged, outputs if outputs["node_id"] else [], merged


def _emit_lazy_fusion(component: str, query_str: Optional[str], legs: Tuple[Union[Spec, StageTrace], ...],
                      fused: Sequence[NodeWithScore], latency_ms: float, attributes: Dict[str, Any],
                      count_candidates: Callable[[], int], collectors: Optional[List[Any]], span_id: Optional[str]) -> None:
    """Emit fusion's record (``legs``: what :func:`_emit_spec` returned for each leg), its per-node entries built on first read.

    ``count_candidates()``: how many distinct candidates the legs handed to fusion, asked only when
    events are dispatched (then the drop event is sent when fusion dropped any, without building
    the record's entries to see). ``collectors``: as :func:`_emit_spec` takes them.
    """
    snap = snapshot(fused)  # the results are the caller's (mutable): ids and scores kept now
    spec = _spec(Stage.FUSION, "fusion", component, query_str, latency_ms, _fusion_columns, (snap, legs, attributes), attributes, span_id)
    _emit_spec(spec, None if collectors is not None else max(0, count_candidates() - len(fused)), collectors)


def _array_leg_columns(node_ids: Sequence[str], positions: Any, scores: Any) -> Tuple[Any, Any, Any]:
    """An array leg's outputs: ``positions`` into ``node_ids`` (the index snapshot's ids) and their ``scores``, best first."""
    n = len(positions)
    if n > 1:
        ids = list(operator.itemgetter(*positions.tolist())(node_ids))
    elif n:
        ids = [node_ids[int(positions[0])]]
    else:
        return [], [], []
    return [], {"node_id": ids, "score": scores.tolist()}, []


# ------------------------------------------------------------------------------ stage hooks (called only when enabled)
def trace_index_fusion(
    retriever: Any, query: Any, node_ids: Sequence[str], legs: Mapping[str, Tuple[Any, Any]], fused: Sequence[NodeWithScore], laps: Laps
) -> None:
    """Emit the leg and fusion records of a ``FusedIndexRetriever`` query.

    ``node_ids``: the index snapshot's node ids by position (``BM25Snapshot.node_ids``); ``legs``:
    per leg, its top positions into them and their scores, best first, as fresh
    numpy arrays that nobody writes afterwards (the records keep them and read them when read).
    """
    query_str = _query_text(query)
    component = type(retriever).__name__
    collectors, span_id = _receivers(), active_span_id.get()
    lap_ms, depth = laps.ms, retriever.candidate_top_k
    entries = []
    embed_ms = lap_ms.get("embed", 0.0)
    for name, (positions, scores) in legs.items():
        attributes: Dict[str, Any] = {"candidate_top_k": depth}
        ms = lap_ms.get(name, 0.0)
        if name == "dense":  # the dense leg's time includes embedding the query (0 when the bundle carried one)
            ms += embed_ms
            attributes["query_embedding_ms"] = embed_ms
        spec = _spec(Stage.RETRIEVAL_LEG, name, component, query_str, ms, _array_leg_columns, (node_ids, positions, scores),
                     attributes, span_id)
        entries.append(_emit_spec(spec, 0, collectors))
    _emit_lazy_fusion(component, query_str, tuple(entries), fused, lap_ms.get("fusion", 0.0), retriever.fusion_attributes,
                      lambda: len(set().union(*(positions.tolist() for positions, _ in legs.values()))), collectors, span_id)


def trace_hybrid(
    retriever: Any, query: Any, leg_results: Sequence[Sequence[NodeWithScore]], leg_ms: Sequence[float],
    fused: Sequence[NodeWithScore], fusion_ms: float,
) -> None:
    """Emit the leg and fusion records of a ``HybridRetriever`` query."""
    query_str = _query_text(query)
    component = type(retriever).__name__
    collectors, span_id = _receivers(), active_span_id.get()
    depths = retriever.candidate_depths
    entries = []
    for name, results, depth, ms in zip(retriever.names, leg_results, depths, leg_ms):
        spec = _leg_spec(name, component, query_str, results, depth, ms, span_id)
        entries.append(_emit_spec(spec, 0 if depth is None else max(0, len(results) - depth), collectors))
    _emit_lazy_fusion(component, query_str, tuple(entries), fused, fusion_ms, retriever.fusion_attributes,
                      lambda: len({r.node.node_id for results, depth in zip(leg_results, depths) for r in results[:depth]}),
                      collectors, span_id)


def timed(fn: Callable[[Any], Any], arg: Any) -> Tuple[Any, float]:
    """``(fn(arg), milliseconds)``."""
    started = time.perf_counter()
    return fn(arg), elapsed_ms(started)


async def atimed(awaitable: Any) -> Tuple[Any, float]:
    """``(await awaitable, milliseconds)``."""
    started = time.perf_counter()
    return await awaitable, elapsed_ms(started)


def _gate_columns(in_snap: Snapshot, out_snap: Snapshot, cutoff: Optional[float], conf: Optional[float],
                  threshold: Optional[float]) -> Tuple[Any, Any, Any]:
    inputs = snapshot_columns(in_snap)
    if out_snap is in_snap:  # the open gate passed every input on: nothing dropped
        return (inputs, _fresh_columns(inputs), []) if inputs["node_id"] else ([], [], [])
    outputs = snapshot_columns(out_snap)
    kept_ids = set(outputs["node_id"])
    drops = _Drops()
    closed = f"confidence {conf:.4f} < threshold {threshold:.4f}" if conf is not None else "gate closed"
    for rank, (node_id, score) in enumerate(zip(inputs["node_id"], inputs["score"]), 1):
        if node_id in kept_ids:
            continue
        if cutoff is not None and (score is None or score < cutoff):
            drops.add(node_id, DropReason.BELOW_CUTOFF, rank, score, f"score {score} < similarity_cutoff {cutoff}")
        else:
            drops.add(node_id, DropReason.BELOW_THRESHOLD, rank, score, closed)
    return _part(inputs), _part(outputs), drops.columns()


def gate_record(gate: Any, nodes: Sequence[NodeWithScore], kept: Sequence[NodeWithScore], query: Any, latency_ms: float,
                confidence: Optional[float] = None) -> StageTrace:
    """The no-answer gate: closed -> every input dropped below threshold (or below the cutoff).

    ``confidence``: the answer probability the gate computed for these nodes (None when unfitted).
    """
    return _record_of_spec(_gate_spec(gate, nodes, kept, query, latency_ms, confidence, None))


def _gate_spec(gate: Any, nodes: Sequence[NodeWithScore], kept: Sequence[NodeWithScore], query: Any, latency_ms: float,
               confidence: Optional[float], span_id: Optional[str]) -> Spec:
    fitted = gate.is_fitted
    conf = _score(confidence) if fitted else None
    threshold = _score(gate.threshold) if fitted else None
    cutoff = gate.similarity_cutoff
    in_snap = snapshot(nodes)
    same = len(kept) == len(nodes) and all(map(operator.is_, kept, nodes))  # the open gate: every input passed on
    out_snap = in_snap if same else snapshot(kept)
    return (Stage.NO_ANSWER_GATE, "no_answer", type(gate).__name__, _query_text(query), float(latency_ms), conf, threshold, None,
            None, {"closed": bool(nodes) and not kept, "similarity_cutoff": cutoff}, span_id,
            _gate_columns, in_snap, out_snap, cutoff, conf, threshold)  # _spec(...), without the call


def trace_gate(gate: Any, nodes: Sequence[NodeWithScore], kept: Sequence[NodeWithScore], query: Any, started: float,
               confidence: Optional[float] = None) -> None:
    """Emit the no-answer gate's record (``confidence``: see :func:`gate_record`)."""
    latency_ms = elapsed_ms(started)
    collectors = _receivers()
    _emit_spec(_gate_spec(gate, nodes, kept, query, latency_ms, confidence, active_span_id.get()), len(nodes) - len(kept), collectors)


def _rerank_columns(in_snap: Snapshot, out_snap: Snapshot, capped: int, scored: int, budget_ms: Any, top_n: Any) -> Tuple[Any, Any, Any]:
    inputs, outputs = snapshot_columns(in_snap), snapshot_columns(out_snap)
    kept = set(outputs["node_id"])
    drops = _Drops()
    seen: set = set()
    distinct = 0  # the reranker drops a repeated id before capping and scoring: count distinct ids
    for rank, (node_id, score) in enumerate(zip(inputs["node_id"], inputs["score"]), 1):
        if node_id in seen:
            drops.add(node_id, DropReason.DUPLICATE, rank, score, f"{_DUPLICATE_OF}{node_id}", duplicate_of=node_id)
            continue
        seen.add(node_id)
        distinct += 1
        if node_id in kept:
            continue
        if distinct > capped:
            drops.add(node_id, DropReason.OVER_MAX_CANDIDATES, rank, score, f"input rank {distinct} > max_candidates {capped}")
        elif distinct > scored:
            drops.add(node_id, DropReason.NOT_SCORED, rank, score, f"latency budget {budget_ms} ms: scored {scored}")
        else:
            drops.add(node_id, DropReason.NOT_IN_TOP_K, rank, score, f"reranked below top_n {top_n}")
    return _part(inputs), _part(outputs), drops.columns()


def rerank_record(reranker: Any, query: Any, nodes: Sequence[NodeWithScore], results: Sequence[NodeWithScore], latency_ms: float,
                  stats: Any = None) -> StageTrace:
    """The reranker: inputs beyond ``max_candidates``, unscored (latency budget) or below ``top_n`` are dropped.
    ``stats``: the call's ``RerankStats`` (default: the reranker's ``last_stats``)."""
    return _record_of_spec(_rerank_spec(reranker, query, nodes, results, latency_ms, None, stats))


def _rerank_spec(reranker: Any, query: Any, nodes: Sequence[NodeWithScore], results: Sequence[NodeWithScore], latency_ms: float,
                 span_id: Optional[str], stats: Any = None) -> Spec:
    if stats is None:
        stats = reranker.last_stats
    capped = stats.capped_to if stats is not None else len(nodes)
    scored = stats.scored if stats is not None else len(nodes)
    attributes: Dict[str, Any] = {"model": reranker.model, "top_n": reranker.top_n}
    if stats is not None:
        attributes.update(scoring_ms=stats.scoring_ms, scored=stats.scored, per_pair_ms=stats.per_pair_ms)
        for name in ("truncated", "duplicates_dropped", "fixed_call_ms"):  # fields of newer RerankStats
            if getattr(stats, name, None) is not None:
                attributes[name] = getattr(stats, name)
    return _spec(Stage.RERANK, "rerank", type(reranker).__name__, _query_text(query), latency_ms, _rerank_columns,
                 (snapshot(nodes), snapshot(results), capped, scored, reranker.latency_budget_ms, reranker.top_n), attributes, span_id)


def trace_rerank(reranker: Any, query: Any, nodes: Sequence[NodeWithScore], results: Sequence[NodeWithScore], started: float,
                 stats: Any = None) -> None:
    """Emit the reranker's record (``stats``: the call's own ``RerankStats``; default ``reranker.last_stats``)."""
    latency_ms = elapsed_ms(started)
    collectors = _receivers()
    _emit_spec(_rerank_spec(reranker, query, nodes, results, latency_ms, active_span_id.get(), stats), len(nodes) - len(results),
               collectors)



def _assembly_columns(in_snap: Snapshot, out_snap: Snapshot, sources: Tuple[Tuple[str, ...], ...],
                      left_out: Tuple[str, ...], max_tokens: Any) -> Tuple[Any, Any, Any]:
    inputs = snapshot_columns(in_snap)
    outputs = snapshot_columns(out_snap)
    if outputs["node_id"]:
        outputs["source_ids"] = [list(s) for s in sources]
    if not left_out:
        return inputs if inputs["node_id"] else [], outputs if outputs["node_id"] else [], []
    in_ids, in_scores = inputs["node_id"], inputs["score"]
    position = dict(zip(in_ids, range(1, len(in_ids) + 1)))  # id -> rank (the last, for a repeated id)
    ids, reasons = list(left_out[0::2]), left_out[1::2]
    ranks = [position.get(node_id) for node_id in ids]
    duplicate = [reason.startswith(_DUPLICATE_OF) for reason in reasons]
    budget = f"budget {max_tokens} tokens"
    dropped: Dict[str, Any] = {
        "node_id": ids,
        "reason": [_DUPLICATE_VALUE if dup else _OVER_BUDGET_VALUE for dup in duplicate],
        "rank": ranks,
        "score": [None if rank is None else in_scores[rank - 1] for rank in ranks],
        "detail": [reason if dup else budget for reason, dup in zip(reasons, duplicate)],
    }
    if any(duplicate):
        dropped["duplicate_of"] = [reason[len(_DUPLICATE_OF):] if dup else None for reason, dup in zip(reasons, duplicate)]
    return inputs if inputs["node_id"] else [], outputs if outputs["node_id"] else [], dropped


def assembly_record(assembler: Any, query: Any, nodes: Sequence[NodeWithScore], out: Sequence[NodeWithScore], report: Any,
                    latency_ms: float) -> StageTrace:
    """Context assembly: outputs are the assembled nodes (with the input ids each holds), drops from its report."""
    return _record_of_spec(_assembly_spec(assembler, query, nodes, out, report, latency_ms, None))


def _assembly_spec(assembler: Any, query: Any, nodes: Sequence[NodeWithScore], out: Sequence[NodeWithScore], report: Any,
                   latency_ms: float, span_id: Optional[str]) -> Spec:
    sources = tuple([tuple((r.node.metadata or {}).get("source_node_ids") or ()) for r in out])
    left_out = tuple(_chain([(left.node_id, left.reason) for left in report.left_out]))  # flat: id, reason, id, reason, ...
    max_tokens, used_tokens = report.max_tokens, report.used_tokens
    max_tokens, used_tokens = None if max_tokens is None else int(max_tokens), None if used_tokens is None else int(used_tokens)
    return (Stage.ASSEMBLY, "context", type(assembler).__name__, _query_text(query), float(latency_ms), None, None,
            used_tokens, max_tokens, {"order": _enum_value(assembler.order), "spans": report.spans,
                                             "truncated": list(report.truncated)}, span_id,
            _assembly_columns, snapshot(nodes), snapshot(out), sources, left_out, max_tokens)  # _spec(...), without the call


def trace_assembly(assembler: Any, query: Any, nodes: Sequence[NodeWithScore], out: Sequence[NodeWithScore], report: Any,
                   started: float) -> None:
    """Emit the context assembler's record."""
    latency_ms = elapsed_ms(started)
    collectors = _receivers()
    _emit_spec(_assembly_spec(assembler, query, nodes, out, report, latency_ms, active_span_id.get()), len(report.left_out), collectors)


# ------------------------------------------------------------------------------ responses
def attach_trace(response: Any, trace: Union[QueryTrace, Mapping[str, Any]]) -> Any:
    """Put ``trace`` (as a JSON-ready dict: :meth:`QueryTrace.to_dict`) in ``response.metadata["trace"]``; returns the response."""
    data = trace.to_dict() if isinstance(trace, QueryTrace) else dict(trace)
    response.metadata = {**(getattr(response, "metadata", None) or {}), "trace": data}
    return response


# ------------------------------------------------------------------------------ collecting
class _Open:
    """A trace being collected in one context (its stages so far, as handed on), and the one it
    interrupted. The :class:`QueryTrace` is made when it closes."""

    __slots__ = ("query_str", "span_id", "owner", "previous", "entries", "started_at", "started", "inner")

    def __init__(self, query_str: Optional[str], span_id: Optional[str], owner: Optional[str], previous: Optional["_Open"]) -> None:
        self.query_str, self.span_id, self.owner, self.previous = query_str, span_id, owner, previous
        self.entries: List[Union[Spec, StageTrace]] = []
        #: the attached dict of the last query that finished inside this one (a chat turn over a query engine)
        self.inner: Optional[Dict[str, Any]] = None
        self.started_at = datetime.now()
        self.started = time.perf_counter()


_QUERY_FIELDS_SET = _ALL_FIELDS_SET.setdefault(QueryTrace, set(_field_names(QueryTrace)))


def _new_trace(query_str: Optional[str], span_id: Optional[str], started_at: Optional[datetime] = None,
               entries: Optional[List[Any]] = None) -> QueryTrace:
    """A :class:`QueryTrace` of ``entries`` (pending: made into ``stages`` when read), unvalidated."""
    return assemble(QueryTrace, {"trace_id": _IDS.hex(), "query_str": query_str, "started_at": started_at or datetime.now(),
                                 "latency_ms": None, "span_id": span_id}, _QUERY_FIELDS_SET,
                    private={"_pending": [] if entries is None else entries})


def _one_stage_trace(entry: Union[Spec, StageTrace], started_at: datetime) -> QueryTrace:
    """The trace of a stage (its :data:`Spec` or record) that ran outside any query."""
    if type(entry) is tuple:
        query_str, span_id, latency_ms = entry[_SPEC_QUERY], entry[_SPEC_SPAN], entry[_SPEC_LATENCY]
    else:
        values = entry.__dict__
        query_str, span_id, latency_ms = values["query_str"], values["span_id"], values["latency_ms"]
    trace = _new_trace(query_str, span_id, started_at, [entry])
    trace.__dict__["latency_ms"] = latency_ms
    return trace


class _Route(int, Enum):
    """What a :class:`TraceCollector` does with an event of a given class."""

    IGNORE = 0
    STAGE = 1
    QUERY_START = 2
    QUERY_END = 3
    RETRIEVAL_START = 4
    RETRIEVAL_END = 5
    SPAN_DROP = 6


_ROUTES: Dict[type, _Route] = {}  # event class -> route (a collector sees every event: one dict lookup each)


def _route(cls: type) -> _Route:
    """The :class:`_Route` of events of ``cls`` (cached per class)."""
    for base, route in ((StageTraceEvent, _Route.STAGE), (NodesDroppedEvent, _Route.IGNORE),
                        (QueryStartEvent, _Route.QUERY_START), (QueryEndEvent, _Route.QUERY_END),
                        (RetrievalStartEvent, _Route.RETRIEVAL_START), (RetrievalEndEvent, _Route.RETRIEVAL_END),
                        (SpanDropEvent, _Route.SPAN_DROP)):
        if issubclass(cls, base):
            break
    else:
        route = _Route.IGNORE
    _ROUTES[cls] = route
    return route


class TraceCollector(BaseEventHandler):
    """Groups :class:`StageTraceEvent` records into one :class:`QueryTrace` per query.

    A trace opens at ``QueryStartEvent`` (or at the outermost ``RetrievalStartEvent`` when a
    retriever is called on its own, or when a chat engine's turn starts: its span, as chat engines
    emit no query events) and closes at the matching end; stage records outside
    any query become one-stage traces. Open traces live in a context variable, so concurrent
    queries (threads, asyncio tasks) do not mix. Use :meth:`install` / :meth:`uninstall`, or
    ``with collector:``.
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not ignored

    attach: bool = Field(default=True, description="Attach each query's trace to its response (metadata['trace']).")
    keep: bool = Field(default=True, description="Keep finished traces in `traces`.")
    max_traces: int = Field(default=1000, ge=1, description="Most finished traces kept (oldest dropped first).")

    _current: Any = PrivateAttr(default=None)
    # finished traces; a one-stage trace nobody read yet is kept as ``(record, started_at)`` (see _add)
    _traces: List[Any] = PrivateAttr(default_factory=list)
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
            traces = self._traces
            for i, entry in enumerate(traces):
                if type(entry) is tuple:
                    traces[i] = _one_stage_trace(*entry)
            return list(traces)

    @property
    def last(self) -> Optional[QueryTrace]:
        """The most recent finished trace."""
        with self._lock:
            traces = self._traces
            if not traces:
                return None
            if type(traces[-1]) is tuple:
                traces[-1] = _one_stage_trace(*traces[-1])
            return traces[-1]

    def clear(self) -> None:
        """Forget the finished traces."""
        with self._lock:
            self._traces.clear()

    # -- installation
    def install(self) -> "TraceCollector":
        """Add this handler to the root dispatcher (once)."""
        _install_chat_scope()
        root = get_dispatcher()
        if not any(h is self for h in root.event_handlers):
            root.add_event_handler(self)
        return self

    def uninstall(self) -> None:
        """Remove this handler from the root dispatcher (and the chat-turn span handler with the last
        collector: nothing of tracing stays on LlamaIndex's spans when it is off)."""
        root = get_dispatcher()
        root.event_handlers = [h for h in root.event_handlers if h is not self]
        _remove_chat_scope_if_unused()

    def __enter__(self) -> "TraceCollector":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    # -- events
    def handle(self, event: BaseEvent, **kwargs: Any) -> Any:
        route = _ROUTES.get(type(event))
        if route is None:
            route = _route(type(event))
        if route is _Route.IGNORE:
            return None
        if route is _Route.STAGE:
            self._add(event.__dict__["trace"])
        elif route is _Route.QUERY_START:
            self._begin(_query_text(event.query), event.span_id, owner=None)
        elif route is _Route.QUERY_END:
            self._end(event.span_id, event.response, query_end=True)
        elif route is _Route.RETRIEVAL_START:
            if self.__pydantic_private__["_current"].get() is None:
                self._begin(_query_text(event.str_or_query_bundle), event.span_id, owner=event.span_id)
        elif route is _Route.SPAN_DROP:
            self._drop_failed(event.span_id, event.err_str)
        else:
            self._end(event.span_id, None, query_end=False)

    def _drop_failed(self, span_id: Optional[str], error: str) -> None:
        """The span of an open trace ended with an exception (LlamaIndex's ``SpanDropEvent``; no
        end event follows): forget that trace and the ones it opened, so that later queries of
        this context (a server's worker thread) are traced again instead of piling into it."""
        current = self.__pydantic_private__["_current"]
        open_ = current.get()
        while open_ is not None:
            if span_id is not None and span_id in (open_.span_id, open_.owner):
                current.set(open_.previous)
                logger.debug("trace of %r dropped: its query failed (%s)", (open_.query_str or "")[:80], error[:200])
                return
            open_ = open_.previous

    def _chat_begin(self, span_id: str, message: Optional[str]) -> None:
        """A chat engine's turn started (its span): one trace for its retrieval and postprocessors,
        which LlamaIndex's chat engines run without a query's start and end events."""
        if self.__pydantic_private__["_current"].get() is None:
            self._begin(message, span_id, owner=span_id)

    def _chat_end(self, span_id: str, response: Any) -> None:
        """The chat turn's span ended: close its trace (attached to an ``AgentChatResponse``). A
        turn that traced nothing itself (a chat engine over a query engine: the query has its own
        trace) is not written as an empty trace; its reply gets the query's attached trace."""
        current = self.__pydantic_private__["_current"]
        open_ = current.get()
        if open_ is not None and open_.owner == span_id and not open_.entries:
            current.set(open_.previous)
            if open_.inner is not None and self.attach and response is not None and hasattr(response, "metadata"):
                # the turn's trace is its query's (CondenseQuestionChatEngine over a query engine)
                response.metadata = {**(response.metadata or {}), "trace": open_.inner}
            return
        self._end(span_id, response, query_end=False)

    def _begin(self, query_str: Optional[str], span_id: Optional[str], owner: Optional[str]) -> None:
        current = self.__pydantic_private__["_current"]  # not self._current: pydantic's __getattr__ on every event
        current.set(_Open(query_str, span_id, owner, current.get()))

    def _add(self, entry: Union[Spec, StageTrace]) -> None:
        """Add a stage (its :data:`Spec`, or its record) to the open trace, or make it a trace of its own."""
        open_ = self.__pydantic_private__["_current"].get()
        if open_ is not None:
            open_.entries.append(entry)
        elif type(self).on_trace is not TraceCollector.on_trace:  # a stage run outside a query: a trace of its own
            self._finish(_one_stage_trace(entry, datetime.now()))
        elif self.keep:  # no export hook reads it now: the trace is made when `traces` / `last` are read
            self._keep((entry, datetime.now()))

    def _keep(self, entry: Any) -> None:
        private = self.__pydantic_private__
        traces = private["_traces"]
        with private["_lock"]:
            traces.append(entry)
            if len(traces) > self.max_traces:
                del traces[: len(traces) - self.max_traces]

    def _end(self, span_id: Optional[str], response: Any, query_end: bool) -> None:
        current = self.__pydantic_private__["_current"]
        open_ = current.get()
        if open_ is None or (open_.owner is None) != query_end or (not query_end and open_.owner != span_id):
            return
        current.set(open_.previous)
        latency_ms = (time.perf_counter() - open_.started) * 1000.0
        trace = _new_trace(open_.query_str, open_.span_id, open_.started_at, open_.entries)
        trace.__dict__["latency_ms"] = latency_ms  # built unvalidated: no pydantic __setattr__
        data = None
        if self.attach and response is not None and hasattr(response, "metadata"):
            data = trace.to_dict()
            response.metadata = {**(response.metadata or {}), "trace": data}  # as attach_trace, without its copy
            if open_.previous is not None:  # a chat turn around this query attaches it too (see _chat_end)
                open_.previous.inner = data
        self._finish(trace, data)

    def _finish(self, trace: QueryTrace, data: Optional[Dict[str, Any]] = None) -> None:
        if self.keep:
            self._keep(trace)
        try:
            self._export(trace, data)
        except Exception:  # the dispatcher would swallow it silently
            logger.exception("trace handler %s failed for trace %s", type(self).__name__, trace.trace_id)
            logger.debug("the failed trace's query: %r", trace.query_str)

    def _export(self, trace: QueryTrace, data: Optional[Dict[str, Any]]) -> None:
        """Hand a finished trace on (``data``: its :meth:`QueryTrace.to_dict`, when one was attached to the response)."""
        self.on_trace(trace)

    def on_trace(self, trace: QueryTrace) -> None:
        """Called with each finished trace (override to export it)."""


_CHAT_SCOPE_LOCK = threading.Lock()
_CHAT_SCOPE: Any = None  # the ChatTraceScope span handler, made on first use


def _root_collectors() -> List[TraceCollector]:
    return [h for h in get_dispatcher().event_handlers if isinstance(h, TraceCollector)]


def _chat_message(bound_args: Any) -> Optional[str]:
    message = getattr(bound_args, "arguments", {}).get("message")
    return None if message is None else str(message)


def _chat_scope() -> Any:
    """The span handler that makes each chat engine turn (``chat``, ``achat``, ``stream_chat``,
    ``astream_chat``) one trace of the collectors on the root dispatcher: a chat engine calls its
    retriever, postprocessors and synthesizer itself, with no query start or end event, so its
    stages would otherwise be traced one trace each. Made once per process."""
    global _CHAT_SCOPE
    if _CHAT_SCOPE is None:
        from llama_index.core.chat_engine.types import BaseChatEngine
        from llama_index.core.instrumentation.span_handlers import BaseSpanHandler

        class ChatTraceScope(BaseSpanHandler):
            """Opens a trace when a chat engine's span starts, closes it when the span ends."""

            @classmethod
            def class_name(cls) -> str:
                return "ChatTraceScope"

            def new_span(self, id_: str, bound_args: Any, instance: Any = None, parent_span_id: Optional[str] = None, tags: Any = None, **kwargs: Any) -> None:
                if isinstance(instance, BaseChatEngine):
                    for collector in _root_collectors():
                        collector._chat_begin(id_, _chat_message(bound_args))
                return None

            def prepare_to_exit_span(self, id_: str, bound_args: Any, instance: Any = None, result: Any = None, **kwargs: Any) -> None:
                if isinstance(instance, BaseChatEngine):
                    for collector in _root_collectors():
                        collector._chat_end(id_, result)
                return None

            def prepare_to_drop_span(self, id_: str, bound_args: Any, instance: Any = None, err: Any = None, **kwargs: Any) -> None:
                if isinstance(instance, BaseChatEngine):
                    for collector in _root_collectors():
                        collector._drop_failed(id_, str(err))
                return None

        _CHAT_SCOPE = ChatTraceScope()
    return _CHAT_SCOPE


def _install_chat_scope() -> None:
    """Put :func:`_chat_scope` on the root dispatcher (once)."""
    with _CHAT_SCOPE_LOCK:
        scope = _chat_scope()
        root = get_dispatcher()
        if not any(h is scope for h in root.span_handlers):
            root.add_span_handler(scope)


def _remove_chat_scope_if_unused() -> None:
    """Take :func:`_chat_scope` off the root dispatcher when no collector is left on it."""
    with _CHAT_SCOPE_LOCK:
        if _CHAT_SCOPE is None or _root_collectors():
            return
        root = get_dispatcher()
        root.span_handlers = [h for h in root.span_handlers if h is not _CHAT_SCOPE]


class _JsonlSink:
    """Finished traces waiting for one JSON-lines file, and the background thread that writes them.

    ``add`` only appends (the query path) a trace, or its line already serialised; the thread
    wakes when one is pending, waits up to ``interval_s`` (less once ``max_pending`` wait),
    serialises the traces and writes the batch in one append.
    :meth:`flush` writes synchronously. Lines keep the order the traces finished in. A trace that
    cannot be serialised is logged and skipped; when the file cannot be written the lines stay
    (the next flush writes them first) and an explicit flush raises.
    """

    def __init__(self, path: str, max_pending: int, interval_s: float) -> None:
        self.path, self.max_pending, self.interval_s = path, max_pending, interval_s
        self._reset()
        _SINKS.add(self)

    def _reset(self) -> None:
        """Nothing pending, no thread, fresh locks (also in a forked child: the parent writes its own lines)."""
        self.pending: List[Union[QueryTrace, bytes]] = []  # traces, or their lines (UTF-8, no newline)
        self.unwritten: List[bytes] = []  # lines serialised but not written (the file could not be written)
        self.pending_lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.wake = threading.Event()  # something is pending (or closing)
        self.due = threading.Event()  # write now: max_pending reached (or closing)
        self.thread: Optional[threading.Thread] = None
        self.stopping = False

    def add(self, trace: Union[QueryTrace, bytes]) -> None:
        with self.pending_lock:
            self.pending.append(trace)
            n = len(self.pending)
            if self.thread is None or not self.thread.is_alive():
                self.stopping = False
                self.thread = threading.Thread(target=self._run, name="rkit-jsonl-trace-writer", daemon=True)
                self.thread.start()
        if n == 1:
            self.wake.set()
        if n >= self.max_pending:
            self.due.set()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if not self.stopping:
                self.due.wait(self.interval_s)
            self.due.clear()
            self.flush_or_log()  # on failure the lines stay: flush() / close() / exit try again
            if self.stopping:
                return

    def flush(self) -> int:
        """Write every pending trace now; how many lines were written."""
        with self.write_lock:
            with self.pending_lock:
                batch, self.pending = self.pending, []
            lines, self.unwritten = self.unwritten, []
            for i, trace in enumerate(batch):
                batch[i] = None  # serialised: freed now (unless kept), not with the whole batch
                try:
                    lines.append((trace if type(trace) is bytes else trace.to_json().encode("utf-8")) + b"\n")
                except Exception:  # never writable: keeping it would block every later line
                    logger.exception("trace %s cannot be serialised; not written to %s", trace.trace_id, self.path)
            if not lines:
                return 0
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                append_lines(self.path, b"".join(lines))
            except BaseException:
                self.unwritten = lines  # the next flush writes them first (the file was cut back to its lines)
                raise
            return len(lines)

    def flush_or_log(self) -> None:
        """:meth:`flush`, logging a failure (the lines stay for the next flush) instead of raising it."""
        try:
            self.flush()
        except Exception:
            logger.exception("could not write traces to %s; they stay pending (flush() retries)", self.path)

    def close(self, raise_errors: bool = True) -> None:
        """Stop the thread and write what is pending (also at interpreter exit and when the writer is collected)."""
        self.stopping = True
        self.wake.set()
        self.due.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if raise_errors:
            self.flush()
        else:
            self.flush_or_log()


_SINKS: "weakref.WeakSet[_JsonlSink]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _IDS.reseed()
    for sink in list(_SINKS):
        sink._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class JsonlTraceWriter(TraceCollector):
    """A :class:`TraceCollector` that appends each finished trace to ``path`` as one JSON line.

    Each line is :meth:`QueryTrace.to_json` (the columnar layout, ``"format": 2``). Lines are
    written in batches by a background thread (at most ``flush_interval_s`` after the trace
    finished, sooner once ``max_pending`` traces wait). A trace attached to its response is
    serialised when its query ends, from the attached dict (built once for both, and before the
    caller can change it); any other trace is serialised on the background thread. :meth:`flush` writes what is pending now; :meth:`uninstall` (the end of ``with writer:``)
    and :meth:`close` flush, and so does interpreter exit. Only a process killed outright (SIGKILL,
    ``os._exit``) can lose the last ``flush_interval_s`` of lines.
    """

    path: str = Field(description="JSON-lines file the traces are appended to (folders are created).")
    keep: bool = Field(default=False, description="Also keep finished traces in `traces`.")
    flush_interval_s: float = Field(default=1.0, gt=0, description="Most seconds a finished trace waits before the background write.")
    max_pending: int = Field(default=256, ge=1, description="Traces waiting that trigger the background write at once.")

    _sink: Any = PrivateAttr(default=None)

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        self._sink = sink = _JsonlSink(self.path, self.max_pending, self.flush_interval_s)
        weakref.finalize(self, sink.close, False)  # at exit too (finalize's atexit); failures logged

    @classmethod
    def class_name(cls) -> str:
        return "JsonlTraceWriter"

    def _export(self, trace: QueryTrace, data: Optional[Dict[str, Any]]) -> None:
        if data is None or type(self).on_trace is not JsonlTraceWriter.on_trace:
            self.on_trace(trace)
            return
        try:  # serialised now, from the dict attached to the response: before the caller can change it
            line = _dumps_utf8(data)
        except Exception:
            logger.exception("trace %s cannot be serialised; not written to %s", trace.trace_id, self.path)
            return
        self._queue(line)

    def on_trace(self, trace: QueryTrace) -> None:
        self._queue(trace)

    def _queue(self, item: Union[QueryTrace, bytes]) -> None:
        sink = self.__pydantic_private__["_sink"]
        if sink.path != self.path:  # the path was changed: what was queued goes to the old file
            sink.flush()
            sink.path = self.path
        sink.add(item)

    def flush(self) -> int:
        """Write every pending trace now (returns how many); raises when the file cannot be written."""
        return self._sink.flush()

    @property
    def pending(self) -> int:
        """Finished traces not written yet."""
        sink = self._sink
        return len(sink.pending) + len(sink.unwritten)

    def uninstall(self) -> None:
        """Stop listening and write what is pending (a failure is logged and the traces stay pending)."""
        super().uninstall()
        self._sink.flush_or_log()

    def close(self) -> None:
        """Stop listening, write what is pending (raises when the file cannot be written) and stop the
        background thread (a later trace starts it again)."""
        super().uninstall()
        self._sink.close()


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
    embed_ms = s.attributes.get("query_embedding_ms")
    latency = f"{s.latency_ms:.2f} ms" + (f" (query embedding {embed_ms:.2f} ms)" if isinstance(embed_ms, (int, float)) and embed_ms else "")
    bits = [f"{s.name} ({s.stage.value}, {s.component})", latency,
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
        trace = QueryTrace.from_dict(trace)
    total = f"{trace.latency_ms:.1f} ms" if trace.latency_ms is not None else "n/a"
    tokens = "n/a (no assembly stage)" if trace.context_tokens is None else str(trace.context_tokens)
    lines = [f"trace {trace.trace_id} | query {trace.query_str!r} | total {total} | context tokens {tokens}"]
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
