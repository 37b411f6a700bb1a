"""Concurrent writers of one folder, in threads and real processes.

``BM25Retriever.persist`` into one folder from two threads or processes at once runs one persist
at a time, and a ``load`` meanwhile reads one whole index (never fails, never a mix); the folder
holds only the payload (the lock is the folder itself). ``HybridIndex.load`` meeting a rebuild
that another process publishes into the folder opens the new index or says to retry
(``IndexBeingPublishedError``), never a raw FileNotFoundError, a false "damaged" or a mix of two
builds. A read-only reader of the embedding cache waits for another process's transaction. A
folder's lock held too long (its holder stopped: SIGSTOP, a debugger) is a ``FolderLockTimeout``
naming the folder, not a hang.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from llama_index.core import Document
from llama_index.core.schema import TextNode

from llama_index_retrieval_kit._files import folder_lock
from llama_index_retrieval_kit.indices import FolderLockTimeout
from llama_index_retrieval_kit.indices import HybridIndex, IndexBeingPublishedError, IndexWriteLockedError
from llama_index_retrieval_kit.indices import embedding_cache as embedding_cache_module
from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module
from llama_index_retrieval_kit.indices.embedding_cache import EmbeddingCache
from llama_index_retrieval_kit.retrievers import BM25Retriever

from .indices import _support

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = ["bm25s", "nodes.json", "retriever.json", "tokens.npz", "tokens_vocab.json"]
SIZES = {"a": 120, "b": 180}  # two indexes told apart by their node ids' prefix and their size

BM25_CHILD = r"""
import json, os, sys
sys.path.insert(0, {repo!r})
from llama_index.core.schema import TextNode
from llama_index_retrieval_kit.retrievers import BM25Retriever
folder, role = {folder!r}, {role!r}
def corpus(tag, n):
    return [TextNode(id_=f"{{tag}}-{{i}}", text=f"{{tag}} clause {{i}} annual fee card payment " * (5 + i % 7)) for i in range(n)]
retriever = BM25Retriever.from_nodes(corpus(role, {sizes!r}.get(role, 1)))
print("ready", flush=True)
sys.stdin.readline()
if role == "load":
    seen = []
    while True:
        last = os.path.exists(folder + ".stop")
        try:
            loaded = BM25Retriever.load(folder)
            seen.append(sorted({{n.node_id.split("-")[0] for n in loaded.nodes}}) + [len(loaded)])
        except Exception as exc:
            seen.append(f"{{type(exc).__name__}}: {{exc}}")
        if last:
            break
    print(json.dumps(seen), flush=True)
else:
    for _ in range({rounds}):
        retriever.persist(folder)
"""


def corpus(tag: str) -> List[TextNode]:
    return [TextNode(id_=f"{tag}-{i}", text=f"{tag} clause {i} annual fee card payment " * (5 + i % 7)) for i in range(SIZES[tag])]


def whole_index(outcome: object) -> bool:
    """A load's outcome is one of the two persisted indexes, whole."""
    return outcome in (["a", SIZES["a"]], ["b", SIZES["b"]])


