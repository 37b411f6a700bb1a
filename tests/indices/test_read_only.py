"""``HybridIndex.load(read_only=True)``: one writer, many readers of one folder. A reader takes
nothing (no shard, no lock), writes nothing, answers every in-memory mode exactly as the writer
does, refuses writes and engine-side search with a clear error, and follows the writer's commits
with ``refresh()``."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Tuple

import pytest
from llama_index.core import Document

from llama_index_retrieval_kit.indices import HybridIndex, IndexReadOnlyError
from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module

from . import _support

IN_MEMORY_MODES = ("hybrid", "hybrid_score", "hybrid_rrf", "dense", "sparse")


def tree_state(folder: Path) -> Dict[str, Tuple[int, int, str]]:
    """Every file under ``folder``: size, mtime (ns) and sha256."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_reader_beside_the_open_writer_gives_the_writers_answers(index: HybridIndex, index_dir: Path, embed_model, bundles) -> None:
    with HybridIndex.load(index_dir, embed_model=embed_model, read_only=True) as reader:  # the writer holds the shard
        assert len(reader) == len(index) and reader.doc_ids() == index.doc_ids()
        got = _support.run_modes(reader, bundles[:6], modes=IN_MEMORY_MODES)
        want = _support.run_modes(index, bundles[:6], modes=IN_MEMORY_MODES)
        _support.assert_same_results(got, want)
    assert index.as_retriever("qdrant_hybrid").retrieve(bundles[0])  # the writer is unaffected


def test_a_reader_refuses_writes_and_engine_side_search(index_dir: Path, embed_model, bundles) -> None:
    with HybridIndex.load(index_dir, embed_model=embed_model, read_only=True) as reader:
        writes = {
            "upsert": lambda: reader.upsert([Document(id_="new.md", text="A new clause.")]),
            "delete": lambda: reader.delete(_support.CHANGED_DOC),
            "optimize": reader.optimize,
            "push_to": lambda: reader.push_to("http://localhost:6333"),
        }
        for name, write in writes.items():
            with pytest.raises(IndexReadOnlyError, match=r"opened with read_only=True.*without read_only=True in the one process that writes"):
                write()
        for mode, options in (("qdrant_hybrid", {}), ("dense", {"dense_search": "qdrant"})):
            with pytest.raises(IndexReadOnlyError, match="read_only=True"):
                reader.as_retriever(mode, **options).retrieve(bundles[0])
        assert reader.as_retriever("hybrid").retrieve(bundles[0])  # still serving
    with pytest.raises(TypeError, match="read_only must be True or False, got 'yes'"):
        HybridIndex.load(index_dir, embed_model=embed_model, read_only="yes")  # type: ignore[arg-type]


def test_a_reader_writes_nothing(index_dir: Path, embed_model, bundles) -> None:
    before = tree_state(index_dir)
    with HybridIndex.load(index_dir, embed_model=embed_model, read_only=True) as reader:
        for mode in IN_MEMORY_MODES:
            reader.as_retriever(mode).retrieve(bundles[1])
        assert reader.refresh() is False
    assert tree_state(index_dir) == before


def test_refresh_follows_the_writers_commits(index: HybridIndex, index_dir: Path, embed_model, bundles) -> None:
    reader = HybridIndex.load(index_dir, embed_model=embed_model, read_only=True)
    try:
        sparse = reader.as_retriever("sparse", similarity_top_k=50)  # made before: sees the refresh too
        index.upsert([_support.changed_document()])
        index.upsert([Document(id_="appendix.md", text="Appendix: the zebra clause covers striped payment cards.")])
        # The reader keeps serving the generation it read, though the writer deleted its files.
        assert "appendix.md" not in reader.doc_ids()
        assert not [n for n in sparse.retrieve("zebra striped") if n.node.ref_doc_id == "appendix.md"]
        assert reader.refresh() is True and reader.refresh() is False
        assert reader.doc_ids() == index.doc_ids()
        assert sparse.retrieve("zebra striped")[0].node.ref_doc_id == "appendix.md"
        got = _support.run_modes(reader, bundles[:4], modes=IN_MEMORY_MODES)
        want = _support.run_modes(index, bundles[:4], modes=IN_MEMORY_MODES)
        _support.assert_same_results(got, want)
    finally:
        reader.close()


