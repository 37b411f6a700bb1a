"""Queries running while another thread writes the index see one committed state, whole.

A deterministic hash embedding (one unit vector per text) makes every dense score checkable: a
result's dense leg must be the cosine between the query and the embedding of the very text the
result carries. A write that reloads the embedded shard (delete, replacing upsert) must never give
a query an all-zero dense leg, and a write between a fused query's two legs must never pair one
generation's text with another generation's vector.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import numpy as np
import pytest
from llama_index.core import Document
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.retrievers import HybridRetriever
from llama_index_retrieval_kit.retrievers.fusion import FusedNodeWithScore

DIM = 16
QUERY = "annual fee of X"
WRITES = 25  # write cycles per test; readers query until the writer is done


def _vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    vec = np.random.default_rng(seed).standard_normal(DIM)
    return vec / np.linalg.norm(vec)


class HashEmbedding(BaseEmbedding):
    """One deterministic unit vector per text: a stored vector tells which text it was made from."""

    @classmethod
    def class_name(cls) -> str:
        return "HashEmbedding"

    def _get_text_embedding(self, text: str) -> List[float]:
        return _vector(text).tolist()

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        return [_vector(t).tolist() for t in texts]

    def _get_query_embedding(self, query: str) -> List[float]:
        return _vector(query).tolist()

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return _vector(query).tolist()


def _own_cosine(result: NodeWithScore) -> float:
    return float(_vector(QUERY) @ _vector(result.node.get_content(metadata_mode=MetadataMode.EMBED)))


def _doc(doc_id: str, text: str) -> Document:
    return Document(id_=doc_id, text=text, metadata={"doc_id": doc_id})


def _dense_score(result: NodeWithScore) -> float:
    return result.leg_scores["dense"] if isinstance(result, FusedNodeWithScore) else result.score


def _query_while_writing(index: HybridIndex, write: Callable[[int], None], retrievers: Dict[str, Any]) -> Dict[str, list]:
    """Run ``write(0..WRITES-1)`` in one thread while one thread per retriever queries in a loop;
    returns, per retriever, (text, dense score, own cosine) of every result whose dense score is
    not its own text's, and the number of results checked (key ``"<name> checked"``)."""
    done = threading.Event()
    wrong: Dict[str, list] = {name: [] for name in retrievers}
    checked = {name: 0 for name in retrievers}
    errors: List[BaseException] = []

    def read(name: str, retriever: Any) -> None:
        try:
            while not done.is_set() or not checked[name]:
                for result in retriever.retrieve(QUERY):
                    if isinstance(result, FusedNodeWithScore) and "dense" not in result.leg_scores:
                        continue
                    checked[name] += 1
                    if abs(_dense_score(result) - _own_cosine(result)) > 1e-4:
                        wrong[name].append((result.node.get_content(), _dense_score(result), _own_cosine(result)))
        except BaseException as exc:  # surfaced in the test thread
            errors.append(exc)
            done.set()

    readers = [threading.Thread(target=read, args=item) for item in retrievers.items()]
    for thread in readers:
        thread.start()
    try:
        for i in range(WRITES):
            if errors:
                break
            write(i)
    finally:
        done.set()
        for thread in readers:
            thread.join()
    if errors:
        raise errors[0]
    return {**wrong, **{f"{name} checked": [checked[name]] for name in retrievers}}


@pytest.fixture()
def fee_index(tmp_path: Path) -> Iterator[HybridIndex]:
    docs = [_doc(f"d{i}", f"Clause {i}. The annual fee is {10 + i} dollars.") for i in range(20)]
    docs.append(_doc("X", "The annual fee of X is 10 dollars."))
    index = HybridIndex.from_documents(docs, tmp_path / "idx", embed_model=HashEmbedding(model_name="hash16"))
    yield index
    index.close()


