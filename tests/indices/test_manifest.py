"""manifest.py and journal.py: the typed index.json and the write journal.

``IndexManifest`` must read exactly what ``storage.validate_manifest`` accepts (with its errors),
write back the same JSON keys (folders written before and after it are interchangeable), and
change only by returning new manifests. ``WriteJournal`` runs the journal steps on a real folder.
No model, no Qdrant: an empty BM25 index and docstore stand in for a generation's content.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore
from pydantic import ValidationError

from llama_index_retrieval_kit.indices import HybridIndex, IndexManifest, storage
from llama_index_retrieval_kit.indices.journal import WriteJournal, split_touched
from llama_index_retrieval_kit.indices.manifest import (
    FORMAT_VERSION,
    READABLE_FORMATS,
    BM25Settings,
    GenerationRecord,
    PendingWrite,
)
from llama_index_retrieval_kit.indices.storage import DamagedIndexError
from llama_index_retrieval_kit.retrievers import BM25Retriever

DIGEST = "0" * 64

# What a format-2 folder holds after a few writes (key order as HybridIndex writes it).
GOOD: Dict[str, Any] = {
    "format_version": 2,
    "embed_model": "sentence-transformers/all-MiniLM-L6-v2",
    "embed_model_class": "HuggingFaceEmbedding",
    "embed_dim": 384,
    "node_parser": {"class_name": "SectionWindowNodeParser", "window_size": 3},
    "bm25": {"k1": 1.2, "b": 0.75, "method": "lucene", "avgdl": 50.5},
    "bm25_tokenizer": {"stemmer_language": "english", "stopwords": "en"},
    "qdrant_url": None,
    "collection": "chunks",
    "embed_batch_size": 256,
    "generation": 3,
    "pending": {"generation": 4, "touched_ids": ["a", "b"]},
    "integrity": {"generation": 3, "files": {"docstore/gen-3.json": DIGEST}, "chunks": 7},
}

# A first-format folder written before checksums and before embed_model_class existed.
FORMAT_1_EARLY = {k: copy.deepcopy(v) for k, v in GOOD.items() if k not in ("embed_model_class", "integrity")}
FORMAT_1_EARLY.update(format_version=1, pending=None)


def with_value(data: Dict[str, Any], key_path: str, value: Any) -> Dict[str, Any]:
    data = copy.deepcopy(data)
    *parents, last = key_path.split(".")
    target = data
    for key in parents:
        target = target[key]
    target[last] = value
    return data


def without(data: Dict[str, Any], key_path: str) -> Dict[str, Any]:
    data = copy.deepcopy(data)
    *parents, last = key_path.split(".")
    target = data
    for key in parents:
        target = target[key]
    del target[last]
    return data


def outcome(read: Any) -> Tuple[str, Any]:
    """("ok", value) or the error's kind and message."""
    try:
        return "ok", read()
    except DamagedIndexError as exc:
        return "damaged", str(exc)
    except ValueError as exc:
        return "value", str(exc)


