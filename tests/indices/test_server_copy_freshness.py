"""A server copy of an embedded folder (``push_to``) is served only while it is a copy of the state
the folder has committed.

``push_to`` records the folder's committed state (build, generation, checksums digest) in the
collection's metadata; ``HybridIndex.load(dir, qdrant_url=)`` (writable or ``read_only=True``)
refuses a copy of another state with :class:`StaleServerCopyError` saying to push again, so a
deleted or redacted document is never served from a copy made before the change. Pushed again, the
copy serves the folder's chunks in every mode. A folder moved to the server for good
(``switch=True``) is the index itself and is unaffected. qdrant-client's local mode stands in for
the server (``_support.share_server``); the packaged embedding model ranks, so the deleted
document's marker word would be its own best match.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, List

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llama_index.core import Document
from qdrant_client import QdrantClient

from llama_index_retrieval_kit import SectionWindowNodeParser
from llama_index_retrieval_kit.indices import RETRIEVER_MODES, DamagedIndexError, HybridIndex, StaleServerCopyError
from llama_index_retrieval_kit.indices import store as store_module
from llama_index_retrieval_kit.indices.manifest import FolderState
from llama_index_retrieval_kit.indices.store import metadata_folder_state, metadata_owner, owner_metadata

from . import _support

URL = "http://qdrant.example:6333"
GONE = "acme_contract.txt"  # deleted, or redacted, after the first push
MARKER = "zorblattine"  # only GONE holds it
FILLER = (
    "The customer agrees to the payment schedule described here and the supplier agrees to deliver the goods "
    "on time. Late delivery gives the customer the right to a refund of the fees paid. "
)
QUERY = f"What does the {MARKER} clause say?"
ALL_CHUNKS = 200  # more than the index holds: every mode returns everything it can


def section(n: int, title: str, word: str) -> str:
    body = " ".join(f"The {word} clause applies {word} to every order. {FILLER}" for _ in range(3))
    return f"{n}. {title}\n\n{body}\n\n"


def contract(text_of_marker: str = MARKER) -> Document:
    text = section(1, "Terms", text_of_marker) + section(2, "Delivery", "quexotrium")
    return Document(text=text, id_=GONE, metadata={"tenant": "acme"})


def other_documents() -> List[Document]:
    return [
        Document(text=section(1, "Scope", "sunpetrelix") + section(2, "Pricing", "kelpvortexa"), id_="beta_terms.txt"),
        Document(text=section(1, "General", "harborlimeo"), id_="gamma_policy.txt"),
    ]


@pytest.fixture()
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[QdrantClient]:
    client = _support.share_server(monkeypatch, QdrantClient(path=str(tmp_path / "server")))
    yield client
    client.close()


@pytest.fixture()
def folder(tmp_path: Path, embed_model, server: QdrantClient) -> Path:
    """An embedded index of the three documents, pushed to the server, closed."""
    path = tmp_path / "index"
    with HybridIndex.from_documents(
        [contract(), *other_documents()], path, embed_model=embed_model, node_parser=SectionWindowNodeParser(chunk_size=60, chunk_overlap=10)
    ) as index:
        assert index.push_to(URL) == len(index) > 6
    return path


def served_texts(index: HybridIndex) -> dict:
    """Each mode's results for the marker query: (document id, text) pairs."""
    out = {}
    for mode in RETRIEVER_MODES:
        results = index.as_retriever(mode, similarity_top_k=ALL_CHUNKS).retrieve(QUERY)
        assert results, mode
        out[mode] = [(r.node.ref_doc_id, r.node.get_content()) for r in results]
    return out


def assert_refused(folder: Path, embed_model, read_only: bool, match: str) -> StaleServerCopyError:
    with pytest.raises(StaleServerCopyError, match=match) as caught:
        HybridIndex.load(folder, embed_model=embed_model, qdrant_url=URL, read_only=read_only)
    message = str(caught.value)
    assert "\n" not in message and f"index.push_to({URL!r})" in message and f"--push {URL}" in message
    assert "rebuild" not in message and not isinstance(caught.value, DamagedIndexError)
    return caught.value


def push_again(folder: Path, embed_model) -> None:
    with HybridIndex.load(folder, embed_model=embed_model) as index:
        assert index.push_to(URL) == len(index)


# ------------------------------------------------------------------------------------ delete, redaction
@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read_only"])
def test_a_copy_pushed_before_a_delete_is_refused_until_pushed_again(folder: Path, embed_model, read_only: bool) -> None:
    with HybridIndex.load(folder, embed_model=embed_model, qdrant_url=URL, read_only=read_only) as served:  # current: served
        assert any(doc == GONE for doc, _ in served_texts(served)["dense"])
    with HybridIndex.load(folder, embed_model=embed_model) as index:
        index.delete(GONE)
        remaining = len(index)
    error = assert_refused(folder, embed_model, read_only, r"is a copy of the folder at generation \d+ .* but the folder has committed generation")
    assert error.url == URL and error.storage_dir == folder
    push_again(folder, embed_model)
    with HybridIndex.load(folder, embed_model=embed_model, qdrant_url=URL, read_only=read_only) as served:
        assert served.store.kind == "server" and len(served) == remaining and GONE not in served.doc_ids()
        for mode, results in served_texts(served).items():
            assert all(doc != GONE and MARKER not in text for doc, text in results), mode


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read_only"])
def test_a_redaction_keeping_the_chunk_count_is_refused_too(folder: Path, embed_model, read_only: bool) -> None:
    redacted = "[redacted]."
    assert len(redacted) == len(MARKER)
    with HybridIndex.load(folder, embed_model=embed_model) as index:
        before = len(index)
        index.upsert([contract(redacted)])
        assert len(index) == before  # the point count alone cannot tell
    assert_refused(folder, embed_model, read_only, "but the folder has committed")
    push_again(folder, embed_model)
    with HybridIndex.load(folder, embed_model=embed_model, qdrant_url=URL, read_only=read_only) as served:
        results = served_texts(served)
        assert any(doc == GONE for doc, _ in results["dense"])  # the document is served, redacted
        for mode, hits in results.items():
            assert all(MARKER not in text for _, text in hits), mode


