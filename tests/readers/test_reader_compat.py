"""The package readers under LlamaIndex's reader contract: SimpleDirectoryReader over a folder
tree (same-named files never silently merged), lazy and async loading, unknown options refused."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

from llama_index_retrieval_kit import SectionWindowNodeParser
from llama_index_retrieval_kit.readers import (
    DocumentFolderReader,
    DocumentReadError,
    MarkdownReader,
    PagedPDFReader,
    TextFileReader,
    folder_doc_id,
)
from llama_index_retrieval_kit.retrievers.node_identity import ChunkIdConflictError, chunk_id_conflicts

TERMS = {"a": "Client A pays 10 dollars per month.", "b": "Client B pays 99 dollars per month."}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``a/terms.md`` and ``b/terms.md`` (same length, so their chunks get the same spans)."""
    root = tmp_path / "docs"
    for sub, sentence in TERMS.items():
        (root / sub).mkdir(parents=True)
        (root / sub / "terms.md").write_text(f"# Terms {sub.upper()}\n\n{sentence}\n", encoding="utf-8")
    return root


def _parser() -> SectionWindowNodeParser:
    return SectionWindowNodeParser(chunk_size=64, chunk_overlap=8)


@pytest.mark.parametrize("filename_as_id", [False, True])
def test_same_name_files_in_two_folders_are_refused_not_overwritten(tree: Path, filename_as_id: bool) -> None:
    docs = SimpleDirectoryReader(
        str(tree), recursive=True, file_extractor={".md": MarkdownReader()}, filename_as_id=filename_as_id
    ).load_data()
    assert sorted(d.text.splitlines()[2] for d in docs) == sorted(TERMS.values())
    with pytest.raises(ChunkIdConflictError) as err:
        _parser().get_nodes_from_documents(docs)
    message = str(err.value)
    for sub in TERMS:
        assert str((tree / sub / "terms.md").resolve()) in message
    assert "doc_id_func=" in message and "folder_doc_id" in message and "filename_as_id=True" in message
    assert all(c.two_files for c in err.value.conflicts)


@pytest.mark.parametrize("filename_as_id", [False, True])
def test_doc_id_func_on_the_reader_gives_each_file_its_own_chunks(tree: Path, filename_as_id: bool) -> None:
    reader = MarkdownReader(doc_id_func=folder_doc_id(tree))
    docs = SimpleDirectoryReader(
        str(tree), recursive=True, file_extractor={".md": reader}, filename_as_id=filename_as_id
    ).load_data()
    assert sorted(d.metadata["doc_id"] for d in docs) == ["a/terms.md", "b/terms.md"]
    if not filename_as_id:
        assert sorted(d.id_ for d in docs) == ["a/terms.md", "b/terms.md"]
    nodes = _parser().get_nodes_from_documents(docs)
    assert len({n.node_id for n in nodes}) == len(nodes)
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    kept = " ".join(n.get_content() for n in index.docstore.docs.values())
    assert all(sentence in kept for sentence in TERMS.values())


def test_doc_id_func_survives_pickling_and_is_left_out_of_to_dict(tree: Path) -> None:
    reader = MarkdownReader(doc_id_func=folder_doc_id(tree))
    copy = pickle.loads(pickle.dumps(reader))  # SimpleDirectoryReader(num_workers=...) pickles readers
    assert copy.doc_id_func(tree / "a" / "terms.md") == "a/terms.md"
    assert "doc_id_func" not in reader.to_dict()
    assert MarkdownReader.from_dict(reader.to_dict()).doc_id_func is None
    # load_data's own doc_id_func wins over the reader's
    docs = reader.load_data(tree / "a" / "terms.md", doc_id_func=lambda p: "mine")
    assert [d.id_ for d in docs] == ["mine"] and docs[0].metadata["doc_id"] == "mine"


def test_a_doc_id_func_that_cannot_be_pickled_is_refused_not_dropped(tree: Path) -> None:
    # LlamaIndex's __getstate__ would drop it with a log line: worker processes then gave the default ids
    reader = MarkdownReader(doc_id_func=lambda p: "mine/" + p.name)
    with pytest.raises(pickle.PicklingError, match=r"doc_id_func .*cannot be pickled.*num_workers"):
        pickle.dumps(reader)
    assert [d.id_ for d in reader.load_data(tree / "a" / "terms.md")] == ["mine/terms.md"]  # in-process use unchanged
    with pytest.raises(pickle.PicklingError, match="module level"):
        SimpleDirectoryReader(str(tree), recursive=True, file_extractor={".md": reader}).load_data(num_workers=2)


def test_simple_directory_reader_workers_keep_a_picklable_doc_id_func(tree: Path) -> None:
    reader = MarkdownReader(doc_id_func=folder_doc_id(tree))
    docs = SimpleDirectoryReader(str(tree), recursive=True, file_extractor={".md": reader}).load_data(num_workers=2)
    assert sorted(d.id_ for d in docs) == ["a/terms.md", "b/terms.md"]


def _node(node_id: str, ref: str | None, file: str | None) -> TextNode:
    node = TextNode(id_=node_id, text=f"{ref} {file}", metadata={} if file is None else {"file_path": file})
    if ref is not None:
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=ref)
    return node


