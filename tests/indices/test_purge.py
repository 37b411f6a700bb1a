"""``HybridIndex.purge()`` / ``rkit purge``: after a delete (or an upsert that shortens a document),
the removed chunks' text leaves every file of the folder, not only the query paths.

Before a purge, Qdrant Edge's WAL and segment pages still hold the removed chunks' payloads (text and
metadata) and the embedding cache their text hashes and vectors; the tests check that they are
there first (so each check proves something), then gone: every file under the folder is searched
byte for byte for the removed documents' marker words, and the cache file for the removed chunks'
text hashes and vector bytes. The remaining documents answer exactly as before, in every mode; a
process killed (SIGKILL) at each step of a purge leaves a folder that opens to the same committed
index; an index open elsewhere is refused. A rebuild takes from the replaced index's cache only the
vectors its own chunks need. Real Qdrant Edge throughout; the packaged MiniLM where rankings and the
command line matter, a hashed embedding (distinct vectors, no model) elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core import Document
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import MetadataMode, QueryBundle
from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters
from pydantic import PrivateAttr
from qdrant_client import QdrantClient

from llama_index_retrieval_kit import SectionWindowNodeParser
from llama_index_retrieval_kit.cli import EXIT_BUSY, EXIT_OK, EXIT_USAGE, main
from llama_index_retrieval_kit.indices import (
    RETRIEVER_MODES,
    EmbeddingCache,
    HybridIndex,
    IndexBusyError,
    IndexReadOnlyError,
    StaleServerCopyError,
)
from llama_index_retrieval_kit.indices.embedding_cache import model_key, text_key

from . import _support

REPO = Path(__file__).resolve().parents[2]
URL = "http://qdrant.example:6333"
DELETED = "acme_contract.txt"  # deleted outright
SHORTENED = "beta_terms.txt"  # upserted again without its sections 2 and 3
KEPT = "gamma_policy.txt"
DELETED_MARKERS = ["zorblattine", "quexotrium"]
CUT_MARKERS = ["kelpvortexa", "marbleglintz"]  # the shortened document's removed sections
REMOVED_MARKERS = DELETED_MARKERS + CUT_MARKERS
KEPT_MARKERS = ["sunpetrelix", "harborlimeo"]
GOODS = ["steel beams", "copper wire", "glass panels", "oak planks", "paper rolls", "wool bales", "tin cans", "salt sacks"]
CITIES = ["Lisbon", "Oslo", "Turin", "Ghent", "Krakow", "Porto", "Bergen", "Leeds"]
QUESTIONS = [
    "What does the sunpetrelix clause say about copper wire?",
    "Which penalty applies to late deliveries of glass panels?",
    "harborlimeo travel rules for Oslo",
    "refund of the fees paid",
]
ALL_CHUNKS = 200  # more than any index here holds: every mode returns everything it can


def section(n: int, title: str, word: str, sentences: int = 6) -> str:
    """A numbered section whose sentences all differ (no two chunks share a text) and name ``word``."""
    body = " ".join(
        f"The {word} clause {n}.{i} covers {GOODS[(n + i) % 8]} shipped to {CITIES[(n * 3 + i) % 8]}, "
        f"with a penalty of {n * 7 + i} percent per late week{' and a refund of the fees paid' * (i % 2)}."
        for i in range(sentences)
    )
    return f"{n}. {title}\n\n{body}\n\n"


def contract() -> Document:
    text = section(1, "Terms", DELETED_MARKERS[0]) + section(2, "Delivery", DELETED_MARKERS[1])
    return Document(text=text, id_=DELETED, metadata={"tenant": "acme"})


def beta(shortened: bool = False) -> Document:
    text = section(1, "Scope", KEPT_MARKERS[0])
    if not shortened:
        text += section(2, "Pricing", CUT_MARKERS[0]) + section(3, "Liability", CUT_MARKERS[1])
    return Document(text=text, id_=SHORTENED, metadata={"tenant": "beta"})


def gamma() -> Document:
    return Document(text=section(1, "General", KEPT_MARKERS[1]) + section(2, "Travel", "economy"), id_=KEPT, metadata={"tenant": "gamma"})


def parser() -> SectionWindowNodeParser:
    return SectionWindowNodeParser(chunk_size=60, chunk_overlap=10)


class HashEmbedding(BaseEmbedding):
    """A deterministic unit vector per text (seeded by its hash): distinct vectors, no model. Counts
    the texts it embeds (``calls``)."""

    dim: int = 32
    _calls: List[str] = PrivateAttr(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "HashEmbedding"

    @property
    def calls(self) -> List[str]:
        return self._calls

    def _vector(self, text: str) -> List[float]:
        seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        vec = np.random.default_rng(seed).standard_normal(self.dim)
        return (vec / np.linalg.norm(vec)).tolist()

    def _get_text_embedding(self, text: str) -> List[float]:
        self._calls.append(text)
        return self._vector(text)

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        self._calls.extend(texts)
        return [self._vector(t) for t in texts]

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)


# ---------------------------------------------------------------------------------- what the folder holds


def grep_folder(folder: Path, needles: Sequence[bytes]) -> Dict[str, List[bytes]]:
    """Every file under ``folder`` (hidden ones too) holding any of ``needles``, byte for byte."""
    hits: Dict[str, List[bytes]] = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found = [n for n in needles if n in data]
            if found:
                hits[str(path.relative_to(folder))] = found
    return hits


def words(markers: Sequence[str]) -> List[bytes]:
    return [m.encode("utf-8") for m in markers]


def chunk_keys(index: HybridIndex, marker_words: Sequence[str]) -> List[str]:
    """The cache keys (text hashes) of the index's chunks holding any of ``marker_words``."""
    return [
        text_key(n.get_content(metadata_mode=MetadataMode.EMBED))
        for n in index.bm25.nodes
        if any(w in n.get_content() for w in marker_words)
    ]


