"""Postprocessor constructor options: misspelt ones refused; a ContextAssembler's ``tokenizer=``
carried through to_dict (named), pickling (kept) and from_dict (asked for again)."""

from __future__ import annotations

import pickle
from typing import List

import pytest
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_retrieval_kit import ContextAssembler, CrossEncoderReranker, NoAnswerPostprocessor


def words(text: str) -> List[str]:
    """A module-level (picklable) tokenizer that counts whitespace-separated words."""
    return text.split()


@pytest.mark.parametrize(
    "cls, kwargs, option, allowed",
    [
        (NoAnswerPostprocessor, {}, "treshold", "threshold"),
        (ContextAssembler, {"max_tokens": 100}, "ordr", "order"),
        (CrossEncoderReranker, {}, "topn", "top_n"),
    ],
)
def test_a_misspelt_option_is_refused_listing_the_allowed_ones(cls: type, kwargs: dict, option: str, allowed: str) -> None:
    with pytest.raises(TypeError, match=rf"{cls.__name__} got unknown option\(s\) '{option}'; allowed:.*\b{allowed}\b"):
        cls(**kwargs, **{option: 3})


@pytest.mark.parametrize(
    "component",
    [
        NoAnswerPostprocessor(threshold=0.7, similarity_cutoff=0.2),
        ContextAssembler(max_tokens=120, order="relevance"),
        CrossEncoderReranker(top_n=3, max_candidates=6),
    ],
    ids=lambda c: type(c).__name__,
)
def test_llama_index_construction_paths_still_work(component: object) -> None:
    cls = type(component)
    data = component.to_dict()
    assert cls.from_dict(data).to_dict() == data
    assert cls.from_json(component.to_json()).to_dict() == data
    assert cls.model_validate(data).to_dict() == data
    assert pickle.loads(pickle.dumps(component)).to_dict() == data
    assert cls.from_dict(data, callback_manager=CallbackManager([])).to_dict() == data


def context(assembler: ContextAssembler) -> List[str]:
    text = " ".join(f"Clause {i}: the late fee is payable within thirty days of notice." for i in range(30))
    node = TextNode(id_="c0", text=text, metadata={"source": "fees.txt", "doc_id": "fees.txt", "char_start": 0, "char_end": len(text)})
    return [r.node.get_content() for r in assembler.postprocess_nodes([NodeWithScore(node=node, score=1.0)], query_str="late fee")]


def test_assembler_tokenizer_is_named_kept_by_pickle_and_asked_for_by_from_dict() -> None:
    assembler = ContextAssembler(max_tokens=60, tokenizer=words)
    assert context(assembler) != context(ContextAssembler(max_tokens=60))  # the tokenizer sets the budget here
    data = assembler.to_dict()
    assert data["tokenizer_callable"] == f"custom:{__name__}.words"
    assert context(pickle.loads(pickle.dumps(assembler))) == context(assembler)
    with pytest.raises(ValueError, match="tokenizer="):
        ContextAssembler.from_dict(data)
    assert context(ContextAssembler.from_dict(data, tokenizer=words)) == context(assembler)
    with pytest.raises(pickle.PicklingError, match="module-level function"):
        pickle.dumps(ContextAssembler(max_tokens=60, tokenizer=lambda s: s.split()))


def test_a_used_assembler_deep_copies_and_pickles_like_a_new_one(caplog: pytest.LogCaptureFixture) -> None:
    """Locks, context variables and cached tokenizers are runtime state: a deep copy starts them
    afresh (it raised TypeError on the lock), a pickle leaves them out (LlamaIndex warned for each)."""
    import copy

    assembler = ContextAssembler(max_tokens=60, tokenizer=words)
    first = context(assembler)
    assert assembler.last_report is not None
    twin = copy.deepcopy(assembler)
    assert twin.to_dict() == assembler.to_dict() and twin.last_report is None
    assert context(twin) == first
    with caplog.at_level("WARNING"):
        restored = pickle.loads(pickle.dumps(assembler))
    assert "unpickleable" not in caplog.text
    assert context(restored) == first and context(assembler) == first
