"""BM25Retriever: scores, tokenizer settings, persistence, filters, updates, no mutation."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import Document, MetadataMode, NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

from llama_index_retrieval_kit.retrievers import BM25Retriever, BM25TokenizerConfig, ChunkIdConflictError
from llama_index_retrieval_kit.retrievers.bm25 import PackedTokens

from ._strategies import WORDS, corpus_st, filters_st, oracle_matches, query_st

PLAIN = BM25TokenizerConfig(stopwords=None, stemmer_language=None)


def chunk(node_id: str, text: str, doc_id: Optional[str] = None, **metadata: object) -> TextNode:
    node = TextNode(id_=node_id, text=text, metadata=dict(metadata))
    if doc_id is not None:
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=doc_id)
    return node


def ranked(retriever: BM25Retriever, query: str) -> List[Tuple[str, float]]:
    return [(r.node.node_id, r.score) for r in retriever.retrieve(query)]  # type: ignore[misc]


@pytest.fixture()
def corpus() -> List[TextNode]:
    return [
        chunk("d1-0", "The annual fee is charged every year on the card.", "d1", lang="en", year=2021),
        chunk("d1-1", "Late payment fees apply when the minimum payment is missed.", "d1", lang="en", year=2022),
        chunk("d2-0", "Die Jahresgebühr wird jährlich berechnet.", "d2", lang="de", year=2021),
        chunk("d3-0", "Interest is charged daily on the average balance.", "d3", lang="en", year=2023),
        chunk("d3-1", "Disputes must be raised within sixty days of the statement.", "d3", lang="en", year=2023),
    ]


# ----- scoring -----------------------------------------------------------------------------------


def test_lucene_score_known_answer() -> None:
    nodes = [chunk("a", "apple banana apple"), chunk("b", "banana cherry"), chunk("c", "cherry date elder fig")]
    bm25 = BM25Retriever.from_nodes(nodes, tokenizer_config=PLAIN, k1=1.5, b=0.75)
    n_docs, df, tf, doc_len, avg_len = 3, 1, 2, 3, 3.0
    idf = math.log(1 + (n_docs - df + 0.5) / (df + 0.5))
    expected = idf * tf / (tf + 1.5 * (1 - 0.75 + 0.75 * doc_len / avg_len))
    results = ranked(bm25, "apple")
    assert [node_id for node_id, _ in results] == ["a"]
    assert results[0][1] == pytest.approx(expected, rel=1e-6)
    # banana in a (len 3) and b (len 2): same tf and idf, the shorter document wins
    assert [node_id for node_id, _ in ranked(bm25, "banana")] == ["b", "a"]


def test_no_overlap_nodes_are_not_returned(corpus: List[TextNode]) -> None:
    bm25 = BM25Retriever.from_nodes(corpus, similarity_top_k=10)
    assert {node_id for node_id, _ in ranked(bm25, "fee")} == {"d1-0", "d1-1"}  # stemmed: fee/fees
    assert ranked(bm25, "zebra") == []
    assert ranked(bm25, "the and of") == []  # only stopwords
    with pytest.raises(ValueError, match="the query is blank"):  # nothing to search for: refused, not []
        ranked(bm25, "")
    assert all(score > 0 for _, score in ranked(bm25, "charged fee payment"))


@pytest.mark.parametrize("method", ["bm25l", "bm25+", "robertson", "atire"])
def test_other_methods_return_only_overlapping_nodes(corpus: List[TextNode], method: str) -> None:
    # bm25l/bm25+ add a non-occurrence score to every document; only term overlap must count
    bm25 = BM25Retriever.from_nodes(corpus, method=method, similarity_top_k=10)
    assert {node_id for node_id, _ in ranked(bm25, "interest")} == {"d3-0"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=corpus_st(),
    query=query_st,
    method=st.sampled_from(["lucene", "robertson", "atire", "bm25l", "bm25+"]),
    top_k=st.integers(1, 12),
)
def test_matches_agree_with_a_brute_force_oracle(nodes: List[TextNode], query: str, method: str, top_k: int) -> None:
    # Oracle: every node sharing a query term with a positive bm25s score, by (-score, node id).
    bm25 = BM25Retriever.from_nodes(nodes, tokenizer_config=PLAIN, method=method, similarity_top_k=top_k)
    snapshot = bm25.snapshot
    terms = bm25.tokenize(query)
    expected: List[Tuple[str, float]] = []
    if snapshot.bm25 is not None:
        ids = [snapshot.bm25.vocab_dict[t] for t in terms if t in snapshot.bm25.vocab_dict]
        scores = snapshot.bm25.get_scores_from_ids(ids) if ids else []
        for position, node in enumerate(snapshot.nodes):
            if set(terms) & set(bm25.tokenize(node.get_content())) and scores[position] > 0:
                expected.append((node.node_id, float(scores[position])))
    expected.sort(key=lambda item: (-item[1], item[0]))
    assert ranked(bm25, query) == expected[:top_k]


def test_empty_corpora() -> None:
    assert BM25Retriever.from_nodes([]).retrieve("anything") == []
    empty_texts = BM25Retriever.from_nodes([chunk("a", ""), chunk("b", "the of")])
    assert empty_texts.retrieve("the") == []
    empty_texts.insert_nodes([chunk("c", "real words here")])
    assert ranked(empty_texts, "words")[0][0] == "c"


def test_top_k_and_deterministic_ties() -> None:
    nodes = [chunk(f"n{i}", "same text") for i in (3, 1, 2)]
    bm25 = BM25Retriever.from_nodes(nodes, tokenizer_config=PLAIN, similarity_top_k=2)
    assert [node_id for node_id, _ in ranked(bm25, "text")] == ["n1", "n2"]


def test_metadata_mode_indexes_metadata() -> None:
    nodes = [chunk("a", "body text", section_title="Refunds")]
    assert BM25Retriever.from_nodes(nodes).retrieve("refunds") == []
    with_meta = BM25Retriever.from_nodes(nodes, metadata_mode=MetadataMode.EMBED)
    assert ranked(with_meta, "refunds")[0][0] == "a"


# ----- tokenizer config and validation ------------------------------------------------------------


def test_tokenizer_pipeline() -> None:
    bm25 = BM25Retriever.from_nodes([], tokenizer_config=BM25TokenizerConfig())
    assert bm25.tokenize("The Cats are RUNNING, a b") == ["cat", "run"]
    case = BM25Retriever.from_nodes([], tokenizer_config=BM25TokenizerConfig(lowercase=False, stopwords=["The"], stemmer_language=None))
    assert case.tokenize("The the Cats") == ["the", "Cats"]
    pattern = BM25Retriever.from_nodes([], tokenizer_config=BM25TokenizerConfig(token_pattern=r"\w+", stopwords=None, stemmer_language=None))
    assert pattern.tokenize("a b-c") == ["a", "b", "c"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"token_pattern": "("}, "token_pattern"),
        ({"stopwords": "klingon"}, "klingon"),
        ({"stemmer_language": "elvish"}, "elvish"),
    ],
)
def test_tokenizer_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BM25TokenizerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k1": -1}, "k1"),
        ({"b": 1.5}, "b must"),
        ({"method": "bm42"}, "bm42"),
        ({"similarity_top_k": 0}, "similarity_top_k"),
        ({"tokenizer_config": {"lowercase": True}}, "BM25TokenizerConfig"),
        ({"filters": {"lang": "en"}}, "MetadataFilters"),
    ],
)
def test_retriever_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BM25Retriever.from_nodes([chunk("a", "x")], **kwargs)


def test_duplicate_ids_and_non_nodes_rejected() -> None:
    with pytest.raises(ValueError, match="'a'"):
        BM25Retriever.from_nodes([chunk("a", "x"), chunk("a", "y")])
    with pytest.raises(ValueError, match="BaseNode"):
        BM25Retriever.from_nodes(["plain string"])  # type: ignore[list-item]


# ----- persistence -------------------------------------------------------------------------------


def test_persist_round_trip_scores_and_settings(tmp_path: Path, corpus: List[TextNode]) -> None:
    config = BM25TokenizerConfig(lowercase=False, token_pattern=r"\w+", stopwords=["The", "is"], stemmer_language="porter")
    original = BM25Retriever.from_nodes(
        corpus, tokenizer_config=config, k1=1.2, b=0.6, method="bm25+", similarity_top_k=len(corpus), metadata_mode=MetadataMode.EMBED
    )
    original.persist(tmp_path / "idx")
    loaded = BM25Retriever.load(tmp_path / "idx")
    assert loaded.tokenizer_config == config
    assert loaded.params == {"k1": 1.2, "b": 0.6, "method": "bm25+"}
    assert loaded.similarity_top_k == len(corpus)
    assert [n.to_dict() for n in loaded.nodes] == [n.to_dict() for n in original.nodes]
    for query in ["The annual fee", "charged", "payment fees", "Die Jahresgebühr", "lang: en", "nothing-matches"]:
        assert loaded.tokenize(query) == original.tokenize(query)
        assert ranked(loaded, query) == ranked(original, query)  # exact float equality


def test_loaded_index_updates_like_a_fresh_one(tmp_path: Path, corpus: List[TextNode]) -> None:
    BM25Retriever.from_nodes(corpus).persist(tmp_path)
    loaded = BM25Retriever.load(tmp_path, similarity_top_k=10)
    new = chunk("d1-0", "A new annual fee schedule.", "d1")
    loaded.replace_documents([new])
    fresh = BM25Retriever.from_nodes([n for n in corpus if n.ref_doc_id != "d1"] + [new], similarity_top_k=10)
    for query in ["annual fee", "payment", "interest balance"]:
        assert ranked(loaded, query) == ranked(fresh, query)


def test_first_update_after_load_tokenizes_only_the_new_nodes(tmp_path: Path, corpus: List[TextNode]) -> None:
    calls: List[str] = []

    def counting_bigrams(text: str) -> List[str]:
        calls.append(text)
        return bigrams(text)

    config = BM25TokenizerConfig(custom_tokenizer=counting_bigrams, stopwords=None, stemmer_language=None)
    BM25Retriever.from_nodes(corpus, tokenizer_config=config).persist(tmp_path)
    loaded = BM25Retriever.load(tmp_path, custom_tokenizer=counting_bigrams, similarity_top_k=10)
    calls.clear()
    new = chunk("d1-0", "A new annual fee schedule.", "d1")
    loaded.replace_documents([new])
    assert calls == ["a new annual fee schedule."]  # lowercased first; the indexed nodes' tokens came from disk
    fresh = BM25Retriever.from_nodes([n for n in corpus if n.ref_doc_id != "d1"] + [new], tokenizer_config=config, similarity_top_k=10)
    for query in ["annual fee", "payment", "interest balance"]:
        assert ranked(loaded, query) == ranked(fresh, query)


def test_index_saved_without_tokens_still_updates(tmp_path: Path, corpus: List[TextNode]) -> None:
    # Folders written before tokens were persisted: the first update tokenizes the indexed nodes.
    BM25Retriever.from_nodes(corpus).persist(tmp_path)
    config_path = tmp_path / "retriever.json"
    config = json.loads(config_path.read_text())
    del config["has_tokens"]
    config_path.write_text(json.dumps(config))
    (tmp_path / "tokens.npz").unlink()
    (tmp_path / "tokens_vocab.json").unlink()
    loaded = BM25Retriever.load(tmp_path, similarity_top_k=10)
    loaded.delete_ref_doc("d2")
    fresh = BM25Retriever.from_nodes([n for n in corpus if n.ref_doc_id != "d2"], similarity_top_k=10)
    assert ranked(loaded, "fee interest payment") == ranked(fresh, "fee interest payment")


def test_token_files_that_do_not_match_the_nodes_are_an_error(tmp_path: Path, corpus: List[TextNode]) -> None:
    BM25Retriever.from_nodes(corpus).persist(tmp_path / "five")
    BM25Retriever.from_nodes(corpus[:2]).persist(tmp_path / "two")
    (tmp_path / "two" / "tokens.npz").replace(tmp_path / "five" / "tokens.npz")
    (tmp_path / "two" / "tokens_vocab.json").replace(tmp_path / "five" / "tokens_vocab.json")
    with pytest.raises(ValueError, match="tokens of 2 nodes, expected 5"):
        BM25Retriever.load(tmp_path / "five")


token_lists_st = st.lists(st.lists(st.text(min_size=1, max_size=5), max_size=6), max_size=8)


@settings(deadline=None)
@given(tokens=token_lists_st, more=token_lists_st, data=st.data())
def test_packed_tokens_select_extend_and_save(tmp_path_factory, tokens: List[List[str]], more: List[List[str]], data) -> None:
    packed = PackedTokens.pack(tokens)
    assert len(packed) == len(tokens) and list(packed) == [tuple(t) for t in tokens]
    assert PackedTokens.pack(packed) is packed
    keep = data.draw(st.lists(st.sampled_from(range(len(tokens))), unique=True) if tokens else st.just([]))
    updated = packed.select(keep).extend(more)
    expected = [tuple(tokens[i]) for i in keep] + [tuple(t) for t in more]
    assert list(updated) == expected
    assert updated.as_lists() == [list(t) for t in expected]
    assert list(packed) == [tuple(t) for t in tokens]  # select/extend return new objects
    folder = tmp_path_factory.mktemp("tokens")
    updated.save(folder)
    loaded = PackedTokens.load(folder)
    assert list(loaded) == expected
    assert len(loaded.vocab) == len({t for toks in expected for t in toks})  # unused terms dropped


def test_persist_empty_index(tmp_path: Path) -> None:
    BM25Retriever.from_nodes([chunk("a", "the")]).persist(tmp_path)
    loaded = BM25Retriever.load(tmp_path)
    assert len(loaded) == 1 and loaded.retrieve("the") == []


def bigrams(text: str) -> List[str]:
    return [text[i : i + 2] for i in range(len(text) - 1) if not text[i : i + 2].isspace()]


def test_custom_tokenizer_must_be_passed_again(tmp_path: Path, corpus: List[TextNode]) -> None:
    config = BM25TokenizerConfig(custom_tokenizer=bigrams, stopwords=None, stemmer_language=None)
    original = BM25Retriever.from_nodes(corpus, tokenizer_config=config)
    original.persist(tmp_path)
    with pytest.raises(ValueError, match="custom tokenizer"):
        BM25Retriever.load(tmp_path)
    loaded = BM25Retriever.load(tmp_path, custom_tokenizer=bigrams)
    assert ranked(loaded, "Jahresgebühr") == ranked(original, "Jahresgebühr") != []
    BM25Retriever.from_nodes(corpus).persist(tmp_path / "plain")
    with pytest.raises(ValueError, match="without a custom tokenizer"):
        BM25Retriever.load(tmp_path / "plain", custom_tokenizer=bigrams)


def test_load_rejects_non_index_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="retriever.json"):
        BM25Retriever.load(tmp_path)


# ----- filters -----------------------------------------------------------------------------------


def test_filters_in_constructor_and_per_query_views(corpus: List[TextNode]) -> None:
    german = MetadataFilters(filters=[MetadataFilter(key="lang", value="de")])
    recent = MetadataFilters(filters=[MetadataFilter(key="year", value=2022, operator=FilterOperator.GTE)])
    bm25 = BM25Retriever.from_nodes(corpus, filters=german, tokenizer_config=PLAIN)
    assert ranked(bm25, "annual fee") == []
    view = bm25.with_filters(recent)
    assert {node_id for node_id, _ in ranked(view, "the")} == {"d1-1", "d3-0", "d3-1"}
    assert bm25.filters is german and view.filters is recent
    unfiltered = bm25.with_filters(None)
    assert {node_id for node_id, _ in ranked(unfiltered, "annual fee")} == {"d1-0"}
    # views share the index
    bm25.insert_nodes([chunk("d4-0", "The newest annual document", "d4", lang="en", year=2024)])
    assert "d4-0" in {node_id for node_id, _ in ranked(view, "annual")}


def test_filtering_happens_before_top_k() -> None:
    nodes = [chunk(f"x{i}", "fee fee fee", lang="en") for i in range(5)] + [chunk(f"y{i}", "fee", lang="de") for i in range(3)]
    bm25 = BM25Retriever.from_nodes(nodes, tokenizer_config=PLAIN, similarity_top_k=3)
    german = bm25.with_filters(MetadataFilters(filters=[MetadataFilter(key="lang", value="de")]))
    assert [node_id for node_id, _ in ranked(german, "fee")] == ["y0", "y1", "y2"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=corpus_st(), filters=filters_st, query=query_st, small_k=st.integers(1, 3))
def test_filter_isolation(nodes: List[TextNode], filters: MetadataFilters, query: str, small_k: int) -> None:
    """Filtered results == the filter applied to all unfiltered results, and top_k cuts after filtering."""
    bm25 = BM25Retriever.from_nodes(nodes, tokenizer_config=PLAIN, similarity_top_k=len(nodes))
    everything = bm25.retrieve(query)
    filtered = bm25.with_filters(filters).retrieve(query)
    assert all(oracle_matches(r.node.metadata, filters) for r in filtered)
    expected = [(r.node.node_id, r.score) for r in everything if oracle_matches(r.node.metadata, filters)]
    assert [(r.node.node_id, r.score) for r in filtered] == expected
    words = set(query.split())
    assert {r.node.node_id for r in everything} == {n.node_id for n in nodes if words & set(n.text.split())}
    small = BM25Retriever.from_nodes(nodes, tokenizer_config=PLAIN, similarity_top_k=small_k, filters=filters)
    assert [(r.node.node_id, r.score) for r in small.retrieve(query)] == expected[:small_k]


# ----- updates -----------------------------------------------------------------------------------


def test_replace_documents_replaces_every_old_chunk_of_a_document(corpus: List[TextNode]) -> None:
    bm25 = BM25Retriever.from_nodes(corpus, similarity_top_k=20)
    new_version = [chunk("d1-v2-0", "The annual fee is now waived.", "d1", lang="en", year=2024)]
    assert bm25.replace_documents(new_version) == 2  # d1-0 and d1-1, though no new id matches them
    ids = [n.node_id for n in bm25.nodes]
    assert len(ids) == len(set(ids))
    assert "d1-0" not in ids and "d1-1" not in ids and "d1-v2-0" in ids
    assert ranked(bm25, "minimum payment missed") == []  # only the old d1-1 had these words
    fresh = BM25Retriever.from_nodes([n for n in corpus if n.ref_doc_id != "d1"] + new_version, similarity_top_k=20)
    for query in ["annual fee", "charged", "statement days"]:
        assert ranked(bm25, query) == ranked(fresh, query)


def test_insert_same_node_id_updates_and_delete(corpus: List[TextNode]) -> None:
    bm25 = BM25Retriever.from_nodes(corpus, similarity_top_k=20)
    bm25.insert_nodes([chunk("d3-0", "Interest rates are fixed.")])  # no ref doc: replaced by id only
    assert [n.text for n in bm25.nodes if n.node_id == "d3-0"] == ["Interest rates are fixed."]
    assert "d3-1" in {n.node_id for n in bm25.nodes}
    assert bm25.delete_ref_doc("d3") == 1
    assert bm25.delete_ref_doc("missing") == 0
    assert bm25.delete_nodes(["d2-0", "nope"]) == 1
    assert sorted(n.node_id for n in bm25.nodes) == ["d1-0", "d1-1", "d3-0"]
    assert ranked(bm25, "disputes") == [] and ranked(bm25, "Jahresgebühr") == []


NODE_BATCH = st.lists(
    st.tuples(st.sampled_from(["c0", "c1", "c2", "c3"]), st.sampled_from(["docA", "docB", None]), st.lists(st.sampled_from(WORDS), max_size=4)),
    min_size=1,
    max_size=3,
    unique_by=lambda t: t[0],
)
op_st = st.one_of(
    st.tuples(st.just("insert"), NODE_BATCH),
    st.tuples(st.just("replace"), NODE_BATCH, st.lists(st.sampled_from(["docA", "docB"]), max_size=2)),
    st.tuples(st.just("delete_ref"), st.sampled_from(["docA", "docB"])),
    st.tuples(st.just("delete_nodes"), st.lists(st.sampled_from(["c0", "c1", "c2", "c3"]), max_size=2)),
)


def _model_conflicts(model: Dict[str, TextNode], batch: List[TextNode], replaced: set) -> List[str]:
    """Node ids of ``batch`` held by another document that the write does not replace."""
    return [
        n.node_id
        for n in batch
        for owner in [model[n.node_id].ref_doc_id if n.node_id in model else None]
        if n.ref_doc_id is not None and owner is not None and owner != n.ref_doc_id and owner not in replaced
    ]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op_st, max_size=6), query=query_st)
def test_updates_match_a_model_and_a_fresh_build(ops: list, query: str) -> None:
    """insert_nodes replaces by node id only; replace_documents also drops the documents' other nodes;
    a node id held by another document is refused and changes nothing."""
    bm25 = BM25Retriever.from_nodes([], tokenizer_config=PLAIN, similarity_top_k=10)
    model: Dict[str, TextNode] = {}
    for op in ops:
        if op[0] in ("insert", "replace"):
            batch = [chunk(f"{node_id}", " ".join(words), doc) for node_id, doc, words in op[1]]
            ids = {n.node_id for n in batch}
            replaced = set(op[2]) | {n.ref_doc_id for n in batch if n.ref_doc_id} if op[0] == "replace" else set()
            before = bm25.snapshot
            if _model_conflicts(model, batch, replaced):
                with pytest.raises(ChunkIdConflictError) as caught:
                    bm25.insert_nodes(batch) if op[0] == "insert" else bm25.replace_documents(batch, doc_ids=op[2])
                assert {c.chunk_id for c in caught.value.conflicts} == set(_model_conflicts(model, batch, replaced))
                assert bm25.snapshot is before
                continue
            model = {k: v for k, v in model.items() if k not in ids and v.ref_doc_id not in replaced}
            model.update({n.node_id: n for n in batch})
            if op[0] == "insert":
                bm25.insert_nodes(batch)
            else:
                removed = bm25.replace_documents(batch, doc_ids=op[2])
                assert removed == len(before.nodes) + len(batch) - len(bm25.snapshot.nodes)
        elif op[0] == "delete_ref":
            model = {k: v for k, v in model.items() if v.ref_doc_id != op[1]}
            bm25.delete_ref_doc(op[1])
        else:
            model = {k: v for k, v in model.items() if k not in op[1]}
            bm25.delete_nodes(op[1])
    ids = [n.node_id for n in bm25.nodes]
    assert sorted(ids) == sorted(model)
    assert {n.node_id: n.text for n in bm25.nodes} == {k: v.text for k, v in model.items()}
    fresh = BM25Retriever.from_nodes(list(model.values()), tokenizer_config=PLAIN, similarity_top_k=10)
    assert ranked(bm25, query) == ranked(fresh, query)


def test_insert_nodes_in_batches_keeps_every_chunk_of_a_document() -> None:
    """LlamaIndex's convention (a pipeline or a streaming loader inserts a document's chunks in batches)."""
    doc = Document(id_="handbook.md", text=" ".join(f"Policy {i}: employees get {i} extra days for reason{i}." for i in range(300)))
    nodes = SentenceSplitter(chunk_size=128, chunk_overlap=0).get_nodes_from_documents([doc])
    assert len(nodes) > 10 and {n.ref_doc_id for n in nodes} == {"handbook.md"}
    bm25 = BM25Retriever([], similarity_top_k=5)
    half = len(nodes) // 2
    bm25.insert_nodes(nodes[:half])
    bm25.insert_nodes(nodes[half:])
    assert sorted(n.node_id for n in bm25.nodes) == sorted(n.node_id for n in nodes)
    fresh = BM25Retriever(nodes, similarity_top_k=5)
    for query in ("reason3 extra days", "reason297", "Policy 150"):
        assert ranked(bm25, query) == ranked(fresh, query) and ranked(bm25, query)


def test_a_node_id_of_another_document_is_refused_and_changes_nothing(corpus: List[TextNode]) -> None:
    bm25 = BM25Retriever.from_nodes(corpus, similarity_top_k=20)
    before = bm25.snapshot
    page2 = chunk("d1-0", "Page two: the late fee is 40 dollars.", "d1-page2")
    page2.metadata["doc_id"] = "report"
    for write in (lambda: bm25.insert_nodes([page2]), lambda: bm25.replace_documents([page2])):
        with pytest.raises(ChunkIdConflictError) as caught:
            write()
        message = str(caught.value)
        assert "'d1-0'" in message and "'d1'" in message and "'d1-page2'" in message
        assert "metadata['doc_id']='report'" in message and "give each Document its own metadata['doc_id']" in message
        assert [(c.chunk_id, c.indexed_doc, c.incoming_doc) for c in caught.value.conflicts] == [("d1-0", "d1", "d1-page2")]
        assert bm25.snapshot is before
    # replacing d1 itself in the same call frees its ids
    assert bm25.replace_documents([page2], doc_ids=["d1"]) == 2
    assert {n.node_id: n.ref_doc_id for n in bm25.nodes}["d1-0"] == "d1-page2"
    # two documents' nodes with one id in one batch, and a node of no document (replaced by id)
    with pytest.raises(ChunkIdConflictError, match="'x'.*'a'.*'b'"):
        BM25Retriever([chunk("x", "one", "a"), chunk("x", "two", "b")])
    with pytest.raises(ValueError, match="node ids must be unique within one call"):
        bm25.insert_nodes([chunk("y", "one", "a"), chunk("y", "two", "a")])
    bm25.insert_nodes([chunk("d3-0", "no document")])
    assert "d3-1" in {n.node_id for n in bm25.nodes}


def test_replace_documents_empties_a_document_given_by_id(corpus: List[TextNode]) -> None:
    bm25 = BM25Retriever.from_nodes(corpus, similarity_top_k=20)
    assert bm25.replace_documents([], doc_ids=["d3", "missing"]) == 2
    assert sorted(n.node_id for n in bm25.nodes) == ["d1-0", "d1-1", "d2-0"]
    before = bm25.snapshot
    assert bm25.replace_documents([], doc_ids=["missing"]) == 0 and bm25.snapshot is before
    for bad in ("d1", [1]):
        with pytest.raises(ValueError, match="doc_ids must be a list of str document ids"):
            bm25.replace_documents([], doc_ids=bad)  # type: ignore[arg-type]


# ----- no mutation -------------------------------------------------------------------------------


def test_caller_nodes_are_never_mutated_or_shared(corpus: List[TextNode], tmp_path: Path) -> None:
    before = [n.to_dict() for n in corpus]
    bm25 = BM25Retriever.from_nodes(corpus, similarity_top_k=10)
    results = bm25.retrieve("annual fee charged")
    bm25.insert_nodes([chunk("d1-0", "replacement text", "d1")])
    bm25.persist(tmp_path)
    assert [n.to_dict() for n in corpus] == before
    assert all(r.node is not n for r in results for n in corpus)
    # changing the caller's node or a returned node does not change the index
    corpus[3].metadata["lang"] = "xx"
    corpus[3].text = "changed"
    results = bm25.retrieve("interest")
    results[0].node.metadata["lang"] = "yy"
    again = bm25.retrieve("interest")
    assert again[0].node.text.startswith("Interest") and again[0].node.metadata["lang"] == "en"


def test_relationships_are_shared_with_neither_the_caller_nor_the_results() -> None:
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo

    source = RelatedNodeInfo(node_id="doc-z", metadata={"file_name": "z.txt", "tags": ["a"]}, hash="h1")
    children = [RelatedNodeInfo(node_id="c1", metadata={"page": 1})]
    node = chunk("z-0", "zeppelin hangar maintenance", "doc-z")
    node.relationships[NodeRelationship.SOURCE] = source
    node.relationships[NodeRelationship.CHILD] = children
    bm25 = BM25Retriever.from_nodes([node, chunk("y-0", "unrelated text about fees", "doc-y")], similarity_top_k=2)
    want = bm25.retrieve("zeppelin")[0].node.to_dict()
    # the caller changes the relationships it inserted, in place
    source.node_id, source.hash = "changed", "changed"
    source.metadata["file_name"] = "changed.txt"
    source.metadata["tags"].append("b")
    children[0].metadata["page"] = 9
    children.append(RelatedNodeInfo(node_id="c2"))
    assert bm25.retrieve("zeppelin")[0].node.to_dict() == want
    # a result's relationships changed in place
    result = bm25.retrieve("zeppelin")[0].node
    result.relationships[NodeRelationship.SOURCE].metadata["tags"].append("c")
    result.relationships[NodeRelationship.SOURCE].node_id = "changed"
    result.relationships[NodeRelationship.CHILD][0].metadata["page"] = 7
    assert bm25.retrieve("zeppelin")[0].node.to_dict() == want



def test_indexed_documents_text_resource_is_shared_with_neither_caller_nor_results() -> None:
    """Whole ``Document`` objects indexed (their text lives in ``text_resource``, a pydantic model):
    editing a result's, or the caller's, text resource changes neither the index nor later results."""
    from llama_index.core.schema import Document

    doc = Document(id_="D", text="annual fee is ninety five dollars", metadata={"doc_id": "D"})
    other = Document(id_="E", text="refund policy lasts thirty days", metadata={"doc_id": "E"})
    bm25 = BM25Retriever.from_nodes([doc, other], similarity_top_k=1)
    bm25.retrieve("annual fee")[0].node.text_resource.text = "overwritten by a caller editing its result"
    assert doc.text == "annual fee is ninety five dollars"
    doc.text_resource.text = "the caller reuses its document"
    assert bm25.retrieve("annual fee")[0].node.text == "annual fee is ninety five dollars"


# ----- query input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("query", ["annual \ud800 fee", "\udfff", "fee\udc80s"])
def test_a_query_with_a_lone_surrogate_is_refused_with_its_position(corpus: List[TextNode], query: str) -> None:
    bm25 = BM25Retriever(corpus)
    position = next(i for i, c in enumerate(query) if 0xD800 <= ord(c) <= 0xDFFF)
    with pytest.raises(ValueError, match=rf"query text contains a lone surrogate .* at position {position}; it is not valid Unicode"):
        bm25.retrieve(query)
    # A custom pattern that keeps the surrogate used to crash in the stemmer (UnicodeEncodeError).
    anything = BM25Retriever(corpus, tokenizer_config=BM25TokenizerConfig(token_pattern=r"\S+"))
    with pytest.raises(ValueError, match="lone surrogate"):
        anything.retrieve(query)
    assert ranked(bm25, "annual fee")[0][0] == "d1-0"


def test_a_bytes_or_non_text_query_is_a_clear_error(corpus: List[TextNode]) -> None:
    import asyncio

    from llama_index.core.schema import QueryBundle

    bm25 = BM25Retriever(corpus)
    with pytest.raises(ValueError, match=r"the query must be a str, got bytes b'fees': decode it first"):
        bm25.retrieve(b"fees")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"QueryBundle.query_str must be a str, got bytes"):
        bm25.retrieve(QueryBundle(query_str=b"fees"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the query must be a str, got bytes"):
        asyncio.run(bm25.aretrieve(b"fees"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "shown"), [("5", "'5' (str)"), (None, "None (NoneType)"), (True, "True (bool)")])
def test_similarity_top_k_must_be_a_real_int(corpus: List[TextNode], value: object, shown: str) -> None:
    message = re.escape(f"similarity_top_k must be an int >= 1, got {shown}")
    with pytest.raises(ValueError, match=message):
        BM25Retriever(corpus, similarity_top_k=value)  # type: ignore[arg-type]
    if value is not None:  # with_filters(similarity_top_k=None) keeps the retriever's own
        with pytest.raises(ValueError, match=message):
            BM25Retriever(corpus).with_filters(None, similarity_top_k=value)  # type: ignore[arg-type]


def test_insert_nodes_with_precomputed_tokens_equals_tokenizing() -> None:
    nodes = [TextNode(text=f"annual fee {i} waived for students", id_=f"n{i}") for i in range(4)]
    plain = BM25Retriever.from_nodes(nodes[:2], similarity_top_k=4)
    given = BM25Retriever.from_nodes(nodes[:2], similarity_top_k=4)
    plain.insert_nodes(nodes[2:])
    given.insert_nodes(nodes[2:], tokens=[given.node_tokens(n) for n in nodes[2:]])
    rank = lambda r: [(x.node.node_id, round(x.score, 9)) for x in r.retrieve("fee waived 3")]  # noqa: E731
    assert rank(plain) == rank(given) and len(rank(given)) == 4
    with pytest.raises(ValueError, match="got 1 nodes but 2 token lists"):
        given.insert_nodes(nodes[:1], tokens=[["a"], ["b"]])
