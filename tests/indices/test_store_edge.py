"""EdgeStore (Qdrant Edge): the engine behaviours the store relies on, and exact filter translation.

These pin qdrant-edge-py's behaviour: a version bump that changes scoring, fusion, persistence or
filter matching must fail here.
"""

from __future__ import annotations

import math
import random
import uuid
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

pytest.importorskip("qdrant_edge")

from llama_index_retrieval_kit.indices.store import (  # noqa: E402
    NODE_ID_NAMESPACE,
    EdgeStore,
    build_query_request,
    kind_tokens,
    point_id,
    translate_filters,
)
from llama_index_retrieval_kit.retrievers.filters import metadata_matches  # noqa: E402

DIM = 8


def _nodes(n: int, metadata: List[Dict[str, Any]] | None = None) -> List[TextNode]:
    return [TextNode(id_=f"n{i:03d}", text=f"text {i}", metadata=(metadata[i] if metadata else {})) for i in range(n)]


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    vectors = rng.normal(size=(n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _sparse(rng: np.random.Generator, n: int, vocab: int = 30, terms: int = 5) -> List[Dict[int, float]]:
    return [
        {int(t): float(w) for t, w in zip(rng.choice(vocab, terms, replace=False), rng.uniform(0.5, 2.0, terms))}
        for _ in range(n)
    ]


@pytest.fixture
def store(tmp_path: Path):
    with EdgeStore.create(tmp_path / "store", DIM) as opened:
        yield opened


# ------------------------------------------------------------------ writes, ids, persistence


def test_upsert_delete_count_and_reopen(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    nodes = _nodes(50)
    store = EdgeStore.create(tmp_path / "s", DIM)
    store.upsert(nodes, _unit(rng, 50), _sparse(rng, 50))
    assert store.count() == 50
    store.upsert(nodes[:5], _unit(rng, 5), _sparse(rng, 5))  # same ids: replaced, not added
    assert store.count() == 50
    store.delete(["n000", "n001", "unknown"])
    assert store.count() == 48
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.count()
    with EdgeStore.open(tmp_path / "s") as reopened:
        assert reopened.count() == 48
        assert [n.node_id for n in reopened.retrieve(["n000", "n002", "n049"])] == ["n002", "n049"]
    with pytest.raises(ValueError, match="already holds a store"):
        EdgeStore.create(tmp_path / "s", DIM)
    with pytest.raises(FileNotFoundError, match="no Edge store"):
        EdgeStore.open(tmp_path / "nothing")


def test_retrieve_rebuilds_the_node(store: EdgeStore) -> None:
    node = TextNode(
        id_=str(uuid.uuid4()),
        text="Fees: 5 % é",
        metadata={"doc_id": "a.pdf", "section_path": ["1. Fees", "1.2 Late"], "page_start": 3, "x": None},
        excluded_llm_metadata_keys=["doc_id"],
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id="a.pdf")},
        start_char_idx=10,
        end_char_idx=20,
    )
    store.upsert([node], np.ones((1, DIM)), [{3: 1.0}])
    (back,) = store.retrieve([node.node_id])
    assert back.to_dict() == node.to_dict()
    hit = store.query(dense=np.ones(DIM), limit=1)[0]
    assert hit.node_id == node.node_id and hit.payload["doc_id"] == "a.pdf"
    assert hit.payload["metadata"] == node.metadata


def test_point_ids() -> None:
    known = str(uuid.uuid4())
    assert point_id(known) == known
    assert point_id("n1") == str(uuid.uuid5(NODE_ID_NAMESPACE, "n1"))
    with pytest.raises(ValueError, match="non-empty str"):
        point_id("")


@pytest.mark.parametrize(
    "value, message",
    [({"a": 1}, "unsupported value"), ([[1]], "unsupported value"), ([None], "unsupported value"),
     (2**60, "beyond"), (float("nan"), "finite")],
)
def test_unfilterable_metadata_is_refused(store: EdgeStore, value: Any, message: str) -> None:
    node = TextNode(id_="n", text="t", metadata={"bad": value})
    with pytest.raises(ValueError, match=message):
        store.upsert([node], np.ones((1, DIM)), [{1: 1.0}])
    assert store.count() == 0


def test_bad_vectors_are_refused(store: EdgeStore) -> None:
    nodes = _nodes(2)
    with pytest.raises(ValueError, match=r"shape \(2, 8\)"):
        store.upsert(nodes, np.ones((2, 3)), [{1: 1.0}, {1: 1.0}])
    with pytest.raises(ValueError, match="all-zero"):
        store.upsert(nodes, np.zeros((2, DIM)), [{1: 1.0}, {1: 1.0}])
    with pytest.raises(ValueError, match="repeated indices"):
        store.upsert(nodes, np.ones((2, DIM)), [([1, 1], [1.0, 1.0]), {1: 1.0}])
    with pytest.raises(ValueError, match="2 nodes but 1 sparse"):
        store.upsert(nodes, np.ones((2, DIM)), [{1: 1.0}])


# ------------------------------------------------------------------ scoring and fusion


def test_dense_scores_are_numpy_cosine(store: EdgeStore) -> None:
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(200, DIM)) * rng.uniform(0.1, 5, size=(200, 1))  # not normalised
    store.upsert(_nodes(200), raw, _sparse(rng, 200))
    query = rng.normal(size=DIM)
    expected = (raw / np.linalg.norm(raw, axis=1, keepdims=True)) @ (query / np.linalg.norm(query))
    order = np.argsort(-expected)[:20]
    for optimized in (False, True):
        hits = store.query(dense=query, limit=20)
        assert [h.node_id for h in hits] == [f"n{i:03d}" for i in order]
        np.testing.assert_allclose([h.score for h in hits], expected[order], atol=1e-5)
        store.optimize()


