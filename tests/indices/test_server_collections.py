"""Indexes on a Qdrant server never lose or leak another collection's points.

qdrant-client's local mode stands in for the server (as in the other server tests): every
``HybridIndex`` gets a client of one shared local-mode store. Checked: a build or a push never
replaces a collection another index or application wrote (unless ``overwrite=True`` for a push),
two indexes on one server need two names and never see each other's points, a rebuild keeps none
of the old points, a failed build leaves nothing behind, and a folder refuses to serve another
index's collection. Vectors do not matter here (``MockEmbedding``): answers are compared as sets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List

import pytest
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from qdrant_client import QdrantClient, models

from llama_index_retrieval_kit.indices import HybridIndex, IndexManifest
from llama_index_retrieval_kit.indices.store import (
    ForeignCollectionError,
    ServerCollections,
    ServerPoints,
    build_collection_name,
    is_build_collection_name,
    served_collection_name,
)

from . import _support

URL = "http://qdrant.example:6333"
MODEL = MockEmbedding(embed_dim=8)


@pytest.fixture()
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[QdrantClient]:
    client = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    yield client
    client.close()


def documents(prefix: str, n: int = 2) -> List[Document]:
    return [Document(text=f"Topic {i}\n\nDocument {prefix}{i} is about topic {i}, fees and filters.", id_=f"{prefix}{i}.txt") for i in range(n)]


def foreign_collection(server: QdrantClient, name: str = "chunks", points: int = 5) -> None:
    """Another application's collection: its own schema and payloads, no index id."""
    server.create_collection(name, vectors_config={"text-dense": models.VectorParams(size=8, distance=models.Distance.COSINE)})
    server.upsert(name, points=[models.PointStruct(id=i, vector={"text-dense": [0.1] * 8}, payload={"owner": "other-app"}) for i in range(points)])


def foreign_points(server: QdrantClient, name: str = "chunks") -> int:
    owned = models.Filter(must=[models.FieldCondition(key="owner", match=models.MatchValue(value="other-app"))])
    return server.count(name, count_filter=owned).count


def collections(server: QdrantClient) -> List[str]:
    return sorted(c.name for c in server.get_collections().collections)


def aliases(server: QdrantClient) -> dict:
    return {a.alias_name: a.collection_name for a in server.get_aliases().aliases}


def engine_doc_ids(index: HybridIndex) -> dict:
    """The documents each engine-side mode returns for a query every chunk matches."""
    return {
        mode: sorted({r.node.ref_doc_id for r in index.as_retriever(mode, similarity_top_k=20, **extra).retrieve("topic fees filters")})
        for mode, extra in (("qdrant_hybrid", {}), ("dense", {"dense_search": "qdrant"}))
    }


# ------------------------------------------------------------------------------------ names
def test_build_collection_names_round_trip() -> None:
    built = build_collection_name("tenant_a")
    assert built.startswith("tenant_a-") and is_build_collection_name(built) and served_collection_name(built) == "tenant_a"
    assert served_collection_name("chunks") == "chunks" and not is_build_collection_name("chunks")
    assert build_collection_name("chunks") != build_collection_name("chunks")  # a fresh one each build


@pytest.mark.parametrize("bad", ["a/b", "", "../victim", "x" * 129, "chunks-0123456789ab", 5])
def test_a_bad_collection_name_is_refused_before_anything_is_built(tmp_path: Path, bad) -> None:
    with pytest.raises(ValueError, match="collection"):
        HybridIndex.from_documents(documents("d"), tmp_path / "idx", embed_model=MODEL, collection=bad)
    assert not (tmp_path / "idx" / "index.json").exists()


def test_an_embedded_index_records_its_collection_and_an_id_kept_by_upserts(tmp_path: Path) -> None:
    with HybridIndex.from_documents(documents("d"), tmp_path / "idx", embed_model=MODEL, collection="tenant_a") as index:
        index_id = index.manifest.index_id
        assert index.manifest.collection == "tenant_a" and len(index_id) == 32
        index.upsert(documents("e"))
    assert json.loads((tmp_path / "idx" / "index.json").read_text())["index_id"] == index_id
    with HybridIndex.load(tmp_path / "idx", embed_model=MODEL) as index:
        assert index.manifest.index_id == index_id