def cache_rows(storage: Path) -> Dict[str, bytes]:
    """The cache file's rows, key -> vector bytes (read with sqlite3, as anyone could)."""
    with contextlib.closing(sqlite3.connect(storage / "embeddings.sqlite")) as conn:
        return {key: bytes(vector) for key, vector in conn.execute("SELECT key, vector FROM vectors")}


IN_PROCESS_MODES = tuple(m for m in RETRIEVER_MODES if m != "qdrant_hybrid")


def results(index: HybridIndex) -> tuple[Dict, Dict]:
    """What ``index`` answers to QUESTIONS: each in-process mode's ranking, and for ``qdrant_hybrid``
    each chunk's leg scores (the engine orders chunks of equal leg scores by insertion, which a
    rewrite of the shard changes, as a rebuild does; the scores themselves stay)."""
    bundles = [QueryBundle(q) for q in QUESTIONS]
    ranked = _support.run_modes(index, bundles, modes=IN_PROCESS_MODES, similarity_top_k=ALL_CHUNKS)
    engine = index.as_retriever("qdrant_hybrid", similarity_top_k=ALL_CHUNKS)
    legs = {qb.query_str: {r.node.node_id: dict(r.leg_scores) for r in engine.retrieve(qb)} for qb in bundles}
    return ranked, legs


def assert_same_answers(got: tuple[Dict, Dict], want: tuple[Dict, Dict]) -> None:
    _support.assert_same_results(got[0], want[0], top_k=ALL_CHUNKS)
    assert got[1].keys() == want[1].keys()
    for question, chunks in want[1].items():
        assert got[1][question].keys() == chunks.keys(), question
        for node_id, legs in chunks.items():
            other = got[1][question][node_id]
            assert other.keys() == legs.keys() and all(math.isclose(other[k], v, abs_tol=1e-6) for k, v in legs.items()), node_id