def test_sparse_scores_use_idf(store: EdgeStore) -> None:
    rng = np.random.default_rng(2)
    docs = _sparse(rng, 60, vocab=12, terms=4)
    store.upsert(_nodes(60), _unit(rng, 60), docs)
    query = {0: 1.0, 3: 0.5, 7: 2.0}
    n_docs = len(docs)
    idf = {t: math.log((n_docs - df + 0.5) / (df + 0.5) + 1) for t in query for df in [sum(t in d for d in docs)]}
    expected = {f"n{i:03d}": sum(w * d[t] * idf[t] for t, w in query.items() if t in d) for i, d in enumerate(docs)}
    hits = store.query(sparse=query, limit=60)
    assert {h.node_id for h in hits} == {k for k, v in expected.items() if v > 0}
    for hit in hits:
        assert hit.score == pytest.approx(expected[hit.node_id], rel=1e-5)


def test_rrf_follows_package_convention(store: EdgeStore) -> None:
    rng = np.random.default_rng(3)
    store.upsert(_nodes(80), _unit(rng, 80), _sparse(rng, 80, vocab=10))
    dense, sparse = rng.normal(size=DIM), {1: 1.0, 4: 1.0}
    legs = [store.query(dense=dense, limit=20), store.query(sparse=sparse, limit=20)]
    expected: Dict[str, float] = {}
    for leg in legs:
        for rank, hit in enumerate(leg, start=1):  # package RRF: 1 / (k + rank), ranks from 1
            expected[hit.node_id] = expected.get(hit.node_id, 0.0) + 1.0 / (60 + rank)
    fused = store.query(dense=dense, sparse=sparse, fusion="rrf", limit=10, prefetch_limit=20)
    assert len(fused) == 10
    for hit in fused:
        assert hit.score == pytest.approx(expected[hit.node_id], rel=1e-6)
    assert [h.score for h in fused] == pytest.approx(sorted(expected.values(), reverse=True)[:10], rel=1e-6)
    dbsf = store.query(dense=dense, sparse=sparse, fusion="dbsf", limit=10, prefetch_limit=20)
    assert {h.node_id for h in dbsf} <= set(expected) and len(dbsf) == 10


def test_filter_applies_to_every_leg_of_a_fused_query(store: EdgeStore) -> None:
    rng = np.random.default_rng(4)
    metadata = [{"tenant": f"t{i % 4}"} for i in range(80)]
    store.index_metadata_key("tenant")
    store.upsert(_nodes(80, metadata), _unit(rng, 80), _sparse(rng, 80, vocab=10))
    with pytest.raises(ValueError, match="kind must be one of"):
        store.index_metadata_key("tenant", "text")
    only = MetadataFilters(filters=[MetadataFilter(key="tenant", value="t2")])
    hits = store.query(dense=rng.normal(size=DIM), sparse={1: 1.0}, filter=only, fusion="rrf", limit=30)
    assert len(hits) == 20 and {h.payload["metadata"]["tenant"] for h in hits} == {"t2"}
    assert store.count(only) == 20


@pytest.mark.parametrize(
    "kwargs, message",
    [({}, "dense=, sparse= or both"), ({"dense": [1.0] * DIM, "sparse": {1: 1.0}}, "two legs need a fusion"),
     ({"dense": [1.0] * DIM, "fusion": "rrf"}, "needs both"), ({"dense": [1.0] * DIM, "fusion": "max"}, "fusion must be"),
     ({"dense": [1.0] * DIM, "limit": 0}, "limit must be")],
)
def test_query_arguments_are_checked(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_query_request(**kwargs)


# ------------------------------------------------------------------ filter translation

SCALARS = st.one_of(
    st.sampled_from(["", "a", "A", "ab", "Ab", "ba", "b", "ç"]),
    st.integers(min_value=-2, max_value=3),
    st.sampled_from([0.0, 1.0, 2.5, -1.5, 3.0]),
    st.booleans(),
)
VALUES = st.one_of(st.none(), SCALARS, st.lists(SCALARS, max_size=3))
KEYS = ("a", "b")
METADATA = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=2)

