"""The Qdrant side of an index: shard schema, point writes, filter translation and query building.

Every call into Qdrant Edge (``qdrant-edge-py``, Qdrant's engine in-process; pinned, extra
``edge``) lives in this module, so an upgrade that changes its API or behaviour fails
``tests/indices/test_store_edge.py`` and nothing else.

Point layout (one point per chunk):

* id: the node id when it is a UUID, else ``uuid5(NODE_ID_NAMESPACE, node_id)`` (Qdrant ids are
  UUIDs or unsigned ints);
* vectors: ``text-dense`` (cosine, ``dense_dim``) and ``text-sparse-new`` (IDF modifier);
* payload: ``node_id``, ``doc_id`` (the node's ``ref_doc_id``), ``metadata`` (the chunk's metadata,
  verbatim), ``node`` (the node's JSON without metadata and embedding, to rebuild the TextNode)
  and two bookkeeping fields that make filters exact: ``_kinds`` (keyword tokens ``"<kind>:<key>"``
  saying what Python type each metadata value has) and ``_lower`` (lower-cased string values, for
  ``TEXT_MATCH_INSENSITIVE``).

Filters (:func:`translate_filters`) mean exactly what the in-memory evaluator
:func:`llama_index_retrieval_kit.retrievers.filters.metadata_matches` means; every Qdrant condition
on a metadata value is guarded by its ``_kinds`` token, because Qdrant matches a condition against
any element of a list and compares across types differently from Python. Filters Qdrant cannot
evaluate exactly (string ranges, ``EQ``/``NE`` against a list) raise ValueError. So that every
stored value can be filtered exactly, metadata values are limited to None, str, bool, finite
float, int within +-2**53 (Qdrant ranges compare in float64), and lists of those scalars.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from ..retrievers.filters import validate_filters
from .storage import DamagedIndexError, FileLock, IndexWriteLockedError, remove_path

try:
    import qdrant_edge as qe
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(
        "llama_index_retrieval_kit needs qdrant-edge-py==0.9.0 (a core dependency): "
        "pip install 'qdrant-edge-py==0.9.0'"
    ) from exc

logger = logging.getLogger(__name__)

DENSE_VECTOR = "text-dense"
SPARSE_VECTOR = "text-sparse-new"
NODE_ID_NAMESPACE = uuid.UUID("5b0f6a52-8f0e-4a53-9a1f-2f7d0c1e6b11")
SCHEMA_FILE = "store.json"
SHARD_DIR = "shard"
FORMAT_VERSION = 1
FUSIONS: Tuple[str, ...] = ("rrf", "dbsf")
KINDS_FIELD = "_kinds"
LOWER_FIELD = "_lower"
MAX_EXACT_INT = 2**53
UPSERT_BATCH = 1024

SparseInput = Union[Mapping[int, float], Tuple[Sequence[int], Sequence[float]]]
Scalar = Union[str, bool, int, float]

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_VALUE_KINDS = ("str", "num", "true", "false", "list")  # a key with none of these is missing (or None)
_ORDER_FUNCS: Dict[FilterOperator, Callable[[Any, Any], bool]] = {
    FilterOperator.GT: operator.gt,
    FilterOperator.GTE: operator.ge,
    FilterOperator.LT: operator.lt,
    FilterOperator.LTE: operator.le,
}


class StoreHit(NamedTuple):
    """One query result: the node id, the engine's score, and the point's payload."""

    node_id: str
    score: float
    payload: Dict[str, Any]


# --------------------------------------------------------------------------------------------
# Point ids and payload (pure)
# --------------------------------------------------------------------------------------------


def point_id(node_id: str) -> str:
    """The Qdrant point id of ``node_id``: the node id itself when it is a UUID, else its uuid5."""
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"node id must be a non-empty str, got {node_id!r}")
    try:
        return str(uuid.UUID(node_id))
    except ValueError:
        return str(uuid.uuid5(NODE_ID_NAMESPACE, node_id))


def _check_scalar(key: str, value: Any) -> None:
    if isinstance(value, bool) or isinstance(value, str):
        return
    if isinstance(value, int):
        if abs(value) > MAX_EXACT_INT:
            raise ValueError(
                f"metadata {key!r}: int {value} is beyond +-2**53; Qdrant compares numbers as float64, "
                "so it could not be filtered exactly: store it as a str"
            )
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"metadata {key!r}: {value!r} is not a finite float (JSON cannot store it)")
        return
    raise ValueError(
        f"metadata {key!r}: unsupported value {value!r:.80} ({type(value).__name__}); "
        "allowed: None, str, bool, int, float, or a list of str/bool/int/float"
    )


def kind_tokens(metadata: Mapping[str, Any]) -> List[str]:
    """The ``_kinds`` tokens of ``metadata``; ValueError naming a key whose value is not storable.

    Per key: ``str``/``num``/``true``/``false``/``list`` (the Python type), ``empty`` for ``""`` and
    ``[]``, and ``ltrue``/``lfalse`` for a list holding True/False. None (= missing) has no token.
    """
    tokens: List[str] = []
    for key, value in metadata.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            for item in value:
                _check_scalar(key, item)
            tokens.append(f"list:{key}")
            if len(value) == 0:
                tokens.append(f"empty:{key}")
            if any(item is True for item in value):
                tokens.append(f"ltrue:{key}")
            if any(item is False for item in value):
                tokens.append(f"lfalse:{key}")
            continue
        _check_scalar(key, value)
        if isinstance(value, bool):
            tokens.append(f"{'true' if value else 'false'}:{key}")
        elif isinstance(value, str):
            tokens.append(f"str:{key}")
            if value == "":
                tokens.append(f"empty:{key}")
        else:
            tokens.append(f"num:{key}")
    return tokens


def node_payload(node: TextNode) -> Dict[str, Any]:
    """The payload stored for ``node`` (see the module docstring)."""
    if not isinstance(node, TextNode):
        raise ValueError(f"nodes must be llama_index TextNode objects, got {type(node).__name__}")
    metadata = dict(node.metadata)
    for key in metadata:
        if not isinstance(key, str):
            raise ValueError(f"metadata keys must be str, got {key!r} in node {node.node_id!r}")
    body = node.to_dict()
    body.pop("metadata", None)
    body.pop("embedding", None)
    return {
        "node_id": node.node_id,
        "doc_id": node.ref_doc_id,
        "metadata": metadata,
        "node": json.dumps(body, ensure_ascii=False),
        KINDS_FIELD: kind_tokens(metadata),
        LOWER_FIELD: {k: v.lower() for k, v in metadata.items() if isinstance(v, str)},
    }


def node_from_payload(payload: Mapping[str, Any]) -> TextNode:
    """Rebuild the TextNode written by :func:`node_payload`."""
    body = json.loads(payload["node"])
    body["metadata"] = dict(payload.get("metadata") or {})
    return TextNode.from_dict(body)


def check_dense(vectors: Any, dim: int, count: int) -> np.ndarray:
    """``vectors`` as a float32 ``(count, dim)`` array of finite, non-zero rows; else ValueError."""
    array = np.asarray(vectors, dtype=np.float32)
    if array.ndim != 2 or array.shape != (count, dim):
        raise ValueError(f"dense vectors must have shape ({count}, {dim}), got {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("dense vectors contain NaN or inf")
    if count and (np.linalg.norm(array, axis=1) == 0).any():
        raise ValueError("dense vectors contain an all-zero row (cosine is undefined for it)")
    return array


def to_sparse(vector: SparseInput) -> "qe.SparseVector":
    """An Edge SparseVector from ``{index: weight}`` or ``(indices, weights)``; ValueError when malformed."""
    if isinstance(vector, Mapping):
        indices, values = list(vector.keys()), list(vector.values())
    elif isinstance(vector, tuple) and len(vector) == 2:
        indices, values = list(vector[0]), list(vector[1])
    else:
        raise ValueError(f"sparse vector must be a {{index: weight}} mapping or (indices, weights), got {vector!r:.80}")
    if len(indices) != len(values):
        raise ValueError(f"sparse vector has {len(indices)} indices but {len(values)} weights")
    if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 or i >= 2**32 for i in indices):
        raise ValueError(f"sparse indices must be ints in [0, 2**32), got {indices[:10]!r}")
    if len(set(int(i) for i in indices)) != len(indices):
        raise ValueError("sparse vector has repeated indices")
    weights = [float(v) for v in values]
    if not all(math.isfinite(w) for w in weights):
        raise ValueError("sparse vector has NaN or inf weights")
    return qe.SparseVector([int(i) for i in indices], weights)


# --------------------------------------------------------------------------------------------
# Filter translation (pure)
# --------------------------------------------------------------------------------------------

def _none() -> "qe.Filter":
    return qe.Filter(must=[qe.HasIdCondition(set())])


def _kind(kind: str, key: str) -> "qe.FieldCondition":
    return qe.FieldCondition(KINDS_FIELD, match=qe.MatchValue(f"{kind}:{key}"))


def _any_of(conditions: List[Any]) -> Any:
    """OR of ``conditions`` (an empty OR matches nothing; Qdrant's empty ``should`` matches all)."""
    if not conditions:
        return _none()
    return conditions[0] if len(conditions) == 1 else qe.Filter(should=conditions)


def _path(key: str) -> str:
    return f"metadata.{key}"


def _check_filter_number(leaf: MetadataFilter, value: Any) -> None:
    if isinstance(value, int) and abs(value) > MAX_EXACT_INT:
        raise ValueError(
            f"filter on {leaf.key!r} ({leaf.operator.value}): int {value} is beyond +-2**53, which Qdrant "
            "cannot compare exactly (float64)"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"filter on {leaf.key!r} ({leaf.operator.value}): {value!r} is not a finite number")


def _number_range(key: str, func: Callable[[Any, Any], bool], wanted: float) -> "qe.FieldCondition":
    if func is operator.eq:
        return qe.FieldCondition(_path(key), range=qe.RangeFloat(gte=wanted, lte=wanted))
    bounds = {operator.gt: "gt", operator.ge: "gte", operator.lt: "lt", operator.le: "lte"}
    return qe.FieldCondition(_path(key), range=qe.RangeFloat(**{bounds[func]: wanted}))


def _compare(key: str, func: Callable[[Any, Any], bool], wanted: Any) -> Any:
    """Scalar ``func(actual, wanted)`` for a number ``wanted``: numbers by range, bools as 0/1 (as Python)."""
    parts: List[Any] = [qe.Filter(must=[_kind("num", key), _number_range(key, func, wanted)])]
    if func(True, wanted):
        parts.append(_kind("true", key))
    if func(False, wanted):
        parts.append(_kind("false", key))
    return _any_of(parts)


def _equals(leaf: MetadataFilter, wanted: Any) -> Any:
    """``actual == wanted`` on a scalar metadata value (missing and lists never match)."""
    key = leaf.key
    if wanted is None:
        return _none()
    if isinstance(wanted, list):
        raise ValueError(
            f"filter on {key!r} ({leaf.operator.value}) with a list value {wanted!r}: Qdrant cannot test "
            "list equality (it matches any element); use ANY/ALL/IN instead"
        )
    if isinstance(wanted, str):
        return qe.Filter(must=[_kind("str", key), qe.FieldCondition(_path(key), match=qe.MatchValue(wanted))])
    _check_filter_number(leaf, wanted)
    return _compare(key, operator.eq, wanted)


def _element_equals(leaf: MetadataFilter, wanted: Any) -> Any:
    """Some element of the (list) metadata value ``== wanted``; combine with the ``list`` kind."""
    key = leaf.key
    if isinstance(wanted, str):
        return qe.FieldCondition(_path(key), match=qe.MatchValue(wanted))
    _check_filter_number(leaf, wanted)
    parts: List[Any] = [qe.FieldCondition(_path(key), range=qe.RangeFloat(gte=wanted, lte=wanted))]
    if wanted == 1:
        parts.append(_kind("ltrue", key))
    if wanted == 0:
        parts.append(_kind("lfalse", key))
    return _any_of(parts)


def _substring(key: str, text: str, field: str) -> "qe.Filter":
    return qe.Filter(must=[_kind("str", key), qe.FieldCondition(field, match=qe.MatchSubstring(text))])


def _translate_leaf(leaf: MetadataFilter) -> Any:
    op, wanted, key = leaf.operator, leaf.value, leaf.key
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"filter key {key!r} is not supported: keys must match {_KEY_RE.pattern}")
    if op == FilterOperator.EQ:
        return _equals(leaf, wanted)
    if op == FilterOperator.NE:
        return qe.Filter(must_not=[_equals(leaf, wanted)])
    if op in _ORDER_FUNCS:
        if isinstance(wanted, str):
            raise ValueError(
                f"filter on {key!r} ({op.value}) with a str value {wanted!r}: Qdrant ranges are numeric, "
                "string ordering cannot be evaluated in the engine"
            )
        _check_filter_number(leaf, wanted)
        return _compare(key, _ORDER_FUNCS[op], wanted)
    if op == FilterOperator.IN:
        return _any_of([_equals(leaf, item) for item in wanted])
    if op == FilterOperator.NIN:
        return qe.Filter(must_not=[_any_of([_equals(leaf, item) for item in wanted])])
    if op == FilterOperator.CONTAINS:
        parts = [qe.Filter(must=[_kind("list", key), _element_equals(leaf, wanted)])]
        if isinstance(wanted, str):
            parts.append(_substring(key, wanted, _path(key)))
        return _any_of(parts)
    if op == FilterOperator.ANY:
        return qe.Filter(must=[_kind("list", key), _any_of([_element_equals(leaf, item) for item in wanted])])
    if op == FilterOperator.ALL:
        return qe.Filter(must=[_kind("list", key)] + [_element_equals(leaf, item) for item in wanted])
    if op == FilterOperator.TEXT_MATCH:
        return _substring(key, wanted, _path(key))
    if op == FilterOperator.TEXT_MATCH_INSENSITIVE:
        return _substring(key, wanted.lower(), f"{LOWER_FIELD}.{key}")
    if op == FilterOperator.IS_EMPTY:
        present = qe.FieldCondition(KINDS_FIELD, match=qe.MatchAny([f"{k}:{key}" for k in _VALUE_KINDS]))
        return qe.Filter(should=[qe.Filter(must_not=[present]), _kind("empty", key)])
    raise ValueError(f"unsupported filter operator {op!r}; allowed: {[o.value for o in FilterOperator]}")