def test_a_worker_keeps_its_generation_until_the_copy_is_pushed_again(folder: Path, embed_model, caplog: pytest.LogCaptureFixture) -> None:
    with HybridIndex.load(folder, embed_model=embed_model, qdrant_url=URL, read_only=True) as worker:
        with HybridIndex.load(folder, embed_model=embed_model) as writer:  # the worker holds no shard: both open
            writer.delete(GONE)
            with caplog.at_level(logging.WARNING, logger="llama_index_retrieval_kit.indices.hybrid_index"):
                assert worker.refresh() is False and worker.refresh() is False
            warnings = [r.getMessage() for r in caplog.records if "still serving generation" in r.getMessage()]
            assert len(warnings) == 1 and f"push_to({URL!r})" in warnings[0]  # once per generation
            assert GONE in worker.doc_ids()  # the copy's generation: BM25 and the copy agree
            writer.push_to(URL)
        assert worker.refresh() is True and GONE not in worker.doc_ids()
        for mode, results in served_texts(worker).items():
            assert all(doc != GONE and MARKER not in text for doc, text in results), mode


# ------------------------------------------------------------------------------------ other stale copies
def test_a_copy_without_a_recorded_state_is_refused(folder: Path, embed_model, monkeypatch: pytest.MonkeyPatch, server: QdrantClient) -> None:
    """A copy pushed by an earlier version (metadata: the index id only) cannot be shown to be current."""
    monkeypatch.setattr(store_module, "owner_metadata", lambda index_id, folder_state=None: {store_module.OWNER_METADATA_KEY: {"index_id": index_id}})
    push_again(folder, embed_model)
    metadata = server.get_collection("chunks").config.metadata
    assert metadata_owner(metadata) is not None and metadata_folder_state(metadata) is None
    for read_only in (False, True):
        assert_refused(folder, embed_model, read_only, "records no state of the folder it copies")


def test_a_copy_changed_on_the_server_or_never_pushed_is_refused(tmp_path: Path, folder: Path, embed_model, server: QdrantClient) -> None:
    from qdrant_client import models

    first = server.scroll("chunks", limit=1)[0][0].id
    server.delete("chunks", points_selector=models.PointIdsList(points=[first]))
    assert_refused(folder, embed_model, False, r"holds \d+ point\(s\) but the folder \d+ chunk\(s\) \(changed on the server")
    with HybridIndex.from_documents(other_documents(), tmp_path / "unpushed", embed_model=embed_model, collection="unpushed") as index:
        index_dir = index.storage_dir
    assert_refused(index_dir, embed_model, True, r"'unpushed' at .* does not exist \(nothing was pushed there")


def test_a_folder_switched_to_the_server_is_the_index_and_unaffected(folder: Path, embed_model, server: QdrantClient) -> None:
    with HybridIndex.load(folder, embed_model=embed_model) as index:
        index.push_to(URL, switch=True)
        assert metadata_folder_state(server.get_collection(index.manifest.collection).config.metadata) is None
        index.delete(GONE)  # written to the server: nothing to push
    for read_only in (False, True):
        for where in ({}, {"qdrant_url": URL}):
            with HybridIndex.load(folder, embed_model=embed_model, read_only=read_only, **where) as served:
                assert served.store.kind == "server" and GONE not in served.doc_ids()
                for mode, results in served_texts(served).items():
                    assert all(doc != GONE and MARKER not in text for doc, text in results), mode


# ------------------------------------------------------------------------------------ the record (pure)
states = st.builds(
    FolderState,
    build_id=st.none() | st.text("0123456789abcdef", min_size=32, max_size=32),
    generation=st.integers(min_value=0, max_value=2**40),
    digest=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
)


@given(states, st.text("0123456789abcdef", min_size=32, max_size=32))
def test_the_recorded_state_round_trips_through_collection_metadata(state: FolderState, index_id: str) -> None:
    metadata = owner_metadata(index_id, state.to_json())
    assert metadata_owner(metadata) == index_id
    assert FolderState.from_json(metadata_folder_state(metadata)) == state
    assert metadata_folder_state(owner_metadata(index_id)) is None


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers()), st.dictionaries(st.text(), st.integers() | st.text())))
def test_anything_else_is_no_recorded_state(data) -> None:
    if isinstance(data, dict) and "generation" in data:
        data.pop("generation")  # a real record always has one
    assert FolderState.from_json(data) is None


def test_the_state_changes_with_every_commit_and_rebuild(tmp_path: Path, embed_model) -> None:
    path = tmp_path / "index"
    with HybridIndex.from_documents(other_documents(), path, embed_model=embed_model) as index:
        built = index.manifest.folder_state
        assert built.generation == index.manifest.generation and built.digest is not None
        index.upsert([contract()])
        assert index.manifest.folder_state != built and index.manifest.folder_state.build_id == built.build_id
    with HybridIndex.from_documents(other_documents(), path, embed_model=embed_model, overwrite=True) as rebuilt:
        assert rebuilt.manifest.folder_state.build_id != built.build_id and rebuilt.manifest.folder_state != built
