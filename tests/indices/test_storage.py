"""storage.py: manifest validation, generation paths, checksums, durable JSON writes, locks and
publishing a built folder. Pure file-system tests: no index, no model."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest

from llama_index_retrieval_kit import _files
from llama_index_retrieval_kit.indices import storage
from llama_index_retrieval_kit.indices.storage import DamagedIndexError

GOOD = {
    "format_version": 1,
    "embed_model": "sentence-transformers/all-MiniLM-L6-v2",
    "embed_model_class": "HuggingFaceEmbedding",
    "embed_dim": 384,
    "node_parser": {"class_name": "SectionWindowNodeParser"},
    "bm25": {"k1": 1.2, "b": 0.75, "method": "lucene", "avgdl": 50.5},
    "bm25_tokenizer": {"pattern": "x"},
    "qdrant_url": None,
    "collection": "chunks",
    "embed_batch_size": 256,
    "generation": 3,
    "pending": {"generation": 4, "touched_ids": ["a", "b"]},
    "integrity": {"generation": 3, "files": {"docstore/gen-3.json": "0" * 64}, "chunks": 7},
}


def with_value(key_path: str, value):
    data = copy.deepcopy(GOOD)
    *parents, last = key_path.split(".")
    target = data
    for key in parents:
        target = target[key]
    target[last] = value
    return data


def without(key_path: str):
    data = copy.deepcopy(GOOD)
    *parents, last = key_path.split(".")
    target = data
    for key in parents:
        target = target[key]
    del target[last]
    return data


def test_a_good_manifest_passes_unchanged(tmp_path: Path) -> None:
    assert storage.validate_manifest(copy.deepcopy(GOOD), tmp_path / "index.json", 1) == GOOD
    for key, value in [("pending", None), ("embed_dim", None), ("bm25.avgdl", None), ("qdrant_url", "http://q:6333")]:
        storage.validate_manifest(with_value(key, value), tmp_path / "index.json", 1)
    storage.validate_manifest(without("integrity"), tmp_path / "index.json", 1)  # written before checksums
    storage.validate_manifest(without("embed_model_class"), tmp_path / "index.json", 1)


@pytest.mark.parametrize(
    "key, value",
    [
        ("generation", True),  # a bool is not a generation
        ("generation", -1),
        ("generation", "1"),
        ("generation", 1.0),
        ("generation", "1/../../../victim"),
        ("pending.generation", "4/../../../victim"),
        ("pending.generation", 5),  # must be the committed generation + 1
        ("pending.generation", True),
        ("pending", ["a"]),
        ("pending.touched_ids", "abc"),
        ("pending.touched_ids", ["a", 3]),
        ("collection", "../../victim"),
        ("collection", "a/b"),
        ("collection", ""),
        ("collection", 5),
        ("embed_dim", 0),
        ("embed_dim", True),
        ("embed_batch_size", 0),
        ("embed_batch_size", 2.5),
        ("bm25.k1", "1.2"),
        ("bm25.k1", float("nan")),
        ("bm25.b", 1.5),
        ("bm25.avgdl", 0),
        ("bm25", None),
        ("qdrant_url", 5),
        ("embed_model", ""),
        ("node_parser", "SectionWindowNodeParser"),
        ("node_parser.class_name", None),
        ("bm25_tokenizer", []),
        ("integrity.generation", 2),
        ("integrity.files", {"docstore/gen-3.json": "not a digest"}),
        ("integrity.chunks", -1),
    ],
)
def test_a_bad_value_names_the_file_the_key_and_the_value(tmp_path: Path, key: str, value) -> None:
    path = tmp_path / "index.json"
    with pytest.raises(DamagedIndexError) as err:
        storage.validate_manifest(with_value(key, value), path, 1)
    message = str(err.value)
    assert str(path) in message
    assert f"key {key}" in message.replace("'", "").replace('"', "")
    shown = list(value.values())[0] if key == "integrity.files" else value  # the bad digest itself
    assert repr(shown)[:40] in message
    assert "rkit index" in message and "overwrite=True" in message  # the repair
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("key", ["generation", "embed_model", "bm25", "collection", "pending", "bm25.k1", "pending.touched_ids"])
def test_a_missing_key_is_named(tmp_path: Path, key: str) -> None:
    with pytest.raises(DamagedIndexError, match=f"key {key!r} is missing"):
        storage.validate_manifest(without(key), tmp_path / "index.json", 1)


def test_format_version_and_top_level_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format_version 2; this version reads 1"):
        storage.validate_manifest(with_value("format_version", 2), tmp_path / "index.json", 1)
    with pytest.raises(ValueError, match="format_version True"):
        storage.validate_manifest(with_value("format_version", True), tmp_path / "index.json", 1)
    with pytest.raises(DamagedIndexError, match="not a JSON object"):
        storage.validate_manifest([GOOD], tmp_path / "index.json", 1)


def test_read_manifest_reports_invalid_json_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    path.write_text('{"format_version": 1, "generation": ', encoding="utf-8")
    with pytest.raises(DamagedIndexError, match=r"index.json: is not valid JSON") as err:
        storage.read_manifest(path, 1)
    assert err.value.path == path
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DamagedIndexError, match="is not valid JSON"):
        storage.read_manifest(path, 1)


def test_generation_paths_only_from_generation_numbers(tmp_path: Path) -> None:
    assert storage.bm25_dir(tmp_path, 2) == tmp_path / "bm25" / "gen-2"
    assert storage.docstore_file(tmp_path, 0) == tmp_path / "docstore" / "gen-0.json"
    for bad in ("1/../../x", True, -1, 1.0, None):
        with pytest.raises(ValueError):
            storage.bm25_dir(tmp_path, bad)
        with pytest.raises(ValueError):
            storage.docstore_file(tmp_path, bad)


def test_generation_paths_are_found_by_listing(tmp_path: Path) -> None:
    (tmp_path / "bm25" / "gen-1").mkdir(parents=True)
    (tmp_path / "bm25" / "gen-7").mkdir()
    (tmp_path / "bm25" / "gen-x").mkdir()
    (tmp_path / "bm25" / "gen-01").mkdir()
    (tmp_path / "docstore").mkdir()
    (tmp_path / "docstore" / "gen-1.json").write_text("{}")
    (tmp_path / "docstore" / "notes.json").write_text("{}")
    found = storage.generation_paths(tmp_path)
    assert sorted(found) == [1, 7]
    assert sorted(p.name for p in found[1]) == ["gen-1", "gen-1.json"]


def write_generation(root: Path, gen: int) -> None:
    folder = storage.bm25_dir(root, gen)
    (folder / "bm25s").mkdir(parents=True)
    (folder / "nodes.json").write_text("[1, 2, 3]")
    (folder / "bm25s" / "scores.npy").write_bytes(bytes(range(256)))
    storage.docstore_file(root, gen).parent.mkdir(parents=True, exist_ok=True)
    storage.docstore_file(root, gen).write_text('{"docstore/data": {}}')


def test_generation_record_and_verify(tmp_path: Path) -> None:
    write_generation(tmp_path, 2)
    record = storage.generation_record(tmp_path, 2, chunks=3)
    assert sorted(record["files"]) == ["bm25/gen-2/bm25s/scores.npy", "bm25/gen-2/nodes.json", "docstore/gen-2.json"]
    manifest = tmp_path / "index.json"
    config = with_value("integrity", record)
    config["generation"], config["pending"] = 2, None
    storage.validate_manifest(config, manifest, 1)  # what _commit writes passes validation
    assert storage.verify_generation(tmp_path, 2, record, manifest) is True
    assert storage.verify_generation(tmp_path, 2, None, manifest) is False  # old folder: unverified

    scores = tmp_path / "bm25" / "gen-2" / "bm25s" / "scores.npy"
    data = bytearray(scores.read_bytes())
    data[10], data[20] = data[20], data[10]  # scrambled, same size
    scores.write_bytes(bytes(data))
    with pytest.raises(DamagedIndexError, match="sha256 differs") as err:
        storage.verify_generation(tmp_path, 2, record, manifest)
    assert err.value.path == scores
    scores.unlink()
    with pytest.raises(DamagedIndexError, match="scores.npy: is missing"):
        storage.verify_generation(tmp_path, 2, record, manifest)
    storage.docstore_file(tmp_path, 2).unlink()
    with pytest.raises(DamagedIndexError, match=r"gen-2.json: is missing \(generation 2"):
        storage.verify_generation(tmp_path, 2, None, manifest)


def test_recorded_names_are_never_opened(tmp_path: Path) -> None:
    """A crafted record naming a file outside the folder is a mismatch, not a read of that file."""
    write_generation(tmp_path, 0)
    outside = tmp_path.parent / "secret.txt"
    outside.write_text("secret")
    record = storage.generation_record(tmp_path, 0, chunks=1)
    record["files"]["../secret.txt"] = storage.sha256_file(outside)
    with pytest.raises(DamagedIndexError, match="secret.txt: is missing"):
        storage.verify_generation(tmp_path, 0, record, tmp_path / "index.json")


def test_write_json_atomic_replaces_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "index.json"
    storage.write_json_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    synced = []
    monkeypatch.setattr(storage, "fsync_dir", lambda p: synced.append(Path(p)))
    storage.write_json_atomic(path, {"a": 2})
    assert synced == [tmp_path]  # the rename is made durable

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        storage.write_json_atomic(path, {"a": 3})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]  # no temporary file left


def test_fsync_tree_syncs_every_file_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_generation(tmp_path, 1)
    files, dirs = [], []
    monkeypatch.setattr(_files, "fsync_file", lambda p: files.append(Path(p)))  # the durable-write module owns them
    monkeypatch.setattr(_files, "fsync_dir", lambda p: dirs.append(Path(p)))
    storage.fsync_tree(storage.bm25_dir(tmp_path, 1))
    gen = tmp_path / "bm25" / "gen-1"
    assert sorted(files) == sorted([gen / "nodes.json", gen / "bm25s" / "scores.npy"])
    assert dirs == [gen / "bm25s", gen, tmp_path / "bm25"]


def test_file_lock_excludes_a_second_holder(tmp_path: Path) -> None:
    first, second = storage.FileLock(tmp_path / ".write.lock"), storage.FileLock(tmp_path / ".write.lock")
    first.acquire(0)
    with pytest.raises(storage.IndexWriteLockedError, match=r"writing to .* holds .*\.write\.lock"):
        second.acquire(0.1)
    first.release()
    second.acquire(0)
    second.release()


def test_write_guard_is_reentrant_and_serialises_threads(tmp_path: Path) -> None:
    guard = storage.WriteGuard(tmp_path / ".write.lock", timeout=0)
    events: list = []

    def other() -> None:
        with guard.hold():
            events.append("other")

    with guard.hold():
        with guard.hold():  # re-entrant: no second flock on the same file
            thread = threading.Thread(target=other)
            thread.start()
            thread.join(0.2)
            assert thread.is_alive()  # waits for this thread's write
            events.append("mine")
    thread.join(5)
    assert events == ["mine", "other"]
    with pytest.raises(storage.IndexWriteLockedError):  # another process (or handle) holds the file
        lock = storage.FileLock(tmp_path / ".write.lock")
        lock.acquire(0)
        try:
            with guard.hold():
                pass
        finally:
            lock.release()


def test_refusing_lock_raises_its_error() -> None:
    error = RuntimeError("read-only")
    lock = storage.RefusingLock(error)
    with pytest.raises(RuntimeError, match="read-only"):
        with lock.read():
            pass
    with pytest.raises(RuntimeError, match="read-only"):
        with lock.write():
            pass


def make_build(root: Path, marker: str) -> Path:
    build = storage.building_dir(root / "idx")
    build.mkdir(parents=True)
    (build / "qdrant").mkdir()
    (build / "qdrant" / "data").write_text(marker)
    (build / "index.json").write_text(marker)
    (build / storage.WRITE_LOCK).write_text("")
    return build


def test_publish_folder_new_replacing_and_into_a_non_index_folder(tmp_path: Path) -> None:
    target = tmp_path / "idx"
    assert storage.publish_new_folder(make_build(tmp_path, "one"), target)
    assert (target / "index.json").read_text() == "one" and not storage.building_dir(target).exists()

    build = make_build(tmp_path, "two")
    assert not storage.publish_new_folder(build, target)  # it exists: nothing done
    (target / "mine.txt").write_text("keep me")
    storage.publish_into(build, target, "b" * 32)  # replaces the index's entries only
    assert (target / "index.json").read_text() == "two" and (target / "qdrant" / "data").read_text() == "two"
    assert (target / "mine.txt").read_text() == "keep me"
    assert not build.exists() and not (target / storage.PUBLISH_MARKER).exists()

    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    build = storage.building_dir(other)
    build.mkdir()
    (build / "qdrant").mkdir()
    (build / "qdrant" / "data").write_text("three")
    (build / "index.json").write_text("three")
    storage.publish_into(build, other, "c" * 32)
    assert (other / "mine.txt").read_text() == "keep me" and (other / "index.json").read_text() == "three"
    assert (other / "qdrant" / "data").read_text() == "three" and not build.exists()


def test_clear_build_folder_keeps_the_cache_and_the_lock(tmp_path: Path) -> None:
    build = tmp_path / ".idx.building"
    build.mkdir()
    for name in ("embeddings.sqlite", "embeddings.sqlite-journal", storage.WRITE_LOCK, "index.json"):
        (build / name).write_text("x")
    (build / "qdrant").mkdir()
    assert storage.clear_build_folder(build, keep_prefix="embeddings.sqlite") is True
    assert sorted(p.name for p in build.iterdir()) == [".write.lock", "embeddings.sqlite", "embeddings.sqlite-journal"]
    (build / "embeddings.sqlite").unlink()
    assert storage.clear_build_folder(build, keep_prefix="embeddings.sqlite") is False