def _translate(filters: Union[MetadataFilters, MetadataFilter]) -> Any:
    if isinstance(filters, MetadataFilter):
        return _translate_leaf(filters)
    subs = [_translate(sub) for sub in filters.filters]
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return qe.Filter(must=subs)
    if condition == FilterCondition.OR:
        return _any_of(subs)
    if condition == FilterCondition.NOT:
        return qe.Filter(must_not=subs)
    raise ValueError(f"unsupported filter condition {condition!r}; allowed: {[c.value for c in FilterCondition]}")


def translate_filters(filters: Optional[MetadataFilters]) -> Optional["qe.Filter"]:
    """The Qdrant filter meaning exactly what ``metadata_matches`` means for ``filters`` (None: no filter).

    Validates with ``validate_filters`` first; raises ValueError for a filter Qdrant cannot evaluate
    exactly (string ranges, list equality, keys that are not plain names, numbers beyond 2**53).
    """
    validate_filters(filters)
    if filters is None:
        return None
    translated = _translate(filters)
    return translated if isinstance(translated, qe.Filter) else qe.Filter(must=[translated])


# --------------------------------------------------------------------------------------------
# Query building (pure)
# --------------------------------------------------------------------------------------------


def _check_limit(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    return value


def check_fusion(fusion: Optional[str]) -> Optional[str]:
    """``fusion`` if it is None or one of :data:`FUSIONS`; else a ValueError listing them."""
    if fusion is not None and fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {list(FUSIONS)} or None, got {fusion!r}")
    return fusion


def build_query_request(
    *,
    dense: Optional[Sequence[float]] = None,
    sparse: Optional[SparseInput] = None,
    filter: Optional["qe.Filter"] = None,
    limit: int = 10,
    fusion: Optional[str] = None,
    prefetch_limit: Optional[int] = None,
    rrf_k: int = 60,
    dense_name: str = DENSE_VECTOR,
    sparse_name: str = SPARSE_VECTOR,
) -> "qe.QueryRequest":
    """One query: a single leg (``fusion=None``), or a prefetch per leg fused by RRF or DBSF.

    ``rrf_k`` follows the package convention ``1 / (k + rank)`` with ranks from 1; Qdrant's ranks
    start at 0, so it gets ``k + 1``. The filter applies to every prefetch and to the fused result.
    """
    _check_limit("limit", limit)
    check_fusion(fusion)
    legs: List[Any] = []
    if dense is not None:
        vector = np.asarray(dense, dtype=np.float32)
        if vector.ndim != 1 or not np.isfinite(vector).all():
            raise ValueError(f"dense query must be a 1-d vector of finite floats, got shape {vector.shape}")
        legs.append(qe.Query.Nearest(vector.tolist(), using=dense_name))
    if sparse is not None:
        legs.append(qe.Query.Nearest(to_sparse(sparse), using=sparse_name))
    if not legs:
        raise ValueError("query needs dense=, sparse= or both")
    if fusion is None:
        if len(legs) == 2:
            raise ValueError(f"two legs need a fusion; allowed: {list(FUSIONS)}")
        return qe.QueryRequest(limit=limit, query=legs[0], filter=filter, with_payload=True, with_vector=False)
    if len(legs) != 2:
        raise ValueError(f"fusion={fusion!r} needs both dense= and sparse=; pass fusion=None for one leg")
    per_leg = _check_limit("prefetch_limit", prefetch_limit if prefetch_limit is not None else max(limit, 100))
    _check_limit("rrf_k", rrf_k)
    fused = qe.Fusion.Rrf(k=rrf_k + 1) if fusion == "rrf" else qe.Fusion.Dbsf()
    prefetches = [qe.Prefetch(limit=per_leg, query=leg, filter=filter) for leg in legs]
    return qe.QueryRequest(
        limit=limit, query=fused, prefetches=prefetches, filter=filter, with_payload=True, with_vector=False
    )


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSchema:
    """What ``store.json`` records: vector names and the dense dimension."""

    dense_dim: int
    dense_name: str = DENSE_VECTOR
    sparse_name: str = SPARSE_VECTOR

    def edge_config(self) -> "qe.EdgeConfig":
        """The Edge shard config: cosine dense vector, IDF-modified sparse vector."""
        return qe.EdgeConfig(
            vectors={self.dense_name: qe.EdgeVectorParams(size=self.dense_dim, distance=qe.Distance.Cosine)},
            sparse_vectors={self.sparse_name: qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf)},
        )

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, "engine": "qdrant-edge", **self.__dict__}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: Path) -> "StoreSchema":
        data = json.loads(text)
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"{source}: store format {data.get('format')!r} is not supported (expected {FORMAT_VERSION})")
        return cls(dense_dim=int(data["dense_dim"]), dense_name=data["dense_name"], sparse_name=data["sparse_name"])


