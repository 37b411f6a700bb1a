"""Metadata filter semantics: agree with LlamaIndex's SimpleVectorStore per leaf, plus nesting."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
from hypothesis import given, settings
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.retrievers.filters import as_stored, filters_key, metadata_matches, validate_filters

from ._strategies import filters_st, metadata_st, oracle_matches


@settings(max_examples=300, deadline=None)
@given(metadata=metadata_st, filters=filters_st)
def test_matches_reference_semantics(metadata: Dict[str, Any], filters: MetadataFilters) -> None:
    assert metadata_matches(metadata, filters) == oracle_matches(metadata, filters)


def test_nested_and_or_not() -> None:
    en_2020 = MetadataFilters(
        filters=[MetadataFilter(key="lang", value="en"), MetadataFilter(key="year", value=2020, operator=">=")],
    )
    not_draft = MetadataFilters(filters=[MetadataFilter(key="status", value="draft")], condition=FilterCondition.NOT)
    f = MetadataFilters(filters=[en_2020, not_draft], condition=FilterCondition.AND)
    assert metadata_matches({"lang": "en", "year": 2021}, f)
    assert not metadata_matches({"lang": "en", "year": 2021, "status": "draft"}, f)
    assert not metadata_matches({"lang": "en", "year": 2019}, f)
    either = MetadataFilters(filters=[en_2020, MetadataFilter(key="lang", value="de")], condition=FilterCondition.OR)
    assert metadata_matches({"lang": "de"}, either)


def test_missing_key_matches_only_negations() -> None:
    assert metadata_matches({}, MetadataFilters(filters=[MetadataFilter(key="k", value=1, operator="!=")]))
    assert metadata_matches({}, MetadataFilters(filters=[MetadataFilter(key="k", value=[1], operator="nin")]))
    for op in ("==", ">", "<", ">=", "<=", "in", "contains", "text_match"):
        value: Any = [1] if op == "in" else ("x" if op == "text_match" else 1)
        assert not metadata_matches({}, MetadataFilters(filters=[MetadataFilter(key="k", value=value, operator=op)]))


def test_incomparable_types_do_not_match_instead_of_raising() -> None:
    f = MetadataFilters(filters=[MetadataFilter(key="year", value=2020, operator=FilterOperator.GT)])
    assert not metadata_matches({"year": "recent"}, f)
    text = MetadataFilters(filters=[MetadataFilter(key="year", value="20", operator=FilterOperator.TEXT_MATCH)])
    assert not metadata_matches({"year": 2020}, text)


def test_empty_filter_list_matches_everything() -> None:
    assert metadata_matches({"a": 1}, MetadataFilters(filters=[]))
    assert metadata_matches({"a": 1}, None)


@pytest.mark.parametrize(
    "leaf",
    [
        MetadataFilter(key="k", value="x", operator=FilterOperator.IN),
        MetadataFilter(key="k", value=3, operator=FilterOperator.TEXT_MATCH),
        MetadataFilter(key="k", value=None, operator=FilterOperator.GT),
        MetadataFilter(key="k", value=["a"], operator=FilterOperator.CONTAINS),
    ],
)
def test_malformed_filters_rejected_up_front(leaf: MetadataFilter) -> None:
    with pytest.raises(ValueError, match="'k'"):
        validate_filters(MetadataFilters(filters=[MetadataFilters(filters=[leaf])]))


def test_validate_rejects_non_filters() -> None:
    with pytest.raises(ValueError, match="MetadataFilters"):
        validate_filters({"lang": "en"})  # type: ignore[arg-type]


def test_filter_mask_is_cached_per_nodes_and_filters_and_matches_metadata_matches() -> None:
    from llama_index.core.schema import TextNode

    from llama_index_retrieval_kit.retrievers.filters import filter_mask, metadata_matches

    nodes = tuple(TextNode(text=str(i), metadata={"tenant": f"t{i % 3}", "n": i}) for i in range(30))
    flt = MetadataFilters(filters=[MetadataFilter(key="tenant", value="t1"), MetadataFilter(key="n", value=10, operator=FilterOperator.GT)])
    mask = filter_mask(nodes, flt)
    assert mask.tolist() == [metadata_matches(n.metadata, flt) for n in nodes] and mask.sum() == 6
    assert filter_mask(nodes, flt) is mask  # cached: same index state, same filters
    other = nodes[:10]  # another index state (a new tuple): computed afresh
    assert filter_mask(other, flt).tolist() == [False] * 10
    assert not mask.flags.writeable


def test_filter_mask_cache_is_keyed_by_the_filter_value_not_the_object() -> None:
    """A retriever built per request with an equal filter hits the cache; a filter object changed
    in place after a query is answered for its new value, never from the old value's mask."""
    from llama_index.core.schema import TextNode

    from llama_index_retrieval_kit.retrievers.filters import filter_mask, filter_rows, filters_key

    nodes = tuple(TextNode(text=str(i), metadata={"tenant": f"t{i % 4}"}) for i in range(40))
    first = MetadataFilters(filters=[MetadataFilter(key="tenant", value="t1")])
    mask = filter_mask(nodes, first)
    again = MetadataFilters(filters=[MetadataFilter(key="tenant", value="t1")])
    assert filters_key(again) == filters_key(first) and filter_mask(nodes, again) is mask
    assert filter_rows(nodes, again).tolist() == np.flatnonzero(mask).tolist() == list(range(1, 40, 4))
    first.filters[0].value = "t2"  # changed in place
    assert filters_key(first) != filters_key(again)
    assert filter_rows(nodes, first).tolist() == list(range(2, 40, 4))
    assert not filter_rows(nodes, first).flags.writeable


