"""A build or rebuild never touches the user's files in its storage folder (issue: data loss).

Only the index's own entries (``storage.INDEX_ENTRIES``) are ever moved aside or deleted; a folder
without an index whose entries an index would replace is refused before anything is embedded; a
rebuild of an index open for writing elsewhere is refused (IndexBusyError); an index open while its
folder was rebuilt turns read-only instead of writing over it; two builds at once cannot both
publish without ``overwrite``; a publish killed at any step leaves the old or the new index (the
next open finishes it) and the user's files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import Document
from pydantic import PrivateAttr

from llama_index_retrieval_kit.cli import EXIT_OK, main
from llama_index_retrieval_kit.indices import HybridIndex, IndexBusyError
from llama_index_retrieval_kit.indices import storage
from llama_index_retrieval_kit.indices.storage import IndexReadOnlyError

REPO = Path(__file__).resolve().parents[2]
DIM = 8


class WatchedEmbedding(MockEmbedding):
    """MockEmbedding counting the texts it embeds, with an optional hook run at its first call
    (private attributes: they do not change the embedding cache's model key)."""

    _calls: int = PrivateAttr(default=0)
    _on_first_call: Optional[Callable[[], None]] = PrivateAttr(default=None)

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        hook, self._on_first_call = self._on_first_call, None
        if hook is not None:
            hook()
        self._calls += len(texts)
        return super()._get_text_embeddings(texts)


def model(on_first_call: Optional[Callable[[], None]] = None) -> WatchedEmbedding:
    embed = WatchedEmbedding(embed_dim=DIM)
    embed._on_first_call = on_first_call
    return embed


def documents(prefix: str, n: int = 3) -> List[Document]:
    return [
        Document(id_=f"{prefix}{i}.md", text=f"# {prefix} {i}\n\nDocument {prefix}{i} says the annual fee is {i} dollars.")
        for i in range(n)
    ]


def user_files(folder: Path) -> Dict[str, str]:
    """The user's files planted in ``folder`` (relative path -> text)."""
    files = {"notes.txt": "my precious notes", "docs/fees.md": "# Fees\n\nThe annual fee is 95 dollars.\n", "docs/sub/a.md": "# Late fees\n\nA late payment costs 20 dollars.\n"}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return files


def assert_files(folder: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        assert (folder / name).read_text() == text, name


def siblings(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.parent.iterdir())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------- the layout


def test_every_entry_an_index_folder_holds_is_an_index_entry(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    with HybridIndex.from_documents(documents("d"), folder, embed_model=model()) as index:
        index.upsert(documents("e", 2))
        index.delete("d0.md")
        names = [p.name for p in folder.iterdir()]
    assert {"index.json", "edge", "bm25", "docstore", "embeddings.sqlite", ".write.lock"} <= set(names)
    assert all(storage.is_index_entry(name) for name in names), names
    assert not any(storage.is_index_entry(name) for name in ("docs", "notes.txt", "index.json.bak", "edge2", ".git"))


@settings(max_examples=25, deadline=None)
@given(st.sets(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=12), max_size=6))
def test_publish_into_moves_index_entries_only(names: set) -> None:
    """Whatever else the folder holds stays, byte for byte (the old index's entries are replaced)."""
    foreign = sorted(n for n in names if n not in (".", "..") and not storage.is_index_entry(n))
    with tempfile.TemporaryDirectory() as tmp:
        target, build = Path(tmp) / "idx", storage.building_dir(Path(tmp) / "idx")
        for folder, tag in ((target, "old"), (build, "new")):
            (folder / "docstore").mkdir(parents=True)
            (folder / "docstore" / "gen-0.json").write_text(tag)
            (folder / "embeddings.sqlite").write_text(tag)
            (folder / "index.json").write_text(tag)
        (target / "qdrant").mkdir()  # an entry of the old index only: replaced too
        for name in foreign:
            (target / name).write_text(f"user {name}")
        storage.publish_into(build, target, "a" * 32)
        assert sorted(p.name for p in target.iterdir()) == sorted(["docstore", "embeddings.sqlite", "index.json", *foreign])
        assert (target / "index.json").read_text() == (target / "docstore" / "gen-0.json").read_text() == "new"
        assert all((target / name).read_text() == f"user {name}" for name in foreign)
        assert not build.exists()


# ---------------------------------------------------------------------------------- 1. the user's files


def test_a_folder_whose_entries_an_index_would_replace_is_refused_before_any_embedding(tmp_path: Path) -> None:
    folder = tmp_path / "proj"
    folder.mkdir()
    files = user_files(folder)
    (folder / "docstore").mkdir()
    (folder / "docstore" / "mine.json").write_text("{}")
    (folder / "embeddings.sqlite").write_bytes(b"my own database")
    embed = model()
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds no index \(index.json\) but holds docstore/, embeddings.sqlite, which an index") as caught:
            HybridIndex.from_documents(documents("d"), folder, embed_model=embed, overwrite=overwrite)
        assert "move them out of the folder, or build the index in another storage_dir" in str(caught.value)
    assert embed._calls == 0
    assert_files(folder, {**files, "docstore/mine.json": "{}"})
    assert (folder / "embeddings.sqlite").read_bytes() == b"my own database"
    assert siblings(folder) == ["proj"]


def test_a_build_and_a_rebuild_keep_the_users_files_where_they_are(tmp_path: Path) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    files = user_files(folder)
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    assert_files(folder, files)
    with HybridIndex.from_documents(documents("e", 2), folder, embed_model=model(), overwrite=True) as index:
        assert index.doc_ids() == ["e0.md", "e1.md"]
    assert_files(folder, files)
    assert siblings(folder) == ["kb"]  # no build folder, nothing moved aside beside it
    with HybridIndex.load(folder, embed_model=model()) as index:
        assert index.doc_ids() == ["e0.md", "e1.md"]
        assert [r.node.ref_doc_id for r in index.as_retriever("hybrid", similarity_top_k=1).retrieve("annual fee")]


def test_rkit_index_rebuild_from_inside_the_folder_keeps_the_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cd kb; rkit index docs --storage .`` then ``--rebuild``: kb/docs/*.md are the documents indexed."""
    kb = tmp_path / "kb"
    kb.mkdir()
    files = user_files(kb)
    (kb / "TODO.txt").write_text("my own notes, not indexed")
    monkeypatch.chdir(kb)
    assert main(["-q", "index", "docs", "--storage", "."]) == EXIT_OK
    (kb / "docs" / "new.md").write_text("# New\n\nThe late fee is 20 dollars.\n")
    assert main(["-q", "index", "docs", "--storage", ".", "--rebuild"]) == EXIT_OK
    assert_files(kb, {**files, "TODO.txt": "my own notes, not indexed"})
    assert siblings(kb) == ["kb"]
    with HybridIndex.load(kb) as index:
        assert len(index.doc_ids()) == 3  # fees.md, sub/a.md and new.md


def test_an_old_versions_replaced_folder_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Earlier versions moved the whole folder (the user's files too) to .<name>.replaced: never deleted."""
    folder = tmp_path / "idx"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    leftover = storage.replaced_dir(folder)
    user_files(leftover)
    HybridIndex.from_documents(documents("e"), folder, embed_model=model(), overwrite=True).close()
    assert (leftover / "notes.txt").read_text() == "my precious notes"
    assert "may hold files of yours" in caplog.text


# ---------------------------------------------------------------------------------- embedding caches


def test_embedding_cache_seeds_a_build_and_is_never_changed(tmp_path: Path) -> None:
    first = tmp_path / "first"
    HybridIndex.from_documents(documents("d"), first, embed_model=model()).close()
    cache = first / "embeddings.sqlite"
    before = sha256(cache)
    embed = model()
    with HybridIndex.from_documents(documents("d"), tmp_path / "second", embed_model=embed, embedding_cache=cache) as index:
        assert len(index) > 0
    assert embed._calls == 0  # every vector came from the given cache
    assert sha256(cache) == before

    with pytest.raises(ValueError, match="is not a file"):
        HybridIndex.from_documents(documents("d"), tmp_path / "third", embed_model=model(), embedding_cache=tmp_path / "none.sqlite")
    with pytest.raises(TypeError, match="embedding_cache must be a path"):
        HybridIndex.from_documents(documents("d"), tmp_path / "third", embed_model=model(), embedding_cache=3)
    not_a_cache = tmp_path / "notes.sqlite"
    not_a_cache.write_bytes(b"not sqlite at all, but long enough to look like a header................")
    with pytest.raises(ValueError, match="notes.sqlite is not"):
        HybridIndex.from_documents(documents("d"), tmp_path / "third", embed_model=model(), embedding_cache=not_a_cache)
    assert not (tmp_path / "third" / "index.json").exists()


def test_a_rebuild_reuses_the_replaced_indexs_cache(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    embed = model()
    HybridIndex.from_documents(documents("d"), folder, embed_model=embed, overwrite=True).close()
    assert embed._calls == 0


# ---------------------------------------------------------------------------------- 2. open elsewhere

HOLDER = r"""
import sys
sys.path.insert(0, {repo!r})
from llama_index.core.embeddings import MockEmbedding
from llama_index_retrieval_kit.indices import HybridIndex
index = HybridIndex.load({path!r}, embed_model=MockEmbedding(embed_dim={dim}))
print("open", flush=True)
sys.stdin.readline()
index.close()
"""


def test_a_rebuild_is_refused_while_another_process_has_the_index_open(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(repo=str(REPO), path=str(folder), dim=DIM)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open", holder.stderr.read()
        embed = model()
        with pytest.raises(IndexBusyError, match="cannot rebuild the index in .*close it there .*then build again"):
            HybridIndex.from_documents(documents("e"), folder, embed_model=embed, overwrite=True)
        assert embed._calls == 0  # refused before any embedding
    finally:
        holder.communicate("done\n", timeout=60)
    assert holder.returncode == 0
    with HybridIndex.load(folder, embed_model=model()) as index:
        assert index.doc_ids() == ["d0.md", "d1.md", "d2.md"]
    with HybridIndex.from_documents(documents("e"), folder, embed_model=model(), overwrite=True) as index:  # closed: rebuilt
        assert index.doc_ids() == ["e0.md", "e1.md", "e2.md"]


def test_a_rebuild_finding_the_index_opened_during_its_build_is_refused_at_publish(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    opened: List[HybridIndex] = []
    embed = model(on_first_call=lambda: opened.append(HybridIndex.load(folder, embed_model=model())))
    with pytest.raises(IndexBusyError, match="cannot rebuild"):
        HybridIndex.from_documents(documents("e"), folder, embed_model=embed, overwrite=True)
    with opened[0] as worker:  # untouched: it still writes to its own index
        worker.delete("d0.md")
        assert worker.doc_ids() == ["d1.md", "d2.md"]
    with HybridIndex.load(folder, embed_model=model()) as index:
        assert index.doc_ids() == ["d1.md", "d2.md"]


def test_an_index_whose_folder_was_rebuilt_under_it_turns_read_only(tmp_path: Path) -> None:
    """The folder now holds another build (build_id differs): the open object writes nothing over it."""
    folder, other = tmp_path / "idx", tmp_path / "other"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    HybridIndex.from_documents(documents("e"), other, embed_model=model()).close()
    with HybridIndex.load(folder, embed_model=model()) as worker:
        shutil.copyfile(other / "index.json", folder / "index.json")  # another build's manifest, as a rebuild leaves it
        replaced = (folder / "index.json").read_bytes()
        for write in (lambda: worker.delete("d0.md"), lambda: worker.upsert(documents("x", 1)), worker.refresh):
            with pytest.raises(IndexReadOnlyError, match="was rebuilt since this object opened it.*HybridIndex.load to use the new index"):
                write()
        assert (folder / "index.json").read_bytes() == replaced
        assert [r.node.ref_doc_id for r in worker.as_retriever("sparse", similarity_top_k=1).retrieve("annual fee")]


def test_a_read_only_reader_learns_of_a_rebuild_on_refresh(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    with HybridIndex.load(folder, embed_model=model(), read_only=True) as reader:
        HybridIndex.from_documents(documents("e"), folder, embed_model=model(), overwrite=True).close()  # readers take no lock
        with pytest.raises(IndexReadOnlyError, match="was rebuilt since this object opened it"):
            reader.refresh()
    with HybridIndex.load(folder, embed_model=model(), read_only=True) as reader:
        assert reader.doc_ids() == ["e0.md", "e1.md", "e2.md"]


def test_folders_without_a_build_id_stay_writable(tmp_path: Path) -> None:
    """Folders built before build ids have none on disk and in memory alike."""
    folder = tmp_path / "idx"
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    manifest = json.loads((folder / "index.json").read_text())
    del manifest["build_id"]
    (folder / "index.json").write_text(json.dumps(manifest))
    with HybridIndex.load(folder, embed_model=model()) as index:
        assert index.manifest.build_id is None
        index.delete("d0.md")
    assert "build_id" not in json.loads((folder / "index.json").read_text())


# ---------------------------------------------------------------------------------- 3. two builds at once


def test_a_build_that_finds_an_index_published_meanwhile_does_not_replace_it(tmp_path: Path) -> None:
    """Both builds checked an empty folder; the later one re-checks at publish, under the folder's lock."""
    folder = tmp_path / "idx"
    folder.mkdir()
    files = user_files(folder)

    def publish_another_index() -> None:  # the other build finishes first
        HybridIndex.from_documents(documents("a"), tmp_path / "other", embed_model=model()).close()
        for entry in (tmp_path / "other").iterdir():
            os.rename(entry, folder / entry.name)

    with pytest.raises(ValueError, match="already holds an index; open it with HybridIndex.load.*overwrite=True"):
        HybridIndex.from_documents(documents("b"), folder, embed_model=model(on_first_call=publish_another_index))
    assert_files(folder, files)
    with HybridIndex.load(folder, embed_model=model()) as index:
        assert index.doc_ids() == ["a0.md", "a1.md", "a2.md"]


# ---------------------------------------------------------------------------------- crash safety

KILLED_PUBLISH = r"""
import os, sys
sys.path.insert(0, {repo!r})
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index_retrieval_kit.indices import HybridIndex, storage

renames = 0
real_rename, real_publish_into = os.rename, storage.publish_into
def counting_rename(src, dst):
    global renames
    renames += 1
    if renames == {kill_at}:
        os._exit(9)  # killed: no except handler, no finally
    real_rename(src, dst)
def publish_into(*args, **kwargs):
    os.rename = counting_rename
    return real_publish_into(*args, **kwargs)
storage.publish_into = publish_into
docs = [Document(id_=f"new{{i}}.md", text=f"# New {{i}}\n\nThe new fee is {{i}} dollars.") for i in range(3)]
HybridIndex.from_documents(docs, {path!r}, embed_model=MockEmbedding(embed_dim={dim}), overwrite=True).close()
"""
OLD_IDS = ["d0.md", "d1.md", "d2.md"]
NEW_IDS = ["new0.md", "new1.md", "new2.md"]


def killed_rebuild(folder: Path, kill_at: int) -> int:
    code = KILLED_PUBLISH.format(repo=str(REPO), path=str(folder), dim=DIM, kill_at=kill_at)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 9), proc.stderr
    return proc.returncode


@pytest.mark.parametrize("kill_at", [1, 3, 6, 8, 10, 99])
def test_a_rebuild_killed_at_any_step_of_its_publish_leaves_an_index_and_the_users_files(tmp_path: Path, kill_at: int) -> None:
    """Renames of a rebuild: 5 old entries out (index.json first), 4 new ones in, index.json last."""
    folder = tmp_path / "kb"
    folder.mkdir()
    files = user_files(folder)
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    code = killed_rebuild(folder, kill_at)
    assert code == (0 if kill_at == 99 else 9)
    assert (folder / "index.json").exists() == (kill_at in (1, 99))  # killed half-way: neither index in place
    assert_files(folder, files)
    with HybridIndex.load(folder, embed_model=model()) as index:  # finishes an interrupted publish
        assert index.doc_ids() == (OLD_IDS if kill_at == 1 else NEW_IDS)
        assert len(index.as_retriever("hybrid", similarity_top_k=2).retrieve("fee")) == 2
    if kill_at == 1:  # killed before the first move: the old index, and the unpublished build beside it
        assert siblings(folder) == [".kb.building", "kb"]
    else:  # the new index, the publish finished by the load
        assert siblings(folder) == ["kb"] and not (folder / storage.PUBLISH_MARKER).exists()


def test_the_leftovers_of_a_killed_publish_are_replaced_by_the_next_build(tmp_path: Path) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    files = user_files(folder)
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    assert killed_rebuild(folder, 7) == 9  # the old index moved out, one new entry in
    assert not (folder / "index.json").exists() and (folder / storage.PUBLISH_MARKER).exists()
    assert storage.clashing_entries(folder) == []  # recognised as ours
    with pytest.raises(ValueError, match="holds no index.json"):
        HybridIndex.load(folder, embed_model=model(), read_only=True)  # a reader never writes, so never finishes it
    embed = model()
    with HybridIndex.from_documents(documents("e"), folder, embed_model=embed) as index:
        assert index.doc_ids() == ["e0.md", "e1.md", "e2.md"]
    assert_files(folder, files)
    assert siblings(folder) == ["kb"] and not (folder / storage.PUBLISH_MARKER).exists()


def test_a_failed_publish_step_puts_the_old_index_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    files = user_files(folder)
    HybridIndex.from_documents(documents("d"), folder, embed_model=model()).close()
    real_rename, calls = os.rename, []

    def failing_rename(src, dst):
        calls.append(src)
        if len(calls) == 7:
            raise OSError("disk on fire")
        real_rename(src, dst)

    real_publish_into = storage.publish_into

    def publish_into(*args, **kwargs):
        monkeypatch.setattr(os, "rename", failing_rename)
        try:
            return real_publish_into(*args, **kwargs)
        finally:
            monkeypatch.setattr(os, "rename", real_rename)

    monkeypatch.setattr(storage, "publish_into", publish_into)
    with pytest.raises(OSError, match="disk on fire"):
        HybridIndex.from_documents(documents("e"), folder, embed_model=model(), overwrite=True)
    assert_files(folder, files)
    assert not (folder / storage.PUBLISH_MARKER).exists()
    with HybridIndex.load(folder, embed_model=model()) as index:
        assert index.doc_ids() == OLD_IDS
