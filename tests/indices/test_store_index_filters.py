"""A HybridIndex's Qdrant-side filters (``qdrant_hybrid``, ``dense_search="qdrant"``) run in the
engine, rank exactly as the id-list filter they replace, and keep working on folders written
before the filter bookkeeping existed; a push to a server carries the same payload indexes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import qdrant_edge as qe
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters
from qdrant_client import QdrantClient

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module
from llama_index_retrieval_kit.indices.store import BOOKKEEPING_FIELDS, EdgePoints, FilterRoute, IndexKind, filter_fields
from llama_index_retrieval_kit.retrievers import metadata_matches
from llama_index_retrieval_kit.retrievers.qdrant_hybrid import QdrantDenseRetriever, QdrantHybridRetriever

from . import _support

F = MetadataFilter
ENGINE_FILTERS = [
    MetadataFilters(filters=[F(key="doc_id", value="product_manual.md")]),
    MetadataFilters(filters=[F(key="doc_id", value="credit_card_terms.md", operator=FilterOperator.NE), F(key="page_start", value=2, operator=FilterOperator.GT)]),
    MetadataFilters(filters=[F(key="section_path", value="2. Fees", operator=FilterOperator.CONTAINS), F(key="section_title", value="annual", operator=FilterOperator.TEXT_MATCH_INSENSITIVE)], condition=FilterCondition.OR),
    MetadataFilters(filters=[MetadataFilters(filters=[F(key="doc_id", value=["privacy_policy.txt", "missing.txt"], operator=FilterOperator.IN)], condition=FilterCondition.NOT)]),
]
PYTHON_FILTERS = [MetadataFilters(filters=[F(key="section_title", value="3", operator=FilterOperator.GT)])]  # a string range


def _rankings(index: HybridIndex, filters: MetadataFilters, bundles: Any, point_filter: Any) -> Dict[str, List]:
    """qdrant_hybrid (RRF and DBSF) and the engine's dense search, each with ``point_filter``."""
    common = {"similarity_top_k": 10, "filters": filters, "point_filter": lambda: point_filter}
    retrievers = {
        fusion: QdrantHybridRetriever(index.store, index.config["collection"], index.embed_model, index.bm25.tokenize, fusion=fusion, **common)
        for fusion in ("rrf", "dbsf")
    }
    retrievers["dense"] = QdrantDenseRetriever(index.store, index.config["collection"], index.embed_model, **common)
    return {f"{name} {qb.query_str}": _support.ranking(r.retrieve(qb)) for name, r in retrievers.items() for qb in bundles}


def _id_list(index: HybridIndex, filters: MetadataFilters) -> Any:
    nodes = index.bm25.snapshot.nodes
    allowed = [n.node_id for n in nodes if metadata_matches(n.metadata, filters)]
    return index.store.ids_filter(allowed, [n.node_id for n in nodes if n.node_id not in set(allowed)])


def _as_retrieved(index: HybridIndex, filters: MetadataFilters, bundles: Any) -> Dict[str, List]:
    """What ``as_retriever`` gives in the Qdrant-side modes (the route HybridIndex picks)."""
    modes = {"rrf": ("qdrant_hybrid", {}), "dbsf": ("qdrant_hybrid", {"fusion": "dbsf"}), "dense": ("dense", {"dense_search": "qdrant"})}
    out = {}
    for name, (mode, options) in modes.items():
        retriever = index.as_retriever(mode, similarity_top_k=10, filters=filters, **options)
        for qb in bundles:
            out[f"{name} {qb.query_str}"] = _support.ranking(retriever.retrieve(qb))
    return out


def _routes(index: HybridIndex, filters_list: List[MetadataFilters]) -> List[FilterRoute]:
    return [index.store.metadata_filter(f, index.bm25.snapshot.nodes).route for f in filters_list]


def test_engine_filters_rank_exactly_like_id_lists(index: HybridIndex, bundles) -> None:
    assert _routes(index, ENGINE_FILTERS) == [FilterRoute.ENGINE] * len(ENGINE_FILTERS)
    assert _routes(index, PYTHON_FILTERS) == [FilterRoute.ID_LIST]
    for filters in ENGINE_FILTERS + PYTHON_FILTERS:
        got = _as_retrieved(index, filters, bundles[:4])
        want = _rankings(index, filters, bundles[:4], _id_list(index, filters))
        assert got.keys() == want.keys()
        for key in want:
            _support.assert_same_ranking(got[key], want[key], tol=1e-6, truncated=True)
            assert all(metadata_matches(index.docstore.get_node(i).metadata, filters) for i, _ in got[key])


def _strip_bookkeeping(index: HybridIndex) -> None:
    """Rewrite every point as HybridIndex wrote it before the filter bookkeeping existed."""
    points = list(index.store.iter_points())
    index.store.upsert_points(
        [p.point_id for p in points],
        [p.dense for p in points],
        [p.sparse for p in points],
        [{k: v for k, v in p.payload.items() if k not in BOOKKEEPING_FIELDS} for p in points],
    )
    index.store.flush()


