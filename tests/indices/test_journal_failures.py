"""Failed writes of ``index.json`` and interrupted writes of the embedding cache never leave an
index that serves or commits a state the folder does not record, nor advise deleting data.

A write of ``index.json`` that fails (disk full) leaves memory and disk on the previous manifest
(``WriteJournal.save`` adopts only what it wrote); one that reached the disk unconfirmed makes the
next write refuse instead of committing over it. A writer killed inside an embedding-cache
transaction leaves a hot journal: read-only opens say to open the folder once writable (which
rolls it back), never to delete the cache. qdrant-client's local mode stands in for a server.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List

import pytest
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from qdrant_client import QdrantClient

from llama_index_retrieval_kit.indices import HybridIndex, IndexReadOnlyError
from llama_index_retrieval_kit.indices.hybrid_index import IndexBeingPublishedError
from llama_index_retrieval_kit.indices import storage as storage_module
from llama_index_retrieval_kit.indices.embedding_cache import InterruptedCacheWriteError

from . import _support

URL = "http://qdrant.example:6333"
MODEL = MockEmbedding(embed_dim=8)


@pytest.fixture()
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[QdrantClient]:
    client = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    yield client
    client.close()


def clause(i: int, fee: int) -> Document:
    return Document(text=f"Clause {i}: the fee is {fee} dollars.", id_=f"d{i}")


def texts_of(index: HybridIndex, mode: str, doc_id: str) -> List[str]:
    return [r.node.text for r in index.as_retriever(mode, similarity_top_k=10).retrieve("fee of clause") if r.node.ref_doc_id == doc_id]


def fail_server_switch(monkeypatch: pytest.MonkeyPatch, written: bool) -> None:
    """The ``index.json`` write that records a server fails (ENOSPC); ``written``: after its rename
    (the directory's fsync failed), else before anything reached the disk."""
    real = storage_module.write_json_atomic

    def write(path, data):
        if isinstance(data, dict) and data.get("qdrant_url"):
            if written:
                real(path, data)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(storage_module, "write_json_atomic", write)


def on_disk(folder: Path) -> dict:
    return json.loads((folder / "index.json").read_text(encoding="utf-8"))


def test_a_failed_server_switch_keeps_the_folder_on_its_shard_and_later_writes_commit_there(
    tmp_path: Path, server: QdrantClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "idx"
    with HybridIndex.from_documents([clause(i, 10) for i in range(3)], folder, embed_model=MODEL) as index:
        with monkeypatch.context() as m:
            fail_server_switch(m, written=False)
            with pytest.raises(OSError, match="No space left"):
                index.push_to(URL, switch=True)
        assert (index.manifest.qdrant_url, index.manifest.collection, index.store.kind) == (None, "chunks", "edge")
        index.upsert([clause(1, 99)])
        assert (on_disk(folder)["qdrant_url"], on_disk(folder)["collection"]) == (None, "chunks")
    with HybridIndex.load(folder, embed_model=MODEL) as again:
        assert again.store.kind == "edge"
        for mode in ("qdrant_hybrid", "hybrid", "sparse"):
            assert texts_of(again, mode, "d1") == ["Clause 1: the fee is 99 dollars."], mode


def test_a_switch_written_but_not_confirmed_makes_the_next_write_refuse_and_a_reopen_serves_the_server(
    tmp_path: Path, server: QdrantClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "idx"
    with HybridIndex.from_documents([clause(i, 10) for i in range(3)], folder, embed_model=MODEL) as index:
        with monkeypatch.context() as m:
            fail_server_switch(m, written=True)
            with pytest.raises(OSError, match="No space left"):
                index.push_to(URL, switch=True)
        assert on_disk(folder)["qdrant_url"] == URL and index.store.kind == "edge"
        with pytest.raises(IndexReadOnlyError, match="index.json names Qdrant collection"):
            index.upsert([clause(1, 99)])  # would write the shard while index.json names the server
        assert on_disk(folder)["qdrant_url"] == URL
    with HybridIndex.load(folder, embed_model=MODEL) as again:  # the pushed copy: the committed state
        assert again.store.kind == "server"
        assert texts_of(again, "qdrant_hybrid", "d1") == texts_of(again, "sparse", "d1") == ["Clause 1: the fee is 10 dollars."]
        again.upsert([clause(1, 99)])
        assert texts_of(again, "qdrant_hybrid", "d1") == ["Clause 1: the fee is 99 dollars."]


def test_a_failed_index_id_write_is_not_adopted(tmp_path: Path, server: QdrantClient, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents([clause(i, 10) for i in range(2)], folder, embed_model=MODEL).close()
    before_ids = on_disk(folder)
    del before_ids["index_id"]  # a folder written before index ids
    (folder / "index.json").write_text(json.dumps(before_ids), encoding="utf-8")
    real = storage_module.write_json_atomic

    def disk_full(path, data):
        if isinstance(data, dict) and data.get("index_id"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    with HybridIndex.load(folder, embed_model=MODEL) as index:
        with monkeypatch.context() as m:
            m.setattr(storage_module, "write_json_atomic", disk_full)
            with pytest.raises(OSError, match="No space left"):
                index.push_to(URL)
        assert index.manifest.index_id is None and "index_id" not in on_disk(folder)
        assert index.push_to(URL) == 2  # the fault gone, the id is saved and the push goes through
        assert on_disk(folder)["index_id"] == index.manifest.index_id is not None


KILLED_CACHE_WRITER = r"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA cache_size=1")  # pages spill to the file before the commit: a hot journal
conn.execute("BEGIN IMMEDIATE")
conn.executemany("INSERT INTO vectors VALUES ('junk', ?, 1, ?)", [(f"k{i}", b"0" * 4000) for i in range(200)])
print("in transaction", flush=True)
time.sleep(120)
"""


def kill_a_cache_writer_mid_transaction(cache: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", KILLED_CACHE_WRITER, str(cache)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "in transaction"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()


def test_a_writer_killed_inside_a_cache_transaction_gets_a_roll_back_advice_not_a_delete_one(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    with HybridIndex.from_documents([clause(i, 10) for i in range(3)], folder, embed_model=MODEL) as index:
        cached = len(index.cache)
        want = texts_of(index, "dense", "d1")
    cache = folder / "embeddings.sqlite"
    kill_a_cache_writer_mid_transaction(cache)
    assert (folder / "embeddings.sqlite-journal").stat().st_size > 0

    with pytest.raises(InterruptedCacheWriteError) as caught:
        HybridIndex.load(folder, embed_model=MODEL, read_only=True)
    message = str(caught.value)
    assert "open the folder once without read_only=True" in message and "delete" not in message and "\n" not in message
    assert cache.exists() and (folder / "embeddings.sqlite-journal").exists()  # the reader touched nothing

    HybridIndex.load(folder, embed_model=MODEL).close()  # a writable open rolls the journal back
    assert not (folder / "embeddings.sqlite-journal").exists()
    with HybridIndex.load(folder, embed_model=MODEL, read_only=True) as reader:
        assert len(reader.cache) == cached  # the killed transaction's rows are gone, the vectors kept
        assert texts_of(reader, "dense", "d1") == want == ["Clause 1: the fee is 10 dollars."]


def test_a_reader_open_before_the_writer_was_killed_says_the_same_on_its_next_read(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents([clause(i, 10) for i in range(3)], folder, embed_model=MODEL).close()
    with HybridIndex.load(folder, embed_model=MODEL, read_only=True) as reader:
        kill_a_cache_writer_mid_transaction(folder / "embeddings.sqlite")
        with pytest.raises(InterruptedCacheWriteError, match="without read_only=True"):
            len(reader.cache)


def test_readers_meeting_a_rebuild_s_publish_are_told_to_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents([clause(i, 10) for i in range(3)], folder, embed_model=MODEL).close()
    reader = HybridIndex.load(folder, embed_model=MODEL, read_only=True)
    seen: List[str] = []
    real_rename = os.rename

    def rename(src, dst):  # the publish's last move: the new index.json into the folder
        if Path(dst) == folder / "index.json" and not seen:
            for attempt in (reader.refresh, lambda: HybridIndex.load(folder, embed_model=MODEL, read_only=True)):
                with pytest.raises(IndexBeingPublishedError, match="being published there .* retry shortly") as caught:
                    attempt()
                seen.append(str(caught.value))
        return real_rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", rename)
        HybridIndex.from_documents([clause(i, 20) for i in range(3)], folder, embed_model=MODEL, overwrite=True).close()
    assert len(seen) == 2 and all("\n" not in s for s in seen)
    reader.close()
    with HybridIndex.load(folder, embed_model=MODEL, read_only=True) as again:  # published: readers work again
        assert texts_of(again, "sparse", "d1") == ["Clause 1: the fee is 20 dollars."]
