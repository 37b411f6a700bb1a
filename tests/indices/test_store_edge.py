"""EdgePoints (Qdrant Edge): the engine behaviours the store relies on.

These pin qdrant-edge-py's behaviour: a version bump that changes scoring, fusion, persistence,
payload indexes or filter matching must fail here (filters: tests/indices/test_store_filters.py).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

pytest.importorskip("qdrant_edge")

from llama_index_retrieval_kit.indices.store import (  # noqa: E402
    BOOKKEEPING_TOKEN,
    KINDS_FIELD,
    NODE_ID_NAMESPACE,
    EdgePoints,
    FilterRoute,
    IndexKind,
    StoreBusyError,
    UntranslatableFilterError,
    filter_fields,
    kind_tokens,
    metadata_field,
    node_payload,
    plan_search,
    point_id,
    token_code,
    translate_filters,
)

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


def write(store: Any, nodes: List[TextNode], dense: Any, sparse: List[Any]) -> None:
    store.upsert_points([point_id(n.node_id) for n in nodes], dense, sparse, [node_payload(n) for n in nodes])


def node_ids(hits: List[Any]) -> List[str]:
    return [json.loads(payload["_node_content"])["id_"] for payload, _ in hits]


@pytest.fixture
def store(tmp_path: Path):
    opened = EdgePoints(tmp_path / "store")
    opened.create(DIM)
    yield opened
    opened.close()


# ------------------------------------------------------------------ writes, ids, persistence


def test_upsert_delete_count_and_reopen(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    nodes = _nodes(50)
    store = EdgePoints(tmp_path / "s")
    assert not store.exists() and store.count() == 0 and store.search([1.0] * DIM, limit=3) == []
    store.create(DIM)
    write(store, nodes, _unit(rng, 50), _sparse(rng, 50))
    assert store.count() == 50
    write(store, nodes[:5], _unit(rng, 5), _sparse(rng, 5))  # same ids: replaced, not added
    assert store.count() == 50
    store.delete_points([point_id(i) for i in ("n000", "n001", "unknown")])
    assert store.count() == 48
    with pytest.raises(StoreBusyError):
        EdgePoints(tmp_path / "s")  # one open per shard
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.count()
    reopened = EdgePoints(tmp_path / "s")
    try:
        assert reopened.count() == 48 and reopened.dense_dim == DIM
        ids = {json.loads(p.payload["_node_content"])["id_"] for p in reopened.iter_points()}
        assert "n002" in ids and "n049" in ids and "n000" not in ids and len(ids) == 48
    finally:
        reopened.close()


def test_payload_is_the_llamaindex_layout_plus_filter_bookkeeping(store: EdgePoints) -> None:
    node = TextNode(
        id_=str(uuid.uuid4()),
        text="Fees: 5 % é",
        metadata={"doc_id": "a.pdf", "section_path": ["1. Fees", "1.2 Late"], "page_start": 3, "x": None, "Title": "Fees"},
        excluded_llm_metadata_keys=["doc_id"],
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc-1")},
        start_char_idx=10,
        end_char_idx=20,
    )
    original = node.model_copy(deep=True)
    write(store, [node], np.ones((1, DIM)), [{3: 1.0}])
    assert node.to_dict() == original.to_dict()  # the caller's node is not changed
    ((payload, _),) = store.search(np.ones(DIM), limit=1)
    layout = node_to_metadata_dict(node, remove_text=False, flat_metadata=False)
    assert {k: v for k, v in payload.items() if not k.startswith("_") or k in layout} == layout
    assert metadata_dict_to_node(payload).to_dict() == node.to_dict()  # what QdrantVectorStore reads
    assert payload["doc_id"] == "doc-1" and payload["_masked"] == {"doc_id": "a.pdf"}  # the layout's own doc_id
    assert payload["_lower"] == {"Title": "fees"}  # only what lower-casing changes
    tokens = [BOOKKEEPING_TOKEN, "str:doc_id", "list:section_path", "lstr:section_path", "num:page_start", "str:Title", "upper:Title"]
    assert sorted(payload[KINDS_FIELD]) == sorted(token_code(t) for t in tokens)


def test_point_ids() -> None:
    known = str(uuid.uuid4())
    assert point_id(known) == known
    assert point_id("n1") == str(uuid.uuid5(NODE_ID_NAMESPACE, "n1"))
    with pytest.raises(ValueError, match="non-empty str"):
        point_id("")


@given(
    node_id=st.one_of(
        st.uuids().map(str),
        st.uuids().map(lambda u: str(u).upper()),
        st.uuids().map(lambda u: u.hex),
        st.uuids().map(lambda u: "{" + str(u) + "}"),
        st.text(alphabet="0123456789abcdefABCDEF-{}", min_size=1, max_size=40),
        st.text(min_size=1, max_size=20),
    )
)
def test_point_id_is_the_parsed_uuid_or_the_uuid5(node_id: str) -> None:
    """The canonical-UUID shortcut returns what parsing returns, for any id."""
    try:
        want = str(uuid.UUID(node_id))
    except ValueError:
        want = str(uuid.uuid5(NODE_ID_NAMESPACE, node_id))
    assert point_id(node_id) == want


def test_bad_vectors_are_refused(store: EdgePoints) -> None:
    nodes = _nodes(2)
    with pytest.raises(ValueError, match=r"shape \(2, 8\)"):
        write(store, nodes, np.ones((2, 3)), [{1: 1.0}, {1: 1.0}])
    with pytest.raises(ValueError, match="all-zero"):
        write(store, nodes, np.zeros((2, DIM)), [{1: 1.0}, {1: 1.0}])
    with pytest.raises(ValueError, match="NaN or inf"):
        write(store, nodes, np.full((2, DIM), np.nan), [{1: 1.0}, {1: 1.0}])
    with pytest.raises(ValueError, match="repeated indices"):
        write(store, nodes, np.ones((2, DIM)), [([1, 1], [1.0, 1.0]), {1: 1.0}])
    with pytest.raises(ValueError, match="2 ids, 1 sparse"):
        write(store, nodes, np.ones((2, DIM)), [{1: 1.0}])
    assert store.count() == 0


# ------------------------------------------------------------------ scoring and fusion


def test_dense_scores_are_numpy_cosine(store: EdgePoints) -> None:
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(200, DIM)) * rng.uniform(0.1, 5, size=(200, 1))  # not normalised
    write(store, _nodes(200), raw, _sparse(rng, 200))
    query = rng.normal(size=DIM)
    expected = (raw / np.linalg.norm(raw, axis=1, keepdims=True)) @ (query / np.linalg.norm(query))
    order = np.argsort(-expected)[:20]
    for _ in ("segments as written", "after optimize (HNSW)"):
        hits = store.search(query, limit=20)
        assert node_ids(hits) == [f"n{i:03d}" for i in order]
        np.testing.assert_allclose([s for _, s in hits], expected[order], atol=1e-5)
        store.optimize()


def test_sparse_scores_use_idf(store: EdgePoints) -> None:
    rng = np.random.default_rng(2)
    docs = _sparse(rng, 60, vocab=12, terms=4)
    write(store, _nodes(60), _unit(rng, 60), docs)
    query = {0: 1.0, 3: 0.5, 7: 2.0}
    n_docs = len(docs)
    idf = {t: math.log((n_docs - df + 0.5) / (df + 0.5) + 1) for t in query for df in [sum(t in d for d in docs)]}
    expected = {f"n{i:03d}": sum(w * d[t] * idf[t] for t, w in query.items() if t in d) for i, d in enumerate(docs)}
    hits = store.search(None, query, limit=60)
    assert set(node_ids(hits)) == {k for k, v in expected.items() if v > 0}
    for node_id, (_, score) in zip(node_ids(hits), hits):
        assert score == pytest.approx(expected[node_id], rel=1e-5)
    assert store.search(None, {}, limit=5) == []  # no terms: nothing to rank


def test_rrf_follows_package_convention(store: EdgePoints) -> None:
    rng = np.random.default_rng(3)
    write(store, _nodes(80), _unit(rng, 80), _sparse(rng, 80, vocab=10))
    dense, sparse = rng.normal(size=DIM), {1: 1.0, 4: 1.0}
    legs = [store.search(dense, limit=20), store.search(None, sparse, limit=20)]
    expected: Dict[str, float] = {}
    for leg in legs:
        for rank, node_id in enumerate(node_ids(leg), start=1):  # package RRF: 1 / (k + rank), ranks from 1
            expected[node_id] = expected.get(node_id, 0.0) + 1.0 / (60 + rank)
    fused = store.search(dense, sparse, fusion="rrf", limit=10, prefetch_limit=20)
    assert len(fused) == 10
    for node_id, (_, score) in zip(node_ids(fused), fused):
        assert score == pytest.approx(expected[node_id], rel=1e-6)
    assert [s for _, s in fused] == pytest.approx(sorted(expected.values(), reverse=True)[:10], rel=1e-6)
    dbsf = store.search(dense, sparse, fusion="dbsf", limit=10, prefetch_limit=20)
    assert set(node_ids(dbsf)) <= set(expected) and len(dbsf) == 10


def test_filter_applies_to_every_leg_of_a_fused_query(store: EdgePoints) -> None:
    rng = np.random.default_rng(4)
    nodes = _nodes(80, [{"tenant": f"t{i % 4}"} for i in range(80)])
    write(store, nodes, _unit(rng, 80), _sparse(rng, 80, vocab=10))
    only = MetadataFilters(filters=[MetadataFilter(key="tenant", value="t2")])
    point_filter = store.metadata_filter(only, nodes)
    assert point_filter is not None and point_filter.route == FilterRoute.ENGINE
    hits = store.search(rng.normal(size=DIM), {1: 1.0}, filter=point_filter, fusion="rrf", limit=30)
    assert len(hits) == 20 and {p["tenant"] for p, _ in hits} == {"t2"}
    assert store.count(point_filter) == 20
    assert store.metadata_filter(None, nodes) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dense": None}, "dense vector, a sparse vector or both"), ({"dense": [1.0] * DIM, "fusion": "max"}, "unknown engine fusion"),
     ({"dense": [1.0] * DIM, "limit": 0}, "limit must be"), ({"dense": [1.0] * DIM, "prefetch_limit": True}, "prefetch_limit must be"),
     ({"dense": [1.0] * DIM, "rrf_k": -1}, "rrf_k must be"), ({"dense": [float("nan")] * DIM}, "finite"),
     ({"dense": [[1.0]]}, "1-d"), ({"dense": None, "sparse": {1: float("inf")}}, "NaN or inf")],
)
def test_search_arguments_are_checked(kwargs: Dict[str, Any], message: str) -> None:
    kwargs = {"limit": 5, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan_search(kwargs.pop("dense"), kwargs.pop("sparse", None), **kwargs)


def test_one_plan_per_search_shape() -> None:
    dense_only = plan_search([1.0, 0.0], limit=3)
    assert dense_only is not None and [leg.kind for leg in dense_only.legs] == ["dense"] and dense_only.fusion is None
    fused = plan_search([1.0, 0.0], {2: 1.0}, limit=3, rrf_k=60, fusion="dbsf")
    assert fused is not None and [leg.kind for leg in fused.legs] == ["dense", "sparse"] and fused.fusion == "dbsf"
    assert fused.engine_rrf_k == 61  # Qdrant counts ranks from 0
    termless = plan_search([1.0, 0.0], {}, limit=3)  # a stopword-only query: the dense prefetch alone, still fused
    assert termless is not None and [leg.kind for leg in termless.legs] == ["dense"] and termless.fusion == "rrf"
    assert plan_search(None, {}, limit=3) is None


# ------------------------------------------------------------------ payload indexes


def _index_types(path: Path) -> Dict[str, str]:
    import qdrant_edge as qe

    shard = qe.EdgeShard.load(str(path / "shard"))
    try:
        return {field: str(info.data_type).rpartition(".")[2] for field, info in shard.info().payload_schema.items()}
    finally:
        shard.close()


def _filter_on(store: EdgePoints, *keys: str) -> None:
    for key in keys:
        filters = MetadataFilters(filters=[MetadataFilter(key=key, value=0, operator=FilterOperator.NE)])
        assert store.metadata_filter(filters, []).route == FilterRoute.ENGINE


def test_payload_indexes_are_made_for_filtered_keys_and_persist(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    store = EdgePoints(tmp_path / "s")
    store.create(DIM)
    assert store.payload_indexes == {KINDS_FIELD: IndexKind.INTEGER}
    metadata = [{"tenant": "t1", "n": 1, "flag": True, "tags": [1, 2], "doc_id": "d", "unfiltered": "x"}, {"mixed": 2.5}]
    write(store, _nodes(2, metadata), _unit(rng, 2), _sparse(rng, 2))
    assert store.payload_indexes == {KINDS_FIELD: IndexKind.INTEGER}  # writes alone index nothing more (each index costs writes)
    _filter_on(store, "tenant", "n", "flag", "tags", "doc_id", "mixed", "absent")
    expected = {KINDS_FIELD: "integer", "tenant": "keyword", "n": "float", "tags": "float", "_masked.doc_id": "keyword", "mixed": "float"}
    assert {f: k.value for f, k in store.payload_indexes.items()} == expected  # booleans are _kinds tokens: no index
    write(store, [TextNode(id_="n100", text="t", metadata={"mixed": "now a string", "n": 3, "unfiltered": 2})], _unit(rng, 1), _sparse(rng, 1))
    expected["mixed"] = "keyword"  # strings outrank numbers: the index is replaced, never downgraded
    assert {f: k.value for f, k in store.payload_indexes.items()} == expected
    write(store, [TextNode(id_="n101", text="t", metadata={"mixed": 7})], _unit(rng, 1), _sparse(rng, 1))
    assert store.payload_indexes["mixed"] == IndexKind.KEYWORD
    store.close()
    assert _index_types(tmp_path / "s") == {f: k.capitalize() for f, k in expected.items()}  # in the engine, on disk
    reopened = EdgePoints(tmp_path / "s")
    try:
        assert {f: k.value for f, k in reopened.payload_indexes.items()} == expected
    finally:
        reopened.close()


# ------------------------------------------------------------------ bookkeeping and translation (pure)


def test_kind_tokens_name_each_value_and_mark_what_the_engine_cannot_compare() -> None:
    tokens = kind_tokens(
        {"s": "", "n": 2.5, "t": True, "l": [False, "X", 3], "e": [], "m": None, "tu": ("a",), "U": "Ab",
         "d": {"a": 1}, "big": 2**60, "nan": float("nan"), "nested": [[1]], "np": np.int64(3), "bad key": "x"}
    )
    assert sorted(tokens) == sorted(
        [BOOKKEEPING_TOKEN, "str:s", "empty:s", "num:n", "true:t", "list:l", "lfalse:l", "lstr:l", "lnum:l", "list:e", "empty:e",
         "list:tu", "lstr:tu", "str:U", "upper:U", "other:d", "other:big", "other:nan", "other:nested", "other:np"]
    )
    assert filter_fields({"_kinds": "X", "doc_id": ("a", "b"), "big": 2**60}) == {
        "_kinds": [token_code(t) for t in (BOOKKEEPING_TOKEN, "str:_kinds", "upper:_kinds", "list:doc_id", "lstr:doc_id", "other:big")],
        "_lower": {"_kinds": "x"},
        "_masked": {"_kinds": "X", "doc_id": ["a", "b"]},
    }
    assert filter_fields({"a": "lower", "b": 1}) == {KINDS_FIELD: [token_code(t) for t in (BOOKKEEPING_TOKEN, "str:a", "num:b")]}
    assert len({token_code(t) for t in tokens}) == len(tokens) and all(0 <= token_code(t) < 2**62 for t in tokens)
    assert metadata_field("tenant") == "tenant" and metadata_field("ref_doc_id") == "_masked.ref_doc_id"


@pytest.mark.parametrize(
    "leaf, message",
    [
        (MetadataFilter(key="a", value="b", operator=FilterOperator.GT), "string ordering"),
        (MetadataFilter(key="a", value=["x"], operator=FilterOperator.EQ), "list equality"),
        (MetadataFilter(key="a", value=[1], operator=FilterOperator.NE), "list equality"),
        (MetadataFilter(key="a", value=2**60, operator=FilterOperator.LT), "2\\*\\*53"),
        (MetadataFilter(key="a.b", value=1, operator=FilterOperator.EQ), "keys must match"),
    ],
)
def test_untranslatable_filters_are_refused(leaf: MetadataFilter, message: str) -> None:
    nested = MetadataFilters(filters=[MetadataFilters(filters=[leaf], condition=FilterCondition.NOT)])
    with pytest.raises(UntranslatableFilterError, match=message):
        translate_filters(nested)


def test_malformed_filters_are_value_errors() -> None:
    malformed = MetadataFilters(filters=[MetadataFilter(key="a", value=[1], operator=FilterOperator.GT)])
    with pytest.raises(ValueError, match="needs a single"):
        translate_filters(malformed)
    assert translate_filters(None) is None


# ------------------------------------------------------------------ HNSW on demand


def test_unindexed_vectors_counts_dense_vectors_outside_hnsw(tmp_path: Path) -> None:
    """What ``HybridIndex.optimize`` and its hint rely on: ``ShardInfo.indexed_vectors_count``
    counts non-empty sparse vectors and HNSW dense vectors; HNSW is built by ``optimize`` only for
    segments above Edge's indexing threshold (about 6,700 384-d vectors), and search is exact
    either way."""
    rng = np.random.default_rng(11)
    for n, hnsw in ((5_000, False), (8_000, True)):
        store = EdgePoints(tmp_path / f"s{n}")
        try:
            store.create(384)
            vectors = _unit(rng, n, 384)
            store.upsert_points([point_id(f"n{i}") for i in range(n)], vectors, [([i % 50], [1.0]) for i in range(n)], [{"doc_id": f"d{i}"} for i in range(n)])
            assert store.unindexed_vectors() == n  # written: scanned, not in HNSW
            query = vectors[17] + 0.1 * vectors[42]
            exact = np.argsort(-(vectors @ (query / np.linalg.norm(query))))[:10]
            assert [h[0]["doc_id"] for h in store.search(query, limit=10)] == [f"d{i}" for i in exact]  # a plain scan is exact
            assert store.optimize() is hnsw
            assert store.unindexed_vectors() == (0 if hnsw else n)
            assert store.optimize() is False  # nothing left to do
            found = [h[0]["doc_id"] for h in store.search(query, limit=10)]
            # HNSW is approximate (its build is multi-threaded: not bit-reproducible), and random
            # 384-d vectors are its hard case: recall@10 measured 0.7-1.0 here; the nearest is found.
            assert found[0] == f"d{exact[0]}" and len(set(found) & {f"d{i}" for i in exact}) >= 6
        finally:
            store.close()
    reopened = EdgePoints(tmp_path / "s8000")
    try:
        assert reopened.unindexed_vectors() == 0  # HNSW persisted
    finally:
        reopened.close()


def test_dense_block_is_every_vector_in_one_matrix(tmp_path: Path) -> None:
    """``dense_block`` (the dense matrix's source, converted page by page) holds what
    ``dense_vectors`` holds, on both transports, across several scroll pages."""
    from qdrant_client import QdrantClient

    from llama_index_retrieval_kit.indices.store import SCROLL_PAGE, ServerPoints

    rng = np.random.default_rng(5)
    n = SCROLL_PAGE + 37
    nodes, vectors, sparse = _nodes(n), _unit(rng, n), _sparse(rng, n)
    edge = EdgePoints(tmp_path / "edge")
    server = ServerPoints(QdrantClient(location=":memory:"), "block")
    try:
        assert edge.dense_block()[0] == [] and server.dense_block()[0] == []  # nothing created yet
        edge.create(DIM)
        server.create(DIM)
        for store in (edge, server):
            write(store, nodes, vectors, sparse)
            ids, block = store.dense_block()
            by_id = store.dense_vectors()
            assert block.dtype == np.float32 and block.shape == (n, DIM) and sorted(ids) == sorted(by_id)
            np.testing.assert_array_equal(block, np.asarray([by_id[i] for i in ids], dtype=np.float32))
            np.testing.assert_allclose(block[ids.index(point_id("n007"))], vectors[7], atol=1e-6)
    finally:
        edge.close()
        server.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 0.25, 0.1, 1.0]), st.uuids()), max_size=20, unique_by=lambda h: h[1]), st.integers(1, 25))
def test_ranked_hits_orders_by_score_then_point_id(hits, limit) -> None:
    from types import SimpleNamespace

    from llama_index_retrieval_kit.indices.store import ranked_hits

    objects = [SimpleNamespace(score=score, id=uid) for score, uid in hits]
    got = ranked_hits(objects, limit)
    assert len(got) == min(limit, len(objects))
    keys = [(-h.score, str(h.id)) for h in got]
    assert keys == sorted(keys) and keys == sorted((-h.score, str(h.id)) for h in objects)[:limit]
    assert ranked_hits(list(reversed(objects)), limit) == got
