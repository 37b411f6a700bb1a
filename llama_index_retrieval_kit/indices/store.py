"""The Qdrant side of an index: schema, point writes, filter translation, payload indexes and queries.

Every Qdrant call of the package lives here, behind one surface with two transports:
:class:`EdgePoints` (Qdrant Edge, ``qdrant-edge-py``, Qdrant's engine in-process; pinned) for a
storage folder, and :class:`ServerPoints` (qdrant-client) for a Qdrant server or cluster (and
qdrant-client's local mode, which stands in for a server in tests). What both run is built once,
transport-neutral, and only rendered per transport: filters (:func:`translate_filters`, a tree of
:class:`Clause` / :class:`Keyword` / ...) and queries (:func:`plan_search`). So an embedded index
and a server filter and rank the same way, and an upgrade of qdrant-edge-py that changes its API
or behaviour fails ``tests/indices/test_store_*.py`` and nothing else.

Point layout (one point per chunk):

* id: the node id when it is a UUID, else ``uuid5(NODE_ID_NAMESPACE, node_id)``;
* vectors: ``text-dense`` (cosine) and ``text-sparse-new`` (BM25 weights, IDF modifier);
* payload (:func:`node_payload`): LlamaIndex ``QdrantVectorStore``'s layout (the metadata keys at
  the top level, ``_node_content``, ``_node_type``, ``doc_id``/``document_id``/``ref_doc_id``),
  so a server collection reads as a ``QdrantVectorStore``; plus three bookkeeping fields that
  make metadata filters exact in the engine (:func:`filter_fields`):

  - ``_kinds``: tokens ``"<kind>:<key>"`` naming the Python type of each metadata value
    (``str``, ``num``, ``true``, ``false``, ``list``, with ``empty`` for ``""``/``[]``,
    ``upper`` for a string that lower-casing changes, ``ltrue``/``lfalse``/``lstr``/``lnum`` for
    what a list holds, ``other`` for a value the engine cannot compare exactly: dicts, nested
    lists, NaN, ints beyond 2**53, non-JSON types), and ``filters:1``, which says the point
    carries this bookkeeping. Stored as 62-bit integer codes (:func:`token_code`, blake2b):
    qdrant-edge-py 0.9.0 converts each payload string at ~8 us, an int at ~2 us, and a chunk
    of this package's parsers has about 15 tokens;
  - ``_lower``: the lower-cased value of each string that lower-casing changes (``upper``), for
    ``TEXT_MATCH_INSENSITIVE``;
  - ``_masked``: the values of metadata keys whose top-level field the layout (or this
    bookkeeping) uses for something else (``doc_id`` holds the node's ``ref_doc_id``, not
    ``metadata["doc_id"]``).

Filters mean exactly what :func:`~llama_index_retrieval_kit.retrievers.filters.metadata_matches`
means. Every condition on a metadata value is guarded by its ``_kinds`` token, because Qdrant
matches a condition against any element of a list and compares across types unlike Python.
:meth:`metadata_filter` uses the translation when it is exact for the stored points, and
otherwise (string ranges, list equality, keys that are not plain names, an ``other`` value of a
filtered key, points written before the bookkeeping existed) the list of matching point ids,
evaluated in Python on the indexed chunks: slower, never different.

Payload indexes: ``_kinds`` (integer, with the collection), and a metadata key's own index once a
filter on it runs in the engine: keyword when the key holds strings, else float when it holds
numbers (booleans need none: they are ``_kinds`` tokens); later writes upgrade it (float to
keyword) when strings arrive. Same rule on both transports. Only filtered keys get one: each
index costs every write (measured: a one-document upsert of the sample parser's chunks took
~3x as long with all 12 of its metadata keys indexed).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import operator
import re
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from llama_index.core.schema import BaseNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters
from llama_index.core.vector_stores.utils import node_to_metadata_dict

from .._enums import ChoiceEnum, EngineFusion
from ..retrievers.filters import DOCUMENT_ID_ALIASES, metadata_matches, validate_filters
from .storage import DamagedIndexError, FileLock, IndexWriteLockedError, fsync_dir, remove_path

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
FUSIONS: Tuple[str, ...] = tuple(f.value for f in EngineFusion)
KINDS_FIELD = "_kinds"
LOWER_FIELD = "_lower"
MASKED_FIELD = "_masked"
#: In ``_kinds`` of every point that carries the filter bookkeeping.
BOOKKEEPING_TOKEN = "filters:1"
#: The top-level payload fields LlamaIndex's ``QdrantVectorStore`` layout writes itself.
LAYOUT_FIELDS: Tuple[str, ...] = ("_node_content", "_node_type", "document_id", "doc_id", "ref_doc_id")
BOOKKEEPING_FIELDS: Tuple[str, ...] = (KINDS_FIELD, LOWER_FIELD, MASKED_FIELD)
MAX_EXACT_INT = 2**53
UPSERT_BATCH = 1024
SERVER_UPSERT_BATCH = 256
SCROLL_PAGE = 2048
STORE_LOCK = ".store.lock"

SparseInput = Union[Mapping[int, float], Tuple[Sequence[int], Sequence[float]], Any]

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_NO_POINT_TOKEN = "none"  # no point holds it: every token but this one has a ':'
_CODE_BITS = 62
_VALUE_KINDS = ("str", "num", "true", "false", "list")  # a key with none of these is missing (or None)
_SCALAR_KINDS = ("str", "num", "true", "false")  # a single (not list) exactly comparable value
_ORDER_FUNCS: Dict[FilterOperator, Callable[[Any, Any], bool]] = {
    FilterOperator.GT: operator.gt,
    FilterOperator.GTE: operator.ge,
    FilterOperator.LT: operator.lt,
    FilterOperator.LTE: operator.le,
}


# --------------------------------------------------------------------------------------------
# Point ids, payload and vectors (pure)
# --------------------------------------------------------------------------------------------


#: A UUID in its canonical text form (what ``str(uuid.UUID(...))`` writes), e.g. every chunk id.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def point_id(node_id: str) -> str:
    """The Qdrant point id of ``node_id``: the node id itself when it is a UUID (canonical form),
    else its uuid5."""
    if type(node_id) is str and _CANONICAL_UUID.fullmatch(node_id):
        return node_id  # what the parse below returns, in a fifth of the time
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"node id must be a non-empty str, got {node_id!r}")
    try:
        return str(uuid.UUID(node_id))
    except ValueError:
        return str(uuid.uuid5(NODE_ID_NAMESPACE, node_id))


def _is_exact_scalar(value: Any) -> bool:
    """A value the engine stores and compares exactly: str, bool, int within +-2**53, finite float
    (exact types: a subclass may compare or serialise differently)."""
    kind = type(value)
    if kind is str or kind is bool:
        return True
    if kind is int:
        return abs(value) <= MAX_EXACT_INT
    if kind is float:
        return math.isfinite(value)
    return False


_STR_KINDS = ("str",)
_EMPTY_STR_KINDS = ("str", "empty")
_UPPER_STR_KINDS = ("str", "upper")


@functools.lru_cache(maxsize=1 << 14)
def _plain_key(key: str) -> bool:
    """Whether ``key`` is a plain name (``[A-Za-z0-9_-]+``): only those get ``_kinds`` tokens."""
    return _KEY_RE.match(key) is not None


def _value_kinds(value: Any) -> Optional[Tuple[str, ...]]:
    """The ``_kinds`` kinds of one metadata value (not None); None when it is not exactly comparable."""
    kind = type(value)
    if kind is list or kind is tuple:
        if not all(_is_exact_scalar(item) for item in value):
            return None
        kinds = ["list"]
        if not value:
            kinds.append("empty")
        if any(item is True for item in value):
            kinds.append("ltrue")
        if any(item is False for item in value):
            kinds.append("lfalse")
        if any(type(item) is str for item in value):
            kinds.append("lstr")
        if any(type(item) in (int, float) for item in value):
            kinds.append("lnum")
        return tuple(kinds)
    if not _is_exact_scalar(value):
        return None
    if kind is bool:
        return ("true",) if value else ("false",)
    if kind is str:
        return _UPPER_STR_KINDS if value.lower() != value else _EMPTY_STR_KINDS if not value else _STR_KINDS
    return ("num",)


def _keyed_kinds(metadata: Mapping[str, Any]) -> Iterator[Tuple[str, Any, Optional[Tuple[str, ...]]]]:
    """``(key, value, kinds)`` of the keys ``_kinds`` describes: plain names (``[A-Za-z0-9_-]+``;
    filters on other keys are never translated) with a value (None = missing)."""
    for key, value in metadata.items():
        if value is not None and isinstance(key, str) and _plain_key(key):
            yield key, value, _value_kinds(value)


def _key_tokens(key: str, kinds: Optional[Tuple[str, ...]]) -> List[str]:
    """The ``_kinds`` tokens of one key whose value has ``kinds`` (None: not exactly comparable)."""
    return [f"other:{key}"] if kinds is None else [f"{kind}:{key}" for kind in kinds]


def kind_tokens(metadata: Mapping[str, Any]) -> List[str]:
    """The ``_kinds`` tokens of ``metadata`` (see the module docstring); never raises."""
    tokens = [BOOKKEEPING_TOKEN]
    for key, _, kinds in _keyed_kinds(metadata):
        tokens += _key_tokens(key, kinds)
    return tokens


@functools.lru_cache(maxsize=1 << 16)
def token_code(token: str) -> int:
    """The integer stored in ``_kinds`` for a token: its blake2b hash, 62 bits (two tokens of one
    index share a code with odds below 1e-12 even at a million distinct tokens)."""
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little") >> (64 - _CODE_BITS)


_BOOKKEEPING_CODE = token_code(BOOKKEEPING_TOKEN)


def metadata_field(key: str) -> str:
    """The payload path holding ``metadata[key]``: the top-level field, or ``_masked.<key>`` for a
    key whose top-level field the layout or the bookkeeping uses."""
    return f"{MASKED_FIELD}.{key}" if key in LAYOUT_FIELDS or key in BOOKKEEPING_FIELDS else key


@functools.lru_cache(maxsize=1 << 16)
def _key_kind_codes(key: str, kinds: Optional[Tuple[str, ...]]) -> Tuple[int, ...]:
    """The codes of :func:`_key_tokens` (memoised: chunks of one corpus share their keys and kinds)."""
    return tuple(token_code(token) for token in _key_tokens(key, kinds))


_MASKED_KEYS = frozenset(LAYOUT_FIELDS) | frozenset(BOOKKEEPING_FIELDS)


def filter_fields(metadata: Mapping[str, Any]) -> Dict[str, Any]:
    """The bookkeeping fields stored beside the layout so that filters on ``metadata`` are exact
    (``_lower`` and ``_masked`` only when they hold something).

    ``_kinds`` holds the :func:`token_code` of each of :func:`kind_tokens` (in that order).
    """
    codes: List[int] = [_BOOKKEEPING_CODE]
    lower: Dict[str, str] = {}
    masked: Dict[str, Any] = {}
    for key, value, kinds in _keyed_kinds(metadata):
        codes.extend(_key_kind_codes(key, kinds))
        if kinds is _UPPER_STR_KINDS:
            lower[key] = value.lower()
        if kinds is not None and key in _MASKED_KEYS:
            masked[key] = list(value) if type(value) is tuple else value
    fields: Dict[str, Any] = {KINDS_FIELD: codes}
    if lower:  # left out when empty: every payload value costs the engine's conversion on each write
        fields[LOWER_FIELD] = lower
    if masked:
        fields[MASKED_FIELD] = masked
    return fields


def node_payload(node: BaseNode) -> Dict[str, Any]:
    """The payload of ``node``'s point: LlamaIndex ``QdrantVectorStore``'s layout plus
    :func:`filter_fields` of its metadata (``node`` is not changed)."""
    payload = node_to_metadata_dict(node, remove_text=False, flat_metadata=False)
    payload.update(filter_fields(node.metadata))
    return payload


def layout_metadata(payload: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The node metadata kept in a layout payload's ``_node_content``; None when it has none."""
    try:
        metadata = json.loads(payload["_node_content"]).get("metadata")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return metadata if isinstance(metadata, dict) else None


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