NUMBERS = st.one_of(st.integers(min_value=-2, max_value=3), st.sampled_from([0.0, 0.5, 1.0, 2.5, 3.0]))
STRINGS = st.sampled_from(["", "a", "A", "ab", "b", "ç"])
HOMOGENEOUS_LISTS = st.one_of(
    st.lists(STRINGS, max_size=4), st.lists(st.integers(-2, 3), max_size=4), st.lists(st.sampled_from([0.0, 1.0, 2.5]), max_size=4)
)


def _leaf(op: FilterOperator, values: st.SearchStrategy) -> st.SearchStrategy[MetadataFilter]:
    return st.builds(MetadataFilter, key=st.sampled_from(KEYS), operator=st.just(op), value=values)


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
CONDITIONS = st.sampled_from([FilterCondition.AND, FilterCondition.OR, FilterCondition.NOT, None])
FILTERS = st.recursive(
    st.builds(MetadataFilters, filters=st.lists(LEAVES, max_size=3), condition=CONDITIONS),
    lambda children: st.builds(
        MetadataFilters, filters=st.lists(st.one_of(LEAVES, children), max_size=3), condition=CONDITIONS
    ),
    max_leaves=6,
)


def _base_corpus(n: int = 60) -> List[Dict[str, Any]]:
    """A fixed, seeded corpus covering every value kind (hypothesis alone draws sparse corpora)."""
    rng = random.Random(0)
    pool: List[Any] = ["", "a", "A", "ab", "Ab", "ba", "b", "ç", -2, -1, 0, 1, 2, 3, 0.0, 1.0, 2.5, -1.5, True, False]

    def value() -> Any:
        roll = rng.random()
        if roll < 0.15:
            return None
        if roll < 0.4:
            return rng.sample(pool, rng.randint(0, 3))
        return rng.choice(pool)

    return [{key: value() for key in KEYS if rng.random() < 0.8} for _ in range(n)]


BASE_CORPUS = _base_corpus()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory):
    with EdgeStore.create(tmp_path_factory.mktemp("edge_filters") / "store", 2) as opened:
        base = [TextNode(id_=f"b{i:03d}", text="", metadata=m) for i, m in enumerate(BASE_CORPUS)]
        opened.upsert(base, np.ones((len(base), 2)), [{0: 1.0}] * len(base))
        yield opened


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpus=st.lists(METADATA, min_size=1, max_size=12), filters=FILTERS)
def test_translated_filters_select_what_metadata_matches_selects(shared_store: EdgeStore, corpus, filters) -> None:
    store = shared_store
    store.delete([f"n{i:03d}" for i in range(12)])
    nodes = _nodes(len(corpus), corpus)
    store.upsert(nodes, np.ones((len(nodes), 2)), [{0: 1.0}] * len(nodes))
    every = nodes + [TextNode(id_=f"b{i:03d}", text="", metadata=m) for i, m in enumerate(BASE_CORPUS)]
    expected = sorted(n.node_id for n in every if metadata_matches(n.metadata, filters))
    got = sorted(h.node_id for h in store.query(dense=[1.0, 0.0], filter=filters, limit=100))
    assert got == expected, (corpus, filters)
    assert store.count(filters) == len(expected)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpus=st.lists(METADATA, min_size=4, max_size=12), leaf=LEAVES)
def test_each_translated_operator_selects_what_metadata_matches_selects(shared_store: EdgeStore, corpus, leaf) -> None:
    test_translated_filters_select_what_metadata_matches_selects.hypothesis.inner_test(
        shared_store, corpus, MetadataFilters(filters=[leaf])
    )


@pytest.mark.parametrize(
    "leaf, message",
    [
        (MetadataFilter(key="a", value="b", operator=FilterOperator.GT), "string ordering"),
        (MetadataFilter(key="a", value=["x"], operator=FilterOperator.EQ), "list equality"),
        (MetadataFilter(key="a", value=[1], operator=FilterOperator.NE), "list equality"),
        (MetadataFilter(key="a", value=2**60, operator=FilterOperator.LT), "beyond"),
        (MetadataFilter(key="a.b", value=1, operator=FilterOperator.EQ), "keys must match"),
        (MetadataFilter(key="a", value=[1], operator=FilterOperator.GT), "needs a single"),  # validate_filters
    ],
)
def test_untranslatable_filters_are_refused(leaf: MetadataFilter, message: str) -> None:
    nested = MetadataFilters(filters=[MetadataFilters(filters=[leaf], condition=FilterCondition.NOT)])
    with pytest.raises(ValueError, match=message):
        translate_filters(nested)


def test_kind_tokens() -> None:
    tokens = kind_tokens({"s": "", "n": 2.5, "t": True, "l": [False, "x"], "e": [], "m": None})
    assert sorted(tokens) == sorted(
        ["str:s", "empty:s", "num:n", "true:t", "list:l", "lfalse:l", "list:e", "empty:e"]
    )
    assert translate_filters(None) is None
