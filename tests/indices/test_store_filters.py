"""Metadata filters in the engine, on both transports: Qdrant Edge (``EdgePoints``) and a Qdrant
server (``ServerPoints``; qdrant-client's local mode stands in for one).

* Translated filters select exactly what ``metadata_matches`` selects (hypothesis), with the
  payload indexes the store creates.
* ``metadata_filter`` is exact for any filter and any metadata: it falls back to the id list
  where the engine cannot compare (string ranges, list equality, dicts, big ints, dates...).
* One query builder: the same search ranks alike on both transports.
* Points written before the filter bookkeeping existed: id lists until upgraded, the upgrade
  only adds fields, an interrupted one resumes.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters
from llama_index.core.vector_stores.utils import node_to_metadata_dict
from qdrant_client import QdrantClient

pytest.importorskip("qdrant_edge")

from llama_index_retrieval_kit.indices.store import (  # noqa: E402
    EdgePoints,
    FilterRoute,
    IndexKind,
    ServerPoints,
    UntranslatableFilterError,
    filter_fields,
    filter_keys,
    kind_tokens,
    metadata_field,
    node_payload,
    point_id,
    token_code,
    translate_filters,
)
from llama_index_retrieval_kit.retrievers.filters import metadata_matches  # noqa: E402

from . import _support  # noqa: E402

KEYS = ("a", "b", "doc_id")  # doc_id: the layout's own top-level field; the metadata value lives in _masked
NUMERIC_KEY = "c"  # numbers only: a float payload index
EXAMPLE_IDS = [f"n{i:03d}" for i in range(12)]

SCALARS = st.one_of(
    st.sampled_from(["", "a", "A", "ab", "Ab", "ba", "b", "ç"]),
    st.integers(min_value=-2, max_value=3),
    st.sampled_from([0.0, 1.0, 2.5, -1.5, 3.0]),
    st.booleans(),
)
VALUES = st.one_of(st.none(), SCALARS, st.lists(SCALARS, max_size=3))
NUMERIC_VALUES = st.one_of(st.none(), st.integers(-2, 3), st.sampled_from([0.5, 2.5]), st.lists(st.integers(-2, 3), max_size=3))
METADATA = st.fixed_dictionaries({}, optional={**{k: VALUES for k in KEYS}, NUMERIC_KEY: NUMERIC_VALUES})
# What the engine cannot compare exactly: the store must fall back for filters on these keys.
OPAQUE = st.sampled_from([{"x": 1}, 2**60, [[1]], datetime.date(2020, 1, 2), ["a", None]])
ANY_METADATA = st.fixed_dictionaries({}, optional={k: st.one_of(VALUES, OPAQUE) for k in KEYS})

NUMBERS = st.one_of(st.integers(min_value=-2, max_value=3), st.sampled_from([0.0, 0.5, 1.0, 2.5, 3.0]))
STRINGS = st.sampled_from(["", "a", "A", "ab", "b", "ç"])
HOMOGENEOUS_LISTS = st.one_of(
    st.lists(STRINGS, max_size=4), st.lists(st.integers(-2, 3), max_size=4), st.lists(st.sampled_from([0.0, 1.0, 2.5]), max_size=4)
)
FILTER_KEYS = st.sampled_from(KEYS + (NUMERIC_KEY,))


WEIRD_KEYS = st.sampled_from(["a", "A", "doc_id", "_node_content", "_kinds", "_masked", "has space", "é", "", "x-y_1"])


@settings(max_examples=400, deadline=None)
@given(metadata=st.dictionaries(WEIRD_KEYS, st.one_of(VALUES, OPAQUE, st.sampled_from(["ABC", ("a", 1), (), "Ç"])), max_size=6))
def test_filter_fields_are_the_kind_tokens_codes_and_the_lowered_and_masked_values(metadata) -> None:
    """``filter_fields`` (one pass, memoised codes) stores exactly what its definition says: the
    codes of ``kind_tokens`` in order, lower-cased strings that change, and layout-shadowed
    values under ``_masked`` (tuples as lists)."""
    fields = filter_fields(metadata)
    assert fields["_kinds"] == [token_code(t) for t in kind_tokens(metadata)]
    exact = {k: v for k, v in metadata.items() if v is not None and k and "other:" + k not in kind_tokens(metadata)}
    plain = {k: v for k, v in exact.items() if all(c.isascii() and (c.isalnum() or c in "_-") for c in k)}
    lowered = {k: v.lower() for k, v in plain.items() if type(v) is str and v.lower() != v}
    masked = {k: list(v) if type(v) is tuple else v for k, v in plain.items() if metadata_field(k) != k}
    assert fields.get("_lower", {}) == lowered
    assert fields.get("_masked", {}) == masked
    assert set(fields) <= {"_kinds", "_lower", "_masked"} and ("_lower" in fields) == bool(lowered) and ("_masked" in fields) == bool(masked)


def _leaf(op: FilterOperator, values: st.SearchStrategy, keys: st.SearchStrategy = FILTER_KEYS) -> st.SearchStrategy[MetadataFilter]:
    return st.builds(MetadataFilter, key=keys, operator=st.just(op), value=values)


LEAVES = st.one_of(
    _leaf(FilterOperator.EQ, st.one_of(NUMBERS, STRINGS, st.none())),
    _leaf(FilterOperator.NE, st.one_of(NUMBERS, STRINGS, st.none())),
    *[_leaf(op, NUMBERS) for op in (FilterOperator.GT, FilterOperator.GTE, FilterOperator.LT, FilterOperator.LTE)],
    *[_leaf(op, HOMOGENEOUS_LISTS) for op in (FilterOperator.IN, FilterOperator.NIN, FilterOperator.ANY, FilterOperator.ALL)],
    _leaf(FilterOperator.CONTAINS, st.one_of(NUMBERS, STRINGS)),
    _leaf(FilterOperator.TEXT_MATCH, STRINGS),
    _leaf(FilterOperator.TEXT_MATCH_INSENSITIVE, st.sampled_from(["", "a", "A", "AB", "Ç", "b"])),
    _leaf(FilterOperator.IS_EMPTY, st.none()),
)
# Leaves no engine evaluates like metadata_matches: string ranges, list equality, dotted keys.
UNTRANSLATABLE_LEAVES = st.one_of(
    *[_leaf(op, STRINGS) for op in (FilterOperator.GT, FilterOperator.LTE)],
    _leaf(FilterOperator.EQ, st.lists(STRINGS, min_size=1, max_size=2)),
    _leaf(FilterOperator.EQ, STRINGS, keys=st.just("a.b")),
)
CONDITIONS = st.sampled_from([FilterCondition.AND, FilterCondition.OR, FilterCondition.NOT, None])


def _filters(leaves: st.SearchStrategy) -> st.SearchStrategy[MetadataFilters]:
    return st.recursive(
        st.builds(MetadataFilters, filters=st.lists(leaves, max_size=3), condition=CONDITIONS),
        lambda children: st.builds(MetadataFilters, filters=st.lists(st.one_of(leaves, children), max_size=3), condition=CONDITIONS),
        max_leaves=6,
    )


FILTERS = _filters(LEAVES)
ANY_FILTERS = _filters(st.one_of(LEAVES, UNTRANSLATABLE_LEAVES))


def _base_corpus(n: int = 60) -> List[Dict[str, Any]]:
    """A fixed, seeded corpus covering every value kind (hypothesis alone draws sparse corpora)."""
    rng = random.Random(0)
    pool: List[Any] = ["", "a", "A", "ab", "Ab", "ba", "b", "ç", -2, -1, 0, 1, 2, 3, 0.0, 1.0, 2.5, -1.5, True, False]

    def value(numeric: bool) -> Any:
        choices = [v for v in pool if type(v) in (int, float)] if numeric else pool
        roll = rng.random()
        if roll < 0.15:
            return None
        if roll < 0.4:
            return rng.sample(choices, rng.randint(0, 3))
        return rng.choice(choices)

    return [
        {key: value(key == NUMERIC_KEY) for key in KEYS + (NUMERIC_KEY,) if rng.random() < 0.8} for _ in range(n)
    ]


BASE_NODES = [TextNode(id_=f"b{i:03d}", text="", metadata=m) for i, m in enumerate(_base_corpus())]


def write(store: Any, nodes: Sequence[TextNode], payloads: Sequence[Dict[str, Any]] | None = None) -> None:
    payloads = payloads if payloads is not None else [node_payload(n) for n in nodes]
    store.upsert_points([point_id(n.node_id) for n in nodes], np.ones((len(nodes), 2)), [{0: 1.0}] * len(nodes), payloads)


def found(store: Any, point_filter: Any) -> List[str]:
    return sorted(json.loads(p["_node_content"])["id_"] for p, _ in store.search([1.0, 0.0], limit=500, filter=point_filter))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[EdgePoints, ServerPoints]]:
    """The base corpus in Qdrant Edge and in a server collection (local mode), payload indexes as
    the store creates them."""
    edge = EdgePoints(tmp_path_factory.mktemp("edge_filters") / "store")
    server = ServerPoints(QdrantClient(location=":memory:"), "filters")
    try:
        for store in (edge, server):
            store.create(2)
            write(store, BASE_NODES)
        yield edge, server
    finally:
        edge.close()
        server.close()


def _example_nodes(stores: Sequence[Any], corpus: List[Dict[str, Any]]) -> List[TextNode]:
    """``corpus`` as this example's nodes (replacing the previous example's) on every store."""
    nodes = [TextNode(id_=EXAMPLE_IDS[i], text="", metadata=m) for i, m in enumerate(corpus)]
    for store in stores:
        store.delete_points([point_id(i) for i in EXAMPLE_IDS])
        write(store, nodes)
    return nodes + BASE_NODES


def test_the_stores_index_the_filtered_keys_alike(stores) -> None:
    """Indexed before the property tests run (module order), so that they run against the indexes."""
    everything = MetadataFilters(filters=[MetadataFilter(key=k, value=None, operator=FilterOperator.IS_EMPTY) for k in KEYS + (NUMERIC_KEY,)])
    expected = {"_kinds": "integer", "a": "keyword", "b": "keyword", "_masked.doc_id": "keyword", "c": "float"}
    for store in stores:
        assert store.payload_indexes == {"_kinds": IndexKind.INTEGER}
        assert store.metadata_filter(everything, BASE_NODES).route == FilterRoute.ENGINE
        assert {f: k.value for f, k in store.payload_indexes.items()} == expected, store.kind


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpus=st.lists(METADATA, min_size=1, max_size=12), filters=FILTERS)
def test_translated_filters_select_what_metadata_matches_selects(stores, corpus, filters) -> None:
    every = _example_nodes(stores, corpus)
    expected = sorted(n.node_id for n in every if metadata_matches(n.metadata, filters))
    for store in stores:
        point_filter = store.metadata_filter(filters, every)
        assert point_filter is not None and point_filter.route == FilterRoute.ENGINE, store.kind
        assert point_filter.tree == translate_filters(filters)  # one translation, rendered per transport
        assert found(store, point_filter) == expected, (store.kind, corpus, filters)
        assert store.count(point_filter) == len(expected)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpus=st.lists(METADATA, min_size=4, max_size=12), leaf=LEAVES)
def test_each_translated_operator_selects_what_metadata_matches_selects(stores, corpus, leaf) -> None:
    test_translated_filters_select_what_metadata_matches_selects.hypothesis.inner_test(stores, corpus, MetadataFilters(filters=[leaf]))


def _translatable(filters: MetadataFilters) -> bool:
    try:
        translate_filters(filters)
    except UntranslatableFilterError:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpus=st.lists(ANY_METADATA, min_size=1, max_size=12), filters=ANY_FILTERS)
def test_metadata_filter_is_exact_for_any_filter_and_any_metadata(stores, corpus, filters) -> None:
    every = _example_nodes(stores, corpus)
    expected = sorted(n.node_id for n in every if metadata_matches(n.metadata, filters))
    opaque = any(f"other:{key}" in kind_tokens(n.metadata) for n in every for key in filter_keys(filters))
    route = FilterRoute.ENGINE if _translatable(filters) and not opaque else FilterRoute.ID_LIST
    for store in stores:
        point_filter = store.metadata_filter(filters, every)
        assert point_filter is not None and point_filter.route == route, (store.kind, filters)
        assert found(store, point_filter) == expected, (store.kind, corpus, filters)


# ---------------------------------------------------------------------- one query builder


@pytest.fixture(scope="module")
def ranked_stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[EdgePoints, ServerPoints]]:
    """Random vectors (no ties) with a tenant key, in Edge and in a server collection."""
    rng = np.random.default_rng(7)
    n, dim = 300, 16
    nodes = [TextNode(id_=f"r{i:03d}", text="", metadata={"tenant": f"t{i % 5}", "n": i}) for i in range(n)]
    dense = rng.normal(size=(n, dim)).astype(np.float32)
    sparse = [{int(t): float(w) for t, w in zip(rng.choice(50, 6, replace=False), rng.uniform(0.2, 2.0, 6))} for _ in range(n)]
    edge = EdgePoints(tmp_path_factory.mktemp("ranked") / "store")
    server = ServerPoints(QdrantClient(location=":memory:"), "ranked")
    try:
        for store in (edge, server):
            store.create(dim)
            store.upsert_points([point_id(x.node_id) for x in nodes], dense, sparse, [node_payload(x) for x in nodes])
        yield edge, server
    finally:
        edge.close()
        server.close()


@pytest.mark.parametrize("shape", ["dense", "sparse", "rrf", "dbsf"])
@pytest.mark.parametrize("filtered", [False, True])
def test_one_query_builder_ranks_alike_on_both_transports(ranked_stores, shape: str, filtered: bool) -> None:
    rng = np.random.default_rng(11)
    nodes = [TextNode(id_=f"r{i:03d}", text="", metadata={"tenant": f"t{i % 5}", "n": i}) for i in range(300)]
    filters = MetadataFilters(
        filters=[MetadataFilter(key="tenant", value=["t1", "t3"], operator=FilterOperator.IN), MetadataFilter(key="n", value=40, operator=FilterOperator.GTE)]
    )
    for _ in range(5):
        dense = rng.normal(size=16).tolist() if shape != "sparse" else None
        sparse = {int(t): 1.0 for t in rng.choice(50, 3, replace=False)} if shape != "dense" else None
        rankings = []
        for store in ranked_stores:
            point_filter = store.metadata_filter(filters, nodes) if filtered else None
            assert point_filter is None or point_filter.route == FilterRoute.ENGINE
            hits = store.search(dense, sparse, limit=15, prefetch_limit=40, fusion="dbsf" if shape == "dbsf" else "rrf", filter=point_filter)
            rankings.append([(json.loads(p["_node_content"])["id_"], s) for p, s in hits])
        edge, server = rankings
        assert len(edge) == 15
        _support.assert_same_ranking(edge, server, tol=1e-5, truncated=True)
        if filtered:
            assert all(metadata_matches(nodes[int(i[1:])].metadata, filters) for i, _ in edge)


# ---------------------------------------------------------------------- points written before the bookkeeping


def _old_layout(nodes: Sequence[TextNode]) -> List[Dict[str, Any]]:
    """Payloads as HybridIndex wrote them before the filter bookkeeping existed."""
    return [node_to_metadata_dict(n, remove_text=False, flat_metadata=False) for n in nodes]


OLD_NODES = [
    TextNode(id_=f"o{i:03d}", text=f"chunk {i}", metadata={"tenant": f"t{i % 4}", "doc_id": f"file-{i % 3}", "page": i, "tags": ["x", "y"][: i % 3]})
    for i in range(40)
]
OLD_FILTERS = [
    MetadataFilters(filters=[MetadataFilter(key="tenant", value="t1")]),
    MetadataFilters(filters=[MetadataFilter(key="doc_id", value="file-2", operator=FilterOperator.NE), MetadataFilter(key="page", value=20, operator=FilterOperator.LT)]),
    MetadataFilters(filters=[MetadataFilter(key="tags", value="y", operator=FilterOperator.CONTAINS)], condition=FilterCondition.NOT),
]


def _assert_filters_exact(store: Any, route: FilterRoute) -> None:
    for filters in OLD_FILTERS:
        point_filter = store.metadata_filter(filters, OLD_NODES)
        assert point_filter.route == route, (store.kind, filters)
        assert found(store, point_filter) == sorted(n.node_id for n in OLD_NODES if metadata_matches(n.metadata, filters))


def test_an_old_shard_is_upgraded_on_open_adding_fields_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = EdgePoints(tmp_path / "s")
    store.create(2)
    upgraded_before = OLD_NODES[:15]  # an interrupted upgrade: these already carry the bookkeeping
    write(store, upgraded_before, [node_payload(n) for n in upgraded_before])
    write(store, OLD_NODES[15:], _old_layout(OLD_NODES[15:]))
    _assert_filters_exact(store, FilterRoute.ID_LIST)  # until upgraded: id lists, still exact
    store.close()
    with caplog.at_level(logging.INFO, logger="llama_index_retrieval_kit.indices.store"):
        reopened = EdgePoints(tmp_path / "s")
    try:
        assert "added the filter bookkeeping to 25 point(s)" in caplog.text  # the rest of the interrupted upgrade
        stored = {json.loads(p.payload["_node_content"])["id_"]: p.payload for p in reopened.iter_points()}
        for node, old in zip(OLD_NODES, _old_layout(OLD_NODES)):
            assert stored[node.node_id] == {**old, **filter_fields(node.metadata)}  # the layout as written, plus the fields
        _assert_filters_exact(reopened, FilterRoute.ENGINE)
        assert reopened.payload_indexes["tenant"] == IndexKind.KEYWORD and reopened.payload_indexes["page"] == IndexKind.FLOAT
        assert reopened.upgrade_payloads() == 0
    finally:
        reopened.close()


def test_a_shard_that_cannot_be_upgraded_still_filters_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    store = EdgePoints(tmp_path / "s")
    store.create(2)
    write(store, OLD_NODES, _old_layout(OLD_NODES))
    store.close()

    def read_only(self: Any) -> int:
        raise OSError("Read-only file system")

    monkeypatch.setattr(EdgePoints, "upgrade_payloads", read_only)
    with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.indices.store"):
        reopened = EdgePoints(tmp_path / "s")
    try:
        assert "filters use id lists" in caplog.text
        _assert_filters_exact(reopened, FilterRoute.ID_LIST)
    finally:
        reopened.close()


def test_a_server_collection_is_upgraded_only_when_asked() -> None:
    server = ServerPoints(QdrantClient(location=":memory:"), "old")
    try:
        server.create(2)
        write(server, OLD_NODES[:10], [node_payload(n) for n in OLD_NODES[:10]])
        write(server, OLD_NODES[10:], _old_layout(OLD_NODES[10:]))
        _assert_filters_exact(server, FilterRoute.ID_LIST)
        assert server.upgrade_payloads() == 30
        _assert_filters_exact(server, FilterRoute.ENGINE)
        assert server.upgrade_payloads() == 0
        assert server.payload_indexes["_masked.doc_id"] == IndexKind.KEYWORD
    finally:
        server.close()