class EdgeStore:
    """A Qdrant Edge shard in ``path/shard`` with its schema in ``path/store.json``.

    Use :meth:`create` or :meth:`open`; writes go to Edge's WAL, :meth:`flush` persists segments,
    :meth:`optimize` builds the HNSW and payload indexes (call it after bulk writes).
    """

    def __init__(self, shard: "qe.EdgeShard", path: Path, schema: StoreSchema) -> None:
        self._shard = shard
        self.path = path
        self.schema = schema

    @classmethod
    def create(cls, path: Union[str, Path], dense_dim: int, **names: str) -> "EdgeStore":
        """A new, empty store in ``path`` (created); ValueError if it already holds one."""
        path = Path(path)
        _check_limit("dense_dim", dense_dim)
        if (path / SCHEMA_FILE).exists():
            raise ValueError(f"{path} already holds a store; use EdgeStore.open")
        schema = StoreSchema(dense_dim=dense_dim, **names)
        path.mkdir(parents=True, exist_ok=True)
        shard = qe.EdgeShard.create(str(path / SHARD_DIR), schema.edge_config())
        shard.update(qe.UpdateOperation.create_field_index(KINDS_FIELD, qe.PayloadSchemaType.Keyword))
        tmp = path / (SCHEMA_FILE + ".tmp")
        tmp.write_text(schema.to_json(), encoding="utf-8")
        tmp.replace(path / SCHEMA_FILE)
        logger.info("created Edge store %s (dense dim %d)", path, dense_dim)
        return cls(shard, path, schema)

    @classmethod
    def open(cls, path: Union[str, Path]) -> "EdgeStore":
        """The store in ``path``; Edge checks the shard against the recorded schema."""
        path = Path(path)
        schema_file = path / SCHEMA_FILE
        if not schema_file.exists():
            raise FileNotFoundError(f"{path} holds no Edge store ({SCHEMA_FILE} missing); use EdgeStore.create")
        schema = StoreSchema.from_json(schema_file.read_text(encoding="utf-8"), schema_file)
        shard = qe.EdgeShard.load(str(path / SHARD_DIR), schema.edge_config())
        return cls(shard, path, schema)

    def __enter__(self) -> "EdgeStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def shard(self) -> "qe.EdgeShard":
        if self._shard is None:
            raise RuntimeError(f"Edge store {self.path} is closed")
        return self._shard

    def upsert(self, nodes: Sequence[TextNode], dense_vectors: Any, sparse_vectors: Sequence[SparseInput]) -> None:
        """Insert or replace one point per node (same node id: replaced)."""
        nodes = list(nodes)
        dense = check_dense(dense_vectors, self.schema.dense_dim, len(nodes))
        sparse = list(sparse_vectors)
        if len(sparse) != len(nodes):
            raise ValueError(f"got {len(nodes)} nodes but {len(sparse)} sparse vectors")
        ids = [node.node_id for node in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("nodes contain repeated node ids")
        points = [
            qe.Point(
                point_id(node.node_id),
                {self.schema.dense_name: dense[i].tolist(), self.schema.sparse_name: to_sparse(sparse[i])},
                node_payload(node),
            )
            for i, node in enumerate(nodes)
        ]
        for start in range(0, len(points), UPSERT_BATCH):
            self.shard.update(qe.UpdateOperation.upsert_points(points[start : start + UPSERT_BATCH]))
        logger.debug("upserted %d points into %s", len(points), self.path)

    def delete(self, node_ids: Iterable[str]) -> None:
        """Delete the points of ``node_ids`` (unknown ids are ignored)."""
        ids = [point_id(node_id) for node_id in node_ids]
        if ids:
            self.shard.update(qe.UpdateOperation.delete_points(ids))

    def count(self, filters: Optional[MetadataFilters] = None) -> int:
        """Exact number of points (matching ``filters`` when given)."""
        return int(self.shard.count(qe.CountRequest(exact=True, filter=translate_filters(filters))))

    def retrieve(self, node_ids: Sequence[str]) -> List[TextNode]:
        """The stored nodes of ``node_ids``, in that order; unknown ids are skipped."""
        records = self.shard.retrieve([point_id(n) for n in node_ids], True, False)
        by_id = {record.payload["node_id"]: record.payload for record in records}
        return [node_from_payload(by_id[n]) for n in node_ids if n in by_id]

    def query(
        self,
        *,
        dense: Optional[Sequence[float]] = None,
        sparse: Optional[SparseInput] = None,
        filter: Optional[MetadataFilters] = None,
        limit: int = 10,
        fusion: Optional[str] = None,
        prefetch_limit: Optional[int] = None,
        rrf_k: int = 60,
    ) -> List[StoreHit]:
        """Top ``limit`` points for one leg or two fused legs (see :func:`build_query_request`)."""
        request = build_query_request(
            dense=dense,
            sparse=sparse,
            filter=translate_filters(filter),
            limit=limit,
            fusion=fusion,
            prefetch_limit=prefetch_limit,
            rrf_k=rrf_k,
            dense_name=self.schema.dense_name,
            sparse_name=self.schema.sparse_name,
        )
        if dense is not None and len(dense) != self.schema.dense_dim:
            raise ValueError(f"dense query has {len(dense)} dimensions, the store {self.schema.dense_dim}")
        return [StoreHit(p.payload["node_id"], float(p.score), p.payload) for p in self.shard.query(request)]

    def index_metadata_key(self, key: str, kind: str = "keyword") -> None:
        """Add a payload index on ``metadata.<key>`` (``keyword``, ``integer`` or ``float``) for fast filters."""
        kinds = {"keyword": qe.PayloadSchemaType.Keyword, "integer": qe.PayloadSchemaType.Integer, "float": qe.PayloadSchemaType.Float}
        if kind not in kinds:
            raise ValueError(f"kind must be one of {sorted(kinds)}, got {kind!r}")
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ValueError(f"metadata key {key!r} is not supported: keys must match {_KEY_RE.pattern}")
        self.shard.update(qe.UpdateOperation.create_field_index(_path(key), kinds[kind]))

    def flush(self) -> None:
        """Persist pending changes to the segments."""
        self.shard.flush()

    def optimize(self) -> bool:
        """Run Edge's optimizers (HNSW, payload indexes) until done; True when anything changed."""
        return bool(self.shard.optimize())

    def close(self) -> None:
        """Flush and release the shard (idempotent)."""
        if self._shard is not None:
            self._shard.flush()
            self._shard.close()
            self._shard = None


# --------------------------------------------------------------------------------------------
# Point stores: the surface HybridIndex writes and searches through, with two transports
# --------------------------------------------------------------------------------------------

STORE_LOCK = ".store.lock"
SERVER_UPSERT_BATCH = 256
SCROLL_PAGE = 2048


class StoredPoint(NamedTuple):
    """One stored point as read back: id, payload, dense vector, sparse ``(indices, values)``."""

    point_id: str
    payload: Dict[str, Any]
    dense: List[float]
    sparse: Tuple[List[int], List[float]]


class StoreBusyError(RuntimeError):
    """The embedded store is open in another process (or another open index of this one)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} is open in another process")
        self.path = path


class StoreDamagedError(DamagedIndexError):
    """The engine could not read the store's files (a ``DamagedIndexError``: ``rkit`` exit 4)."""

    def __init__(self, path: Path, problem: str) -> None:
        storage_dir = path.parent if path.name != SCHEMA_FILE else path.parent.parent
        super().__init__(path, problem, storage_dir)
        self.path = path
        self.problem = problem


def is_engine_panic(exc: BaseException) -> bool:
    """A Rust panic inside Qdrant Edge: ``pyo3_runtime.PanicException``, a ``BaseException`` that
    ``except Exception`` misses."""
    return type(exc).__name__ == "PanicException"


def is_engine_error(exc: BaseException) -> bool:
    """An error raised inside Qdrant Edge: its errors are bare ``Exception``s, or a panic."""
    return type(exc) is Exception or is_engine_panic(exc)


@contextlib.contextmanager
def engine_reads(path: Path, what: str) -> Iterator[None]:
    """Engine errors while reading ``path`` become a :class:`StoreDamagedError` naming it."""
    try:
        yield
    except BaseException as exc:
        if is_engine_error(exc):
            raise StoreDamagedError(path, f"could not be {what} by Qdrant Edge ({type(exc).__name__}: {str(exc)[:300]})") from exc
        raise


@contextlib.contextmanager
def engine_writes(path: Path) -> Iterator[None]:
    """An engine panic while writing becomes a RuntimeError (handled like any failed write)."""
    try:
        yield
    except BaseException as exc:
        if is_engine_panic(exc):
            raise RuntimeError(f"Qdrant Edge failed writing {path}: {str(exc)[:300]}") from exc
        raise


def sparse_parts(vector: Any) -> Tuple[List[int], List[float]]:
    """``(indices, values)`` of a sparse vector given as qdrant-client ``SparseVector`` (anything
    with ``.indices`` / ``.values``), ``{index: weight}`` or ``(indices, weights)``."""
    if hasattr(vector, "indices") and hasattr(vector, "values"):
        return [int(i) for i in vector.indices], [float(v) for v in vector.values]
    if isinstance(vector, Mapping):
        return [int(i) for i in vector.keys()], [float(v) for v in vector.values()]
    if isinstance(vector, tuple) and len(vector) == 2:
        return [int(i) for i in vector[0]], [float(v) for v in vector[1]]
    raise ValueError(f"sparse vector must be a SparseVector, {{index: weight}} or (indices, weights), got {vector!r:.80}")


class EdgePoints:
    """The embedded transport: a Qdrant Edge shard (:class:`EdgeStore` layout) in ``path``.

    Edge keeps its WAL exclusive to one open shard, and a second *failed* open of a shard that is
    open elsewhere was seen to damage the open one's segments (qdrant-edge-py 0.9.0). So the shard
    is only ever opened while holding ``path/.store.lock`` (flock): a second open, from this or
    another process, is a :class:`StoreBusyError` before Edge touches any file.
    """

    kind = "edge"

    def __init__(self, path: Union[str, Path], fresh: bool = False) -> None:
        """Open (or prepare) the store in ``path``; ``fresh=True`` deletes a shard found there
        first (under the lock: never one open elsewhere)."""
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(self.path / STORE_LOCK)
        try:
            self._lock.acquire(timeout=0)
        except IndexWriteLockedError:
            raise StoreBusyError(self.path) from None
        self._store: Optional[EdgeStore] = None
        try:
            if fresh:
                (self.path / SCHEMA_FILE).unlink(missing_ok=True)
                remove_path(self.path / SHARD_DIR)
            schema_file = self.path / SCHEMA_FILE
            if schema_file.exists():
                try:
                    StoreSchema.from_json(schema_file.read_text(encoding="utf-8"), schema_file)
                except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                    raise StoreDamagedError(schema_file, f"cannot be read ({type(exc).__name__}: {exc})") from exc
                with engine_reads(self.path, "opened"):
                    self._store = EdgeStore.open(self.path)
        except BaseException:
            self._lock.release()
            raise

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def closed(self) -> bool:
        return not self._lock.held

    def _check_open(self) -> None:
        if not self._lock.held:
            raise RuntimeError(f"the point store {self.path} is closed")

    def _shard(self) -> "qe.EdgeShard":
        self._check_open()
        if self._store is None:
            raise RuntimeError(f"{self.path} holds no shard yet (create() it first)")
        return self._store.shard

    def exists(self) -> bool:
        self._check_open()
        return self._store is not None

    @property
    def dense_dim(self) -> Optional[int]:
        return self._store.schema.dense_dim if self._store is not None else None

    def create(self, dense_dim: int) -> None:
        """Create the shard (dense ``dense_dim``, cosine; sparse with the IDF modifier)."""
        if self._store is None:
            self._store = EdgeStore.create(self.path, dense_dim)

    def upsert_points(self, point_ids: Sequence[str], dense: np.ndarray, sparse: Sequence[Any], payloads: Sequence[Mapping[str, Any]]) -> None:
        """Insert or replace points (ids from :func:`point_id`)."""
        self._check_open()
        schema = self._store.schema if self._store is not None else None
        if schema is None:
            raise RuntimeError(f"{self.path} holds no shard yet (create() it first)")
        dense = check_dense(dense, schema.dense_dim, len(point_ids))
        points = []
        for pid, vec, sp, payload in zip(point_ids, dense, sparse, payloads):
            indices, values = sparse_parts(sp)
            vectors = {schema.dense_name: vec.tolist(), schema.sparse_name: qe.SparseVector(indices, values)}
            points.append(qe.Point(pid, vectors, dict(payload)))
        for start in range(0, len(points), UPSERT_BATCH):
            with engine_writes(self.path):
                self._shard().update(qe.UpdateOperation.upsert_points(points[start : start + UPSERT_BATCH]))

    def delete_points(self, point_ids: Sequence[str]) -> None:
        self._check_open()
        if point_ids and self._store is not None:
            with engine_writes(self.path):
                self._shard().update(qe.UpdateOperation.delete_points(list(point_ids)))

    def count(self) -> int:
        self._check_open()
        if self._store is None:
            return 0
        with engine_reads(self.path, "counted"):
            return self._store.count()

    def dense_vectors(self) -> Dict[str, List[float]]:
        """Every point's dense vector, by point id."""
        self._check_open()
        if self._store is None:
            return {}
        name = self._store.schema.dense_name
        out: Dict[str, List[float]] = {}
        offset = None
        while True:
            with engine_reads(self.path, "read"):
                records, offset = self._shard().scroll(qe.ScrollRequest(limit=SCROLL_PAGE, offset=offset, with_payload=False, with_vector=[name]))
            for record in records:
                vector = (record.vector or {}).get(name)
                if vector is None:
                    raise StoreDamagedError(self.path, f"holds point {record.id} without its dense vector {name!r}")
                out[str(record.id)] = vector
            if offset is None:
                return out

    def iter_points(self) -> Iterable[StoredPoint]:
        """Every stored point with its payload and both vectors (for checks and copies)."""
        self._check_open()
        if self._store is None:
            return
        schema = self._store.schema
        offset = None
        while True:
            with engine_reads(self.path, "read"):
                records, offset = self._shard().scroll(qe.ScrollRequest(limit=SCROLL_PAGE, offset=offset, with_payload=True, with_vector=True))
            for record in records:
                vectors = record.vector or {}
                sparse = vectors.get(schema.sparse_name)
                parts = sparse_parts(sparse) if sparse is not None else ([], [])
                yield StoredPoint(str(record.id), dict(record.payload or {}), list(vectors.get(schema.dense_name) or []), parts)
            if offset is None:
                return

    def ids_filter(self, allowed_node_ids: Sequence[str], excluded_node_ids: Sequence[str]) -> "qe.Filter":
        """A filter admitting exactly ``allowed_node_ids`` (the shorter list goes into the request)."""
        if len(excluded_node_ids) < len(allowed_node_ids):
            return qe.Filter(must_not=[qe.HasIdCondition({point_id(n) for n in excluded_node_ids})])
        return qe.Filter(must=[qe.HasIdCondition({point_id(n) for n in allowed_node_ids})])

    def search(
        self,
        dense: Optional[Sequence[float]],
        sparse: Any = None,
        *,
        limit: int,
        prefetch_limit: int = 100,
        rrf_k: int = 60,
        filter: Any = None,
        fusion: str = "rrf",
    ) -> List[Tuple[Dict[str, Any], float]]:
        """``(payload, score)`` of the top ``limit`` points: dense only (``sparse=None``, cosine
        scores), sparse only (``dense=None``, IDF-weighted dot products), else an RRF of a dense and
        a sparse prefetch fused by ``fusion``: ``"rrf"`` (``1 / (rrf_k + rank)``, ranks from 1) or
        ``"dbsf"`` (each leg's scores normalised by mean +- 3 standard deviations, then summed); a
        sparse vector without terms leaves its prefetch out. Scores are float32 (the engine's)."""
        self._check_open()
        schema = self._store.schema if self._store is not None else None
        if schema is None:
            return []
        if dense is None:
            indices, values = sparse_parts(sparse)
            if not indices:
                return []
            query = qe.Query.Nearest(qe.SparseVector(indices, values), using=schema.sparse_name)
            request = qe.QueryRequest(limit=limit, query=query, filter=filter, with_payload=True, with_vector=False)
            with engine_reads(self.path, "searched"):
                return [(dict(p.payload or {}), float(p.score)) for p in self._shard().query(request)]
        vector = [float(x) for x in dense]
        nearest = qe.Query.Nearest(vector, using=schema.dense_name)
        if sparse is None:
            request = qe.QueryRequest(limit=limit, query=nearest, filter=filter, with_payload=True, with_vector=False)
        else:
            prefetches = [qe.Prefetch(limit=prefetch_limit, query=nearest, filter=filter)]
            indices, values = sparse_parts(sparse)
            if indices:
                query = qe.Query.Nearest(qe.SparseVector(indices, values), using=schema.sparse_name)
                prefetches.append(qe.Prefetch(limit=prefetch_limit, query=query, filter=filter))
            fused = qe.Fusion.Dbsf() if fusion == "dbsf" else qe.Fusion.Rrf(k=int(rrf_k) + 1)
            request = qe.QueryRequest(limit=limit, query=fused, prefetches=prefetches, filter=filter, with_payload=True, with_vector=False)
        with engine_reads(self.path, "searched"):
            return [(dict(p.payload or {}), float(p.score)) for p in self._shard().query(request)]

    def flush(self) -> None:
        if self._store is not None:
            with engine_writes(self.path):
                self._store.flush()

    def optimize(self) -> None:
        """Build HNSW and payload indexes (after bulk writes)."""
        if self._store is not None:
            with engine_writes(self.path):
                self._store.optimize()

    def refresh(self) -> None:
        """Flush, then reload the shard (keeping the lock). qdrant-edge-py 0.9.0 keeps counting
        deleted and replaced points in the sparse vectors' IDF statistics (N, n_t) until the shard
        is loaded again, so a live shard would rank differently from the same shard reopened; a
        write ends with this, so queries always see the statistics of the stored points."""
        if self._store is not None:
            with engine_writes(self.path):
                self._store.close()
            with engine_reads(self.path, "reopened"):
                self._store = EdgeStore.open(self.path)

    def close(self) -> None:
        """Flush and close the shard, then release the lock (idempotent)."""
        try:
            if self._store is not None:
                self._store.close()
                self._store = None
        finally:
            self._lock.release()


def point_ids_filter(allowed_ids: Sequence[str], excluded_ids: Sequence[str]) -> Any:
    """A qdrant-client filter admitting exactly the points ``allowed_ids`` (all others are
    ``excluded_ids``): whichever list is shorter goes into the request (``has_id``, or
    ``must_not`` ``has_id``); an empty allowed list admits nothing."""
    from qdrant_client import models

    if len(excluded_ids) < len(allowed_ids):
        if not excluded_ids:
            return models.Filter()
        return models.Filter(must_not=[models.HasIdCondition(has_id=list(excluded_ids))])
    return models.Filter(must=[models.HasIdCondition(has_id=list(allowed_ids))])


def sparse_vectors_config() -> Dict[str, Any]:
    """The sparse vector of a hybrid collection on a server: BM25 weights with Qdrant's IDF modifier."""
    from qdrant_client import models

    return {SPARSE_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)}


