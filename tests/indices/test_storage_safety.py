"""HybridIndex folder safety (issue "Data safety"): a crafted index.json cannot make ``load`` touch
anything outside the folder; concurrent writers are serialised; a damaged folder is an error that
names the file (instead of wrong answers); an interrupted build publishes nothing; generation
files are fsynced; and a roll-back that cannot be written leaves a read-only index on the
committed state instead of one that serves the failed write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.node_parser import get_leaf_nodes
from llama_index.core.storage.docstore import SimpleDocumentStore
import numpy as np
from qdrant_client import QdrantClient

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module
from llama_index_retrieval_kit.indices import storage as storage_module  # index.json writes: fault injection
from llama_index_retrieval_kit.indices.storage import (
    DamagedIndexError,
    FileLock,
    IndexReadOnlyError,
    IndexWriteLockedError,
)
from llama_index_retrieval_kit.retrievers import BM25Retriever
from llama_index_retrieval_kit.indices.store import EdgePoints, point_id

from . import _support
from ._support import CHANGED_DOC

REPAIR = ("rkit index", "--rebuild", "overwrite=True")


def manifest(folder: Path) -> dict:
    return json.loads((folder / "index.json").read_text())


def write_manifest(folder: Path, config: dict) -> None:
    (folder / "index.json").write_text(json.dumps(config, indent=2))


def tiny_documents(prefix: str = "", n: int = 2) -> list[Document]:
    texts = [
        "Annual fee\n\nThe annual fee is 95 dollars, waived in the first year.",
        "Water filter\n\nReplace the cartridge every six months or 400 litres.",
        "Warranty\n\nThe warranty covers parts and labour for two years.",
        "Returns\n\nUnused items can be returned within thirty days.",
    ]
    return [Document(text=f"{prefix}{texts[i % len(texts)]} ({i})", id_=f"{prefix}doc-{i}.txt") for i in range(n)]


class CountingEmbedding(MockEmbedding):
    """MockEmbedding that counts the texts it embeds and can fail after ``fail_after`` of them."""

    calls: int = 0
    fail_after: int = -1

    def _get_text_embeddings(self, texts):
        if 0 <= self.fail_after < self.calls + len(texts):
            raise OSError("embedding service gone")
        self.calls += len(texts)
        return super()._get_text_embeddings(texts)


# ---------------------------------------------------------------------------------- 1. path escape


def test_crafted_pending_generation_cannot_delete_outside_the_folder(index_dir: Path, embed_model, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("do not delete")
    (tmp_path / "victim.json").write_text("{}")
    config = manifest(index_dir)
    gen = config["generation"]
    # bm25/gen-<gen>/../../../victim is tmp_path/victim (bm25/gen-<gen> exists, so the path resolves).
    crafted = f"{gen}/../../../victim"
    assert (index_dir / "bm25" / f"gen-{crafted}").resolve() == victim.resolve()
    config["pending"] = {"generation": crafted, "touched_ids": []}
    write_manifest(index_dir, config)

    with pytest.raises(ValueError) as err:
        HybridIndex.load(index_dir, embed_model=embed_model)
    message = str(err.value)
    assert str(index_dir / "index.json") in message and "pending.generation" in message and crafted in message
    assert all(hint in message for hint in REPAIR)
    assert (victim / "precious.txt").read_text() == "do not delete"
    assert (tmp_path / "victim.json").exists()
    assert (index_dir / "bm25" / f"gen-{gen}").is_dir()


@pytest.mark.parametrize(
    "key, value",
    [("generation", True), ("generation", "1"), ("collection", "../../victim"), ("embed_batch_size", 0), ("bm25", {"k1": "x"})],
)
def test_load_validates_every_manifest_value(index_dir: Path, embed_model, key: str, value) -> None:
    config = manifest(index_dir)
    config[key] = value
    write_manifest(index_dir, config)
    with pytest.raises(DamagedIndexError) as err:
        HybridIndex.load(index_dir, embed_model=embed_model)
    assert str(index_dir / "index.json") in str(err.value) and key in str(err.value)


# ---------------------------------------------------------------------------------- 2. concurrent writers


def slow(real, delay: float = 0.01):
    """``real`` after a short sleep: another thread runs in between (a busy disk)."""

    def wrapper(*args, **kwargs):
        time.sleep(delay)
        return real(*args, **kwargs)

    return wrapper


def test_concurrent_upserts_and_deletes_from_two_threads(
    index, index_dir: Path, embed_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads write different documents, 12 upserts and 6 deletes each; some of thread a's
    writes fail (a transient I/O error when persisting) and are rolled back while thread b writes."""
    persist_docstore = SimpleDocumentStore.persist
    calls = {"a": 0}

    def flaky_persist(self, *args, **kwargs):
        if threading.current_thread().name == "a":
            calls["a"] += 1
            if calls["a"] % 4 == 3:
                time.sleep(0.02)
                raise OSError(5, "transient I/O error")
        return persist_docstore(self, *args, **kwargs)

    monkeypatch.setattr(SimpleDocumentStore, "persist", flaky_persist)
    monkeypatch.setattr(BM25Retriever, "persist", slow(BM25Retriever.persist, 0.05))
    monkeypatch.setattr(index.store, "upsert_points", slow(index.store.upsert_points))
    monkeypatch.setattr(index.store, "delete_points", slow(index.store.delete_points))
    base_docs = set(index.doc_ids())
    deleted: dict[str, set] = {"a": set(), "b": set()}
    kept: dict[str, set] = {"a": set(), "b": set()}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer() -> None:
        name = threading.current_thread().name
        try:
            start.wait()
            docs = tiny_documents(prefix=f"{name}-", n=12)
            for i, doc in enumerate(docs):
                try:
                    index.upsert([doc])
                    kept[name].add(doc.id_)
                except OSError as exc:  # the injected failure: this upsert did not happen
                    assert name == "a" and "transient" in str(exc), exc
                if i % 2 and docs[i - 1].id_ in kept[name]:
                    victim = docs[i - 1].id_
                    try:
                        assert index.delete(victim) >= 1
                        deleted[name].add(victim)
                        kept[name].discard(victim)
                    except OSError as exc:
                        assert name == "a" and "transient" in str(exc), exc
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, name=name) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert calls["a"] >= 3  # some writes of thread a failed
    expected = base_docs | kept["a"] | kept["b"]
    assert set(index.doc_ids()) == expected
    _support.assert_consistent(index)
    index.close()

    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:
        legs = _support.assert_consistent(reopened)  # Qdrant ids == BM25 ids == docstore leaves
        assert set(legs.qdrant) == set(legs.bm25) == legs.leaf_ids()
        assert set(reopened.doc_ids()) == expected
        assert not (deleted["a"] | deleted["b"]) & set(reopened.doc_ids())  # every delete stayed deleted
        assert reopened.config["pending"] is None


