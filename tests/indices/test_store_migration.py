"""Qdrant Edge as the embedded store: no pickle anywhere ``load`` reads, format-1 folders (Qdrant
local mode) migrated without reading ``qdrant/``, one open shard per folder, and ``push_to`` a
server (qdrant-client's local mode stands in for it)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from qdrant_client import QdrantClient

from llama_index_retrieval_kit.indices import HybridIndex, IndexBusyError
from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module
from llama_index_retrieval_kit.indices.storage import FileLock, IndexReadOnlyError

from . import _support


class _RunsCode:
    """Unpickling this runs ``touch <marker>`` (what a crafted local-mode folder does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_local_mode_store(folder: Path, marker: Path) -> Path:
    """A Qdrant local-mode ``qdrant/`` whose stored point runs code when unpickled."""
    db = folder / "qdrant" / "collection" / "chunks" / "storage.sqlite"
    db.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE IF NOT EXISTS points (id TEXT PRIMARY KEY, point BLOB)")
    con.execute("INSERT INTO points VALUES (?, ?)", ("p1", pickle.dumps(_RunsCode(marker))))
    con.commit()
    con.close()
    (folder / "qdrant" / "meta.json").write_text(json.dumps({"collections": {"chunks": {}}, "aliases": {}}))
    assert pickle.loads  # the planted bytes really are a pickle that runs code:
    assert b"system" in db.read_bytes()
    return db


def as_format_1(folder: Path, marker: Path) -> None:
    """Rewrite a built folder into the first format: format_version 1, points in ``qdrant/``."""
    config = json.loads((folder / "index.json").read_text())
    config["format_version"] = 1
    (folder / "index.json").write_text(json.dumps(config))
    shutil.rmtree(folder / "edge")
    plant_local_mode_store(folder, marker)


def test_load_never_unpickles_a_crafted_qdrant_folder(index_dir: Path, embed_model, bundles, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    plant_local_mode_store(index_dir, marker)  # beside a current (format 2) index
    with HybridIndex.load(index_dir, embed_model=embed_model) as index:
        assert index.as_retriever("qdrant_hybrid").retrieve(bundles[0])
        assert index.as_retriever("hybrid").retrieve(bundles[0])
    assert not marker.exists()


def test_a_format_1_folder_migrates_on_open_without_reading_qdrant(
    template: _support.Template, tmp_path: Path, embed_model, bundles, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _support.copy_index(template, tmp_path / "old")
    marker = tmp_path / "code-ran"
    as_format_1(folder, marker)
    cached = HybridIndex.load  # the cache holds every vector: nothing is embedded again
    with caplog.at_level("WARNING", logger=hybrid_index_module.__name__):
        with cached(folder, embed_model=embed_model) as index:
            assert any("migrated to Qdrant Edge" in r.getMessage() and "0 embedded again" in r.getMessage() for r in caplog.records)
            _support.assert_consistent(index)
            got = _support.run_modes(index, bundles[: _support.ROUND_TRIP_QUERIES])
    _support.assert_same_results(got, template.built_results)
    assert not marker.exists()
    assert not (folder / "qdrant").exists() and (folder / "edge" / "store.json").is_file()
    assert json.loads((folder / "index.json").read_text())["format_version"] == 2
    with HybridIndex.load(folder, embed_model=embed_model) as again:  # opens as a current folder
        _support.assert_same_results(_support.run_modes(again, bundles[: _support.ROUND_TRIP_QUERIES]), template.built_results)


def test_migration_embeds_what_the_cache_lacks_and_survives_an_interrupted_try(
    template: _support.Template, tmp_path: Path, embed_model, bundles
) -> None:
    folder = _support.copy_index(template, tmp_path / "old")
    as_format_1(folder, tmp_path / "marker")
    con = sqlite3.connect(folder / "embeddings.sqlite")
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    for table in tables:
        con.execute(f"DELETE FROM {table}")  # a lost cache: the chunks are embedded again
    con.commit()
    con.close()
    (folder / "edge" / "shard").mkdir(parents=True)  # what an interrupted migration might leave
    (folder / "edge" / "shard" / "junk").write_text("half a shard")
    with HybridIndex.load(folder, embed_model=embed_model) as index:
        _support.assert_consistent(index)
        got = _support.run_modes(index, bundles[:2], modes=("hybrid", "dense", "qdrant_hybrid"))
    want = {k: v for k, v in template.built_results.items() if k[0] in ("hybrid", "dense", "qdrant_hybrid") and k[1] in {b.query_str for b in bundles[:2]}}
    _support.assert_same_results(got, want, tol=1e-5)


def test_an_unwritable_format_1_folder_names_the_migrate_command(template: _support.Template, tmp_path: Path, embed_model) -> None:
    folder = _support.copy_index(template, tmp_path / "old")
    as_format_1(folder, tmp_path / "marker")
    holder = FileLock(folder / ".write.lock")
    holder.acquire(timeout=0)  # another writer holds the folder
    try:
        with pytest.raises(ValueError, match=r"rkit migrate"):
            HybridIndex.load(folder, embed_model=embed_model)
    finally:
        holder.release()
    assert (folder / "qdrant").is_dir()  # untouched until a migration can run


def test_cli_migrate(template: _support.Template, tmp_path: Path) -> None:
    folder = _support.copy_index(template, tmp_path / "old")
    as_format_1(folder, tmp_path / "marker")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = lambda: subprocess.run([sys.executable, "-m", "llama_index_retrieval_kit.cli", "migrate", str(folder)], capture_output=True, text=True, env=env, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr
    assert "migrated to Qdrant Edge" in first.stdout and not (folder / "qdrant").exists()
    second = run()
    assert second.returncode == 0 and "already current" in second.stdout


def test_a_second_open_is_busy_and_leaves_the_open_shard_intact(index: HybridIndex, index_dir: Path, embed_model, bundles) -> None:
    for _ in range(3):  # an engine open of a shard open elsewhere damaged it (qdrant-edge-py 0.9.0): never attempted
        with pytest.raises(IndexBusyError):
            HybridIndex.load(index_dir, embed_model=embed_model)
    index.upsert([_support.changed_document()])  # the open index still writes...
    _support.assert_consistent(index)  # ...its shard is whole...
    native = _support.run_modes(index, bundles[:2], modes=("qdrant_hybrid",))
    ours = _support.run_modes(index, bundles[:2], modes=("hybrid_rrf",))
    assert [[i for i, _ in r] for r in native.values()][0][:3] == [[i for i, _ in r] for r in ours.values()][0][:3]  # ...and answers


@pytest.fixture()
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """qdrant-client's local mode standing in for a Qdrant server at any URL."""
    client = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    yield client
    client.close()


def test_push_to_a_server_serves_the_same_results(index: HybridIndex, index_dir: Path, embed_model, bundles, server) -> None:
    want = _support.run_modes(index, bundles[:3])
    # a server's "hybrid" runs its dense leg in Qdrant, where it is min-max score fusion (the feedback fusion needs the vectors in memory)
    want.update({("hybrid", qb.query_str): _support.ranking(index.as_retriever("hybrid", dense_search="qdrant").retrieve(qb)) for qb in bundles[:3]})
    assert index.push_to("http://qdrant.example:6333") == len(index)
    assert index.push_to("http://qdrant.example:6333") == len(index)  # its own copy is replaced (others' are refused: test_server_collections.py)
    index.close()
    with HybridIndex.load(index_dir, embed_model=embed_model, qdrant_url="http://qdrant.example:6333") as served:
        assert served.store.kind == "server"
        _support.assert_same_results(_support.run_modes(served, bundles[:3]), want, tol=1e-5)
        with pytest.raises(IndexReadOnlyError, match="push_to"):
            served.upsert([_support.changed_document()])
    with HybridIndex.load(index_dir, embed_model=embed_model) as embedded:  # the folder itself is unchanged
        assert embedded.store.kind == "edge"
        moved = embedded.push_to("http://qdrant.example:6333", overwrite=True, switch=True)
        assert moved == len(embedded) and not (index_dir / "edge").exists()
        embedded.upsert([_support.changed_document()])  # writes go to the server now
        _support.assert_consistent(embedded)
    assert json.loads((index_dir / "index.json").read_text())["qdrant_url"] == "http://qdrant.example:6333"


@pytest.mark.parametrize(
    "pattern",
    [
        "vector_storage-text-sparse-new/store/tracker.dat",  # the engine panicked on it (a BaseException)
        "vector_storage-text-dense/vectors/chunk_0.mmap",  # NaN vectors: opened fine, caught by the vector check
        "wal/open-1",
        "version.info",
    ],
)
def test_damaged_shard_files_are_damaged_index_errors(index_dir: Path, embed_model, bundles, pattern: str) -> None:
    from llama_index_retrieval_kit.indices import DamagedIndexError

    matches = [p for p in (index_dir / "edge" / "shard").rglob("*") if p.is_file() and str(p).endswith(pattern)]
    assert matches, pattern
    for path in matches:
        path.write_bytes(b"\xff" * max(1, path.stat().st_size))
    with pytest.raises(DamagedIndexError) as err:
        with HybridIndex.load(index_dir, embed_model=embed_model) as index:
            for mode in ("hybrid", "qdrant_hybrid"):
                index.as_retriever(mode).retrieve(bundles[0])
    assert str(index_dir / "edge") in str(err.value) and "rkit index" in str(err.value)
