"""Data safety regressions (issue 9): filters reach every retriever, every option works or is
refused, documents from different files never replace each other silently, a busy index is a
clear error, and a metadata filter means the same thing in every mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator, List

import pytest
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.llms import MockLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import Document
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.cli import EXIT_BUSY, EXIT_USAGE, main
from llama_index_retrieval_kit.indices import (
    RETRIEVER_MODES,
    RETRIEVER_OPTIONS,
    DocumentIdConflictError,
    HybridIndex,
    IndexBusyError,
)
from llama_index_retrieval_kit.ingest import read_documents
from llama_index_retrieval_kit.retrievers import metadata_matches

from . import _support

#: (mode, dense_search) pairs: every way the index answers, Qdrant-side search included.
MODE_VARIANTS = [(m, None) for m in RETRIEVER_MODES] + [(m, "qdrant") for m in ("dense", "hybrid", "hybrid_rrf")]


def _retriever(index: HybridIndex, mode: str, dense_search, **kwargs):
    extra = {"dense_search": dense_search} if dense_search else {}
    return index.as_retriever(mode, **kwargs, **extra)


# ----------------------------------------------------------------------------- 1. kwargs
def test_query_engine_honours_filters_in_every_mode(index: HybridIndex) -> None:
    only_manual = MetadataFilters(filters=[MetadataFilter(key="doc_id", value="product_manual.md")])
    for mode in RETRIEVER_MODES:
        engine = index.as_query_engine(llm=MockLLM(max_tokens=4), mode=mode, filters=only_manual)
        sources = engine.query("What is the penalty APR?").source_nodes
        assert sources, mode
        assert {s.node.metadata["doc_id"] for s in sources} == {"product_manual.md"}, mode


def test_query_engine_passes_retriever_options_and_refuses_unknown_ones(index: HybridIndex) -> None:
    engine = index.as_query_engine(llm=MockLLM(max_tokens=4), mode="hybrid_rrf", similarity_top_k=2, candidate_top_k=20, rrf_k=10)
    assert len(engine.retrieve(_support.query_bundles()[0])) == 2
    with pytest.raises(TypeError, match="'filter'"):  # a typo must not turn into "no filter"
        index.as_query_engine(llm=MockLLM(), filter=MetadataFilters(filters=[]))
    with pytest.raises(ValueError, match="rrf_k"):
        index.as_query_engine(llm=MockLLM(), mode="sparse", rrf_k=10)
    # query-engine options still reach RetrieverQueryEngine.from_args
    engine = index.as_query_engine(llm=MockLLM(max_tokens=4), node_postprocessors=[_KeepFirst()])
    assert len(engine.query("late fee").source_nodes) == 1


class _KeepFirst(BaseNodePostprocessor):
    """Keeps the best node only (observable proof that node_postprocessors arrived)."""

    def _postprocess_nodes(self, nodes, query_bundle=None):
        return list(nodes)[:1]


def test_every_option_works_or_is_refused_in_every_mode(index: HybridIndex) -> None:
    values = {"candidate_top_k": 20, "rrf_k": 30, "weights": [1.0, 1.0], "dense_search": "memory"}
    for mode in RETRIEVER_MODES:
        for name, value in values.items():
            if name in RETRIEVER_OPTIONS[mode]:
                assert index.as_retriever(mode, **{name: value}).retrieve("late fee"), (mode, name)
            else:
                with pytest.raises(ValueError, match=name):
                    index.as_retriever(mode, **{name: value})
        with pytest.raises(TypeError, match="no_such_option"):
            index.as_retriever(mode, no_such_option=1)
        for bad in ("5", None, True, 0):
            with pytest.raises(ValueError, match="similarity_top_k"):
                index.as_retriever(mode, similarity_top_k=bad)


def test_callback_manager_reaches_every_mode(index: HybridIndex) -> None:
    for mode, dense_search in MODE_VARIANTS:
        handler = LlamaDebugHandler()
        retriever = _retriever(index, mode, dense_search, callback_manager=CallbackManager([handler]))
        retriever.retrieve("late payment fee")
        assert handler.get_event_pairs(CBEventType.RETRIEVE), (mode, dense_search)


# ----------------------------------------------------------------------------- 2. document ids
def _contracts(root: Path) -> Path:
    for client, fee in (("clientA", 95), ("clientB", 250)):
        folder = root / "contracts" / client
        folder.mkdir(parents=True)
        (folder / "terms.md").write_text(
            f"# Terms\n\n## Fees\n\nThe annual fee for {client} is ${fee}. Late fees apply after 30 days.\n",
            encoding="utf-8",
        )
    return root / "contracts"


def test_same_named_files_get_different_ids_and_keep_their_file_name(tmp_path: Path) -> None:
    contracts = _contracts(tmp_path)
    docs, failures = read_documents([contracts])
    assert not failures
    assert sorted(d.id_ for d in docs) == ["clientA/terms.md", "clientB/terms.md"]
    assert {d.metadata["file_name"] for d in docs} == {"terms.md"}
    assert {d.metadata["file_path"] for d in docs} == {str((contracts / c / "terms.md").resolve()) for c in ("clientA", "clientB")}
    # flat folders and files named directly keep the ids older versions gave them
    assert [d.id_ for d in read_documents([contracts / "clientA"])[0]] == ["terms.md"]
    assert [d.id_ for d in read_documents([contracts / "clientA" / "terms.md"])[0]] == ["terms.md"]
    with pytest.raises(ValueError, match="same document id"):
        read_documents([contracts / "clientA", contracts / "clientB"])


def _run_cli(*argv: str) -> int:
    return main(["-q", *argv])


def test_second_file_with_the_same_id_is_refused_and_nothing_is_lost(tmp_path: Path, embed_model, capsys) -> None:
    contracts = _contracts(tmp_path)
    storage = tmp_path / "S"
    assert _run_cli("index", str(contracts / "clientA"), "--storage", str(storage)) == 0
    assert _run_cli("index", str(contracts / "clientB"), "--storage", str(storage)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "already belong to a different file" in err and "clientB" in err and "Traceback" not in err
    with HybridIndex.load(storage, embed_model=embed_model) as index:
        texts = [r.node.get_content() for r in index.as_retriever("sparse").retrieve("annual fee")]
        assert any("$95" in t for t in texts) and not any("$250" in t for t in texts)
        # re-indexing the same file still replaces it; another file replaces only when asked
        (contracts / "clientA" / "terms.md").write_text("# Terms\n\n## Fees\n\nThe annual fee is $99.\n", encoding="utf-8")
        docs, _ = read_documents([contracts / "clientA"])
        assert index.upsert(docs)["removed"] == 1
        docs_b, _ = read_documents([contracts / "clientB"])
        with pytest.raises(DocumentIdConflictError, match="allow_source_change"):
            index.upsert(docs_b)
        index.upsert(docs_b, allow_source_change=True)
        assert "$250" in index.as_retriever("sparse").retrieve("annual fee")[0].node.get_content()


def test_indexing_the_parent_folder_keeps_both_and_migrates_old_ids_only_when_asked(tmp_path: Path, embed_model, capsys) -> None:
    contracts = _contracts(tmp_path)
    storage = tmp_path / "S"
    assert _run_cli("index", str(contracts / "clientA"), "--storage", str(storage)) == 0
    # the same file reached through the parent folder has another id: refused, then re-keyed on request
    assert _run_cli("index", str(contracts), "--storage", str(storage)) == EXIT_USAGE
    assert "--migrate-ids" in capsys.readouterr().err
    assert _run_cli("index", str(contracts), "--storage", str(storage), "--migrate-ids") == 0
    with HybridIndex.load(storage, embed_model=embed_model) as index:
        assert index.doc_ids() == ["clientA/terms.md", "clientB/terms.md"]
        fees = {r.node.metadata["doc_id"] for r in index.as_retriever("sparse").retrieve("annual fee")}
        assert fees == {"clientA/terms.md", "clientB/terms.md"}


def test_folder_built_with_old_ids_refuses_a_different_file(tmp_path: Path, embed_model) -> None:
    """Chunks indexed before ``file_path`` existed are compared by their ``source``."""
    contracts = _contracts(tmp_path)
    docs, _ = read_documents([contracts / "clientA"])
    for d in docs:
        del d.metadata["file_path"]  # what older versions wrote
    with HybridIndex.from_documents(docs, tmp_path / "old", embed_model=embed_model) as index:
        new_b, _ = read_documents([contracts / "clientB"])
        with pytest.raises(DocumentIdConflictError):
            index.upsert(new_b)
        same_a, _ = read_documents([contracts / "clientA"])
        index.upsert(same_a)  # the same file: replaced as before
        assert index.doc_ids() == ["terms.md"]


# ----------------------------------------------------------------------------- 3. busy index
def test_second_load_in_the_same_process_is_a_clear_error(index: HybridIndex, index_dir: Path, embed_model) -> None:
    with pytest.raises(IndexBusyError, match="open in another process"):
        HybridIndex.load(index_dir, embed_model=embed_model)
    assert index.as_retriever("sparse").retrieve("fee")  # the first one is unaffected


def test_cli_query_on_a_busy_index_answers_read_only_or_says_what_to_do(index_dir: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from llama_index_retrieval_kit.indices.store import EdgePoints
            store = EdgePoints({str(index_dir / 'edge')!r})  # the shard open in another process
            print('open', flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )
    query = [sys.executable, "-m", "llama_index_retrieval_kit.cli", "-q", "query", "late payment fee", "--storage", str(index_dir), "--json"]
    try:
        assert holder.stdout.readline().strip() == "open"
        answered = subprocess.run(query, capture_output=True, text=True, env=env, timeout=300)
        refused = subprocess.run([*query, "--mode", "qdrant_hybrid"], capture_output=True, text=True, env=env, timeout=300)
    finally:
        holder.communicate("", timeout=60)
    # The default mode answers from the committed index, read-only, and says so in one line.
    assert answered.returncode == 0, answered.stderr
    results = json.loads(answered.stdout)["results"]
    assert results and any("late" in r["text"].lower() for r in results)
    notes = [line for line in answered.stderr.splitlines() if line.startswith("rkit:")]
    assert len(notes) == 1 and "open in another process" in notes[0] and "read-only" in notes[0]
    # Engine-side search needs the shard: one line saying what to do, no traceback.
    assert refused.returncode == EXIT_BUSY, refused.stderr
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("rkit:")]
    assert len(errors) == 1 and "open in another process" in errors[0] and "qdrant_url" in errors[0]


# ----------------------------------------------------------------------------- 4. one meaning for a filter
@pytest.fixture(scope="module")
def uuid_index(tmp_path_factory: pytest.TempPathFactory, embed_model) -> Iterator[HybridIndex]:
    """Documents whose ``id_`` differs from ``metadata['doc_id']`` (and a numeric/str/list payload)."""
    docs = [
        Document(
            id_=f"uuid-{i}",
            text=f"Contract {i}. The annual fee is {i * 100} dollars. Termination requires {i} months notice.",
            metadata={"doc_id": f"contract-{i}", "tenant": f"t{i % 2}", "prio": i, "tags": ["fee", f"tag{i}"]},
        )
        for i in range(1, 7)
    ]
    idx = HybridIndex.from_documents(docs, tmp_path_factory.mktemp("uuid") / "index", embed_model=embed_model)
    try:
        yield idx
    finally:
        idx.close()


FILTER_CASES: List[MetadataFilters] = [
    MetadataFilters(filters=[MetadataFilter(key="doc_id", value="contract-2")]),
    MetadataFilters(filters=[MetadataFilter(key="doc_id", value="contract-2", operator=FilterOperator.NE)]),
    MetadataFilters(filters=[MetadataFilter(key="doc_id", value="uuid-2")]),  # Document.id_ is not metadata
    MetadataFilters(filters=[MetadataFilter(key="prio", value=3, operator=FilterOperator.GT)]),
    MetadataFilters(filters=[MetadataFilter(key="prio", value="3", operator=FilterOperator.GT)]),  # str vs int
    MetadataFilters(filters=[MetadataFilter(key="tags", value="tag4", operator=FilterOperator.CONTAINS)]),
    MetadataFilters(filters=[MetadataFilter(key="doc_id", value=["contract-1", "contract-5"], operator=FilterOperator.NIN)]),
    MetadataFilters(
        filters=[
            MetadataFilter(key="tenant", value="t0"),
            MetadataFilters(filters=[MetadataFilter(key="prio", value=4)], condition=FilterCondition.NOT),
        ]
    ),
    MetadataFilters(filters=[MetadataFilter(key="doc_id", value=[], operator=FilterOperator.IN)]),
]


@pytest.mark.parametrize("filters", FILTER_CASES, ids=lambda f: repr(f.filters)[:60])
def test_a_filter_means_the_same_in_every_mode(uuid_index: HybridIndex, filters: MetadataFilters) -> None:
    leaves = {n.node_id: n for n in uuid_index.bm25.nodes}
    expected = {i for i, n in leaves.items() if metadata_matches(n.metadata, filters)}
    for mode, dense_search in MODE_VARIANTS:
        got = _retriever(uuid_index, mode, dense_search, similarity_top_k=50, filters=filters).retrieve("annual fee notice")
        ids = {r.node.node_id for r in got}
        if mode == "sparse" or mode == "qdrant_hybrid":
            assert ids <= expected, (mode, dense_search)  # BM25 returns term matches only
        else:
            assert ids == expected, (mode, dense_search, filters)


def test_invalid_filters_are_refused_in_every_mode(uuid_index: HybridIndex) -> None:
    bad = MetadataFilters.model_construct(filters=[MetadataFilter(key="tenant", value="t0")], condition="xor")
    for mode, dense_search in MODE_VARIANTS:
        with pytest.raises(ValueError, match="condition"):
            _retriever(uuid_index, mode, dense_search, filters=bad)
        with pytest.raises(ValueError, match="list"):
            _retriever(uuid_index, mode, dense_search, filters=MetadataFilters(
                filters=[MetadataFilter.model_construct(key="tenant", value="t0", operator=FilterOperator.IN)]
            ))


def test_qdrant_reads_never_see_half_an_update(uuid_index: HybridIndex, monkeypatch) -> None:
    """Queries reading Qdrant hold the read side of the index's lock while a write holds the
    write side: a query started during an update waits and then sees the finished update."""
    import threading

    retriever = uuid_index.as_retriever("qdrant_hybrid", similarity_top_k=50)
    written = threading.Event()
    store = uuid_index.store
    upsert = store.upsert_points

    def slow_upsert(*args, **kwargs):
        out = upsert(*args, **kwargs)
        written.set()
        time.sleep(0.5)  # Qdrant has the new points; BM25 and the docstore do not yet
        return out

    monkeypatch.setattr(store, "upsert_points", slow_upsert)
    doc = Document(id_="uuid-9", text="Contract 9. A zephyrquartz clause.", metadata={"doc_id": "contract-9"})
    writer = threading.Thread(target=uuid_index.upsert, args=([doc],))
    writer.start()
    try:
        assert written.wait(60)
        results = retriever.retrieve("zephyrquartz clause")
        after = {n.node_id for n in uuid_index.bm25.nodes}
    finally:
        writer.join()
        monkeypatch.undo()
        uuid_index.delete("uuid-9")
    assert results[0].node.metadata["doc_id"] == "contract-9"
    assert {r.node.node_id for r in results} <= after  # every result is in the committed state


def test_document_with_a_lone_surrogate_is_refused_by_name(index: HybridIndex) -> None:
    before = index.doc_ids()
    bad = Document(id_="bad.txt", text="Fees \ud800 apply.", metadata={"doc_id": "bad.txt"})
    with pytest.raises(ValueError, match=r"'bad.txt': text has an invalid character .* position 5"):
        index.upsert([bad])
    with pytest.raises(ValueError, match="Document objects"):
        index.upsert(["just a string"])
    assert index.doc_ids() == before


def test_bad_query_text_is_a_clear_error_in_every_mode(index: HybridIndex) -> None:
    for mode, dense_search in MODE_VARIANTS:
        retriever = _retriever(index, mode, dense_search)
        with pytest.raises(ValueError, match="decode it first"):
            retriever.retrieve(b"fees")
        with pytest.raises(ValueError, match="lone surrogate"):
            retriever.retrieve("late \ud800 fee")
        with pytest.raises(ValueError, match="str or a QueryBundle"):
            retriever.retrieve(None)


def test_settings_embed_model_is_honoured(tmp_path: Path, embed_model) -> None:
    """LlamaIndex's Settings.embed_model is the default model of from_documents and load."""
    from llama_index.core import Settings
    from llama_index.core.embeddings import MockEmbedding

    from llama_index_retrieval_kit.models import embed_model_name

    docs, _ = read_documents([_contracts(tmp_path) / "clientA"])
    Settings.embed_model = MockEmbedding(embed_dim=8)
    try:
        with HybridIndex.from_documents(docs, tmp_path / "mock") as index:
            assert index.embed_model is Settings.embed_model
        with HybridIndex.load(tmp_path / "mock") as index:
            assert index.embed_model is Settings.embed_model
        with HybridIndex.from_documents(docs, tmp_path / "minilm", embed_model=embed_model):
            pass
        with HybridIndex.load(tmp_path / "minilm") as index:  # built with another model: not Settings'
            assert embed_model_name(index.embed_model) == embed_model_name(embed_model)
    finally:
        Settings._embed_model = None