def same(a: Any, b: Any) -> bool:
    """JSON equality where NaN equals NaN (an unknown key may hold one)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def as_written(data: Dict[str, Any]) -> Dict[str, Any]:
    """A validated manifest as IndexManifest writes it back: the optional keys that hold null are
    left out (as in folders written before they existed); numbers compare by value."""
    return {k: v for k, v in data.items() if not (k in ("embed_model_class", "integrity") and v is None)}


# ---------------------------------------------------------------------------------- reading


@pytest.mark.parametrize("data", [GOOD, FORMAT_1_EARLY], ids=["format-2", "format-1-early"])
def test_every_readable_format_round_trips_to_the_same_json(tmp_path: Path, data: Dict[str, Any]) -> None:
    path = tmp_path / "index.json"
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    manifest = IndexManifest.read(path, READABLE_FORMATS)
    assert manifest.format_version == data["format_version"] and manifest.format_version in READABLE_FORMATS
    assert manifest.to_json() == data
    assert list(manifest.to_json()) == list(data)  # same keys, same order
    manifest.write(tmp_path / "copy.json")
    assert json.loads((tmp_path / "copy.json").read_text(encoding="utf-8")) == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.json", "index.json"]  # no temporary file left


def test_typed_fields(tmp_path: Path) -> None:
    manifest = IndexManifest.from_json(copy.deepcopy(GOOD), tmp_path / "index.json")
    assert manifest.bm25 == BM25Settings(k1=1.2, b=0.75, method="lucene", avgdl=50.5)
    assert manifest.pending == PendingWrite(generation=4, touched_ids=("a", "b"))
    assert manifest.integrity == GenerationRecord(generation=3, files={"docstore/gen-3.json": DIGEST}, chunks=7)
    assert manifest.integrity_record == GOOD["integrity"]
    assert IndexManifest.from_json(copy.deepcopy(FORMAT_1_EARLY), tmp_path / "index.json").integrity_record is None


def test_unknown_keys_are_kept(tmp_path: Path) -> None:
    data = with_value(with_value(GOOD, "future_key", {"nested": [1, None]}), "bm25.future", 3)
    assert IndexManifest.from_json(copy.deepcopy(data), tmp_path / "index.json").to_json() == data


def test_a_format_it_does_not_read_is_refused_with_the_versions_it_reads(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    for version in (0, 3, "2", True, None):
        with pytest.raises(ValueError, match=f"format_version {version!r}; this version reads 1 or 2"):
            IndexManifest.from_json(with_value(GOOD, "format_version", version), path)
    with pytest.raises(ValueError, match="format_version 1; this version reads 2"):
        IndexManifest.from_json(with_value(GOOD, "format_version", 1), path, FORMAT_VERSION)


@pytest.mark.parametrize(
    "key, value",
    [
        ("generation", True),
        ("generation", "1/../../../victim"),
        ("pending.generation", 5),
        ("pending.touched_ids", ["a", 3]),
        ("collection", "../../victim"),
        ("embed_dim", 0),
        ("embed_batch_size", 2.5),
        ("bm25.k1", "1.2"),
        ("bm25.k1", 10**400),  # an int JSON holds but no float does
        ("bm25.b", 1.5),
        ("bm25.avgdl", 0),
        ("qdrant_url", 5),
        ("node_parser.class_name", None),
        ("integrity.files", {"docstore/gen-3.json": "not a digest"}),
        ("integrity.chunks", -1),
    ],
)
def test_a_bad_value_is_the_validators_damaged_index_error(tmp_path: Path, key: str, value: Any) -> None:
    path = tmp_path / "index.json"
    data = with_value(GOOD, key, value)
    with pytest.raises(DamagedIndexError) as expected:
        storage.validate_manifest(copy.deepcopy(data), path, READABLE_FORMATS)
    with pytest.raises(DamagedIndexError) as got:
        IndexManifest.from_json(data, path)
    assert str(got.value) == str(expected.value)
    assert str(path) in str(got.value) and key in str(got.value).replace("'", "")
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DamagedIndexError) as read:
        IndexManifest.read(path)
    assert str(read.value) == str(expected.value)


def test_a_missing_key_and_invalid_json_are_named(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    with pytest.raises(DamagedIndexError, match="key 'pending.touched_ids' is missing"):
        IndexManifest.from_json(without(GOOD, "pending.touched_ids"), path)
    path.write_text('{"format_version": 2, "generation": ', encoding="utf-8")
    with pytest.raises(DamagedIndexError, match="index.json: is not valid JSON") as err:
        IndexManifest.read(path)
    assert err.value.path == path


KEY_PATHS = sorted(
    [k for k in GOOD]
    + [f"bm25.{k}" for k in GOOD["bm25"]]
    + [f"pending.{k}" for k in GOOD["pending"]]
    + [f"integrity.{k}" for k in GOOD["integrity"]]
    + ["node_parser.class_name"]
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SPECIAL = st.sampled_from([0, 1, 2, 3, 4, -1, 1.5, 10**18, 10**400, "chunks", "a/b", "", [], ["x"], {}, DIGEST, None, True])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEY_PATHS), value=JSON_VALUES | SPECIAL, drop=st.booleans())
def test_it_accepts_exactly_what_the_validator_accepts(tmp_path: Path, key: str, value: Any, drop: bool) -> None:
    """Differential: any one key changed (or removed) is read by IndexManifest exactly when
    validate_manifest accepts it, with the same error otherwise; what it reads it writes back."""
    data = without(GOOD, key) if drop else with_value(GOOD, key, value)
    path = tmp_path / "index.json"
    expected = outcome(lambda: storage.validate_manifest(copy.deepcopy(data), path, READABLE_FORMATS))
    got = outcome(lambda: IndexManifest.from_json(copy.deepcopy(data), path))
    assert got[0] == expected[0]
    if got[0] == "ok":
        assert same(got[1].to_json(), as_written(expected[1]))
        again = IndexManifest.from_json(got[1].to_json(), path)
        assert same(again.to_json(), got[1].to_json())
    else:
        assert got[1] == expected[1]


# ---------------------------------------------------------------------------------- updates


def test_updates_return_new_manifests_and_leave_the_old_one_alone(tmp_path: Path) -> None:
    original = IndexManifest.from_json(copy.deepcopy(FORMAT_1_EARLY), tmp_path / "index.json")
    before = original.to_json()
    pending = PendingWrite(generation=1, touched_ids=("x",))
    record = GenerationRecord(generation=7, files={"docstore/gen-7.json": DIGEST}, chunks=2)
    updated = (
        original.with_pending(pending)
        .with_embed_dim(8)
        .with_bm25_avgdl(12)
        .with_qdrant_url("http://q:6333")
        .with_format_version(FORMAT_VERSION)
    )
    assert original.to_json() == before
    assert (updated.pending, updated.embed_dim, updated.bm25.avgdl, updated.qdrant_url) == (pending, 8, 12.0, "http://q:6333")
    assert updated.format_version == FORMAT_VERSION and updated.bm25.k1 == original.bm25.k1
    committed = updated.committed(7, record)
    assert (committed.generation, committed.pending, committed.integrity) == (7, None, record)
    storage.validate_manifest(committed.to_json(), tmp_path / "index.json", FORMAT_VERSION)  # what it writes, it reads
    with pytest.raises(ValidationError):
        original.generation = 9  # frozen
    with pytest.raises(ValueError, match="a generation is an integer"):
        original.committed(-1, record)
    with pytest.raises(ValueError, match="format_version 3"):
        original.with_format_version(3)


def test_the_model_does_not_coerce(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="embed_batch_size"):
        IndexManifest(**{**GOOD, "embed_batch_size": "8"})
    with pytest.raises(ValidationError, match="k1"):
        BM25Settings(k1="1.2", b=0.75)


# ---------------------------------------------------------------------------------- journal


def nodes(*ids: str) -> Dict[str, TextNode]:
    return {i: TextNode(id_=i, text=f"text of {i}") for i in ids}


@given(touched=st.lists(st.sampled_from("abcdefgh"), max_size=10), committed=st.sets(st.sampled_from("abcdefgh")))
def test_split_touched_rewrites_committed_ids_and_drops_the_rest(touched: List[str], committed: set) -> None:
    keep, drop = split_touched(touched, nodes(*committed))
    assert [n.node_id for n in keep] == [i for i in touched if i in committed]
    assert drop == [i for i in touched if i not in committed]


def new_journal(folder: Path) -> WriteJournal:
    folder.mkdir(parents=True, exist_ok=True)
    manifest = IndexManifest(
        embed_model="m",
        embed_model_class="MockEmbedding",
        node_parser={"class_name": "SentenceSplitter"},
        bm25=BM25Settings(k1=1.2, b=0.75),
        bm25_tokenizer={},
    )
    return WriteJournal(folder, manifest)


def on_disk(journal: WriteJournal) -> Dict[str, Any]:
    return json.loads(journal.path.read_text(encoding="utf-8"))


def test_journal_commit_begin_commit(tmp_path: Path) -> None:
    journal = new_journal(tmp_path / "idx")
    bm25, docstore = BM25Retriever([]), SimpleDocumentStore()
    assert journal.commit(bm25, docstore) == 0  # no index.json yet: generation 0
    assert on_disk(journal)["generation"] == 0 and on_disk(journal)["pending"] is None
    assert storage.verify_generation(journal.storage_dir, 0, on_disk(journal)["integrity"], journal.path) is True

    first = journal.begin(["b", "a"])
    assert first == PendingWrite(generation=1, touched_ids=("a", "b"))
    assert on_disk(journal)["pending"] == {"generation": 1, "touched_ids": ["a", "b"]}
    grown = journal.begin(["c"])  # an unfinished record only grows until a commit
    assert grown.touched_ids == ("a", "b", "c") and on_disk(journal)["pending"]["touched_ids"] == ["a", "b", "c"]

    (tmp_path / "idx" / "bm25" / "gen-9").mkdir()  # left by a crash after a switch
    assert journal.commit(bm25, docstore) == 1
    disk = on_disk(journal)
    assert (disk["generation"], disk["pending"], disk["integrity"]["generation"]) == (1, None, 1)
    assert sorted(storage.generation_paths(journal.storage_dir)) == [1]
    assert IndexManifest.read(journal.path, FORMAT_VERSION) == journal.manifest == journal.read_disk()


def test_journal_roll_back_clears_the_record_and_the_unfinished_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal = new_journal(tmp_path / "idx")
    bm25, docstore = BM25Retriever([]), SimpleDocumentStore()
    journal.commit(bm25, docstore)
    pending = journal.begin(["a"])
    unfinished = storage.bm25_dir(journal.storage_dir, pending.generation)
    unfinished.mkdir(parents=True)
    storage.docstore_file(journal.storage_dir, pending.generation).write_text("{}")

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
        m.setattr(storage, "write_json_atomic", disk_full)
        journal.finish_roll_back(pending)  # the journal cannot be cleared on disk: a warning, not an error
    assert "could not clear the journal" in caplog.text
    assert journal.pending is None and on_disk(journal)["pending"] is not None
    assert not unfinished.exists() and not storage.docstore_file(journal.storage_dir, pending.generation).exists()
    journal.finish_roll_back(pending)  # again, with space: harmless, and the record goes
    assert on_disk(journal)["pending"] is None and on_disk(journal)["generation"] == 0


# ---------------------------------------------------------------------------------- HybridIndex


def test_index_config_is_the_manifest_on_disk_and_a_copy(tmp_path: Path) -> None:
    docs = [Document(id_=f"doc-{i}.txt", text=f"Section {i}. The annual fee is {i} dollars.") for i in range(3)]
    with HybridIndex.from_documents(docs, tmp_path / "idx", embed_model=MockEmbedding(embed_dim=8)) as index:
        on_file = json.loads((tmp_path / "idx" / "index.json").read_text(encoding="utf-8"))
        assert index.config == on_file == index.manifest.to_json()
        assert index.manifest.embed_dim == 8 and index.manifest.bm25.avgdl and math.isfinite(index.manifest.bm25.avgdl)
        assert set(on_file) == set(GOOD) | {"index_id", "build_id", "embed_settings"}  # the keys folders have always had, and the new ones
        assert on_file["embed_settings"] == {"embed_dim": 8}  # MockEmbedding's document-vector setting
        changed = index.config
        changed["generation"] = 99
        changed["bm25"]["k1"] = 0.0
        assert index.config == on_file  # a copy: the index is changed through its methods only
        index.delete("doc-0.txt")
        assert index.manifest.generation == on_file["generation"] + 1
        assert json.loads((tmp_path / "idx" / "index.json").read_text(encoding="utf-8")) == index.config