# ------------------------------------------------------------------------------------ builds
def test_a_build_refuses_a_collection_another_application_wrote(tmp_path: Path, server: QdrantClient) -> None:
    foreign_collection(server)
    with pytest.raises(ForeignCollectionError, match=r"'chunks'.*5 point\(s\).*collection=") as err:
        HybridIndex.from_documents(documents("d"), tmp_path / "idx", embed_model=MODEL, qdrant_url=URL)
    assert err.value.collection == "chunks" and err.value.owner is None
    assert foreign_points(server) == 5 and collections(server) == ["chunks"]  # untouched, nothing left behind
    assert not (tmp_path / "idx" / "index.json").exists()


def test_two_indexes_on_one_server_need_two_names_and_never_see_each_other(tmp_path: Path, server: QdrantClient) -> None:
    with HybridIndex.from_documents(documents("a"), tmp_path / "A", embed_model=MODEL, qdrant_url=URL) as a:
        a_id, a_collection = a.manifest.index_id, a.manifest.collection
    assert served_collection_name(a_collection) == "chunks" and aliases(server) == {"chunks": a_collection}
    with pytest.raises(ForeignCollectionError, match=f"'chunks'.*index with id {a_id}") as err:
        HybridIndex.from_documents(documents("b"), tmp_path / "B", embed_model=MODEL, qdrant_url=URL)
    assert err.value.alias_of == a_collection
    with HybridIndex.from_documents(documents("b"), tmp_path / "B", embed_model=MODEL, qdrant_url=URL, collection="tenant_b") as b:
        assert b.manifest.index_id != a_id
        assert engine_doc_ids(b) == {"qdrant_hybrid": ["b0.txt", "b1.txt"], "dense": ["b0.txt", "b1.txt"]}
    for folder, prefix in (("A", "a"), ("B", "b")):
        with HybridIndex.load(tmp_path / folder, embed_model=MODEL) as index:
            assert engine_doc_ids(index)["qdrant_hybrid"] == [f"{prefix}0.txt", f"{prefix}1.txt"]
            assert server.count(index.manifest.collection).count == len(index)  # the marker is no point
    assert server.count("chunks").count == 2 and server.count("tenant_b").count == 2


def test_a_rebuild_on_a_server_keeps_none_of_the_old_points(tmp_path: Path, server: QdrantClient) -> None:
    path = tmp_path / "idx"
    with HybridIndex.from_documents(documents("old", 3), path, embed_model=MODEL, qdrant_url=URL, collection="kb") as index:
        index_id, old_collection = index.manifest.index_id, index.manifest.collection
    # a build collection of this index left by an interrupted build: removed by the next publish
    ServerPoints(_support.SharedServer(server), build_collection_name("kb"), url=URL, index_id=index_id).create(8)
    with HybridIndex.from_documents(documents("new", 1), path, embed_model=MODEL, qdrant_url=URL, overwrite=True) as index:
        assert index.manifest.index_id == index_id  # the same index, rebuilt: its collections stay recognisable
        assert served_collection_name(index.manifest.collection) == "kb" != index.manifest.collection != old_collection
        assert engine_doc_ids(index) == {"qdrant_hybrid": ["new0.txt"], "dense": ["new0.txt"]}
        new_collection = index.manifest.collection
    assert collections(server) == [new_collection] and aliases(server) == {"kb": new_collection}
    assert server.count("kb").count == 1
    with HybridIndex.load(path, embed_model=MODEL) as index:
        assert index.doc_ids() == ["new0.txt"] and engine_doc_ids(index)["dense"] == ["new0.txt"]


def test_a_failed_server_build_keeps_the_old_index_and_leaves_no_collection(tmp_path: Path, server: QdrantClient, monkeypatch) -> None:
    path = tmp_path / "idx"
    with HybridIndex.from_documents(documents("old", 2), path, embed_model=MODEL, qdrant_url=URL) as index:
        old_collection = index.manifest.collection
    monkeypatch.setattr(_support.SharedServer, "fail_upserts", True)
    with pytest.raises(ConnectionError):
        HybridIndex.from_documents(documents("new", 3), path, embed_model=MODEL, qdrant_url=URL, overwrite=True)
    monkeypatch.setattr(_support.SharedServer, "fail_upserts", False)
    assert collections(server) == [old_collection] and aliases(server) == {"chunks": old_collection}
    with HybridIndex.load(path, embed_model=MODEL) as index:
        assert engine_doc_ids(index)["qdrant_hybrid"] == ["old0.txt", "old1.txt"]
    monkeypatch.setattr(_support.SharedServer, "fail_upserts", True)
    with pytest.raises(ConnectionError):  # a first build too
        HybridIndex.from_documents(documents("x"), tmp_path / "other", embed_model=MODEL, qdrant_url=URL, collection="other")
    assert collections(server) == [old_collection]


