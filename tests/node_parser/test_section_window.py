"""SectionWindowNodeParser: invariants on random documents, LlamaIndex integration."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core import Document
from llama_index.core.ingestion import IngestionCache, IngestionPipeline
from llama_index.core.schema import MetadataMode, NodeRelationship

from llama_index_retrieval_kit import PagedPDFReader, SectionHierarchyNodeParser, SectionWindowNodeParser
from llama_index_retrieval_kit.samples import sample_files

WORDS = st.sampled_from(
    "the card fee interest annual rate payment is of to a charged daily billing statement "
    "cardholder account balance 21.49% $95 U.S. e-mail, late; credit-limit (APR) days".split()
)


@st.composite
def paragraphs(draw: st.DrawFn) -> str:
    sentences = []
    for _ in range(draw(st.integers(1, 6))):
        words = draw(st.lists(WORDS, min_size=1, max_size=30))
        sentences.append(" ".join(words).capitalize() + draw(st.sampled_from([".", "!", "?", ""])))
    return draw(st.sampled_from([" ", "\n"])).join(sentences)


@st.composite
def documents(draw: st.DrawFn) -> str:
    parts = []
    if draw(st.booleans()):
        parts.append(draw(paragraphs()))
    for i in range(1, draw(st.integers(0, 5)) + 1):
        parts.append(f"{i}. Section Number {i}")
        for j in range(1, draw(st.integers(0, 3)) + 1):
            parts.append(f"{i}.{j} Sub Part {j}")
            parts.append(draw(paragraphs()))
        if draw(st.booleans()):
            parts.append(draw(paragraphs()))
    if not parts:
        parts.append(draw(paragraphs()))
    return draw(st.sampled_from(["\n", "\n\n"])).join(parts) + draw(st.sampled_from(["", "\n"]))


@pytest.fixture(scope="module")
def parser() -> SectionWindowNodeParser:
    return SectionWindowNodeParser(chunk_size=24, chunk_overlap=6, min_chunk_tokens=6)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=documents(), size=st.integers(8, 60), overlap_share=st.floats(0, 0.5))
def test_window_invariants(text: str, size: int, overlap_share: float) -> None:
    parser = SectionWindowNodeParser(chunk_size=size, chunk_overlap=int(size * overlap_share), min_chunk_tokens=4)
    doc = Document(text=text, id_="doc-1")
    nodes = parser.get_nodes_from_documents([doc])
    sections = parser.sections_of(doc)
    covered = [False] * len(text)
    for i, node in enumerate(nodes):
        m = node.metadata
        # Exact offsets.
        assert text[m["char_start"] : m["char_end"]] == node.text
        assert (node.start_char_idx, node.end_char_idx) == (m["char_start"], m["char_end"])
        # Inside exactly one section, and labelled with it.
        owner = [s for s in sections if s.start <= m["char_start"] and m["char_end"] <= s.end]
        assert len(owner) == 1 and list(owner[0].path) == m["section_path"]
        # Size limit, measured with the same tokenizer.
        assert parser.count_tokens(node.text) <= size
        assert m["chunk_index"] == i and m["doc_id"] == "doc-1"
        for k in range(m["char_start"], m["char_end"]):
            covered[k] = True
    # Every non-space character of the document is in some chunk.
    assert all(covered[k] for k, c in enumerate(text) if not c.isspace())
    # Deterministic ids.
    again = parser.get_nodes_from_documents([Document(text=text, id_="doc-1")])
    assert [n.node_id for n in again] == [n.node_id for n in nodes]
    assert len({n.node_id for n in nodes}) == len(nodes)


def test_sample_agreement_chunks(parser: SectionWindowNodeParser) -> None:
    doc = Document(text=sample_files()[0].read_text(), id_="terms", metadata={"doc_id": "terms", "source": "terms.md"})
    nodes = SectionWindowNodeParser().get_nodes_from_documents([doc])
    late = [n for n in nodes if n.metadata["section_title"] == "2.2 Late Payment Fee"]
    assert late and late[0].text.startswith("2.2 Late Payment Fee")
    assert late[0].metadata["section_path"] == ["2. Fees", "2.2 Late Payment Fee"]
    # Heading-only "2. Fees" joins its first sub-section instead of being a lone chunk.
    assert not any(n.text.strip() == "2. Fees" for n in nodes)
    assert all(SectionWindowNodeParser().count_tokens(n.text) <= 200 for n in nodes)


def test_pdf_chunks_carry_pages(sample_pdf) -> None:
    doc = PagedPDFReader().load_data(sample_pdf)[0]
    nodes = SectionWindowNodeParser().get_nodes_from_documents([doc])
    starts = doc.metadata["page_starts"]
    assert max(n.metadata["page_end"] for n in nodes) == len(starts) > 1
    for n in nodes:
        m = n.metadata
        assert starts[m["page_start"] - 1] <= m["char_start"]
        assert m["page_start"] == len(starts) or m["char_start"] < starts[m["page_start"]]
        assert "page_starts" not in m and "outline" not in m
        assert m["source"] == str(sample_pdf)


def test_documents_are_not_mutated(parser: SectionWindowNodeParser) -> None:
    doc = Document(text=sample_files()[2].read_text(), id_="policy", metadata={"doc_id": "policy", "page_starts": [0]})
    before = copy.deepcopy(doc.to_dict())
    nodes = parser.get_nodes_from_documents([doc])
    assert doc.to_dict() == before
    # and the chunks share nothing with it: changing the document afterwards leaves them alone
    chunks_before = [n.to_dict() for n in nodes]
    doc.metadata["page_starts"].append(99)
    doc.metadata["doc_id"] = "changed"
    assert [n.to_dict() for n in nodes] == chunks_before
    # each chunk has its own copy of its source relationship
    assert nodes[0].relationships[NodeRelationship.SOURCE].metadata["page_starts"] == [0]
    nodes[0].relationships[NodeRelationship.SOURCE].metadata["page_starts"].append(7)
    assert all(n.relationships[NodeRelationship.SOURCE].metadata["page_starts"] == [0] for n in nodes[1:])



@pytest.mark.parametrize(
    "parse",
    [
        lambda docs: SectionWindowNodeParser(chunk_size=32, chunk_overlap=4).get_nodes_from_documents(docs),
        lambda docs: SectionHierarchyNodeParser(parent_chunk_size=96, child_chunk_size=24).get_nodes_from_documents(docs),
        lambda docs: IngestionPipeline(transformations=[SectionWindowNodeParser(chunk_size=32, chunk_overlap=4)]).run(documents=docs),
    ],
    ids=["window", "hierarchy", "ingestion_pipeline"],
)
def test_chunks_have_their_own_list_and_dict_metadata(parse) -> None:
    """A document's list/dict metadata values (tags, ACLs) are copied into each chunk: editing one
    chunk's changes neither the document nor the document's other chunks."""
    doc = Document(
        text=sample_files()[0].read_text(), id_="terms", metadata={"doc_id": "terms", "tags": ["t1"], "acl": {"groups": ["g1"]}}
    )
    nodes = parse([doc])
    assert len(nodes) >= 3
    nodes[0].metadata["tags"].append("edited")
    nodes[0].metadata["acl"]["groups"].append("everyone")
    assert doc.metadata == {"doc_id": "terms", "tags": ["t1"], "acl": {"groups": ["g1"]}}
    assert all(n.metadata["tags"] == ["t1"] and n.metadata["acl"] == {"groups": ["g1"]} for n in nodes[1:])

def test_contextual_header_changes_embedding_text_only() -> None:
    doc = Document(text=sample_files()[0].read_text(), id_="terms", metadata={"doc_id": "terms"})
    plain = SectionWindowNodeParser().get_nodes_from_documents([doc])
    ctx = SectionWindowNodeParser(contextual_header=True).get_nodes_from_documents([doc])
    n_plain = next(n for n in plain if n.metadata["section_title"] == "3.3 Penalty APR")
    n_ctx = next(n for n in ctx if n.node_id == n_plain.node_id)
    assert n_ctx.text == n_plain.text
    assert n_plain.get_content(MetadataMode.EMBED).strip() == n_plain.text.strip()
    embed = n_ctx.get_content(MetadataMode.EMBED)
    assert "3. Interest and Billing > 3.3 Penalty APR" in embed and embed.endswith(n_ctx.text.strip())
    # Bookkeeping never reaches the LLM; citations do.
    llm = n_ctx.get_content(MetadataMode.LLM)
    assert "char_start" not in llm and "chunk_id" not in llm and "section_title: 3.3 Penalty APR" in llm


def test_prev_next_and_source_relationships() -> None:
    doc = Document(text=sample_files()[1].read_text(), id_="manual", metadata={"doc_id": "manual"})
    nodes = SectionWindowNodeParser().get_nodes_from_documents([doc])
    assert all(n.relationships[NodeRelationship.SOURCE].node_id == "manual" for n in nodes)
    for a, b in zip(nodes, nodes[1:]):
        assert a.next_node.node_id == b.node_id and b.prev_node.node_id == a.node_id


def test_serialisation_round_trip() -> None:
    parser = SectionWindowNodeParser(chunk_size=120, chunk_overlap=10, heading_patterns=[r"^Clause (?P<title>.+)$"])
    data = parser.to_dict()
    assert data["class_name"] == "SectionWindowNodeParser"
    loaded = SectionWindowNodeParser.from_dict(data)
    assert loaded.chunk_size == 120 and loaded.heading_patterns == [r"^Clause (?P<title>.+)$"]
    doc = Document(text=sample_files()[0].read_text(), id_="terms")
    assert [n.node_id for n in loaded(  [doc])] == [n.node_id for n in parser([doc])]
    assert SectionWindowNodeParser.from_json(parser.to_json()).chunk_overlap == 10


def test_ingestion_pipeline_with_cache(tmp_path) -> None:
    doc = Document(text=sample_files()[2].read_text(), id_="policy", metadata={"doc_id": "policy"})
    cache = IngestionCache()
    pipeline = IngestionPipeline(transformations=[SectionWindowNodeParser(chunk_size=64, chunk_overlap=8)], cache=cache)
    first = pipeline.run(documents=[doc])
    assert first and all(n.metadata["section_title"] is not None for n in first)
    pipeline.cache.persist(str(tmp_path / "cache.json"))
    reloaded = IngestionPipeline(
        transformations=[SectionWindowNodeParser(chunk_size=64, chunk_overlap=8)],
        cache=IngestionCache.from_persist_path(str(tmp_path / "cache.json")),
    )
    second = reloaded.run(documents=[doc])
    assert [n.node_id for n in second] == [n.node_id for n in first]
    assert [n.metadata for n in second] == [n.metadata for n in first]


def test_custom_tokenizer_callable() -> None:
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base") if False else None  # no network: use a whitespace tokenizer
    parser = SectionWindowNodeParser(chunk_size=30, chunk_overlap=5, tokenizer=str.split)
    doc = Document(text=sample_files()[0].read_text(), id_="terms")
    nodes = parser.get_nodes_from_documents([doc])
    assert nodes and all(len(n.text.split()) <= 30 for n in nodes)
    assert enc is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunk_size=100, chunk_overlap=100), r"chunk_overlap \(100\) must be smaller than chunk_size \(100\)"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(heading_patterns=["("]), r"heading pattern '\(' is not a valid regular expression"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SectionWindowNodeParser(**kwargs)