@pytest.fixture()
def edited(tmp_path: Path, embed_model) -> Iterator[tuple[HybridIndex, Path, Dict[str, bytes]]]:
    """(index, folder, removed chunks' cache rows): three documents indexed with the packaged model,
    then DELETED deleted and SHORTENED upserted without two sections."""
    storage = tmp_path / "index"
    index = HybridIndex.from_documents([contract(), beta(), gamma()], storage, embed_model=embed_model, node_parser=parser())
    try:
        texts = [n.get_content() for n in index.bm25.nodes]
        assert len(set(texts)) == len(texts)  # distinct chunks: rankings have no ties to reorder
        removed_keys = chunk_keys(index, REMOVED_MARKERS)
        index.delete(DELETED)
        index.upsert([beta(shortened=True)])
        removed = {k: v for k, v in cache_rows(storage).items() if k in set(removed_keys)}
        assert len(removed) == len(set(removed_keys)) > 0
        yield index, storage, removed
    finally:
        index.close()


# ---------------------------------------------------------------------------------- erasure


def test_purge_erases_the_removed_text_from_every_file_and_keeps_the_answers(edited, embed_model) -> None:
    index, storage, removed = edited
    generation = index.manifest.generation
    before = grep_folder(storage, words(REMOVED_MARKERS))
    # Out of every query path already, but on disk: Edge's WAL and segments, the cache's hashes and vectors.
    assert {m for found in before.values() for m in found} == set(words(REMOVED_MARKERS)), before
    assert any(name.startswith("edge/shard/wal/") for name in before)
    cache_bytes = (storage / "embeddings.sqlite").read_bytes()
    assert all(key.encode() in cache_bytes and vector in cache_bytes for key, vector in removed.items())
    answers = results(index)
    reader = HybridIndex.load(storage, embed_model=embed_model, read_only=True)  # another process's reader

    stats = index.purge()

    assert grep_folder(storage, words(REMOVED_MARKERS)) == {}
    kept = grep_folder(storage, words(KEPT_MARKERS))
    assert any(name.startswith("edge/") for name in kept) and any(name.startswith("docstore/") for name in kept)
    cache_bytes = (storage / "embeddings.sqlite").read_bytes()
    assert not any(key.encode() in cache_bytes or vector in cache_bytes for key, vector in removed.items())
    assert not set(removed) & set(cache_rows(storage))
    committed = {text_key(n.get_content(metadata_mode=MetadataMode.EMBED)) for n in index.bm25.nodes}
    assert set(cache_rows(storage)) == committed  # exactly the committed chunks' vectors
    assert stats["points"] == len(index) and stats["cache_rows"] == len(committed)
    assert stats["cache_rows_removed"] == len(removed) and stats["bytes_freed"] > 0

    assert index.manifest.generation == generation and index.manifest.pending is None  # the committed state is unchanged
    _support.assert_consistent(index)
    assert_same_answers(results(index), answers)
    with reader:  # a reader of the same generation still answers, its vectors from the purged cache
        assert reader.refresh() is False
        in_memory = ("hybrid", "dense", "sparse")
        got = _support.run_modes(reader, [QueryBundle(q) for q in QUESTIONS], modes=in_memory, similarity_top_k=ALL_CHUNKS)
        _support.assert_same_results(got, {k: v for k, v in answers[0].items() if k[0] in in_memory}, top_k=ALL_CHUNKS)
    index.close()
    with HybridIndex.load(storage, embed_model=embed_model) as reopened:
        _support.assert_consistent(reopened)
        assert_same_answers(results(reopened), answers)
    assert grep_folder(storage, words(REMOVED_MARKERS)) == {}


def test_purge_keeps_the_payload_indexes_and_filters(edited) -> None:
    index, storage, _ = edited
    only_beta = MetadataFilters(filters=[MetadataFilter(key="tenant", value="beta")])
    engine = index.as_retriever("qdrant_hybrid", similarity_top_k=ALL_CHUNKS, filters=only_beta)
    before = [(r.node.node_id, r.score) for r in engine.retrieve(QUESTIONS[0])]
    assert before and "tenant" in index.store.payload_indexes  # the filter made the engine index the key
    indexes = index.store.payload_indexes
    index.purge()
    assert index.store.payload_indexes == indexes
    assert [(r.node.node_id, r.score) for r in engine.retrieve(QUESTIONS[0])] == before


