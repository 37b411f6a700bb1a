"""The readers and section-aware parsers inside LlamaIndex's IngestionPipeline: cache keys, cached
runs, docstore upserts, workers, arun, persist/load."""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any, List

import pytest
from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
from llama_index.core.ingestion.pipeline import get_transformation_hash
from llama_index.core.storage.docstore import SimpleDocumentStore
from llama_index.core.vector_stores import SimpleVectorStore

from llama_index_retrieval_kit.node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from llama_index_retrieval_kit.readers import MarkdownReader, PagedPDFReader, TextFileReader
from llama_index_retrieval_kit.samples import sample_files, sample_pdf

PARSERS = [SectionWindowNodeParser, SectionHierarchyNodeParser]


class Splitter:
    """A tokenizer object whose setting changes what it measures (module level: picklable)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def encode(self, text: str) -> List[str]:
        return [text[i : i + self.width] for i in range(0, len(text), self.width)]


def signature(nodes: Any) -> list:
    """Everything a chunk is: id, text, offsets, metadata, excluded keys, relationships."""
    out = []
    for n in nodes:
        rels = {str(k): [r.node_id for r in v] if isinstance(v, list) else v.node_id for k, v in n.relationships.items()}
        out.append(
            (
                n.node_id,
                n.text,
                n.start_char_idx,
                n.end_char_idx,
                json.dumps(n.metadata, sort_keys=True),
                n.excluded_embed_metadata_keys,
                n.excluded_llm_metadata_keys,
                rels,
            )
        )
    return out


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> List[Document]:
    md, manual, txt = sample_files()
    pdf = sample_pdf(tmp_path_factory.mktemp("pdf"))
    return MarkdownReader().load_data([md, manual]) + TextFileReader().load_data(txt) + PagedPDFReader().load_data(pdf)


def test_cache_key_tells_tokenizer_objects_of_one_class_apart() -> None:
    """Two tokenizer objects of one class with different settings (e.g. two Hugging Face
    tokenizers' ``.encode``) must not share a cache key: the second run would get the first's chunks."""
    docs = [Document(text="Some words here. " * 200, id_="doc")]
    pipe = IngestionPipeline(transformations=[SectionWindowNodeParser(tokenizer=Splitter(2).encode)])
    pipe.run(documents=docs)
    wide = SectionWindowNodeParser(tokenizer=Splitter(8).encode)
    pipe.transformations = [wide]
    assert signature(pipe.run(documents=docs)) == signature(wide(docs))


@pytest.mark.parametrize(
    "options",
    [
        {"chunk_size": 100},
        {"chunk_overlap": 10},
        {"min_chunk_tokens": 4},
        {"heading_patterns": [r"^Clause (?P<number>\d+)"]},
        {"detect_numbered_headings": False},
        {"use_pdf_outline": False},
        {"merge_empty_sections": False},
        {"max_chunk_chars": 300},
        {"contextual_header": True},
        {"include_metadata": False},
        {"tokenizer": Splitter(3).encode},
    ],
)
def test_chunk_changing_options_change_the_cache_key(documents: List[Document], options: dict) -> None:
    base = get_transformation_hash(documents, SectionWindowNodeParser())
    assert get_transformation_hash(documents, SectionWindowNodeParser(**options)) != base


@pytest.mark.parametrize(
    "options", [{"parent_chunk_size": 512}, {"child_chunk_size": 64}, {"child_chunk_overlap": 8}, {"store_parent_text": False}]
)
def test_parent_options_change_the_cache_key(documents: List[Document], options: dict) -> None:
    base = get_transformation_hash(documents, SectionHierarchyNodeParser())
    assert get_transformation_hash(documents, SectionHierarchyNodeParser(**options)) != base


@pytest.mark.parametrize("parser_cls", PARSERS)
def test_cached_and_persisted_runs_equal_an_uncached_one(documents: List[Document], parser_cls: Any, tmp_path: Path) -> None:
    plain = signature(IngestionPipeline(transformations=[parser_cls()], disable_cache=True).run(documents=documents))
    pipe = IngestionPipeline(transformations=[parser_cls()])
    assert signature(pipe.run(documents=documents)) == plain
    assert signature(pipe.run(documents=documents)) == plain  # from the cache
    pipe.persist(str(tmp_path))
    loaded = IngestionPipeline(transformations=[parser_cls()])
    loaded.load(str(tmp_path))
    assert signature(loaded.run(documents=documents)) == plain
    async_nodes = asyncio.run(IngestionPipeline(transformations=[parser_cls()], disable_cache=True).arun(documents=documents))
    assert signature(async_nodes) == plain


def test_workers_give_the_serial_chunks_with_the_tokenizer_kept(documents: List[Document]) -> None:
    parser = SectionWindowNodeParser(tokenizer=Splitter(4).encode, chunk_size=60, chunk_overlap=5)
    serial = IngestionPipeline(transformations=[parser], disable_cache=True).run(documents=documents)
    parallel = IngestionPipeline(transformations=[parser], disable_cache=True).run(documents=documents, num_workers=2)
    assert sorted(signature(parallel), key=repr) == sorted(signature(serial), key=repr)


@pytest.mark.parametrize("parser_cls", PARSERS)
def test_pickling_a_used_parser_logs_no_warning(parser_cls: Any, caplog: pytest.LogCaptureFixture) -> None:
    """LlamaIndex logs a root WARNING for each unpicklable private attribute it drops (here the
    cached span function), once per worker of run(num_workers=...)."""
    parser = parser_cls()
    parser.count_tokens("warm the span cache")
    with caplog.at_level(logging.WARNING):
        copy = pickle.loads(pickle.dumps(parser))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert copy.count_tokens("warm the span cache") == parser.count_tokens("warm the span cache")


def test_upserts_replace_a_changed_documents_chunks(tmp_path: Path) -> None:
    md, manual, _ = sample_files()
    file = tmp_path / "terms.md"
    text = md.read_text(encoding="utf-8")
    file.write_text(text, encoding="utf-8")
    store = SimpleVectorStore()
    pipe = IngestionPipeline(
        transformations=[SectionWindowNodeParser(), MockEmbedding(embed_dim=8)],
        docstore=SimpleDocumentStore(),
        vector_store=store,
        docstore_strategy=DocstoreStrategy.UPSERTS,
    )
    reader = MarkdownReader()
    first = pipe.run(documents=reader.load_data([file, manual]))
    assert pipe.run(documents=reader.load_data([file, manual])) == []  # unchanged: nothing re-run
    file.write_text(text.replace("annual fee", "yearly charge"), encoding="utf-8")
    pipe.run(documents=reader.load_data([file, manual]))
    expected = SectionWindowNodeParser()(reader.load_data([file, manual]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stored = set(store.data.embedding_dict)
    assert stored == {n.node_id for n in expected}
    assert len(first) == len(expected)
    assert {store.data.text_id_to_ref_doc_id[i] for i in stored} == {"terms.md", "product_manual.md"}


def test_tokenizer_labels_agree_across_processes_and_versions() -> None:
    """A state digest keys caches only (it may differ between processes); a label recorded before
    bound methods' owners were named still agrees, so such an index keeps its upserts."""
    from llama_index_retrieval_kit.indices.hybrid_index import node_parser_changes
    from llama_index_retrieval_kit.node_parser.tokenizer_identity import tokenizer_labels_agree

    old = "custom:transformers.PreTrainedTokenizerFast.encode"
    assert tokenizer_labels_agree(old, old + "[bert-base-uncased]")
    assert tokenizer_labels_agree("custom:m.Splitter.__call__@0123456789", "custom:m.Splitter.__call__@abcdef0123")
    assert not tokenizer_labels_agree(old + "[bert-base-uncased]", old + "[roberta-base]")
    assert not tokenizer_labels_agree("custom:m.f", "custom:m.g") and not tokenizer_labels_agree("custom:m.f", None)
    built = SectionWindowNodeParser(chunk_size=64, chunk_overlap=8).to_dict()
    given = dict(built)
    built["tokenizer_callable"], given["tokenizer_callable"] = old, old + "[bert-base-uncased]"
    assert node_parser_changes(built, given) == []
    given["tokenizer_callable"] = "custom:m.other"
    assert node_parser_changes(built, given) == [f"tokenizer_callable: built with {old!r}, given 'custom:m.other'"]
