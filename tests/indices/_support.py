"""Helpers shared by the HybridIndex tests (and tests/retrievers/test_qdrant_hybrid.py).

One embedding model per process (``embed_model``), one index built per session from the bundled
samples (``build_template``) that tests copy and reopen, and checkers that read every leg of an
index (docstore, BM25, Qdrant dense and sparse vectors) and compare them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.schema import BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import MetadataFilters

from llama_index_retrieval_kit.indices import RETRIEVER_MODES, HybridIndex, embed_texts
from llama_index_retrieval_kit.retrievers.qdrant_hybrid import DENSE_VECTOR, SPARSE_VECTOR, bm25_doc_vector
from llama_index_retrieval_kit.indices.store import point_id
from llama_index_retrieval_kit.samples import QUESTIONS_FILE, sample_files

PAGE_CHARS = 1500  # synthetic page size given to the text samples, so page_start varies
CHANGED_DOC = "privacy_policy.txt"
OLD_SENTENCE = "We do not collect your precise GPS location, and we never access your contacts or photos."
NEW_SENTENCE = (
    "We estimate your approximate region from the zephyrquartz network beacon each day, "
    "but we never access your contacts or photos, and we keep no history of past regions."
)

Ranking = List[Tuple[str, float]]

#: Every kind of retriever ``as_retriever`` builds: (mode, options).
RETRIEVER_KINDS: List[Tuple[str, Dict[str, Any]]] = [
    ("sparse", {}),
    ("dense", {}),
    ("dense", {"dense_search": "qdrant"}),
    ("hybrid", {}),
    ("hybrid_score", {}),
    ("hybrid_rrf", {}),
    ("hybrid", {"dense_search": "qdrant"}),
    ("hybrid_rrf", {"dense_search": "qdrant"}),
    ("qdrant_hybrid", {}),
]


@functools.lru_cache(maxsize=1)
def embed_model():
    """The packaged offline MiniLM, loaded once per process."""
    from llama_index_retrieval_kit.models import default_embed_model

    return default_embed_model()


@functools.lru_cache(maxsize=1)
def _raw_documents() -> Tuple[Document, ...]:
    from llama_index_retrieval_kit.ingest import read_documents

    docs, failures = read_documents(sample_files())
    assert not failures, failures
    return tuple(docs)


def sample_documents() -> List[Document]:
    """Fresh copies of the three text samples, each cut into synthetic pages of PAGE_CHARS."""
    out = []
    for doc in _raw_documents():
        doc = doc.model_copy(deep=True)
        doc.metadata["page_starts"] = list(range(0, len(doc.text), PAGE_CHARS))
        out.append(doc)
    return out


def changed_document() -> Document:
    """The privacy policy with one sentence of Section 2 replaced by a longer one."""
    (doc,) = [d for d in sample_documents() if d.id_ == CHANGED_DOC]
    assert OLD_SENTENCE in doc.text
    return Document(
        text=doc.text.replace(OLD_SENTENCE, NEW_SENTENCE),
        id_=doc.id_,
        metadata=dict(doc.metadata),
        excluded_embed_metadata_keys=list(doc.excluded_embed_metadata_keys),
        excluded_llm_metadata_keys=list(doc.excluded_llm_metadata_keys),
    )


@functools.lru_cache(maxsize=1)
def questions() -> Tuple[str, ...]:
    with open(QUESTIONS_FILE, encoding="utf-8") as fh:
        return tuple(json.loads(line)["question"] for line in fh if line.strip())


@functools.lru_cache(maxsize=1)
def query_bundles() -> Tuple[QueryBundle, ...]:
    """Every sample question with its query embedding computed once (legs reuse it).

    One batched forward pass (HuggingFaceEmbedding's own query path, ``prompt_name="query"``)
    instead of 38 single ones: the same vectors to float rounding, in a fraction of the time.
    """
    model = embed_model()
    qs = list(questions())
    vectors = model._embed(qs, prompt_name="query") if hasattr(model, "_embed") else [model.get_query_embedding(q) for q in qs]
    return tuple(QueryBundle(q, embedding=list(v)) for q, v in zip(qs, vectors))


# ---------------------------------------------------------------------- the session's index


@dataclass
class Template:
    """A built, closed index folder plus what the freshly built index answered."""

    path: Path
    doc_ids: List[str]
    built_results: Dict[Tuple[str, str], Ranking] = field(default_factory=dict)


ROUND_TRIP_QUERIES = 4
_TEMPLATE: Optional[Template] = None


def build_template(base_dir: Path) -> Template:
    """Build the sample index once per process (later calls return the same folder)."""
    global _TEMPLATE
    if _TEMPLATE is None or not (_TEMPLATE.path / "index.json").exists():
        path = Path(base_dir) / "template"
        index = HybridIndex.from_documents(sample_documents(), path, embed_model=embed_model())
        try:
            results = run_modes(index, query_bundles()[:ROUND_TRIP_QUERIES])
            doc_ids = index.doc_ids()
        finally:
            index.close()
        _TEMPLATE = Template(path=path, doc_ids=doc_ids, built_results=results)
    return _TEMPLATE


@contextlib.contextmanager
def opened_sample_copy(base_dir: Path) -> Iterator[HybridIndex]:
    """A private copy of the sample template under ``base_dir``, open for the ``with`` block."""
    template = build_template(Path(base_dir) / "template_base")
    index = HybridIndex.load(copy_index(template, Path(base_dir) / "index"), embed_model=embed_model())
    try:
        yield index
    finally:
        index.close()


def calibrated_gate(index: HybridIndex, top_k: int) -> Any:
    """A NoAnswerPostprocessor calibrated on the bundled questions (with near misses made by
    excluding each answer's documents), on ``index``'s hybrid retriever at ``top_k``."""
    from llama_index_retrieval_kit import NoAnswerPostprocessor
    from llama_index_retrieval_kit.evaluation import load_jsonl

    return NoAnswerPostprocessor.calibrate(
        index.as_retriever("hybrid", similarity_top_k=top_k),
        load_jsonl(QUESTIONS_FILE),
        exclusion_retriever=lambda f: index.as_retriever("hybrid", similarity_top_k=top_k, filters=f),
        no_answer_text="No answer in these documents.",
    )


def copy_index(template: Template, dest: Path) -> Path:
    """A private copy of the template folder (Qdrant local mode: one client per folder)."""
    shutil.copytree(template.path, dest)
    return dest


# ---------------------------------------------------------------------- querying


def ranking(results: Sequence[NodeWithScore]) -> Ranking:
    return [(r.node.node_id, float(r.score)) for r in results]


def run_modes(
    index: HybridIndex,
    bundles: Iterable[QueryBundle],
    modes: Sequence[str] = RETRIEVER_MODES,
    similarity_top_k: int = 10,
    filters: Optional[MetadataFilters] = None,
) -> Dict[Tuple[str, str], Ranking]:
    """(mode, query) -> [(node id, score)] for every mode and query."""
    out: Dict[Tuple[str, str], Ranking] = {}
    bundles = list(bundles)
    for mode in modes:
        retriever = index.as_retriever(mode, similarity_top_k=similarity_top_k, filters=filters)
        for qb in bundles:
            out[(mode, qb.query_str)] = ranking(retriever.retrieve(qb))
    return out


def assert_same_ranking(got: Ranking, want: Ranking, tol: float = 1e-9, truncated: Optional[bool] = None) -> None:
    """Same scores position by position (within ``tol``) and the same ids, where the order of
    ids may differ only among equal scores. A tie group at the end of a truncated list may hold
    different ids (the cut fell inside the tie)."""
    assert len(got) == len(want), f"{len(got)} results vs {len(want)}:\n{got}\n{want}"
    for i, ((gid, gs), (wid, ws)) in enumerate(zip(got, want)):
        assert math.isclose(gs, ws, rel_tol=0, abs_tol=tol), f"position {i}: {gid} {gs!r} vs {wid} {ws!r}"
    groups: List[List[int]] = []
    for i in range(len(want)):
        if groups and abs(want[i][1] - want[groups[-1][0]][1]) <= tol:
            groups[-1].append(i)
        else:
            groups.append([i])
    for n, group in enumerate(groups):
        g = {got[i][0] for i in group}
        w = {want[i][0] for i in group}
        if truncated and n == len(groups) - 1:
            continue
        assert g == w, f"positions {group[0]}..{group[-1]} (score {want[group[0]][1]!r}): {sorted(g)} vs {sorted(w)}"


# Dense (cosine) scores survive a reopen only to ~1e-8: Qdrant local mode normalises each vector
# again when it loads the collection from disk, which moves the float32 components by an ulp.
# Rank-based (RRF) and BM25 scores come back bit for bit.
REOPEN_TOL = 1e-6


def assert_same_results(
    got: Dict[Tuple[str, str], Ranking], want: Dict[Tuple[str, str], Ranking], top_k: int = 10, tol: float = REOPEN_TOL
) -> None:
    assert got.keys() == want.keys()
    for key in want:
        try:
            assert_same_ranking(got[key], want[key], tol=tol, truncated=len(want[key]) >= top_k)
        except AssertionError as exc:
            raise AssertionError(f"{key}: {exc}") from None


# ---------------------------------------------------------------------- legs


@dataclass
class Legs:
    """What each part of an index holds, by node id."""

    docstore_leaves: Dict[str, BaseNode]
    docstore_parents: Dict[str, BaseNode]
    bm25: Dict[str, BaseNode]
    qdrant: Dict[str, object]  # point id -> Record (payload + vectors)
    qdrant_count: int

    def leaf_ids(self) -> set:
        return set(self.docstore_leaves)


def read_legs(index: HybridIndex) -> Legs:
    docs = index.docstore.docs
    leaves = {i: n for i, n in docs.items() if not n.child_nodes}
    parents = {i: n for i, n in docs.items() if n.child_nodes}
    bm25 = {n.node_id: n for n in index.bm25.nodes}
    assert len(bm25) == len(index.bm25), "duplicate node ids inside the BM25 index"
    points: Dict[str, object] = {}
    for point in index.store.iter_points():
        node_id = json.loads(point.payload["_node_content"])["id_"]
        assert point.point_id == point_id(node_id), f"point {point.point_id} does not have node {node_id}'s point id"
        assert node_id not in points, f"point of node {node_id} listed twice"
        points[node_id] = point
    return Legs(leaves, parents, bm25, points, index.store.count())


def assert_consistent(index: HybridIndex) -> Legs:
    """Every leg holds exactly the docstore's leaves, with the same text, fresh dense vectors
    (the cached embedding of the text) and fresh BM25 sparse vectors; parents only in the docstore."""
    legs = read_legs(index)
    leaf_ids = legs.leaf_ids()
    assert set(legs.bm25) == leaf_ids, (
        f"BM25 vs docstore: extra {sorted(set(legs.bm25) - leaf_ids)[:5]}, missing {sorted(leaf_ids - set(legs.bm25))[:5]}"
    )
    assert set(legs.qdrant) == leaf_ids, (
        f"Qdrant vs docstore: extra {sorted(set(legs.qdrant) - leaf_ids)[:5]}, missing {sorted(leaf_ids - set(legs.qdrant))[:5]}"
    )
    assert legs.qdrant_count == len(leaf_ids) == len(index)
    assert not set(legs.docstore_parents) & set(legs.qdrant)

    # Documents: the same doc ids everywhere, and the docstore's per-document node lists are exact.
    by_doc: Dict[str, set] = {}
    for node_id, node in {**legs.docstore_leaves, **legs.docstore_parents}.items():
        by_doc.setdefault(node.ref_doc_id, set()).add(node_id)
    assert set(index.doc_ids()) == set(by_doc)
    for doc_id, ids in by_doc.items():
        assert set(index.docstore.get_ref_doc_info(doc_id).node_ids) == ids
    assert {n.ref_doc_id for n in legs.bm25.values()} == {legs.docstore_leaves[i].ref_doc_id for i in leaf_ids}

    if not leaf_ids:
        return legs
    ordered = sorted(leaf_ids)
    cached = len(index.cache)
    vectors = embed_texts(
        index.embed_model,
        [legs.docstore_leaves[i].get_content(metadata_mode=MetadataMode.EMBED) for i in ordered],
        index.cache,
    )
    assert len(index.cache) == cached, "an indexed chunk had no cached embedding"
    cfg = index.config["bm25"]
    for node_id, vec in zip(ordered, vectors):
        node, rec = legs.docstore_leaves[node_id], legs.qdrant[node_id]
        text = node.get_content()
        assert legs.bm25[node_id].get_content() == text
        payload_text = json.loads(rec.payload["_node_content"])["text"]
        assert payload_text == text, f"stale text in Qdrant for {node_id}"
        assert rec.payload["doc_id"] == node.ref_doc_id
        dense = np.asarray(rec.dense, dtype=np.float32)
        np.testing.assert_allclose(dense, vec / np.linalg.norm(vec), atol=1e-5, err_msg=f"stale dense vector {node_id}")
        indices, values = rec.sparse
        want = bm25_doc_vector(index.bm25.tokenize(text), cfg["avgdl"], cfg["k1"], cfg["b"])
        assert list(indices) == list(want.indices), f"stale sparse vector {node_id}"
        np.testing.assert_allclose(values, want.values, rtol=1e-6)
    return legs


def qdrant_ids(index: HybridIndex) -> set:
    return set(read_legs(index).qdrant)


class SharedServer:
    """One Qdrant that several HybridIndex objects talk to, as processes share a Qdrant server
    (``qdrant_url=...``): qdrant-client's local mode stands in for it, and closing one index's
    client does not close it. ``fail_upserts`` makes point writes fail (a server going away)."""

    fail_upserts = False

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def upsert(self, *args: Any, **kwargs: Any) -> Any:
        if SharedServer.fail_upserts:
            raise ConnectionError("the Qdrant server went away")
        return self._client.upsert(*args, **kwargs)

    def close(self, **kwargs: Any) -> None:  # the server outlives each index's client
        pass


def share_server(monkeypatch: Any, client: Any) -> Any:
    """Make every ``qdrant_url`` of ``HybridIndex`` reach ``client`` (a ``QdrantClient`` in local
    mode) for the rest of the test; returns ``client``."""
    from llama_index_retrieval_kit.indices import hybrid_index

    monkeypatch.setattr(hybrid_index, "server_client", lambda url, api_key=None: SharedServer(client))
    monkeypatch.setattr(SharedServer, "fail_upserts", False)
    return client