def test_purge_rebuilds_hnsw_when_the_index_had_it(tmp_path: Path) -> None:
    from .test_hybrid_index_hnsw import DOCS, HashEmbedding as WideHashEmbedding, documents

    embed = WideHashEmbedding()
    with HybridIndex.from_documents(documents(DOCS), tmp_path / "big", embed_model=embed, build_hnsw=True) as index:
        assert index.store.unindexed_vectors() == 0
        index.delete("doc-1")
        stats = index.purge()
        assert stats["points"] == DOCS - 1 == index.store.count()
        assert index.store.unindexed_vectors() == 0  # HNSW over every vector again
    with HybridIndex.from_documents(documents(50), tmp_path / "small", embed_model=embed) as index:
        index.purge()
        assert index.store.unindexed_vectors() == index.store.count()  # none before, none built


def test_purge_embeds_nothing_even_when_the_cache_lost_vectors(tmp_path: Path) -> None:
    """Vectors missing from the cache (deleted by hand) are copied from the old shard first."""
    embed = HashEmbedding()
    storage = tmp_path / "index"
    with HybridIndex.from_documents([contract(), gamma()], storage, embed_model=embed, node_parser=parser()) as index:
        answers = results(index)
        index.cache.retain(model_key(embed), chunk_keys(index, [KEPT_MARKERS[1]]))  # only gamma's first section left
        embed.calls.clear()
        index.purge()
        assert embed.calls == []
        assert len(index.cache) == len(index)
        _support.assert_consistent(index)
        assert_same_answers(results(index), answers)


def test_purge_of_an_emptied_and_of_an_untouched_index(tmp_path: Path) -> None:
    embed = HashEmbedding()
    with HybridIndex.from_documents([contract()], tmp_path / "a", embed_model=embed, node_parser=parser()) as index:
        index.delete(DELETED)
        stats = index.purge()
        assert stats["points"] == 0 and stats["cache_rows"] == 0 and stats["cache_rows_removed"] > 0
        assert grep_folder(tmp_path / "a", words(DELETED_MARKERS)) == {}
        assert index.as_retriever("qdrant_hybrid").retrieve("zorblattine") == []
        index.upsert([gamma()])  # still writable
        assert index.doc_ids() == [KEPT]
    with HybridIndex.from_documents([gamma()], tmp_path / "b", embed_model=embed, node_parser=parser()) as index:
        answers = results(index)
        assert index.purge()["cache_rows_removed"] == 0
        assert_same_answers(results(index), answers)


# ---------------------------------------------------------------------------------- crashes


KILLED_PURGE = r"""
import sys, time
sys.path.insert(0, {repo!r})
from tests.indices.test_purge import HashEmbedding
from llama_index_retrieval_kit.indices import EdgePoints, EmbeddingCache, HybridIndex
from llama_index_retrieval_kit.indices.journal import WriteJournal

def pause(label):
    print(label, flush=True)
    time.sleep(120)  # SIGKILLed here

point = {point!r}
if point == "journal_recorded":
    real_begin = WriteJournal.begin
    def begin(self, touched_ids):
        record = real_begin(self, touched_ids)
        pause(point)
    WriteJournal.begin = begin
elif point == "shard_deleted":
    real_clear = EdgePoints.clear
    def clear(self):
        real_clear(self)
        pause(point)
    EdgePoints.clear = clear
elif point == "half_the_points_written":
    real_upsert = EdgePoints.upsert_points
    def upsert_points(self, ids, dense, sparse, payloads):
        half = len(ids) // 2
        real_upsert(self, ids[:half], dense[:half], sparse[:half], payloads[:half])
        pause(point)
    EdgePoints.upsert_points = upsert_points
elif point == "cache_rows_deleted":
    def vacuum(self):
        pause(point)
    EmbeddingCache.vacuum = vacuum
index = HybridIndex.load({path!r}, embed_model=HashEmbedding())
index.purge()
print("finished", flush=True)
"""


