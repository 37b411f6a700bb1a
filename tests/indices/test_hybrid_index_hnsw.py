"""HNSW on demand: ``from_documents`` leaves the engine's HNSW index out unless asked
(``build_hnsw=True``), ``HybridIndex.optimize()`` / ``rkit index --hnsw`` build it, and
engine-side search is exact before and close to exact after."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import List

import numpy as np
import pytest
from llama_index.core import Document
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.schema import QueryBundle

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices import hybrid_index as hybrid_index_module

DIM = 384
DOCS = 7_200  # above Edge's indexing threshold for 384-d vectors (about 6,700), so HNSW is built


class HashEmbedding(BaseEmbedding):
    """A deterministic random unit vector per text (seeded by its hash): spread like real
    embeddings, so HNSW has work to do, and free of any model download."""

    @classmethod
    def class_name(cls) -> str:
        return "HashEmbedding"

    @staticmethod
    def _vector(text: str) -> List[float]:
        seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        vec = np.random.default_rng(seed).standard_normal(DIM)
        return (vec / np.linalg.norm(vec)).tolist()

    def _get_text_embedding(self, text: str) -> List[float]:
        return self._vector(text)

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        return [self._vector(t) for t in texts]

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._vector(query)


def documents(n: int) -> List[Document]:
    return [Document(id_=f"doc-{i}", text=f"Clause {i} covers topic{i % 97} and item{i}.", metadata={"part": i % 4}) for i in range(n)]


def top_ids(index: HybridIndex, query: QueryBundle, **options) -> List[str]:
    return [n.node.ref_doc_id for n in index.as_retriever("dense", similarity_top_k=10, **options).retrieve(query)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hnsw") / "index"
    HybridIndex.from_documents(documents(DOCS), folder, embed_model=HashEmbedding()).close()
    return folder


def test_build_leaves_hnsw_out_and_engine_search_is_exact(built: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    query = QueryBundle("topic5 item3", embedding=HashEmbedding._vector("any query"))
    with HybridIndex.load(built, embed_model=HashEmbedding()) as index:
        assert index.store.unindexed_vectors() == DOCS  # every chunk is scanned: no HNSW was built
        monkeypatch.setattr(hybrid_index_module, "PLAIN_SCAN_HINT_VECTORS", 1_000)
        with caplog.at_level(logging.WARNING, logger=hybrid_index_module.__name__):
            index.as_retriever("qdrant_hybrid")
            index.as_retriever("dense", dense_search="qdrant")
        exact = top_ids(index, query)  # the default dense leg: exact cosine in numpy
        assert top_ids(index, query, dense_search="qdrant") == exact  # the engine's scan is exact too
        hints = [r.getMessage() for r in caplog.records if "no HNSW index" in r.getMessage()]
        assert len(hints) == 1 and f"{DOCS} vector(s)" in hints[0] and "index.optimize()" in hints[0]  # once per index object


def test_optimize_builds_hnsw_once_and_it_persists(built: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    folder = tmp_path / "index"
    shutil.copytree(built, folder)
    with HybridIndex.load(folder, embed_model=HashEmbedding()) as index:
        rows = index.dense_matrix().vectors
        near = rows[5] + 0.8 * rows[9] + 0.6 * rows[11]  # three clear neighbours, then near-ties (random vectors)
        query = QueryBundle("topic5 item3", embedding=(near / np.linalg.norm(near)).tolist())
        exact = top_ids(index, query)
        assert index.optimize() is True
        assert index.store.unindexed_vectors() == 0
        assert index.optimize() is False  # nothing left to do
        approx = top_ids(index, query, dense_search="qdrant")
        assert approx[:3] == exact[:3]  # HNSW is approximate: the clear neighbours, in order
        assert top_ids(index, query) == exact  # the default dense leg does not use it
        index.upsert([Document(id_="doc-new", text="A clause added after the HNSW build.")])
        assert index.store.unindexed_vectors() == 1  # new points are scanned until the next optimize()
        with caplog.at_level(logging.WARNING, logger=hybrid_index_module.__name__):
            index.as_retriever("qdrant_hybrid")
        assert not [r for r in caplog.records if "no HNSW index" in r.getMessage()]  # below the hint's size
    with HybridIndex.load(folder, embed_model=HashEmbedding()) as index:
        assert index.store.unindexed_vectors() == 1  # the HNSW segment persisted
        assert len(index) == DOCS + 1


def test_build_hnsw_true_builds_it_before_publishing(tmp_path: Path) -> None:
    with HybridIndex.from_documents(documents(DOCS), tmp_path / "index", embed_model=HashEmbedding(), build_hnsw=True) as index:
        assert index.store.unindexed_vectors() == 0
    with pytest.raises(TypeError, match="build_hnsw must be True or False, got 'yes'"):
        HybridIndex.from_documents(documents(2), tmp_path / "other", embed_model=HashEmbedding(), build_hnsw="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "other").exists()


KILL_CHILD = r"""
import sys
sys.path.insert(0, {repo!r})
from tests.indices.test_hybrid_index_hnsw import HashEmbedding
from llama_index_retrieval_kit.indices import HybridIndex
index = HybridIndex.load({path!r}, embed_model=HashEmbedding())
print("ready", flush=True)
index.optimize()
print("done", flush=True)
"""


@pytest.mark.skipif(__import__("sys").platform == "win32", reason="SIGKILL is POSIX")
def test_kill_during_optimize_leaves_a_working_index(built: Path, tmp_path: Path) -> None:
    """kill -9 at random moments of the HNSW build: the folder reopens with every chunk in every
    leg, engine search still finds the clear neighbours, and optimize() then finishes the job."""
    import os
    import random
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from . import _support

    folder = tmp_path / "index"
    shutil.copytree(built, folder)
    rng = random.Random(3)
    repo = str(Path(__file__).resolve().parents[2])
    outcomes = []
    for trial in range(2):
        child = subprocess.Popen(
            [sys.executable, "-c", KILL_CHILD.format(repo=repo, path=str(folder))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            time.sleep(rng.uniform(0.05, 0.8))  # the build takes 1.5 s or more
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(60)
        with HybridIndex.load(folder, embed_model=HashEmbedding()) as index:
            outcomes.append(index.store.unindexed_vectors())
            assert outcomes[-1] in (0, DOCS), trial  # before or after the build, nothing between
            _support.assert_consistent(index)
            rows = index.dense_matrix().vectors
            near = rows[7] + 0.8 * rows[8]
            query = QueryBundle("q", embedding=(near / np.linalg.norm(near)).tolist())
            assert top_ids(index, query, dense_search="qdrant")[:2] == top_ids(index, query)[:2]
    assert DOCS in outcomes  # at least one kill landed during the build
    with HybridIndex.load(folder, embed_model=HashEmbedding()) as index:
        index.optimize()
        assert index.store.unindexed_vectors() == 0
