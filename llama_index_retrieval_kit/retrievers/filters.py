"""Evaluate LlamaIndex ``MetadataFilters`` against a node's metadata, in memory.

Semantics follow LlamaIndex's ``SimpleVectorStore`` (``build_metadata_filter_fn``), plus nested
``MetadataFilters``:

* a missing key (or a ``None`` value) matches only ``NE`` and ``NIN`` (and ``IS_EMPTY``);
* values are compared as the index stores them (JSON: a tuple is a list, :func:`as_stored`);
* ``ref_doc_id`` / ``document_id`` read ``metadata["doc_id"]`` when the chunk has no value of its
  own under them (:data:`DOCUMENT_ID_ALIASES`: LlamaIndex's vector stores put the document id there);
* ``IN``/``NIN``: the metadata value is (not) one of the filter's list;
* ``CONTAINS``: the filter value is in the metadata value (list membership, or substring when
  the metadata value is a string); ``ANY``/``ALL``: any/all filter values are in the metadata list,
  or, for a single metadata value, it equals any / each of them (as Qdrant's ``MatchAny`` reads a
  keyword field: ``NOT tenant ANY ["a"]`` excludes tenant ``"a"``, which it once kept);
* ``TEXT_MATCH``: the filter string is a substring of the metadata string (case-sensitive);
  ``TEXT_MATCH_INSENSITIVE`` ignores case;
* conditions: ``AND`` (default when None), ``OR``, and ``NOT`` = "none of the sub-filters match".
  An empty ``AND`` or ``NOT`` list matches everything, an empty ``OR`` list nothing (``any([])``;
  ``SimpleVectorStore`` matches everything there: the narrower reading is the safe one).

Deliberate differences: a comparison Python cannot make (``"a" > 1``, ``TEXT_MATCH`` on a
number) does not match, instead of raising ``TypeError`` mid-query; ``ANY``/``ALL`` on a string
metadata value compare it whole (``SimpleVectorStore`` tests substrings there; use ``TEXT_MATCH``). Malformed filters (``IN``
without a list, ``TEXT_MATCH`` without a string, ...) are rejected up front by
:func:`validate_filters`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

_LIST_OPERATORS = (FilterOperator.IN, FilterOperator.NIN, FilterOperator.ANY, FilterOperator.ALL)
_TEXT_OPERATORS = (FilterOperator.TEXT_MATCH, FilterOperator.TEXT_MATCH_INSENSITIVE)
_ORDER_OPERATORS = (FilterOperator.GT, FilterOperator.GTE, FilterOperator.LT, FilterOperator.LTE)


def validate_filters(filters: Optional[MetadataFilters]) -> Optional[MetadataFilters]:
    """Check ``filters`` (recursively) and return it; raise ValueError on a malformed filter."""
    if filters is None:
        return None
    if not isinstance(filters, MetadataFilters):
        raise ValueError(f"filters must be a llama_index MetadataFilters or None, got {type(filters).__name__}")
    condition = filters.condition or FilterCondition.AND
    if condition not in tuple(FilterCondition):
        raise ValueError(f"unsupported filter condition {condition!r}; allowed: {[c.value for c in FilterCondition]}")
    for sub in filters.filters:
        if isinstance(sub, MetadataFilters):
            validate_filters(sub)
        else:
            _validate_leaf(sub)
    return filters


def _validate_leaf(leaf: MetadataFilter) -> None:
    op, value = leaf.operator, leaf.value
    if op in _LIST_OPERATORS and not isinstance(value, list):
        raise ValueError(f"filter on {leaf.key!r} with operator {op.value!r} needs a list value, got {value!r}")
    if op in _TEXT_OPERATORS and not isinstance(value, str):
        raise ValueError(f"filter on {leaf.key!r} with operator {op.value!r} needs a string value, got {value!r}")
    if op in _ORDER_OPERATORS + (FilterOperator.CONTAINS,) and (value is None or isinstance(value, list)):
        raise ValueError(
            f"filter on {leaf.key!r} with operator {op.value!r} needs a single int, float or str value, got {value!r}"
        )
    if op not in tuple(FilterOperator):
        raise ValueError(f"unsupported filter operator {op!r}; allowed: {[o.value for o in FilterOperator]}")


def as_stored(value: Any) -> Any:
    """``value`` as the index stores it (JSON): tuples become lists, also inside lists. A chunk's
    metadata is compared in that form, so that a tuple matches alike in memory, in the engine's
    payload and after the index is reopened (``() IS_EMPTY`` everywhere, ``("a",) == ["a"]``)."""
    if type(value) is tuple:
        return [as_stored(v) for v in value]
    if type(value) is list and any(type(v) is tuple for v in value):
        return [as_stored(v) for v in value]
    return value


#: Filter keys LlamaIndex's vector stores fill with the chunk's document id (``node_to_metadata_dict``
#: writes ``ref_doc_id`` and ``document_id`` beside the metadata "to allow metadata filtering"): a
#: chunk whose metadata has no value of its own under them is filtered on ``metadata["doc_id"]``
#: (its document's id, as this package's parsers and ``HybridIndex`` record it), so that
#: ``ref_doc_id NIN [...]`` excludes a document here as it does in LlamaIndex.
DOCUMENT_ID_ALIASES = ("ref_doc_id", "document_id")


def filter_value(metadata: Mapping[str, Any], key: str) -> Any:
    """The value a filter on ``key`` reads from a chunk's ``metadata`` (None: missing), as stored
    (:func:`as_stored`), with the document-id keys of :data:`DOCUMENT_ID_ALIASES`."""
    actual = metadata.get(key)
    if actual is None and key in DOCUMENT_ID_ALIASES:
        actual = metadata.get("doc_id")
    return as_stored(actual)


def _leaf_matches(leaf: MetadataFilter, metadata: Mapping[str, Any]) -> bool:
    op, wanted = leaf.operator, as_stored(leaf.value)
    actual = filter_value(metadata, leaf.key)
    if op == FilterOperator.IS_EMPTY:
        return actual is None or actual == "" or actual == []
    if actual is None:
        return op in (FilterOperator.NE, FilterOperator.NIN)
    try:
        if op == FilterOperator.EQ:
            return bool(actual == wanted)
        if op == FilterOperator.NE:
            return bool(actual != wanted)
        if op == FilterOperator.GT:
            return bool(actual > wanted)
        if op == FilterOperator.GTE:
            return bool(actual >= wanted)
        if op == FilterOperator.LT:
            return bool(actual < wanted)
        if op == FilterOperator.LTE:
            return bool(actual <= wanted)
        if op == FilterOperator.IN:
            return actual in wanted  # type: ignore[operator]
        if op == FilterOperator.NIN:
            return actual not in wanted  # type: ignore[operator]
        if op == FilterOperator.CONTAINS:
            return isinstance(actual, (list, tuple, set, str)) and wanted in actual
        if op == FilterOperator.ANY:  # a single value: equal to one of them (Qdrant's MatchAny on a keyword field)
            if isinstance(actual, (list, set)):
                return any(v in actual for v in wanted)  # type: ignore[union-attr]
            return not isinstance(actual, dict) and any(actual == v for v in wanted)  # type: ignore[union-attr]
        if op == FilterOperator.ALL:  # a single value: equal to each of them
            if isinstance(actual, (list, set)):
                return all(v in actual for v in wanted)  # type: ignore[union-attr]
            return not isinstance(actual, dict) and all(actual == v for v in wanted)  # type: ignore[union-attr]
        if op == FilterOperator.TEXT_MATCH:
            return isinstance(actual, str) and isinstance(wanted, str) and wanted in actual
        if op == FilterOperator.TEXT_MATCH_INSENSITIVE:
            return isinstance(actual, str) and isinstance(wanted, str) and wanted.lower() in actual.lower()
    except TypeError:
        return False
    raise ValueError(f"unsupported filter operator {op!r}; allowed: {[o.value for o in FilterOperator]}")


def metadata_matches(metadata: Mapping[str, Any], filters: Optional[Union[MetadataFilters, MetadataFilter]]) -> bool:
    """True when ``metadata`` satisfies ``filters`` (None matches everything)."""
    if filters is None:
        return True
    if isinstance(filters, MetadataFilter):
        return _leaf_matches(filters, metadata)
    matches = (metadata_matches(metadata, sub) for sub in filters.filters)
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return all(matches)
    if condition == FilterCondition.OR:
        return any(matches)
    if condition == FilterCondition.NOT:
        return not any(matches)
    raise ValueError(f"unsupported filter condition {condition!r}; allowed: {[c.value for c in FilterCondition]}")


_MASK_CACHE_SIZE = 8
_masks: "OrderedDict[Tuple[int, str], Tuple[Sequence[Any], np.ndarray, np.ndarray]]" = OrderedDict()
_masks_lock = threading.Lock()


def filters_key(filters: MetadataFilters) -> str:
    """A value key of ``filters``: equal filters share it whatever object holds them, changing a
    filter object changes its key, and filters that may match differently never share one.

    Lossless: every value keeps its type and ``repr`` (JSON would write ``inf``, ``-inf`` and
    ``nan`` all as ``null``, and a tuple or set like a list: ``price > inf`` then shared the
    cached answer of ``price > -inf``)."""
    return repr(_filter_key(filters))


def _filter_key(item: Any) -> Any:
    if isinstance(item, MetadataFilters):
        condition = item.condition
        return ("filters", getattr(condition, "value", condition), tuple(_filter_key(sub) for sub in item.filters))
    if isinstance(item, MetadataFilter):
        return ("filter", item.key, getattr(item.operator, "value", item.operator), _value_key(item.value))
    return ("other", type(item).__qualname__, repr(item))


def _value_key(value: Any) -> Any:
    if isinstance(value, (list, tuple, set, frozenset)):
        items = tuple(_value_key(v) for v in value)
        return (type(value).__qualname__, tuple(sorted(items, key=repr)) if isinstance(value, (set, frozenset)) else items)
    return (type(value).__qualname__, repr(value))


def has_settable_filters(retriever: Any) -> bool:
    """Whether ``retriever.filters = ...`` changes what ``retriever`` returns (a property with a
    setter, or a plain ``filters`` attribute its queries read, as LlamaIndex's vector retrievers have)."""
    attr = getattr(type(retriever), "filters", None)
    if isinstance(attr, property):
        return attr.fset is not None
    return "filters" in getattr(retriever, "__dict__", {})


def _cached_mask(nodes: Sequence[Any], filters: MetadataFilters) -> Tuple[np.ndarray, np.ndarray]:
    """``(mask, rows)`` of ``filters`` over ``nodes``, from the cache of the last few index states
    and filter values, or computed (one :func:`metadata_matches` per node) and cached."""
    key = (id(nodes), filters_key(filters))
    with _masks_lock:
        hit = _masks.get(key)
        if hit is not None and hit[0] is nodes:
            _masks.move_to_end(key)
            return hit[1], hit[2]
    mask = np.fromiter((metadata_matches(n.metadata, filters) for n in nodes), dtype=bool, count=len(nodes))
    rows = np.flatnonzero(mask).astype(np.int64, copy=False)
    mask.setflags(write=False)
    rows.setflags(write=False)
    with _masks_lock:
        _masks[key] = (nodes, mask, rows)
        while len(_masks) > _MASK_CACHE_SIZE:
            _masks.popitem(last=False)
    return mask, rows


def filter_mask(nodes: Sequence[Any], filters: MetadataFilters) -> np.ndarray:
    """``[metadata_matches(n.metadata, filters) for n in nodes]`` as a read-only bool array, cached
    for the last few index states (the ``nodes`` tuple object, which an index state never changes)
    and filter *values* (:func:`filters_key`): a retriever built per request with the same filter
    costs one lookup instead of a check per node, and a filter object changed in place is not
    answered from the cache of its old value."""
    return _cached_mask(nodes, filters)[0]


def filter_rows(nodes: Sequence[Any], filters: MetadataFilters) -> np.ndarray:
    """The positions of the nodes passing ``filters``, ascending (``flatnonzero`` of
    :func:`filter_mask`, cached with it; read-only int64)."""
    return _cached_mask(nodes, filters)[1]