def kill_purge_at(storage: Path, point: str) -> None:
    """Run ``purge()`` in a child process and SIGKILL it at ``point``."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_PURGE.format(repo=str(REPO), path=str(storage), point=point)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = child.stdout.readline().strip()
        assert line == point, f"the child did not reach {point}: {line!r} {child.stderr.read()}"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(60)
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("point", ["journal_recorded", "shard_deleted", "half_the_points_written", "cache_rows_deleted"])
def test_a_purge_killed_at_any_step_leaves_the_committed_index(tmp_path: Path, point: str) -> None:
    embed = HashEmbedding()
    storage = tmp_path / "index"
    with HybridIndex.from_documents([contract(), beta(), gamma()], storage, embed_model=embed, node_parser=parser()) as index:
        index.delete(DELETED)
        index.upsert([beta(shortened=True)])
        answers = results(index)
        committed = {"docs": index.doc_ids(), "generation": index.manifest.generation, "chunks": len(index)}
    assert grep_folder(storage, words(REMOVED_MARKERS))

    kill_purge_at(storage, point)
    pending = json.loads((storage / "index.json").read_text())["pending"]
    assert (pending is not None) == (point != "cache_rows_deleted")  # the journal covers the shard's rewrite
    assert (storage / "edge" / "store.json").exists() == (point != "shard_deleted")

    embed.calls.clear()
    with HybridIndex.load(storage, embed_model=embed) as reopened:  # rolled back: every point rewritten from the cache
        assert embed.calls == []
        assert reopened.manifest.pending is None and reopened.manifest.generation == committed["generation"]
        assert reopened.doc_ids() == committed["docs"] and len(reopened) == committed["chunks"]
        _support.assert_consistent(reopened)
        assert_same_answers(results(reopened), answers)
        reopened.purge()  # ...and a purge run again finishes the job
    assert grep_folder(storage, words(REMOVED_MARKERS)) == {}
    with HybridIndex.load(storage, embed_model=embed) as reopened:
        assert_same_answers(results(reopened), answers)


def test_a_failed_purge_is_rolled_back_in_the_live_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index_retrieval_kit.indices import EdgePoints

    embed = HashEmbedding()
    with HybridIndex.from_documents([contract(), gamma()], tmp_path / "index", embed_model=embed, node_parser=parser()) as index:
        index.delete(DELETED)
        answers = results(index)
        real = EdgePoints.upsert_points
        failed: List[int] = []

        def fails_half_way_once(self, ids, dense, sparse, payloads):
            if failed:  # the roll-back's writes go through
                return real(self, ids, dense, sparse, payloads)
            failed.append(len(ids))
            real(self, ids[:1], dense[:1], sparse[:1], payloads[:1])
            raise OSError("disk full")

        monkeypatch.setattr(EdgePoints, "upsert_points", fails_half_way_once)
        with pytest.raises(OSError, match="disk full"):
            index.purge()
        monkeypatch.setattr(EdgePoints, "upsert_points", real)
        assert failed == [len(index)]
        # The live object restored every point (its roll-back rewrites them all) and still writes.
        assert index.manifest.pending is None
        _support.assert_consistent(index)
        assert_same_answers(results(index), answers)
        index.purge()
    assert grep_folder(tmp_path / "index", words(DELETED_MARKERS)) == {}


def test_a_missing_shard_without_a_purge_in_flight_is_still_damage(tmp_path: Path) -> None:
    from llama_index_retrieval_kit.indices import DamagedIndexError

    storage = tmp_path / "index"
    HybridIndex.from_documents([gamma()], storage, embed_model=HashEmbedding(), node_parser=parser()).close()
    (storage / "edge" / "store.json").unlink()
    with pytest.raises(DamagedIndexError, match="is missing"):
        HybridIndex.load(storage, embed_model=HashEmbedding())


# ---------------------------------------------------------------------------------- who may purge

HOLDER = r"""
import sys
sys.path.insert(0, {repo!r})
from tests.indices.test_purge import HashEmbedding
from llama_index_retrieval_kit.indices import HybridIndex
index = HybridIndex.load({path!r}, embed_model=HashEmbedding())
print("open", flush=True)
sys.stdin.readline()
index.close()
"""


def test_purge_is_refused_while_another_process_has_the_index_open(tmp_path: Path) -> None:
    storage = tmp_path / "index"
    with HybridIndex.from_documents([contract(), gamma()], storage, embed_model=HashEmbedding(), node_parser=parser()) as index:
        index.delete(DELETED)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(repo=str(REPO), path=str(storage))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open", holder.stderr.read()
        with pytest.raises(IndexBusyError, match="open in another process"):
            HybridIndex.load(storage, embed_model=HashEmbedding())
        with HybridIndex.load(storage, embed_model=HashEmbedding(), read_only=True) as reader:
            with pytest.raises(IndexReadOnlyError):
                reader.purge()
    finally:
        holder.communicate("done\n", timeout=60)
    assert holder.returncode == 0
    assert grep_folder(storage, words(DELETED_MARKERS))  # nothing was purged
    with HybridIndex.load(storage, embed_model=HashEmbedding()) as index:
        index.purge()
    assert grep_folder(storage, words(DELETED_MARKERS)) == {}


def test_a_pushed_copy_needs_a_push_again_and_a_server_index_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    embed = HashEmbedding()
    storage = tmp_path / "index"
    with HybridIndex.from_documents([contract(), gamma()], storage, embed_model=embed, node_parser=parser()) as index:
        index.push_to(URL)
        index.delete(DELETED)
        index.purge()
        with pytest.raises(StaleServerCopyError):  # the copy was pushed before the delete: still refused
            HybridIndex.load(storage, embed_model=embed, qdrant_url=URL, read_only=True)
        index.push_to(URL)
        index.purge()  # changes no committed state: the copy pushed after the delete stays current
        with HybridIndex.load(storage, embed_model=embed, qdrant_url=URL, read_only=True) as served:
            assert served.doc_ids() == [KEPT]
        index.push_to(URL, switch=True)
        with pytest.raises(ValueError, match="rebuild the index"):
            index.purge()


# ---------------------------------------------------------------------------------- rebuilds


def test_a_rebuild_takes_only_its_own_chunks_vectors_from_the_replaced_cache(tmp_path: Path) -> None:
    embed = HashEmbedding()
    storage = tmp_path / "index"
    with HybridIndex.from_documents([contract(), gamma()], storage, embed_model=embed, node_parser=parser()) as index:
        removed = {k: v for k, v in cache_rows(storage).items() if k in set(chunk_keys(index, DELETED_MARKERS))}
    assert removed
    embed.calls.clear()
    with HybridIndex.from_documents([gamma()], storage, embed_model=embed, node_parser=parser(), overwrite=True) as index:
        assert embed.calls == []  # every vector came from the replaced index's cache
        kept = {text_key(n.get_content(metadata_mode=MetadataMode.EMBED)) for n in index.bm25.nodes}
    assert set(cache_rows(storage)) == kept
    cache_bytes = (storage / "embeddings.sqlite").read_bytes()
    assert not any(key.encode() in cache_bytes or vector in cache_bytes for key, vector in removed.items())
    assert grep_folder(storage, words(DELETED_MARKERS)) == {}


def test_a_rebuild_survives_a_replaced_cache_it_cannot_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    embed = HashEmbedding()
    storage = tmp_path / "index"
    HybridIndex.from_documents([gamma()], storage, embed_model=embed, node_parser=parser()).close()
    (storage / "embeddings.sqlite").write_bytes(b"not a database at all, but long enough to look like a header....")
    with HybridIndex.from_documents([gamma()], storage, embed_model=embed, node_parser=parser(), overwrite=True) as index:
        assert index.doc_ids() == [KEPT]
    assert "not reusing the embedding cache of the replaced index" in caplog.text


# ---------------------------------------------------------------------------------- the cache's own surface

keys_st = st.lists(st.sampled_from([f"k{i}" for i in range(12)]), max_size=12)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(["m1", "m2"]), st.sampled_from([f"k{i}" for i in range(12)])), max_size=20), keep=keys_st)
def test_retain_keeps_exactly_the_models_rows_of_the_keys(tmp_path_factory: pytest.TempPathFactory, rows, keep) -> None:
    path = tmp_path_factory.mktemp("cache") / "embeddings.sqlite"
    cache = EmbeddingCache(path)
    try:
        for model, key in rows:
            cache.put_many(model, [(key, np.full(3, float(len(key)), dtype=np.float32))])
        stored = set(rows)
        deleted = cache.retain("m1", keep)
        cache.vacuum()
        left = {(model, key) for model, key in stored if model == "m1" and key in set(keep)}
        assert deleted == len(stored) - len(left) and len(cache) == len(left)
        assert set(cache.get_many("m1", sorted({k for _, k in left}))) == {k for _, k in left}
        assert cache.missing("m1", keep + ["zz"]) == [k for k in dict.fromkeys(keep + ["zz"]) if ("m1", k) not in left]
    finally:
        cache.close()


def test_a_seeded_cache_copies_only_the_rows_asked_for(tmp_path: Path) -> None:
    seed_path = tmp_path / "seed.sqlite"
    with contextlib.closing(EmbeddingCache(seed_path)) as seed:
        seed.put_many("m", [(f"k{i}", np.full(4, i, dtype=np.float32)) for i in range(5)])
    before = seed_path.read_bytes()
    with contextlib.closing(EmbeddingCache(tmp_path / "new.sqlite", seed_from=seed_path)) as cache:
        got = cache.get_many("m", ["k1", "k3", "nope"])
        assert sorted(got) == ["k1", "k3"] and float(got["k3"][0]) == 3.0
        assert len(cache) == 2 and cache.missing("m", ["k1", "k2"]) == ["k2"]
    assert seed_path.read_bytes() == before  # read, never changed
    with pytest.raises(ValueError, match="needs a writable cache"):
        EmbeddingCache(tmp_path / "x.sqlite", read_only=True, seed_from=seed_path)
    with pytest.raises(ValueError, match="is not a file"):
        EmbeddingCache(tmp_path / "y.sqlite", seed_from=tmp_path / "none.sqlite")
    with contextlib.closing(sqlite3.connect(tmp_path / "other.sqlite")) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    with pytest.raises(ValueError, match="is not an embedding cache"):
        EmbeddingCache(tmp_path / "z.sqlite", seed_from=tmp_path / "other.sqlite")
    with pytest.raises(RuntimeError, match="read-only"):
        EmbeddingCache(seed_path, read_only=True).retain("m", [])


# ---------------------------------------------------------------------------------- rkit purge


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["-q", *argv])
    return code, out.getvalue(), err.getvalue()


def test_rkit_delete_then_rkit_purge(tmp_path: Path, embed_model) -> None:
    storage = tmp_path / "index"
    HybridIndex.from_documents([contract(), gamma()], storage, embed_model=embed_model, node_parser=parser()).close()
    code, out, err = _run("delete", "--storage", str(storage), DELETED)
    assert code == EXIT_OK, err
    assert f"to erase their text from the folder's files too (an erasure request): rkit purge --storage {storage}" in out
    assert grep_folder(storage, words(DELETED_MARKERS))

    with HybridIndex.load(storage, embed_model=embed_model):  # open in this process: refused, nothing done
        code, out, err = _run("purge", "--storage", str(storage))
    assert code == EXIT_BUSY and out == "" and "is open in another process" in err
    assert grep_folder(storage, words(DELETED_MARKERS))

    code, out, err = _run("purge", "--storage", str(storage))
    assert code == EXIT_OK, err
    with HybridIndex.load(storage, embed_model=embed_model) as index:
        chunks = len(index)
    assert f"purged {storage}: the Qdrant Edge shard was written afresh with the {chunks} committed chunk(s)" in out
    assert "cached embedding(s) of chunks no longer indexed deleted" in out and "push again" in out
    assert grep_folder(storage, words(DELETED_MARKERS)) == {}

    config = tmp_path / "pipeline.yaml"
    config.write_text(f"index: {{storage_dir: {storage}}}\n", encoding="utf-8")
    code, out, err = _run("purge", "--config", str(config))
    assert code == EXIT_OK and f"purged {storage}" in out and " 0 cached embedding(s)" in out, err


def test_rkit_purge_needs_an_index(tmp_path: Path) -> None:
    code, _, err = _run("purge", "--storage", str(tmp_path / "nothing"))
    assert code == EXIT_USAGE and "holds no index" in err
    code, _, err = _run("purge")
    assert code == EXIT_USAGE and "--storage is required" in err