def test_dense_leg_is_never_zeroed_by_a_shard_reload(fee_index: HybridIndex) -> None:
    """delete + re-add reload the Edge shard at commit; dense and hybrid queries meanwhile keep
    their true cosines (an all-zero dense matrix was once returned, and cached, during the reload)."""

    def write(i: int) -> None:
        fee_index.delete("d19")
        fee_index.upsert([_doc("d19", f"Clause 19. The annual fee is {50 + i} dollars.")])

    found = _query_while_writing(
        fee_index,
        write,
        {
            "dense": fee_index.as_retriever("dense", similarity_top_k=5),
            "dense, deeper": fee_index.as_retriever("dense", similarity_top_k=21),
            "hybrid": fee_index.as_retriever("hybrid", similarity_top_k=5),
        },
    )
    for name in ("dense", "dense, deeper", "hybrid"):
        assert found[f"{name} checked"][0] > 0
        assert found[name] == [], name


def test_fused_results_pair_each_text_with_its_own_vector(fee_index: HybridIndex) -> None:
    """X is upserted again and again with a new fee (same chunk id, new text and vector): the
    in-memory fusion and the Qdrant-side one report, for every result, its own text's cosine."""

    def write(i: int) -> None:
        fee_index.upsert([_doc("X", f"The annual fee of X is {11 + i} dollars.")])

    found = _query_while_writing(
        fee_index,
        write,
        {
            "hybrid": fee_index.as_retriever("hybrid", similarity_top_k=21),
            "hybrid_score+qdrant": fee_index.as_retriever("hybrid_score", similarity_top_k=21, dense_search="qdrant"),
            "hybrid_rrf+qdrant": fee_index.as_retriever("hybrid_rrf", similarity_top_k=21, dense_search="qdrant"),
        },
    )
    for name in ("hybrid", "hybrid_score+qdrant", "hybrid_rrf+qdrant"):
        assert found[f"{name} checked"][0] > 0
        assert found[name] == [], name


def test_index_built_qdrant_fusion_answers_async_queries(fee_index: HybridIndex) -> None:
    """``aretrieve`` of the Qdrant-side fusion (legs under the index's read lock) gives the
    synchronous answer."""
    retriever = fee_index.as_retriever("hybrid_score", similarity_top_k=5, dense_search="qdrant")
    expected = [(r.node.node_id, r.score) for r in retriever.retrieve(QUERY)]
    got = asyncio.run(retriever.aretrieve(QUERY))
    assert [(r.node.node_id, r.score) for r in got] == expected


class _RecordingGuard:
    """A read guard that counts how many queries hold it."""

    def __init__(self) -> None:
        self.held = 0
        self.entered = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        self.held += 1
        self.entered += 1
        try:
            yield
        finally:
            self.held -= 1


def _leg(guard: _RecordingGuard, seen: List[int], text: str):
    from llama_index.core.base.base_retriever import BaseRetriever

    class Leg(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
            seen.append(guard.held)
            return [NodeWithScore(node=TextNode(id_=text, text=text), score=1.0)]

    return Leg()


@pytest.mark.parametrize("run", ["sync", "async"])
def test_hybrid_retriever_holds_read_guard_around_all_legs(run: str) -> None:
    guard = _RecordingGuard()
    seen: List[int] = []
    retriever = HybridRetriever([_leg(guard, seen, "a"), _leg(guard, seen, "b")], read_guard=guard)
    results = retriever.retrieve("q") if run == "sync" else asyncio.run(retriever.aretrieve("q"))
    assert sorted(r.node.node_id for r in results) == ["a", "b"]
    assert seen == [1, 1] and guard.entered == 1 and guard.held == 0


def test_hybrid_retriever_refuses_a_read_guard_that_is_not_callable() -> None:
    guard = _RecordingGuard()
    with pytest.raises(TypeError, match="read_guard"):
        HybridRetriever([_leg(guard, [], "a"), _leg(guard, [], "b")], read_guard="lock")