@given(st.lists(st.tuples(st.sampled_from("xy"), st.sampled_from(["d1", "d2", None]), st.sampled_from(["/f1", "/f2", None]))))
def test_chunk_id_conflict_iff_one_id_has_two_documents_or_two_files(triples: list) -> None:
    nodes = [_node(*t) for t in triples]
    expected = False
    for node_id in "xy":
        owned = [(ref, file) for i, ref, file in triples if i == node_id and ref is not None]
        refs = {ref for ref, _ in owned}
        files = {file for _, file in owned if file is not None}
        expected |= len(refs) > 1 or len(files) > 1
    assert bool(chunk_id_conflicts(nodes)) == expected


def test_same_file_twice_is_no_conflict() -> None:
    assert chunk_id_conflicts([_node("x", "d", "/f"), _node("x", "d", "/f"), _node("x", "d", None)]) == []
    [conflict] = chunk_id_conflicts([_node("x", "d", "/f"), _node("x", "d", "/g")])
    assert (conflict.indexed_file, conflict.incoming_file, conflict.two_files) == ("/f", "/g", True)


def test_lazy_load_data_yields_each_file_as_it_is_read(tmp_path: Path) -> None:
    first, second = tmp_path / "one.txt", tmp_path / "two.txt"
    first.write_text("first file\n", encoding="utf-8")
    docs = TextFileReader().lazy_load_data([first, second], extra_info={"tenant": "x"})
    doc = next(iter(docs))
    assert doc.id_ == "one.txt" and doc.metadata["tenant"] == "x"
    second.write_text("second file\n", encoding="utf-8")  # written only after the first was yielded
    assert [d.text for d in docs] == ["second file\n"]


def test_lazy_load_data_reports_bad_files_after_yielding_the_others(tmp_path: Path) -> None:
    good, bad, last = tmp_path / "good.md", tmp_path / "empty.md", tmp_path / "last.md"
    good.write_text("# Good\n\ntext\n", encoding="utf-8")
    bad.write_bytes(b"")
    last.write_text("# Last\n\ntext\n", encoding="utf-8")
    seen = []
    with pytest.raises(DocumentReadError) as err:
        for doc in MarkdownReader().lazy_load_data([good, bad, last]):
            seen.append(doc.id_)
    assert seen == ["good.md", "last.md"]
    assert [f.path for f in err.value.failures] == [str(bad)] and err.value.documents == []
    assert [d.id_ for d in MarkdownReader().lazy_load_data([good, bad, last], skip_errors=True)] == ["good.md", "last.md"]
    # load_data still hands back the readable documents on the error
    with pytest.raises(DocumentReadError) as err:
        MarkdownReader().load_data([good, bad, last])
    assert [d.id_ for d in err.value.documents] == ["good.md", "last.md"]


def test_lazy_load_data_checks_arguments_when_called(tmp_path: Path, tree: Path) -> None:
    with pytest.raises(ValueError, match="same document id"):
        MarkdownReader().lazy_load_data([tree / "a" / "terms.md", tree / "b" / "terms.md"])
    with pytest.raises(ValueError, match="extra_info must be a dict"):
        MarkdownReader().lazy_load_data(tree / "a" / "terms.md", extra_info=["x"])  # type: ignore[arg-type]


def test_async_loading_matches_load_data(tree: Path, sample_pdf: Path) -> None:
    files = [tree / "a" / "terms.md", tree / "b" / "terms.md"]
    reader = MarkdownReader(doc_id_func=folder_doc_id(tree))
    expected = [(d.id_, d.text) for d in reader.load_data(files)]
    assert [(d.id_, d.text) for d in asyncio.run(reader.aload_data(files))] == expected
    assert [(d.id_, d.text) for d in asyncio.run(reader.alazy_load_data(files))] == expected
    pdf = PagedPDFReader()
    assert asyncio.run(pdf.aload_data(sample_pdf))[0].text == pdf.load_data(sample_pdf)[0].text
    sdr = SimpleDirectoryReader(str(tree), recursive=True, file_extractor={".md": reader})
    assert sorted(d.metadata["doc_id"] for d in asyncio.run(sdr.aload_data())) == ["a/terms.md", "b/terms.md"]


@pytest.mark.parametrize("reader_cls", [PagedPDFReader, TextFileReader, MarkdownReader, DocumentFolderReader])
def test_every_reader_refuses_unknown_options_and_round_trips(reader_cls: type) -> None:
    with pytest.raises(TypeError, match=rf"{reader_cls.__name__} got unknown option\(s\) 'pasword'; allowed: .*doc_id_func"):
        reader_cls(pasword="x")
    reader = reader_cls()
    data = reader.to_dict()
    assert data["class_name"] == reader.class_name()
    assert reader_cls.from_dict(data) == reader
    with pytest.raises(TypeError, match="unknown option"):
        reader_cls.from_dict({**data, "typo": 1})


def test_pdf_password_is_not_serialised_and_is_passed_again() -> None:
    reader = PagedPDFReader(password="secret", remove_headers_footers=False)
    data = reader.to_dict()
    assert "password" not in data and "secret" not in str(data)
    again = PagedPDFReader.from_dict(data, password="secret")
    assert again.password == "secret" and again.remove_headers_footers is False