def test_a_folder_written_without_bookkeeping_is_upgraded_on_open(index_dir: Path, embed_model, bundles) -> None:
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        want = {i: _as_retrieved(index, f, bundles[:3]) for i, f in enumerate(ENGINE_FILTERS)}
        _strip_bookkeeping(index)
        before = {p.point_id: p.payload for p in index.store.iter_points()}
        assert not any(set(BOOKKEEPING_FIELDS) & set(payload) for payload in before.values())
    shard = qe.EdgeShard.load(str(index_dir / "edge" / "shard"))  # the _kinds index as the previous version made it
    shard.update(qe.UpdateOperation.create_field_index("_kinds", qe.PayloadSchemaType.Keyword))
    shard.close()
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        legs = _support.assert_consistent(index)  # nothing indexed was lost
        assert index.store.payload_indexes["_kinds"] == IndexKind.INTEGER
        for point in legs.qdrant.values():
            metadata = json.loads(point.payload["_node_content"])["metadata"]
            assert point.payload == {**before[point.point_id], **filter_fields(metadata)}
        assert _routes(index, ENGINE_FILTERS) == [FilterRoute.ENGINE] * len(ENGINE_FILTERS)
        for i, filters in enumerate(ENGINE_FILTERS):
            got = _as_retrieved(index, filters, bundles[:3])
            for key in want[i]:
                _support.assert_same_ranking(got[key], want[i][key], tol=1e-6, truncated=True)


def test_a_folder_that_cannot_be_upgraded_keeps_working(index_dir: Path, embed_model, bundles, monkeypatch) -> None:
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        want = {i: _as_retrieved(index, f, bundles[:3]) for i, f in enumerate(ENGINE_FILTERS)}
        _strip_bookkeeping(index)

    def cannot_write(self: Any) -> int:
        raise OSError("Read-only file system")

    monkeypatch.setattr(EdgePoints, "upgrade_payloads", cannot_write)
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        assert _routes(index, ENGINE_FILTERS) == [FilterRoute.ID_LIST] * len(ENGINE_FILTERS)
        for i, filters in enumerate(ENGINE_FILTERS):
            got = _as_retrieved(index, filters, bundles[:3])
            for key in want[i]:
                _support.assert_same_ranking(got[key], want[i][key], tol=1e-6, truncated=True)


@pytest.fixture()
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """qdrant-client's local mode standing in for a Qdrant server at any URL, recording the
    payload indexes it is asked to create."""
    client = QdrantClient(path=str(tmp_path / "server"))
    created: Dict[str, Any] = {}

    class Recording:
        indexes = created

        def __getattr__(self, name):
            return getattr(client, name)

        def create_payload_index(self, collection_name, field_name, field_schema=None, **kwargs):
            created[field_name] = field_schema
            return client.create_payload_index(collection_name, field_name, field_schema=field_schema, **kwargs)

        def close(self, **kwargs):  # one server outlives the clients of every index
            pass

    monkeypatch.setattr(hybrid_index_module, "server_client", lambda url, api_key=None: Recording())
    yield Recording()
    client.close()


def test_push_to_creates_the_same_payload_indexes_and_the_server_filters_in_the_engine(index: HybridIndex, index_dir: Path, embed_model, bundles, server) -> None:
    want = {i: _support.run_modes(index, bundles[:3], modes=("qdrant_hybrid", "hybrid"), filters=f) for i, f in enumerate(ENGINE_FILTERS)}
    for i, f in enumerate(ENGINE_FILTERS):  # a server's "hybrid" runs its dense leg in Qdrant: min-max score fusion there
        hybrid = index.as_retriever("hybrid", filters=f, dense_search="qdrant")
        want[i].update({("hybrid", qb.query_str): _support.ranking(hybrid.retrieve(qb)) for qb in bundles[:3]})
    embedded = index.store.payload_indexes  # the filtered keys' indexes, made by the queries above
    assert embedded["_masked.doc_id"] == IndexKind.KEYWORD and embedded["page_start"] == IndexKind.FLOAT
    assert embedded["section_title"] == IndexKind.KEYWORD and embedded["section_path"] == IndexKind.KEYWORD
    assert "chunk_id" not in embedded and "char_start" not in embedded  # never filtered: no index to pay for
    index.push_to("http://qdrant.example:6333")
    assert {field: str(schema.value) for field, schema in server.indexes.items()} == {f: k.value for f, k in embedded.items()}
    index.close()
    with HybridIndex.load(index_dir, embed_model=embed_model, qdrant_url="http://qdrant.example:6333") as served:
        assert _routes(served, ENGINE_FILTERS) == [FilterRoute.ENGINE] * len(ENGINE_FILTERS)
        for i, filters in enumerate(ENGINE_FILTERS):
            got = _support.run_modes(served, bundles[:3], modes=("qdrant_hybrid", "hybrid"), filters=filters)
            _support.assert_same_results(got, want[i], tol=1e-5)