def _legacy_server_folder(path: Path, server: QdrantClient, prefix: str, collection: str = "chunks") -> None:
    """A folder as versions before index ids left it on a server: a plain, unmarked collection
    named in index.json, no index_id. Made from an embedded build whose points are copied over."""
    with HybridIndex.from_documents(documents(prefix), path, embed_model=MODEL) as embedded:
        points = list(embedded.store.iter_points())
    unmarked = ServerPoints(_support.SharedServer(server), collection, url=URL)
    unmarked.create(8)
    unmarked.upsert_points([p.point_id for p in points], [p.dense for p in points], [p.sparse for p in points], [p.payload for p in points])
    manifest = IndexManifest.read(path / "index.json")
    legacy = manifest.with_qdrant_url(URL, collection).to_json()
    del legacy["index_id"]
    (path / "index.json").write_text(json.dumps(legacy), encoding="utf-8")


def test_a_folder_written_before_index_ids_still_opens_and_rebuilds_over_its_own_collection(tmp_path: Path, server: QdrantClient) -> None:
    path = tmp_path / "legacy"
    _legacy_server_folder(path, server, "old")
    with HybridIndex.load(path, embed_model=MODEL) as index:
        assert index.manifest.index_id is None and engine_doc_ids(index)["qdrant_hybrid"] == ["old0.txt", "old1.txt"]
    with HybridIndex.from_documents(documents("new", 1), path, embed_model=MODEL, qdrant_url=URL, overwrite=True) as index:
        assert engine_doc_ids(index)["dense"] == ["new0.txt"]
        assert aliases(server) == {"chunks": index.manifest.collection} and collections(server) == [index.manifest.collection]


def test_a_rebuild_never_takes_a_collection_shared_with_another_folder(tmp_path: Path, server: QdrantClient) -> None:
    """Two folders of before index ids wrote into one 'chunks' (the audit's leak): its point count
    is not the folder's, so a rebuild of one cannot tell it is its own and refuses."""
    _legacy_server_folder(tmp_path / "A", server, "a")
    _legacy_server_folder(tmp_path / "B", server, "b")  # its points join A's in 'chunks'
    assert server.count("chunks").count == 4
    with pytest.raises(ForeignCollectionError, match="'chunks'.*4 point"):
        HybridIndex.from_documents(documents("new"), tmp_path / "B", embed_model=MODEL, qdrant_url=URL, overwrite=True)
    assert server.count("chunks").count == 4


# ------------------------------------------------------------------------------------ push_to
def test_push_shows_a_progress_bar_when_asked(tmp_path: Path, server: QdrantClient, capsys: pytest.CaptureFixture) -> None:
    with HybridIndex.from_documents(documents("p", 3), tmp_path / "P", embed_model=MODEL) as index:
        capsys.readouterr()
        assert index.push_to(URL, collection="progress", show_progress=True) == 3
        assert "Pushing" in capsys.readouterr().err
        with pytest.raises(TypeError, match="show_progress must be True or False"):
            index.push_to(URL, collection="progress", show_progress="yes")


def test_push_replaces_its_own_copy_and_refuses_anything_else(tmp_path: Path, server: QdrantClient) -> None:
    foreign_collection(server)
    with HybridIndex.from_documents(documents("e"), tmp_path / "E", embed_model=MODEL) as index:
        with pytest.raises(ForeignCollectionError, match=r"'chunks'.*overwrite=True.*--push-overwrite"):
            index.push_to(URL)
        assert foreign_points(server) == 5
        assert index.push_to(URL, collection="mine") == 2
        first = aliases(server)["mine"]
        assert server.get_collection(first).config.metadata["llama_index_retrieval_kit"]["index_id"] == index.manifest.index_id
        index.upsert(documents("f", 1))
        assert index.push_to(URL, collection="mine") == 3  # its own copy: replaced, no overwrite needed
        second = aliases(server)["mine"]
        assert second != first and collections(server) == sorted(["chunks", second])
        assert server.count("mine").count == 3
        assert index.push_to(URL, overwrite=True) == 3  # the explicit way: another application's plain collection goes
    assert aliases(server)["chunks"] != "chunks" and server.count("chunks").count == 3
    with HybridIndex.load(tmp_path / "E", embed_model=MODEL, qdrant_url=URL) as served:
        assert engine_doc_ids(served)["qdrant_hybrid"] == ["e0.txt", "e1.txt", "f0.txt"]


