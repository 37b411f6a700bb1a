"""Chunk identity on writes: chunk ids two documents would share are refused before anything is
written (HybridIndex.upsert, the parsers, an IngestionPipeline), and an index keeps one chunking
(HybridIndex with another node_parser, ``rkit index --chunk-size/--parser`` on an update)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import Document

from llama_index_retrieval_kit import cli
from llama_index_retrieval_kit.indices import ChunkIdConflictError, HybridIndex
from llama_index_retrieval_kit.indices.hybrid_index import node_parser_changes
from llama_index_retrieval_kit.node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser

from . import _support

MODEL = MockEmbedding(embed_dim=8)
#: Two pages of one report: distinct Document ids, one metadata["doc_id"], texts of equal length
#: (so their single chunks have the same span, hence the same chunk id).
PAGE_1 = "Page one: the annual fee is 95 dollars."
PAGE_2 = "Page two: the late fee is 40 dollars!!!"


def page(number: int, text: str, **metadata: Any) -> Document:
    return Document(id_=f"report-p{number}", text=text, metadata={"doc_id": "report-2024", "page": number, **metadata})


def state(index: HybridIndex) -> Tuple[Any, ...]:
    """Everything a write could change, in every leg (and the committed generation)."""
    legs = _support.read_legs(index)
    texts = lambda nodes: {i: n.get_content() for i, n in nodes.items()}  # noqa: E731
    return (
        index.config["generation"],
        index.doc_ids(),
        texts(legs.docstore_leaves),
        texts(legs.bm25),
        sorted(legs.qdrant),
        legs.qdrant_count,
    )


def bm25_texts(index: HybridIndex, query: str) -> List[Tuple[str, str]]:
    return [(r.node.ref_doc_id, r.node.get_content()) for r in index.as_retriever("sparse", similarity_top_k=5).retrieve(query)]


# ----- chunk ids shared by two documents -----------------------------------------------------------


def test_a_page_sharing_metadata_doc_id_with_an_indexed_page_is_refused_before_any_write(tmp_path: Path) -> None:
    assert len(PAGE_1) == len(PAGE_2)
    folder = tmp_path / "index"
    with HybridIndex.from_documents([page(1, PAGE_1)], folder, embed_model=MODEL) as index:
        before = state(index)
        chunk_id = index.docstore.get_ref_doc_info("report-p1").node_ids[0]
        with pytest.raises(ChunkIdConflictError) as caught:
            index.upsert([page(2, PAGE_2)])
        message = str(caught.value)
        for named in (repr(chunk_id), "'report-p1'", "'report-p2'", "metadata['doc_id']='report-2024'",
                      "give each Document its own metadata['doc_id']", "so that the Document id is used"):
            assert named in message
        assert [(c.chunk_id, c.indexed_doc, c.incoming_doc) for c in caught.value.conflicts] == [(chunk_id, "report-p1", "report-p2")]
        assert isinstance(caught.value, ValueError)
        assert state(index) == before  # nothing written, in any leg
        assert bm25_texts(index, "annual fee 95") == [("report-p1", PAGE_1)]
        # the same page again is an ordinary update (its own chunk ids)
        assert index.upsert([page(1, PAGE_1)])["chunks"] == 1
    with HybridIndex.load(folder, embed_model=MODEL) as index:
        assert state(index)[1:] == before[1:]  # on disk: page 1 alone (written again: the next generation)
        _support.assert_consistent(index)


@pytest.mark.parametrize("fix", ["own metadata doc_id", "no metadata doc_id"])
def test_pages_with_their_own_ids_are_indexed_and_deleted_separately(tmp_path: Path, fix: str) -> None:
    def fixed(number: int, text: str) -> Document:
        doc = page(number, text)
        if fix == "own metadata doc_id":
            doc.metadata["doc_id"] = f"report-2024-p{number}"
        else:
            del doc.metadata["doc_id"]  # the Document id is used
        return doc

    with HybridIndex.from_documents([fixed(1, PAGE_1)], tmp_path / "index", embed_model=MODEL) as index:
        index.upsert([fixed(2, PAGE_2)])
        _support.assert_consistent(index)
        assert len(index) == 2 and index.doc_ids() == ["report-p1", "report-p2"]
        assert bm25_texts(index, "annual fee 95")[0] == ("report-p1", PAGE_1)
        assert index.delete("report-p2") == 1
        _support.assert_consistent(index)
        assert len(index) == 1 and index.doc_ids() == ["report-p1"]
        assert bm25_texts(index, "annual fee 95") == [("report-p1", PAGE_1)]


def test_two_pages_in_one_batch_are_refused_and_no_index_is_made(tmp_path: Path) -> None:
    folder = tmp_path / "index"
    with pytest.raises(ChunkIdConflictError, match="'report-p1' and of document 'report-p2'"):
        HybridIndex.from_documents([page(1, PAGE_1), page(2, PAGE_2)], folder, embed_model=MODEL)
    assert not (folder / "index.json").exists()


def test_any_parser_whose_ids_collide_is_refused_by_upsert(tmp_path: Path) -> None:
    """HybridIndex checks the nodes itself: a LlamaIndex parser with an id_func that ignores the document."""
    splitter = SentenceSplitter(chunk_size=64, chunk_overlap=0, id_func=lambda i, doc: f"chunk-{i}")
    a = Document(id_="a.md", text="Alpha fees are low.")
    b = Document(id_="b.md", text="Beta rates are high.")
    with HybridIndex.from_documents([a], tmp_path / "index", embed_model=MODEL, node_parser=splitter) as index:
        before = state(index)
        with pytest.raises(ChunkIdConflictError) as caught:  # the indexed document's id
            index.upsert([b])
        assert [(c.chunk_id, c.indexed_doc, c.incoming_doc) for c in caught.value.conflicts] == [("chunk-0", "a.md", "b.md")]
        with pytest.raises(ChunkIdConflictError, match="'chunk-0': of document 'b.md' and of document 'c.md'"):  # within the batch
            index.upsert([b, Document(id_="c.md", text="Gamma terms apply.")])
        assert state(index) == before
        with pytest.raises(ChunkIdConflictError):  # the indexed document with another: still chunk-0 twice
            index.upsert([a, b])
        assert state(index) == before


def test_the_parsers_and_an_ingestion_pipeline_refuse_shared_chunk_ids() -> None:
    for parser in (SectionWindowNodeParser(), SectionHierarchyNodeParser()):
        with pytest.raises(ChunkIdConflictError, match="'report-p1' and of document 'report-p2'"):
            parser.get_nodes_from_documents([page(1, PAGE_1), page(2, PAGE_2)])
        with pytest.raises(ChunkIdConflictError):
            IngestionPipeline(transformations=[parser]).run(documents=[page(1, PAGE_1), page(2, PAGE_2)])
        # pages with their own metadata doc_id: every chunk id distinct
        nodes = parser.get_nodes_from_documents([page(1, PAGE_1), page(2, PAGE_2, doc_id="report-2024-p2")])
        assert len({n.node_id for n in nodes}) == len(nodes)
        # the same document twice (one id): the same ids, not a conflict between documents
        once = [n.node_id for n in parser.get_nodes_from_documents([page(1, PAGE_1)])]
        twice = [n.node_id for n in parser.get_nodes_from_documents([page(1, PAGE_1), page(1, PAGE_1)])]
        assert sorted(twice) == sorted(once * 2)


# ----- one chunking per index --------------------------------------------------------------------

LONG = " ".join(f"Sentence number {i} talks about fees and rates." for i in range(120))


@pytest.fixture()
def window_index(tmp_path: Path) -> Path:
    folder = tmp_path / "index"
    HybridIndex.from_documents([Document(id_="a.md", text=LONG)], folder, embed_model=MODEL, node_parser=SectionWindowNodeParser(chunk_size=200)).close()
    return folder


@pytest.mark.parametrize(
    ("parser", "named"),
    [
        (SectionHierarchyNodeParser(), "class: built with SectionWindowNodeParser, given SectionHierarchyNodeParser"),
        (SectionWindowNodeParser(chunk_size=60), "chunk_size: built with 200, given 60"),
        (SentenceSplitter(chunk_size=200, chunk_overlap=0), "given SentenceSplitter"),
    ],
)
def test_upsert_with_another_parser_is_refused(window_index: Path, parser: Any, named: str) -> None:
    with HybridIndex.load(window_index, embed_model=MODEL, node_parser=parser) as index:
        before = state(index)
        with pytest.raises(ValueError, match="another chunking") as caught:
            index.upsert([Document(id_="b.md", text=LONG)])
        assert named in str(caught.value) and "overwrite=True" in str(caught.value) and "--rebuild" in str(caught.value)
        assert state(index) == before
        index.node_parser = index.manifest.build_node_parser()  # the index's own parser: updates work
        assert index.upsert([Document(id_="b.md", text=LONG)])["chunks"] == len(index) // 2


def test_an_equal_parser_is_accepted(window_index: Path) -> None:
    with HybridIndex.load(window_index, embed_model=MODEL, node_parser=SectionWindowNodeParser(chunk_size=200)) as index:
        counts = index.upsert([Document(id_="b.md", text=LONG)])
        assert counts["chunks"] == len(index) // 2
        assert {n.metadata["node_kind"] for n in index.bm25.nodes} == {"chunk"}


SETTINGS = st.dictionaries(st.sampled_from(["chunk_size", "chunk_overlap", "heading_patterns", "flag"]),
                           st.integers(0, 3) | st.lists(st.text(max_size=2), max_size=2) | st.booleans(), max_size=4)


@given(built=SETTINGS, given_=SETTINGS, extra=SETTINGS)
def test_node_parser_changes_compare_shared_settings_as_json(built: Dict[str, Any], given_: Dict[str, Any], extra: Dict[str, Any]) -> None:
    a = {**built, "class_name": "P", "id_func": {"id_func_name": "x"}}
    b = {**built, **given_, "class_name": "P", "callback_manager": object()}
    want = [k for k in sorted(set(built) & set(given_)) if built[k] != given_[k]]
    assert [c.split(":")[0] for c in node_parser_changes(a, b)] == want
    assert node_parser_changes(a, {**a, **{f"new_{k}": v for k, v in extra.items()}}) == []  # a setting one side lacks
    tupled = {k: tuple(v) if isinstance(v, list) else v for k, v in a.items()}
    assert node_parser_changes(a, tupled) == []  # compared as JSON
    assert node_parser_changes(a, {**a, "class_name": "Q"}) == ["class: built with P, given Q"]


def rkit(*argv: str) -> Tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["-q", *argv])
    return code, out.getvalue() + err.getvalue()


def test_rkit_index_refuses_other_chunking_options_on_an_update(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "c.md").write_text(LONG, encoding="utf-8")
    storage = str(tmp_path / "index")
    code, out = rkit("index", str(src), "--storage", storage, "--chunk-size", "200")
    assert code == cli.EXIT_OK, out
    with HybridIndex.load(storage, read_only=True) as index:
        before = (index.config["generation"], len(index))
    for options, named in (
        (["--chunk-size", "60"], "asked for: --chunk-size 60"),
        (["--parser", "hierarchy", "--chunk-size", "60"], "asked for: --parser hierarchy"),
        (["--chunk-overlap", "5"], "asked for: --chunk-overlap 5"),
    ):
        code, out = rkit("index", str(src), "--storage", storage, *options)
        assert code == cli.EXIT_USAGE, out
        lines = out.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "--parser window --chunk-size 200 --chunk-overlap 40" in lines[0]
        assert "--rebuild" in lines[0]
    # the index's own settings, or none: an update
    for options in ([], ["--chunk-size", "200"], ["--parser", "window", "--chunk-overlap", "40"]):
        code, out = rkit("index", str(src), "--storage", storage, *options)
        assert code == cli.EXIT_OK, out
    with HybridIndex.load(storage, read_only=True) as index:
        assert len(index) == before[1]
    code, out = rkit("index", str(src), "--storage", storage, "--chunk-size", "60", "--rebuild")
    assert code == cli.EXIT_OK, out
    with HybridIndex.load(storage, read_only=True) as index:
        assert index.config["node_parser"]["chunk_size"] == 60 and len(index) > before[1]