def test_a_generation_replaced_while_it_is_read_is_followed(index: HybridIndex, index_dir: Path, embed_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer commits (and deletes the generation the reader's index.json named) between the
    reader's check of the files and its read of them: the reader reads index.json again."""
    real = hybrid_index_module.read_generation
    calls = []

    def racing(storage, generation, custom_tokenizer=None, **options):
        calls.append(generation)
        if len(calls) == 1:
            index.upsert([Document(id_="race.md", text="Committed while the reader was reading.")])
        return real(storage, generation, custom_tokenizer, **options)

    monkeypatch.setattr(hybrid_index_module, "read_generation", racing)
    with HybridIndex.load(index_dir, embed_model=embed_model, read_only=True) as reader:
        assert calls == [calls[0], calls[0] + 1]  # the first generation's files went; the next one was read
        assert "race.md" in reader.doc_ids() and reader.doc_ids() == index.doc_ids()


def test_the_cli_answers_read_only_beside_an_open_writer(index: HybridIndex, index_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from llama_index_retrieval_kit.cli import EXIT_OK, main

    assert main(["-q", "query", "How much is the late payment fee?", "--storage", str(index_dir), "-k", "3"]) == EXIT_OK
    captured = capsys.readouterr()
    assert "open in another process: answering from its last committed state (read-only)" in captured.err
    assert "late" in captured.out.lower()


WRITER = r"""
import sys
sys.path.insert(0, {repo!r})
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index_retrieval_kit.indices import HybridIndex
with HybridIndex.load({path!r}, embed_model=MockEmbedding(embed_dim=16)) as index:
    print("open", flush=True)
    for n in range(24):
        index.upsert([Document(id_=f"w{{n % 8}}", text=f"writer clause {{n}} zebra " * 30)])
        if n % 5 == 4:
            index.delete(f"w{{(n - 2) % 8}}")
"""


def test_readers_in_this_process_follow_a_writer_in_another(tmp_path: Path) -> None:
    """Real concurrency: another process writes (upserts, deletes, each a commit that deletes the
    previous generation's files) while this one opens, refreshes and queries read-only."""
    import subprocess
    import sys

    from llama_index.core.embeddings import MockEmbedding

    model = MockEmbedding(embed_dim=16)
    folder = tmp_path / "index"
    HybridIndex.from_documents([Document(id_=f"d{i}", text=f"fee {i} annual card late " * 20) for i in range(20)], folder, embed_model=model).close()
    repo = str(Path(__file__).resolve().parents[2])
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=repo, path=str(folder))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    moved = queries = 0
    try:
        assert writer.stdout.readline().strip() == "open", writer.stderr.read()
        while writer.poll() is None:
            with HybridIndex.load(folder, embed_model=model, read_only=True) as reader:
                for _ in range(10):
                    moved += reader.refresh()
                    results = reader.as_retriever("hybrid", similarity_top_k=5).retrieve("zebra clause")
                    assert len(results) == 5 and all(r.node.get_content() for r in results)
                    queries += 1
    finally:
        writer.wait(120)
    assert writer.returncode == 0, writer.stderr.read()
    assert queries and moved >= 1  # the readers saw commits land while they served
    with HybridIndex.load(folder, embed_model=model, read_only=True) as reader, HybridIndex.load(folder, embed_model=model) as owner:
        assert reader.doc_ids() == owner.doc_ids()
        _support.assert_consistent(owner)


def test_the_cli_with_a_config_answers_read_only_beside_an_open_writer(index: HybridIndex, index_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from llama_index_retrieval_kit.cli import EXIT_BUSY, EXIT_OK, main

    config = tmp_path / "pipeline.yaml"
    config.write_text(f"index: {{storage_dir: {index_dir}}}\nretriever: {{mode: hybrid, similarity_top_k: 3}}\n", encoding="utf-8")
    assert main(["-q", "query", "How much is the late payment fee?", "--config", str(config)]) == EXIT_OK
    captured = capsys.readouterr()
    assert "answering from its last committed state (read-only)" in captured.err and "late" in captured.out.lower()
    config.write_text(f"index: {{storage_dir: {index_dir}}}\nretriever: {{mode: qdrant_hybrid, similarity_top_k: 3}}\n", encoding="utf-8")
    assert main(["-q", "query", "How much is the late payment fee?", "--config", str(config)]) == EXIT_BUSY  # engine-side: needs the shard


def test_a_query_only_open_never_parses_the_docstore(index_dir: Path, embed_model, bundles, monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed docstore file is read on open but parsed on first use: queries never use it."""
    from llama_index_retrieval_kit.indices.docstore import IndexDocumentStore

    parsed = []
    real = IndexDocumentStore.from_json_bytes.__func__
    monkeypatch.setattr(IndexDocumentStore, "from_json_bytes", classmethod(lambda cls, raw, namespace=None: parsed.append(1) or real(cls, raw, namespace)))
    for read_only in (True, False):
        parsed.clear()
        with HybridIndex.load(index_dir, embed_model=embed_model, read_only=read_only) as index:
            for mode in IN_MEMORY_MODES:
                index.as_retriever(mode).retrieve(bundles[2])
            assert parsed == []
            assert _support.CHANGED_DOC in index.doc_ids() and parsed == [1]  # parsed once, when needed
            index.doc_ids()
            assert parsed == [1]


def test_a_reader_of_a_server_folder_searches_the_server_and_follows_its_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index.core.embeddings import MockEmbedding
    from qdrant_client import QdrantClient

    client = _support.share_server(monkeypatch, QdrantClient(location=":memory:"))  # a Qdrant server both objects share
    model = MockEmbedding(embed_dim=8)
    docs = [Document(id_=f"d{i}", text=f"fee clause {i} about late payment") for i in range(4)]
    with HybridIndex.from_documents(docs, tmp_path / "index", embed_model=model, qdrant_url="http://qdrant.invalid:6333") as writer:
        with HybridIndex.load(tmp_path / "index", embed_model=model, read_only=True) as reader:
            assert reader.store.kind == "server"
            assert len(reader.as_retriever("qdrant_hybrid").retrieve("late payment")) == 4  # engine-side search works
            with pytest.raises(IndexReadOnlyError, match="opened with read_only=True.*without read_only=True"):
                reader.upsert([Document(id_="x", text="refused")])
            writer.upsert([Document(id_="zebra", text="the zebra clause")])
            assert reader.refresh() is True
            assert "zebra" in reader.doc_ids()
            assert reader.as_retriever("sparse").retrieve("zebra")[0].node.ref_doc_id == "zebra"
    client.close()


def test_the_cli_calibrates_read_only_beside_an_open_writer(index: HybridIndex, index_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from llama_index_retrieval_kit.cli import EXIT_OK, main
    from llama_index_retrieval_kit.samples import QUESTIONS_FILE

    gate = tmp_path / "gate.json"
    assert main(["-q", "calibrate", "--storage", str(index_dir), "--dataset", str(QUESTIONS_FILE), "--out", str(gate)]) == EXIT_OK
    assert "answering from its last committed state (read-only)" in capsys.readouterr().err
    assert gate.exists() and '"threshold"' in gate.read_text(encoding="utf-8")


def test_a_reader_on_a_server_never_returns_points_another_writer_moved_out_of_its_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter the engine cannot evaluate ('tenant.id' is not a plain key) goes to the server as
    an id list built from the reader's view; the writer's later points (new ones, or one moved to
    another tenant under the same id) must not come back through it."""
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters
    from qdrant_client import QdrantClient

    _support.share_server(monkeypatch, QdrantClient(location=":memory:"))
    model = MockEmbedding(embed_dim=8)
    docs = [Document(id_=f"acme-{i}", text=f"Refund policy of acme, part {i}.", metadata={"tenant.id": "acme"}) for i in range(6)]
    docs += [Document(id_=f"globex-{i}", text=f"Refund policy of globex, part {i}.", metadata={"tenant.id": "globex"}) for i in range(2)]
    acme = MetadataFilters(filters=[MetadataFilter(key="tenant.id", value="acme")])
    globex = MetadataFilters(filters=[MetadataFilter(key="tenant.id", value="globex")])
    engine_modes = [("qdrant_hybrid", {}), ("dense", {"dense_search": "qdrant"})]

    def tenants(reader: HybridIndex, filters: MetadataFilters) -> Dict[str, set]:
        return {
            mode: {r.node.metadata["tenant.id"] for r in reader.as_retriever(mode, similarity_top_k=20, filters=filters, **opts).retrieve("refund policy")}
            for mode, opts in engine_modes
        }

    with HybridIndex.from_documents(docs, tmp_path / "index", embed_model=model, qdrant_url="http://qdrant.invalid:6333") as writer:
        with HybridIndex.load(tmp_path / "index", embed_model=model, read_only=True) as reader:
            assert tenants(reader, acme) == {"qdrant_hybrid": {"acme"}, "dense": {"acme"}}
            # acme is the majority: the id list excludes globex's points; a new globex point is not in it
            writer.upsert([Document(id_="globex-new", text="Refund policy of globex: GLOBEX-NEW-SECRET.", metadata={"tenant.id": "globex"})])
            assert tenants(reader, acme) == {"qdrant_hybrid": {"acme"}, "dense": {"acme"}}
            # globex is the minority: the id list admits its points; acme-0 moves to globex under the same ids
            writer.upsert([Document(id_="acme-0", text="Refund policy of acme, part 0.", metadata={"tenant.id": "globex"})])
            assert tenants(reader, globex) == {"qdrant_hybrid": {"globex"}, "dense": {"globex"}}
            assert tenants(reader, acme) == {"qdrant_hybrid": {"acme"}, "dense": {"acme"}}
            assert reader.refresh() is True
            after = {r.node.ref_doc_id for r in reader.as_retriever("qdrant_hybrid", similarity_top_k=20, filters=globex).retrieve("refund policy")}
            assert after == {"globex-0", "globex-1", "globex-new", "acme-0"}