def test_push_overwrite_moves_only_the_alias_off_another_index(tmp_path: Path, server: QdrantClient) -> None:
    with HybridIndex.from_documents(documents("a"), tmp_path / "A", embed_model=MODEL, qdrant_url=URL) as a:
        a_collection = a.manifest.collection
    with HybridIndex.from_documents(documents("e"), tmp_path / "E", embed_model=MODEL) as embedded:
        with pytest.raises(ForeignCollectionError, match="index with id"):
            embedded.push_to(URL)
        embedded.push_to(URL, overwrite=True)
    assert aliases(server)["chunks"] != a_collection and a_collection in collections(server)
    with HybridIndex.load(tmp_path / "A", embed_model=MODEL) as a:  # A reads its own collection, untouched
        assert engine_doc_ids(a)["qdrant_hybrid"] == ["a0.txt", "a1.txt"]


def test_a_folder_refuses_to_serve_another_index_s_collection(tmp_path: Path, server: QdrantClient) -> None:
    with HybridIndex.from_documents(documents("e"), tmp_path / "E", embed_model=MODEL) as e:
        e.push_to(URL)
    with HybridIndex.from_documents(documents("f"), tmp_path / "F", embed_model=MODEL) as f:
        f.push_to(URL, overwrite=True)  # 'chunks' is F's now
    with pytest.raises(ForeignCollectionError, match="does not serve another index's points"):
        HybridIndex.load(tmp_path / "E", embed_model=MODEL, qdrant_url=URL)
    with HybridIndex.load(tmp_path / "F", embed_model=MODEL, qdrant_url=URL) as served:
        assert engine_doc_ids(served)["dense"] == ["f0.txt", "f1.txt"]


def test_push_switch_moves_the_folder_to_its_new_collection(tmp_path: Path, server: QdrantClient) -> None:
    with HybridIndex.from_documents(documents("e"), tmp_path / "E", embed_model=MODEL) as index:
        index.push_to(URL, switch=True)
        assert index.manifest.qdrant_url == URL and aliases(server) == {"chunks": index.manifest.collection}
        index.upsert(documents("g", 1))
        assert server.count("chunks").count == 3
    with HybridIndex.load(tmp_path / "E", embed_model=MODEL) as index:
        assert engine_doc_ids(index)["qdrant_hybrid"] == ["e0.txt", "e1.txt", "g0.txt"]


# ------------------------------------------------------------------------------------ rkit, pipeline
def test_rkit_push_refuses_a_foreign_collection_unless_push_overwrite(tmp_path: Path, server: QdrantClient, capsys) -> None:
    from llama_index_retrieval_kit.cli import EXIT_OK, EXIT_USAGE, main

    src = tmp_path / "src"
    src.mkdir()
    (src / "fees.md").write_text("# Fees\n\nThe annual fee is 95 dollars.\n", encoding="utf-8")
    foreign_collection(server)
    argv = ["-q", "index", str(src), "--storage", str(tmp_path / "idx"), "--push", URL]
    assert main(argv) == EXIT_USAGE
    assert "'chunks'" in capsys.readouterr().err and foreign_points(server) == 5
    assert main(argv + ["--push-overwrite"]) == EXIT_OK
    assert main(argv) == EXIT_OK  # its own copy now: replaced without the flag
    assert collections(server) == [aliases(server)["chunks"]] and server.count("chunks").count == 1
    assert main(["-q", "index", str(src), "--storage", str(tmp_path / "idx"), "--push-overwrite"]) == EXIT_USAGE


def test_the_pipeline_config_names_the_collection(tmp_path: Path, server: QdrantClient) -> None:
    from llama_index_retrieval_kit.pipeline import PipelineConfig, index_build_kwargs, index_mismatches

    with pytest.raises(Exception, match="collection"):
        PipelineConfig.model_validate({"index": {"storage_dir": "x", "collection": "a/b"}})
    config = PipelineConfig.model_validate({"index": {"storage_dir": str(tmp_path / "idx"), "qdrant_url": URL, "collection": "kb"}})
    kwargs = index_build_kwargs(config, embed_model=MODEL)
    assert kwargs["collection"] == "kb"
    with HybridIndex.from_documents(documents("d"), config.storage_dir, **kwargs) as index:
        assert aliases(server) == {"kb": index.manifest.collection}
        other = PipelineConfig.model_validate({"index": {"storage_dir": str(tmp_path / "idx"), "qdrant_url": URL, "collection": "kb2"}})
        assert any("index.collection" in p for p in index_mismatches(other, index))