def test_settings_node_parser_and_chunk_size_are_honoured(tmp_path: Path, embed_model) -> None:
    """Settings.chunk_size (LlamaIndex's SentenceSplitter) or Settings.node_parser chunk from_documents
    when no node_parser is passed; load keeps the parser recorded in the folder."""
    from llama_index.core import Settings
    from llama_index.core.node_parser import SentenceSplitter

    docs, _ = read_documents([_contracts(tmp_path) / "clientA"])
    Settings.chunk_size = 256
    try:
        with HybridIndex.from_documents(docs, tmp_path / "settings", embed_model=embed_model) as index:
            assert isinstance(index.node_parser, SentenceSplitter) and index.node_parser.chunk_size == 256
        Settings._node_parser = None  # no public way to unset it
        with HybridIndex.load(tmp_path / "settings", embed_model=embed_model) as index:
            assert isinstance(index.node_parser, SentenceSplitter) and index.node_parser.chunk_size == 256
        with HybridIndex.from_documents(docs, tmp_path / "default", embed_model=embed_model) as index:
            assert type(index.node_parser).__name__ == "SectionWindowNodeParser"
    finally:
        Settings._node_parser = None


def test_llamaindex_reading_its_default_node_parser_does_not_change_our_chunking(tmp_path: Path, embed_model) -> None:
    """Building a VectorStoreIndex reads Settings.node_parser, which stores LlamaIndex's default
    SentenceSplitter in the slot: that is not the user's setting, so from_documents keeps our parser."""
    from llama_index.core import Settings, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    docs, _ = read_documents([_contracts(tmp_path) / "clientA"])
    try:
        VectorStoreIndex([TextNode(text="x")], embed_model=MockEmbedding(embed_dim=8))
        assert Settings.node_parser is not None  # the slot is filled now (LlamaIndex's default)
        with HybridIndex.from_documents(docs, tmp_path / "after_vector_index", embed_model=embed_model) as index:
            assert type(index.node_parser).__name__ == "SectionWindowNodeParser"
    finally:
        Settings._node_parser = None


def test_an_index_never_closed_releases_its_folder_quietly(index_dir: Path, embed_model) -> None:
    """Forgetting close() neither locks the folder forever nor prints a traceback at exit."""
    import gc

    forgotten = HybridIndex.load(index_dir, embed_model=embed_model)
    assert len(forgotten)
    del forgotten
    gc.collect()
    HybridIndex.load(index_dir, embed_model=embed_model).close()  # the folder was released
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    code = f"from llama_index_retrieval_kit import HybridIndex\nindex = HybridIndex.load({str(index_dir)!r})\nprint(len(index))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
