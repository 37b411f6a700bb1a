"""Parser options that LlamaIndex's own paths carry: a ``tokenizer=`` callable through to_dict,
pickling, IngestionCache hashes and index manifests; ``include_metadata``; ``id_func``; misspelt options."""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import List

import pytest
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.ingestion import IngestionCache, IngestionPipeline
from llama_index.core.ingestion.pipeline import get_transformation_hash
from llama_index.core.schema import Document

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices.hybrid_index import node_parser_changes
from llama_index_retrieval_kit.node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from llama_index_retrieval_kit.node_parser.tokenizer_identity import tokenizer_label

TEXT = "# Fees\n\nThe late fee is forty dollars per month. Tokenization counts differ by tokenizer. " * 6


def words(text: str) -> List[str]:
    """A module-level (picklable) tokenizer that counts whitespace-separated words."""
    return text.split()


def doc(**metadata: object) -> Document:
    return Document(text=TEXT, id_="fees.md", metadata={"source": "fees.md", "tenant": "acme", **metadata})


def texts(parser: SectionWindowNodeParser) -> List[str]:
    return [n.text for n in parser.get_nodes_from_documents([doc()])]


@pytest.fixture(scope="module")
def word_parser() -> SectionWindowNodeParser:
    parser = SectionWindowNodeParser(tokenizer=words, chunk_size=12, chunk_overlap=2)
    assert texts(parser) != texts(SectionWindowNodeParser(chunk_size=12, chunk_overlap=2))  # the tokenizer matters here
    return parser


# ----- tokenizer= -----------------------------------------------------------------------------------
def test_to_dict_names_the_tokenizer(word_parser: SectionWindowNodeParser) -> None:
    assert word_parser.to_dict()["tokenizer_callable"] == f"custom:{__name__}.words"
    assert SectionWindowNodeParser().to_dict()["tokenizer_callable"] is None


def test_pickle_keeps_the_tokenizer(word_parser: SectionWindowNodeParser) -> None:
    copy = pickle.loads(pickle.dumps(word_parser))
    assert copy.tokenizer_callable == word_parser.tokenizer_callable
    assert texts(copy) == texts(word_parser)


def test_pickling_an_unpicklable_tokenizer_is_refused() -> None:
    parser = SectionWindowNodeParser(tokenizer=lambda s: s.split())
    with pytest.raises(pickle.PicklingError, match="module-level function"):
        pickle.dumps(parser)


def test_from_dict_needs_the_tokenizer_again(word_parser: SectionWindowNodeParser) -> None:
    with pytest.raises(ValueError, match="tokenizer="):
        SectionWindowNodeParser.from_dict(word_parser.to_dict())
    with pytest.raises(ValueError, match="tokenizer="):
        SectionWindowNodeParser.from_json(word_parser.to_json())
    again = SectionWindowNodeParser.from_dict(word_parser.to_dict(), tokenizer=words)
    assert texts(again) == texts(word_parser)
    assert again.to_dict() == word_parser.to_dict()


def test_ingestion_cache_tells_tokenizers_apart(word_parser: SectionWindowNodeParser) -> None:
    docs = [doc()]
    default = SectionWindowNodeParser(chunk_size=12, chunk_overlap=2)
    assert get_transformation_hash(docs, word_parser) != get_transformation_hash(docs, default)
    cache = IngestionCache()
    IngestionPipeline(transformations=[default], cache=cache).run(documents=docs)
    warm = IngestionPipeline(transformations=[word_parser], cache=cache).run(documents=docs)
    assert [n.text for n in warm] == texts(word_parser)


def test_tokenizer_labels_tell_callables_apart() -> None:
    tiktoken = pytest.importorskip("tiktoken")
    encoding = tiktoken.Encoding(name="toy_enc", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={})
    assert tokenizer_label(encoding.encode) == "tiktoken:toy_enc"
    assert tokenizer_label(functools.partial(encoding.encode, allowed_special="all")) == "tiktoken:toy_enc"
    assert tokenizer_label(str.split) == "custom:builtins.str.split"
    one, two = (lambda s: s.split()), (lambda s: list(s))
    assert tokenizer_label(one) != tokenizer_label(two)
    assert tokenizer_label(functools.partial(words)) != tokenizer_label(words)