def test_two_writers_on_one_folder_sharing_a_qdrant_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two HybridIndex objects (two processes, in production) on one folder with a Qdrant server:
    each write waits for the other's (``.write.lock``) and starts from the other's commit."""
    server = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    model = MockEmbedding(embed_dim=8)
    path = tmp_path / "idx"
    HybridIndex.from_documents(tiny_documents(n=2), path, embed_model=model, qdrant_url="http://qdrant.invalid:6333").close()
    writers = {"a": HybridIndex.load(path, embed_model=model), "b": HybridIndex.load(path, embed_model=model)}
    deleted: dict[str, set] = {"a": set(), "b": set()}
    kept: dict[str, set] = {"a": set(), "b": set()}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer() -> None:
        name = threading.current_thread().name
        index = writers[name]
        try:
            start.wait()
            docs = tiny_documents(prefix=f"{name}-", n=12)
            for i, doc in enumerate(docs):
                index.upsert([doc])
                kept[name].add(doc.id_)
                if i % 2:
                    assert index.delete(docs[i - 1].id_) >= 1
                    deleted[name].add(docs[i - 1].id_)
                    kept[name].discard(docs[i - 1].id_)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, name=name) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    expected = {"doc-0.txt", "doc-1.txt"} | kept["a"] | kept["b"]
    with HybridIndex.load(path, embed_model=model) as reopened:
        legs = _support.assert_consistent(reopened)  # Qdrant ids == BM25 ids == docstore leaves
        assert set(legs.qdrant) == set(legs.bm25) == legs.leaf_ids()
        assert set(reopened.doc_ids()) == expected
        assert not (deleted["a"] | deleted["b"]) & set(reopened.doc_ids())
    server.close()


def test_a_write_waits_for_another_processes_lock_then_fails_clearly(index, index_dir: Path) -> None:
    before = index.doc_ids()
    other = FileLock(index_dir / ".write.lock")  # another open handle: what another process would hold
    other.acquire(0)
    try:
        assert index.write_lock_timeout is None  # the default wait (60 s), also after from_documents
        index.write_lock_timeout = 0.3
        with pytest.raises(IndexWriteLockedError, match="another process .* is writing to"):
            index.upsert(tiny_documents(n=1))
        with pytest.raises(IndexWriteLockedError):
            index.delete(CHANGED_DOC)
    finally:
        other.release()
    assert index.doc_ids() == before and manifest(index_dir)["pending"] is None
    index.delete(CHANGED_DOC)  # the lock is free again
    assert CHANGED_DOC not in index.doc_ids()


def test_an_index_built_by_from_documents_waits_for_other_writers_like_a_loaded_one(tmp_path: Path, embed_model) -> None:
    """The build takes the folder's lock without waiting; that rule ends with the build, so the
    returned index's later writes wait for another process's write (regression: they failed at once)."""
    built = HybridIndex.from_documents(tiny_documents(n=2), tmp_path / "built", embed_model=embed_model)
    try:
        assert built.write_lock_timeout is None
        other = FileLock(tmp_path / "built" / ".write.lock")
        other.acquire(0)
        releaser = threading.Timer(0.5, other.release)
        releaser.start()
        started = time.perf_counter()
        built.upsert(tiny_documents(prefix="later-", n=1))  # waits for the other writer, then writes
        assert time.perf_counter() - started >= 0.4
        releaser.join()
        assert any(doc_id.startswith("later-") for doc_id in built.doc_ids())
        for bad in (-1, float("nan"), "5", True):
            with pytest.raises(ValueError, match="write_lock_timeout must be None, a number of seconds >= 0"):
                built.write_lock_timeout = bad
        built.write_lock_timeout = 0
        assert built.write_lock_timeout == 0.0
    finally:
        built.close()


def test_load_leaves_the_journal_of_a_write_running_elsewhere_alone(index_dir: Path, embed_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal in index.json while another process holds the write lock is that process's
    running write (a Qdrant server shared by both), not a crash: load must not roll it back."""
    crashed = HybridIndex.load(index_dir, embed_model=embed_model)
    with monkeypatch.context() as m:
        m.setattr(HybridIndex, "_recover", lambda self: None)
        m.setattr(BM25Retriever, "persist", lambda self, folder: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            crashed.upsert([_support.changed_document()])
    crashed.close()
    journal = manifest(index_dir)["pending"]
    writer = FileLock(index_dir / ".write.lock")
    writer.acquire(0)
    try:
        with HybridIndex.load(index_dir, embed_model=embed_model) as reader:
            assert manifest(index_dir)["pending"] == journal  # not rolled back under the writer's feet
            assert reader.doc_ids()
    finally:
        writer.release()
    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:  # the writer is gone: a crash
        assert manifest(index_dir)["pending"] is None
        _support.assert_consistent(reopened)


# ---------------------------------------------------------------------------------- 3. damaged folders


def assert_damaged(err: pytest.ExceptionInfo, path: Path) -> None:
    message = str(err.value)
    assert str(path) in message, message
    assert all(hint in message for hint in REPAIR), message


def test_scrambled_bm25_score_array_is_detected(index_dir: Path, embed_model) -> None:
    gen = manifest(index_dir)["generation"]
    scores = index_dir / "bm25" / f"gen-{gen}" / "bm25s" / "data.csc.index.npy"
    data = bytearray(scores.read_bytes())
    tail = data[-64:]
    data[-64:] = tail[32:] + tail[:32]  # same size, same header, scores moved around
    scores.write_bytes(bytes(data))
    with pytest.raises(DamagedIndexError, match="sha256 differs") as err:
        HybridIndex.load(index_dir, embed_model=embed_model)
    assert_damaged(err, scores)


def test_edited_docstore_is_detected(index_dir: Path, embed_model) -> None:
    gen = manifest(index_dir)["generation"]
    path = index_dir / "docstore" / f"gen-{gen}.json"
    path.write_text(path.read_text().replace("GPS", "GPX"))
    with pytest.raises(DamagedIndexError) as err:
        HybridIndex.load(index_dir, embed_model=embed_model)
    assert_damaged(err, path)


def test_deleted_qdrant_rows_are_detected(index_dir: Path, embed_model) -> None:
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        victims = sorted(_support.qdrant_ids(index))[:3]
        index.store.delete_points([point_id(v) for v in victims])
    with pytest.raises(DamagedIndexError, match=r"holds \d+ point\(s\) but the BM25 index holds \d+ chunk") as err:
        HybridIndex.load(index_dir, embed_model=embed_model)
    assert_damaged(err, index_dir / "edge")


def test_swapped_vectors_are_detected_when_first_read(index_dir: Path, embed_model, bundles) -> None:
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        first, second = sorted(point_id(i) for i in _support.qdrant_ids(index))[:2]
        records = {p.point_id: p for p in index.store.iter_points() if p.point_id in (first, second)}
        index.store.upsert_points(  # the two points' dense vectors swapped, the rest as stored
            [first, second],
            np.array([records[second].dense, records[first].dense]),
            [records[first].sparse, records[second].sparse],
            [records[first].payload, records[second].payload],
        )
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:  # same point count: opens
        with pytest.raises(DamagedIndexError, match=r"2 point\(s\) hold a vector that is not their chunk's embedding") as err:
            index.as_retriever("hybrid").retrieve(bundles[0])
        assert_damaged(err, index_dir / "edge")
        with pytest.raises(DamagedIndexError):  # every later dense read too, not only the first
            index.as_retriever("dense").retrieve(bundles[1])


def test_a_folder_without_checksums_loads_unverified_until_its_next_write(
    index_dir: Path, embed_model, caplog: pytest.LogCaptureFixture
) -> None:
    config = manifest(index_dir)
    del config["integrity"]  # as written before checksums existed
    write_manifest(index_dir, config)
    with caplog.at_level("INFO", logger=hybrid_index_module.__name__):
        with HybridIndex.load(index_dir, embed_model=embed_model) as index:
            assert any("unverified until the next write" in r.getMessage() for r in caplog.records)
            _support.assert_consistent(index)
            index.delete(CHANGED_DOC)
    assert manifest(index_dir)["integrity"]["generation"] == manifest(index_dir)["generation"]


@pytest.mark.parametrize(
    "target",
    ["index.json", "docstore", "embeddings.sqlite", "edge_schema", "bm25_npy", "bm25_npz", "bm25_nodes"],
)
def test_corrupted_files_are_errors_naming_the_file(index_dir: Path, embed_model, target: str) -> None:
    config = manifest(index_dir)
    gen = config["generation"]
    config.pop("integrity")  # no checksums: exercise the readers' own errors
    write_manifest(index_dir, config)
    path = {
        "index.json": index_dir / "index.json",
        "docstore": index_dir / "docstore" / f"gen-{gen}.json",
        "embeddings.sqlite": index_dir / "embeddings.sqlite",
        "edge_schema": index_dir / "edge" / "store.json",
        "bm25_npy": index_dir / "bm25" / f"gen-{gen}" / "bm25s" / "data.csc.index.npy",
        "bm25_npz": index_dir / "bm25" / f"gen-{gen}" / "tokens.npz",
        "bm25_nodes": index_dir / "bm25" / f"gen-{gen}" / "nodes.json",
    }[target]
    path.write_bytes(b"\x00garbage, not what this file should hold\x00" * 100)
    with pytest.raises(DamagedIndexError) as err:
        HybridIndex.load(index_dir, embed_model=embed_model)
    named = path if not target.startswith("bm25") else path.parents[1 if target == "bm25_npy" else 0]
    assert str(named) in str(err.value), str(err.value)
    if target == "embeddings.sqlite":
        assert "delete it" in str(err.value)
    else:
        assert all(hint in str(err.value) for hint in REPAIR)
    # The folder's store lock was released on the way out.
    if target != "edge_schema":
        EdgePoints(index_dir / "edge").close()


# ---------------------------------------------------------------------------------- 4. interrupted build

KILLED_BUILD = r"""
import os, sys
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index_retrieval_kit.indices import HybridIndex

class DiesAfter(MockEmbedding):
    done: int = 0
    def _get_text_embeddings(self, texts):
        if self.done >= 4:
            os._exit(9)  # killed: no except handler, no finally
        self.done += len(texts)
        return super()._get_text_embeddings(texts)

docs = [Document(text=f"Section {i}\n\nText number {i} about topic {i}.", id_=f"d{i}.txt") for i in range(10)]
HybridIndex.from_documents(docs, sys.argv[1], embed_model=DiesAfter(embed_dim=8), embed_batch_size=2)
"""


def test_a_killed_first_build_publishes_nothing_and_the_next_build_reuses_its_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    proc = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr
    assert not (path / "index.json").exists()  # not a folder that loads and fails on queries
    with pytest.raises(ValueError, match="holds no index.json.*interrupted build"):
        HybridIndex.load(path, embed_model=MockEmbedding(embed_dim=8))

    model = CountingEmbedding(embed_dim=8)
    docs = [Document(text=f"Section {i}\n\nText number {i} about topic {i}.", id_=f"d{i}.txt") for i in range(10)]
    with HybridIndex.from_documents(docs, path, embed_model=model, embed_batch_size=2) as index:
        assert model.calls == 10 - 4  # the 4 texts embedded before the kill came from the cache
        assert index.as_retriever("qdrant_hybrid").retrieve("topic 3")
        _support.assert_consistent(index)
    assert not (tmp_path / ".idx.building").exists()
    with HybridIndex.load(path, embed_model=model) as index:
        assert len(index.doc_ids()) == 10


def test_a_failed_rebuild_keeps_the_old_index(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    HybridIndex.from_documents(tiny_documents(n=2), path, embed_model=MockEmbedding(embed_dim=8)).close()
    failing = CountingEmbedding(embed_dim=8, fail_after=1)
    with pytest.raises(OSError, match="embedding service gone"):
        HybridIndex.from_documents(tiny_documents("new-", n=4), path, embed_model=failing, embed_batch_size=1, overwrite=True)
    with HybridIndex.load(path, embed_model=MockEmbedding(embed_dim=8)) as index:
        assert index.doc_ids() == ["doc-0.txt", "doc-1.txt"]
        _support.assert_consistent(index)
        assert index.as_retriever("qdrant_hybrid").retrieve("annual fee")
    # The rebuild succeeds later and replaces the old index, reusing the cache of both.
    model = CountingEmbedding(embed_dim=8)
    with HybridIndex.from_documents(tiny_documents("new-", n=4), path, embed_model=model, overwrite=True) as index:
        assert index.doc_ids() == [f"new-doc-{i}.txt" for i in range(4)]
        assert model.calls == 4 - 1  # the text embedded before the failure is cached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no building/replaced folder left


# ---------------------------------------------------------------------------------- 5. durability


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to map fsynced descriptors to paths")
def test_a_commit_fsyncs_the_generation_files_and_the_directories(index, index_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    real = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    index.delete(CHANGED_DOC)
    monkeypatch.undo()
    root = index_dir.resolve()
    gen = manifest(index_dir)["generation"]
    gen_files = [p.resolve() for p in (root / "bm25" / f"gen-{gen}").rglob("*") if p.is_file()]
    gen_files.append((root / "docstore" / f"gen-{gen}.json").resolve())
    missing = [p for p in gen_files if p not in synced]
    assert not missing, f"not fsynced: {missing}"
    for folder in (root / "bm25" / f"gen-{gen}", root / "bm25", root / "docstore"):
        assert folder in synced, f"directory {folder} not fsynced"
    # index.json's directory entry after the rename: the folder is fsynced after the last commit file.
    last_index_json = max(i for i, p in enumerate(synced) if p.name.startswith("index.json"))
    assert root in synced[last_index_json:], "the folder was not fsynced after the index.json rename"


def crash_with_disk_full(index: HybridIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write fails while persisting (disk full), and so does every Qdrant write after it."""
    state = {"full": False}

    def persist_fails(self, folder):
        state["full"] = True
        raise OSError(28, "No space left on device")

    def qdrant_write(real):
        def write(*args, **kwargs):
            if state["full"]:
                raise OSError(28, "No space left on device")
            return real(*args, **kwargs)

        return write

    monkeypatch.setattr(BM25Retriever, "persist", persist_fails)
    monkeypatch.setattr(index.store, "upsert_points", qdrant_write(index.store.upsert_points))
    monkeypatch.setattr(index.store, "delete_points", qdrant_write(index.store.delete_points))


MEMORY_MODES = ("hybrid", "hybrid_rrf", "dense", "sparse")


def test_a_failed_roll_back_leaves_the_live_object_read_only_on_the_committed_state(
    index, index_dir: Path, embed_model, bundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    queries = bundles[:3]
    before_ids = set(_support.assert_consistent(index).docstore_leaves)
    before = _support.run_modes(index, queries, modes=MEMORY_MODES)
    new_ids = {n.node_id for n in get_leaf_nodes(index.node_parser.get_nodes_from_documents([_support.changed_document()]))}
    failed_ids = new_ids - before_ids
    qdrant_view = index.as_retriever("qdrant_hybrid", similarity_top_k=50)
    with monkeypatch.context() as m:
        crash_with_disk_full(index, m)
        with pytest.raises(OSError, match="No space left"):
            index.upsert([_support.changed_document()])

    # Memory modes answer from the committed state (BM25 restored, dense vectors from the cache)...
    _support.assert_same_results(_support.run_modes(index, queries, modes=MEMORY_MODES), before)
    assert not failed_ids & {n.node_id for n in index.bm25.nodes}
    # ...Qdrant, which still holds the failed write, is not read any more, and writes are refused.
    with pytest.raises(IndexReadOnlyError, match="read-only"):
        index.as_retriever("qdrant_hybrid").retrieve(queries[0])
    with pytest.raises(Exception):
        qdrant_view.retrieve(queries[0])  # a retriever made before the failure stops answering too
    with pytest.raises(IndexReadOnlyError, match="open it again with HybridIndex.load"):
        index.upsert([_support.changed_document()])
    with pytest.raises(IndexReadOnlyError):
        index.delete(CHANGED_DOC)
    assert manifest(index_dir)["pending"] is not None  # the journal is kept for the next open
    index.close()

    with HybridIndex.load(index_dir, embed_model=embed_model) as reopened:  # space is back: rolls back
        assert reopened.config["pending"] is None and manifest(index_dir)["pending"] is None
        legs = _support.assert_consistent(reopened)
        assert set(legs.docstore_leaves) == before_ids and not failed_ids & set(legs.qdrant)


def test_load_opens_read_only_when_the_roll_back_cannot_be_written(
    index_dir: Path, embed_model, bundles, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    queries = bundles[10:13]
    crashed = HybridIndex.load(index_dir, embed_model=embed_model)
    before_ids = set(_support.assert_consistent(crashed).docstore_leaves)
    before = _support.run_modes(crashed, queries, modes=MEMORY_MODES)
    with monkeypatch.context() as m:  # a killed write: Qdrant written, no roll-back in process
        m.setattr(HybridIndex, "_recover", lambda self: None)
        m.setattr(BM25Retriever, "persist", lambda self, folder: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            crashed.upsert([_support.changed_document()])
    crashed.close()
    journal = manifest(index_dir)["pending"]
    assert journal is not None

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(EdgePoints, "upsert_points", disk_full)
        m.setattr(EdgePoints, "delete_points", disk_full)
        m.setattr(storage_module, "write_json_atomic", disk_full)
        with caplog.at_level("WARNING"):
            reopened = HybridIndex.load(index_dir, embed_model=embed_model)
        try:
            assert any("read-only" in r.getMessage() for r in caplog.records)
            _support.assert_same_results(_support.run_modes(reopened, queries, modes=MEMORY_MODES), before)
            assert set(reopened.docstore.docs) >= before_ids
            with pytest.raises(IndexReadOnlyError):
                reopened.as_retriever("qdrant_hybrid").retrieve(queries[0])
            with pytest.raises(IndexReadOnlyError):
                reopened.upsert([_support.changed_document()])
        finally:
            reopened.close()
    assert manifest(index_dir)["pending"] == journal  # nothing written

    with HybridIndex.load(index_dir, embed_model=embed_model) as repaired:  # writable again: rolls back
        assert manifest(index_dir)["pending"] is None
        assert set(_support.assert_consistent(repaired).docstore_leaves) == before_ids
        _support.assert_same_results(_support.run_modes(repaired, queries, modes=MEMORY_MODES), before)


def test_roll_back_whose_journal_cannot_be_cleared_still_serves_and_writes(
    index, index_dir: Path, embed_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qdrant restored but index.json not writable for a moment: the object is consistent, keeps
    answering, and its next write clears the old journal."""
    before_ids = set(_support.assert_consistent(index).docstore_leaves)
    real = storage_module.write_json_atomic
    with monkeypatch.context() as m:
        m.setattr(BM25Retriever, "persist", lambda self, folder: (_ for _ in ()).throw(OSError(5, "I/O error")))

        def journal_write_fails(path, data):
            if data.get("pending") is None:
                raise OSError(28, "No space left on device")
            real(path, data)

        m.setattr(storage_module, "write_json_atomic", journal_write_fails)
        with pytest.raises(OSError, match="I/O error"):
            index.upsert([_support.changed_document()])
    assert set(_support.assert_consistent(index).docstore_leaves) == before_ids
    assert manifest(index_dir)["pending"] is not None
    index.upsert([_support.changed_document()])
    assert manifest(index_dir)["pending"] is None
    _support.assert_consistent(index)