class ServerPoints:
    """The server transport: a collection on a Qdrant server or cluster through qdrant-client
    (also qdrant-client's local mode, which stands in for a server in tests).

    Payloads are written as LlamaIndex's ``QdrantVectorStore`` writes them, so the collection is
    also readable as a ``QdrantVectorStore``.
    """

    kind = "server"

    def __init__(self, client: Any, collection: str, url: Optional[str] = None) -> None:
        self.client = client
        self.collection = collection
        self.url = url
        self._closed = False

    @property
    def location(self) -> str:
        return f"Qdrant collection {self.collection!r} at {self.url}" if self.url else f"Qdrant collection {self.collection!r}"

    @property
    def closed(self) -> bool:
        return self._closed

    def exists(self) -> bool:
        return bool(self.client.collection_exists(self.collection))

    @property
    def dense_dim(self) -> Optional[int]:
        if not self.exists():
            return None
        vectors = self.client.get_collection(self.collection).config.params.vectors
        return int(vectors[DENSE_VECTOR].size)

    def create(self, dense_dim: int) -> None:
        from qdrant_client import models

        if self.exists():
            return
        self.client.create_collection(
            self.collection,
            vectors_config={DENSE_VECTOR: models.VectorParams(size=dense_dim, distance=models.Distance.COSINE)},
            sparse_vectors_config=sparse_vectors_config(),
        )

    def upsert_points(self, point_ids: Sequence[str], dense: np.ndarray, sparse: Sequence[Any], payloads: Sequence[Mapping[str, Any]]) -> None:
        from qdrant_client import models

        points = []
        for pid, vec, sp, payload in zip(point_ids, np.asarray(dense, dtype=np.float32), sparse, payloads):
            indices, values = sparse_parts(sp)
            vector = {DENSE_VECTOR: vec.tolist(), SPARSE_VECTOR: models.SparseVector(indices=indices, values=values)}
            points.append(models.PointStruct(id=pid, vector=vector, payload=dict(payload)))
        for start in range(0, len(points), SERVER_UPSERT_BATCH):
            self.client.upsert(self.collection, points=points[start : start + SERVER_UPSERT_BATCH], wait=True)

    def delete_points(self, point_ids: Sequence[str]) -> None:
        from qdrant_client import models

        if point_ids and self.exists():
            self.client.delete(self.collection, points_selector=models.PointIdsList(points=list(point_ids)))

    def count(self) -> int:
        return int(self.client.count(self.collection, exact=True).count) if self.exists() else 0

    def dense_vectors(self) -> Dict[str, List[float]]:
        if not self.exists():
            return {}
        out: Dict[str, List[float]] = {}
        offset = None
        while True:
            points, offset = self.client.scroll(
                self.collection, limit=SCROLL_PAGE, offset=offset, with_payload=False, with_vectors=[DENSE_VECTOR]
            )
            for point in points:
                out[str(point.id)] = point.vector[DENSE_VECTOR]
            if offset is None:
                return out

    def iter_points(self) -> Iterable[StoredPoint]:
        """Every stored point with its payload and both vectors."""
        if not self.exists():
            return
        offset = None
        while True:
            points, offset = self.client.scroll(self.collection, limit=SCROLL_PAGE, offset=offset, with_payload=True, with_vectors=True)
            for point in points:
                vectors = point.vector or {}
                sparse = vectors.get(SPARSE_VECTOR)
                parts = sparse_parts(sparse) if sparse is not None else ([], [])
                yield StoredPoint(str(point.id), dict(point.payload or {}), list(vectors.get(DENSE_VECTOR) or []), parts)
            if offset is None:
                return

    def ids_filter(self, allowed_node_ids: Sequence[str], excluded_node_ids: Sequence[str]) -> Any:
        """As :meth:`EdgePoints.ids_filter`, as a qdrant-client filter."""
        return point_ids_filter([point_id(n) for n in allowed_node_ids], [point_id(n) for n in excluded_node_ids])

    def search(
        self,
        dense: Optional[Sequence[float]],
        sparse: Any = None,
        *,
        limit: int,
        prefetch_limit: int = 100,
        rrf_k: int = 60,
        filter: Any = None,
        fusion: str = "rrf",
    ) -> List[Tuple[Dict[str, Any], float]]:
        """As :meth:`EdgePoints.search`, through the Query API."""
        from qdrant_client import models

        if dense is None:
            indices, values = sparse_parts(sparse)
            if not indices:
                return []
            response = self.client.query_points(
                collection_name=self.collection,
                query=models.SparseVector(indices=indices, values=values),
                using=SPARSE_VECTOR,
                limit=limit,
                query_filter=filter,
                with_payload=True,
            )
            return [(dict(p.payload or {}), float(p.score)) for p in response.points]
        vector = [float(x) for x in dense]
        if sparse is None:
            response = self.client.query_points(
                collection_name=self.collection, query=vector, using=DENSE_VECTOR, limit=limit, query_filter=filter, with_payload=True
            )
        else:
            prefetch = [models.Prefetch(query=vector, using=DENSE_VECTOR, limit=prefetch_limit, filter=filter)]
            indices, values = sparse_parts(sparse)
            if indices:
                sparse_query = models.SparseVector(indices=indices, values=values)
                prefetch.append(models.Prefetch(query=sparse_query, using=SPARSE_VECTOR, limit=prefetch_limit, filter=filter))
            response = self.client.query_points(
                collection_name=self.collection,
                prefetch=prefetch,
                query=(
                    models.FusionQuery(fusion=models.Fusion.DBSF) if fusion == "dbsf" else models.RrfQuery(rrf=models.Rrf(k=int(rrf_k) + 1))
                ),
                limit=limit,
                query_filter=filter,
                with_payload=True,
            )
        return [(dict(p.payload or {}), float(p.score)) for p in response.points]

    def flush(self) -> None:
        """Server writes are acknowledged with ``wait=True``: nothing to flush."""

    def optimize(self) -> None:
        """The server optimises in the background."""

    def refresh(self) -> None:
        """Nothing to reload on a server."""

    def close(self) -> None:
        self._closed = True
        self.client.close()