def sparse_parts(vector: SparseInput) -> Tuple[List[int], List[float]]:
    """``(indices, values)`` of a sparse vector given as a ``SparseVector`` (anything with
    ``.indices`` / ``.values``), ``{index: weight}`` or ``(indices, weights)``."""
    if hasattr(vector, "indices") and hasattr(vector, "values"):
        return [int(i) for i in vector.indices], [float(v) for v in vector.values]
    if isinstance(vector, Mapping):
        return [int(i) for i in vector.keys()], [float(v) for v in vector.values()]
    if isinstance(vector, tuple) and len(vector) == 2:
        return [int(i) for i in vector[0]], [float(v) for v in vector[1]]
    raise ValueError(f"sparse vector must be a SparseVector, {{index: weight}} or (indices, weights), got {vector!r:.80}")


class CheckedSparse(NamedTuple):
    """A sparse vector's ``(indices, values)`` as plain lists, already satisfying
    :func:`check_sparse` (distinct ``int`` indices in ``[0, 2**32)``, finite ``float`` values):
    what :func:`bm25_sparse_parts` makes, so a write does not check its own output again."""

    indices: List[int]
    values: List[float]


def bm25_sparse_parts(
    token_lists: Sequence[Sequence[str]], avgdl: float, k1: float, b: float, term_id: Callable[[str], int]
) -> List[CheckedSparse]:
    """``(indices, weights)`` of each document's BM25 sparse vector, for many documents at once:
    exactly ``retrievers.qdrant_hybrid.bm25_doc_vector`` of each (``term_id`` is its
    ``token_id``), ``tf / (tf + k1 * (1 - b + b * dl / avgdl))`` per distinct term, summed per
    term id, indices ascending, but in numpy over the whole batch (each distinct term hashed once).
    """
    if avgdl <= 0:
        raise ValueError(f"avgdl must be > 0, got {avgdl}")
    vocab: Dict[str, int] = {}
    flat = np.fromiter((vocab.setdefault(t, len(vocab)) for toks in token_lists for t in toks), dtype=np.int64)
    lengths = np.fromiter((len(toks) for toks in token_lists), dtype=np.int64, count=len(token_lists))
    if not flat.size:
        return [CheckedSparse([], []) for _ in token_lists]
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    # term frequencies: one entry per (document, term)
    pairs, tf = np.unique(doc * len(vocab) + flat, return_counts=True)
    pair_doc = pairs // len(vocab)
    ids = np.fromiter((term_id(t) for t in vocab), dtype=np.int64, count=len(vocab))[pairs % len(vocab)]
    tf = tf.astype(np.float64)
    norm = k1 * (1 - b + b * lengths[pair_doc].astype(np.float64) / avgdl)
    weights = tf / (tf + norm)
    # per document, by term id ascending; terms sharing an id (a hash collision) add up
    keys = pair_doc * (1 << 32) + ids
    order = np.argsort(keys, kind="stable")
    keys, weights = keys[order], weights[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    keys, weights = keys[starts], np.add.reduceat(weights, starts)
    if not np.isfinite(weights).all():
        raise ValueError(f"BM25 sparse weights are not finite (k1={k1!r}, b={b!r}, avgdl={avgdl!r})")
    bounds = np.searchsorted(keys >> 32, np.arange(len(lengths) + 1)).tolist()
    # ids are distinct per document (summed above) and masked to 32 bits; .tolist() gives int / float
    index_list, weight_list = (keys & 0xFFFFFFFF).tolist(), weights.tolist()
    return [CheckedSparse(index_list[bounds[i] : bounds[i + 1]], weight_list[bounds[i] : bounds[i + 1]]) for i in range(len(lengths))]


def _dense_rows(rows: Sequence[Sequence[float]], dim: int, where: Any) -> np.ndarray:
    """``rows`` (one stored page) as a float32 ``(len(rows), dim)`` matrix; a row of another length
    is a :class:`StoreDamagedError`."""
    try:
        block = np.asarray(rows, dtype=np.float32)
    except ValueError:  # ragged
        block = None
    if block is None or block.ndim != 2 or block.shape[1] != dim:
        lengths = sorted({len(r) for r in rows})
        raise StoreDamagedError(Path(str(where)), f"holds dense vectors of {lengths} dimensions, not {dim}")
    return block


def check_sparse(vector: SparseInput) -> Tuple[List[int], List[float]]:
    """:func:`sparse_parts` of ``vector``, checked: as many weights as indices, indices distinct
    ints in ``[0, 2**32)``, finite weights; else ValueError. A :class:`CheckedSparse` is returned as is."""
    if type(vector) is CheckedSparse:
        return vector
    if type(vector) is tuple and len(vector) == 2 and type(vector[0]) is list and type(vector[1]) is list:
        indices, values = vector  # already lists (bm25_sparse_parts): checked, not converted
        if not all(type(i) is int for i in indices) or not all(type(v) is float for v in values):
            indices, values = sparse_parts(vector)
    else:
        indices, values = sparse_parts(vector)
    if len(indices) != len(values):
        raise ValueError(f"sparse vector has {len(indices)} indices but {len(values)} weights")
    if indices and (min(indices) < 0 or max(indices) >= 2**32):
        raise ValueError(f"sparse indices must be ints in [0, 2**32), got {indices[:10]!r}")
    if len(set(indices)) != len(indices):
        raise ValueError("sparse vector has repeated indices")
    if not all(math.isfinite(w) for w in values):
        raise ValueError("sparse vector has NaN or inf weights")
    return indices, values


# --------------------------------------------------------------------------------------------
# Filters: one transport-neutral tree, rendered per transport (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyword:
    """``field`` equals ``value``, a string or an integer code (for a list field: some element does)."""

    field: str
    value: Union[str, int]


@dataclass(frozen=True)
class AnyKeyword:
    """``field`` equals one of ``values`` (strings, or integer codes)."""

    field: str
    values: Tuple[Union[str, int], ...]


@dataclass(frozen=True)
class Substring:
    """``field`` is a string containing ``text`` (case-sensitive)."""

    field: str
    text: str


@dataclass(frozen=True)
class NumberRange:
    """``field`` is a number within the bounds (booleans are not numbers here)."""

    field: str
    gt: Optional[float] = None
    gte: Optional[float] = None
    lt: Optional[float] = None
    lte: Optional[float] = None


@dataclass(frozen=True)
class PointIds:
    """The point id is one of ``ids``."""

    ids: FrozenSet[str]


@dataclass(frozen=True)
class Clause:
    """Qdrant's filter: every ``must``, at least one ``should`` (when any), no ``must_not``."""

    must: Tuple[Any, ...] = ()
    should: Tuple[Any, ...] = ()
    must_not: Tuple[Any, ...] = ()


Condition = Union[Keyword, AnyKeyword, Substring, NumberRange, PointIds, Clause]
NOTHING = Keyword(KINDS_FIELD, token_code(_NO_POINT_TOKEN))
LACKS_BOOKKEEPING = Clause(must_not=(Keyword(KINDS_FIELD, token_code(BOOKKEEPING_TOKEN)),))


class FilterRoute(ChoiceEnum):
    """How a :class:`PointFilter` selects points: translated metadata conditions run by the engine
    (``engine``), or the matching point ids, evaluated in Python (``id_list``)."""

    ENGINE = "engine"
    ID_LIST = "id_list"


@dataclass(frozen=True)
class PointFilter:
    """A filter both transports run (``tree``, rendered by each), and how it was obtained."""

    tree: Clause
    route: FilterRoute


class UntranslatableFilterError(ValueError):
    """A filter the engine cannot evaluate with ``metadata_matches``' exact meaning."""


def _kind(kind: str, key: str) -> Keyword:
    return Keyword(KINDS_FIELD, token_code(f"{kind}:{key}"))


def _any_of(parts: Sequence[Condition]) -> Condition:
    """OR of ``parts`` (an empty OR matches nothing; Qdrant's empty ``should`` matches all)."""
    if not parts:
        return NOTHING
    return parts[0] if len(parts) == 1 else Clause(should=tuple(parts))


def _check_filter_value(leaf: MetadataFilter, value: Any) -> None:
    if value is None or not _is_exact_scalar(value):
        raise UntranslatableFilterError(
            f"filter on {leaf.key!r} ({leaf.operator.value}) with value {value!r:.80}: only str, bool, finite float "
            "and int within +-2**53 compare exactly in the engine (Qdrant compares numbers as float64)"
        )


def _number_range(key: str, func: Callable[[Any, Any], bool], wanted: float) -> NumberRange:
    if func is operator.eq:
        return NumberRange(metadata_field(key), gte=wanted, lte=wanted)
    bound = {operator.gt: "gt", operator.ge: "gte", operator.lt: "lt", operator.le: "lte"}[func]
    return NumberRange(metadata_field(key), **{bound: wanted})


def _compare(key: str, func: Callable[[Any, Any], bool], wanted: Any) -> Condition:
    """Scalar ``func(actual, wanted)`` for a number ``wanted``: numbers by range, bools as 0/1 (as Python)."""
    parts: List[Condition] = [Clause(must=(_kind("num", key), _number_range(key, func, wanted)))]
    if func(True, wanted):
        parts.append(_kind("true", key))
    if func(False, wanted):
        parts.append(_kind("false", key))
    return _any_of(parts)


def _equals(leaf: MetadataFilter, wanted: Any) -> Condition:
    """``actual == wanted`` on a scalar metadata value (missing and lists never match)."""
    key = leaf.key
    if wanted is None:
        return NOTHING
    if isinstance(wanted, list):
        raise UntranslatableFilterError(
            f"filter on {key!r} ({leaf.operator.value}) with a list value {wanted!r:.80}: Qdrant cannot test "
            "list equality (it matches any element)"
        )
    _check_filter_value(leaf, wanted)
    if isinstance(wanted, str):
        return Clause(must=(_kind("str", key), Keyword(metadata_field(key), wanted)))
    return _compare(key, operator.eq, wanted)


def _element_equals(leaf: MetadataFilter, wanted: Any) -> Condition:
    """Some element of the (list) metadata value ``== wanted``; combine with the ``list`` kind."""
    key = leaf.key
    _check_filter_value(leaf, wanted)
    if isinstance(wanted, str):
        return Keyword(metadata_field(key), wanted)
    parts: List[Condition] = [NumberRange(metadata_field(key), gte=wanted, lte=wanted)]
    if wanted == 1:
        parts.append(_kind("ltrue", key))
    if wanted == 0:
        parts.append(_kind("lfalse", key))
    return _any_of(parts)


def _substring(key: str, text: str, field: str) -> Clause:
    return Clause(must=(_kind("str", key), Substring(field, text)))


def _translate_leaf(leaf: MetadataFilter) -> Condition:
    """A leaf's engine condition; a document-id alias key (:data:`DOCUMENT_ID_ALIASES`) reads its own
    value where the point has one, else ``doc_id``'s (as ``metadata_matches`` does)."""
    if leaf.key not in DOCUMENT_ID_ALIASES:
        return _translate_key_leaf(leaf)
    own = _translate_key_leaf(leaf)
    fallback = _translate_key_leaf(leaf.model_copy(update={"key": "doc_id"}))
    present = AnyKeyword(KINDS_FIELD, tuple(token_code(f"{k}:{leaf.key}") for k in _VALUE_KINDS))
    return Clause(should=(Clause(must=(present, own)), Clause(must=(fallback,), must_not=(present,))))


def _translate_key_leaf(leaf: MetadataFilter) -> Condition:
    op, wanted, key = leaf.operator, leaf.value, leaf.key
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise UntranslatableFilterError(f"filter key {key!r} is not supported in the engine: keys must match {_KEY_RE.pattern}")
    if op == FilterOperator.EQ:
        return _equals(leaf, wanted)
    if op == FilterOperator.NE:
        return Clause(must_not=(_equals(leaf, wanted),))
    if op in _ORDER_FUNCS:
        if isinstance(wanted, str):
            raise UntranslatableFilterError(
                f"filter on {key!r} ({op.value}) with a str value {wanted!r:.80}: Qdrant ranges are numeric, "
                "string ordering cannot be evaluated in the engine"
            )
        _check_filter_value(leaf, wanted)
        return _compare(key, _ORDER_FUNCS[op], wanted)
    if op == FilterOperator.IN:
        return _any_of([_equals(leaf, item) for item in wanted])
    if op == FilterOperator.NIN:
        return Clause(must_not=(_any_of([_equals(leaf, item) for item in wanted]),))
    if op == FilterOperator.CONTAINS:
        parts: List[Condition] = [Clause(must=(_kind("list", key), _element_equals(leaf, wanted)))]
        if isinstance(wanted, str):
            parts.append(_substring(key, wanted, metadata_field(key)))
        return _any_of(parts)
    if op == FilterOperator.ANY:  # in the list, or a single value equal to one of them
        in_list = Clause(must=(_kind("list", key), _any_of([_element_equals(leaf, item) for item in wanted])))
        return _any_of([in_list, *[_equals(leaf, item) for item in wanted]])
    if op == FilterOperator.ALL:  # all in the list, or a single value equal to each of them
        single = AnyKeyword(KINDS_FIELD, tuple(token_code(f"{k}:{key}") for k in _SCALAR_KINDS))
        return _any_of([
            Clause(must=(_kind("list", key), *[_element_equals(leaf, item) for item in wanted])),
            Clause(must=(single, *[_equals(leaf, item) for item in wanted])),
        ])
    if op == FilterOperator.TEXT_MATCH:
        return _substring(key, wanted, metadata_field(key))
    if op == FilterOperator.TEXT_MATCH_INSENSITIVE:
        lowered = wanted.lower()  # a string lower-casing changes is in _lower; others are their own lower case
        return Clause(
            should=(
                Clause(must=(_kind("upper", key), Substring(f"{LOWER_FIELD}.{key}", lowered))),
                Clause(must=(_kind("str", key), Substring(metadata_field(key), lowered)), must_not=(_kind("upper", key),)),
            )
        )
    if op == FilterOperator.IS_EMPTY:
        present = AnyKeyword(KINDS_FIELD, tuple(token_code(f"{k}:{key}") for k in _VALUE_KINDS))
        return Clause(should=(Clause(must_not=(present,)), _kind("empty", key)))
    raise UntranslatableFilterError(f"unsupported filter operator {op!r}; allowed: {[o.value for o in FilterOperator]}")


def _translate(filters: Union[MetadataFilters, MetadataFilter]) -> Condition:
    if isinstance(filters, MetadataFilter):
        return _translate_leaf(filters)
    subs = tuple(_translate(sub) for sub in filters.filters)
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return Clause(must=subs)
    if condition == FilterCondition.OR:
        return _any_of(subs)
    if condition == FilterCondition.NOT:
        return Clause(must_not=subs)
    raise ValueError(f"unsupported filter condition {condition!r}; allowed: {[c.value for c in FilterCondition]}")


def translate_filters(filters: Optional[MetadataFilters]) -> Optional[Clause]:
    """The engine filter meaning exactly what ``metadata_matches`` means for ``filters`` on points
    that carry the bookkeeping (None: no filter).

    Validates with ``validate_filters`` first (ValueError); raises :class:`UntranslatableFilterError`
    for a filter the engine cannot evaluate exactly (string ranges, list equality, keys that are
    not plain names, numbers beyond 2**53). Points whose value of a filtered key is ``other`` are
    not covered: :meth:`EdgePoints.metadata_filter` checks for them.
    """
    validate_filters(filters)
    if filters is None:
        return None
    translated = _translate(filters)
    return translated if isinstance(translated, Clause) else Clause(must=(translated,))


def filter_keys(filters: Union[MetadataFilters, MetadataFilter]) -> List[str]:
    """The metadata keys ``filters`` reads, sorted."""
    if isinstance(filters, MetadataFilter):
        return sorted({filters.key, "doc_id"}) if filters.key in DOCUMENT_ID_ALIASES else [filters.key]
    return sorted({key for sub in filters.filters for key in filter_keys(sub)})


def untranslated_points(keys: Sequence[str]) -> Clause:
    """The points on which a translation reading ``keys`` may not be exact: those without the
    bookkeeping, and those holding an ``other`` value of one of ``keys``."""
    others = tuple(token_code(f"other:{key}") for key in keys)
    return Clause(should=(LACKS_BOOKKEEPING, AnyKeyword(KINDS_FIELD, others)) if others else (LACKS_BOOKKEEPING,))


def id_list_filter(allowed_point_ids: Sequence[str], excluded_point_ids: Sequence[str]) -> PointFilter:
    """A filter admitting exactly ``allowed_point_ids`` (all others are ``excluded_point_ids``):
    whichever list is shorter goes into the request; an empty allowed list admits nothing."""
    if len(excluded_point_ids) < len(allowed_point_ids):
        tree = Clause(must_not=(PointIds(frozenset(excluded_point_ids)),)) if excluded_point_ids else Clause()
    else:
        tree = Clause(must=(PointIds(frozenset(allowed_point_ids)),) if allowed_point_ids else (NOTHING,))
    return PointFilter(tree, FilterRoute.ID_LIST)


def edge_filter(condition: Optional[Condition]) -> Any:
    """``condition`` as Qdrant Edge objects (``qe.Filter`` at the top)."""
    if condition is None:
        return None
    if isinstance(condition, Clause):
        parts = [[edge_filter(c) for c in group] or None for group in (condition.must, condition.should, condition.must_not)]
        return qe.Filter(must=parts[0], should=parts[1], must_not=parts[2])
    if isinstance(condition, Keyword):
        return qe.FieldCondition(condition.field, match=qe.MatchValue(condition.value))
    if isinstance(condition, AnyKeyword):
        return qe.FieldCondition(condition.field, match=qe.MatchAny(list(condition.values)))
    if isinstance(condition, Substring):
        return qe.FieldCondition(condition.field, match=qe.MatchSubstring(condition.text))
    if isinstance(condition, NumberRange):
        bounds = {b: float(v) for b in ("gt", "gte", "lt", "lte") for v in [getattr(condition, b)] if v is not None}
        return qe.FieldCondition(condition.field, range=qe.RangeFloat(**bounds))
    if isinstance(condition, PointIds):
        return qe.HasIdCondition(set(condition.ids))
    raise TypeError(f"not a filter condition: {condition!r:.80}")


def client_filter(condition: Optional[Condition]) -> Any:
    """``condition`` as qdrant-client models (``models.Filter`` at the top)."""
    from qdrant_client import models

    if condition is None:
        return None
    if isinstance(condition, Clause):
        parts = [[client_filter(c) for c in group] or None for group in (condition.must, condition.should, condition.must_not)]
        return models.Filter(must=parts[0], should=parts[1], must_not=parts[2])
    if isinstance(condition, Keyword):
        return models.FieldCondition(key=condition.field, match=models.MatchValue(value=condition.value))
    if isinstance(condition, AnyKeyword):
        return models.FieldCondition(key=condition.field, match=models.MatchAny(any=list(condition.values)))
    if isinstance(condition, Substring):
        return models.FieldCondition(key=condition.field, match=models.MatchSubstring(substring=condition.text))
    if isinstance(condition, NumberRange):
        bounds = {b: float(v) for b in ("gt", "gte", "lt", "lte") for v in [getattr(condition, b)] if v is not None}
        return models.FieldCondition(key=condition.field, range=models.Range(**bounds))
    if isinstance(condition, PointIds):
        return models.HasIdCondition(has_id=sorted(condition.ids))
    raise TypeError(f"not a filter condition: {condition!r:.80}")


def point_ids_filter(allowed_ids: Sequence[str], excluded_ids: Sequence[str]) -> Any:
    """:func:`id_list_filter` as a qdrant-client filter (point ids, not node ids)."""
    return client_filter(id_list_filter(allowed_ids, excluded_ids).tree)


# --------------------------------------------------------------------------------------------
# Payload indexes (pure)
# --------------------------------------------------------------------------------------------


class IndexKind(ChoiceEnum):
    """A payload index's type; a field has one, the later member winning (strings outrank numbers;
    ``integer`` is ``_kinds``' own)."""

    FLOAT = "float"
    KEYWORD = "keyword"
    INTEGER = "integer"


_INDEX_RANK = {IndexKind.FLOAT: 0, IndexKind.KEYWORD: 1, IndexKind.INTEGER: 2}
KINDS_INDEX = {KINDS_FIELD: IndexKind.INTEGER}


def _payload_value(payload: Mapping[str, Any], field: str) -> Any:
    head, _, rest = field.partition(".")
    value = payload.get(head)
    return value.get(rest) if rest and isinstance(value, Mapping) else (None if rest else value)


def payload_index_plan(payloads: Iterable[Mapping[str, Any]], fields: Iterable[str]) -> Dict[str, IndexKind]:
    """The index each of ``fields`` (metadata paths) wants for these payloads: keyword when it
    holds strings (also in lists), else float when it holds numbers (booleans are not numbers)."""
    fields = list(fields)
    plan: Dict[str, IndexKind] = {}
    for payload in payloads:
        for field in fields:
            value = _payload_value(payload, field)
            items = value if isinstance(value, list) else [value]
            if any(type(item) is str for item in items):
                plan[field] = IndexKind.KEYWORD
            elif any(type(item) in (int, float) for item in items):
                plan.setdefault(field, IndexKind.FLOAT)
    return plan


def index_upgrades(existing: Mapping[str, IndexKind], payloads: Sequence[Mapping[str, Any]]) -> Dict[str, IndexKind]:
    """The metadata indexes of ``existing`` that these payloads outrank (written points decide no
    new index, only the type of one that exists)."""
    metadata_fields = [field for field in existing if field != KINDS_FIELD]
    return indexes_to_create(existing, payload_index_plan(payloads, metadata_fields)) if metadata_fields else {}


def indexes_to_create(existing: Mapping[str, IndexKind], wanted: Mapping[str, IndexKind]) -> Dict[str, IndexKind]:
    """The indexes of ``wanted`` that are missing from ``existing`` or outrank the one there (the
    kinds seen only grow, so an index is never downgraded and every transport ends alike)."""
    return {
        field: kind
        for field, kind in wanted.items()
        if field not in existing or (kind != existing[field] and _INDEX_RANK[kind] > _INDEX_RANK[existing[field]])
    }


# --------------------------------------------------------------------------------------------
# Queries: one plan, rendered per transport (pure)
# --------------------------------------------------------------------------------------------


class SearchLeg(NamedTuple):
    """One nearest-neighbour leg: ``"dense"`` (a vector) or ``"sparse"`` (indices, weights)."""

    kind: str
    dense: Optional[List[float]]
    sparse: Optional[Tuple[List[int], List[float]]]


class SearchPlan(NamedTuple):
    """What a search asks the engine: one leg scored by itself (``fusion=None``), or a prefetch of
    ``prefetch_limit`` per leg fused by ``fusion``; ``engine_rrf_k`` is Qdrant's k (ranks from 0)."""

    legs: Tuple[SearchLeg, ...]
    fusion: Optional[str]
    engine_rrf_k: int
    limit: int
    prefetch_limit: int
    filter: Any


class LegSearch(NamedTuple):
    """A fused search and each leg's own ranking under the same filter (what the fusion read).

    ``fused``: ``(point id, score, payload or None)``, ranked as :func:`ranked_hits` orders them;
    ``legs``: per leg kind (``"dense"``, ``"sparse"``), ``(point id, score)`` of that leg alone,
    best first, ``prefetch_limit`` deep (a single-leg search: that leg's ranking as well)."""

    fused: List[Tuple[str, float, Optional[Dict[str, Any]]]]
    legs: Dict[str, List[Tuple[str, float]]]


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    return int(value)


def check_fusion(fusion: Optional[str]) -> Optional[str]:
    """``fusion`` if it is None or one of :data:`FUSIONS`; else a ValueError listing them."""
    return None if fusion is None else EngineFusion.from_str(fusion).value


#: Extra hits a search asks the engine for beyond ``limit``, so that points tied on score at the
#: cut are chosen, like all ties, by point id (:func:`ranked_hits`).
TIE_MARGIN = 8


def ranked_hits(hits: Iterable[Any], limit: int) -> List[Any]:
    """The engine's ``hits`` (anything with ``.id`` and ``.score``) ordered by score descending,
    ties by point id (as text), cut to ``limit``. Qdrant returns points of equal score in no fixed
    order (under RRF, where ties are common, the same query ranked differently from call to
    call); this makes every search's order a function of the data."""
    return sorted(hits, key=lambda hit: (-hit.score, str(hit.id)))[:limit]


def plan_search(
    dense: Optional[Sequence[float]],
    sparse: Optional[SparseInput] = None,
    *,
    limit: int,
    prefetch_limit: int = 100,
    rrf_k: int = 60,
    filter: Any = None,
    fusion: str = "rrf",
) -> Optional[SearchPlan]:
    """The one query builder of both transports (None: nothing to search).

    Dense only (``sparse=None``): cosine scores. Sparse only (``dense=None``): IDF-weighted dot
    products; a sparse vector without terms finds nothing. Both: a dense and a sparse prefetch of
    ``prefetch_limit`` each (the sparse one left out when it has no terms), fused by ``fusion``:
    ``"rrf"``, ``1 / (rrf_k + rank)`` with ranks from 1 (Qdrant counts ranks from 0, so it gets
    ``rrf_k + 1``), or ``"dbsf"`` (each leg's scores normalised by mean +- 3 standard deviations,
    then summed). The filter applies to every prefetch and to the fused result.
    """
    limit = _check_count("limit", limit)
    prefetch_limit = _check_count("prefetch_limit", prefetch_limit)
    rrf_k = _check_count("rrf_k", rrf_k, minimum=0)
    fusion = check_fusion(fusion) or "rrf"
    if dense is None and sparse is None:
        raise ValueError("a search needs a dense vector, a sparse vector or both")
    sparse_leg = None
    if sparse is not None:
        indices, values = check_sparse(sparse)
        if indices:
            sparse_leg = SearchLeg("sparse", None, (indices, values))
    if dense is None:
        if sparse_leg is None:
            return None
        return SearchPlan((sparse_leg,), None, rrf_k + 1, limit, prefetch_limit, filter)
    vector = np.asarray(dense, dtype=np.float32)
    if vector.ndim != 1 or not vector.size or not np.isfinite(vector).all():
        raise ValueError(f"dense query must be a non-empty 1-d vector of finite floats, got shape {vector.shape}")
    dense_leg = SearchLeg("dense", [float(x) for x in dense], None)
    if sparse is None:
        return SearchPlan((dense_leg,), None, rrf_k + 1, limit, prefetch_limit, filter)
    legs = (dense_leg,) if sparse_leg is None else (dense_leg, sparse_leg)
    return SearchPlan(legs, fusion, rrf_k + 1, limit, prefetch_limit, filter)


# --------------------------------------------------------------------------------------------
# Engine errors
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Point stores: the surface HybridIndex writes and searches through, with two transports
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


class _PointStore:
    """What both transports share: ids filters, metadata filters and the bookkeeping upgrade, on
    top of each transport's ``exists``/``count``/``_scroll_payloads``/``_set_payloads``/``_create_indexes``."""

    kind = ""
    location = ""

    def exists(self) -> bool:  # pragma: no cover - every transport defines it
        raise NotImplementedError

    def count(self, filter: Any = None) -> int:  # pragma: no cover - every transport defines it
        raise NotImplementedError

    def dense_block(self) -> Tuple[List[str], np.ndarray]:  # pragma: no cover - every transport defines it
        raise NotImplementedError

    def dense_vectors(self) -> Dict[str, List[float]]:
        """Every point's dense vector, by point id (:meth:`dense_block` as a dict of lists)."""
        ids, block = self.dense_block()
        return dict(zip(ids, block.tolist()))

    def ids_filter(self, allowed_node_ids: Sequence[str], excluded_node_ids: Sequence[str]) -> PointFilter:
        """A filter admitting exactly the points of ``allowed_node_ids`` (see :func:`id_list_filter`)."""
        return id_list_filter([point_id(n) for n in allowed_node_ids], [point_id(n) for n in excluded_node_ids])

    def metadata_filter(self, filters: Optional[MetadataFilters], nodes: Sequence[BaseNode]) -> Optional[PointFilter]:
        """The filter admitting exactly the points of ``nodes`` (the indexed chunks) whose metadata
        ``filters`` matches (``metadata_matches``); None without filters.

        The translation (:func:`translate_filters`, route ``engine``) when it is exact for every
        stored point, one count query decides; else the matching ids (route ``id_list``).
        """
        filters = validate_filters(filters)
        if filters is None:
            return None
        try:
            tree = _translate(filters)
        except UntranslatableFilterError as exc:
            reason = str(exc)
        else:
            blocking = self.count(PointFilter(untranslated_points(filter_keys(filters)), FilterRoute.ID_LIST)) if self.exists() else 0
            if not blocking:
                self._index_filtered_keys(filter_keys(filters))
                return PointFilter(tree if isinstance(tree, Clause) else Clause(must=(tree,)), FilterRoute.ENGINE)
            reason = f"{blocking} point(s) lack the filter bookkeeping or hold a value of {filter_keys(filters)} the engine cannot compare"
        logger.debug("%s: a filter is evaluated in Python (%s)", self.location, reason)
        allowed: List[str] = []
        excluded: List[str] = []
        for node in nodes:
            (allowed if metadata_matches(node.metadata, filters) else excluded).append(node.node_id)
        return self.ids_filter(allowed, excluded)

    def _index_filtered_keys(self, keys: Sequence[str]) -> None:
        """Create the payload index of each filtered key that holds strings or numbers and has none
        (:data:`IndexKind` by what ``_kinds`` says it holds); a store that refuses it stays unindexed."""
        existing = self.payload_indexes
        for key in keys:
            field = metadata_field(key)
            if field in existing or not _KEY_RE.match(key):
                continue
            strings = AnyKeyword(KINDS_FIELD, (token_code(f"str:{key}"), token_code(f"lstr:{key}")))
            numbers = AnyKeyword(KINDS_FIELD, (token_code(f"num:{key}"), token_code(f"lnum:{key}")))
            if self.count(Clause(must=(strings,))):
                kind = IndexKind.KEYWORD
            elif self.count(Clause(must=(numbers,))):
                kind = IndexKind.FLOAT
            else:
                continue
            try:
                self._create_indexes({field: kind}, wait=False)
            except Exception as exc:  # e.g. a read-only folder or API key: filters stay exact, unindexed
                logger.info("%s: no payload index on %r (%s: %s)", self.location, field, type(exc).__name__, exc)
            else:
                logger.info("%s: created the %s payload index of %r (first filtered)", self.location, kind.value, field)

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
        """``(payload, score)`` of the top ``limit`` points, as :func:`plan_search` describes, ties
        ordered by point id (:func:`ranked_hits`). Scores are float32 (the engine's)."""
        hits = self._ranked_hits(dense, sparse, limit, dict(prefetch_limit=prefetch_limit, rrf_k=rrf_k, filter=filter, fusion=fusion), True)
        return [(dict(p.payload or {}), float(p.score)) for p in hits]

    def search_ids(
        self,
        dense: Optional[Sequence[float]],
        sparse: Any = None,
        *,
        limit: int,
        prefetch_limit: int = 100,
        rrf_k: int = 60,
        filter: Any = None,
        fusion: str = "rrf",
    ) -> List[Tuple[str, float]]:
        """:meth:`search` without the payloads: ``(point id, score)`` of the same points, for a
        caller that holds the nodes itself (parsing a payload back into a node costs ~20 us)."""
        hits = self._ranked_hits(dense, sparse, limit, dict(prefetch_limit=prefetch_limit, rrf_k=rrf_k, filter=filter, fusion=fusion), False)
        return [(str(p.id), float(p.score)) for p in hits]

    def search_with_legs(
        self,
        dense: Optional[Sequence[float]],
        sparse: Any = None,
        *,
        limit: int,
        prefetch_limit: int = 100,
        rrf_k: int = 60,
        filter: Any = None,
        fusion: str = "rrf",
        with_payload: bool = False,
    ) -> LegSearch:
        """:meth:`search_ids` (with the payloads when ``with_payload``) and, in the same batch, each
        leg on its own to ``prefetch_limit`` under the same filter: the rank and score each result
        had in every leg, which the engine's fusion does not return (one planned batch: Qdrant
        Edge's ``query_batch`` shares a pass over the segments, a server gets one request)."""
        limit = _check_count("limit", limit)
        plan = plan_search(dense, sparse, limit=limit + TIE_MARGIN, prefetch_limit=prefetch_limit, rrf_k=rrf_k, filter=filter, fusion=fusion)
        if plan is None:
            return LegSearch([], {})
        depth = plan.prefetch_limit
        legs = [SearchPlan((leg,), None, plan.engine_rrf_k, depth, depth, plan.filter) for leg in plan.legs]
        results = self._query_batch([(plan, with_payload)] + [(leg, False) for leg in legs])
        fused = [(str(p.id), float(p.score), dict(p.payload or {}) if with_payload else None) for p in ranked_hits(results[0], limit)]
        ranked = {leg.legs[0].kind: [(str(p.id), float(p.score)) for p in ranked_hits(hits, depth)] for leg, hits in zip(legs, results[1:])}
        return LegSearch(fused, ranked)

    def _query_batch(self, plans: Sequence[Tuple[SearchPlan, bool]]) -> List[List[Any]]:
        """Run each ``(plan, with_payload)``: their scored points, in order (a transport may batch them)."""
        return [self._query(plan, with_payload) for plan, with_payload in plans]

    def _ranked_hits(self, dense: Any, sparse: Any, limit: int, options: Dict[str, Any], with_payload: bool) -> List[Any]:
        """The engine's top ``limit`` hits (asked for ``limit`` + :data:`TIE_MARGIN`), by :func:`ranked_hits`."""
        limit = _check_count("limit", limit)
        plan = plan_search(dense, sparse, limit=limit + TIE_MARGIN, **options)
        return [] if plan is None else ranked_hits(self._query(plan, with_payload), limit)

    def _query(self, plan: SearchPlan, with_payload: bool) -> List[Any]:  # pragma: no cover - every transport defines it
        """Run ``plan`` in the engine: its scored points (with payloads when asked)."""
        raise NotImplementedError

    @property
    def payload_indexes(self) -> Dict[str, IndexKind]:  # pragma: no cover - every transport defines it
        raise NotImplementedError

    def ensure_payload_indexes(self, indexes: Mapping[str, IndexKind]) -> None:
        """Create the payload ``indexes`` (field -> kind) this store lacks or holds with a lower kind
        (``HybridIndex.push_to`` gives a server the embedded shard's indexes)."""
        self._create_indexes({field: IndexKind.from_str(kind) for field, kind in indexes.items()})

    def upgrade_payloads(self) -> int:
        """Add the filter bookkeeping (:func:`filter_fields`, from the metadata in ``_node_content``)
        to points written without it (and ``_kinds``' integer index); returns how many were upgraded.

        Safe to interrupt: it only adds the bookkeeping fields, each point's together with its
        ``filters:1`` token in one update, and :meth:`metadata_filter` translates only when no
        point lacks them; running it again finishes the rest.
        """
        if not self.exists() or not self.count(PointFilter(LACKS_BOOKKEEPING, FilterRoute.ID_LIST)):
            return 0
        self._create_indexes(KINDS_INDEX)
        upgraded = 0
        for page in self._scroll_payloads(PointFilter(LACKS_BOOKKEEPING, FilterRoute.ID_LIST), ["_node_content"]):
            updates = []
            for pid, payload in page:
                metadata = layout_metadata(payload)
                if metadata is not None:
                    updates.append((pid, filter_fields(metadata)))
            self._set_payloads(updates)
            upgraded += len(updates)
        return upgraded

    def _scroll_payloads(self, filter: PointFilter, fields: List[str]) -> Iterator[List[Tuple[str, Dict[str, Any]]]]:  # pragma: no cover
        raise NotImplementedError

    def _set_payloads(self, updates: Sequence[Tuple[str, Dict[str, Any]]]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _create_indexes(self, plan: Mapping[str, IndexKind], wait: bool = True) -> None:  # pragma: no cover
        raise NotImplementedError


_EDGE_INDEX_TYPES = {IndexKind.KEYWORD: "Keyword", IndexKind.FLOAT: "Float", IndexKind.INTEGER: "Integer"}


class EdgePoints(_PointStore):
    """The embedded transport: a Qdrant Edge shard in ``path/shard``, its schema in ``path/store.json``.

    Edge keeps its WAL exclusive to one open shard, and a second *failed* open of a shard that is
    open elsewhere was seen to damage the open one's segments (qdrant-edge-py 0.9.0). So the shard
    is only ever opened while holding ``path/.store.lock`` (flock): a second open, from this or
    another process, is a :class:`StoreBusyError` before Edge touches any file. Opening a shard
    whose points lack the filter bookkeeping (written before it existed) adds it
    (:meth:`upgrade_payloads`); when that cannot be written, filters use id lists.
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
        self._engine: Optional["qe.EdgeShard"] = None
        self._schema: Optional[StoreSchema] = None
        self._indexes: Dict[str, IndexKind] = {}
        try:
            if fresh:
                (self.path / SCHEMA_FILE).unlink(missing_ok=True)
                remove_path(self.path / SHARD_DIR)
            schema_file = self.path / SCHEMA_FILE
            if schema_file.exists():
                try:
                    schema = StoreSchema.from_json(schema_file.read_text(encoding="utf-8"), schema_file)
                except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                    raise StoreDamagedError(schema_file, f"cannot be read ({type(exc).__name__}: {exc})") from exc
                self._load(schema)
                self._upgrade_on_open()
        except BaseException:
            if self._engine is not None:
                self._engine.close()
            self._lock.release()
            raise

    def _load(self, schema: StoreSchema) -> None:
        with engine_reads(self.path, "opened"):
            self._engine = qe.EdgeShard.load(str(self.path / SHARD_DIR), schema.edge_config())
            self._schema = schema
            self._indexes = {
                field: kind
                for field, info in self._engine.info().payload_schema.items()
                for kind in IndexKind
                if info.data_type == getattr(qe.PayloadSchemaType, _EDGE_INDEX_TYPES[kind])
            }

    def _upgrade_on_open(self) -> None:
        try:
            upgraded = self.upgrade_payloads()
        except StoreDamagedError:
            raise
        except Exception as exc:  # a folder that cannot be written: still readable, filters use id lists
            logger.warning("%s: could not add the filter bookkeeping (%s: %s); filters use id lists", self.path, type(exc).__name__, exc)
            return
        if upgraded:
            self.flush()
            logger.info("%s: added the filter bookkeeping to %d point(s)", self.path, upgraded)

    @property
    def location(self) -> str:  # type: ignore[override]
        return str(self.path)

    @property
    def closed(self) -> bool:
        return not self._lock.held

    def _check_open(self) -> None:
        if not self._lock.held:
            raise RuntimeError(f"the point store {self.path} is closed")

    def _shard(self) -> "qe.EdgeShard":
        self._check_open()
        if self._engine is None:
            raise RuntimeError(f"{self.path} holds no shard yet (create() it first)")
        return self._engine

    def exists(self) -> bool:
        self._check_open()
        return self._engine is not None

    @property
    def dense_dim(self) -> Optional[int]:
        return self._schema.dense_dim if self._schema is not None else None

    @property
    def payload_indexes(self) -> Dict[str, IndexKind]:
        """The payload indexes of the shard, by field."""
        return dict(self._indexes)

    def create(self, dense_dim: int) -> None:
        """Create the shard (dense ``dense_dim``, cosine; sparse with the IDF modifier) with the
        ``_kinds`` payload index; nothing when it exists."""
        self._check_open()
        if self._engine is not None:
            return
        _check_count("dense_dim", dense_dim)
        schema = StoreSchema(dense_dim=int(dense_dim))
        with engine_writes(self.path):
            self._engine = qe.EdgeShard.create(str(self.path / SHARD_DIR), schema.edge_config())
        self._schema = schema
        self._create_indexes(KINDS_INDEX)
        tmp = self.path / (SCHEMA_FILE + ".tmp")
        tmp.write_text(schema.to_json(), encoding="utf-8")
        tmp.replace(self.path / SCHEMA_FILE)
        logger.info("created Edge store %s (dense dim %d)", self.path, dense_dim)

    def clear(self) -> None:
        """Delete the shard and its schema, keeping the lock: the store then holds no shard until
        :meth:`create` (``HybridIndex.purge`` writes a fresh one). ``store.json`` goes first, in one
        fsynced unlink, so a kill at any point leaves either the whole shard or a folder whose shard
        counts as missing (its leftover files are deleted by the next ``EdgePoints(path, fresh=True)``),
        never a half-deleted shard described as whole."""
        self._check_open()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            with engine_writes(self.path):
                engine.close()
        (self.path / SCHEMA_FILE).unlink(missing_ok=True)
        fsync_dir(self.path)
        self._schema = None
        self._indexes = {}
        remove_path(self.path / SHARD_DIR)
        if (self.path / SHARD_DIR).exists():
            raise OSError(f"could not delete the shard {self.path / SHARD_DIR}")
        fsync_dir(self.path)

    def _create_indexes(self, plan: Mapping[str, IndexKind], wait: bool = True) -> None:
        for field, kind in indexes_to_create(self._indexes, plan).items():
            with engine_writes(self.path):
                self._shard().update(qe.UpdateOperation.create_field_index(field, getattr(qe.PayloadSchemaType, _EDGE_INDEX_TYPES[kind])))
            self._indexes[field] = kind

    def upsert_points(
        self,
        point_ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[Any],
        payloads: Sequence[Mapping[str, Any]],
        progress: Optional[Callable[[int], None]] = None,
    ) -> None:
        """Insert or replace points (ids from :func:`point_id`, payloads from :func:`node_payload`),
        creating the payload indexes their metadata wants. ``progress`` is called with the number
        of points of each batch the engine has written (a progress bar's ``update``)."""
        self._shard()
        schema = self._schema
        if schema is None:  # pragma: no cover - set with the shard
            raise RuntimeError(f"{self.path} holds no schema")
        if not (len(point_ids) == len(sparse) == len(payloads)):
            raise ValueError(f"got {len(point_ids)} ids, {len(sparse)} sparse vectors and {len(payloads)} payloads")
        if not len(point_ids):
            return
        dense = check_dense(dense, schema.dense_dim, len(point_ids))
        self._create_indexes(index_upgrades(self._indexes, payloads))
        sparse = [qe.SparseVector(*check_sparse(sp)) for sp in sparse]  # all checked before anything is written
        dense_name, sparse_name = schema.dense_name, schema.sparse_name
        for start in range(0, len(point_ids), UPSERT_BATCH):
            stop = start + UPSERT_BATCH
            points = [  # built per batch: the engine's copy of a payload is large
                qe.Point(pid, {dense_name: vec, sparse_name: sp}, payload if type(payload) is dict else dict(payload))
                for pid, vec, sp, payload in zip(point_ids[start:stop], dense[start:stop].tolist(), sparse[start:stop], payloads[start:stop])
            ]
            with engine_writes(self.path):
                self._shard().update(qe.UpdateOperation.upsert_points(points))
            if progress is not None:
                progress(len(points))

    def delete_points(self, point_ids: Sequence[str]) -> None:
        self._check_open()
        if point_ids and self._engine is not None:
            with engine_writes(self.path):
                self._shard().update(qe.UpdateOperation.delete_points(list(point_ids)))

    def _render(self, filter: Any) -> Any:
        if isinstance(filter, PointFilter):
            return edge_filter(filter.tree)
        if isinstance(filter, Clause):
            return edge_filter(filter)
        return filter  # None, or a qe.Filter built by the caller

    def count(self, filter: Any = None) -> int:
        """Exact number of points (admitted by ``filter`` when given)."""
        self._check_open()
        if self._engine is None:
            return 0
        with engine_reads(self.path, "counted"):
            return int(self._shard().count(qe.CountRequest(exact=True, filter=self._render(filter))))

    def _scroll(self, filter: Any, with_payload: Any, with_vector: Any) -> Iterator[List[Any]]:
        offset = None
        while True:
            with engine_reads(self.path, "read"):
                records, offset = self._shard().scroll(
                    qe.ScrollRequest(limit=SCROLL_PAGE, offset=offset, filter=self._render(filter), with_payload=with_payload, with_vector=with_vector)
                )
            yield records
            if offset is None:
                return

    def _scroll_payloads(self, filter: PointFilter, fields: List[str]) -> Iterator[List[Tuple[str, Dict[str, Any]]]]:
        for records in self._scroll(filter, fields, False):
            yield [(str(r.id), dict(r.payload or {})) for r in records]

    def _set_payloads(self, updates: Sequence[Tuple[str, Dict[str, Any]]]) -> None:
        for pid, fields in updates:
            with engine_writes(self.path):
                self._shard().update(qe.UpdateOperation.set_payload([pid], fields))

    def dense_block(self) -> Tuple[List[str], np.ndarray]:
        """Every point's id and dense vector: ``(ids, float32 matrix)``, rows in the engine's order.

        Converted one scroll page at a time, so the engine's per-component Python floats never
        outlive their page (:meth:`dense_vectors` of 162k 384-d points holds 62 million of them)."""
        self._check_open()
        if self._engine is None or self._schema is None:
            return [], np.zeros((0, 0), dtype=np.float32)
        name, dim = self._schema.dense_name, self._schema.dense_dim
        ids: List[str] = []
        blocks: List[np.ndarray] = []
        for records in self._scroll(None, False, [name]):
            rows = []
            for record in records:
                vector = (record.vector or {}).get(name)
                if vector is None:
                    raise StoreDamagedError(self.path, f"holds point {record.id} without its dense vector {name!r}")
                ids.append(str(record.id))
                rows.append(vector)
            if rows:
                blocks.append(_dense_rows(rows, dim, self.path))
        return ids, np.concatenate(blocks) if blocks else np.zeros((0, dim), dtype=np.float32)

    def iter_points(self) -> Iterable[StoredPoint]:
        """Every stored point with its payload and both vectors (for checks and copies)."""
        self._check_open()
        if self._engine is None or self._schema is None:
            return
        schema = self._schema
        for records in self._scroll(None, True, True):
            for record in records:
                vectors = record.vector or {}
                sparse = vectors.get(schema.sparse_name)
                parts = sparse_parts(sparse) if sparse is not None else ([], [])
                yield StoredPoint(str(record.id), dict(record.payload or {}), list(vectors.get(schema.dense_name) or []), parts)

    def _request(self, plan: SearchPlan, with_payload: bool = True) -> "qe.QueryRequest":
        schema = self._schema
        assert schema is not None
        flt = self._render(plan.filter)

        def nearest(leg: SearchLeg) -> Any:
            if leg.kind == "dense":
                return qe.Query.Nearest(leg.dense, using=schema.dense_name)
            assert leg.sparse is not None
            return qe.Query.Nearest(qe.SparseVector(*leg.sparse), using=schema.sparse_name)

        if plan.fusion is None:
            return qe.QueryRequest(limit=plan.limit, query=nearest(plan.legs[0]), filter=flt, with_payload=with_payload, with_vector=False)
        prefetches = [qe.Prefetch(limit=plan.prefetch_limit, query=nearest(leg), filter=flt) for leg in plan.legs]
        fused = qe.Fusion.Dbsf() if plan.fusion == "dbsf" else qe.Fusion.Rrf(k=plan.engine_rrf_k)
        return qe.QueryRequest(limit=plan.limit, query=fused, prefetches=prefetches, filter=flt, with_payload=with_payload, with_vector=False)

    def _query(self, plan: SearchPlan, with_payload: bool) -> List[Any]:
        self._check_open()
        if self._engine is None or self._schema is None:
            return []
        self._check_dense_dim(plan)
        request = self._request(plan, with_payload)
        with engine_reads(self.path, "searched"):
            return self._shard().query(request)

    def _check_dense_dim(self, plan: SearchPlan) -> None:
        """A ValueError when ``plan``'s dense vector does not have the shard's dimension."""
        dense = plan.legs[0].dense
        if dense is not None and len(dense) != self._schema.dense_dim:  # type: ignore[union-attr]
            raise ValueError(f"dense query has {len(dense)} dimensions, the store {self._schema.dense_dim}")  # type: ignore[union-attr]

    def _query_batch(self, plans: Sequence[Tuple[SearchPlan, bool]]) -> List[List[Any]]:
        self._check_open()
        if self._engine is None or self._schema is None:
            return [[] for _ in plans]
        for plan, _ in plans:
            self._check_dense_dim(plan)
        batch = qe.QueryBatchRequest([self._request(plan, with_payload) for plan, with_payload in plans])
        with engine_reads(self.path, "searched"):
            return list(self._shard().query_batch(batch))

    def flush(self) -> None:
        if self._engine is not None:
            with engine_writes(self.path):
                self._engine.flush()

    def optimize(self) -> bool:
        """Run the engine's segment optimisers until none is planned: HNSW over the dense vectors of
        segments above Edge's indexing threshold, segments merged and vacuumed. True when anything
        changed."""
        if self._engine is None:
            return False
        with engine_writes(self.path):
            return bool(self._engine.optimize())

    def unindexed_vectors(self) -> int:
        """Dense vectors the engine searches without HNSW (an exact scan), from ``ShardInfo``:
        ``2 * points - indexed_vectors``, because qdrant-edge-py 0.9.0 counts as indexed each
        non-empty sparse vector (always in the inverted index) and each dense vector in an HNSW
        segment (tested). A point whose sparse vector is empty (a chunk without BM25 terms) counts
        here too, so this is an upper bound; 0 for a store not created yet."""
        self._check_open()
        if self._engine is None:
            return 0
        with engine_reads(self.path, "inspected"):
            info = self._shard().info()
        return min(int(info.points_count), max(0, 2 * int(info.points_count) - int(info.indexed_vectors_count)))

    def refresh(self) -> None:
        """Flush, then reload the shard (keeping the lock). qdrant-edge-py 0.9.0 keeps counting
        deleted and replaced points in the sparse vectors' IDF statistics (N, n_t) until the shard
        is loaded again, so a live shard would rank differently from the same shard reopened; a
        write ends with this, so queries always see the statistics of the stored points."""
        if self._engine is not None and self._schema is not None:
            with engine_writes(self.path):
                self._engine.flush()
                self._engine.close()
                self._engine = None
            self._load(self._schema)

    def close(self) -> None:
        """Flush and close the shard, then release the lock (idempotent)."""
        try:
            if self._engine is not None:
                engine, self._engine = self._engine, None
                engine.flush()
                engine.close()
        finally:
            self._lock.release()


def sparse_vectors_config() -> Dict[str, Any]:
    """The sparse vector of a hybrid collection on a server: BM25 weights with Qdrant's IDF modifier."""
    from qdrant_client import models

    return {SPARSE_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)}


class ServerPoints(_PointStore):
    """The server transport: a collection on a Qdrant server or cluster through qdrant-client
    (also qdrant-client's local mode, which stands in for a server in tests).

    Payloads are written as LlamaIndex's ``QdrantVectorStore`` writes them (plus the filter
    bookkeeping), so the collection is also readable as a ``QdrantVectorStore``. Points written
    without the bookkeeping are filtered by id lists until :meth:`upgrade_payloads` runs (never
    run implicitly: several workers may open one collection).
    """

    kind = "server"

    def __init__(
        self,
        client: Any,
        collection: str,
        url: Optional[str] = None,
        index_id: Optional[str] = None,
        folder_state: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.client = client
        self.collection = collection
        self.url = url
        self.index_id = index_id  # written into the metadata of the collection :meth:`create` makes
        # With index_id: the folder state a copy holds (push_to), written beside it (:func:`owner_metadata`).
        self.folder_state = dict(folder_state) if folder_state is not None else None
        self._closed = False
        self._indexes: Optional[Dict[str, IndexKind]] = None  # read from the collection on first use

    @property
    def location(self) -> str:  # type: ignore[override]
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

    @property
    def payload_indexes(self) -> Dict[str, IndexKind]:
        """The payload indexes of the collection (as the server reports them, plus those created
        through this object: qdrant-client's local mode reports none)."""
        if self._indexes is None:
            self._indexes = {}
            if self.exists():
                schema = self.client.get_collection(self.collection).payload_schema or {}
                for field, info in schema.items():
                    data_type = str(getattr(info.data_type, "value", info.data_type))
                    if data_type in {k.value for k in IndexKind}:
                        self._indexes[field] = IndexKind(data_type)
        return dict(self._indexes)

    def create(self, dense_dim: int) -> None:
        """Create the collection (as :meth:`EdgePoints.create`), marked with ``index_id`` (and the
        ``folder_state`` a copy holds) in its metadata (:func:`owner_metadata`); nothing when it exists."""
        from qdrant_client import models

        if self.exists():
            return
        _check_count("dense_dim", dense_dim)
        marked = {"metadata": owner_metadata(self.index_id, self.folder_state)} if self.index_id else {}
        try:
            self.client.create_collection(
                self.collection,
                vectors_config={DENSE_VECTOR: models.VectorParams(size=int(dense_dim), distance=models.Distance.COSINE)},
                sparse_vectors_config=sparse_vectors_config(),
                **marked,
            )
        except TypeError as exc:
            if "metadata" not in str(exc):
                raise
            raise RuntimeError(
                f"this qdrant-client cannot write collection metadata ({exc}), which marks the collections an index "
                "writes as its own: pip install 'qdrant-client>=1.16'"
            ) from None
        self._indexes = {}
        self._create_indexes(KINDS_INDEX)
        if self.index_id and self.owner() != self.index_id:
            logger.warning(
                "%s: the server did not keep the collection's metadata (Qdrant before 1.16?), so this index cannot "
                "recognise the collection as its own later: replacing it (a rebuild, push_to) will be refused "
                "unless forced (push_to(overwrite=True))",
                self.location,
            )

    def _metadata(self) -> Any:
        """The collection's metadata as the server reports it (None when missing or without any)."""
        if not self.exists():
            return None
        return getattr(self.client.get_collection(self.collection).config, "metadata", None)

    def owner(self) -> Optional[str]:
        """The index id in the collection's metadata (:func:`metadata_owner`); None when the
        collection is missing or carries none (another application's, or written before ids)."""
        return metadata_owner(self._metadata())

    def copied_state(self) -> Optional[Dict[str, Any]]:
        """The folder state recorded in the collection's metadata by the push that made it
        (:func:`metadata_folder_state`); None when the collection is missing or records none (built
        on the server, pushed with ``switch=True``, pushed by a version before the record, or a
        Qdrant server before 1.16, which drops collection metadata)."""
        return metadata_folder_state(self._metadata())

    def check_owner(self, storage_dir: Any) -> None:
        """Refuse (:class:`ForeignCollectionError`) a collection marked as another index's than
        ``index_id``'s (a folder without id accepts only unmarked ones, as it wrote them)."""
        owner = self.owner()
        if owner is not None and owner != self.index_id:
            raise ForeignCollectionError(
                self.collection,
                self.url,
                owner,
                self.count(),
                f"the index in {storage_dir} (id {self.index_id}) does not serve another index's points. Copy this "
                "index there first (push_to, which replaces only a collection it wrote itself), or open it without qdrant_url=",
            )

    def _create_indexes(self, plan: Mapping[str, IndexKind], wait: bool = True) -> None:
        """``wait=False``: the server builds the index in the background (a query that asked for it
        does not wait; it is exact either way)."""
        from qdrant_client import models

        existing = self.payload_indexes
        assert self._indexes is not None
        for field, kind in indexes_to_create(existing, plan).items():
            schema = {IndexKind.KEYWORD: models.PayloadSchemaType.KEYWORD, IndexKind.FLOAT: models.PayloadSchemaType.FLOAT, IndexKind.INTEGER: models.PayloadSchemaType.INTEGER}[kind]
            with warnings.catch_warnings():  # local mode (a server's stand-in) warns that it has no payload indexes
                warnings.filterwarnings("ignore", message="Payload indexes have no effect in the local Qdrant", category=UserWarning)
                self.client.create_payload_index(self.collection, field_name=field, field_schema=schema, wait=wait)
            self._indexes[field] = kind

    def upsert_points(
        self,
        point_ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[Any],
        payloads: Sequence[Mapping[str, Any]],
        progress: Optional[Callable[[int], None]] = None,
    ) -> None:
        """As :meth:`EdgePoints.upsert_points`."""
        from qdrant_client import models

        if not (len(point_ids) == len(sparse) == len(payloads)):
            raise ValueError(f"got {len(point_ids)} ids, {len(sparse)} sparse vectors and {len(payloads)} payloads")
        if not len(point_ids):
            return
        dense = np.asarray(dense, dtype=np.float32)
        dense = check_dense(dense, dense.shape[1] if dense.ndim == 2 else -1, len(point_ids))
        self._create_indexes(index_upgrades(self.payload_indexes, payloads))
        points = []
        for pid, vec, sp, payload in zip(point_ids, dense, sparse, payloads):
            indices, values = check_sparse(sp)
            vector = {DENSE_VECTOR: vec.tolist(), SPARSE_VECTOR: models.SparseVector(indices=indices, values=values)}
            points.append(models.PointStruct(id=pid, vector=vector, payload=dict(payload)))
        for start in range(0, len(points), SERVER_UPSERT_BATCH):
            batch = points[start : start + SERVER_UPSERT_BATCH]
            self.client.upsert(self.collection, points=batch, wait=True)
            if progress is not None:
                progress(len(batch))

    def delete_points(self, point_ids: Sequence[str]) -> None:
        from qdrant_client import models

        if point_ids and self.exists():
            self.client.delete(self.collection, points_selector=models.PointIdsList(points=list(point_ids)))

    def _render(self, filter: Any) -> Any:
        if isinstance(filter, PointFilter):
            return client_filter(filter.tree)
        if isinstance(filter, Clause):
            return client_filter(filter)
        return filter  # None, or a models.Filter built by the caller

    def count(self, filter: Any = None) -> int:
        """Exact number of points (admitted by ``filter`` when given)."""
        if not self.exists():
            return 0
        return int(self.client.count(self.collection, count_filter=self._render(filter), exact=True).count)

    def _scroll(self, filter: Any, with_payload: Any, with_vectors: Any) -> Iterator[List[Any]]:
        offset = None
        while True:
            points, offset = self.client.scroll(
                self.collection, scroll_filter=self._render(filter), limit=SCROLL_PAGE, offset=offset, with_payload=with_payload, with_vectors=with_vectors
            )
            yield points
            if offset is None:
                return

    def _scroll_payloads(self, filter: PointFilter, fields: List[str]) -> Iterator[List[Tuple[str, Dict[str, Any]]]]:
        for points in self._scroll(filter, fields, False):
            yield [(str(p.id), dict(p.payload or {})) for p in points]

    def _set_payloads(self, updates: Sequence[Tuple[str, Dict[str, Any]]]) -> None:
        from qdrant_client import models

        operations = [models.SetPayloadOperation(set_payload=models.SetPayload(payload=fields, points=[pid])) for pid, fields in updates]
        for start in range(0, len(operations), SERVER_UPSERT_BATCH):
            self.client.batch_update_points(self.collection, operations[start : start + SERVER_UPSERT_BATCH], wait=True)

    def dense_block(self) -> Tuple[List[str], np.ndarray]:
        """As :meth:`EdgePoints.dense_block`."""
        if not self.exists():
            return [], np.zeros((0, 0), dtype=np.float32)
        ids: List[str] = []
        blocks: List[np.ndarray] = []
        for points in self._scroll(None, False, [DENSE_VECTOR]):
            rows = [point.vector[DENSE_VECTOR] for point in points]
            ids.extend(str(point.id) for point in points)
            if rows:
                blocks.append(_dense_rows(rows, len(rows[0]), self.location))
        return ids, np.concatenate(blocks) if blocks else np.zeros((0, 0), dtype=np.float32)

    def iter_points(self) -> Iterable[StoredPoint]:
        """Every stored point with its payload and both vectors."""
        if not self.exists():
            return
        for points in self._scroll(None, True, True):
            for point in points:
                vectors = point.vector or {}
                sparse = vectors.get(SPARSE_VECTOR)
                parts = sparse_parts(sparse) if sparse is not None else ([], [])
                yield StoredPoint(str(point.id), dict(point.payload or {}), list(vectors.get(DENSE_VECTOR) or []), parts)

    def _query_kwargs(self, plan: SearchPlan) -> Dict[str, Any]:
        from qdrant_client import models

        flt = self._render(plan.filter)

        def nearest(leg: SearchLeg) -> Tuple[Any, str]:
            if leg.kind == "dense":
                return leg.dense, DENSE_VECTOR
            assert leg.sparse is not None
            return models.SparseVector(indices=leg.sparse[0], values=leg.sparse[1]), SPARSE_VECTOR

        if plan.fusion is None:
            query, using = nearest(plan.legs[0])
            return {"query": query, "using": using, "limit": plan.limit, "query_filter": flt}
        prefetch = [
            models.Prefetch(query=query, using=using, limit=plan.prefetch_limit, filter=flt)
            for query, using in (nearest(leg) for leg in plan.legs)
        ]
        fused = (
            models.FusionQuery(fusion=models.Fusion.DBSF) if plan.fusion == "dbsf" else models.RrfQuery(rrf=models.Rrf(k=plan.engine_rrf_k))
        )
        return {"prefetch": prefetch, "query": fused, "limit": plan.limit, "query_filter": flt}

    def _query(self, plan: SearchPlan, with_payload: bool) -> List[Any]:
        return self.client.query_points(collection_name=self.collection, with_payload=with_payload, **self._query_kwargs(plan)).points

    def _query_batch(self, plans: Sequence[Tuple[SearchPlan, bool]]) -> List[List[Any]]:
        from qdrant_client import models

        requests = []
        for plan, with_payload in plans:
            kwargs = self._query_kwargs(plan)
            kwargs["filter"] = kwargs.pop("query_filter")
            requests.append(models.QueryRequest(with_payload=with_payload, **kwargs))
        responses = self.client.query_batch_points(collection_name=self.collection, requests=requests)
        return [response.points for response in responses]

    def flush(self) -> None:
        """Server writes are acknowledged with ``wait=True``: nothing to flush."""

    def optimize(self) -> bool:
        """The server optimises in the background: nothing to do here (False)."""
        return False

    def unindexed_vectors(self) -> int:
        """0: a server indexes in the background (above its own ``indexing_threshold``)."""
        return 0

    def refresh(self) -> None:
        """Nothing to reload on a server."""

    def close(self) -> None:
        self._closed = True
        self.client.close()


# ---------------------------------------------------------------------------- server namespace
#: The key of this package's entry in the metadata of a server collection it wrote (Qdrant keeps
#: collection metadata since 1.16): ``{OWNER_METADATA_KEY: {"index_id": <the index's id>}}``, and
#: for a copy of an embedded folder (``push_to``) also ``FOLDER_STATE_KEY: <the state it copied>``.
OWNER_METADATA_KEY = "llama_index_retrieval_kit"
#: The key, beside ``index_id``, of the folder state a pushed copy holds (``manifest.FolderState.to_json()``).
FOLDER_STATE_KEY = "folder_state"
#: Hex digits of the suffix of a build collection: ``<name>-<12 hex digits>``.
BUILD_SUFFIX_HEX = 12
_BUILD_SUFFIX = re.compile(rf"-[0-9a-f]{{{BUILD_SUFFIX_HEX}}}\Z")
#: The longest name a server collection can be served under (its build collection stays within 128 characters).
MAX_SERVED_NAME = 128 - 1 - BUILD_SUFFIX_HEX


def owner_metadata(index_id: str, folder_state: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The collection metadata marking a collection as written by the index ``index_id``; with
    ``folder_state``, as a copy of that state of its folder (``push_to``)."""
    entry: Dict[str, Any] = {"index_id": index_id}
    if folder_state is not None:
        entry[FOLDER_STATE_KEY] = dict(folder_state)
    return {OWNER_METADATA_KEY: entry}


def _owner_entry(metadata: Any) -> Optional[Mapping[str, Any]]:
    entry = metadata.get(OWNER_METADATA_KEY) if isinstance(metadata, Mapping) else None
    return entry if isinstance(entry, Mapping) else None


def metadata_owner(metadata: Any) -> Optional[str]:
    """The index id a collection's metadata names (:func:`owner_metadata`), or None."""
    entry = _owner_entry(metadata)
    owner = entry.get("index_id") if entry is not None else None
    return owner if isinstance(owner, str) else None


def metadata_folder_state(metadata: Any) -> Optional[Dict[str, Any]]:
    """The folder state a collection's metadata records (:func:`owner_metadata`), or None."""
    entry = _owner_entry(metadata)
    state = entry.get(FOLDER_STATE_KEY) if entry is not None else None
    return dict(state) if isinstance(state, Mapping) else None


def build_collection_name(name: str, token: Optional[str] = None) -> str:
    """The name of a new collection built to be served as ``name``: ``<name>-<12 random hex digits>``."""
    import secrets

    token = token if token is not None else secrets.token_hex(BUILD_SUFFIX_HEX // 2)
    built = f"{name}-{token}"
    if not _BUILD_SUFFIX.fullmatch(f"-{token}") or len(built) > 128:
        raise ValueError(f"cannot name a build collection of {name!r} with {token!r}")
    return built


def is_build_collection_name(name: str) -> bool:
    """Whether ``name`` has the form of a build collection (``<name>-<12 hex digits>``)."""
    return bool(_BUILD_SUFFIX.search(name)) and len(name) > BUILD_SUFFIX_HEX + 1


def served_collection_name(collection: str) -> str:
    """The name a collection is served under: a build collection's ``<name>``, else itself."""
    return collection[: -(BUILD_SUFFIX_HEX + 1)] if is_build_collection_name(collection) else collection


class ForeignCollectionError(ValueError):
    """A server collection this index did not write (another index's, by its metadata, or
    another application's) where replacing it or reading it as this index's would lose or leak data."""

    def __init__(
        self, collection: str, url: Optional[str], owner: Optional[str], points: int, advice: str, alias_of: Optional[str] = None
    ) -> None:
        self.collection = collection
        self.url = url
        self.owner = owner
        self.points = points
        self.alias_of = alias_of
        whose = (
            f"the index with id {owner}" if owner else "another application, or an index written before index ids (no index id in its metadata)"
        )
        where = f" at {url}" if url else ""
        alias = f" (an alias of {alias_of!r})" if alias_of and alias_of != collection else ""
        super().__init__(f"Qdrant collection {collection!r}{alias}{where} holds {points} point(s) written by {whose}; {advice}")


class ServerCollections:
    """The collections and aliases of a Qdrant server, as this package serves its indexes there.

    An index's points go to a *build collection* ``<name>-<12 hex digits>`` (:func:`build_collection_name`),
    created fresh by each build or push and marked with the index's id (:func:`owner_metadata`);
    the alias ``<name>`` then names it (:meth:`serve`, one atomic alias update), and the build
    collection it named before is deleted. A folder on the server reads its build collection
    (``index.json``'s ``collection``); ``<name>`` is what other readers and
    ``HybridIndex.load(dir, qdrant_url=)`` of an embedded folder use.
    """

    def __init__(self, client: Any, url: Optional[str] = None) -> None:
        self.client = client
        self.url = url

    def _aliases(self) -> Dict[str, str]:
        return {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}

    def target(self, name: str) -> Optional[str]:
        """The collection ``name`` refers to: the one the alias ``name`` names, ``name`` itself when
        it is a collection, None when neither exists."""
        aliases = self._aliases()
        if name in aliases:
            return aliases[name]
        return name if self.client.collection_exists(name) else None

    def owner(self, collection: str) -> Optional[str]:
        """The index id in the metadata of ``collection`` (None: unmarked or missing)."""
        return ServerPoints(self.client, collection, url=self.url).owner()

    def count(self, collection: str) -> int:
        """The number of points in ``collection`` (0 when missing)."""
        return ServerPoints(self.client, collection, url=self.url).count()

    def serve(self, name: str, collection: str) -> None:
        """Make ``name`` name ``collection``: one alias update (readers of ``name`` see the previous
        collection or this one, never none); a plain collection called ``name`` must be gone first."""
        from qdrant_client import models

        operations: List[Any] = []
        if name in self._aliases():
            operations.append(models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=name)))
        operations.append(models.CreateAliasOperation(create_alias=models.CreateAlias(collection_name=collection, alias_name=name)))
        self.client.update_collection_aliases(change_aliases_operations=operations)

    def delete(self, collection: str) -> None:
        """Delete ``collection`` (and the aliases naming it)."""
        self.client.delete_collection(collection)
        logger.info("deleted Qdrant collection %r at %s", collection, self.url)

    def builds_of(self, name: str, index_id: str) -> List[str]:
        """The build collections of ``name`` marked with ``index_id`` (served, replaced or left by an interrupted build)."""
        names = [c.name for c in self.client.get_collections().collections]
        return sorted(
            c for c in names if is_build_collection_name(c) and served_collection_name(c) == name and self.owner(c) == index_id
        )