def test_persists_from_two_processes_run_one_at_a_time_and_loads_meanwhile_read_one_index(tmp_path: Path) -> None:
    folder = tmp_path / "bm25"
    BM25Retriever.from_nodes(corpus("a")).persist(folder)
    children = {
        role: subprocess.Popen(
            [sys.executable, "-c", BM25_CHILD.format(repo=str(REPO), folder=str(folder), role=role, sizes=SIZES, rounds=12)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for role in ("a", "b", "load")
    }
    try:
        for child in children.values():
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
        for child in children.values():  # all start together
            child.stdin.write("go\n")
            child.stdin.flush()
        for role in ("a", "b"):
            assert children[role].wait(120) == 0, children[role].stderr.read()
        (tmp_path / "bm25.stop").touch()
        out, err = children["load"].communicate(timeout=120)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
    loads = json.loads(out.strip().splitlines()[-1])
    assert loads and all(whole_index(outcome) for outcome in loads), [o for o in loads if not whole_index(o)][:3]
    assert sorted(p.name for p in folder.iterdir()) == PAYLOAD  # no lock file, nothing left aside
    final = BM25Retriever.load(folder)
    assert whole_index(sorted({n.node_id.split("-")[0] for n in final.nodes}) + [len(final)])


def test_persists_from_two_threads_run_one_at_a_time_and_loads_meanwhile_read_one_index(tmp_path: Path) -> None:
    folder = tmp_path / "bm25"
    retrievers = {tag: BM25Retriever.from_nodes(corpus(tag)) for tag in SIZES}
    retrievers["a"].persist(folder)
    errors: List[str] = []
    loads: List[object] = []
    writing = threading.Event()
    writing.set()

    def persist(tag: str) -> None:
        for _ in range(10):
            try:
                retrievers[tag].persist(folder)
            except Exception as exc:  # the failure under test: reported, not raised in the thread
                errors.append(f"{tag}: {type(exc).__name__}: {exc}")

    def load() -> None:
        while writing.is_set():
            try:
                loaded = BM25Retriever.load(folder)
                loads.append(sorted({n.node_id.split("-")[0] for n in loaded.nodes}) + [len(loaded)])
            except Exception as exc:
                loads.append(f"{type(exc).__name__}: {exc}")

    writers = [threading.Thread(target=persist, args=(tag,)) for tag in SIZES]
    loader = threading.Thread(target=load)
    for thread in (*writers, loader):
        thread.start()
    for thread in writers:
        thread.join()
    writing.clear()
    loader.join()
    assert errors == []
    assert loads and all(whole_index(outcome) for outcome in loads), [o for o in loads if not whole_index(o)][:3]
    assert sorted(p.name for p in folder.iterdir()) == PAYLOAD


# ----- HybridIndex: a rebuild published by another process while a reader opens the folder ---------

def small_documents(tag: str, count: int) -> List[Document]:
    return [Document(id_=f"{tag}{i}.md", text=f"Clause {i} of the {tag} agreement: the annual fee is {i} dollars.") for i in range(count)]


def test_a_rebuild_published_while_an_open_reads_the_folder_is_opened_whole(tmp_path: Path) -> None:
    """The rebuild ends between the reader's check of the files and its read of them (both
    builds are generation 0: the paths stay, the bytes change): the reader opens the new build,
    not the old index.json over the new build's files."""
    model = _support.embed_model()
    folder = tmp_path / "index"
    HybridIndex.from_documents(small_documents("old", 3), folder, embed_model=model).close()
    real = hybrid_index_module.read_generation
    calls = []

    def racing(storage, generation, custom_tokenizer=None, **options):
        calls.append(generation)
        if len(calls) == 1:
            HybridIndex.from_documents(small_documents("new", 4), folder, embed_model=model, overwrite=True).close()
        return real(storage, generation, custom_tokenizer, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hybrid_index_module, "read_generation", racing)
        reader = HybridIndex.load(folder, embed_model=model, read_only=True)
    with reader, HybridIndex.load(folder, embed_model=model, read_only=True) as fresh:
        assert reader.manifest.build_id == fresh.manifest.build_id
        assert reader.doc_ids() == fresh.doc_ids() == [f"new{i}.md" for i in range(4)]
        assert {r.node.ref_doc_id for r in reader.as_retriever("sparse", similarity_top_k=10).retrieve("annual fee")} <= set(fresh.doc_ids())


PAUSED_PUBLISH = r"""
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index_retrieval_kit.indices import HybridIndex
target = Path({folder!r})
real_rename = os.rename
def rename(src, dst, *args, **kwargs):
    real_rename(src, dst, *args, **kwargs)
    if Path(dst).parent == target and Path(src).parent != target and Path(dst).name != "index.json":
        os.rename = real_rename
        os.kill(os.getpid(), signal.SIGSTOP)  # the old index moved out, the new one moving in
os.rename = rename
docs = [Document(id_=f"new{{i}}.md", text=f"Clause {{i}} of the new agreement: the annual fee is {{i}} dollars.") for i in range(4)]
HybridIndex.from_documents(docs, target, embed_model=MockEmbedding(embed_dim=16), overwrite=True).close()
"""


@pytest.mark.skipif(os.name == "nt", reason="SIGSTOP pauses the publishing process")
def test_an_open_meeting_a_publish_half_way_is_told_to_retry(tmp_path: Path) -> None:
    """Another process's rebuild moves the old index out while the reader reads it: the reader
    gets IndexBeingPublishedError (retry shortly), not FileNotFoundError on index.json; once the
    publish ends, the folder opens to the new build."""
    from llama_index.core.embeddings import MockEmbedding

    model = MockEmbedding(embed_dim=16)
    folder = tmp_path / "index"
    HybridIndex.from_documents(small_documents("old", 3), folder, embed_model=model).close()
    for _ in range(2):  # the reader's generation (2) is not the new build's (0): its files are gone, not replaced
        with HybridIndex.load(folder, embed_model=model) as writer:
            writer.upsert(small_documents("more", 1))
    real = hybrid_index_module.read_generation
    publisher: List[subprocess.Popen] = []

    def racing(storage, generation, custom_tokenizer=None, **options):
        if not publisher:
            child = subprocess.Popen([sys.executable, "-c", PAUSED_PUBLISH.format(repo=str(REPO), folder=str(folder))], stderr=subprocess.PIPE, text=True)
            publisher.append(child)
            _, status = os.waitpid(child.pid, os.WUNTRACED)  # paused half-way through its publish
            assert os.WIFSTOPPED(status), child.stderr.read()
        return real(storage, generation, custom_tokenizer, **options)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hybrid_index_module, "read_generation", racing)
            with pytest.raises(IndexBeingPublishedError, match="retry shortly"):
                HybridIndex.load(folder, embed_model=model, read_only=True)
    finally:
        for child in publisher:
            os.kill(child.pid, signal.SIGCONT)
            assert child.wait(120) == 0, child.stderr.read()
    with HybridIndex.load(folder, embed_model=model, read_only=True) as reader:
        assert reader.doc_ids() == [f"new{i}.md" for i in range(4)]


# ----- the embedding cache: a read-only reader beside another process's transaction ------------------

HOLD_LOCK = r"""
import sqlite3, sys, time
conn = sqlite3.connect({path!r}, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")  # what a purge's delete or VACUUM holds, seconds at a time
print("locked", flush=True)
time.sleep({seconds})
conn.execute("COMMIT")
"""


def cache_with_rows(path: Path, rows: int) -> Dict[str, np.ndarray]:
    vectors = {f"k{i}": np.full(8, i, dtype=np.float32) for i in range(rows)}
    cache = EmbeddingCache(path)
    cache.put_many("m", vectors.items())
    cache.close()
    return vectors


def hold_lock(path: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(path=str(path), seconds=seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_read_only_cache_reader_waits_for_another_process_s_transaction(tmp_path: Path) -> None:
    """sqlite's default 5 s wait raised 'database is locked' from a query of a read-only index
    while the writer purged a large cache (delete 7 s, VACUUM 4 s at 400k rows)."""
    path = tmp_path / "embeddings.sqlite"
    vectors = cache_with_rows(path, 20)
    reader = EmbeddingCache(path, read_only=True)
    holder = hold_lock(path, 6.0)
    try:
        found = reader.get_many("m", list(vectors))
    finally:
        holder.wait(30)
        reader.close()
    assert sorted(found) == sorted(vectors) and all(np.array_equal(found[k], vectors[k]) for k in vectors)


def test_a_cache_transaction_outlasting_the_wait_is_a_one_line_busy_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "embeddings.sqlite"
    vectors = cache_with_rows(path, 3)
    monkeypatch.setattr(embedding_cache_module, "READ_BUSY_TIMEOUT", 0.2)
    reader = EmbeddingCache(path, read_only=True)
    holder = hold_lock(path, 2.0)
    try:
        with pytest.raises(IndexWriteLockedError, match="wait for that write or build to finish") as raised:
            reader.get_many("m", list(vectors))
    finally:
        holder.wait(30)
        reader.close()
    assert str(path) in str(raised.value) and isinstance(raised.value.__cause__, sqlite3.OperationalError)


def test_a_writable_cache_open_waits_like_a_reader_then_says_busy_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a writable cache writes (its table, re-keyed rows) outside the folder's write lock:
    sqlite's 5 s default raised a bare 'database is locked' beside another process's purge."""
    path = tmp_path / "embeddings.sqlite"
    vectors = cache_with_rows(path, 3)
    monkeypatch.setattr(embedding_cache_module, "READ_BUSY_TIMEOUT", 0.2)
    holder = hold_lock(path, 2.0)
    try:
        with pytest.raises(IndexWriteLockedError, match="wait for that write or build to finish"):
            EmbeddingCache(path)
    finally:
        holder.wait(30)
    cache = EmbeddingCache(path)  # the transaction ended: opens and reads as before
    try:
        assert sorted(cache.get_many("m", list(vectors))) == sorted(vectors)
    finally:
        cache.close()


# ----- a folder's lock held too long: a one-line timeout, not a hang -----------------------------------

HOLD_FOLDER = r"""
import sys
sys.path.insert(0, {repo!r})
from llama_index_retrieval_kit._files import folder_lock
with folder_lock({folder!r}, shared={shared!r}):
    print("held", flush=True)
    sys.stdin.readline()  # held until the parent writes a line (as by a process stopped half-way)
"""
WAIT = 0.2  # seconds given to the lock in these tests


def hold_folder(folder: Path, shared: bool) -> subprocess.Popen:
    """A child process holding ``folder``'s lock until a line is written to its stdin."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_FOLDER.format(repo=str(REPO), folder=str(folder), shared=shared)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "held"
    return child


def release(child: subprocess.Popen) -> None:
    child.stdin.write("\n")
    child.stdin.close()
    assert child.wait(30) == 0


def assert_lock_timeout(folder: Path, shared: bool, holders: str) -> None:
    with pytest.raises(FolderLockTimeout) as raised:
        with folder_lock(folder, shared=shared, timeout_s=WAIT):
            pytest.fail("the lock was taken while another holder had it")
    message = str(raised.value)
    assert not isinstance(raised.value, OSError) and "\n" not in message
    assert message.startswith(f"{folder} is locked: another process or thread is {holders} (waited {WAIT:g} s")
    assert "resume it or end it" in message and raised.value.folder == folder


def test_a_folder_held_by_another_process_times_out_then_locks_once_released(tmp_path: Path) -> None:
    """Before, ``folder_lock`` (every BM25Retriever.persist and load) waited forever for a holder
    stopped half-way."""
    folder = tmp_path / "bm25"
    folder.mkdir()
    writer = hold_folder(folder, shared=False)
    try:
        assert_lock_timeout(folder, shared=False, holders="writing to it or reading it")
        assert_lock_timeout(folder, shared=True, holders="writing to it")
    finally:
        release(writer)
    for shared in (False, True):
        with folder_lock(folder, shared=shared, timeout_s=WAIT) as excluded:
            assert excluded
    reader = hold_folder(folder, shared=True)
    try:
        assert_lock_timeout(folder, shared=False, holders="writing to it or reading it")
        with folder_lock(folder, shared=True, timeout_s=WAIT):  # readers share it
            pass
    finally:
        release(reader)


def hold_in_thread(folder: Path, shared: bool) -> tuple[threading.Thread, threading.Event]:
    """A thread holding ``folder``'s lock until the returned event is set."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with folder_lock(folder, shared=shared):
            held.set()
            done.wait(120)  # set by the test; the bound only keeps a failing test from hanging

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(30)
    return thread, done


def test_a_folder_held_by_another_thread_times_out_then_locks_once_released(tmp_path: Path) -> None:
    folder = tmp_path / "bm25"
    folder.mkdir()
    thread, done = hold_in_thread(folder, shared=False)
    try:
        assert_lock_timeout(folder, shared=True, holders="writing to it")
        assert_lock_timeout(folder, shared=False, holders="writing to it or reading it")
    finally:
        done.set()
        thread.join(30)
    for shared in (True, False):
        with folder_lock(folder, shared=shared, timeout_s=WAIT):
            pass


def test_a_writer_giving_up_lets_the_readers_it_held_back_in(tmp_path: Path) -> None:
    """Writers are preferred: a reader waits behind a waiting writer. When that writer times out,
    the reader goes on beside the readers already in (it is not left waiting for them to leave)."""
    folder = tmp_path / "bm25"
    folder.mkdir()
    reader, done = hold_in_thread(folder, shared=True)
    outcomes: Dict[str, object] = {}

    def write() -> None:
        try:
            with folder_lock(folder, timeout_s=1.0):
                outcomes["writer"] = "locked"
        except FolderLockTimeout as exc:
            outcomes["writer"] = exc

    def read_late() -> None:
        with folder_lock(folder, shared=True, timeout_s=None):  # behind the writer, then in
            outcomes["late reader"] = "locked"

    writer, late = threading.Thread(target=write), threading.Thread(target=read_late)
    try:
        writer.start()
        while writer.is_alive():  # until the writer waits: then a reader that does not wait is refused
            try:
                with folder_lock(folder, shared=True, timeout_s=0):
                    pass
            except FolderLockTimeout:
                break
        else:
            pytest.fail(f"the writer never waited: {outcomes}")
        late.start()
        late.join(30)
        got = dict(outcomes)  # while the first reader still holds the lock
    finally:
        done.set()
        for thread in (reader, writer, late):
            if thread.ident is not None:
                thread.join(30)
    assert got.get("late reader") == "locked" and isinstance(got.get("writer"), FolderLockTimeout)


def test_a_bad_timeout_is_refused_naming_it(tmp_path: Path) -> None:
    for bad in (-1, "60", float("nan")):
        with pytest.raises(ValueError, match=r"timeout_s must be None \(wait forever\) or a number of seconds >= 0, got "):
            with folder_lock(tmp_path, timeout_s=bad):  # type: ignore[arg-type]
                pass