def test_node_parser_changes_reports_a_tokenizer_change(word_parser: SectionWindowNodeParser) -> None:
    default = SectionWindowNodeParser(chunk_size=12, chunk_overlap=2).to_dict()
    changes = node_parser_changes(word_parser.to_dict(), default)
    assert len(changes) == 1 and changes[0].startswith("tokenizer_callable:")
    older = {k: v for k, v in default.items() if k != "tokenizer_callable"}  # an index.json from before the field
    assert node_parser_changes(older, default) == []
    assert [c.split(":")[0] for c in node_parser_changes(older, word_parser.to_dict())] == ["tokenizer_callable"]


def test_index_built_with_a_tokenizer_callable_needs_the_parser_to_load(tmp_path: Path, word_parser: SectionWindowNodeParser) -> None:
    model = MockEmbedding(embed_dim=8)
    folder = tmp_path / "index"
    with HybridIndex.from_documents([doc()], folder, embed_model=model, node_parser=word_parser) as index:
        built = sorted(index.docstore.docs)
    with pytest.raises(ValueError, match="node_parser="):
        HybridIndex.load(folder, embed_model=model)
    with pytest.raises(ValueError, match="tokenizer_callable"):
        with HybridIndex.load(folder, embed_model=model, node_parser=SectionWindowNodeParser(chunk_size=12, chunk_overlap=2)) as index:
            index.upsert([doc()])
    with HybridIndex.load(folder, embed_model=model, node_parser=SectionWindowNodeParser(tokenizer=words, chunk_size=12, chunk_overlap=2)) as index:
        index.upsert([doc()])
        assert sorted(index.docstore.docs) == built


# ----- include_metadata / id_func -----------------------------------------------------------------
@pytest.mark.parametrize("cls", [SectionWindowNodeParser, SectionHierarchyNodeParser])
def test_include_metadata_false_keeps_only_the_contract(cls: type) -> None:
    document = doc(page_starts=[0, 200], author="bob")
    with_doc = cls().get_nodes_from_documents([document])
    without = cls(include_metadata=False).get_nodes_from_documents([document])
    assert [n.node_id for n in without] == [n.node_id for n in with_doc]
    for full, bare in zip(with_doc, without):
        assert {"tenant", "author"} <= set(full.metadata)
        assert set(bare.metadata) == set(full.metadata) - {"tenant", "author"}
        assert all(bare.metadata[k] == full.metadata[k] for k in bare.metadata)
        assert set(bare.excluded_embed_metadata_keys) <= set(bare.metadata)


def test_a_custom_id_func_is_refused_and_the_default_round_trips() -> None:
    with pytest.raises(ValueError, match="deterministic"):
        SectionWindowNodeParser(id_func=lambda i, d: f"custom-{i}")
    parser = SectionWindowNodeParser(chunk_size=50, chunk_overlap=5)
    again = SectionWindowNodeParser.from_dict(parser.to_dict())
    assert again.to_dict() == parser.to_dict()
    assert [n.node_id for n in again.get_nodes_from_documents([doc()])] == [n.node_id for n in parser.get_nodes_from_documents([doc()])]


# ----- unknown options ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, option, allowed",
    [(SectionWindowNodeParser, "chunk_sise", "chunk_size"), (SectionHierarchyNodeParser, "child_size", "child_chunk_size")],
)
def test_a_misspelt_option_is_refused_listing_the_allowed_ones(cls: type, option: str, allowed: str) -> None:
    with pytest.raises(TypeError, match=rf"'{option}'.*allowed:.*\b{allowed}\b") as caught:
        cls(**{option: 10})
    assert "tokenizer" in str(caught.value) and "include_metadata" in str(caught.value)


@pytest.mark.parametrize("cls", [SectionWindowNodeParser, SectionHierarchyNodeParser])
def test_llama_index_construction_paths_still_work(cls: type) -> None:
    from llama_index.core.callbacks import CallbackManager

    parser = cls(callback_manager=CallbackManager([]), include_prev_next_rel=False)
    data = parser.to_dict()
    assert cls.from_dict(data).to_dict() == data
    assert cls.from_json(parser.to_json()).to_dict() == data
    assert cls.model_validate(data).to_dict() == data
    assert pickle.loads(pickle.dumps(parser)).to_dict() == data