def _one(key: str, value: Any, op: str = "==") -> MetadataFilters:
    return MetadataFilters(filters=[MetadataFilter(key=key, value=value, operator=op)])


def test_filters_that_may_match_differently_never_share_a_cache_key() -> None:
    """JSON wrote inf, -inf and nan all as null: ``price > inf`` was answered from the cached mask
    of ``price > -inf`` (every chunk) in every mode."""
    values = [float("inf"), float("-inf"), float("nan"), 1, 1.0, "1", None]
    keys = {filters_key(_one("price", v, ">")) for v in values}
    assert len(keys) == len(values)
    listed, tupled = _one("acl", ["a"], "in"), _one("acl", ["a"], "in")
    tupled.filters[0].value = ("a",)  # assigned after construction: not validated into a list
    assert filters_key(listed) != filters_key(tupled)
    assert filters_key(_one("price", 5, ">")) == filters_key(_one("price", 5, ">"))  # equal values share one
    nested = MetadataFilters(filters=[_one("a", 1)], condition=FilterCondition.NOT)
    assert filters_key(nested) != filters_key(MetadataFilters(filters=[_one("a", 1)]))


@pytest.mark.parametrize(
    "stored, filters, expected",
    [
        ((), _one("acl", None, "is_empty"), True),
        (("g",), _one("acl", None, "is_empty"), False),
        (("g",), _one("acl", ["g"]), True),
        (("g", "h"), _one("acl", "g", "contains"), True),
        (("g",), _one("acl", ["g", "h"], "any"), True),
        (("g",), _one("acl", ["g"], "nin"), True),
    ],
)
def test_tuples_match_as_the_index_stores_them(stored: Any, filters: MetadataFilters, expected: bool) -> None:
    """A tuple is stored as a list (JSON): it matches alike in memory, in the engine and after a
    reopen (``() IS_EMPTY`` was False in memory and True in the engine and after reopening)."""
    assert as_stored(stored) == [list(v) if isinstance(v, tuple) else v for v in stored]
    assert metadata_matches({"acl": stored}, filters) is expected
    assert metadata_matches({"acl": as_stored(stored)}, filters) is expected


@pytest.mark.parametrize(
    "value, filters, expected",
    [
        ("a", _one("tenant", ["a", "b"], "any"), True),
        ("c", _one("tenant", ["a", "b"], "any"), False),
        ("a", MetadataFilters(filters=[_one("tenant", ["a"], "any")], condition=FilterCondition.NOT), False),
        ("a", _one("tenant", ["a"], "all"), True),
        ("a", _one("tenant", ["a", "b"], "all"), False),
        (3, _one("level", [1, 3], "any"), True),
        ("abc", _one("tenant", ["ab"], "any"), False),  # whole values, not substrings
        (["a", "b"], _one("tenant", ["a", "b"], "all"), True),
    ],
)
def test_any_and_all_on_a_single_value_compare_it_whole(value: Any, filters: MetadataFilters, expected: bool) -> None:
    """A single metadata value is one of ANY's values / each of ALL's (Qdrant's MatchAny on a
    keyword field); it never matched before, so ``NOT tenant ANY ["a"]`` kept tenant a's chunks."""
    key = filters.filters[0].filters[0].key if isinstance(filters.filters[0], MetadataFilters) else filters.filters[0].key
    assert metadata_matches({key: value}, filters) is expected
